"""Gradients of LSTM, GRU and RNN.

onnxruntime runs these ops in float32 only, so ``gradcheck``'s float64 oracle cannot run
them. The oracles here are (1) central differences in float64 of a NumPy re-implementation
of the ONNX recurrences, itself checked against onnxruntime's forward outputs, and
(2) torch autograd for LSTM and GRU (torch's GRU is ONNX GRU with linear_before_reset=1).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto
from onnx import helper as oh

from gradgraph.api import build_gradient_graph
from passes.autodiff import GradientError

SEQ, BATCH, INPUT, HIDDEN = 3, 3, 2, 3
LENS = np.array([3, 1, 2], np.int32)
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
DIRECTIONS = ["forward", "reverse", "bidirectional"]
OPSET = {"RNN": 13, "GRU": 18, "LSTM": 18}  # onnxruntime has no RNN kernel past opset 13
FD_EPS, FD_PICKS = 1e-6, 6
ATOL, RTOL = 1e-4, 1e-3
CLIP_EFFECT = 1e-3  # the clip must change the loss by more than this, or the test proves nothing
VARIANTS = {  # optional inputs present, and the outputs the loss reads
    "plain": dict(init=False, bias=False, lens=False, outputs=("Y_h",)),
    "init_bias": dict(init=True, bias=True, lens=False, outputs=("Y", "Y_h", "Y_c")),
    "lens": dict(init=False, bias=True, lens=True, outputs=("Y", "Y_h", "Y_c")),
    "all": dict(init=True, bias=True, lens=True, outputs=("Y", "Y_c")),
}


# ---- NumPy reference of the ONNX recurrences (float64) ------------------------------------
def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _act(fn, x, clip):
    return fn(np.clip(x, -clip, clip) if clip else x)


def _cell(op, x, h, c, w, r, wb, rb, p, clip, lbr):
    """One step of the ONNX cell; returns (H', C')."""
    hid = h.shape[1]
    if op == "RNN":
        return _act(np.tanh, x @ w.T + wb + h @ r.T + rb, clip), None
    ax = x @ w.T + wb
    if op == "GRU":
        z = _act(_sig, ax[:, :hid] + h @ r[:hid].T + rb[:hid], clip)
        rr = _act(_sig, ax[:, hid:2 * hid] + h @ r[hid:2 * hid].T + rb[hid:2 * hid], clip)
        if lbr:
            pre_h = ax[:, 2 * hid:] + rr * (h @ r[2 * hid:].T + rb[2 * hid:])
        else:
            pre_h = ax[:, 2 * hid:] + (rr * h) @ r[2 * hid:].T + rb[2 * hid:]
        ht = _act(np.tanh, pre_h, clip)
        return (1 - z) * ht + z * h, None
    a = ax + h @ r.T + rb
    pi, po, pf = np.split(p, 3)
    i = _act(_sig, a[:, :hid] + pi * c, clip)
    f = _act(_sig, a[:, 2 * hid:3 * hid] + pf * c, clip)
    g = _act(np.tanh, a[:, 3 * hid:], clip)
    c_new = f * c + i * g
    o = _act(_sig, a[:, hid:2 * hid] + po * c_new, clip)
    return o * np.tanh(c_new), c_new


def ref_forward(op, t, direction, clip=None, lbr=0):
    """Y [T, D, B, H], Y_h, Y_c [D, B, H] for tensors ``t`` (missing optional inputs absent)."""
    x, w, r = t["X"], t["W"], t["R"]
    steps, batch = x.shape[:2]
    dirs, hid = w.shape[0], r.shape[-1]
    y = np.zeros((steps, dirs, batch, hid))
    y_h, y_c = np.zeros((dirs, batch, hid)), np.zeros((dirs, batch, hid))
    lens = t.get("lens", np.full(batch, steps))
    for d in range(dirs):
        wb, rb = np.split(t["B"][d] if "B" in t else np.zeros(2 * w.shape[1]), 2)
        h = t["h0"][d] if "h0" in t else np.zeros((batch, hid))
        c = t["c0"][d] if "c0" in t else np.zeros((batch, hid))
        p = t["P"][d] if "P" in t else np.zeros(3 * hid)
        order = range(steps - 1, -1, -1) if direction == "reverse" or d == 1 else range(steps)
        for s in order:
            h_new, c_new = _cell(op, x[s], h, c, w[d], r[d], wb, rb, p, clip, lbr)
            m = (s < lens)[:, None].astype(np.float64)
            y[s, d] = m * h_new
            h = m * h_new + (1 - m) * h
            c = m * c_new + (1 - m) * c if c_new is not None else c
        y_h[d], y_c[d] = h, c
    return {"Y": y, "Y_h": y_h, "Y_c": y_c}


# ---- fixtures ------------------------------------------------------------------------------
def make_case(op, direction, variant, peephole=False, clip=None, lbr=0, layout=0, seed=0):
    """(model, feeds, trained names, loss weights, float64 tensors) for one configuration."""
    v = VARIANTS[variant]
    rng = np.random.default_rng(seed)
    dirs, gh = 2 if direction == "bidirectional" else 1, GATES[op] * HIDDEN
    t = {"X": rng.standard_normal((SEQ, BATCH, INPUT)), "W": rng.standard_normal((dirs, gh, INPUT)),
         "R": rng.standard_normal((dirs, gh, HIDDEN)) * 0.7}
    if v["bias"]:
        t["B"] = rng.standard_normal((dirs, 2 * gh))
    if v["init"]:
        t["h0"] = rng.standard_normal((dirs, BATCH, HIDDEN))
        if op == "LSTM":
            t["c0"] = rng.standard_normal((dirs, BATCH, HIDDEN))
    if peephole:
        t["P"] = rng.standard_normal((dirs, 3 * HIDDEN))
    if v["lens"]:
        t["lens"] = LENS
    outputs = [o for o in v["outputs"] if o != "Y_c" or op == "LSTM"]
    ref = ref_forward(op, t, direction, clip, lbr)
    k = {o: rng.standard_normal(ref[o].shape) for o in outputs}
    model = _model(op, t, direction, outputs, k, dict(clip=clip, layout=layout, lbr=lbr))
    trained = [n for n in ("X", "W", "R", "B", "h0", "c0", "P") if n in t]
    feeds = {n: _to_layout(n, a, layout).astype(np.float32 if n != "lens" else np.int32)
             for n, a in t.items() if n in ("X", "h0", "c0", "lens")}
    return model, feeds, trained, k, t


def _to_layout(name, a, layout):
    if not layout or name in ("lens", "W", "R", "B", "P"):
        return a
    return np.swapaxes(a, 0, 1) if name != "Y" else np.transpose(a, (2, 0, 1, 3))


def _model(op, t, direction, outputs, k, attrs):
    names = ["X", "W", "R", "B", "lens", "h0", "c0", "P"][: 8 if op == "LSTM" else 6]
    ins = [n if n in t else "" for n in names]
    outs = [o if o in outputs else "" for o in ("Y", "Y_h", "Y_c")[: 3 if op == "LSTM" else 2]]
    extra = {"clip": attrs["clip"]} if attrs["clip"] else {}
    if op == "GRU":
        extra["linear_before_reset"] = attrs["lbr"]
    if attrs["layout"]:
        extra["layout"] = 1
    nodes = [oh.make_node(op, ins, outs, hidden_size=HIDDEN, direction=direction, **extra)]
    inits = [oh.make_tensor(n, TensorProto.FLOAT, t[n].shape, t[n].ravel().tolist())
             for n in ("W", "R", "B", "P") if n in t]
    for o in outputs:
        kv = _to_layout(o, k[o], attrs["layout"])
        inits.append(oh.make_tensor(f"k_{o}", TensorProto.FLOAT, kv.shape, kv.ravel().tolist()))
        nodes += [oh.make_node("Mul", [o, f"k_{o}"], [f"m_{o}"]),
                  oh.make_node("ReduceSum", [f"m_{o}"], [f"s_{o}"], keepdims=0)]
    nodes.append(oh.make_node("Sum", [f"s_{o}" for o in outputs], ["loss"]))
    inputs = [oh.make_tensor_value_info(n, TensorProto.FLOAT, _to_layout(n, t[n], attrs["layout"]).shape)
              for n in ("X", "h0", "c0") if n in t]
    if "lens" in t:
        inputs.append(oh.make_tensor_value_info("lens", TensorProto.INT32, [BATCH]))
    graph = oh.make_graph(nodes, "rnn", inputs, [oh.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", OPSET[op])], ir_version=9)


def _ref_loss(op, t, direction, k, clip, lbr):
    out = ref_forward(op, t, direction, clip, lbr)
    return sum(float(np.sum(out[o] * k[o])) for o in k)


def _session(model):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _only_gradients(model, grad_names):
    """Drop the forward outputs and the nodes only they need (onnxruntime lacks layout=1)."""
    del model.graph.output[:]
    model.graph.output.extend(oh.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in grad_names)
    needed, keep = set(grad_names), []
    for node in reversed(model.graph.node):
        if needed & set(node.output):
            keep.append(node)
            needed.update(node.input)
    del model.graph.node[:]
    model.graph.node.extend(reversed(keep))
    return model


def analytic_grads(model, feeds, trained, prune=False):
    grad_model = build_gradient_graph(model, "loss", trained)
    names = [f"{n}_grad" for n in trained]
    if prune:
        grad_model = _only_gradients(grad_model, names)
    return dict(zip(trained, _session(grad_model).run(names, feeds)))


def assert_matches_fd(op, direction, case, clip=None, lbr=0, layout=0):
    model, feeds, trained, k, t = case
    got = analytic_grads(model, feeds, trained, prune=bool(layout))
    rng = np.random.default_rng(1)
    for name in trained:
        flat = t[name].reshape(-1)
        for idx in rng.choice(flat.size, size=min(FD_PICKS, flat.size), replace=False):
            losses = []
            for sign in (1, -1):
                pert = dict(t)
                pert[name] = flat.copy()
                pert[name][idx] += sign * FD_EPS
                pert[name] = pert[name].reshape(t[name].shape)
                losses.append(_ref_loss(op, pert, direction, k, clip, lbr))
            numeric = (losses[0] - losses[1]) / (2 * FD_EPS)
            analytic = _to_layout(name, got[name], layout).reshape(-1)[idx]
            assert abs(numeric - analytic) <= ATOL + RTOL * abs(numeric), (name, idx, numeric, analytic)


# ---- tests ---------------------------------------------------------------------------------
CONFIGS = [("RNN", {}), ("GRU", {"lbr": 0}), ("GRU", {"lbr": 1}), ("LSTM", {}), ("LSTM", {"peephole": True})]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("op,extra", CONFIGS, ids=["rnn", "gru", "gru_lbr", "lstm", "lstm_peephole"])
def test_matches_finite_differences(op, extra, direction, variant):
    case = make_case(op, direction, variant, **extra)
    lbr = extra.get("lbr", 0)
    model, feeds, _, k, t = case
    (loss,) = _session(model).run(["loss"], feeds)  # the reference follows onnxruntime's semantics
    np.testing.assert_allclose(loss, _ref_loss(op, t, direction, k, None, lbr), rtol=1e-5, atol=1e-5)
    assert_matches_fd(op, direction, case, lbr=lbr)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_clip(op):
    clip = 0.6  # small enough that gates saturate on the random data
    case = make_case(op, "bidirectional", "all", clip=clip, peephole=op == "LSTM")
    model, feeds, _, k, t = case
    (loss,) = _session(model).run(["loss"], feeds)
    clipped = _ref_loss(op, t, "bidirectional", k, clip, 0)
    np.testing.assert_allclose(loss, clipped, rtol=1e-5, atol=1e-5)
    assert abs(clipped - _ref_loss(op, t, "bidirectional", k, None, 0)) > CLIP_EFFECT
    assert_matches_fd(op, "bidirectional", case, clip=clip)


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_layout_1(op):
    case = make_case(op, "bidirectional", "init_bias", layout=1)
    assert_matches_fd(op, "bidirectional", case, layout=1)


# ---- torch autograd ------------------------------------------------------------------------
TORCH_GATES = {"LSTM": [0, 2, 3, 1], "GRU": [1, 0, 2]}  # torch gate j is ONNX gate [j] (ifgo, rzn)


def _to_torch_gates(op, m):
    blocks = torch.split(m, HIDDEN, dim=0)
    return torch.cat([blocks[j] for j in TORCH_GATES[op]], dim=0)


def torch_grads(op, t, k):
    """d loss / d ONNX tensors through torch.nn.LSTM / torch.nn.GRU (float64)."""
    leaves = {n: torch.tensor(a, dtype=torch.float64, requires_grad=True) for n, a in t.items()}
    dirs = t["W"].shape[0]
    cls = torch.nn.LSTM if op == "LSTM" else torch.nn.GRU
    module = cls(INPUT, HIDDEN, bias="B" in t, bidirectional=dirs == 2).double()
    params = {}
    for d in range(dirs):
        sfx = "_reverse" if d else ""
        params[f"weight_ih_l0{sfx}"] = _to_torch_gates(op, leaves["W"][d])
        params[f"weight_hh_l0{sfx}"] = _to_torch_gates(op, leaves["R"][d])
        if "B" in t:
            wb, rb = leaves["B"][d].split(GATES[op] * HIDDEN)
            params[f"bias_ih_l0{sfx}"] = _to_torch_gates(op, wb)
            params[f"bias_hh_l0{sfx}"] = _to_torch_gates(op, rb)
    zeros = torch.zeros(dirs, BATCH, HIDDEN, dtype=torch.float64)
    h0 = leaves.get("h0", zeros)
    state = (h0, leaves.get("c0", zeros)) if op == "LSTM" else h0
    y, last = torch.func.functional_call(module, params, (leaves["X"], state))
    outs = {"Y": y.reshape(SEQ, BATCH, dirs, HIDDEN).permute(0, 2, 1, 3)}
    outs["Y_h"], outs["Y_c"] = last if op == "LSTM" else (last, None)
    loss = sum((outs[o] * torch.tensor(k[o])).sum() for o in k)
    loss.backward()
    return {n: v.grad.numpy() for n, v in leaves.items()}


@pytest.mark.parametrize("variant", ["plain", "init_bias"])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_matches_torch(op, direction, variant):
    model, feeds, trained, k, t = make_case(op, direction, variant, lbr=1)
    got = analytic_grads(model, feeds, trained)
    want = torch_grads(op, t, k)
    for name in trained:
        np.testing.assert_allclose(got[name], want[name], atol=ATOL, rtol=RTOL, err_msg=name)


# ---- refusals ------------------------------------------------------------------------------
def _lstm_model(x_shape, **attrs):
    return onnx.parser.parse_model(f"""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float{x_shape} X) => (float loss) <float[1, 8, 2] W = {{{", ".join(["0.1"] * 16)}}},
                                           float[1, 8, 2] R = {{{", ".join(["0.2"] * 16)}}}> {{
      Y = LSTM<hidden_size=2{attrs.get("extra", "")}>(X, W, R)
      loss = ReduceSum<keepdims=0>(Y)
    }}""")


def test_dynamic_sequence_length_is_refused():
    with pytest.raises(GradientError, match="static sequence length"):
        build_gradient_graph(_lstm_model("[T, 1, 2]"), "loss", ["W"])


def test_custom_activations_are_refused():
    model = _lstm_model("[2, 1, 2]", extra=', activations=["Relu", "Tanh", "Tanh"]')
    with pytest.raises(GradientError, match="default activations"):
        build_gradient_graph(model, "loss", ["W"])


def test_input_forget_is_refused():
    with pytest.raises(GradientError, match="input_forget"):
        build_gradient_graph(_lstm_model("[2, 1, 2]", extra=", input_forget=1"), "loss", ["W"])


def test_emits_standard_onnx_only():
    model, _, trained, _, _ = make_case("LSTM", "bidirectional", "all", peephole=True)
    grad_model = build_gradient_graph(model, "loss", trained)
    onnx.checker.check_model(grad_model, full_check=True)
    assert {node.domain for node in grad_model.graph.node} <= {""}
