"""gradgraph.torch.ORTModule against plain PyTorch (the oracle: the same module, deep-copied).

Tolerances: losses and parameters rel 1e-5; gradients rel 1e-5 with an absolute floor of
1e-6 x the largest reference gradient magnitude over all parameters (gradients that are zero in
exact arithmetic, such as an attention key bias under softmax, come out as ~1e-12 rounding noise
in both). Parameters after the steps: rel 1e-5, abs 1e-6 (Adam turns such a noise gradient
into an update of up to lr * |g| / (|g| + eps) per step, different noise in each run).
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
model_zoo = pytest.importorskip("model_zoo")

from gradgraph.torch import DebugOptions, ORTModule, ORTModuleTorchModelException  # noqa: E402


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _close_grads(ref: torch.nn.Module, mine: torch.nn.Module, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Gradients equal, ``atol`` times the largest reference gradient as the absolute floor."""
    scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    for (name, p), (_, q) in zip(ref.named_parameters(), mine.named_parameters()):
        if p.grad is None:
            assert q.grad is None or not q.grad.abs().max(), name
            continue
        assert q.grad is not None, f"{name}: no gradient through ORTModule"
        assert q.grad.device == p.device, f"{name}: gradient on {q.grad.device}, parameter on {p.device}"
        np.testing.assert_allclose(_np(q.grad), _np(p.grad), rtol=rtol, atol=atol * scale, err_msg=name)


def _train(name: str, steps: int, optimizer: str, device: str = "cpu", rtol: float = 1e-5,
           atol: float = 1e-6, **options) -> ORTModule:
    """``steps`` steps of the zoo model ``name`` and of ORTModule on a copy, on ``device``:
    losses, gradients, parameters and buffers equal within ``rtol`` / ``atol``. The ORTModule."""
    ref, batch, _ = model_zoo.build(name, "train_p0")
    ref.to(device)
    batch = tuple(t.to(device) for t in batch)
    mine = copy.deepcopy(ref)
    wrapped = ORTModule(mine, **options)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)}[optimizer]
    opt_ref, opt_mine = make(ref.parameters()), make(wrapped.parameters())
    # parameters whose gradient is zero but for rounding (BERT's key bias: softmax ignores what
    # it adds to every score of a query): Adam normalizes that rounding noise into steps of up
    # to lr, whichever the implementation, so their values are compared within lr per step
    noise_only: set[str] = set()
    for step in range(steps):
        opt_ref.zero_grad()
        opt_mine.zero_grad()
        loss_ref = ref(*batch)
        loss_mine = wrapped(*batch)
        assert loss_mine.device == loss_ref.device
        loss_ref.backward()
        loss_mine.backward()
        np.testing.assert_allclose(loss_mine.item(), loss_ref.item(), rtol=rtol, err_msg=f"step {step}")
        _close_grads(ref, mine, rtol, atol)
        scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
        noise_only.update(n for n, p in ref.named_parameters()
                          if p.grad is not None and float(p.grad.abs().max()) <= atol * scale)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
        opt_ref.step()
        opt_mine.step()
    for (pname, p), (_, q) in zip(ref.named_parameters(), mine.named_parameters()):
        lr = opt_ref.param_groups[0]["lr"]
        floor = lr * steps if optimizer == "adamw" and pname in noise_only else atol
        np.testing.assert_allclose(_np(q), _np(p), rtol=rtol, atol=floor, err_msg=pname)
    for (bname, b), (_, c) in zip(ref.named_buffers(), mine.named_buffers()):  # BatchNorm statistics
        np.testing.assert_allclose(_np(c), _np(b), rtol=rtol, atol=atol, err_msg=bname)
    return wrapped


def _train_on_one_graph(name: str, steps: int, optimizer: str) -> None:
    wrapped = _train(name, steps, optimizer)
    assert len(wrapped._engines) == 1, "one signature, one graph"


def test_mlp_trains_like_pytorch():
    _train_on_one_graph("mlp", 10, "sgd")


def test_cnn_with_batch_norm_trains_like_pytorch():
    """Batch statistics in the forward, running statistics written back (unbiased variance)."""
    _train_on_one_graph("cnn", 10, "adamw")


def test_cnn_trains_like_pytorch_with_batch_norm_decomposed(monkeypatch):
    """The graph a CUDA device gets (onnxruntime's CUDA provider has no training-mode
    BatchNormalization kernel: DecomposeTrainingBatchNormPass), run on the CPU."""
    from gradgraph.torch import engine
    from passes.kernels import DecomposeTrainingBatchNormPass

    made = []
    monkeypatch.setattr(engine, "device_rewrites",
                        lambda device: made.append(device) or [DecomposeTrainingBatchNormPass()])
    _train_on_one_graph("cnn", 10, "adamw")
    assert made, "the engine did not ask for the device's rewrites"


@pytest.mark.slow
@pytest.mark.parametrize("name,optimizer", [("bert", "adamw"), ("gpt2", "sgd")])
def test_tiny_transformers_train_like_pytorch(name, optimizer):
    _train_on_one_graph(name, 10, optimizer)


class TwoHeads(torch.nn.Module):
    """Nested inputs and outputs, an integer output, an input that requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x, extra):
        h = torch.tanh(self.lin(x) + extra["shift"])
        return {"hidden": h, "pair": (self.head(h), h.argmax(-1))}


def test_nested_outputs_and_input_gradients():
    torch.manual_seed(0)
    ref = TwoHeads()
    mine = copy.deepcopy(ref)
    wrapped = ORTModule(mine)
    x = torch.randn(5, 4)
    shift = torch.randn(3)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    out_ref = ref(xs[0], {"shift": shift})
    out_mine = wrapped(xs[1], {"shift": shift})
    assert set(out_mine) == {"hidden", "pair"} and isinstance(out_mine["pair"], tuple)
    assert out_mine["pair"][1].dtype == torch.int64
    assert torch.equal(out_mine["pair"][1], out_ref["pair"][1])
    # only one of the two float outputs used: the other's gradient is zero
    (out_ref["pair"][0] ** 2).sum().backward()
    (out_mine["pair"][0] ** 2).sum().backward()
    np.testing.assert_allclose(xs[1].grad.numpy(), xs[0].grad.numpy(), rtol=1e-5, atol=1e-7)
    _close_grads(ref, mine)


def test_eval_mode_runs_forward_only_and_matches():
    ref, batch, _ = model_zoo.build("mlp", "train_p0")
    mine = copy.deepcopy(ref)
    wrapped = ORTModule(mine).eval()
    assert not mine.training
    ref.eval()
    with torch.no_grad():
        np.testing.assert_allclose(float(wrapped(*batch)), float(ref(*batch)), rtol=1e-6)
    engine = next(iter(wrapped._engines.values()))
    assert engine.runner.backward is None
    # eval mode with grad enabled: outputs carry gradients, as in torch
    wrapped(*batch).backward()
    ref(*batch).backward()
    _close_grads(ref, mine)


def test_batch_norm_with_cumulative_momentum_falls_back_with_a_warning():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, momentum=None))
    ref = copy.deepcopy(module)
    wrapped = ORTModule(module)
    x = torch.randn(6, 3)
    with pytest.warns(RuntimeWarning, match="momentum=None"):
        wrapped(x)
    ref(x)
    assert torch.allclose(module[1].running_var, ref[1].running_var)


def test_a_new_input_shape_builds_a_new_graph_and_the_old_one_is_reused():
    torch.manual_seed(0)
    ref = TwoHeads()
    wrapped = ORTModule(copy.deepcopy(ref))
    shift = {"shift": torch.zeros(3)}
    for rows in (5, 7, 5):
        x = torch.randn(rows, 4)
        np.testing.assert_allclose(wrapped(x, shift)["hidden"].detach().numpy(),
                                   ref(x, shift)["hidden"].detach().numpy(), rtol=1e-6, atol=1e-7)
    assert len(wrapped._engines) == 2


def test_module_api_reflects_the_wrapped_module(tmp_path):
    ref, batch, _ = model_zoo.build("mlp", "train_p0")
    wrapped = ORTModule(ref)
    assert wrapped.module is ref
    assert list(wrapped.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in ref.named_parameters()]
    state = {k: v.clone() + 1 for k, v in wrapped.state_dict().items()}
    wrapped.load_state_dict(state)
    assert all(torch.equal(ref.state_dict()[k], v) for k, v in state.items())
    with pytest.raises(ORTModuleTorchModelException):
        wrapped.add_module("other", torch.nn.Linear(1, 1))
    wrapped.train(False)
    assert not ref.training


def test_debug_options_save_the_graphs(tmp_path):
    ref, batch, _ = model_zoo.build("mlp", "train_p0")
    prefix = str(tmp_path / "mlp")
    wrapped = ORTModule(ref, DebugOptions(save_onnx=True, onnx_prefix=prefix))
    wrapped(*batch).backward()
    with torch.no_grad():
        wrapped(*batch)
    ORTModule(model_zoo.build("mlp", "train_p0")[0],
              DebugOptions(save_onnx=True, onnx_prefix=str(tmp_path / "new" / "m")))(*batch)
    assert (tmp_path / "new" / "m_torch_exported_training.onnx").exists()  # the folder is created
    # onnxruntime ORTModule's names, one set per mode; every file a valid model
    stages = [f"{s}_training" for s in ("torch_exported", "optimized_pre_grad", "optimized",
                                       "execution_model_forward", "execution_model_backward")]
    stages += [f"{s}_inference" for s in ("torch_exported", "optimized_pre_grad", "execution_model")]
    for stage in stages:
        onnx.checker.check_model(onnx.load(f"{prefix}_{stage}.onnx"))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == sorted(
        f"mlp_{stage}.onnx" for stage in stages)  # no temp files left
    with pytest.raises(ValueError, match="onnx_prefix"):
        DebugOptions(save_onnx=True)


def test_debug_log_levels(caplog):
    from gradgraph.torch import LogLevel

    assert DebugOptions(log_level="info").level is LogLevel.INFO
    assert DebugOptions(log_level=LogLevel.VERBOSE).ort_severity == 0
    assert DebugOptions().ort_severity == 4  # onnxruntime's warnings and its error line hidden
    for bad in ("LOUD", 7, True):
        with pytest.raises(ValueError, match="log_level"):
            DebugOptions(log_level=bad)
    ref, batch, _ = model_zoo.build("mlp", "train_p0")
    logger = logging.getLogger("gradgraph.torch")
    before = logger.level
    try:
        with caplog.at_level(logging.INFO, logger="gradgraph.torch"):
            ORTModule(ref, DebugOptions(log_level="INFO"))(*batch)
        built = [r.getMessage() for r in caplog.records if "built the training graphs" in r.getMessage()]
        assert len(built) == 1 and "export" in built[0], caplog.text
    finally:
        logger.setLevel(before)


def test_module_methods_delegate_and_conversions_rebuild():
    torch.manual_seed(0)
    inner = TwoHeads()
    wrapped = ORTModule(inner)
    assert [n for n, _ in wrapped.named_modules()] == [n for n, _ in inner.named_modules()]
    assert list(wrapped.children()) == list(inner.children())
    assert wrapped.get_submodule("lin") is inner.lin
    assert wrapped.get_parameter("lin.weight") is inner.lin.weight
    wrapped.register_buffer("scale", torch.ones(1))
    assert wrapped.get_buffer("scale") is inner.scale
    x, shift = torch.randn(5, 4), {"shift": torch.zeros(3)}
    wrapped(x, shift)["hidden"].sum().backward()
    wrapped.zero_grad()
    assert inner.lin.weight.grad is None
    wrapped.double()
    assert inner.lin.weight.dtype == torch.float64 and not wrapped._engines
    out = wrapped(x.double(), {"shift": shift["shift"].double()})
    expected = TwoHeads.forward(inner, x.double(), {"shift": shift["shift"].double()})
    np.testing.assert_allclose(out["hidden"].detach().numpy(), expected["hidden"].detach().numpy(), rtol=1e-12)


class Unexportable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x), "a string output"  # no exporter returns a str


def test_a_failed_build_falls_back_to_pytorch_with_one_warning():
    torch.manual_seed(0)
    module = Unexportable()
    wrapped = ORTModule(module)
    x = torch.ones(2, 3)
    with pytest.warns(RuntimeWarning, match="runs in PyTorch"):
        out = wrapped(x)
    np.testing.assert_allclose(out[0].detach().numpy(), module(x)[0].detach().numpy())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped(x)  # the same signature: no second warning
    with pytest.raises(Exception):  # noqa: B017 - the exporter's own error type
        ORTModule(Unexportable(), fallback="raise")(x)
    with pytest.raises(ValueError, match="fallback"):
        ORTModule(module, fallback="sometimes")


def test_hf_model_with_keyword_inputs_returns_its_model_output():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="eager")
    ref = transformers.BertForMaskedLM(cfg).train()
    mine = copy.deepcopy(ref)
    wrapped = ORTModule(mine, fallback="raise")
    ids = torch.randint(0, 64, (2, 8))
    labels = ids.clone()
    labels[:, ::2] = -100
    kwargs = {"input_ids": ids, "attention_mask": torch.ones(2, 8, dtype=torch.long), "labels": labels}
    out, out_ref = wrapped(**kwargs), ref(**kwargs)
    assert type(out) is type(out_ref) and set(out.keys()) == {"loss", "logits"}
    np.testing.assert_allclose(out.loss.item(), out_ref.loss.item(), rtol=1e-5)
    out.loss.backward()
    out_ref.loss.backward()
    _close_grads(ref, mine)


def test_the_exporters_registry_is_built_once_and_each_export_adds_to_a_copy():
    """ORTModule's exports share one torchlib registry (built once per opset: 1-2 s an export
    before), each call adding its custom translations to a copy of it: the shared one gets
    none, torch's classmethod is restored after each export, and two different modules
    exported one after the other both train like PyTorch."""
    from torch.onnx._internal.exporter import _registration

    from gradgraph.torch import export as export_module

    original = _registration.ONNXRegistry.__dict__["from_torchlib"]
    for width in (5, 6):
        torch.manual_seed(width)
        ref = torch.nn.Sequential(torch.nn.Linear(width, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
        mine = ORTModule(copy.deepcopy(ref))
        x, y = torch.randn(4, width), torch.randint(0, 3, (4,))
        torch.nn.functional.cross_entropy(mine(x), y).backward()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        for p, q in zip(ref.parameters(), mine.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)
        assert _registration.ONNXRegistry.__dict__["from_torchlib"] is original
    assert export_module._TORCHLIB_REGISTRIES, "no registry was cached"
    for registry in export_module._TORCHLIB_REGISTRIES.values():
        assert not any(meta.is_custom for metas in registry.functions.values() for meta in metas)


def test_the_exports_copy_of_the_weights_is_released_after_the_first_run():
    """After a signature's first run the engine's exported ModelProto holds none of the
    module's parameters (the sessions read torch's tensors: the copy was 1x the weights of
    resident memory for the module's lifetime); training goes on equal to PyTorch, and a new
    signature exports afresh."""
    torch.manual_seed(3)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    mine = ORTModule(copy.deepcopy(ref))
    for batch in (4, 4, 7):  # the third call: another signature
        x = torch.randn(batch, 6)
        mine(x).square().sum().backward()
        ref(x).square().sum().backward()
        for p, q in zip(ref.parameters(), mine.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)
    engines = list(mine._engines.values())
    assert engines
    for engine in engines:
        held = set(engine.exported.parameters) | set(engine.exported.buffers)
        assert held and not held & {t.name for t in engine.exported.model.graph.initializer}
