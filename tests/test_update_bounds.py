"""The update proven finite from bounds (gradgraph.training.update_bounds).

Soundness: for drawn weights, optimizer state, gradients, learning rates and step counts over
60 orders of magnitude, whenever :class:`UpdateProof` says an update is finite, onnxruntime's run
of the same update graph gives finite outputs inside the intervals the proof returns. The oracle
is the update graph itself, run by onnxruntime on the drawn values.

In the session: steps whose update is proven skip the check run and train to the same bits as
steps that run it; state loaded from outside is measured again before the next proof (a stale
bound would let an overflowing update through).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
import pytest
import torch
from _training_models import MLP, OPTIMIZER_CASES, export_training, mlp_batches
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto

import gradgraph
from gradgraph.training.update_bounds import UpdateProof, array_bounds
from passes.optimizer import SGDConfig

CPU = ["CPUExecutionProvider"]
CASES = {"sgd-plain": SGDConfig(), **OPTIMIZER_CASES}
_SESSIONS: dict[tuple[str, int], gradgraph.TrainingSession] = {}
_SHAPES: dict[tuple[str, int], dict[str, tuple[int, ...]]] = {}
_INTS: dict[tuple[str, int], dict[str, np.ndarray]] = {}  # integer inputs other than the step


@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    torch.manual_seed(0)
    feeds = mlp_batches(1)[0]
    return export_training(MLP(), (torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["y"])), ["x", "y"])


def _session(model_bytes: bytes, case: str, fuse_below: int = 0, clip: float | None = None,
             ) -> gradgraph.TrainingSession:
    key = (case, fuse_below)
    if clip is not None or key not in _SESSIONS:
        config = gradgraph.TrainingConfig("loss", CASES[case], update=gradgraph.UpdateOptions(
            fuse_below=fuse_below, max_grad_norm=clip))
        session = gradgraph.TrainingSession(model_bytes, config, providers=CPU)
        if clip is not None:
            return session
        _SESSIONS[key] = session
        shapes: dict[str, tuple[int, ...]] = {}  # of the update's inputs, from one real step
        ints: dict[str, np.ndarray] = {}
        assert session._update is not None
        prove = session._update.prove

        def recording(feeds, step):
            for name, value in feeds.items():
                array = np.array(value.numpy() if isinstance(value, ort.OrtValue) else value)
                shapes[name] = array.shape
                if array.dtype.kind == "i":
                    ints[name] = array
            return prove(feeds, step)

        session._update.prove = recording  # type: ignore[method-assign]
        session.train_step(mlp_batches(1)[0], lr=1e-2)
        _SHAPES[key], _INTS[key] = shapes, ints
    return _SESSIONS[key]


def _feeds(session: gradgraph.TrainingSession, key: tuple[str, int], step: Callable[[str], int],
           exponent: Callable[[str], int], zeros: Callable[[str], bool],
           rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Inputs of the update graph: normal values times 10**exponent(name), a third of them 0
    where zeros(name), second moments non-negative, the step counter step(name)."""
    feeds: dict[str, np.ndarray] = {}
    assert session._split is not None
    for value in session._split.update.graph.input:
        name = value.name
        if name in _INTS[key]:  # shapes the gradient run computes
            feeds[name] = _INTS[key][name]
            continue
        shape = _SHAPES[key][name] if name in _SHAPES[key] else session.store.shape(name)
        if value.type.tensor_type.elem_type == TensorProto.INT64:  # the step counter
            feeds[name] = np.full(shape, step(name), np.int64)
            continue
        array = np.asarray(rng.standard_normal(shape) * 10.0 ** exponent(name))
        if "sq" in name:  # a second moment is a running mean of squares
            array = np.abs(array)
        if zeros(name):
            array.reshape(-1)[: max(1, array.size // 3)] = 0.0
        feeds[name] = array.astype(np.float32)
    return feeds


@pytest.mark.parametrize("fuse_below", [0, 1 << 20], ids=["per-tensor", "fused"])
@pytest.mark.parametrize("case", list(CASES))
@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_proven_update_is_finite_and_inside_its_bounds(model_bytes: bytes, case: str, fuse_below: int,
                                                        data: st.DataObject) -> None:
    session = _session(model_bytes, case, fuse_below)
    assert session._split is not None
    update = session._split.update
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    feeds = _feeds(session, (case, fuse_below), lambda n: data.draw(st.integers(0, 10**7), label=n),
                   lambda n: data.draw(st.integers(-30, 36), label=n),
                   lambda n: data.draw(st.booleans(), label=f"{n} zeros"), rng)
    result = UpdateProof(update).prove({n: array_bounds(a) for n, a in feeds.items()})
    if result is None:
        return
    runner = ort.InferenceSession(update.SerializeToString(), providers=CPU)
    outputs = dict(zip([o.name for o in runner.get_outputs()], runner.run(None, feeds)))
    for name, array in outputs.items():
        if array.dtype.kind != "f":
            continue
        lo, hi = result[name]
        assert np.isfinite(array).all(), f"{name}: proven finite, computed {array}"
        assert lo <= float(array.min()) and float(array.max()) <= hi, (name, (lo, hi), array.min(), array.max())


@pytest.mark.parametrize("fuse_below", [0, 1 << 20], ids=["per-tensor", "fused"])
@pytest.mark.parametrize("case", list(CASES))
def test_ordinary_updates_are_proven_and_overflowing_ones_are_not(model_bytes: bytes, case: str,
                                                                  fuse_below: int) -> None:
    """Weights ~1, moments ~1e-4, gradients ~1e-2, learning rate 1e-3 at step 10: proven (LAMB
    excepted: its trust ratio divides by norms that may be 0). A learning rate of 1e37 with
    gradients ~1e3: not."""
    session = _session(model_bytes, case, fuse_below)
    assert session._split is not None
    proof = UpdateProof(session._split.update)
    rng = np.random.default_rng(0)

    def exponent(name: str) -> int:
        return 0 if name in session.store and "." in name and name.count(".") == 1 else -2

    feeds = _feeds(session, (case, fuse_below), lambda n: 10, exponent, lambda n: False, rng)
    bounds = {n: array_bounds(a) for n, a in feeds.items()}
    bounds[session.names.learning_rate] = (1e-3, 1e-3)
    assert (proof.prove(bounds) is None) == (case == "lamb")
    feeds = _feeds(session, (case, fuse_below), lambda n: 10, lambda n: exponent(n) + 5, lambda n: False, rng)
    bounds = {n: array_bounds(a) for n, a in feeds.items()}  # gradients ~1e3: lr * g ~1e40
    bounds[session.names.learning_rate] = (1e37, 1e37)
    assert proof.prove(bounds) is None


def test_bounds_of_a_known_update() -> None:
    """Interval arithmetic by hand: w - lr * g / (sqrt(v) + eps) with w in [-1, 2], g in
    [-3, 3], v in [0, 4], lr 0.5, eps 0.25 gives [-1 - 6, 2 + 6] (each bound widened by a
    relative 2^-20 per op); v's lower bound 0 without eps is a division by a possible zero."""
    import onnx
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    nodes = [helper.make_node("Sqrt", ["v"], ["r"]), helper.make_node("Add", ["r", "eps"], ["d"]),
             helper.make_node("Div", ["g", "d"], ["q"]), helper.make_node("Mul", ["lr", "q"], ["u"]),
             helper.make_node("Sub", ["w", "u"], ["w_new"])]
    inputs = [helper.make_tensor_value_info(n, f, [4]) for n in ("w", "g", "v")]
    inputs += [helper.make_tensor_value_info(n, f, []) for n in ("lr", "eps")]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("w_new", f, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    proof = UpdateProof(model)
    bounds = {"w": (-1.0, 2.0), "g": (-3.0, 3.0), "v": (0.0, 4.0), "lr": (0.5, 0.5), "eps": (0.25, 0.25)}
    result = proof.prove(bounds)
    assert result is not None
    lo, hi = result["w_new"]
    assert lo == pytest.approx(-7.0, rel=1e-5) and lo <= -7.0
    assert hi == pytest.approx(8.0, rel=1e-5) and hi >= 8.0
    assert proof.prove({**bounds, "eps": (0.0, 0.0)}) is None  # sqrt(v) may be 0
    assert proof.prove({**bounds, "lr": (1e38, 1e38)}) is None  # 6e38 > float32's range
    assert proof.prove({**bounds, "g": (-math.inf, math.inf)}) is None
    onnx.checker.check_model(model)


@pytest.mark.parametrize("case", ["sgd", "adamw", "lamb"])
def test_proven_steps_train_like_checked_steps(model_bytes: bytes, case: str) -> None:
    """SGD and AdamW prove every step at ordinary learning rates (the check run is skipped) and
    end bit-identical to a session that checks every step; LAMB's trust ratio divides by a
    norm that may be 0, so it is checked every step."""
    batches = mlp_batches(6)
    proven = _session(model_bytes, case, clip=1.0)
    checked = _session(model_bytes, case, clip=1.0)
    checked._update.proof = None  # every step checked
    for feeds in batches:
        proven.train_step(feeds, lr=1e-2)
        checked.train_step(feeds, lr=1e-2)
    assert proven.step == checked.step == len(batches)
    assert proven.proven_updates == (0 if case == "lamb" else len(batches))
    assert checked.proven_updates == 0
    for name, value in checked.get_state().items():
        assert np.array_equal(value, proven.get_state()[name]), name


def test_loaded_state_is_measured_before_the_next_proof(model_bytes: bytes) -> None:
    """An exp_avg loaded as 3e38 makes Adam's next update overflow: the bounds from before the
    load would prove it finite; measured again, the step is checked and skipped."""
    session = _session(model_bytes, "adam", clip=1.0)
    batches = mlp_batches(4)
    for feeds in batches[:3]:
        session.train_step(feeds, lr=1e-3)
    assert session.proven_updates == 3
    state = session.get_state()
    moments = [n for n in state if n.endswith("exp_avg")]
    assert moments
    for name in moments:
        state[name] = np.full_like(state[name], 3e38)
    session.load_state(state)
    before = session.get_state()
    session.train_step(batches[3], lr=1e-3)
    assert not session.last_step_finite and session.skipped_steps == 1 and session.proven_updates == 3
    for name, value in before.items():
        assert np.array_equal(value, session.get_state()[name]), name
