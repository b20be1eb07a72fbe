"""Holes a review found in the update's proof (gradgraph.training.update_bounds, 9a033e7),
each failing on that commit, fixed since.

Each test states the invariant: whenever ``UpdateProof.prove`` says "finite" (or the session
skips the check run on its word), onnxruntime's run of the update gives only finite float
outputs. The oracle is onnxruntime's run of the same graph; each docstring says what was wrong.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import gradgraph
from gradgraph.training.update_bounds import UpdateProof, array_bounds
from passes.optimizer import AdamConfig, AdamWConfig

CPU = ["CPUExecutionProvider"]
F = T.FLOAT
vi = h.make_tensor_value_info


def _linear_model(dtype: int) -> bytes:
    """loss = sum(w * x): the gradient of w is x, chosen by the test."""
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    graph = h.make_graph(
        [h.make_node("Mul", ["w", "x"], ["p"]), h.make_node("ReduceSum", ["p"], ["s"], keepdims=0),
         h.make_node("Cast", ["s"], ["loss"], to=F)],
        "linear", [vi("x", dtype, [4])], [vi("loss", F, [])],
        initializer=[nh.from_array(np.full([4], 0.5, np_dtype), "w")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    model.ir_version = 9
    return model.SerializeToString()


def _finite_state(session: gradgraph.TrainingSession) -> list[str]:
    return [n for n, v in session.get_state().items() if v.dtype.kind == "f" and not np.isfinite(v).all()]


def test_float16_weights_the_proof_uses_float32_rounding() -> None:
    """A model with float16 weights (not mixed precision) runs its AdamW update in float16.
    The proof widens each bound by 2^-20 relative and 1e-44 absolute (float32's rounding), so
    g*g = 1e-8, which is 0 in float16, keeps a lower bound of 1e-11 in exp_avg_sq's carried
    bound. The next step (gradient 0) divides exp_avg by sqrt(0) + eps (1e-8 is 0 in float16):
    the carried bounds prove it finite, the check is skipped and -inf is written into w.
    (With the proof off, the check run skips that step.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = gradgraph.TrainingSession(_linear_model(T.FLOAT16),
                                            gradgraph.TrainingConfig("loss", AdamWConfig()), providers=CPU)
    for x in (1e-4, 0.0):
        session.train_step({"x": np.full([4], x, np.float16)}, lr=1e-3)
    assert _finite_state(session) == [], f"proven {session.proven_updates} steps, wrote {session.get_state()['w']}"


def test_a_write_through_get_state_views_leaves_the_bounds_stale() -> None:
    """get_state_views() returned writable views of the held buffers: a write through one
    bumped no StateStore version, so the next proof used the carried bounds of the old values,
    skipped the check, and Adam's update of an exp_avg of 3e38 wrote inf into the weight."""
    session = gradgraph.TrainingSession(_linear_model(F), gradgraph.TrainingConfig("loss", AdamConfig()),
                                        providers=CPU)
    feeds = {"x": np.full([4], 0.25, np.float32)}
    for _ in range(2):
        session.train_step(feeds, lr=1e-3)
    assert session.proven_updates == 2
    view = session.get_state_views()["w.exp_avg"]
    with pytest.raises(ValueError, match="read-only"):
        view[...] = 3e38  # the views are read-only now: load_state sets values (and is measured)
    state = session.get_state()
    state["w.exp_avg"][...] = 3e38
    session.load_state(state)
    session.train_step(feeds, lr=1e-3)
    assert _finite_state(session) == [], f"last_step_finite={session.last_step_finite}"
    assert not session.last_step_finite and session.proven_updates == 2


def _proven_yet_not_finite(nodes: list, inputs: list, output: onnx.ValueInfoProto, feeds: dict,
                           opset: int = 18, inits: tuple = ()) -> tuple[object, np.ndarray]:
    graph = h.make_graph(nodes, "g", inputs, [output], initializer=list(inits))
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = 9
    proof = UpdateProof(model).prove({n: array_bounds(np.asarray(v)) for n, v in feeds.items()})
    options = ort.SessionOptions()
    options.log_severity_level = 4
    (out,) = ort.InferenceSession(model.SerializeToString(), options, providers=CPU).run(None, feeds)
    return proof, out


ONE = nh.from_array(np.array([1.0], np.float32), "one")
BIG = nh.from_array(np.array([1e30], np.float32), "big")
RULE_CASES: dict[str, tuple[list, list, dict, int, tuple]] = {
    # Cast returned its input's interval: no rounding to the narrower type (1e-10 is 0 in float16).
    "cast-to-float16-underflow": (
        [h.make_node("Cast", ["x"], ["x16"], to=T.FLOAT16), h.make_node("Cast", ["x16"], ["x32"], to=F),
         h.make_node("Div", ["one", "x32"], ["y"])],
        [vi("x", F, [1])], {"x": np.array([1e-10], np.float32)}, 18, (ONE,)),
    # Cast double -> float: 0.1 and float32(0.1) differ as doubles, are equal as floats.
    "cast-double-to-float-cancels": (
        [h.make_node("Cast", ["x"], ["xf"], to=F), h.make_node("Sub", ["xf", "c"], ["d"]),
         h.make_node("Div", ["one", "d"], ["y"])],
        [vi("x", T.DOUBLE, [1])], {"x": np.array([0.1], np.float64)}, 18,
        (ONE, nh.from_array(np.array([0.1], np.float32), "c"))),
    # Cast int64 -> float above 2^24 rounds.
    "cast-int64-to-float-rounds": (
        [h.make_node("Cast", ["i"], ["f"], to=F), h.make_node("Sub", ["f", "c"], ["d"]),
         h.make_node("Div", ["one", "d"], ["y"])],
        [vi("i", T.INT64, [1])], {"i": np.array([16777217], np.int64)}, 18,
        (ONE, nh.from_array(np.array([16777216.0], np.float32), "c"))),
    # Integer Div truncates (7 / 2 = 3), the rule computed 3.5.
    "integer-div-truncates": (
        [h.make_node("Div", ["i", "two"], ["q"]), h.make_node("Cast", ["q"], ["qf"], to=F),
         h.make_node("Sub", ["qf", "three"], ["d"]), h.make_node("Div", ["one", "d"], ["y"])],
        [vi("i", T.INT32, [1])], {"i": np.array([7], np.int32)}, 18,
        (ONE, nh.from_array(np.array([2], np.int32), "two"), nh.from_array(np.array([3.0], np.float32), "three"))),
    # Integer overflow wraps (int8 100 + 100 = -56): Sqrt of its cast is NaN.
    "integer-add-wraps": (
        [h.make_node("Add", ["i", "i"], ["s"]), h.make_node("Cast", ["s"], ["sf"], to=F),
         h.make_node("Sqrt", ["sf"], ["y"])],
        [vi("i", T.INT8, [1])], {"i": np.array([100], np.int8)}, 18, ()),
    # Cast float -> int8 out of range (200 -> -56).
    "cast-float-to-int8-out-of-range": (
        [h.make_node("Cast", ["x"], ["i"], to=T.INT8), h.make_node("Cast", ["i"], ["f"], to=F),
         h.make_node("Sqrt", ["f"], ["y"])],
        [vi("x", F, [1])], {"x": np.array([200.0], np.float32)}, 18, ()),
    # float8 was not in LIMITS: treated like an integer type, never checked; saturate=0 gives NaN.
    "cast-to-float8-unchecked": (
        [h.make_node("Cast", ["x"], ["e"], to=T.FLOAT8E4M3FN, saturate=0), h.make_node("Cast", ["e"], ["y"], to=F)],
        [vi("x", F, [1])], {"x": np.array([1e4], np.float32)}, 19, ()),
    # ReduceMax of an empty tensor is -inf; the rule passed the input's interval (0, 0).
    "reducemax-of-empty": (
        [h.make_node("ReduceMax", ["x"], ["y"], keepdims=0)],
        [vi("x", F, [0])], {"x": np.zeros([0], np.float32)}, 18, ()),
    # ReduceMean returned its input's interval unwidened: mean of six float32(0.3) != 0.3f, so
    # mean - 0.3f is 'exactly 0' to the proof, -6e-8 in float32, times 1e30 twice: -inf.
    "reducemean-unwidened": (
        [h.make_node("ReduceMean", ["x"], ["m"], keepdims=0), h.make_node("Sub", ["m", "c"], ["d"]),
         h.make_node("Mul", ["d", "big"], ["e"]), h.make_node("Mul", ["e", "big"], ["y"])],
        [vi("x", F, [6])], {"x": np.full([6], 0.3, np.float32)}, 18,
        (BIG, nh.from_array(np.array(0.3, np.float32), "c"))),
    # Clip before opset 11 takes min/max as attributes: the rule passed x's interval [5, 5].
    "clip-opset10-attributes": (
        [h.make_node("Clip", ["x"], ["c"], min=0.0, max=1.0), h.make_node("Sub", ["c", "one"], ["d"]),
         h.make_node("Div", ["one", "d"], ["y"])],
        [vi("x", F, [1])], {"x": np.array([5.0], np.float32)}, 10, (ONE,)),
}


@pytest.mark.parametrize("case", list(RULE_CASES))
def test_interval_rules(case: str) -> None:
    """Interval rules that were not supersets of what onnxruntime computes (see each case)."""
    nodes, inputs, feeds, opset, inits = RULE_CASES[case]
    out_shape = [] if case.startswith("reduce") else [1]
    proof, out = _proven_yet_not_finite(nodes, inputs, vi("y", F, out_shape), feeds, opset, inits)
    assert proof is None or np.isfinite(out).all(), f"proved {proof}, onnxruntime gives {out}"


def test_a_graph_output_that_is_a_graph_input_is_not_checked() -> None:
    """An output no node computes (a graph input passed through) was never checked: with its
    bound unknown prove() still returned a result."""
    graph = h.make_graph([], "g", [vi("x", F, [1])], [vi("x", F, [1])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    result = UpdateProof(model).prove({})
    assert result is None or all(np.isfinite(b) for b in result["x"]), result
