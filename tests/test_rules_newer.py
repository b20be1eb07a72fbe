"""Gradient rules of passes/autodiff/rules/newer.py, and the scatter reductions, MaxPool's
storage_order=1 and SpaceToDepth's CRD mode: hypothesis-drawn shapes and attributes against
float64 central differences (``fdcheck``: onnxruntime, or the reference evaluator where
onnxruntime has no float64 kernel), or other oracles where those are wrong or missing:

- ops linear in their input (AffineGrid, CenterCropPad, Compress, MaxUnpool, SpaceToDepth):
  the exact linear check in onnxruntime (``assert_linear_fd``); MaxUnpool's reference kernel
  lays out ``output_shape`` differently from onnxruntime's;
- LRN and GlobalLpPool: torch float64 autograd. The reference LRN loops over the batch axis
  instead of the channels (right only when N >= C), and nothing runs GlobalLpPool in float64
  (nor at all from opset 22: onnxruntime's kernel is opset 2's, the reference has none);
- Col2Im is checked against the reference evaluator: onnxruntime's 3-D Col2Im with dilations
  is wrong (it disagrees with the reference and with a direct loop).
"""

from __future__ import annotations

import os

import fdcheck
import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper
from onnx.reference import ReferenceEvaluator
from single_op import (
    assert_fd,
    assert_linear_fd,
    assert_matches_torch,
    loss_weight,
    make_model,
    onnx_grads,
)

from gradgraph.api import build_gradient_graph
from passes.autodiff import GradientError, lookup

# Set NEWER_RULE_EXAMPLES for more examples per test (and NEWER_RULE_RANDOM for fresh ones).
EXAMPLES = int(os.environ.get("NEWER_RULE_EXAMPLES", "20"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    derandomize="NEWER_RULE_RANDOM" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
SEEDS = st.integers(0, 2**31 - 1)


def ints(values) -> np.ndarray:
    return np.asarray(values, np.int64)


# ---- GridSample / AffineGrid --------------------------------------------------------------------


@st.composite
def grid_sample_case(draw):
    mode = draw(st.sampled_from(["nearest", "linear", "cubic"]))
    dims = 2 if mode == "cubic" else draw(st.sampled_from([2, 3]))
    opset = draw(st.sampled_from([20, 22]))
    attrs = {"mode": mode, "padding_mode": draw(st.sampled_from(["zeros", "border", "reflection"])),
             "align_corners": draw(st.integers(0, 1))}
    spatial = tuple(draw(st.integers(1, 4)) for _ in range(dims))
    out = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    n, c = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    # beyond [-1, 1] too, so that every padding mode maps some coordinates (reflection: twice)
    grid = np.random.default_rng(draw(SEEDS)).uniform(-2.6, 2.6, (n, *out, dims)).astype(np.float32)
    return {"x": (n, c, *spatial), "grid": grid.shape}, attrs, opset, grid


@SETTINGS
@given(grid_sample_case())
def test_grid_sample(case):
    shapes, attrs, opset, grid = case
    model, feeds = make_model("GridSample", shapes, attrs, opset=opset, fixed={"grid": grid})
    assert_fd(model, feeds)


@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_grid_sample_larger_image(mode, padding):
    """More taps inside the image than the random cases' small sides give."""
    grid = np.random.default_rng(3).uniform(-1.2, 1.2, (2, 3, 4, 2)).astype(np.float32)
    model, feeds = make_model("GridSample", {"x": (2, 3, 6, 7), "grid": grid.shape},
                              {"mode": mode, "padding_mode": padding}, opset=22, fixed={"grid": grid})
    assert_fd(model, feeds)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_grid_sample_opset_16_names(mode):
    """Opset 16 says bilinear/bicubic (no float64 kernel, no reference): same as opset 22's."""
    grid = np.random.default_rng(1).uniform(-1.3, 1.3, (2, 3, 2, 2)).astype(np.float32)
    old = {"mode": {"linear": "bilinear", "cubic": "bicubic"}.get(mode, mode), "padding_mode": "border"}
    grads = [onnx_grads(*make_model("GridSample", {"x": (2, 2, 4, 3), "grid": grid.shape}, attrs,
                                     opset=opset, fixed={"grid": grid}))
             for attrs, opset in [(old, 16), (dict(old, mode=mode), 22)]]
    for name in ("x", "grid"):
        np.testing.assert_array_equal(grads[0][name], grads[1][name])


def test_grid_sample_nearest_grid_gradient_is_zero():
    grid = np.random.default_rng(0).uniform(-1, 1, (1, 2, 3, 2)).astype(np.float32)
    model, feeds = make_model("GridSample", {"x": (1, 2, 4, 4), "grid": grid.shape}, {"mode": "nearest"},
                              opset=22, fixed={"grid": grid})
    assert not onnx_grads(model, feeds, ["grid"])["grid"].any()


@SETTINGS
@given(dims=st.sampled_from([2, 3]), align=st.integers(0, 1), sizes=st.lists(st.integers(1, 4), min_size=3,
                                                                             max_size=3))
def test_affine_grid(dims, align, sizes):
    size = ints([2, 3, *sizes[:dims]])
    model, feeds = make_model("AffineGrid", {"theta": (2, dims, dims + 1)}, {"align_corners": align},
                              opset=20, consts={"size": size})
    assert_linear_fd(model, feeds)


def test_affine_grid_into_grid_sample():
    """theta -> AffineGrid -> GridSample(X): the gradients of X and theta through both rules."""
    model = onnx.parser.parse_model(f"""
    <ir_version: 10, opset_import: ["" : 22]>
    g (float[2, 3, 5, 4] x, float[2, 2, 3] theta, float[2, 3, 4, 3] r) => (float {fdcheck.LOSS}) {{
      size = Constant<value = int64[4] {{2, 3, 4, 3}}>()
      grid = AffineGrid<align_corners=1>(theta, size)
      y = GridSample<mode="cubic", padding_mode="border">(x, grid)
      yr = Mul(y, r)
      {fdcheck.LOSS} = ReduceSum<keepdims=0>(yr)
    }}""")
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, 5, 4)).astype(np.float32),
             "theta": rng.uniform(-1, 1, (2, 2, 3)).astype(np.float32),
             "r": rng.standard_normal((2, 3, 4, 3)).astype(np.float32)}
    assert_fd(model, feeds, ["x", "theta"])


# ---- data movement -------------------------------------------------------------------------------


@SETTINGS
@given(dims=st.integers(1, 3), data=st.data())
def test_col2im(dims, data):
    draw = data.draw
    image = [draw(st.integers(2, 5)) for _ in range(dims)]
    block = [draw(st.integers(1, 3)) for _ in range(dims)]
    strides = [draw(st.integers(1, 2)) for _ in range(dims)]
    dilations = [draw(st.integers(1, 2)) for _ in range(dims)]
    pads = [draw(st.integers(0, 1)) for _ in range(2 * dims)]
    blocks = 1
    for i in range(dims):
        span = (block[i] - 1) * dilations[i] + 1
        count = (image[i] + pads[i] + pads[dims + i] - span) // strides[i] + 1
        if count < 1:
            block[i], dilations[i], count = 1, 1, (image[i] + pads[i] + pads[dims + i] - 1) // strides[i] + 1
        blocks *= count
    channels = draw(st.integers(1, 2))
    attrs = dict(strides=strides, dilations=dilations, pads=pads)
    model, feeds = make_model("Col2Im", {"x": (2, channels * int(np.prod(block)), blocks)}, attrs, opset=18,
                              consts={"image_shape": ints(image), "block_shape": ints(block)})
    assert_fd(model, feeds)


@SETTINGS
@given(rank=st.integers(1, 3), data=st.data())
def test_center_crop_pad(rank, data):
    shape = tuple(data.draw(st.integers(1, 5)) for _ in range(rank))
    axes = data.draw(st.none() | st.lists(st.integers(-rank, rank - 1), min_size=1, max_size=rank,
                                          unique_by=lambda a: a % rank))
    count = rank if axes is None else len(axes)
    target = ints([data.draw(st.integers(1, 7)) for _ in range(count)])
    attrs = {} if axes is None else {"axes": axes}
    model, feeds = make_model("CenterCropPad", {"x": shape}, attrs, opset=18, consts={"shape": target})
    assert_linear_fd(model, feeds)


@SETTINGS
@given(rank=st.integers(1, 3), data=st.data())
def test_compress(rank, data):
    shape = tuple(data.draw(st.integers(1, 4)) for _ in range(rank))
    axis = data.draw(st.none() | st.integers(-rank, rank - 1))
    length = int(np.prod(shape)) if axis is None else shape[axis]
    cond = data.draw(st.lists(st.booleans(), min_size=1, max_size=length))
    attrs = {} if axis is None else {"axis": axis}
    opset = data.draw(st.sampled_from([13, 28]))
    model, feeds = make_model("Compress", {"x": shape}, attrs, opset=opset,
                              consts={"condition": np.array(cond)})
    assert_linear_fd(model, feeds)


@st.composite
def max_unpool_case(draw):
    """Indices from a MaxPool of another tensor; overlapping windows repeat indices."""
    dims = draw(st.integers(1, 2))
    kernel = [draw(st.integers(1, 3)) for _ in range(dims)]
    strides = [draw(st.integers(1, 2)) for _ in range(dims)]
    source = (2, 2, *(draw(st.integers(k, k + 3)) for k in kernel))
    pooled = ReferenceEvaluator(helper.make_node(
        "MaxPool", ["s"], ["y", "i"], kernel_shape=kernel, strides=strides))
    rng = np.random.default_rng(draw(SEEDS))
    y, indices = pooled.run(None, {"s": rng.standard_normal(source).astype(np.float32)})
    inferred = (2, 2, *((o - 1) * s + k for o, s, k in zip(y.shape[2:], strides, kernel)))
    output_shape = source if inferred != source or draw(st.booleans()) else None
    return kernel, strides, y.shape, indices, output_shape


@SETTINGS
@given(max_unpool_case())
def test_max_unpool(case):
    kernel, strides, x_shape, indices, output_shape = case
    consts = {"i": indices.astype(np.int64)}
    if output_shape is not None:
        consts["output_shape"] = ints(output_shape)
    model, feeds = make_model("MaxUnpool", {"x": x_shape}, dict(kernel_shape=kernel, strides=strides),
                              opset=22, consts=consts)
    assert_linear_fd(model, feeds)


def test_max_unpool_repeated_index_gets_one_gradient():
    indices = ints([[[[5, 5], [5, 10]]]])  # three writes to position 5: one survives
    model, feeds = make_model("MaxUnpool", {"x": (1, 1, 2, 2)}, dict(kernel_shape=[2, 2], strides=[2, 2]),
                              opset=22, consts={"i": indices})
    grad = onnx_grads(model, feeds)["x"].reshape(-1)
    assert np.count_nonzero(grad[:3]) == 1 and grad[3] == loss_weight(model).reshape(-1)[10]


# ---- normalizations and pools --------------------------------------------------------------------


@SETTINGS
@given(rank=st.integers(1, 4), p=st.sampled_from([1, 2]), data=st.data())
def test_lp_normalization(rank, p, data):
    shape = tuple(data.draw(st.integers(1, 4)) for _ in range(rank))
    axis = data.draw(st.integers(-rank, rank - 1))
    opset = data.draw(st.sampled_from([13, 22]))
    model, feeds = make_model("LpNormalization", {"x": shape}, {"p": p, "axis": axis}, opset=opset)
    assert_fd(model, feeds)


def test_lp_normalization_refuses_other_p():
    model, feeds = make_model("LpNormalization", {"x": (2, 3)}, {"p": 2}, opset=13)
    model.graph.node[0].attribute[0].i = 3  # no runtime takes p=3; the rule must refuse it
    with pytest.raises(GradientError, match="p=1 or p=2"):
        build_gradient_graph(model, fdcheck.LOSS, ["x"])


@SETTINGS
@given(size=st.sampled_from([1, 3, 5]), channels=st.integers(1, 6), alpha=st.floats(1e-3, 2.0),
       beta=st.floats(0.3, 1.5), bias=st.floats(0.5, 2.0))
def test_lrn(size, channels, alpha, beta, bias):
    """onnxruntime runs odd sizes on 4-D inputs only; torch pads the window as ONNX does then."""
    model, feeds = make_model("LRN", {"x": (2, channels, 3, 2)},
                              dict(size=size, alpha=alpha, beta=beta, bias=bias), opset=13)
    assert_matches_torch(model, feeds, lambda x: F.local_response_norm(x, size, alpha, beta, bias))


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_global_lp_pool(p, dims):
    model, feeds = make_model("GlobalLpPool", {"x": (2, 3, *(4 - i for i in range(dims)))}, {"p": p}, opset=21)
    axes = tuple(range(2, 2 + dims))
    assert_matches_torch(model, feeds, lambda x: torch.linalg.vector_norm(x, p, dim=axes, keepdim=True))


# ---- linear algebra, scans, elementwise ----------------------------------------------------------


@SETTINGS
@given(batch=st.lists(st.integers(1, 3), max_size=2), size=st.integers(1, 4), opset=st.sampled_from([13, 22]))
def test_det(batch, size, opset):
    model, feeds = make_model("Det", {"x": (*batch, size, size)}, {}, opset=opset)
    assert_fd(model, feeds)


def test_det_of_singular_matrix():
    """The cofactors are exact where det(X) = 0 (det * inv(X)^T is not defined there)."""
    model, _ = make_model("Det", {"x": (3, 3)}, {}, opset=22)
    x = np.array([[1, 2, 3], [2, 4, 6], [1, 0, 1]], np.float32)
    assert_fd(model, {"x": x})


@st.composite
def cumprod_case(draw):
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 4)) for _ in range(rank))
    x = np.random.default_rng(draw(SEEDS)).uniform(-1.5, 1.5, shape).astype(np.float32)
    zeros = draw(st.lists(st.integers(0, x.size - 1), max_size=3))
    x.reshape(-1)[zeros] = 0.0  # exact zeros: the product stays linear in each factor
    attrs = {"exclusive": draw(st.integers(0, 1)), "reverse": draw(st.integers(0, 1))}
    return x, draw(st.integers(-rank, rank - 1)), attrs


@SETTINGS
@given(cumprod_case())
def test_cumprod(case):
    x, axis, attrs = case
    model, feeds = make_model("CumProd", {"x": x.shape}, attrs, opset=26,
                              consts={"axis": np.array(axis, np.int64)}, fixed={"x": x})
    assert_fd(model, feeds)


@SETTINGS
@given(fmod=st.integers(0, 1), data=st.data())
def test_mod(fmod, data):
    shape = tuple(data.draw(st.integers(1, 3)) for _ in range(2))
    b_shape = data.draw(st.sampled_from([shape, shape[1:], (1, shape[1])]))
    rng = np.random.default_rng(data.draw(SEEDS))
    a = rng.uniform(-5, 5, shape).astype(np.float32)
    b = (rng.uniform(0.5, 2, b_shape) * rng.choice([-1, 1], b_shape)).astype(np.float32)
    opset = 28 if fmod == 0 else data.draw(st.sampled_from([13, 28]))  # floats take fmod=0 from 28
    model, feeds = make_model("Mod", {"a": shape, "b": b_shape}, {"fmod": fmod}, opset=opset,
                              fixed={"a": a, "b": b})
    assert_fd(model, feeds)


def test_hardmax_gradient_is_zero():
    model, feeds = make_model("Hardmax", {"x": (3, 4)}, {"axis": 1}, opset=13)
    assert not onnx_grads(model, feeds)["x"].any()
    assert_fd(model, feeds)


# ---- variants of older rules ------------------------------------------------------------------


@st.composite
def scatter_case(draw):
    """ScatterND or ScatterElements with a reduction, repeated indices, zeros in the updates."""
    op = draw(st.sampled_from(["ScatterND", "ScatterElements"]))
    reduction = draw(st.sampled_from(["mul", "min", "max"]))
    rng = np.random.default_rng(draw(SEEDS))
    shape = (draw(st.integers(2, 4)), draw(st.integers(1, 3)))
    count = draw(st.integers(1, 5))
    if op == "ScatterND":
        idx = rng.integers(0, shape[0], (count, 1))
        upd_shape = (count, shape[1])
        attrs = {"reduction": reduction}
    else:
        idx = rng.integers(-shape[0], shape[0], (count, shape[1]))
        upd_shape = idx.shape
        attrs = {"reduction": reduction, "axis": 0}
    upd = rng.uniform(-2, 2, upd_shape).astype(np.float32)
    if reduction == "mul" and draw(st.booleans()):
        upd.reshape(-1)[rng.integers(0, upd.size, 2)] = 0.0
    data = rng.uniform(-2, 2, shape).astype(np.float32)
    return op, attrs, data, ints(idx), upd


@SETTINGS
@given(scatter_case())
def test_scatter_reductions(case):
    op, attrs, data, idx, upd = case
    model, feeds = make_model(op, {"data": data.shape, "upd": upd.shape}, attrs, opset=18,
                              consts={"idx": idx}, node_inputs=["data", "idx", "upd"],
                              fixed={"data": data, "upd": upd})
    assert_fd(model, feeds)


@pytest.mark.parametrize("op", ["ScatterND", "ScatterElements"])
@pytest.mark.parametrize("reduction", ["min", "max"])
def test_scatter_min_max_ties_share(op, reduction):
    idx = ints([[1], [1]])  # both updates go to row 1 (ScatterND) or element (1, 0) (ScatterElements)
    data = np.array([[0.5], [2.0]], np.float32)
    upd = np.array([[2.0], [2.0]], np.float32)  # ties with data[1]: three ways
    attrs = {"reduction": reduction} if op == "ScatterND" else {"reduction": reduction, "axis": 0}
    if reduction == "min":
        data, upd = -data, -upd
    model, feeds = make_model(op, {"data": data.shape, "upd": upd.shape}, attrs, opset=18,
                              consts={"idx": idx}, node_inputs=["data", "idx", "upd"],
                              fixed={"data": data, "upd": upd})
    grads, w = onnx_grads(model, feeds), loss_weight(model)
    np.testing.assert_allclose(grads["data"], [[w[0, 0]], [w[1, 0] / 3]], rtol=1e-6)
    np.testing.assert_allclose(grads["upd"], [[w[1, 0] / 3], [w[1, 0] / 3]], rtol=1e-6)


@pytest.mark.parametrize("with_indices", [False, True])
@pytest.mark.parametrize("attrs", [dict(kernel_shape=[2, 2], strides=[2, 2]),
                                   dict(kernel_shape=[3, 2], strides=[1, 2], pads=[1, 0, 1, 1]),
                                   dict(kernel_shape=[2, 2], dilations=[2, 1], pads=[1, 1, 1, 1])])
def test_max_pool_storage_order_1(attrs, with_indices):
    outputs = ("y", "idx") if with_indices else ("y",)
    model, feeds = make_model("MaxPool", {"x": (2, 3, 5, 6)}, dict(attrs, storage_order=1), outputs=outputs)
    assert_fd(model, feeds)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
@pytest.mark.parametrize("shape,blocksize", [((2, 3, 6, 9), 3), ((1, 4, 4, 2), 2)])
def test_space_to_depth_modes(shape, blocksize, mode):
    model, feeds = make_model("SpaceToDepth", {"x": shape}, {"blocksize": blocksize, "mode": mode}, opset=28)
    assert_linear_fd(model, feeds)


def test_rules_are_registered():
    """Every rule of newer.py, at the opsets the tests above use (Upsample and Scatter are not:
    deprecated before the builder's floor of opset 13)."""
    for op, opset in [("GridSample", 16), ("AffineGrid", 20), ("Col2Im", 18), ("CenterCropPad", 18),
                      ("Compress", 13), ("MaxUnpool", 22), ("LpNormalization", 22), ("LRN", 13),
                      ("GlobalLpPool", 22), ("Det", 22), ("CumProd", 26), ("Mod", 28), ("Hardmax", 13)]:
        assert lookup("", op, opset) is not None, op
    assert lookup("", "Upsample", 13) is None and lookup("", "Scatter", 13) is None
