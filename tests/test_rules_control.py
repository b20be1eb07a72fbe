"""Gradients through If: both outcomes, captured weights and intermediates, nesting."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh

from gradgraph.api import build_gradient_graph
from gradgraph.check import gradcheck
from passes.autodiff import GradientError

ROWS, COLS, OUT = 2, 3, 4
OUTCOMES = [True, False]


def _branch(name, nodes, outputs):
    return oh.make_graph(nodes, name, [], [oh.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                           for o in outputs])


def _model(nodes, extra_inputs=(), weights=("W", "V")):
    rng = np.random.default_rng(0)
    inputs = [oh.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, COLS]),
              oh.make_tensor_value_info("c", TensorProto.BOOL, [])]
    inputs += [oh.make_tensor_value_info(n, TensorProto.BOOL, []) for n in extra_inputs]
    inits = [oh.make_tensor(n, TensorProto.FLOAT, [COLS, OUT], rng.standard_normal(COLS * OUT).tolist())
             for n in weights]
    graph = oh.make_graph(nodes, "if_model", inputs,
                          [oh.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=9)


def _feeds(**conds):
    x = np.random.default_rng(1).standard_normal((ROWS, COLS)).astype(np.float32)
    return {"x": x, **{k: np.array(v) for k, v in conds.items()}}


def _assert_ok(model, trained, feeds):
    rows = gradcheck(model, "loss", trained, inputs=feeds)
    assert [r.name for r in rows] == list(trained)
    for row in rows:
        assert row.ok, row


def _two_weight_model():
    """then: tanh(x @ W); else: (x * x) @ V."""
    then_g = _branch("then", [oh.make_node("MatMul", ["x", "W"], ["t1"]),
                              oh.make_node("Tanh", ["t1"], ["t_out"])], ["t_out"])
    else_g = _branch("else", [oh.make_node("Mul", ["x", "x"], ["e1"]),
                              oh.make_node("MatMul", ["e1", "V"], ["e_out"])], ["e_out"])
    return _model([oh.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
                   oh.make_node("Sin", ["y"], ["s"]),
                   oh.make_node("ReduceSum", ["s"], ["loss"], keepdims=0)])


@pytest.mark.parametrize("cond", OUTCOMES)
def test_branches_capture_different_weights(cond):
    model = _two_weight_model()
    _assert_ok(model, ["W", "V", "x"], _feeds(c=cond))
    grad_model = build_gradient_graph(model, "loss", ["W", "V", "x"])
    onnx.checker.check_model(grad_model, full_check=True)


def test_untaken_branch_weight_gets_zero():
    model = _two_weight_model()
    w_grad, v_grad = _gradients(model, ["W", "V"], _feeds(c=True))
    assert np.abs(w_grad).max() > 0
    assert not v_grad.any()


@pytest.mark.parametrize("cond", OUTCOMES)
def test_captured_intermediate_and_two_outputs(cond):
    """Branches read h = relu(x @ W) from outside; the loss uses both If outputs."""
    then_g = _branch("then", [oh.make_node("Mul", ["h", "h"], ["a"]),
                              oh.make_node("Sigmoid", ["h"], ["b"])], ["a", "b"])
    else_g = _branch("else", [oh.make_node("MatMul", ["x", "V"], ["xv"]),
                              oh.make_node("Mul", ["xv", "h"], ["a2"]),
                              oh.make_node("Identity", ["h"], ["b2"])], ["a2", "b2"])
    model = _model([oh.make_node("MatMul", ["x", "W"], ["xw"]),
                    oh.make_node("Tanh", ["xw"], ["h"]),
                    oh.make_node("If", ["c"], ["p", "q"], then_branch=then_g, else_branch=else_g),
                    oh.make_node("Mul", ["p", "q"], ["pq"]),
                    oh.make_node("Add", ["pq", "q"], ["z"]),
                    oh.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)])
    _assert_ok(model, ["W", "V", "x"], _feeds(c=cond))


@pytest.mark.parametrize("cond", OUTCOMES)
def test_only_one_output_reaches_loss(cond):
    then_g = _branch("then", [oh.make_node("MatMul", ["x", "W"], ["a"]),
                              oh.make_node("MatMul", ["x", "V"], ["b"])], ["a", "b"])
    else_g = _branch("else", [oh.make_node("MatMul", ["x", "V"], ["a2"]),
                              oh.make_node("Exp", ["a2"], ["b2"])], ["a2", "b2"])
    model = _model([oh.make_node("If", ["c"], ["p", "q"], then_branch=then_g, else_branch=else_g),
                    oh.make_node("Mul", ["p", "p"], ["pp"]),
                    oh.make_node("ReduceSum", ["pp"], ["loss"], keepdims=0)])
    _assert_ok(model, ["W", "V", "x"], _feeds(c=cond))


@pytest.mark.parametrize("outer", OUTCOMES)
@pytest.mark.parametrize("inner", OUTCOMES)
def test_nested_if(outer, inner):
    """then: inner If (d) over tanh(x @ W) / (x @ V) * h; else: x @ V - h, h read from outside."""
    inner_then = _branch("inner_then", [oh.make_node("MatMul", ["x", "W"], ["i1"]),
                                        oh.make_node("Tanh", ["i1"], ["i_out"])], ["i_out"])
    inner_else = _branch("inner_else", [oh.make_node("MatMul", ["x", "V"], ["j1"]),
                                        oh.make_node("Mul", ["j1", "h"], ["j_out"])], ["j_out"])
    then_g = _branch("then", [oh.make_node("If", ["d"], ["k"], then_branch=inner_then,
                                           else_branch=inner_else),
                              oh.make_node("Mul", ["k", "k"], ["t_out"])], ["t_out"])
    else_g = _branch("else", [oh.make_node("MatMul", ["x", "V"], ["e1"]),
                              oh.make_node("Sub", ["e1", "h"], ["e_out"])], ["e_out"])
    model = _model([oh.make_node("MatMul", ["x", "W"], ["h0"]),
                    oh.make_node("Sin", ["h0"], ["h"]),
                    oh.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
                    oh.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], extra_inputs=["d"])
    _assert_ok(model, ["W", "V", "x"], _feeds(c=outer, d=inner))
    onnx.checker.check_model(build_gradient_graph(model, "loss", ["W", "V", "x"]), full_check=True)


def _gradients(model, trained, feeds):
    grad_model = build_gradient_graph(model, "loss", trained)
    sess = ort.InferenceSession(grad_model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run([f"{n}_grad" for n in trained], feeds)


def test_branch_returning_outer_value_is_refused():
    """A branch output that is an outer value itself (onnxruntime refuses such models too)."""
    then_g = _branch("then", [oh.make_node("Mul", ["h", "h"], ["a"])], ["a"])
    model = _model([oh.make_node("MatMul", ["x", "W"], ["xw"]),
                    oh.make_node("Tanh", ["xw"], ["h"]),
                    oh.make_node("If", ["c"], ["p"], then_branch=then_g, else_branch=_branch("else", [], ["h"])),
                    oh.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)], weights=("W",))
    with pytest.raises(GradientError, match="put an Identity inside the branch"):
        build_gradient_graph(model, "loss", ["W"])


def test_a_loop_with_a_captured_weight_passes_the_gradient_check():
    """The If-era placeholder that asserted Loop had no rule: Loop is now differentiated
    (tests/test_rules_loop_scan.py covers it in depth); a float64 check of this small one."""
    body = oh.make_graph(
        [oh.make_node("Identity", ["cond_in"], ["cond_out"]),
         oh.make_node("MatMul", ["acc", "W"], ["acc_out"])],
        "body",
        [oh.make_tensor_value_info("i", TensorProto.INT64, []),
         oh.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         oh.make_tensor_value_info("acc", TensorProto.FLOAT, None)],
        [oh.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         oh.make_tensor_value_info("acc_out", TensorProto.FLOAT, None)])
    rng = np.random.default_rng(0)
    graph = oh.make_graph(
        [oh.make_node("Constant", [], ["n"], value=oh.make_tensor("n", TensorProto.INT64, [], [2])),
         oh.make_node("Loop", ["n", "c", "x"], ["y"], body=body),
         oh.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)],
        "loop", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, COLS]),
                 oh.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [oh.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [oh.make_tensor("W", TensorProto.FLOAT, [COLS, COLS], rng.standard_normal(COLS * COLS).tolist())])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=9)
    feeds = {"x": rng.standard_normal((ROWS, COLS)).astype(np.float32), "c": np.array(True)}
    rows = gradcheck(model, "loss", ["W", "x"], inputs=feeds)
    assert [r.name for r in rows] == ["W", "x"]
    for row in rows:
        assert row.ok, row
