"""gradgraph.torch.ORTTrainer: options schema, optimizers, schedulers, state and checkpoints.

Oracles: torch.optim (AdamW for Adam's BEFORE_WEIGHT_UPDATE mode, SGD) on a deep copy of the
module, rel 1e-5 on losses and weights (float32, the same math in another order); the
HuggingFace AdamW formula written out in torch for AFTER_WEIGHT_UPDATE; the reference's
scheduler formulas; a TrainingSession configured by hand on the exported model for LAMB and
Adam on tiny BERT (the same graph and kernels: bit-identical).
"""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
model_zoo = pytest.importorskip("model_zoo")

from gradgraph import GraphTransformerOptions, TrainingConfig, TrainingSession, UpdateOptions  # noqa: E402
from gradgraph.torch import ORTTrainer, ORTTrainerOptions, optim  # noqa: E402
from gradgraph.training.checkpoint import CheckpointError  # noqa: E402
from passes.optimizer import AdamWConfig, LambConfig  # noqa: E402

RTOL = 1e-5
CPU = {"device": {"id": "cpu"}}
DESC = {"inputs": [("x", ["batch", 6]), ("y", ["batch"])],
        "outputs": [("loss", [], True), ("logits", ["batch", 4])]}


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        n = 8 if step % 2 == 0 else 5  # two batch sizes: the symbolic "batch" axis
        out.append((torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)))
    return out


def _trainer(config: optim._OptimizerConfig, options: dict | None = None, model=None) -> ORTTrainer:
    return ORTTrainer(model or _mlp(), DESC, config, torch.nn.CrossEntropyLoss(),
                      ORTTrainerOptions({**CPU, **(options or {})}))


def _assert_weights(trainer: ORTTrainer, ref: torch.nn.Module, rtol: float = RTOL) -> None:
    mine = trainer.state_dict(pytorch_format=True)
    for name, value in ref.state_dict().items():
        np.testing.assert_allclose(mine[name].numpy(), value.numpy(), rtol=rtol, atol=1e-7, err_msg=name)


# ---- options -----------------------------------------------------------------------------
@pytest.mark.parametrize("options,path", [
    ({"batch": {"gradient_accumulation_steps": 0}}, "batch.gradient_accumulation_steps"),
    ({"batch": {"gradient_accumulation_steps": 2.5}}, "batch.gradient_accumulation_steps"),
    ({"batch": {"gradient_acumulation_steps": 2}}, "batch.gradient_acumulation_steps"),
    ({"device": {"mem_limit": -1}}, "device.mem_limit"),
    ({"device": {"id": "tpu"}}, "device.id"),
    ({"device": {"id": "cuda:x"}}, "device.id"),
    ({"device": {3: "cpu"}}, "device"),
    ({"distributed": {"deepspeed_zero_optimization": {"stage": 2}}},
     "distributed.deepspeed_zero_optimization.stage"),
    ({"distributed": {"pipeline_parallel": {"sliced_axes": {"a": "x"}}}},
     "distributed.pipeline_parallel.sliced_axes.a"),
    ({"mixed_precision": {"enabled": "yes"}}, "mixed_precision.enabled"),
    ({"mixed_precision": {"loss_scaler": 2.0}}, "mixed_precision.loss_scaler"),
    ({"lr_scheduler": "linear"}, "lr_scheduler"),
    ({"graph_transformer": {"propagate_cast_ops_config": {"strategy": "SIDEWAYS"}}},
     "graph_transformer.propagate_cast_ops_config.strategy"),
    ({"graph_transformer": {"number_recompute_layers": -1}}, "graph_transformer.number_recompute_layers"),
    ({"utils": {"frozen_weights": "fc.weight"}}, "utils.frozen_weights"),
    ({"utils": {"frozen_weights": [3]}}, "utils.frozen_weights[0]"),
    ({"debug": {"graph_save_paths": {"model_with_gradient_graph_path": None}}},
     "debug.graph_save_paths.model_with_gradient_graph_path"),
    ({"_internal_use": {"onnx_opset_version": 11}}, "_internal_use.onnx_opset_version"),
    ({"_internal_use": {"extra_postprocess": 1}}, "_internal_use.extra_postprocess"),
    ({"utils": 3}, "utils"),
    ({"batchsize": 3}, "batchsize"),
])
def test_invalid_options_name_their_key_path(options, path):
    with pytest.raises(ValueError, match=f"'{path}'".replace("[", r"\[").replace("]", r"\]")):
        ORTTrainerOptions(options)


@pytest.mark.parametrize("options", [[1], "batch", 3])
def test_options_that_are_not_a_dict_are_a_value_error(options):
    with pytest.raises(ValueError, match="takes a dict of options"):
        ORTTrainerOptions(options)


def test_option_defaults_read_as_attributes():
    opts = ORTTrainerOptions({"batch": {"gradient_accumulation_steps": 4},
                              "graph_transformer": {"propagate_cast_ops_config": {"propagate_cast_ops_level": 2}}})
    assert opts.batch.gradient_accumulation_steps == 4
    assert opts.mixed_precision.enabled is False and opts.mixed_precision.loss_scaler is None
    assert opts.graph_transformer.propagate_cast_ops_config.level == 2  # long form accepted
    assert opts.utils.grad_norm_clip is True and opts.utils.frozen_weights == []
    assert opts.distributed.pipeline_parallel.pipeline_parallel_size == 1
    with pytest.raises(AttributeError, match="batch.size"):
        _ = opts.batch.size


@pytest.mark.parametrize("options", [{"distributed": {"horizontal_parallel_size": 2}},
                                     {"utils": {"memory_efficient_gradient": True}}])
def test_unimplemented_options_are_refused_by_name(options):
    with pytest.raises(NotImplementedError, match=next(iter(options))):
        _trainer(optim.SGDConfig(), options)


@pytest.mark.parametrize("desc,match", [
    ({"inputs": [("x", ["batch", 6])], "outputs": [("loss", [])]}, "exactly one output"),
    ({"inputs": [("x", ["batch", 6])], "outputs": [("a", [], True), ("b", [], True)]}, "exactly one output"),
    ({"inputs": [("x", "batch")], "outputs": [("loss", [], True)]}, "shape"),
    ({"inputs": [("x", [-1])], "outputs": [("loss", [], True)]}, "shape"),
    ({"inputs": [("x", [1])]}, "model_desc must be a dict"),
])
def test_invalid_model_desc(desc, match):
    with pytest.raises(ValueError, match=match):
        ORTTrainer(_mlp(), desc, optim.SGDConfig(), options=CPU)


def test_inputs_unlike_model_desc_are_named():
    """Inputs whose rank, fixed size or symbolic size disagrees with model_desc: a ValueError
    naming the input (was torch's matmul error from inside the export)."""
    trainer = _trainer(optim.SGDConfig(lr=0.1))
    y = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input 'x' has shape \[4, 5\]; model_desc says \['batch', 6\] "
                                         r"\(axis 1 must be 6\)"):
        trainer.train_step(torch.randn(4, 5), y)
    with pytest.raises(ValueError, match=r"input 'x' has shape \[4, 6, 1\] \(rank 3\)"):
        trainer.train_step(torch.randn(4, 6, 1), y)
    with pytest.raises(ValueError, match=r"input 'y' has 'batch' = 3 \(axis 0\) but input 'x' has 'batch' = 4"):
        trainer.train_step(torch.randn(4, 6), y[:3])


def test_optimizer_config_checks():
    with pytest.raises(ValueError, match="'lr' is not supported inside a parameter group"):
        optim.AdamConfig([{"params": ["0.weight"], "lr": 0.1}])
    with pytest.raises(ValueError, match="does not have"):
        optim.AdamConfig([{"params": ["0.weight"], "ratio_min": 0.1}])
    with pytest.raises(ValueError, match="'alpha'"):
        optim.LambConfig(alpha=1.5)
    with pytest.raises(ValueError, match="empty list"):
        optim.SGDConfig([{"params": ["0.weight"], "lr": 0.1}])
    trainer = _trainer(optim.AdamConfig([{"params": ["0.wieght"], "lambda_coef": 0.0}]))
    with pytest.raises(ValueError, match="did you mean '0.weight'"):
        trainer.train_step(*_batches(1)[0])


# ---- training against torch --------------------------------------------------------------
def test_adam_trains_like_torch_adamw_with_groups_and_dynamic_batch():
    """BEFORE_WEIGHT_UPDATE decay is torch's AdamW; a group turns decay off for the biases."""
    groups = [{"params": ["0.bias", "2.bias"], "lambda_coef": 0.0}]
    trainer = _trainer(optim.AdamConfig(groups, lr=1e-2, lambda_coef=0.05),
                       {"utils": {"grad_norm_clip": False}})
    ref = _mlp()
    params = dict(ref.named_parameters())
    opt = torch.optim.AdamW([{"params": [params["0.weight"], params["2.weight"]]},
                             {"params": [params["0.bias"], params["2.bias"]], "weight_decay": 0.0}],
                            lr=1e-2, weight_decay=0.05)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(_batches(10)):
        loss, logits = trainer.train_step(x, y)
        opt.zero_grad()
        expected = loss_fn(ref(x), y)
        expected.backward()
        opt.step()
        np.testing.assert_allclose(float(loss), float(expected), rtol=RTOL, err_msg=f"step {step}")
        assert list(logits.shape) == [len(x), 4]
    _assert_weights(trainer, ref)
    assert trainer._train_step_info.optimization_step == 10


def test_adam_after_update_is_huggingface_adamw():
    lr, wd, b1, b2, eps = 1e-2, 0.1, 0.9, 0.999, 1e-8
    trainer = _trainer(optim.AdamConfig(lr=lr, lambda_coef=wd,
                                        weight_decay_mode=optim.AdamConfig.DecayMode.AFTER_WEIGHT_UPDATE),
                       {"utils": {"grad_norm_clip": False}})
    ref = _mlp()
    state = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in ref.named_parameters()}
    for t, (x, y) in enumerate(_batches(6), start=1):
        trainer.train_step(x, y)
        ref.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                m, v = state[name]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                step = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                p.sub_(step * m / (v.sqrt() + eps))
                p.sub_(lr * wd * p)
    _assert_weights(trainer, ref)


def test_sgd_with_a_scheduler_and_frozen_weights_trains_like_torch():
    total = 8
    scheduler = optim.LinearWarmupLRScheduler(total_steps=total, warmup=0.25)
    trainer = _trainer(optim.SGDConfig(lr=0.1), {"lr_scheduler": scheduler,
                                                 "utils": {"frozen_weights": ["0.weight"]}})
    ref = _mlp()
    ref[0].weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for step, (x, y) in enumerate(_batches(total)):
        trainer.train_step(x, y)
        for group in opt.param_groups:  # the reference formula at optimization_step = step
            group["lr"] = 0.1 * (step / 2 if step < 2 else max(0.0, (total - step) / (total - 2)))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
        assert scheduler.get_last_lr() == [pytest.approx(opt.param_groups[0]["lr"])]
    _assert_weights(trainer, ref)
    np.testing.assert_array_equal(trainer.state_dict(pytorch_format=True)["0.weight"].numpy(),
                                  _mlp()[0].weight.detach().numpy())


def test_batch_norm_running_statistics_follow_torch():
    """A train-mode BatchNorm: batch statistics in the forward, and running mean and (unbiased,
    as torch's) running variance after each step equal to torch's, with two batch sizes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16, momentum=0.3),
                                torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    trainer = _trainer(optim.SGDConfig(lr=0.1), model=model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in _batches(4):
        loss = trainer.train_step(x, y)[0]
        opt.zero_grad()
        ref_loss = torch.nn.functional.cross_entropy(ref(x), y)
        ref_loss.backward()
        opt.step()
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=RTOL)
    mine = trainer.state_dict(pytorch_format=True)
    for name, value in ref.state_dict().items():  # running_mean, running_var, num_batches_tracked
        np.testing.assert_allclose(mine[name].numpy(), value.numpy(), rtol=RTOL, atol=1e-7, err_msg=name)
    assert int(mine["1.num_batches_tracked"]) == 4  # counted on the host, one per training forward
    assert float(ref[1].running_var.max()) != pytest.approx(1.0)  # the statistics moved
    # eval: the running statistics, not the batch's
    trainer_eval = trainer.eval_step(x, y)
    ref.eval()
    np.testing.assert_allclose(float(trainer_eval[0]), float(torch.nn.functional.cross_entropy(ref(x), y)),
                               rtol=RTOL)


@pytest.mark.parametrize("make,formula", [
    (lambda: optim.ConstantWarmupLRScheduler(100, warmup=0.1), lambda s: min(s / 10, 1.0)),
    (lambda: optim.CosineWarmupLRScheduler(100, warmup=0.1),
     lambda s: s / 10 if s < 10 else max(0.0, 0.5 * (1 + math.cos(math.pi * (s - 10) / 90)))),
    (lambda: optim.LinearWarmupLRScheduler(100, warmup=0.1),
     lambda s: s / 10 if s < 10 else max(0.0, (100 - s) / 90)),
    (lambda: optim.PolyWarmupLRScheduler(100, lr_end=1e-4, power=2.0, warmup=0.1),
     lambda s: s / 10 if s < 10 else 1e-4 / 0.5 if s > 100
     else ((0.5 - 1e-4) * (1 - (s - 10) / 90) ** 2 + 1e-4) / 0.5),
])
def test_schedulers_follow_the_reference_formulas(make, formula):
    scheduler = make()
    info = optim.TrainStepInfo(optim.SGDConfig(lr=0.5))
    for step in (0, 1, 5, 10, 11, 50, 99, 100, 120):
        info.optimization_step = step
        assert scheduler.get_lr(info)[0] == pytest.approx(0.5 * formula(step), rel=1e-12, abs=1e-15)


def test_scheduler_arguments_are_checked():
    with pytest.raises(ValueError, match="total_steps"):
        optim.LinearWarmupLRScheduler(0)
    with pytest.raises(ValueError, match="warmup"):
        optim.CosineWarmupLRScheduler(10, warmup=1.5)


def test_gradient_accumulation_counts_optimizer_steps():
    trainer = _trainer(optim.SGDConfig(lr=0.1), {"batch": {"gradient_accumulation_steps": 2}})
    before = trainer.state_dict(pytorch_format=True) if trainer._session else None
    assert before is None  # built on the first step
    for x, y in _batches(3):
        trainer.train_step(x, y)
    assert trainer._train_step_info.step == 3
    assert trainer._train_step_info.optimization_step == 1
    assert trainer.state_dict()["train_step_info"]["micro_step"] == 1


def test_a_non_finite_loss_warns_and_skips_the_update():
    trainer = _trainer(optim.SGDConfig(lr=0.1))
    x, y = _batches(1)[0]
    trainer.train_step(x, y)
    before = trainer.state_dict(pytorch_format=True)
    with pytest.warns(RuntimeWarning, match="not finite"):
        trainer.train_step(torch.full_like(x, float("nan")), y)
    assert trainer._train_step_info.all_finite is False
    after = trainer.state_dict(pytorch_format=True)
    for name in before:
        np.testing.assert_array_equal(after[name].numpy(), before[name].numpy())


def test_inputs_by_name_eval_step_and_check_model_export(tmp_path):
    trainer = _trainer(optim.SGDConfig(lr=0.1), {"debug": {"check_model_export": True}})
    x, y = _batches(1)[0]
    trainer.train_step(y=y, x=x)
    loss, logits = trainer.eval_step(x, y)
    ref = _mlp()
    with torch.no_grad():
        for (name, p) in ref.named_parameters():
            p.copy_(trainer.state_dict(pytorch_format=True)[name])
        np.testing.assert_allclose(logits.numpy(), ref(x).numpy(), rtol=RTOL, atol=1e-6)
    with pytest.raises(ValueError, match="'z' is not in model_desc"):
        trainer.train_step(x, y, z=1)
    with pytest.raises(ValueError, match=r"missing"):
        trainer.train_step(x)


# ---- state, checkpoints, files ----------------------------------------------------------
def _losses(trainer: ORTTrainer, batches) -> list[float]:
    return [float(trainer.train_step(x, y)[0]) for x, y in batches]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_checkpoint_continues_bit_identically(tmp_path, accumulate):
    options = {"batch": {"gradient_accumulation_steps": accumulate}}
    batches = _batches(7)
    first = _trainer(optim.LambConfig(lr=1e-2, lambda_coef=0.01), options)
    _losses(first, batches[:3])  # mid-accumulation when accumulate=2
    path = tmp_path / "ckpt"
    first.save_checkpoint(path, {"epoch": 3})
    with pytest.raises(FileExistsError, match="exists"):
        first.save_checkpoint(path)
    expected = _losses(first, batches[3:])

    second = _trainer(optim.LambConfig(lr=1e-2, lambda_coef=0.01), options, model=_mlp(seed=5))
    assert second.load_checkpoint(path) == {"epoch": 3}  # before the first step: applied at build
    assert _losses(second, batches[3:]) == expected
    mine, ref = second.state_dict(), first.state_dict()
    for name, value in ref["model"]["full_precision"].items():
        np.testing.assert_array_equal(mine["model"]["full_precision"][name], value)
    assert mine["train_step_info"] == ref["train_step_info"]


def test_checkpoint_carries_num_batches_tracked(tmp_path):
    def bn_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 4))

    batches = _batches(5)
    first = _trainer(optim.SGDConfig(lr=0.1), model=bn_model())
    _losses(first, batches[:3])
    first.save_checkpoint(tmp_path / "ckpt")
    second = _trainer(optim.SGDConfig(lr=0.1), model=bn_model())
    second.load_checkpoint(tmp_path / "ckpt")
    assert _losses(second, batches[3:]) == _losses(first, batches[3:])
    for trainer in (first, second):
        assert int(trainer.state_dict(pytorch_format=True)["1.num_batches_tracked"]) == 5


def test_num_batches_tracked_counts_only_the_norms_torch_counts(tmp_path):
    """A frozen eval-mode BatchNorm and one the forward never calls keep 0, as in torch; a
    refused checkpoint load leaves the counters as they were."""
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.bn, self.live = torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.BatchNorm1d(16)
            self.unused, self.out = torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.out(torch.tanh(self.live(self.bn(self.fc(x)))))

    torch.manual_seed(0)
    model = Net()
    model.bn.eval()
    trainer = _trainer(optim.SGDConfig(lr=0.1), model=model)
    _losses(trainer, _batches(3))
    counts = {k: int(v) for k, v in trainer.state_dict(pytorch_format=True).items() if k.endswith("tracked")}
    assert counts == {"bn.num_batches_tracked": 0, "live.num_batches_tracked": 3, "unused.num_batches_tracked": 0}
    trainer.save_checkpoint(tmp_path / "ckpt")
    other = _trainer(optim.AdamConfig(lr=0.1), model=Net())
    with pytest.raises(CheckpointError, match="holds SGDOptimizer state"):
        other.load_checkpoint(tmp_path / "ckpt")
    assert int(other._torch_model.live.num_batches_tracked) == 0


@pytest.mark.parametrize("route", ["state_dict", "checkpoint"])
@pytest.mark.parametrize("when", ["before the first step", "after a step"])
def test_frozen_weights_are_part_of_the_saved_state(tmp_path, route, when):
    """utils.frozen_weights are constants of the training graph; state_dict() and checkpoints
    left them out, so a trainer of another initialization resumed with its own frozen weights
    (other losses, silently). They are saved and loaded, before or after the first step."""
    options = {"utils": {"frozen_weights": ["0.weight"]}}
    batches = _batches(6)
    first = _trainer(optim.AdamConfig(lr=1e-2), options)
    _losses(first, batches[:3])
    assert "0.weight" in first.state_dict()["model"]["full_precision"]
    path = tmp_path / "ckpt"
    first.save_checkpoint(path)
    state = first.state_dict()
    expected = _losses(first, batches[3:])
    second = _trainer(optim.AdamConfig(lr=1e-2), options, model=_mlp(seed=5))
    if when == "after a step":
        _losses(second, batches[:1])
    if route == "state_dict":
        second.load_state_dict(state)
    else:
        second.load_checkpoint(path)
    assert _losses(second, batches[3:]) == expected


class _TiedLM(torch.nn.Module):
    """A tied embedding / output weight and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.fc = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(2.0), persistent=False)

    def forward(self, ids):
        return self.head(torch.tanh(self.fc(self.emb(ids))) * self.scale).reshape(-1, 10)


class _TiedLoss(torch.nn.Module):
    def forward(self, logits, ids):
        return torch.nn.functional.cross_entropy(logits, ids.reshape(-1))


_TIED_DESC = {"inputs": [("ids", ["batch", 5]), ("target", ["batch", 5])],
              "outputs": [("loss", [], True), ("logits", ["n", 10])]}


def test_pytorch_format_state_loads_strictly_into_the_module():
    """state_dict(pytorch_format=True) has the module's own state_dict() keys (a tied weight
    under both names, no non-persistent buffer): a fresh module loads it with strict=True and
    computes the trainer's eval loss."""
    torch.manual_seed(0)
    ids = torch.randint(0, 10, (4, 5))
    trainer = ORTTrainer(_TiedLM(), _TIED_DESC, optim.AdamConfig(lr=1e-2), _TiedLoss(), ORTTrainerOptions(CPU))
    for _ in range(2):
        trainer.train_step(ids, ids)
    fresh = _TiedLM()
    state = trainer.state_dict(pytorch_format=True)
    assert sorted(state) == sorted(fresh.state_dict())
    fresh.load_state_dict(state)  # strict
    loss, _ = trainer.eval_step(ids, ids)
    with torch.no_grad():
        np.testing.assert_allclose(float(_TiedLoss()(fresh(ids), ids)), float(loss), rtol=1e-5)


@pytest.mark.parametrize("name", ["emb.weight", "head.weight"])
def test_a_tied_weight_answers_to_each_of_its_names(name):
    """torch's named_parameters() calls the tied weight ``emb.weight``; the graph may hold it as
    ``head.weight``: frozen_weights and a parameter group take either name."""
    torch.manual_seed(0)
    ids = torch.randint(0, 10, (4, 5))
    frozen = ORTTrainer(_TiedLM(), _TIED_DESC, optim.SGDConfig(lr=0.5), _TiedLoss(),
                        ORTTrainerOptions({**CPU, "utils": {"frozen_weights": [name]}}))
    before = {n: p.detach().clone() for n, p in frozen._torch_model.named_parameters()}
    frozen.train_step(ids, ids)
    state = frozen.state_dict(pytorch_format=True)
    assert torch.equal(state["emb.weight"], before["emb.weight"])  # frozen under either name
    assert not torch.equal(state["fc.weight"], before["fc.weight"])  # the others trained
    grouped = ORTTrainer(_TiedLM(), _TIED_DESC, optim.AdamConfig([{"params": [name], "lambda_coef": 0.5}], lr=1e-2),
                         _TiedLoss(), ORTTrainerOptions(CPU))
    grouped.train_step(ids, ids)  # the group's name resolved (was: "is not a trained weight")


def test_optimizer_config_errors_use_the_reference_names():
    with pytest.raises(ValueError, match=r"AdamConfig: 'alpha' must be"):
        optim.AdamConfig(alpha=1.5)
    with pytest.raises(ValueError, match=r"LambConfig: params\[0\]: 'epsilon' must be"):
        optim.LambConfig([{"params": ["0.weight"], "epsilon": -5.0}])


def test_state_dict_round_trips_and_has_the_reference_layout():
    batches = _batches(5)
    first = _trainer(optim.AdamConfig(lr=1e-2))
    _losses(first, batches[:2])
    state = first.state_dict()
    assert set(state) == {"model", "optimizer", "trainer_options", "train_step_info"}
    assert set(state["optimizer"]["0.weight"]) == {"Moment_1", "Moment_2", "Update_Count"}
    assert int(state["optimizer"]["shared_optimizer_state"]["step"]) == 2
    assert state["trainer_options"]["optimizer_name"] == "AdamOptimizer"
    expected = _losses(first, batches[2:])
    second = _trainer(optim.AdamConfig(lr=1e-2), model=_mlp(seed=9))
    second.train_step(*batches[0])  # built; then overwritten by the state
    second.load_state_dict(state)
    assert _losses(second, batches[2:]) == expected
    bad = {**state, "model": {"full_precision": {**state["model"]["full_precision"], "extra": np.zeros(1)}}}
    with pytest.raises(ValueError, match="extra"):
        second.load_state_dict(bad, strict=True)


def test_weights_only_checkpoint_and_wrong_optimizer(tmp_path):
    trainer = _trainer(optim.AdamConfig(lr=1e-2))
    _losses(trainer, _batches(2))
    trainer.save_checkpoint(tmp_path / "w", include_optimizer_states=False)
    trainer.save_checkpoint(tmp_path / "full")
    other = _trainer(optim.LambConfig(lr=1e-2), model=_mlp(seed=3))
    other.train_step(*_batches(1)[0])
    with pytest.raises(ValueError, match="AdamOptimizer"):
        other.load_checkpoint(tmp_path / "full")
    other.load_checkpoint(tmp_path / "w")
    mine = other.state_dict(pytorch_format=True)
    for name, value in trainer.state_dict(pytorch_format=True).items():
        np.testing.assert_array_equal(mine[name].numpy(), value.numpy())


def test_save_as_onnx_and_an_onnx_model(tmp_path):
    trainer = _trainer(optim.SGDConfig(lr=0.1))
    with pytest.raises(RuntimeWarning):
        trainer.save_as_onnx(tmp_path / "m.onnx")
    x, y = _batches(1)[0]
    trainer.train_step(x, y)
    trainer.save_as_onnx(tmp_path / "m.onnx")
    saved = onnx.load(tmp_path / "m.onnx")
    onnx.checker.check_model(saved)
    assert {"0.weight", "2.bias"} <= {i.name for i in saved.graph.initializer}

    # the exported forward model, trained as an ONNX model (loss flagged in model_desc)
    forward = trainer._onnx_model
    onnx_trainer = ORTTrainer(forward, DESC, optim.SGDConfig(lr=0.1), options=CPU)
    torch_trainer = _trainer(optim.SGDConfig(lr=0.1))
    for x, y in _batches(3):
        a, b = onnx_trainer.train_step(x, y)[0], torch_trainer.train_step(x, y)[0]
        assert float(a) == float(b)
    with pytest.raises(ValueError, match="must match the ONNX model's inputs"):
        ORTTrainer(forward, {"inputs": [("y", ["batch"]), ("x", ["batch", 6])],
                             "outputs": [("loss", [], True)]}, optim.SGDConfig(), options=CPU)


# ---- tiny BERT: LAMB and Adam against the training-graph session -----------------------
def _bert_session(trainer: ORTTrainer, optimizer, clip: float | None) -> TrainingSession:
    """A TrainingSession configured by hand (not from the trainer's options) on the export."""
    params = dict(trainer._torch_model.named_parameters(remove_duplicate=False))
    trained = tuple(n for n in trainer._torch_names if n in params)
    config = TrainingConfig(loss="loss", optimizer=optimizer, weights_to_train=trained,
                            update=UpdateOptions(max_grad_norm=clip),
                            graph_transformer=GraphTransformerOptions(cleanup=True))
    return TrainingSession(trainer._onnx_model, config, providers=["CPUExecutionProvider"])


@pytest.mark.slow
@pytest.mark.parametrize("config,optimizer", [
    (lambda: optim.LambConfig(lr=2e-3, lambda_coef=0.01),
     LambConfig(weight_decay=0.01, bias_correction=False, eps=1e-6)),
    (lambda: optim.AdamConfig(lr=2e-3, lambda_coef=0.01), AdamWConfig(weight_decay=0.01)),
])
def test_tiny_bert_matches_the_training_session(config, optimizer):
    module, batch, names = model_zoo.build("bert", "train_p0")
    desc = {"inputs": [(n, ["batch", "seq"]) for n in names], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(copy.deepcopy(module), desc, config(), options=CPU)
    feeds = {n: t.numpy() for n, t in zip(names, batch)}
    first = float(trainer.train_step(*batch))
    session = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = _bert_session(trainer, optimizer, clip=1.0)
    ours = [first] + [float(trainer.train_step(*batch)) for _ in range(4)]
    theirs = [session.train_step(feeds, lr=2e-3) for _ in range(5)]
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    mine = trainer.state_dict()["model"]["full_precision"]
    for name, value in session.get_model_state()["full_precision"].items():
        np.testing.assert_allclose(mine[name], value, rtol=1e-6, atol=1e-8, err_msg=name)
    assert ours[-1] < ours[0]


def test_training_parameters_adam_decay_is_decoupled_as_in_onnxruntime():
    """onnxruntime's AdamOptimizer: mode 0 decays with the update (torch AdamW), mode 1 after it."""
    from gradgraph import TrainingParameters

    params = TrainingParameters()
    params.loss_output_name = "loss"
    params.optimizer_attributes_map = {"w": {"lambda": 0.01}}  # weight "w" only (issue 35)
    config = params.to_config()
    assert config.optimizer == AdamWConfig(weight_decay=0.0)
    assert [(g.patterns, dict(g.overrides)) for g in config.update.groups] == [(("w",), {"weight_decay": 0.01})]
    params.optimizer_attributes_map = {}
    params.optimizer_int_attributes_map = {"w": {"weight_decay_mode": 1}}
    config = params.to_config()
    assert config.optimizer == AdamWConfig(weight_decay=0.0)
    assert [dict(g.overrides) for g in config.update.groups] == [{"decay_after_update": True}]


def test_mixed_precision_trains_with_a_dynamic_loss_scale():
    scaler = optim.DynamicLossScaler(loss_scale=float(1 << 10), up_scale_window=2)
    trainer = _trainer(optim.AdamConfig(lr=1e-2), {"mixed_precision": {"enabled": True, "loss_scaler": scaler}})
    batches = _batches(6)
    losses = _losses(trainer, batches)
    shared = trainer.state_dict()["optimizer"]["shared_optimizer_state"]
    assert float(shared["loss_scale"]) == 1024 * 2 ** (len(batches) // 2)  # x2 per 2 finite steps
    fp32 = _trainer(optim.AdamConfig(lr=1e-2))
    np.testing.assert_allclose(losses, _losses(fp32, batches), rtol=1e-2)  # fp16 compute


def test_batch_norm_with_cumulative_momentum_is_refused_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8, momentum=None), torch.nn.Linear(8, 4))
    trainer = _trainer(optim.SGDConfig(lr=0.1), model=model)
    with pytest.raises(NotImplementedError, match=r"BatchNorm '1' has momentum=None"):
        _losses(trainer, _batches(1))
