"""Fused optimizer updates (UpdateOptions.fuse_below) and runtime selection of skipped steps
(UpdateOptions.select_in_graph=False).

The oracle of the fused update is the per-tensor update (fuse_below=0), itself checked against
torch.optim and a float64 LAMB in test_training_optimizers.py: 20 steps of both on the same
batches give the same weights and state within rel 1e-6 (float reassociation only), for SGD,
Adam, AdamW and LAMB, with several parameter groups and frozen weights.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from _training_models import OPTIMIZER_CASES, export_training

from gradgraph import TrainingConfig, TrainingSession, UpdateOptions, build_training_artifacts
from passes.marks import STAGE_KEY
from passes.optimizer import AdamWConfig, ParamGroup, SGDConfig
from passes.optimizer.optimizer_pass import VALID_IF_KEY

STEPS = 20
LR = 0.02
RTOL = 1e-6
CPU = ["CPUExecutionProvider"]
CASES = OPTIMIZER_CASES


def _groups(optimizer) -> tuple[ParamGroup, ...]:
    """Biases at half the learning rate without decay; the norm's weight with another momentum
    at twice the rate."""
    momentum = {"momentum": 0.5} if isinstance(optimizer, SGDConfig) else {"beta1": 0.7}
    return (ParamGroup(("*.bias",), {"weight_decay": 0.0}, lr_scale=0.5),
            ParamGroup(("norm.*",), momentum, lr_scale=2.0))


FROZEN = ("fc2.weight", "fc3.bias")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 12)
        self.norm = torch.nn.LayerNorm(12)
        self.fc2 = torch.nn.Linear(12, 10)
        self.fc3 = torch.nn.Linear(10, 4)
        self.fc4 = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(self.norm(self.fc1(x))))
        return torch.nn.functional.cross_entropy(self.fc4(torch.relu(self.fc3(h))), y)


def _model() -> bytes:
    torch.manual_seed(0)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    return export_training(Net(), (x, y), ["x", "y"])


def _batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    return [{"x": rng.standard_normal((8, 6)).astype(np.float32),
             "y": rng.integers(0, 3, 8).astype(np.int64)} for _ in range(n)]


def _config(optimizer, groups=(), **update) -> TrainingConfig:
    names = {"groups": groups, **update}
    return TrainingConfig("loss", optimizer, weights_not_to_train=FROZEN, update=UpdateOptions(**names))


def _optimizer_ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node
            if any(p.key == STAGE_KEY and p.value == "optimizer" for p in n.metadata_props)]


def _assert_same_state(a: TrainingSession, b: TrainingSession) -> None:
    sa, sb = a.get_state(), b.get_state()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        ref = np.asarray(sb[name], np.float64)
        scale = max(float(np.abs(ref).max()), 1e-12)
        np.testing.assert_allclose(np.asarray(sa[name], np.float64), ref, rtol=0, atol=RTOL * scale,
                                   err_msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("clip", [None, 0.1])
def test_fused_update_equals_per_tensor(case: str, clip: float | None) -> None:
    model = _model()
    optimizer = CASES[case]
    fused = TrainingSession(model, _config(optimizer, _groups(optimizer), fuse_below=1 << 20, max_grad_norm=clip),
                            providers=CPU)
    alone = TrainingSession(model, _config(optimizer, _groups(optimizer), fuse_below=0, max_grad_norm=clip),
                            providers=CPU)
    ops = _optimizer_ops(fused.artifacts.train)
    assert "Concat" in ops and "Split" in ops, "the fused graph concatenates its weights"
    # Fewer arithmetic nodes (the layout nodes Reshape / Concat / Split / Constant aside).
    layout = {"Reshape", "Concat", "Split", "Constant", "Identity"}
    assert (sum(op not in layout for op in ops)
            < sum(op not in layout for op in _optimizer_ops(alone.artifacts.train)))
    assert "Concat" not in _optimizer_ops(alone.artifacts.train)
    # The frozen weights stay frozen, the state keeps its per-weight names (checkpoints).
    assert set(fused.artifacts.trained) == set(alone.artifacts.trained)
    assert not set(FROZEN) & set(fused.artifacts.trained)
    before = fused.get_state()
    for feeds in _batches(STEPS):
        la, lb = fused.train_step(feeds, lr=LR), alone.train_step(feeds, lr=LR)
        assert la == pytest.approx(lb, rel=1e-5)
    _assert_same_state(fused, alone)
    after = fused.get_state()
    for name in FROZEN:
        np.testing.assert_array_equal(after[name], before[name])
    assert fused.step == alone.step == STEPS


def test_fused_groups_follow_config_and_dtype() -> None:
    """Weights with different hyper-parameters or learning-rate scales never share a unit: the
    graph has one Concat of weights per group that has several fusable weights."""
    model = _model()
    session = TrainingSession(model, _config(AdamWConfig(), _groups(AdamWConfig())), providers=CPU)
    train = session.artifacts.train
    weights = set(session.artifacts.trained)
    concats = [n for n in train.graph.node if n.op_type == "Concat"
               and any(p.key == STAGE_KEY and p.value == "optimizer" for p in n.metadata_props)]
    producers = {o: n for n in train.graph.node for o in n.output}

    def source(name: str) -> str:
        node = producers.get(name)
        return source(node.input[0]) if node is not None and node.op_type == "Reshape" else name

    weight_sets = [frozenset(source(i) for i in n.input) for n in concats
                   if {source(i) for i in n.input} <= weights]
    by_group = {frozenset(w for w in weights if w.endswith(".bias")),
                frozenset(w for w in weights if w.startswith("norm.") and not w.endswith(".bias")),
                frozenset(w for w in weights if not w.endswith(".bias") and not w.startswith("norm."))}
    assert set(weight_sets) == {g for g in by_group if len(g) > 1}


def test_fuse_below_is_checked() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="fuse_below"):
            UpdateOptions(fuse_below=bad)


def test_runtime_selection_marks_outputs_and_drops_where() -> None:
    model = _model()
    graph_sel = build_training_artifacts(model, _config(AdamWConfig())).train
    runtime = build_training_artifacts(model, _config(AdamWConfig(), select_in_graph=False)).train
    assert "Where" in _optimizer_ops(graph_sel)
    assert "Where" not in _optimizer_ops(runtime)
    marked = {o.name: p.value for o in runtime.graph.output for p in o.metadata_props if p.key == VALID_IF_KEY}
    updated = [o.name for o in runtime.graph.output if o.name.endswith(".out")]
    assert updated and set(marked) == set(updated)
    assert set(marked.values()) == {"step_finite"}
    assert not any(p.key == VALID_IF_KEY for o in graph_sel.graph.output for p in o.metadata_props)


@pytest.mark.parametrize("fuse_below", [0, 1 << 20])
def test_skipped_step_keeps_state_bit_for_bit(fuse_below: int) -> None:
    """A NaN batch: the session (runtime selection) keeps every weight, moment and the step
    counter exactly, then trains on as if the batch had not come."""
    model = _model()
    a = TrainingSession(model, _config(AdamWConfig(), fuse_below=fuse_below), providers=CPU)
    b = TrainingSession(model, _config(AdamWConfig(), fuse_below=fuse_below), providers=CPU)
    batches = _batches(4)
    bad = {"x": np.full((8, 6), np.nan, np.float32), "y": batches[0]["y"]}
    for feeds in batches[:2]:
        a.train_step(feeds, lr=LR)
        b.train_step(feeds, lr=LR)
    before = a.get_state()
    a.train_step(bad, lr=LR)
    assert not a.last_step_finite and a.skipped_steps == 1
    after = a.get_state()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    for feeds in batches[2:]:
        a.train_step(feeds, lr=LR)
        b.train_step(feeds, lr=LR)
    sa, sb = a.get_state(), b.get_state()
    for name in sb:
        np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_finite_check(dtype) -> None:
    """The step's finite flag: NaN or inf anywhere in any value makes it false; large finite
    float16 values whose sum exceeds float16's range do not (their check is exact)."""
    import onnx_ir as ir
    import onnxruntime as ort

    from passes.autodiff.builder import OpBuilder
    from passes.optimizer.optimizer_pass import _all_finite

    b = OpBuilder(17)
    tensor_type = ir.TensorType(ir.DataType.from_numpy(np.dtype(dtype)))
    inputs = [ir.Value(name=f"v{i}", type=tensor_type, shape=ir.Shape([4])) for i in range(2)]
    flag = _all_finite(b, [b.wrap(v) for v in inputs])
    flag.value.name = "finite"
    graph = ir.Graph(inputs, [flag.value], nodes=b.nodes, opset_imports={"": 17})
    proto = ir.to_proto(ir.Model(graph, ir_version=8))
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    big = 6e4 if dtype == np.float16 else 1e30
    cases = [([1, 2, 3, 4], [5, 6, 7, 8], True), ([1, np.nan, 3, 4], [5, 6, 7, 8], False),
             ([1, 2, 3, 4], [5, np.inf, 7, 8], False), ([1, 2, 3, 4], [-np.inf, 6, 7, 8], False),
             ([big, big, big, big], [big, big, big, big], True)]
    for a, c, expected in cases:
        out = session.run(None, {"v0": np.array(a, dtype), "v1": np.array(c, dtype)})[0]
        assert bool(out) is expected, (a, c)


class _RootNet(torch.nn.Module):
    """sqrt(|x * s|): at x = 0 the loss is finite and the gradient of ``s`` is NaN (0 * inf)."""

    def __init__(self) -> None:
        super().__init__()
        self.s = torch.nn.Parameter(torch.ones(6))
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.fc(torch.sqrt(torch.abs(x * self.s))), y)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "lamb"])
@pytest.mark.parametrize("fuse_below", [0, 1 << 20])
def test_non_finite_gradient_or_lr_skips_the_step(optimizer: str, fuse_below: int) -> None:
    """The finite check reads what stands for each update (Adam: the new exp_avg_sq): a NaN
    gradient under a finite loss, or a NaN learning rate, skips the step and keeps the state."""
    torch.manual_seed(0)
    model = export_training(_RootNet(), (torch.randn(8, 6), torch.randint(0, 3, (8,))), ["x", "y"])
    config = TrainingConfig("loss", CASES[optimizer], update=UpdateOptions(fuse_below=fuse_below))
    session = TrainingSession(model, config, providers=CPU)
    good = _batches(1)[0]
    session.train_step(good, lr=LR)
    before = session.get_state()
    zeros = {"x": np.zeros((8, 6), np.float32), "y": good["y"]}
    loss = session.train_step(zeros, lr=LR)
    assert np.isfinite(loss) and not session.last_step_finite
    session.train_step(good, lr=float("nan"))
    assert not session.last_step_finite and session.skipped_steps == 2
    after = session.get_state()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    session.train_step(good, lr=LR)
    assert session.last_step_finite
