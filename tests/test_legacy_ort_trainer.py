"""gradgraph.torch.ort_trainer.ORTTrainer: the legacy onnxruntime.capi.ort_trainer API.

Oracles: torch on a deep copy of the module, float32, rel 1e-5 on losses and weights after 10
optimizer steps (the same math in another order): torch.optim.SGD, torch.optim.AdamW with two
parameter groups (onnxruntime's Adam decays decoupled in the step, weight_decay_mode 0), and
LAMB written out in torch from passes/optimizer/lamb.py's formula; torch's
clip_grad_norm_ where the trainer clips. Most tests give the trainer an ONNX model exported
once (fast); the SGD test goes through the torch module and loss_fn.
"""

from __future__ import annotations

import copy
import io
import json
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from gradgraph.torch import optim  # noqa: E402
from gradgraph.torch.ort_trainer import (  # noqa: E402
    IODescription,
    LossScaler,
    ModelDescription,
    ORTTrainer,
    load_checkpoint,
    save_checkpoint,
)

RTOL = 1e-5
STEPS = 10
LR = IODescription("Learning_Rate", [1], torch.float32)


class Net(torch.nn.Module):
    """An MLP with its loss: ``(loss, logits)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(x)
        return torch.nn.functional.cross_entropy(logits, y), logits


def _desc(outputs: tuple[str, ...] = ("loss", "logits")) -> ModelDescription:
    shapes = {"loss": [], "logits": ["batch", 4]}
    return ModelDescription([IODescription("x", ["batch", 6], torch.float32),
                             IODescription("y", ["batch"], torch.int64, num_classes=4)],
                            [IODescription(o, shapes[o], torch.float32) for o in outputs])


@pytest.fixture(scope="module")
def onnx_net() -> onnx.ModelProto:
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Net(), (torch.zeros(3, 6), torch.zeros(3, dtype=torch.int64)), f, dynamo=False,
                          input_names=["x", "y"], output_names=["loss", "logits"], opset_version=17,
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}, "logits": {0: "batch"}})
    return onnx.load_from_string(f.getvalue())


def _trainer(model: onnx.ModelProto | torch.nn.Module, optimizer: str = "SGDOptimizer",
             attributes: Callable[[str], dict] | None = None, **kwargs) -> ORTTrainer:
    loss_fn = kwargs.pop("loss_fn", None)
    desc = kwargs.pop("model_desc", None) or _desc()
    return ORTTrainer(copy.deepcopy(model), loss_fn, desc, optimizer, attributes, LR, "cpu", **kwargs)


def _batches(count: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8 if i % 2 == 0 else 5, 6, generator=g), torch.randint(0, 4, (8 if i % 2 == 0 else 5,),
                                                                                  generator=g))
            for i in range(count)]


def _assert_weights(trainer: ORTTrainer, ref: torch.nn.Module, rtol: float = RTOL) -> None:
    mine = trainer.state_dict()
    for name, value in ref.state_dict().items():
        np.testing.assert_allclose(mine[name].numpy(), value.numpy(), rtol=rtol, atol=1e-7, err_msg=name)


def _decay(name: str) -> float:
    return 0.0 if name.endswith("bias") else 0.01


def _clip(ref: torch.nn.Module, max_norm: float) -> bool:
    """torch's clip_grad_norm_; whether it clipped (the test must exercise it)."""
    return float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm)) > max_norm


# ---- optimizers against torch ----------------------------------------------------------------
def test_sgd_through_the_torch_module_and_loss_fn_matches_torch():
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    desc = ModelDescription(_desc().inputs, [IODescription("loss", [], torch.float32),
                                             IODescription("logits", ["batch", 4], torch.float32)])
    trainer = _trainer(model, loss_fn=torch.nn.CrossEntropyLoss(), model_desc=desc)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in _batches(STEPS):
        loss, logits = trainer.train_step(x, y, torch.tensor([0.1]))
        opt.zero_grad()
        want = torch.nn.functional.cross_entropy(ref(x), y)
        np.testing.assert_allclose(logits.numpy(), ref(x).detach().numpy(), rtol=RTOL, atol=1e-6)
        want.backward()
        opt.step()
        np.testing.assert_allclose(float(loss), float(want.detach()), rtol=RTOL)
    _assert_weights(trainer, ref)
    assert trainer.global_step_ == STEPS
    assert [(o.domain, o.version) for o in trainer._engine._onnx_model.opset_import] == [("", 14)]  # _opset_version
    fresh = _trainer(model, loss_fn=torch.nn.CrossEntropyLoss(), model_desc=desc)
    fresh.load_state_dict(trainer.state_dict(include_optimizer_state=False))  # before the export: kept
    x, y = _batches(1, seed=5)[0]
    np.testing.assert_allclose(fresh.eval_step(x, y)[1].numpy(), ref(x).detach().numpy(), rtol=RTOL, atol=1e-6)


def test_adam_with_a_per_name_map_matches_torch_adamw(onnx_net):
    """Decay on weights, none on biases; the learning rate by its name; clipping at the
    default max_norm_clip 1.0 (torch's clip_grad_norm_)."""
    seen: list[str] = []

    def attributes(name: str) -> dict:
        seen.append(name)
        return {"alpha": 0.9, "beta": 0.99, "lambda": _decay(name), "epsilon": 1e-6}

    trainer = _trainer(onnx_net, "AdamOptimizer", attributes)
    assert sorted(seen) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    ref = Net()
    named = list(ref.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if _decay(n)], "weight_decay": 0.01},
                             {"params": [p for n, p in named if not _decay(n)], "weight_decay": 0.0}],
                            lr=0.01, betas=(0.9, 0.99), eps=1e-6)
    clipped = []
    for x, y in _batches(STEPS):
        loss, _ = trainer.train_step(x, y, Learning_Rate=torch.tensor([0.01]))
        opt.zero_grad()
        want, _ = ref(x, y)
        want.backward()
        clipped.append(_clip(ref, 1.0))
        opt.step()
        np.testing.assert_allclose(float(loss), float(want.detach()), rtol=RTOL)
    _assert_weights(trainer, ref)
    assert any(clipped)


def _torch_lamb(ref: torch.nn.Module, state: dict, lr: float, decay: Callable[[str], float],
                eps: float = 1e-6) -> None:
    """passes/optimizer/lamb.py's LAMB (no bias correction, onnxruntime's LAMB default)."""
    with torch.no_grad():
        for name, p in ref.named_parameters():
            m, v = state.setdefault(name, (torch.zeros_like(p), torch.zeros_like(p)))
            g = p.grad
            m = m * 0.9 + g * (1 - 0.9)
            v = v * 0.999 + g * g * (1 - 0.999)
            state[name] = (m, v)
            u = m / (v.sqrt() + eps) + p * decay(name)
            w_norm, u_norm = p.norm(), u.norm()
            ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else torch.tensor(1.0)
            p -= lr * ratio * u


def test_lamb_matches_torch_with_max_norm_clip_from_the_map(onnx_net):
    trainer = _trainer(onnx_net, "LambOptimizer",
                       lambda n: {"lambda": _decay(n), "epsilon": 1e-6, "max_norm_clip": 0.2})
    ref, state, clipped = Net(), {}, []
    for x, y in _batches(STEPS):
        loss, _ = trainer.train_step(x, y, torch.tensor([0.02]))
        ref.zero_grad()
        want, _ = ref(x, y)
        want.backward()
        clipped.append(_clip(ref, 0.2))
        _torch_lamb(ref, state, 0.02, _decay)
        np.testing.assert_allclose(float(loss), float(want.detach()), rtol=RTOL)
    _assert_weights(trainer, ref)
    assert any(clipped)  # max_norm_clip 0.2 was applied, not the default 1.0


def test_get_lr_this_step_gives_the_learning_rate_of_global_step(onnx_net):
    asked: list[int] = []

    def schedule(step: int) -> float:
        asked.append(step)
        return 0.2 / (1 + step)

    trainer = _trainer(onnx_net, get_lr_this_step=schedule, global_step=3)
    ref = Net()
    for i, (x, y) in enumerate(_batches(STEPS)):
        trainer.train_step(x, y)  # no learning rate argument
        ref.zero_grad()
        ref(x, y)[0].backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.2 / (1 + 3 + i) * p.grad
    assert asked == list(range(3, 3 + STEPS))
    assert trainer.global_step_ == 3 + STEPS
    _assert_weights(trainer, ref)
    with pytest.raises(ValueError, match="get_lr_this_step"):
        trainer.train_step(*_batches(1)[0], Learning_Rate=torch.tensor([0.1]))


def test_gradient_accumulation_averages_micro_batches(onnx_net):
    trainer = _trainer(onnx_net, "AdamOptimizer", lambda n: {"max_norm_clip": 0.3}, gradient_accumulation_steps=3,
                       enable_grad_norm_clip=False)
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0)
    batches = _batches(3 * STEPS)
    before, norms = trainer.state_dict(include_optimizer_state=False), []
    for i, (x, y) in enumerate(batches):
        loss = trainer.train_step(x, y, torch.tensor([0.01]))
        assert isinstance(loss, list) and len(loss) == 2  # model_desc's outputs at every micro-step
        (ref(x, y)[0] / 3).backward()
        if i % 3 == 2:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), float("inf"))))
            opt.step()
            opt.zero_grad()
        elif i == 0:  # no update before the third micro-batch
            for name, value in before.items():
                np.testing.assert_array_equal(trainer.state_dict()[name].numpy(), value.numpy())
        assert trainer.global_step_ == (i + 1) // 3
    _assert_weights(trainer, ref)
    assert max(norms) > 0.3  # enable_grad_norm_clip=False: max_norm_clip 0.3 would have clipped


def test_frozen_weights_stay_and_the_rest_train_like_torch_whatever_the_call_form(onnx_net):
    trainer = _trainer(onnx_net, frozen_weights=["fc1.weight"])
    ref = Net()
    ref.fc1.weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    lr = torch.tensor([0.1])
    calls = [lambda x, y: trainer.train_step(x, y, lr),  # the documented call forms, one per step
             lambda x, y: trainer.train_step([x, y, lr]),
             lambda x, y: trainer.train_step(x, lr, y=y),
             lambda x, y: trainer.train_step(x=x, y=y, Learning_Rate=lr),
             lambda x, y: [trainer.train_step(x, y, lr, fetches=["logits"])]]
    for i, (x, y) in enumerate(_batches(STEPS)):
        out = calls[i % len(calls)](x, y)
        opt.zero_grad()
        loss, logits = ref(x, y)
        np.testing.assert_allclose(out[-1].numpy(), logits.detach().numpy(), rtol=RTOL, atol=1e-6)
        loss.backward()
        opt.step()
    _assert_weights(trainer, ref)
    np.testing.assert_array_equal(trainer.state_dict()["fc1.weight"].numpy(), Net().fc1.weight.detach().numpy())


def test_eval_step_leaves_the_state_unchanged(onnx_net):
    trainer = _trainer(onnx_net, "AdamOptimizer", None, gradient_accumulation_steps=2)
    batches = _batches(3)
    trainer.train_step(*batches[0], torch.tensor([0.01]))
    trainer.train_step(*batches[1], torch.tensor([0.01]))
    trainer.train_step(*batches[2], torch.tensor([0.01]))  # mid-accumulation
    engine = trainer._engine
    state = engine._session.get_state()
    steps = (trainer.global_step_, trainer.current_step, engine._session.micro_step)
    loss = trainer.eval_step(*batches[0], fetches=["loss"])
    both = trainer.eval_step(*batches[0])
    after = engine._session.get_state()
    assert state.keys() == after.keys()
    for name, value in state.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    assert (trainer.global_step_, trainer.current_step, engine._session.micro_step) == steps
    ref = Net()
    ref.load_state_dict(trainer.state_dict(include_optimizer_state=False))
    with torch.no_grad():
        want, logits = ref(*batches[0])
    np.testing.assert_allclose(float(loss), float(want), rtol=RTOL)
    np.testing.assert_allclose(both[1].numpy(), logits.detach().numpy(), rtol=RTOL, atol=1e-6)
    trainer.eval()  # __call__ follows train() / eval()
    np.testing.assert_allclose(float(trainer(*batches[0])[0]), float(want), rtol=RTOL)


def test_state_dict_round_trip_continues_training_exactly(onnx_net):
    batches = _batches(4)
    first = _trainer(onnx_net, "AdamOptimizer", None, gradient_accumulation_steps=1)
    for x, y in batches[:3]:
        first.train_step(x, y, torch.tensor([0.01]))
    state = first.state_dict()
    assert {"Moment_1_fc1.weight", "Moment_2_fc2.bias", "step", "fc1.weight"} <= set(state)
    assert set(first.state_dict(include_optimizer_state=False)) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    second = _trainer(onnx_net, "AdamOptimizer", None)
    second.load_state_dict(state, strict=True)
    first.train_step(*batches[3], torch.tensor([0.01]))
    second.train_step(*batches[3], torch.tensor([0.01]))
    for name, value in first.state_dict().items():
        np.testing.assert_array_equal(second.state_dict()[name].numpy(), value.numpy(), err_msg=name)
    with pytest.raises(ValueError, match=r"\['Moment_3_fc1.weight'\] are neither weights nor optimizer state"):
        second.load_state_dict({"Moment_3_fc1.weight": state["Moment_1_fc1.weight"]})
    with pytest.raises(ValueError, match="strict=True.*missing"):
        second.load_state_dict({"fc1.weight": state["fc1.weight"]}, strict=True)


def test_legacy_checkpoint_functions_round_trip(onnx_net, tmp_path):
    first = _trainer(onnx_net, "AdamOptimizer", None)
    batches = _batches(3)
    for x, y in batches[:2]:
        first.train_step(x, y, torch.tensor([0.01]))
    save_checkpoint(first, tmp_path, checkpoint_state_dict={"epoch": 2, "note": "warm"})
    assert [p.name for p in tmp_path.iterdir()] == ["ORT_checkpoint.ort.pt"]
    with pytest.warns(RuntimeWarning, match="exists; it is replaced"):
        save_checkpoint(first, tmp_path)
    save_checkpoint(first, tmp_path, checkpoint_state_dict={"epoch": 2})
    second = _trainer(onnx_net, "AdamOptimizer", None)
    assert load_checkpoint(second, tmp_path, strict=True) == {"epoch": 2}
    for trainer in (first, second):
        trainer.train_step(*batches[2], torch.tensor([0.01]))
    for name, value in first.state_dict().items():
        np.testing.assert_array_equal(second.state_dict()[name].numpy(), value.numpy(), err_msg=name)
    with pytest.raises(FileNotFoundError, match="no other.ort.pt"):
        load_checkpoint(second, tmp_path, "other")


# ---- mixed precision -------------------------------------------------------------------------
def test_mixed_precision_returns_all_finite_and_skips_a_bad_step(onnx_net):
    trainer = _trainer(onnx_net, use_mixed_precision=True, gradient_accumulation_steps=2)
    (x, y), (x2, y2) = _batches(2)
    bad = x2.clone()
    bad[0, 0] = float("nan")
    start = {k: v.clone() for k, v in trainer.state_dict(include_optimizer_state=False).items()}
    first = trainer.train_step(x, y, torch.tensor([0.1]), torch.tensor([1024.0]))
    assert len(first) == 2  # mid-accumulation: no all_finite
    loss, logits, all_finite = trainer.train_step(bad, y2, torch.tensor([0.1]), loss_scale=torch.tensor([1024.0]))
    assert all_finite.dtype == torch.bool and not bool(all_finite)
    assert trainer.global_step_ == 0
    for name, value in start.items():
        np.testing.assert_array_equal(trainer.state_dict()[name].numpy(), value.numpy(), err_msg=name)
    for batch in ((x, y), (x2, y2)):
        out = trainer.train_step(*batch, torch.tensor([0.1]), default_loss_scale_input_name=torch.tensor([1024.0]))
    assert bool(out[-1]) and trainer.global_step_ == 1
    ref = Net()
    for batch in ((x, y), (x2, y2)):
        (ref(*batch)[0] / 2).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    _assert_weights(trainer, ref, rtol=2e-3)  # fp16 compute


def test_a_legacy_loss_scaler_is_fed_and_updated(onnx_net):
    scaler = LossScaler("loss_scale", True, loss_scale=float(2 ** 12), up_scale_window=2)
    trainer = _trainer(onnx_net, use_mixed_precision=True, loss_scaler=scaler)
    finite, scales = [], []
    for i, (x, y) in enumerate(_batches(6)):
        if i in (0, 1):  # two bad batches: the scale halves twice
            x = x.clone()
            x[0, 0] = float("inf")
        out = trainer.train_step(x, y, torch.tensor([0.1]))
        scales.append(trainer._engine._session.loss_scale)  # the scale this step ran with
        assert len(out) == 2  # with a loss_scaler, all_finite is not returned
        finite.append(trainer._engine._session.last_step_finite)
    assert finite == [False, False, True, True, True, True]
    assert trainer.global_step_ == 4
    # 2**12 -> 2**11 -> 2**10, doubled after the window of 2 finite steps (the reference's rule);
    # the scale each step ran with is the scaler's at that step
    assert scaler.loss_scale_ == 2.0 ** 11
    assert scales == [2.0 ** 12, 2.0 ** 11, 2.0 ** 10, 2.0 ** 10, 2.0 ** 10, 2.0 ** 11]


def test_gradgraphs_dynamic_loss_scaler_is_kept_by_the_graph(onnx_net):
    scaler = optim.DynamicLossScaler(loss_scale=float(2 ** 12), up_scale_window=2)
    trainer = _trainer(onnx_net, use_mixed_precision=True, loss_scaler=scaler)
    x, y = _batches(1)[0]
    bad = x.clone()
    bad[0, 0] = float("nan")
    assert len(trainer.train_step(bad, y, torch.tensor([0.1]))) == 2  # no loss scale argument, no all_finite
    assert trainer._engine._session.loss_scale == 2.0 ** 11 and trainer.global_step_ == 0
    trainer.train_step(x, y, torch.tensor([0.1]))
    assert trainer.global_step_ == 1


# ---- arguments -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,name", [
    ({"enable_adasum": True}, "enable_adasum"),
    ({"use_memory_efficient_gradient": True}, "use_memory_efficient_gradient"),
    ({"deepspeed_zero_stage": 2}, "deepspeed_zero_stage"),
    ({"training_optimizer_name": "AdagradOptimizer"}, "training_optimizer_name"),
    ({"map_optimizer_attributes": {"alpha": 0.9}}, "map_optimizer_attributes"),
    ({"learning_rate_description": IODescription("x", [1])}, "learning_rate_description"),
    ({"learning_rate_description": IODescription("lr", [2])}, "learning_rate_description"),
    ({"device": "tpu"}, "device"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ({"world_size": 2, "world_rank": 2}, "world_rank"),
    ({"world_size": 0}, "world_size"),
    ({"global_step": -1}, "global_step"),
    ({"get_lr_this_step": 0.1}, "get_lr_this_step"),
    ({"loss_scaler": LossScaler("s", True)}, "loss_scaler"),
    ({"_opset_version": 9}, "_opset_version"),
    ({"_extra_postprocess": "strip"}, "_extra_postprocess"),
    ({"enable_grad_norm_clip": "yes"}, "enable_grad_norm_clip"),
    ({"frozen_weights": "fc1.weight"}, "frozen_weights"),
    ({"optimized_model_filepath": None}, "optimized_model_filepath"),
    ({"use_mixed_precision": 1}, "use_mixed_precision"),
    ({"_use_deterministic_compute": "on"}, "_use_deterministic_compute"),
    ({"model_desc": ModelDescription([], [])}, "model_desc"),
])
def test_refused_arguments_name_themselves(onnx_net, kwargs, name):
    args = {"model": onnx_net, "loss_fn": None, "model_desc": _desc(), "training_optimizer_name": "SGDOptimizer",
            "map_optimizer_attributes": None, "learning_rate_description": LR, "device": "cpu"}
    args.update(kwargs)
    with pytest.raises((ValueError, NotImplementedError), match=name):
        ORTTrainer(**args)


@pytest.mark.parametrize("optimizer,attributes,match", [
    ("AdamOptimizer", lambda n: {"alpha": 0.9, "lamda": 0.01}, r"'lamda' is not an attribute of AdamOptimizer"),
    ("AdamOptimizer", lambda n: {"max_norm_clip": 0.5 if n.endswith("bias") else 1.0}, "'max_norm_clip' differs"),
    ("AdamOptimizer", lambda n: {"alpha": "0.9"}, r"\['alpha'\] must be a float or an int"),
    ("SGDOptimizer", lambda n: {"max_norm_clip": 0.5}, "'max_norm_clip' is not an attribute of SGDOptimizer"),
    ("LambOptimizer", lambda n: {"weight_decay_mode": 1}, "'weight_decay_mode' is not an attribute of Lamb"),
    ("LambOptimizer", lambda n: [0.9], "must return a dict"),
])
def test_bad_attribute_maps_are_refused_naming_the_weight_and_attribute(onnx_net, optimizer, attributes, match):
    with pytest.raises(ValueError, match=match):
        _trainer(onnx_net, optimizer, attributes)


def test_unknown_frozen_weight_and_input_dtype_are_named(onnx_net):
    with pytest.raises(ValueError, match="'fc3.weight' is not a trained weight"):
        _trainer(onnx_net, frozen_weights=["fc3.weight"])
    trainer = _trainer(onnx_net)
    x, y = _batches(1)[0]
    with pytest.raises(ValueError, match="input 'y' has dtype int32; model_desc says int64"):
        trainer.train_step(x, y.int(), torch.tensor([0.1]))
    with pytest.raises(ValueError, match="no learning rate"):
        trainer.train_step(x, y)
    with pytest.raises(ValueError, match="fetches"):
        trainer.train_step(x, y, torch.tensor([0.1]), fetches=["probabilities"])


def test_flags_without_effect_on_one_process_warn(onnx_net):
    with pytest.warns(RuntimeWarning, match="allreduce_post_accumulation=True.*no effect with world_size=1"):
        _trainer(onnx_net, allreduce_post_accumulation=True)


def test_postprocess_in_place_and_optimized_model_file(onnx_net, tmp_path):
    def tag(model: onnx.ModelProto) -> None:  # the legacy contract: edit in place, return None
        model.doc_string = "postprocessed"

    path = tmp_path / "optimized.onnx"
    trainer = _trainer(onnx_net, _extra_postprocess=tag, optimized_model_filepath=str(path))
    assert trainer._engine._onnx_model.doc_string == "postprocessed"
    assert onnx.load(str(path)).graph.node  # onnxruntime's optimized training graph


# ---- data parallel under torchrun -------------------------------------------------------------
def _run(command: list[str], timeout: float = 240.0) -> None:
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # torchrun and its ranks: the group this test started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]


_WORKER = str(Path(__file__).with_name("legacy_trainer_worker.py"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The oracle: one process on the doubled batch (8 rows)."""
    one = tmp_path_factory.mktemp("legacy_dp") / "one"
    _run([sys.executable, _WORKER, str(one), str(STEPS), "8", "0"])
    return one


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1])
def test_two_ranks_under_torchrun_equal_one_process_on_the_doubled_batch(tmp_path, one_process, zero):
    one, two = one_process, tmp_path / "two"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
          _WORKER, str(two), str(STEPS), "4", str(zero), str(tmp_path)])
    single, double = np.load(str(one) + ".npz"), np.load(str(two) + ".npz")
    assert sorted(single.files) == sorted(double.files) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for name in single.files:
        np.testing.assert_allclose(double[name], single[name], rtol=1e-5, atol=1e-7, err_msg=name)
    for run in (one, two):
        assert json.loads(Path(str(run) + ".json").read_text())["global_step"] == STEPS
    files = sorted(p.name for p in tmp_path.glob("*.ort.pt"))
    assert files == (["ORT_checkpoint.ZeRO.0.2.ort.pt", "ORT_checkpoint.ZeRO.1.2.ort.pt"] if zero
                     else ["ORT_checkpoint.ort.pt"])
    if zero:  # the ranks' partitions merged into one process: every weight's moments
        sys.path.insert(0, str(Path(_WORKER).parent))
        from legacy_trainer_worker import make_trainer

        trainer = make_trainer()
        x, y = _batches(1)[0]
        trainer.eval_step(x, y)  # builds
        assert load_checkpoint(trainer, tmp_path) == {"epoch": 3}
        state = trainer.state_dict()
        for name in single.files:
            np.testing.assert_allclose(state[name].numpy(), single[name], rtol=1e-5, atol=1e-7, err_msg=name)
            assert state[f"Moment_1_{name}"].abs().sum() > 0, name
