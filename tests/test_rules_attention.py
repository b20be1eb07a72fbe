"""Gradient rules of Attention, RMSNormalization, RotaryEmbedding, Swish and
MeanVarianceNormalization (passes/autodiff/rules/attention.py).

Oracles:

- float64 central differences (``gradgraph.check.compare_with_central_differences``, as in
  ``fdcheck``: step 1e-6, ``fdcheck.FLOAT64_TOL`` = atol 1e-6, rtol 1e-5, every element screened
  for kinks) of float64 single-op models with random shapes and attributes (hypothesis). The
  analytic side is the float64 gradient graph, run in onnxruntime when onnxruntime runs the
  forward model, else in ``onnx.reference.ReferenceEvaluator`` (onnxruntime has no float64
  RotaryEmbedding, and runs float64 Attention-23 only in some configurations);
- torch float64 autograd, ``rtol`` 1e-6 / ``atol`` 1e-9: Attention-23/24 against
  ``F.scaled_dot_product_attention`` (softcap written out: torch has none), and
  MeanVarianceNormalization, which no float64 finite-difference oracle can run (its ONNX
  function body adds a float32 epsilon, so neither onnxruntime nor the reference evaluator
  runs a float64 copy);
- the float32 gradient graphs run in onnxruntime (``single_op.assert_fd``, float32 tolerances).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import fdcheck
import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from single_op import assert_fd, make_model

from gradgraph import check
from gradgraph.api import build_gradient_graph
from passes.autodiff import GradientError

TORCH_RTOL, TORCH_ATOL = 1e-6, 1e-9
FD_TOL = fdcheck.FLOAT64_TOL
HYPOTHESIS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_ELEM = {np.dtype(np.float64): TensorProto.DOUBLE, np.dtype(np.float32): TensorProto.FLOAT,
         np.dtype(np.bool_): TensorProto.BOOL, np.dtype(np.int64): TensorProto.INT64}


# ---- single-op float64 models, run in onnxruntime or the reference evaluator -------------------


class MeanVarianceNormalization(OpRun):
    """MeanVarianceNormalization for the reference evaluator in any float type (the stock one
    runs the op's function body, whose float32 epsilon cannot be added to float64)."""

    def _run(self, x, axes=None):
        axes = tuple(axes if axes is not None else (0, 2, 3))
        mean = x.mean(axes, keepdims=True)
        std = np.sqrt((x * x).mean(axes, keepdims=True) - mean * mean)
        return ((x - mean) / (std + x.dtype.type(1e-9)),)


def _runner(model: onnx.ModelProto, forward: onnx.ModelProto):
    """Runs ``model`` in onnxruntime when onnxruntime runs ``forward``, else in the reference
    evaluator (a gradient graph onnxruntime cannot run, although it runs the forward, fails)."""
    try:
        fdcheck.session(forward)
    except Exception:  # noqa: BLE001 - no kernel (or no float64 kernel) for the op
        ref = ReferenceEvaluator(model, new_ops=[MeanVarianceNormalization])
        return lambda names, feeds: ref.run(list(names), dict(feeds))
    sess = fdcheck.session(model)
    return lambda names, feeds: sess.run(list(names), dict(feeds))


def op_model(op: str, opset: int, inputs: Sequence[tuple[str, np.ndarray | None]], attrs: Mapping,
             outputs: Sequence[str] = ("y",), *, seed: int = 0, loss_on: Sequence[str] | None = None):
    """``op`` on graph inputs (name, value) in node order (None: absent), plus the weighted loss
    over its finite float outputs, or those named in ``loss_on`` ("" in ``outputs``: an absent
    optional output)."""
    feeds = {name: value for name, value in inputs if value is not None}
    node = helper.make_node(op, [name if value is not None else "" for name, value in inputs],
                            list(outputs), **{k: v for k, v in attrs.items() if v is not None})
    while node.input and not node.input[-1]:
        node.input.pop()
    dtype = _ELEM[next(iter(feeds.values())).dtype]
    graph = helper.make_graph(
        [node], op, [helper.make_tensor_value_info(k, _ELEM[v.dtype], v.shape) for k, v in feeds.items()],
        [helper.make_tensor_value_info(o, dtype, None) for o in outputs if o])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    names = [o for o in outputs if o]
    values = _runner(model, model)(names, feeds)
    loss_outputs = {o: v.shape for o, v in zip(names, values)
                    if np.all(np.isfinite(v)) and (loss_on is None or o in loss_on)}
    return fdcheck.with_weighted_loss(model, loss_outputs, seed=seed), feeds


def gradients(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], wrt: Sequence[str]):
    grad_model = build_gradient_graph(model, fdcheck.LOSS, list(wrt))
    names = [f"{w}{fdcheck.GRAD_SUFFIX}" for w in wrt]
    return dict(zip(wrt, _runner(grad_model, model)(names, feeds)))


def float_inputs(feeds: Mapping[str, np.ndarray]) -> list[str]:
    return [k for k, v in feeds.items() if v.dtype == np.float64]


def assert_fd64(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], wrt=None) -> None:
    """float64 gradient graph vs float64 central differences (fdcheck's step and screen)."""
    wrt = list(wrt or float_inputs(feeds))
    report = check.compare_with_central_differences(
        model, fdcheck.LOSS, gradients(model, feeds, wrt), feeds, eps=fdcheck.FD_EPS,
        rtol=FD_TOL.rtol, atol=FD_TOL.atol, max_elements=fdcheck.MAX_ELEMENTS, float64_only=True,
        kink_screen=check.KinkScreen(fdcheck.KINK_RTOL, fdcheck.KINK_ATOL))
    rows = [fdcheck._report(row) for row in report]
    assert all(r.ok and r.checked for r in rows), fdcheck.describe(rows)


def loss_weights(model: onnx.ModelProto) -> list[np.ndarray]:
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return [inits[f"fdcheck_w_{k}"] for k in range(len(inits)) if f"fdcheck_w_{k}" in inits]


def torch_gradients(fn, feeds: Mapping[str, np.ndarray], weights: Sequence[np.ndarray]):
    """Gradients of sum_k sum(fn(**inputs)[k] * weights[k]) in float64 (bool/int feeds as is)."""
    ts = {k: torch.tensor(v, requires_grad=v.dtype == np.float64) for k, v in feeds.items()}
    outs = fn(**ts)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum(((o * torch.tensor(w)).sum() for o, w in zip(outs, weights)), torch.zeros(())).backward()
    return {k: t.grad.numpy() for k, t in ts.items() if t.requires_grad}


def assert_matches_torch(model, feeds, fn) -> None:
    ours = gradients(model, feeds, float_inputs(feeds))
    theirs = torch_gradients(fn, feeds, loss_weights(model))
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, rtol=TORCH_RTOL, atol=TORCH_ATOL, err_msg=name)


# ---- Attention: finite differences ------------------------------------------------------------


ATTENTION_INPUTS = ("q", "k", "v", "mask", "past_key", "past_value", "nonpad")


def attention_model(opset: int, attrs: dict, *, batch=2, hq=2, hkv=2, sq=3, skv=4, past=0, d=4,
                    dv=None, three_d=False, mask=None, nonpad=None, qk_mode=None, seed=0,
                    loss_on=None):
    """Attention with random float64 Q, K, V (and past K/V when ``past``); ``mask`` is an
    array (float: additive, bool) or None; returns the loss model and its feeds."""
    rng = np.random.default_rng(seed)
    dv = dv or d

    def x(*shape):
        return rng.standard_normal(shape)

    if three_d:
        attrs = dict(attrs, q_num_heads=hq, kv_num_heads=hkv)
        q, k, v = x(batch, sq, hq * d), x(batch, skv, hkv * d), x(batch, skv, hkv * dv)
    else:
        q, k, v = x(batch, hq, sq, d), x(batch, hkv, skv, d), x(batch, hkv, skv, dv)
    pk, pv = (x(batch, hkv, past, d), x(batch, hkv, past, dv)) if past else (None, None)
    outputs = ["y", "present_key" if past else "", "present_value" if past else ""]
    if qk_mode is not None:
        attrs = dict(attrs, qk_matmul_output_mode=qk_mode)
        outputs.append("qk")
    while not outputs[-1]:
        outputs.pop()
    values = (q, k, v, mask, pk, pv, nonpad)
    return op_model("Attention", opset, list(zip(ATTENTION_INPUTS, values)), attrs, outputs,
                    seed=seed, loss_on=loss_on)


@st.composite
def attention_cases(draw):
    opset = draw(st.sampled_from([23, 24, 25]))
    batch, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    sq, skv, past = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.sampled_from([0, 0, 2]))
    hq, total = hkv * group, past + skv
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    attrs = {"is_causal": draw(st.sampled_from([None, 1])),
             "scale": draw(st.sampled_from([None, 0.3, 0.8])),
             "softcap": draw(st.sampled_from([None, 1.5, 3.0]))}
    if opset >= 25:
        attrs["left_window_size"] = draw(st.sampled_from([None, 0, 2]))
        attrs["right_window_size"] = draw(st.sampled_from([None, 1]))
    mask_shape = draw(st.sampled_from([(sq, total), (1, hq, sq, total), (batch, 1, sq, total),
                                       (hq, sq, total)]))
    kind = draw(st.sampled_from(["none", "float", "bool"]))
    mask = None
    if kind == "float":
        mask = rng.standard_normal(mask_shape)
    elif kind == "bool":
        mask = rng.random(mask_shape) > 0.3
    qk_mode = draw(st.sampled_from([None, 0, 1, 2, 3]))
    nonpad = None
    # Not with qk_matmul_output: GradientPass's NameFixPass names the absent present_key/value
    # outputs before it, and onnxruntime refuses nonpad_kv_seqlen with present outputs.
    if opset >= 24 and not past and qk_mode is None and draw(st.booleans()):
        nonpad = rng.integers(1, total + 1, size=batch).astype(np.int64)
    return dict(opset=opset, attrs=attrs, batch=batch, hq=hq, hkv=hkv, sq=sq, skv=skv, past=past,
                d=draw(st.sampled_from([2, 4])), dv=draw(st.sampled_from([2, 3])),
                three_d=draw(st.booleans()), mask=mask, nonpad=nonpad,
                qk_mode=qk_mode, seed=int(rng.integers(1000)))


@HYPOTHESIS
@given(attention_cases())
def test_attention_fd(case):
    """Random layout, heads (grouped), lengths, caches, masks, causal/window, scale, softcap,
    qk_matmul_output mode: every float input (Q, K, V, float mask, past K/V) by differences."""
    opset = case.pop("opset")
    model, feeds = attention_model(opset, case.pop("attrs"), **case)
    assert_fd64(model, feeds)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_attention_qk_matmul_output_gradient(mode):
    """The qk_matmul_output alone carries the loss: its gradient enters where its value is taken."""
    mask = np.random.default_rng(1).standard_normal((3, 4))
    model, feeds = attention_model(23, {"softcap": 2.0}, hq=4, hkv=2, mask=mask, qk_mode=mode,
                                   loss_on=["qk"])
    assert_fd64(model, feeds)


def test_attention_short_mask_is_padded():
    """A float mask shorter than the keys (past + new) is padded with -inf (reference evaluator)."""
    mask = np.random.default_rng(2).standard_normal((2, 1, 3, 4))
    model, feeds = attention_model(24, {"is_causal": 1}, past=2, skv=3, mask=mask)
    assert_fd64(model, feeds)


def test_attention_fully_masked_rows_get_zero_gradient():
    mask = np.ones((3, 4), bool)
    mask[1] = False
    model, feeds = attention_model(23, {}, mask=mask)
    grads = gradients(model, feeds, ["q"])
    assert np.all(np.isfinite(grads["q"]))
    assert not np.any(grads["q"][:, :, 1, :])
    assert_fd64(model, feeds)


@pytest.mark.parametrize("opset,attrs,past,nonpad", [
    (25, {"left_window_size": 1, "right_window_size": 1}, 0, None),
    (25, {"is_causal": 1, "left_window_size": 2}, 2, None),
    (24, {"is_causal": 1}, 0, np.array([2, 4], np.int64)),
    (24, {"is_causal": 1}, 0, np.array([1, 2], np.int64)),  # offset < 0: leading rows masked
])
def test_attention_windows_and_external_cache(opset, attrs, past, nonpad):
    model, feeds = attention_model(opset, attrs, hq=4, hkv=2, sq=3, skv=4, past=past, nonpad=nonpad)
    assert_fd64(model, feeds)


def _symbolic(model: onnx.ModelProto, dims: Mapping[str, Sequence[str]]) -> onnx.ModelProto:
    """``model`` with the named graph inputs' dims made symbolic (rank kept)."""
    for vi in model.graph.input:
        if vi.name in dims:
            for dim, name in zip(vi.type.tensor_type.shape.dim, dims[vi.name]):
                dim.dim_param = name
    return model


@pytest.mark.parametrize("three_d", [False, True])
def test_attention_symbolic_dims(three_d):
    """Heads, lengths and head size unknown until run time: grouping, scale and the mask padding
    are computed from the runtime shapes."""
    mask = np.random.default_rng(3).standard_normal((1, 1, 3, 6))
    model, feeds = attention_model(24, {"is_causal": 1}, hq=4, hkv=2, skv=4, past=2, mask=mask,
                                   three_d=three_d)
    if three_d:
        dims = {"q": ["b", "sq", "hq_d"], "k": ["b", "skv", "hkv_d"], "v": ["b", "skv", "hkv_dv"]}
    else:
        dims = {"q": ["b", "hq", "sq", "d"], "k": ["b", "hkv", "skv", "d"],
                "v": ["b", "hkv", "skv", "dv"]}
    dims.update(past_key=["b", "hkv", "p", "d"], past_value=["b", "hkv", "p", "dv"],
                mask=["one", "one", "sq", "t"])
    assert_fd64(_symbolic(model, dims), feeds)


def test_attention_unsupported_qk_mode_is_refused():
    model, feeds = attention_model(23, {}, qk_mode=0)
    attr = next(a for n in model.graph.node if n.op_type == "Attention" for a in n.attribute
                if a.name == "qk_matmul_output_mode")
    attr.i = 4
    model.graph.node[0].name = "attn"
    with pytest.raises(GradientError, match="qk_matmul_output_mode=4") as info:
        build_gradient_graph(model, fdcheck.LOSS, ["q"])
    assert info.value.op_type == "Attention" and info.value.node == "attn"


def test_attention_unknown_rank_is_refused():
    model, feeds = attention_model(23, {})
    model.graph.input[0].type.tensor_type.ClearField("shape")
    with pytest.raises(GradientError, match=r"known rank 3 or 4.*Attention"):
        build_gradient_graph(model, fdcheck.LOSS, ["q"])


# ---- Attention: torch -------------------------------------------------------------------------


def _heads(t, heads):
    """(B, S, H * D) -> (B, H, S, D)."""
    return t.reshape(t.shape[0], t.shape[1], heads, -1).transpose(1, 2)


def torch_attention(*, hq, hkv, three_d=False, causal=False, softcap=0.0, scale=None, past=0):
    """torch's attention with onnx's conventions: bottom-right causal frontier (offset by the
    past length), caches concatenated, heads split from the hidden axis in the 3-D layout."""

    def fn(q, k, v, mask=None, past_key=None, past_value=None):
        if three_d:
            q, k, v = _heads(q, hq), _heads(k, hkv), _heads(v, hkv)
        keys = torch.cat([past_key, k], 2) if past_key is not None else k
        values = torch.cat([past_value, v], 2) if past_value is not None else v
        bias = mask
        if causal:
            allowed = torch.ones(q.shape[2], keys.shape[2], dtype=torch.bool).tril(diagonal=past)
            if mask is None or mask.dtype == torch.bool:
                bias = allowed if mask is None else mask & allowed
            else:
                bias = mask.masked_fill(~allowed, float("-inf"))
        if softcap:
            reps = hq // hkv
            kk, vv = keys.repeat_interleave(reps, 1), values.repeat_interleave(reps, 1)
            s = scale if scale is not None else q.shape[-1] ** -0.5
            scores = softcap * torch.tanh(q @ kk.transpose(-1, -2) * s / softcap)
            if bias is not None:
                scores = scores + (bias if bias.dtype != torch.bool else
                                   torch.zeros_like(scores).masked_fill(~bias, float("-inf")))
            y = torch.softmax(scores, -1) @ vv
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale,
                                               enable_gqa=hq != hkv)
        if three_d:
            y = y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)
        return (y, keys, values) if past_key is not None else y

    return fn


TORCH_CASES = {
    "gqa": dict(hq=4, hkv=2),
    "gqa_3d": dict(hq=6, hkv=2, three_d=True),
    "causal": dict(attrs={"is_causal": 1}, sq=4, skv=4),
    "causal_gqa_cross": dict(attrs={"is_causal": 1}, hq=4, hkv=1, sq=3, skv=5),
    "float_mask": dict(mask="float"),
    "bool_mask": dict(mask="bool"),
    "past": dict(past=3, hq=4, hkv=2),
    "past_3d_causal": dict(past=2, three_d=True, attrs={"is_causal": 1}),
    "softcap": dict(attrs={"softcap": 2.5, "scale": 0.6}),
    "softcap_gqa_causal_mask": dict(attrs={"softcap": 1.5, "is_causal": 1}, hq=4, hkv=2,
                                    mask="float", sq=4, skv=4),
}


@pytest.mark.parametrize("opset", [23, 24])
@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_attention_matches_torch(name, opset):
    case = dict(TORCH_CASES[name])
    attrs = case.pop("attrs", {})
    shape = dict(dict(batch=2, hq=2, hkv=2, sq=3, skv=4, past=0), **case)
    total = shape["past"] + shape["skv"]
    rng = np.random.default_rng(7)
    if case.get("mask") == "float":
        shape["mask"] = rng.standard_normal((shape["batch"], 1, shape["sq"], total))
    elif case.get("mask") == "bool":
        shape["mask"] = rng.random((shape["sq"], total)) > 0.4
        shape["mask"][:, 0] = True
    model, feeds = attention_model(opset, attrs, **shape)
    fn = torch_attention(hq=shape["hq"], hkv=shape["hkv"], three_d=shape.get("three_d", False),
                         causal=bool(attrs.get("is_causal")), softcap=attrs.get("softcap", 0.0),
                         scale=attrs.get("scale"), past=shape["past"])
    assert_matches_torch(model, feeds, fn)


# ---- float32 gradient graphs in onnxruntime ---------------------------------------------------


def test_attention_float32_runs_in_onnxruntime():
    """3-D grouped-query causal attention with a bool mask, as transformer exports hold it."""
    mask = np.tril(np.ones((4, 4), bool))
    model, feeds = make_model("Attention", {"q": (2, 4, 12), "k": (2, 4, 4), "v": (2, 4, 4)},
                              dict(q_num_heads=6, kv_num_heads=2, is_causal=1), opset=23,
                              consts={"mask": mask}, node_inputs=["q", "k", "v", "mask"])
    assert_fd(model, feeds)


@pytest.mark.parametrize("op,inputs,attrs,opset", [
    ("RMSNormalization", {"x": (2, 3, 8), "scale": (8,)}, {}, 23),
    ("RotaryEmbedding", {"x": (2, 3, 8), "cos": (2, 3, 4), "sin": (2, 3, 4)}, {"num_heads": 1}, 23),
    ("Swish", {"x": (3, 5)}, {"alpha": 0.7}, 24),
    ("MeanVarianceNormalization", {"x": (2, 3, 4, 5)}, {}, 13),
])
def test_float32_runs_in_onnxruntime(op, inputs, attrs, opset):
    model, feeds = make_model(op, inputs, attrs, opset=opset)
    if op == "MeanVarianceNormalization":  # no float64 oracle runs it: only check it runs
        grad = gradients(model, feeds, ["x"])["x"]
        assert grad.shape == feeds["x"].shape and np.all(np.isfinite(grad))
        return
    assert_fd(model, feeds)


# ---- RMSNormalization -----------------------------------------------------------------------------


@st.composite
def rms_cases(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 4)) for _ in range(rank))
    axis = draw(st.integers(-rank, rank - 1))
    trailing = shape[axis % rank:]
    scale_shape = draw(st.sampled_from([trailing, trailing[1:], tuple(1 for _ in trailing)]))
    attrs = {"axis": axis, "epsilon": draw(st.sampled_from([None, 1e-3, 0.5]))}
    return shape, scale_shape, attrs, draw(st.integers(0, 99))


@HYPOTHESIS
@given(rms_cases())
def test_rms_normalization_fd(case):
    shape, scale_shape, attrs, seed = case
    rng = np.random.default_rng(seed)
    model, feeds = op_model("RMSNormalization", 23, [("x", rng.standard_normal(shape)),
                                                    ("scale", rng.standard_normal(scale_shape))], attrs)
    assert_fd64(model, feeds)


# ---- RotaryEmbedding ------------------------------------------------------------------------------


@st.composite
def rotary_cases(draw):
    batch, seq, heads = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    head = draw(st.sampled_from([2, 4, 6, 8]))
    rot = draw(st.sampled_from([0] + [r for r in (2, 4, 6) if r < head]))
    half = (rot or head) // 2
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    attrs = {"interleaved": draw(st.sampled_from([None, 0, 1])), "rotary_embedding_dim": rot or None}
    if draw(st.booleans()):
        x = rng.standard_normal((batch, seq, heads * head))
        attrs["num_heads"] = heads
    else:
        x = rng.standard_normal((batch, heads, seq, head))
    if draw(st.booleans()):  # caches indexed by position_ids (repeats: scatter-add)
        positions = draw(st.integers(seq, seq + 3))
        pos = rng.integers(0, positions, size=(batch, seq)).astype(np.int64)
        cache_shape: tuple[int, ...] = (positions, half)
    else:
        pos, cache_shape = None, (batch, seq, half)
    inputs = [("x", x), ("cos", rng.standard_normal(cache_shape)),
              ("sin", rng.standard_normal(cache_shape)), ("position_ids", pos)]
    return inputs, attrs


@HYPOTHESIS
@given(rotary_cases())
def test_rotary_embedding_fd(case):
    inputs, attrs = case
    model, feeds = op_model("RotaryEmbedding", 23, inputs, attrs)
    assert_fd64(model, feeds)


# ---- Swish and MeanVarianceNormalization -------------------------------------------------------


@HYPOTHESIS
@given(st.sampled_from([None, 0.5, 1.0, 2.5]), st.integers(0, 99))
def test_swish_fd(alpha, seed):
    x = np.random.default_rng(seed).standard_normal((3, 4)) * 3
    model, feeds = op_model("Swish", 24, [("x", x)], {"alpha": alpha})
    assert_fd64(model, feeds)


@HYPOTHESIS
@given(st.sampled_from([None, [0, 2, 3], [1], [-1], [0, 1, 2, 3], [2, 3]]), st.integers(0, 99))
def test_mean_variance_normalization_matches_torch(axes, seed):
    x = np.random.default_rng(seed).standard_normal((2, 3, 4, 3))
    model, feeds = op_model("MeanVarianceNormalization", 13, [("x", x)], {"axes": axes})
    dims = tuple(axes if axes is not None else [0, 2, 3])

    def mvn(x):
        mean = x.mean(dims, keepdim=True)
        std = torch.sqrt((x * x).mean(dims, keepdim=True) - mean * mean)
        return (x - mean) / (std + 1e-9)

    assert_matches_torch(model, feeds, mvn)
