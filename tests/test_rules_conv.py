"""Gradient rules of Conv, ConvTranspose and the pools: finite differences and torch autograd.

Fixtures and oracles are in ``single_op.py``. Conv is checked against float64 finite
differences (``fdcheck``); ConvTranspose, AveragePool and GlobalAveragePool, whose float64
reference kernels disagree with onnxruntime or are missing, with the exact linear check.
"""

from __future__ import annotations

import fdcheck
import numpy as np
import onnx
import onnx.parser
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from single_op import (
    assert_fd,
    assert_linear_fd,
    assert_matches_torch,
    loss_weight,
    make_model,
    onnx_grads,
)

BATCH = 2


def conv_case(dims: int, channels: int, out_channels: int, group: int, size: int, kernel: int,
              bias: bool = True, transpose: bool = False):
    """Input shapes of a Conv/ConvTranspose with ``dims`` spatial axes."""
    spatial = tuple(size - i for i in range(dims))
    kshape = tuple(kernel for _ in range(dims))
    wshape = (channels, out_channels // group) if transpose else (out_channels, channels // group)
    shapes = {"x": (BATCH, channels) + spatial, "w": wshape + kshape}
    if bias:
        shapes["b"] = (out_channels,)
    return shapes


# ---- Conv ----------------------------------------------------------------------------------

CONV_CASES = [
    # dims, C, M, group, size, kernel, attrs
    (1, 2, 3, 1, 7, 3, {}),
    (1, 2, 4, 2, 9, 2, dict(strides=[2], pads=[1, 2], dilations=[2])),
    (2, 4, 6, 2, 7, 3, dict(strides=[2, 1], pads=[1, 0, 0, 1], dilations=[1, 2])),
    (2, 3, 3, 3, 6, 3, dict(pads=[1, 1, 1, 1])),
    (2, 2, 3, 1, 8, 3, dict(strides=[2, 2], auto_pad="VALID")),
    (2, 2, 3, 1, 7, 3, dict(strides=[2, 3], auto_pad="SAME_UPPER")),
    (2, 2, 2, 1, 7, 2, dict(strides=[3, 2], auto_pad="SAME_LOWER")),
    (3, 2, 4, 2, 5, 2, dict(strides=[2, 1, 2], pads=[1, 0, 1, 0, 1, 1])),
    (3, 2, 2, 1, 5, 3, dict(strides=[1, 2, 1], auto_pad="SAME_UPPER")),
]


@pytest.mark.parametrize("dims,c,m,group,size,k,attrs", CONV_CASES)
def test_conv_fd(dims, c, m, group, size, k, attrs):
    model, feeds = make_model("Conv", conv_case(dims, c, m, group, size, k), dict(attrs, group=group))
    assert_fd(model, feeds)


def test_conv_without_bias_and_input_only():
    model, feeds = make_model("Conv", conv_case(2, 2, 3, 1, 6, 3, bias=False), dict(strides=[2, 2]))
    assert_fd(model, feeds)
    assert_fd(model, feeds, wrt=["x"])


# ---- ConvTranspose ---------------------------------------------------------------------------

CONV_TRANSPOSE_CASES = [
    (1, 2, 3, 1, 4, 3, {}),
    (1, 2, 2, 1, 4, 3, dict(strides=[3], pads=[1, 2], output_padding=[1], dilations=[2])),
    (2, 4, 6, 2, 4, 3, dict(strides=[2, 3], output_padding=[1, 2], pads=[0, 1, 1, 0])),
    (2, 2, 3, 1, 4, 3, dict(strides=[2, 2], output_shape=[8, 6])),
    (2, 2, 3, 1, 4, 3, dict(strides=[2, 2], output_shape=[6, 7], auto_pad="SAME_UPPER")),
    (2, 2, 3, 1, 4, 3, dict(strides=[2, 2], output_shape=[6, 7], auto_pad="SAME_LOWER")),
    (2, 2, 3, 1, 4, 2, dict(strides=[2, 3], auto_pad="SAME_UPPER")),
    (2, 2, 3, 1, 4, 2, dict(strides=[3, 2], auto_pad="SAME_LOWER")),
    (2, 2, 3, 1, 5, 3, dict(strides=[2, 2], auto_pad="VALID")),
    (3, 2, 4, 2, 3, 2, dict(strides=[2, 1, 2], pads=[1, 0, 0, 0, 1, 1], output_padding=[1, 0, 1])),
]


@pytest.mark.parametrize("dims,c,m,group,size,k,attrs", CONV_TRANSPOSE_CASES)
def test_conv_transpose_fd(dims, c, m, group, size, k, attrs):
    shapes = conv_case(dims, c, m, group, size, k, transpose=True)
    model, feeds = make_model("ConvTranspose", shapes, dict(attrs, group=group))
    assert_linear_fd(model, feeds)


# ---- hypothesis: random Conv geometry -----------------------------------------------------------


@st.composite
def conv_geometry(draw):
    dims = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2]))
    kernel = draw(st.integers(1, 3))
    strides = [draw(st.integers(1, 3)) for _ in range(dims)]
    size = draw(st.integers(5, 7)) if dims < 3 else 5
    # axis i is size - i long (conv_case): it holds one dilated window even unpadded (VALID)
    dilations = [draw(st.integers(1, 2)) if 2 * (kernel - 1) < size - i else 1 for i in range(dims)]
    attrs = dict(strides=strides, dilations=dilations, group=group)
    auto_pad = draw(st.sampled_from(["NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"]))
    if auto_pad == "NOTSET":
        attrs["pads"] = [draw(st.integers(0, kernel - 1)) for _ in range(2 * dims)]
    else:
        attrs["auto_pad"] = auto_pad
    if auto_pad.startswith("SAME"):  # onnxruntime: no dilations with SAME padding
        attrs["dilations"] = [1] * dims
    return dims, group, kernel, size, attrs


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv_geometry())
def test_conv_random_geometry(geometry):
    dims, group, kernel, size, attrs = geometry
    model, feeds = make_model("Conv", conv_case(dims, 2, 2 * group, group, size, kernel), attrs)
    assert_linear_fd(model, feeds)


# ---- pools ---------------------------------------------------------------------------------

MAX_POOL_CASES = [
    (1, 8, dict(kernel_shape=[3], strides=[2])),
    (2, 8, dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 0], ceil_mode=1)),
    (2, 8, dict(kernel_shape=[2, 2], dilations=[2, 1], strides=[1, 2])),
    (2, 7, dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")),
    (3, 5, dict(kernel_shape=[2, 2, 2], strides=[2, 1, 2], ceil_mode=1)),
]


def pool_input(dims: int, size: int) -> dict[str, tuple[int, ...]]:
    return {"x": (BATCH, 3) + tuple(size - i for i in range(dims))}


@pytest.mark.parametrize("with_indices", [False, True])
@pytest.mark.parametrize("dims,size,attrs", MAX_POOL_CASES)
def test_max_pool_fd(dims, size, attrs, with_indices):
    outputs = ("y", "idx") if with_indices else ("y",)
    model, feeds = make_model("MaxPool", pool_input(dims, size), attrs, outputs=outputs)
    assert_fd(model, feeds)


def test_max_pool_before_opset_16_uses_one_hot():
    model, feeds = make_model("MaxPool", pool_input(2, 6), dict(kernel_shape=[2, 2], strides=[2, 2]),
                              opset=13)
    assert_fd(model, feeds)


AVERAGE_POOL_CASES = [
    (1, 8, dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
    (2, 7, dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1])),
    (2, 7, dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)),
    (2, 8, dict(kernel_shape=[2, 2], dilations=[2, 1], strides=[1, 2], pads=[1, 1, 0, 1])),
    (2, 7, dict(kernel_shape=[3, 2], strides=[2, 3], auto_pad="SAME_UPPER")),
    (2, 7, dict(kernel_shape=[3, 2], strides=[2, 3], auto_pad="SAME_LOWER")),
    (3, 5, dict(kernel_shape=[2, 3, 2], strides=[2, 1, 2], pads=[0, 1, 1, 1, 1, 0])),
]


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("dims,size,attrs", AVERAGE_POOL_CASES)
def test_average_pool_fd(dims, size, attrs, count_include_pad):
    model, feeds = make_model("AveragePool", pool_input(dims, size),
                              dict(attrs, count_include_pad=count_include_pad))
    assert_linear_fd(model, feeds)


@pytest.mark.parametrize("p", [2, 3])
def test_lp_pool_fd(p):
    attrs = dict(kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 1], p=p)
    model, feeds = make_model("LpPool", pool_input(2, 7), attrs)
    assert_fd(model, feeds)


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_global_average_pool(dims):
    model, feeds = make_model("GlobalAveragePool", pool_input(dims, 5), {})
    assert_linear_fd(model, feeds)
    axes = tuple(range(2, 2 + dims))
    assert_matches_torch(model, feeds, lambda x: x.mean(dim=axes, keepdim=True))


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_global_max_pool(dims):
    model, feeds = make_model("GlobalMaxPool", pool_input(dims, 5), {})
    axes = tuple(range(2, 2 + dims))
    assert_matches_torch(model, feeds, lambda x: x.amax(dim=axes, keepdim=True))


def test_global_max_pool_splits_ties():
    model, _ = make_model("GlobalMaxPool", {"x": (1, 1, 2, 2)}, {})
    x = np.array([[[[1.0, 3.0], [3.0, 2.0]]]], np.float32)
    grad = onnx_grads(model, {"x": x})["x"]
    np.testing.assert_allclose(grad.reshape(-1), [0, 0.5, 0.5, 0] * loss_weight(model).reshape(-1))


# ---- torch autograd ----------------------------------------------------------------------------

TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
TORCH_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@pytest.mark.parametrize("dims,group,stride,dilation,pad", [
    (1, 1, 2, 1, 1), (2, 2, 2, 2, 1), (2, 1, 3, 1, 2), (3, 2, 2, 1, 1)])
def test_conv_matches_torch(dims, group, stride, dilation, pad):
    attrs = dict(group=group, strides=[stride] * dims, dilations=[dilation] * dims, pads=[pad] * 2 * dims)
    model, feeds = make_model("Conv", conv_case(dims, 4, 6, group, 7, 3), attrs)
    assert_matches_torch(model, feeds, lambda x, w, b: TORCH_CONV[dims](
        x, w, b, stride=stride, padding=pad, dilation=dilation, groups=group))


@pytest.mark.parametrize("dims,group,stride,pad,out_pad", [(1, 1, 2, 1, 1), (2, 2, 3, 1, 2), (3, 1, 2, 0, 1)])
def test_conv_transpose_matches_torch(dims, group, stride, pad, out_pad):
    attrs = dict(group=group, strides=[stride] * dims, pads=[pad] * 2 * dims,
                 output_padding=[out_pad] * dims)
    model, feeds = make_model("ConvTranspose", conv_case(dims, 4, 6, group, 4, 3, transpose=True), attrs)
    assert_matches_torch(model, feeds, lambda x, w, b: TORCH_CONV_T[dims](
        x, w, b, stride=stride, padding=pad, output_padding=out_pad, groups=group))


@pytest.mark.parametrize("ceil_mode", [0, 1])
def test_max_pool_matches_torch(ceil_mode):
    attrs = dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], dilations=[1, 2],
                 ceil_mode=ceil_mode)
    model, feeds = make_model("MaxPool", pool_input(2, 8), attrs)
    assert_matches_torch(model, feeds, lambda x: F.max_pool2d(
        x, 3, stride=2, padding=1, dilation=(1, 2), ceil_mode=bool(ceil_mode)))


@pytest.mark.parametrize("ceil_mode", [0, 1])
@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool_matches_torch(ceil_mode, count_include_pad):
    attrs = dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=ceil_mode,
                 count_include_pad=count_include_pad)
    model, feeds = make_model("AveragePool", pool_input(2, 8), attrs)
    assert_matches_torch(model, feeds, lambda x: F.avg_pool2d(
        x, 3, stride=2, padding=1, ceil_mode=bool(ceil_mode), count_include_pad=bool(count_include_pad)))


# ceil_mode windows that would start in the right padding (or past the input) are dropped by
# onnxruntime, torch and ONNX from opset 22: each case has one on some axis. Below opset 22
# ONNX shape inference keeps them, so the loss weight (onnxruntime's output shape) would
# clash with the inferred shape at load: these run at opset 22.
CEIL_DROP_OPSET = 22
CEIL_DROP_CASES = [
    # x shape, attrs (ceil_mode=1 added)
    ((2, 3, 3), dict(kernel_shape=[2], strides=[2], pads=[1, 1])),
    ((2, 3, 3, 4), dict(kernel_shape=[1, 1], strides=[1, 2], pads=[0, 0, 0, 0])),
    ((2, 3, 2, 3), dict(kernel_shape=[2, 2], strides=[2, 1], pads=[0, 0, 1, 0])),
    ((2, 3, 5, 6), dict(kernel_shape=[2, 2], strides=[3, 3], pads=[0, 0, 1, 1])),
    ((2, 3, 4, 5), dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 1, 1, 1])),
]


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("shape,attrs", CEIL_DROP_CASES)
def test_average_pool_ceil_mode_drops_window_in_right_pad(shape, attrs, count_include_pad):
    model, feeds = make_model("AveragePool", {"x": shape},
                              dict(attrs, ceil_mode=1, count_include_pad=count_include_pad),
                              opset=CEIL_DROP_OPSET)
    assert_linear_fd(model, feeds)
    dims = len(shape) - 2
    pads = attrs["pads"]
    if pads[:dims] == pads[dims:]:  # torch pads both ends alike
        torch_pool = {1: F.avg_pool1d, 2: F.avg_pool2d}[dims]
        assert_matches_torch(model, feeds, lambda x: torch_pool(
            x, attrs["kernel_shape"], stride=attrs["strides"], padding=pads[:dims], ceil_mode=True,
            count_include_pad=bool(count_include_pad)))


@pytest.mark.parametrize("with_indices", [False, True])
@pytest.mark.parametrize("shape,attrs", CEIL_DROP_CASES)
def test_max_pool_ceil_mode_drops_window_in_right_pad(shape, attrs, with_indices):
    outputs = ("y", "idx") if with_indices else ("y",)
    model, feeds = make_model("MaxPool", {"x": shape}, dict(attrs, ceil_mode=1), outputs=outputs,
                              opset=CEIL_DROP_OPSET)
    assert_fd(model, feeds)


@pytest.mark.parametrize("opset", [13, 19])
@pytest.mark.parametrize("op,count_include_pad", [("AveragePool", 0), ("AveragePool", 1), ("MaxPool", 0)])
def test_pool_ceil_mode_dropped_window_below_opset_22(op, count_include_pad, opset):
    """ONNX shape inference below opset 22 gives y one window more than onnxruntime computes;
    the gradient uses runtime shapes only, so it still matches torch (which drops it too)."""
    attrs = f"count_include_pad={count_include_pad}, " if op == "AveragePool" else ""
    model = onnx.parser.parse_model(f"""
    <ir_version: 9, opset_import: ["" : {opset}]>
    g (float[2, 3, 3, 5] x, float[A, B, C, D] r) => (float {fdcheck.LOSS}) {{
      y = {op}<{attrs}ceil_mode=1, kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1]>(x)
      yr = Mul(y, r)
      {fdcheck.LOSS} = ReduceSum<keepdims=0>(yr)
    }}""")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 3, 5)).astype(np.float32)
    r = rng.standard_normal((2, 3, 2, 3)).astype(np.float32)  # onnxruntime's (and torch's) y shape
    got = fdcheck.analytic_gradients(model, ["x"], {"x": x, "r": r})["x"]
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    if op == "AveragePool":
        y = F.avg_pool2d(xt, 2, stride=2, padding=1, ceil_mode=True, count_include_pad=bool(count_include_pad))
    else:
        y = F.max_pool2d(xt, 2, stride=2, padding=1, ceil_mode=True)
    assert tuple(y.shape) == r.shape
    (y * torch.tensor(r, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(got, xt.grad.numpy(), atol=1e-5, rtol=1e-5)


# Dilated windows whose taps all fall in the padding: onnxruntime gives them the lowest float
# and an index built from position -1 (an element of another channel, or out of range).
EMPTY_WINDOW_CASES = [
    ((1, 1, 1, 1), dict(kernel_shape=[1, 2], pads=[0, 1, 0, 1], dilations=[1, 2])),
    ((1, 1, 1), dict(kernel_shape=[2], pads=[1, 1], dilations=[2])),
    ((2, 3, 2, 3), dict(kernel_shape=[2, 2], pads=[0, 1, 0, 1], dilations=[1, 3])),
]


@pytest.mark.parametrize("with_indices", [False, True])
@pytest.mark.parametrize("shape,attrs", EMPTY_WINDOW_CASES)
def test_max_pool_window_in_padding_only(shape, attrs, with_indices):
    outputs = ("y", "idx") if with_indices else ("y",)
    model, feeds = make_model("MaxPool", {"x": shape}, attrs, outputs=outputs)
    assert_fd(model, feeds)


def test_max_pool_dilated_float64():
    """The in-bounds tap counts of dilated windows are a float32 Conv (none in float64)."""
    model = onnx.parser.parse_model(f"""
    <ir_version: 9, opset_import: ["" : 19]>
    g (double[2, 3, 5, 4] x, double[2, 3, 5, 1] r) => (double {fdcheck.LOSS}) {{
      y = MaxPool<kernel_shape=[2, 2], pads=[1, 0, 1, 1], dilations=[2, 3], strides=[1, 2]>(x)
      yr = Mul(y, r)
      {fdcheck.LOSS} = ReduceSum<keepdims=0>(yr)
    }}""")
    rng = np.random.default_rng(0)
    feeds = {"x": rng.permutation(120).reshape(2, 3, 5, 4) / 10.0, "r": rng.standard_normal((2, 3, 5, 1))}
    reports = fdcheck.compare_gradients(model, ["x"], feeds, fdcheck.tolerance_for(np.dtype(np.float64)))
    assert all(r.ok and r.checked for r in reports), fdcheck.describe(reports)


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("shape,attrs", EMPTY_WINDOW_CASES)
def test_average_pool_window_in_padding_only(shape, attrs, count_include_pad):
    model, feeds = make_model("AveragePool", {"x": shape}, dict(attrs, count_include_pad=count_include_pad))
    assert_linear_fd(model, feeds)
    assert np.isfinite(onnx_grads(model, feeds)["x"]).all()


@pytest.mark.parametrize("with_indices", [False, True])
@pytest.mark.parametrize("attrs", [dict(kernel_shape=[2, 2]),
                                   dict(kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 1]),
                                   dict(kernel_shape=[2, 2], dilations=[2, 1], pads=[1, 1, 0, 1])])
def test_max_pool_storage_order_1(attrs, with_indices):
    """storage_order=1 (column-major Indices, here of a 6 x 5 image, so they differ from the
    row-major ones): the gradient matches finite differences and the storage_order=0 gradient."""
    outputs = ("y", "idx") if with_indices else ("y",)
    model, feeds = make_model("MaxPool", pool_input(2, 6), dict(attrs, storage_order=1), outputs=outputs)
    assert_fd(model, feeds)
    row_major, _ = make_model("MaxPool", pool_input(2, 6), attrs, outputs=outputs)
    np.testing.assert_allclose(onnx_grads(model, feeds)["x"], onnx_grads(row_major, feeds)["x"],
                               rtol=1e-6, atol=1e-6)


def test_chain_with_symbolic_dims():
    """Conv -> AveragePool -> MaxPool on [N, C, H, W] inputs: pads come from runtime shapes."""
    model = onnx.parser.parse_model("""
    <ir_version: 9, opset_import: ["" : 13]>
    g (float[N, 2, H, W] x, float[3, 2, 3, 3] w) => (float[N, 3, P, Q] y) {
      c = Conv<pads=[1, 1, 1, 1], strides=[2, 1]>(x, w)
      a = AveragePool<kernel_shape=[2, 2], pads=[0, 1, 1, 0]>(c)
      y = MaxPool<kernel_shape=[2, 2]>(a)
    }""")
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 2, 7, 6)).astype(np.float32),
             "w": rng.standard_normal((3, 2, 3, 3)).astype(np.float32)}
    y = fdcheck.session(model).run(["y"], feeds)[0]
    assert_fd(fdcheck.with_weighted_loss(model, {"y": y.shape}), feeds)
