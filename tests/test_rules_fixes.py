"""DeformConv, the Softmax family's NaN rows, LpNormalization's zero slices, Range and OneHot.

Oracles: float64 central differences (``fdcheck``; onnxruntime runs 2-D DeformConv in float32
and float64). DeformConv over 1 or 3 spatial axes, which no runtime runs (onnxruntime and the
reference evaluator take 2-D only), is checked against a numpy forward (itself checked against
onnxruntime in 2-D): the gradient graph runs in onnxruntime with the DeformConv node's output
fed from numpy, the central differences are numpy's. LpNormalization next to a zero slice is
checked against a numpy forward too (the zero slice has no derivative: its central difference
grows like 1 / step, which the shared check would compare).
"""

from __future__ import annotations

import collections
import itertools
import os

import fdcheck
import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from single_op import assert_fd, loss_weight, make_model, onnx_grads

from gradgraph.api import build_gradient_graph
from passes.autodiff import GradientError, lookup

EXAMPLES = int(os.environ.get("FIXES_RULE_EXAMPLES", "12"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    derandomize="FIXES_RULE_RANDOM" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
SEEDS = st.integers(0, 2**31 - 1)
GRAD_OF = "gradgraph.grad_of"
# numpy-oracle central differences (float64 forward, float64 step)
NP_STEP = 1e-6
NP_ATOL, NP_RTOL = 1e-4, 1e-3


def ints(values) -> np.ndarray:
    return np.asarray(values, np.int64)


# ---- DeformConv ------------------------------------------------------------------------------


def deform_conv_np(x, w, offset, bias=None, mask=None, *, strides, pads, dilations, group=1, offset_group=1):
    """N-D DeformConv in float64: bilinear (multilinear) samples with zeros outside X."""
    x, w, offset = (np.asarray(a, np.float64) for a in (x, w, offset))
    n, c = x.shape[:2]
    m, kernel = w.shape[0], w.shape[2:]
    dims, sizes, out = len(kernel), x.shape[2:], offset.shape[2:]
    taps = list(itertools.product(*[range(k) for k in kernel]))
    off = offset.reshape(n, offset_group, len(taps), dims, *out)
    msk = np.ones((n, offset_group, len(taps), *out)) if mask is None else \
        np.asarray(mask, np.float64).reshape(n, offset_group, len(taps), *out)
    cols = np.zeros((n, c, len(taps), *out))
    per_og = c // offset_group
    for b_, ch, (t, tap) in itertools.product(range(n), range(c), enumerate(taps)):
        og = ch // per_og
        for o in itertools.product(*[range(s) for s in out]):
            p = [o[a] * strides[a] - pads[a] + tap[a] * dilations[a] + off[(b_, og, t, a, *o)] for a in range(dims)]
            base = [int(np.floor(v)) for v in p]
            value = 0.0
            for bits in itertools.product((0, 1), repeat=dims):
                idx = [base[a] + bits[a] for a in range(dims)]
                if not all(0 <= idx[a] < sizes[a] for a in range(dims)):
                    continue
                weight = np.prod([(p[a] - base[a]) if bits[a] else 1.0 - (p[a] - base[a]) for a in range(dims)])
                value += weight * x[(b_, ch, *idx)]
            cols[(b_, ch, t, *o)] = value * msk[(b_, og, t, *o)]
    per_g, m_per_g = c // group, m // group
    y = np.zeros((n, m, *out))
    wf = w.reshape(m, per_g, len(taps))
    for oc in range(m):
        grp = oc // m_per_g
        y[:, oc] = np.einsum("ck,nck...->n...", wf[oc], cols[:, grp * per_g:(grp + 1) * per_g])
    if bias is not None:
        y += np.asarray(bias, np.float64).reshape((1, m) + (1,) * dims)
    return y


@st.composite
def deform_case(draw, dims: int = 2):
    group, offset_group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    channels = int(np.lcm(group, offset_group)) * draw(st.integers(1, 2))
    outs = group * draw(st.integers(1, 2))
    n = draw(st.integers(1, 2))
    kernel = [draw(st.integers(1, 3)) for _ in range(dims)]
    strides = [draw(st.integers(1, 2)) for _ in range(dims)]
    dilations = [draw(st.integers(1, 2)) for _ in range(dims)]
    pads = [draw(st.integers(0, 1)) for _ in range(2 * dims)]
    lows = [max(1, (k - 1) * d + 1 - pads[a] - pads[dims + a]) for a, (k, d) in enumerate(zip(kernel, dilations))]
    sizes = [draw(st.integers(low, max(low, 5 if dims < 3 else 3))) for low in lows]
    out = [(s + pads[a] + pads[dims + a] - ((k - 1) * d + 1)) // st_ + 1
           for a, (s, k, d, st_) in enumerate(zip(sizes, kernel, dilations, strides))]
    taps = int(np.prod(kernel))
    rng = np.random.default_rng(draw(SEEDS))
    arrays = {
        "x": rng.standard_normal((n, channels, *sizes)),
        "w": rng.standard_normal((outs, channels // group, *kernel)),
        # up to 2 pixels away: some samples land partly or wholly outside X
        "offset": rng.uniform(-2.0, 2.0, (n, offset_group * taps * dims, *out)),
        "bias": rng.standard_normal(outs) if draw(st.booleans()) else None,
        "mask": rng.uniform(-1.0, 1.5, (n, offset_group * taps, *out)) if draw(st.booleans()) else None,
    }
    attrs = {"kernel_shape": kernel, "strides": strides, "dilations": dilations, "pads": pads,
             "group": group, "offset_group": offset_group}
    if draw(st.booleans()):
        del attrs["kernel_shape"]  # read from W's shape
    return {k: None if v is None else v.astype(np.float32) for k, v in arrays.items()}, attrs


def deform_model(arrays, attrs, opset: int = 19):
    present = [k for k in ("x", "w", "offset", "bias", "mask") if arrays[k] is not None]
    shapes = {k: arrays[k].shape for k in present}
    order = [k if arrays[k] is not None else "" for k in ("x", "w", "offset", "bias", "mask")]
    while order[-1] == "":
        order.pop()
    return make_model("DeformConv", shapes, attrs, opset=opset, node_inputs=order,
                      fixed={k: arrays[k] for k in present})


@SETTINGS
@given(deform_case(), st.sampled_from([19, 22]), st.data())
def test_deform_conv(case, opset, data):
    """Every input, or a subset (the rule skips the products only the others need)."""
    arrays, attrs = case
    model, feeds = deform_model(arrays, attrs, opset)
    names = list(feeds)
    wrt = data.draw(st.sampled_from([names, *([n] for n in names)]))
    assert_fd(model, feeds, wrt)


def test_deform_conv_numpy_forward_matches_onnxruntime():
    """The numpy oracle of the 1-D/3-D tests computes what onnxruntime does in 2-D."""
    rng = np.random.default_rng(5)
    attrs = dict(strides=[2, 1], pads=[1, 0, 1, 1], dilations=[1, 2], group=2, offset_group=2)
    arrays = {"x": rng.standard_normal((2, 4, 5, 4)), "w": rng.standard_normal((4, 2, 2, 2)),
              "offset": rng.uniform(-2, 2, (2, 16, 3, 3)), "bias": rng.standard_normal(4),
              "mask": rng.uniform(-1, 1, (2, 8, 3, 3))}
    model, feeds = deform_model({k: v.astype(np.float32) for k, v in arrays.items()}, attrs)
    got = fdcheck.session(model).run(["y"], feeds)[0]
    want = deform_conv_np(feeds["x"], feeds["w"], feeds["offset"], feeds["bias"], feeds["mask"], **attrs)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _grads_with_fed_forward(model, feeds, y):
    """The gradient graph with the DeformConv node removed and its output fed (no runtime runs
    DeformConv on 1 or 3 spatial axes; the rule never reads Y)."""
    grad_model = build_gradient_graph(model, fdcheck.LOSS, list(feeds))
    node = next(nd for nd in grad_model.graph.node if nd.op_type == "DeformConv")
    grad_model.graph.node.remove(node)
    grad_model.graph.input.append(helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None))
    names = [f"{k}{fdcheck.GRAD_SUFFIX}" for k in feeds]
    values = fdcheck.session(grad_model).run(names, {**feeds, node.output[0]: y.astype(np.float32)})
    return dict(zip(feeds, values))


@SETTINGS
@given(st.sampled_from([1, 3]).flatmap(lambda d: deform_case(d)))
def test_deform_conv_other_ranks_numpy(case):
    arrays, attrs = case
    present = {k: v for k, v in arrays.items() if v is not None}
    names = ("x", "w", "offset", "bias", "mask")
    node = helper.make_node("DeformConv", [k if arrays[k] is not None else "" for k in names], ["y"], **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape) for k, v in present.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    np_attrs = {k: v for k, v in attrs.items() if k != "kernel_shape"}

    def forward(values):
        return deform_conv_np(values["x"], values["w"], values["offset"], values.get("bias"),
                              values.get("mask"), **np_attrs)

    y = forward(present)
    model = fdcheck.with_weighted_loss(model, {"y": y.shape})
    weight = loss_weight(model).astype(np.float64)
    got = _grads_with_fed_forward(model, present, y)
    rng = np.random.default_rng(0)
    for name, value in present.items():
        flat = value.astype(np.float64).reshape(-1)
        for k in rng.choice(flat.size, size=min(12, flat.size), replace=False):
            losses = []
            for sign in (1, -1):
                bumped = flat.copy()
                bumped[k] += sign * NP_STEP
                losses.append(float(np.sum(forward({**present, name: bumped.reshape(value.shape)}) * weight)))
            numeric = (losses[0] - losses[1]) / (2 * NP_STEP)
            analytic = float(got[name].reshape(-1)[k])
            assert abs(analytic - numeric) <= NP_ATOL + NP_RTOL * abs(numeric), (
                f"{name}[{k}]: analytic {analytic:.7g} vs numeric {numeric:.7g}")


def test_deform_conv_only_some_inputs():
    """Gradients of offset and mask only (X and W fixed): no dX scatter, no dW product."""
    rng = np.random.default_rng(2)
    arrays = {"x": rng.standard_normal((1, 2, 4, 4)), "w": rng.standard_normal((3, 2, 2, 2)),
              "offset": rng.uniform(-1.5, 1.5, (1, 8, 3, 3)), "bias": None,
              "mask": rng.uniform(0, 1, (1, 4, 3, 3))}
    model, feeds = deform_model({k: None if v is None else v.astype(np.float32) for k, v in arrays.items()},
                                {"kernel_shape": [2, 2]})
    assert_fd(model, feeds, ["offset", "mask"])
    grad_model = build_gradient_graph(model, fdcheck.LOSS, ["offset", "mask"])
    ops = collections.Counter(nd.op_type for nd in grad_model.graph.node)
    assert ops["ScatterElements"] == 0


def test_deform_conv_refuses_unknown_kernel():
    node = helper.make_node("DeformConv", ["x", "w", "offset"], ["y"])
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 2, "kh", "kw"]),
         helper.make_tensor_value_info("offset", TensorProto.FLOAT, [1, "o", 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    model.graph.node.append(helper.make_node("ReduceSum", ["y"], [fdcheck.LOSS], keepdims=0))
    model.graph.output.append(helper.make_tensor_value_info(fdcheck.LOSS, TensorProto.FLOAT, []))
    with pytest.raises(GradientError, match="static kernel shape"):
        build_gradient_graph(model, fdcheck.LOSS, ["x"])


# ---- Softmax / LogSoftmax: NaN rows behind a guard -------------------------------------------


def _grad_node_counts(model: onnx.ModelProto, node_name: str) -> collections.Counter:
    grad_model = build_gradient_graph(model, fdcheck.LOSS, ["x"])
    return collections.Counter(nd.op_type for nd in grad_model.graph.node
                               if any(p.key == GRAD_OF and p.value == node_name for p in nd.metadata_props))


def _plain(op: str) -> onnx.ModelProto:
    return onnx.parser.parse_model(f"""
    <ir_version: 10, opset_import: ["" : 21]>
    g (float[2, 3, 5] x, float[2, 3, 5] r) => (float {fdcheck.LOSS}) {{
      y = {op} <axis=-1> (x)
      yr = Mul(y, r)
      {fdcheck.LOSS} = ReduceSum<keepdims=0>(yr)
    }}""")


# Nodes of the gradient of one unguarded Softmax / LogSoftmax before the NaN guard existed:
# Mul, ReduceSum (+ its axes Constant), Sub, Mul / Exp, ReduceSum (+ Constant), Mul, Sub.
HOT_PATH_NODES = {"Softmax": {"Mul": 2, "Constant": 1, "ReduceSum": 1, "Sub": 1},
                  "LogSoftmax": {"Exp": 1, "Constant": 1, "ReduceSum": 1, "Mul": 1, "Sub": 1}}


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_hot_path_unchanged(op):
    model = _plain(op)
    model.graph.node[0].name = "sm"
    assert dict(_grad_node_counts(model, "sm")) == HOT_PATH_NODES[op]


def _masked(op: str, guard: str) -> onnx.ModelProto:
    """Scores with a boolean mask (-inf where masked), op over the last axis, a guard that
    zeroes what the masked rows give (NaN), as expanded Attention does."""
    if guard == "row":  # Where(row all masked, 0, Cast(y)): Attention's expansion
        tail = """
      yc = Cast<to=1>(y)
      zero = CastLike(fzero, yc)
      last = Constant<value = int64[1] {-1}>()
      none = ReduceMax<keepdims=1>(mf, last)
      row_off = Less(none, half)
      safe = Where(row_off, zero, yc)"""
    else:  # Where(mask, y, 0) through an Identity: also zeroes -inf log-probabilities
        tail = """
      yi = Identity(y)
      safe = Where(mask, yi, fzero)"""
    return onnx.parser.parse_model(f"""
    <ir_version: 10, opset_import: ["" : 21]>
    g (float[3, 4] x, bool[3, 4] mask, float[3, 4] r) => (float {fdcheck.LOSS}) {{
      ninf = Constant<value = float {{-inf}}>()
      fzero = Constant<value = float {{0.0}}>()
      half = Constant<value = float {{0.5}}>()
      mf = Cast<to=1>(mask)
      s = Where(mask, x, ninf)
      y = {op}<axis=-1>(s){tail}
      sr = Mul(safe, r)
      {fdcheck.LOSS} = ReduceSum<keepdims=0>(sr)
    }}""")


@pytest.mark.parametrize("op,guard", [("Softmax", "row"), ("Softmax", "element"), ("LogSoftmax", "element")])
def test_softmax_fully_masked_row(op, guard):
    model = _masked(op, guard)
    model.graph.node[5].name = "sm"
    rng = np.random.default_rng(0)
    mask = np.array([[True, False, True, True], [False] * 4, [True, True, False, False]])
    feeds = {"x": rng.standard_normal((3, 4)).astype(np.float32), "mask": mask,
             "r": rng.standard_normal((3, 4)).astype(np.float32)}
    grad = onnx_grads(model, feeds, ["x"])["x"]
    assert np.isfinite(grad).all()
    assert not grad[1].any() and not grad[~mask].any()
    reports = fdcheck.compare_gradients(model, ["x"], feeds, fdcheck.FLOAT32_TOL)
    assert all(r.ok and r.checked for r in reports), fdcheck.describe(reports)
    assert _grad_node_counts(model, "sm")["IsNaN"] == 1


def test_softmax_guard_ignores_other_consumers():
    """A Where on the scores (before the softmax) is no guard of its output."""
    model = onnx.parser.parse_model(f"""
    <ir_version: 10, opset_import: ["" : 21]>
    g (float[3, 4] x, bool[3, 4] mask, float[3, 4] r) => (float {fdcheck.LOSS}) {{
      low = Constant<value = float {{-1e4}}>()
      s = Where(mask, x, low)
      y = Softmax<axis=-1>(s)
      yc = Cast<to=1>(y)
      sr = Mul(yc, r)
      {fdcheck.LOSS} = ReduceSum<keepdims=0>(sr)
    }}""")
    model.graph.node[2].name = "sm"
    assert dict(_grad_node_counts(model, "sm")) == HOT_PATH_NODES["Softmax"]


# ---- LpNormalization: zero slices -------------------------------------------------------------


def _lp_normalize(x, p, axis):
    norm = np.sum(np.abs(x) ** p, axis=axis, keepdims=True) ** (1.0 / p)
    return np.where(norm == 0, 0.0, x / np.where(norm == 0, 1.0, norm))


@SETTINGS
@given(p=st.sampled_from([1, 2]), rank=st.integers(2, 3), data=st.data())
def test_lp_normalization_zero_slice(p, rank, data):
    """The zero slice gets a zero gradient; every other element matches the central difference."""
    shape = tuple(data.draw(st.integers(2, 3)) for _ in range(rank))
    axis = data.draw(st.integers(-rank, rank - 1))
    x = np.random.default_rng(data.draw(SEEDS)).standard_normal(shape).astype(np.float32)
    first = tuple(0 if i != axis % rank else slice(None) for i in range(rank))
    x[first] = 0.0  # one slice along ``axis`` all zeros
    model, feeds = make_model("LpNormalization", {"x": shape}, {"p": p, "axis": axis}, opset=22, fixed={"x": x})
    got = onnx_grads(model, feeds)["x"]
    assert np.isfinite(got).all() and not got[first].any()
    weight = loss_weight(model).astype(np.float64)
    x64 = x.astype(np.float64)
    outside = np.ones(shape, bool)
    outside[first] = False
    for k in np.flatnonzero(outside):
        losses = []
        for sign in (1, -1):
            bumped = x64.copy().reshape(-1)
            bumped[k] += sign * NP_STEP
            losses.append(float(np.sum(_lp_normalize(bumped.reshape(shape), p, axis) * weight)))
        numeric = (losses[0] - losses[1]) / (2 * NP_STEP)
        analytic = float(got.reshape(-1)[k])
        assert abs(analytic - numeric) <= NP_ATOL + NP_RTOL * abs(numeric), (
            f"x[{k}]: analytic {analytic:.7g} vs numeric {numeric:.7g}")


# ---- Range / OneHot ------------------------------------------------------------------------------


def test_range_and_one_hot_are_rules_now():
    assert lookup("", "Range", 21).diff_inputs == (0, 2)
    assert lookup("", "OneHot", 21).diff_inputs == (2,)


@SETTINGS
@given(start=st.floats(-2, 2), delta=st.sampled_from([0.5, 1.0, -0.7, 1.3]), count=st.integers(1, 6),
       opset=st.sampled_from([13, 21]))
def test_range(start, delta, count, opset):
    """limit half a step past the last element: the count does not move within the FD step."""
    limit = start + delta * (count - 0.5)
    fixed = {k: np.asarray(v, np.float32) for k, v in (("start", start), ("limit", limit), ("delta", delta))}
    model, feeds = make_model("Range", {"start": (), "limit": (), "delta": ()}, {}, opset=opset, fixed=fixed)
    grads = onnx_grads(model, feeds, ["start", "delta"])
    weight = loss_weight(model).astype(np.float64)
    assert grads["start"].shape == ()
    np.testing.assert_allclose(grads["start"], weight.sum(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads["delta"], (weight * np.arange(weight.size)).sum(), rtol=1e-5, atol=1e-5)
    assert_fd(model, feeds, ["start", "delta"])


@SETTINGS
@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=2), depth=st.integers(1, 4), data=st.data())
def test_one_hot(shape, depth, data):
    rng = np.random.default_rng(data.draw(SEEDS))
    # out-of-range indices (all off) too
    indices = ints(rng.integers(-depth - 1, depth + 1, shape))
    axis = data.draw(st.integers(-len(shape) - 1, len(shape)))
    model, feeds = make_model("OneHot", {"values": (2,)}, {"axis": axis}, opset=data.draw(st.sampled_from([13, 21])),
                              consts={"indices": indices, "depth": ints(depth)},
                              node_inputs=["indices", "depth", "values"])
    assert_fd(model, feeds)
    got = onnx_grads(model, feeds)["values"]
    weight = loss_weight(model).astype(np.float64)
    position = np.where(indices < 0, indices + depth, indices)
    valid = (position >= 0) & (position < depth)
    hot = np.moveaxis(np.eye(depth)[np.clip(position, 0, depth - 1)] * valid[..., None], -1, axis % (len(shape) + 1))
    np.testing.assert_allclose(got, [(weight * (1 - hot)).sum(), (weight * hot).sum()], rtol=1e-5, atol=1e-5)


def test_one_hot_float64_values():
    """The hot mask is the forward op on values (0, 1) in the values' own dtype."""
    node = helper.make_node("OneHot", ["indices", "depth", "values"], ["y"], axis=-1)
    graph = helper.make_graph(
        [node, helper.make_node("Mul", ["y", "r"], ["yr"]),
         helper.make_node("ReduceSum", ["yr"], [fdcheck.LOSS], keepdims=0)], "g",
        [helper.make_tensor_value_info("values", TensorProto.DOUBLE, [2])],
        [helper.make_tensor_value_info(fdcheck.LOSS, TensorProto.DOUBLE, [])],
        [numpy_helper.from_array(ints([0, 2, 1]), "indices"), numpy_helper.from_array(ints(3), "depth"),
         numpy_helper.from_array(np.arange(9.0).reshape(3, 3), "r")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=9)
    grad_model = build_gradient_graph(model, fdcheck.LOSS, ["values"])
    # onnxruntime has no float64 OneHot: the reference evaluator runs it
    got = ReferenceEvaluator(grad_model).run([f"values{fdcheck.GRAD_SUFFIX}"], {"values": np.array([0.5, 2.0])})[0]
    np.testing.assert_allclose(got, [36.0 - 0 - 5 - 7, 0 + 5 + 7])  # r = 0..8; hot at r[0], r[5], r[7]


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_with_int32_indices(axis):
    """int32 indices, negative and repeated: the rule's index arithmetic and ScatterND are int64
    (an int32 index met an int64 size in an Add: an invalid gradient graph)."""
    idx = np.array([[0, -1], [2, 0]], np.int32)
    model, feeds = make_model("Gather", {"x": (3, 4)}, {"axis": axis}, consts={"idx": idx})
    assert_fd(model, feeds, ["x"])


@pytest.mark.parametrize("domain", ["", "com.microsoft"])
def test_tanh_gelu_gradient_is_finite_in_float16(domain: str) -> None:
    """The tanh GELU's derivative (ONNX Gelu approximate="tanh", com.microsoft FastGelu) computed
    in float16, node by node as a float16 GPU kernel would: finite for any finite x, equal to
    the float64 formula where x is moderate and to its limits 0 / 1 far out. Unclipped, x^2
    overflowed from 256 and 0 * inf made it NaN from x ~ -86."""
    from gradgraph.runtime.reference_kernels import REFERENCE_OVERRIDES
    node = (helper.make_node("FastGelu", ["x"], ["y"], domain=domain) if domain
            else helper.make_node("Gelu", ["x"], ["y"], approximate="tanh"))
    graph = helper.make_graph([node, helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [14])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT16, [])])
    opsets = [helper.make_opsetid("", 20)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=opsets, ir_version=9))
    grad = build_gradient_graph(model, "loss", ["x"])
    x = np.array([-6e4, -300, -100, -86, -20, -3, -1, 0.5, 1, 3, 20, 100, 300, 6e4], np.float16)
    with np.errstate(all="ignore"):
        (dx,) = ReferenceEvaluator(grad, new_ops=REFERENCE_OVERRIDES).run(["x_grad"], {"x": x})
    k, a, x64 = np.sqrt(2 / np.pi), 0.044715, x.astype(np.float64)
    t = np.tanh(k * (x64 + a * x64 ** 3))
    want = 0.5 * (1 + t) + 0.5 * x64 * (1 - t * t) * k * (1 + 3 * a * x64 * x64)
    assert dx.dtype == np.float16 and np.isfinite(dx).all(), dx
    np.testing.assert_allclose(dx.astype(np.float64), want, rtol=4e-3, atol=2e-3)


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin", "ReduceProd", "ReduceMean", "ReduceL2",
                                "ReduceLogSumExp", "ReduceSumSquare"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_an_explicit_empty_axes_attribute_reduces_every_axis(op, keepdims):
    """Before opset 18 ``axes=[]`` (torch's legacy export of ``t.amax()`` / ``t.amin()``) reduces
    every axis, as no attribute does; the rules read it as "no axis" (a NaN or wrong gradient).
    Against float64 central differences."""
    model, feeds = make_model(op, {"x": (3, 4)}, {"keepdims": keepdims}, opset=17)
    node = next(n for n in model.graph.node if n.op_type == op)
    node.attribute.append(helper.make_attribute("axes", [], attr_type=onnx.AttributeProto.INTS))
    assert ReferenceEvaluator(model).run(["y"], feeds)[0].size == 1  # the runtime's meaning: all axes
    assert_fd(model, feeds)
