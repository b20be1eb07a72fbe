"""Gradients through Scan and Loop: against torch autograd (float64, rtol 1e-7) on an RNN
written with Scan and on trip-count and condition-driven Loops, and against float64
central differences (``fdcheck``) on random shapes, axes, directions and iteration counts.
"""

from __future__ import annotations

import fdcheck
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

from gradgraph.api import build_gradient_graph
from passes.autodiff import GradientError

D = TensorProto.DOUBLE
RTOL = 1e-7
ATOL = 1e-12
B, I, H = 2, 3, 4
LOSS = "loss"


def _vi(name, shape, elem=D):
    return oh.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, inits=(), opset=18, loss=LOSS):
    graph = oh.make_graph(nodes, "model", inputs, [_vi(loss, [])],
                          [nh.from_array(v, k) for k, v in dict(inits).items()])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=9)


def _weighted_loss(value, weight):
    """loss = ReduceSum(value * weight)."""
    return [oh.make_node("Mul", [value, weight], [f"{value}_w"]),
            oh.make_node("ReduceSum", [f"{value}_w"], [f"{value}_sum"], keepdims=0)]


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _gradients(model, wrt, feeds, extra=()):
    """The gradient graph run in onnxruntime: ``extra`` forward values, then the gradients."""
    grad_model = build_gradient_graph(model, LOSS, list(wrt))
    onnx.checker.check_model(grad_model, full_check=True)
    out = _session(grad_model).run([*extra, *(f"{w}_grad" for w in wrt)], feeds)
    return out[:len(extra)], dict(zip(wrt, out[len(extra):]))


def _torch_leaves(values):
    return {k: torch.tensor(v, requires_grad=True) for k, v in values.items()}


def _assert_matches(got, leaves):
    for name, leaf in leaves.items():
        expected = leaf.grad.numpy() if leaf.grad is not None else np.zeros(leaf.shape)
        np.testing.assert_allclose(got[name], expected, rtol=RTOL, atol=ATOL, err_msg=name)


# ---- (a) an RNN written with Scan ---------------------------------------------------------------


def _rnn_body(in_shape=(B, I), state_shape=(B, H)):
    """h_t = tanh(x_t W + h_{t-1} U + b); outputs (h_t, h_t). W, U, b are read from outside."""
    return oh.make_graph(
        [oh.make_node("MatMul", ["x_t", "W"], ["xw"]),
         oh.make_node("MatMul", ["h_prev", "U"], ["hu"]),
         oh.make_node("Add", ["xw", "hu"], ["pre"]),
         oh.make_node("Add", ["pre", "b"], ["pre_b"]),
         oh.make_node("Tanh", ["pre_b"], ["h_next"]),
         oh.make_node("Identity", ["h_next"], ["y_t"])],
        "rnn_step", [_vi("h_prev", list(state_shape)), _vi("x_t", list(in_shape))],
        [_vi("h_next", list(state_shape)), _vi("y_t", list(state_shape))])


def _rnn_model(steps, in_axis, in_dir, out_axis, out_dir, opset):
    rng = np.random.default_rng(0)
    x_shape = [steps, B, I]
    x_shape.insert(in_axis, x_shape.pop(0))
    y_shape = [steps, B, H]
    y_shape.insert(out_axis, y_shape.pop(0))
    inits = {"W": rng.standard_normal((I, H)), "U": 0.5 * rng.standard_normal((H, H)),
             "b": rng.standard_normal(H), "V": rng.standard_normal(y_shape),
             "Vh": rng.standard_normal((B, H))}
    scan = oh.make_node("Scan", ["h0", "x"], ["h_last", "ys"], body=_rnn_body(), num_scan_inputs=1,
                        scan_input_axes=[in_axis], scan_input_directions=[in_dir],
                        scan_output_axes=[out_axis], scan_output_directions=[out_dir])
    nodes = [scan, *_weighted_loss("ys", "V"), *_weighted_loss("h_last", "Vh"),
             oh.make_node("Add", ["ys_sum", "h_last_sum"], [LOSS])]
    model = _model(nodes, [_vi("h0", [B, H]), _vi("x", x_shape)], inits, opset)
    feeds = {"h0": rng.standard_normal((B, H)), "x": rng.standard_normal(x_shape)}
    return model, feeds, inits


def _torch_rnn(leaves, inits, in_axis, in_dir, out_axis, out_dir):
    xs = list(torch.unbind(leaves["x"], dim=in_axis))
    if in_dir:
        xs.reverse()
    h, hs = leaves["h0"], []
    for x_t in xs:
        h = torch.tanh(x_t @ leaves["W"] + h @ leaves["U"] + leaves["b"])
        hs.append(h)
    if out_dir:
        hs.reverse()
    ys = torch.stack(hs, dim=out_axis)
    return (ys * torch.tensor(inits["V"])).sum() + (h * torch.tensor(inits["Vh"])).sum()


@pytest.mark.parametrize("opset", [13, 16, 19, 21])
@pytest.mark.parametrize(("in_axis", "in_dir", "out_axis", "out_dir"),
                         [(0, 0, 0, 0), (0, 1, 0, 0), (0, 0, 0, 1), (1, 1, 1, 0), (1, 0, 0, 1)],
                         ids=["default", "reverse-in", "reverse-out", "batch-first-reverse", "mixed"])
def test_scan_rnn_matches_torch(opset, in_axis, in_dir, out_axis, out_dir):
    model, feeds, inits = _rnn_model(5, in_axis, in_dir, out_axis, out_dir, opset)
    wrt = ["W", "U", "b", "h0", "x"]
    _, got = _gradients(model, wrt, feeds)
    leaves = _torch_leaves({"W": inits["W"], "U": inits["U"], "b": inits["b"], **feeds})
    _torch_rnn(leaves, inits, in_axis, in_dir, out_axis, out_dir).backward()
    _assert_matches(got, leaves)


def test_scan_without_state_and_two_scan_inputs():
    """A map over two sequences (no loop-carried state): y_t = sin(a_t) * c_t @ W."""
    body = oh.make_graph([oh.make_node("Sin", ["a_t"], ["s"]),
                          oh.make_node("Mul", ["s", "c_t"], ["sc"]),
                          oh.make_node("MatMul", ["sc", "W"], ["y_t"])],
                         "map", [_vi("a_t", [I]), _vi("c_t", [I])], [_vi("y_t", [H])])
    rng = np.random.default_rng(1)
    inits = {"W": rng.standard_normal((I, H)), "V": rng.standard_normal((H, 4))}
    model = _model([oh.make_node("Scan", ["a", "c"], ["ys"], body=body, num_scan_inputs=2,
                                 scan_input_axes=[0, -1], scan_input_directions=[1, 0],
                                 scan_output_axes=[-1]),
                    *_weighted_loss("ys", "V"), oh.make_node("Identity", ["ys_sum"], [LOSS])],
                   [_vi("a", [4, I]), _vi("c", [I, 4])], inits)
    feeds = {"a": rng.standard_normal((4, I)), "c": rng.standard_normal((I, 4))}
    _, got = _gradients(model, ["W", "a", "c"], feeds)
    leaves = _torch_leaves({"W": inits["W"], **feeds})
    a_seq = list(reversed(torch.unbind(leaves["a"], 0)))
    ys = [(torch.sin(a_t) * c_t) @ leaves["W"] for a_t, c_t in zip(a_seq, torch.unbind(leaves["c"], 1))]
    (torch.stack(ys, -1) * torch.tensor(inits["V"])).sum().backward()
    _assert_matches(got, leaves)


# ---- (b) Loop with a trip count -------------------------------------------------------------------


def _loop_body(extra_nodes=(), cond_out="cond_in_copy", extra_states=()):
    """x_{k+1} = x_k * W + sin(x_k); scan output y_k = x_{k+1} * k."""
    nodes = [oh.make_node("Identity", ["cond_in"], ["cond_in_copy"]),
             oh.make_node("Mul", ["x_k", "W"], ["xw"]),
             oh.make_node("Sin", ["x_k"], ["sin_x"]),
             oh.make_node("Add", ["xw", "sin_x"], ["x_next"]),
             oh.make_node("Cast", ["iter"], ["k_float"], to=D),
             oh.make_node("Mul", ["x_next", "k_float"], ["y_k"]),
             *extra_nodes]
    states = [("x_k", "x_next", [B, H]), *extra_states]
    return oh.make_graph(
        nodes, "loop_step",
        [_vi("iter", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL),
         *(_vi(name, shape) for name, _, shape in states)],
        [_vi(cond_out, [], TensorProto.BOOL), *(_vi(out, shape) for _, out, shape in states),
         _vi("y_k", [B, H])])


def _torch_step(x, w, k):
    x = x * w + torch.sin(x)
    return x, x * k


@pytest.mark.parametrize("opset", [13, 16, 19, 21])
@pytest.mark.parametrize("trips", [0, 1, 4])
def test_trip_count_loop_matches_torch(opset, trips):
    rng = np.random.default_rng(2)
    inits = {"W": 0.7 * rng.standard_normal((B, H)), "V": rng.standard_normal((trips, B, H)),
             "Vx": rng.standard_normal((B, H))}
    model = _model([oh.make_node("Loop", ["trips", "", "x0"], ["x_last", "ys"], body=_loop_body()),
                    *_weighted_loss("ys", "V"), *_weighted_loss("x_last", "Vx"),
                    oh.make_node("Add", ["ys_sum", "x_last_sum"], [LOSS])],
                   [_vi("trips", [], TensorProto.INT64), _vi("x0", [B, H])], inits, opset)
    feeds = {"trips": np.array(trips), "x0": rng.standard_normal((B, H))}
    _, got = _gradients(model, ["W", "x0"], feeds)
    leaves = _torch_leaves({"W": inits["W"], "x0": feeds["x0"]})
    x, loss = leaves["x0"], torch.zeros((), dtype=torch.float64)
    for k in range(trips):
        x, y = _torch_step(x, leaves["W"], k)
        loss = loss + (y * torch.tensor(inits["V"][k])).sum()
    (loss + (x * torch.tensor(inits["Vx"])).sum()).backward()
    _assert_matches(got, leaves)


def test_loop_captured_intermediate_and_integer_state():
    """The body reads an outer intermediate (tanh(A)) and carries an int64 counter besides x."""
    rng = np.random.default_rng(3)
    counter = [oh.make_node("Add", ["n_k", "one"], ["n_next"]),
               oh.make_node("Cast", ["n_next"], ["n_float"], to=D),
               oh.make_node("Mul", ["x_next", "tA"], ["x_tA"]),
               oh.make_node("Mul", ["x_tA", "n_float"], ["x_out"])]
    body = oh.make_graph(
        [oh.make_node("Identity", ["cond_in"], ["cond_out"]),
         oh.make_node("Mul", ["x_k", "W"], ["xw"]), oh.make_node("Sin", ["x_k"], ["sin_x"]),
         oh.make_node("Add", ["xw", "sin_x"], ["x_next"]), *counter],
        "step", [_vi("iter", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL),
                 _vi("x_k", [B, H]), _vi("n_k", [], TensorProto.INT64)],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("x_out", [B, H]), _vi("n_next", [], TensorProto.INT64)])
    inits = {"W": 0.5 * rng.standard_normal((B, H)), "A": rng.standard_normal((B, H)),
             "Vx": rng.standard_normal((B, H)), "trips": np.array(3), "n0": np.array(0),
             "one": np.array(1), "c": np.array(True)}
    model = _model([oh.make_node("Tanh", ["A"], ["tA"]),
                    oh.make_node("Loop", ["trips", "c", "x0", "n0"], ["x_last", "n_last"], body=body),
                    *_weighted_loss("x_last", "Vx"), oh.make_node("Identity", ["x_last_sum"], [LOSS])],
                   [_vi("x0", [B, H])], inits)
    feeds = {"x0": rng.standard_normal((B, H))}
    _, got = _gradients(model, ["W", "A", "x0"], feeds)
    leaves = _torch_leaves({"W": inits["W"], "A": inits["A"], "x0": feeds["x0"]})
    x = leaves["x0"]
    for n in range(1, 4):
        x = (x * leaves["W"] + torch.sin(x)) * torch.tanh(leaves["A"]) * n
    (x * torch.tensor(inits["Vx"])).sum().backward()
    _assert_matches(got, leaves)


# ---- (c) a condition-driven Loop ------------------------------------------------------------------


MAX_TRIPS = 4


def _cond_loop_model(with_trip_count):
    """Run while s < limit (and at most MAX_TRIPS times with the trip count):
    x_{k+1} = x_k * W + sin(x_k), s_{k+1} = s_k + sum(x_{k+1}^2)."""
    extra = [oh.make_node("Mul", ["x_next", "x_next"], ["sq"]),
             oh.make_node("ReduceSum", ["sq"], ["sq_sum"], keepdims=0),
             oh.make_node("Add", ["s_k", "sq_sum"], ["s_next"]),
             oh.make_node("Less", ["s_next", "limit"], ["go_on"])]
    body = _loop_body(extra, cond_out="go_on", extra_states=[("s_k", "s_next", [])])
    rng = np.random.default_rng(4)
    inits = {"W": 0.9 + 0.2 * rng.random((B, H)), "Vx": rng.standard_normal((B, H)),
             "Vs": np.array(0.3), "max_trips": np.array(MAX_TRIPS)}
    model = _model([oh.make_node("Loop", ["max_trips" if with_trip_count else "", "c", "x0", "s0"],
                                 ["x_last", "s_last", "ys"], body=body),
                    oh.make_node("Shape", ["ys"], ["ys_shape"], start=0, end=1),
                    *_weighted_loss("x_last", "Vx"), *_weighted_loss("s_last", "Vs"),
                    oh.make_node("ReduceSum", ["ys"], ["ys_total"], keepdims=0),
                    oh.make_node("Sum", ["x_last_sum", "s_last_sum", "ys_total"], [LOSS])],
                   [_vi("c", [], TensorProto.BOOL), _vi("x0", [B, H]), _vi("s0", []), _vi("limit", [])],
                   inits)
    model.graph.output.append(_vi("ys_shape", [1], TensorProto.INT64))
    return model, inits


@pytest.mark.parametrize("with_trip_count", [True, False])
@pytest.mark.parametrize(("limit", "start", "steps_expected"),
                         [(4.0, True, 1), (30.0, True, 2), (100.0, True, 3), (250.0, True, 5),
                          (30.0, False, 0)])
def test_condition_driven_loop_matches_torch(with_trip_count, limit, start, steps_expected):
    """The iteration count depends on the data (piecewise constant): 0 to 5 here (the trip
    count stops the last case one iteration early)."""
    model, inits = _cond_loop_model(with_trip_count)
    rng = np.random.default_rng(5)
    feeds = {"c": np.array(start), "x0": rng.uniform(0.5, 1.0, (B, H)), "s0": np.array(0.0),
             "limit": np.array(limit)}
    [shape], got = _gradients(model, ["W", "x0", "s0"], feeds, extra=["ys_shape"])
    leaves = _torch_leaves({"W": inits["W"], "x0": feeds["x0"], "s0": feeds["s0"]})
    x, s, ys_total, steps, go_on = leaves["x0"], leaves["s0"], 0.0, 0, start
    while go_on and (steps < MAX_TRIPS or not with_trip_count):
        x, y = _torch_step(x, leaves["W"], steps)
        s = s + (x * x).sum()
        ys_total = ys_total + y.sum()
        steps += 1
        go_on = bool(s < limit)
    assert shape[0] == steps
    assert steps == (min(steps_expected, MAX_TRIPS) if with_trip_count else steps_expected)
    loss = (x * torch.tensor(inits["Vx"])).sum() + s * float(inits["Vs"]) + ys_total
    loss.backward()
    _assert_matches(got, leaves)


# ---- nesting and refusals --------------------------------------------------------------------------


def test_scan_inside_loop_body():
    """Each Loop iteration runs a Scan RNN from the carried state over the same outer x."""
    inner = oh.make_node("Scan", ["h_k", "x"], ["h_next", "ys_k"], body=_rnn_body(), num_scan_inputs=1)
    body = oh.make_graph(
        [oh.make_node("Identity", ["cond_in"], ["cond_out"]), inner,
         oh.make_node("ReduceSum", ["ys_k"], ["y_k"], keepdims=0)],
        "outer", [_vi("iter", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL),
                  _vi("h_k", [B, H])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("h_next", [B, H]), _vi("y_k", [])])
    rng = np.random.default_rng(6)
    inits = {"W": rng.standard_normal((I, H)), "U": 0.5 * rng.standard_normal((H, H)),
             "b": rng.standard_normal(H), "Vh": rng.standard_normal((B, H)), "V": rng.standard_normal(2),
             "trips": np.array(2)}
    model = _model([oh.make_node("Loop", ["trips", "", "h0"], ["h_last", "ys"], body=body),
                    *_weighted_loss("ys", "V"), *_weighted_loss("h_last", "Vh"),
                    oh.make_node("Add", ["ys_sum", "h_last_sum"], [LOSS])],
                   [_vi("h0", [B, H]), _vi("x", [3, B, I])], inits)
    feeds = {"h0": rng.standard_normal((B, H)), "x": rng.standard_normal((3, B, I))}
    wrt = ["W", "U", "b", "h0", "x"]
    _, got = _gradients(model, wrt, feeds)
    leaves = _torch_leaves({k: inits[k] for k in "WUb"} | feeds)
    h, loss = leaves["h0"], 0.0
    for k in range(2):
        total = 0.0
        for x_t in torch.unbind(leaves["x"], 0):
            h = torch.tanh(x_t @ leaves["W"] + h @ leaves["U"] + leaves["b"])
            total = total + h.sum()
        loss = loss + total * inits["V"][k]
    (loss + (h * torch.tensor(inits["Vh"])).sum()).backward()
    _assert_matches(got, leaves)


def test_if_inside_loop_body_and_frozen_initial_state():
    """The body picks sin(x_k) * W or x_k * V by the sign of the iteration's running sum; the
    initial state is a constant (no gradient wanted), the weights are."""
    then_g = oh.make_graph([oh.make_node("Sin", ["x_k"], ["t1"]), oh.make_node("Mul", ["t1", "W"], ["t_out"])],
                           "then", [], [_vi("t_out", None)])
    else_g = oh.make_graph([oh.make_node("Mul", ["x_k", "V"], ["e_out"])], "else", [], [_vi("e_out", None)])
    body = oh.make_graph(
        [oh.make_node("Identity", ["cond_in"], ["cond_out"]),
         oh.make_node("ReduceSum", ["x_k"], ["total"], keepdims=0),
         oh.make_node("Greater", ["total", "zero"], ["positive"]),
         oh.make_node("If", ["positive"], ["x_next"], then_branch=then_g, else_branch=else_g)],
        "step", [_vi("iter", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL), _vi("x_k", [H])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("x_next", [H])])
    rng = np.random.default_rng(7)
    inits = {"W": rng.uniform(0.5, 1.5, H), "V": rng.uniform(-1.5, -0.5, H), "x0": rng.uniform(0.5, 1, H),
             "zero": np.array(0.0), "trips": np.array(4), "Vx": rng.standard_normal(H)}
    model = _model([oh.make_node("Loop", ["trips", "", "x0"], ["x_last"], body=body),
                    *_weighted_loss("x_last", "Vx"), oh.make_node("Identity", ["x_last_sum"], [LOSS])],
                   [], inits)
    _, got = _gradients(model, ["W", "V"], {})
    leaves = _torch_leaves({"W": inits["W"], "V": inits["V"]})
    x = torch.tensor(inits["x0"])
    for _ in range(4):
        x = torch.sin(x) * leaves["W"] if x.sum() > 0 else x * leaves["V"]
    (x * torch.tensor(inits["Vx"])).sum().backward()
    _assert_matches(got, leaves)


def test_float32_scan_rnn_against_central_differences():
    body = _rnn_body()
    for vi in [*body.input, *body.output]:
        vi.type.tensor_type.elem_type = TensorProto.FLOAT
    rng = np.random.default_rng(8)
    inits = {"W": rng.uniform(-1, 1, (I, H)).astype(np.float32),
             "U": rng.uniform(-0.7, 0.7, (H, H)).astype(np.float32),
             "b": rng.uniform(-1, 1, H).astype(np.float32)}
    scan = oh.make_node("Scan", ["h0", "x"], ["h_last", "ys"], body=body, num_scan_inputs=1,
                        scan_input_directions=[1])
    feeds = {"h0": rng.uniform(-1, 1, (B, H)).astype(np.float32),
             "x": rng.uniform(-1, 1, (3, B, I)).astype(np.float32)}
    model = _open_model([scan], [_vi("h0", [B, H], TensorProto.FLOAT), _vi("x", [3, B, I], TensorProto.FLOAT)],
                        inits, ["h_last", "ys"], 18)
    loss_model = fdcheck.with_weighted_loss(model, _forward_outputs(model, ["h_last", "ys"], feeds))
    reports = fdcheck.compare_gradients(loss_model, ["W", "U", "b", "h0", "x"], feeds, fdcheck.FLOAT32_TOL)
    assert all(r.ok for r in reports), fdcheck.describe(reports)


def test_body_returning_outer_value_is_refused():
    body = oh.make_graph([oh.make_node("Add", ["s", "x_t"], ["s_next"])], "b",
                         [_vi("s", [H]), _vi("x_t", [H])], [_vi("s_next", [H]), _vi("W", [H])])
    model = _model([oh.make_node("Scan", ["s0", "x"], ["s_last", "ws"], body=body, num_scan_inputs=1),
                    oh.make_node("Add", ["s_last", "W"], ["z"]),
                    oh.make_node("ReduceSum", ["z"], [LOSS], keepdims=0)],
                   [_vi("s0", [H]), _vi("x", [2, H])], {"W": np.ones(H)})
    with pytest.raises(GradientError, match=r"Scan failed.*returns 'W\w*', an outer-scope value"):
        build_gradient_graph(model, LOSS, ["s0"])


def test_sequence_state_is_refused():
    body = oh.make_graph(
        [oh.make_node("Identity", ["cond_in"], ["cond_out"]),
         oh.make_node("Mul", ["x_k", "x_k"], ["x_next"]),
         oh.make_node("SequenceInsert", ["seq_k", "x_next"], ["seq_next"])],
        "b", [_vi("iter", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL), _vi("x_k", [H]),
              oh.make_tensor_sequence_value_info("seq_k", D, [H])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("x_next", [H]),
         oh.make_tensor_sequence_value_info("seq_next", D, [H])])
    model = _model([oh.make_node("SequenceEmpty", [], ["seq0"], dtype=D),
                    oh.make_node("Loop", ["trips", "", "x0", "seq0"], ["x_last", "seq_last"], body=body),
                    oh.make_node("ReduceSum", ["x_last"], [LOSS], keepdims=0)],
                   [_vi("x0", [H])], {"trips": np.array(2)})
    with pytest.raises(GradientError, match="supports tensor loop-carried values"):
        build_gradient_graph(model, LOSS, ["x0"])


def test_growing_state_is_refused():
    """A state that grows (Concat) every iteration cannot be recorded as one stack."""
    body = oh.make_graph(
        [oh.make_node("Identity", ["cond_in"], ["cond_out"]), oh.make_node("Sin", ["x_k"], ["sin_x"]),
         oh.make_node("Concat", ["x_k", "sin_x"], ["x_next"], axis=0)],
        "b", [_vi("iter", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL), _vi("x_k", None)],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("x_next", None)])
    model = _model([oh.make_node("Loop", ["trips", "", "x0"], ["x_last"], body=body),
                    oh.make_node("ReduceSum", ["x_last"], [LOSS], keepdims=0)],
                   [_vi("x0", [2])], {"trips": np.array(3)})
    with pytest.raises(GradientError, match=r"Loop failed.*'x_k' changes shape in an iteration"):
        build_gradient_graph(model, LOSS, ["x0"])


# ---- (d) random cases against float64 central differences -----------------------------------------


def _check_fd(model, outputs, wrt, feeds, seed):
    loss_model = fdcheck.with_weighted_loss(model, outputs, seed)
    reports = fdcheck.compare_gradients(loss_model, wrt, feeds, fdcheck.FLOAT64_TOL, seed=seed)
    assert all(r.ok for r in reports), fdcheck.describe(reports)
    assert sum(r.checked for r in reports) > 0, fdcheck.describe(reports)


def _forward_outputs(model, names, feeds):
    values = _session(model).run(list(names), feeds)
    return {n: v.shape for n, v in zip(names, values)}


def _open_model(nodes, inputs, inits, outputs, opset):
    graph = oh.make_graph(nodes, "model", inputs, [onnx.ValueInfoProto(name=o) for o in outputs],
                          [nh.from_array(v, k) for k, v in inits.items()])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=9)
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(steps=st.integers(1, 4), batch=st.integers(1, 3), hidden=st.integers(1, 3), inp=st.integers(1, 3),
       in_axis=st.sampled_from([0, 1, -3, -2]), in_dir=st.integers(0, 1),
       out_axis=st.sampled_from([0, 1, 2, -1]), out_dir=st.integers(0, 1),
       opset=st.sampled_from([13, 16, 19, 21]), seed=st.integers(0, 2**16))
def test_random_scan_rnn_against_central_differences(steps, batch, hidden, inp, in_axis, in_dir,
                                                      out_axis, out_dir, opset, seed):
    rng = np.random.default_rng(seed)
    x_shape = [steps, batch, inp]
    x_shape.insert(in_axis % 3, x_shape.pop(0))
    inits = {"W": rng.uniform(-1, 1, (inp, hidden)), "U": rng.uniform(-0.7, 0.7, (hidden, hidden)),
             "b": rng.uniform(-1, 1, hidden)}
    scan = oh.make_node("Scan", ["h0", "x"], ["h_last", "ys"],
                        body=_rnn_body((batch, inp), (batch, hidden)), num_scan_inputs=1,
                        scan_input_axes=[in_axis], scan_input_directions=[in_dir],
                        scan_output_axes=[out_axis], scan_output_directions=[out_dir])
    feeds = {"h0": rng.uniform(-1, 1, (batch, hidden)), "x": rng.uniform(-1, 1, x_shape)}
    model = _open_model([scan], [_vi("h0", [batch, hidden]), _vi("x", x_shape)], inits,
                        ["h_last", "ys"], opset)
    _check_fd(model, _forward_outputs(model, ["h_last", "ys"], feeds), ["W", "U", "b", "h0", "x"],
              feeds, seed)


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(trips=st.integers(0, 4), rows=st.integers(1, 3), cols=st.integers(1, 3),
       cond_driven=st.booleans(), opset=st.sampled_from([13, 16, 19, 21]), seed=st.integers(0, 2**16))
def test_random_loop_against_central_differences(trips, rows, cols, cond_driven, opset, seed):
    """x_{k+1} = x_k * W + sin(x_k) (scan output x_{k+1} * k); condition-driven: while the
    running sum of squares stays below a limit placed between two iterations' sums."""
    rng = np.random.default_rng(seed)
    shape = [rows, cols]
    extra = [oh.make_node("Mul", ["x_next", "x_next"], ["sq"]),
             oh.make_node("ReduceSum", ["sq"], ["sq_sum"], keepdims=0),
             oh.make_node("Add", ["s_k", "sq_sum"], ["s_next"]),
             oh.make_node("Less", ["s_next", "limit"], ["go_on"])]
    body = _loop_body(extra, cond_out="go_on" if cond_driven else "cond_in_copy",
                      extra_states=[("s_k", "s_next", [])])
    for vi in [*body.input, *body.output]:
        if vi.name in ("x_k", "x_next", "y_k"):
            vi.CopyFrom(_vi(vi.name, shape))
    inits = {"W": rng.uniform(0.5, 1.2, shape), "trips": np.array(trips if not cond_driven else 20)}
    x0 = rng.uniform(0.2, 1.0, shape)
    limit = 1e9
    if cond_driven:  # a limit halfway between the running sums after trips and trips + 1 steps
        x, s, sums = x0, 0.0, []
        for _ in range(trips + 1):
            x = x * inits["W"] + np.sin(x)
            s += float(np.sum(x * x))
            sums.append(s)
        limit = sums[0] / 2 if trips == 0 else (sums[trips - 1] + sums[trips]) / 2
    inits["limit"] = np.array(limit)
    loop = oh.make_node("Loop", ["trips", "", "x0", "s0"], ["x_last", "s_last", "ys"], body=body)
    feeds = {"x0": x0, "s0": np.array(0.0)}
    model = _open_model([loop], [_vi("x0", shape), _vi("s0", [])], inits, ["x_last", "s_last", "ys"], opset)
    outputs = _forward_outputs(model, ["x_last", "s_last", "ys"], feeds)
    if cond_driven:
        assert outputs["ys"][0] == trips + 1
    if trips == 0 and not cond_driven:
        del outputs["ys"]  # an empty output adds nothing to the loss
    _check_fd(model, outputs, ["W", "x0", "s0"], feeds, seed)
