"""Convolution and pooling backward forms of issue 37, against torch float64.

1. ConvWeightGemmPass (passes/kernels/conv_weight_gemm.py): every form on Convs drawn by
   hypothesis (1-3 spatial axes, kernel 1-7, stride 1-3, dilation 1-2, groups with depthwise,
   explicit pads and every auto_pad) against torch's float64 convolution, and the whole weight
   gradient (the Conv rule, then the pass) against torch float64 autograd. The rewritten graphs
   run in float64 in onnxruntime, which has no float64 Conv: a Conv left over fails the test.
2. The pools whose windows tile the input (kernel == stride; passes/autodiff/rules/conv.py):
   MaxPool on inputs full of ties (ReLU'd small integers: torch passes the gradient to the first
   maximum of each window) and AveragePool, against torch float64 autograd.
3. The form rule (ConvGemmOptions) picks from the shapes; a forward Conv is left alone.

Tolerances: float64 runs agree to 1e-9 (sums in another order); the pools run in float32 on
integer-valued inputs with float32 output gradients, exact up to float32 rounding (1e-5).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from onnx_ir.passes.common import RemoveUnusedNodesPass

from gradgraph.api import build_gradient_graph
from passes.kernels.conv_weight_gemm import (
    ConvGemmOptions,
    ConvWeightGemmPass,
    choose_form,
    geometry,
)

OPSET = 17
FLOAT64_ATOL = FLOAT64_RTOL = 1e-9
POOL_ATOL = POOL_RTOL = 1e-5
# Options that rewrite every Conv the pass can (the default rule leaves forward-like ones alone).
EVERY_CONV = ConvGemmOptions(min_kernel_per_position=0, grouped_max_window_step=3)
# Options that make each group-1 form (groups > 1 are always "grouped").
FORMS = {
    "taps": dataclasses.replace(EVERY_CONV, max_unfold_bytes=0),
    "unfold": dataclasses.replace(EVERY_CONV, gather_min_block_bytes=10**9),
    "gather": dataclasses.replace(EVERY_CONV, gather_min_block_bytes=0),
}
AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _onnx_pads(auto_pad: str, pads: list[int], spatial: list[int], kernel: list[int], strides: list[int],
               dilations: list[int]) -> list[int]:
    """Begin and end pads as the ONNX Conv spec defines them (the oracle's own formula)."""
    dims = len(spatial)
    if auto_pad == "VALID":
        return [0] * (2 * dims)
    if auto_pad == "NOTSET":
        return pads
    begin, end = [], []
    for size, k, s, d in zip(spatial, kernel, strides, dilations, strict=True):
        total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
        small, large = total // 2, total - total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else large)
        end.append(large if auto_pad == "SAME_UPPER" else small)
    return begin + end


def _torch_conv(x, w, pads, strides, dilations, group):
    dims = x.dim() - 2
    padded = F.pad(x, [v for a in reversed(range(dims)) for v in (pads[a], pads[dims + a])])
    conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    return conv(padded, w, stride=strides, dilation=dilations, groups=group)


@st.composite
def conv_cases(draw, extra: int = 4):
    """A Conv: (x shape, w shape, attributes, auto_pad, explicit pads)."""
    dims = draw(st.integers(1, 3))
    kernel = [draw(st.integers(1, 7 if dims == 1 else 4 if dims == 2 else 3)) for _ in range(dims)]
    dilations = [draw(st.integers(1, 2)) for _ in range(dims)]
    strides = [draw(st.integers(1, 3)) for _ in range(dims)]
    spatial = [(k - 1) * d + 1 + draw(st.integers(0, extra)) for k, d in zip(kernel, dilations, strict=True)]
    group = draw(st.sampled_from([1, 2, 3]))
    depthwise = group > 1 and draw(st.booleans())
    cin = group if depthwise else group * draw(st.integers(1, 3))
    cout = group * draw(st.integers(1, 2))
    auto_pad = draw(st.sampled_from(AUTO_PADS))
    pads = [draw(st.integers(0, k - 1)) for k in kernel * 2] if auto_pad == "NOTSET" else [0] * (2 * dims)
    attrs = dict(strides=strides, dilations=dilations, group=group, kernel_shape=kernel)
    attrs.update(pads=pads) if auto_pad == "NOTSET" else attrs.update(auto_pad=auto_pad)
    batch = draw(st.integers(1, 3))
    return [batch, cin, *spatial], [cout, cin // group, *kernel], attrs, auto_pad, pads


def _conv_model(xshape, wshape, attrs, loss: bool, dtype: int = TensorProto.DOUBLE) -> onnx.ModelProto:
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], **attrs)]
    inputs = [helper.make_tensor_value_info(n, dtype, s) for n, s in (("x", xshape), ("w", wshape))]
    outputs = [helper.make_tensor_value_info("y", dtype, None)]
    if loss:
        nodes += [helper.make_node("Mul", ["y", "r"], ["yr"]), helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0)]
        inputs.append(helper.make_tensor_value_info("r", dtype, None))
        outputs = [helper.make_tensor_value_info("loss", dtype, [])]
    graph = helper.make_graph(nodes, "conv", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)


def _rewrite(model: ir.Model, options: ConvGemmOptions) -> None:
    assert ConvWeightGemmPass(options).call(model).modified
    assert not any(n.op_type == "Conv" for n in model.graph)
    assert not ConvWeightGemmPass(options).call(model).modified  # a second run finds nothing


# ---- 1. the pass --------------------------------------------------------------------------


@SETTINGS
@given(conv_cases(), st.sampled_from(sorted(FORMS)))
def test_pass_matches_torch_conv(case, form):
    """Each form (taps, unfold, gather; grouped for group > 1) is the Conv."""
    xshape, wshape, attrs, auto_pad, pads = case
    proto = _conv_model(xshape, wshape, attrs, loss=False)
    model = ir.from_proto(proto)
    _rewrite(model, FORMS[form])
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(xshape), rng.standard_normal(wshape)
    got = _session(ir.to_proto(model)).run(["y"], {"x": x, "w": w})[0]
    full_pads = _onnx_pads(auto_pad, pads, xshape[2:], wshape[2:], attrs["strides"], attrs["dilations"])
    want = _torch_conv(torch.tensor(x), torch.tensor(w), full_pads, attrs["strides"], attrs["dilations"],
                       attrs["group"]).numpy()
    np.testing.assert_allclose(got, want, atol=FLOAT64_ATOL, rtol=FLOAT64_RTOL)


@pytest.mark.parametrize("attrs", [{}, dict(strides=[2, 2]), dict(pads=[1, 0, 0, 1])])
def test_gather_form_of_a_1x1_kernel(attrs):
    """A 1x1 kernel reading every position needs no Gather (the rows are the windows); with a
    stride or pads it does."""
    xshape, wshape = [2, 8, 5, 5], [3, 8, 1, 1]
    model = ir.from_proto(_conv_model(xshape, wshape, attrs, loss=False))
    _rewrite(model, FORMS["gather"])
    assert any(n.op_type == "Gather" for n in model.graph) == bool(attrs)
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal(xshape), rng.standard_normal(wshape)
    got = _session(ir.to_proto(model)).run(["y"], {"x": x, "w": w})[0]
    want = _torch_conv(torch.tensor(x), torch.tensor(w), attrs.get("pads", [0] * 4), attrs.get("strides", [1, 1]),
                       [1, 1], 1).numpy()
    np.testing.assert_allclose(got, want, atol=FLOAT64_ATOL, rtol=FLOAT64_RTOL)


def test_pass_adds_the_bias():
    xshape, wshape = [2, 4, 9, 9], [3, 4, 7, 7]
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 0, 1, 0])
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info(n, TensorProto.DOUBLE, s)
                                               for n, s in (("x", xshape), ("w", wshape), ("b", [3]))],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9))
    _rewrite(model, EVERY_CONV)
    rng = np.random.default_rng(1)
    x, w, b = rng.standard_normal(xshape), rng.standard_normal(wshape), rng.standard_normal(3)
    got = _session(ir.to_proto(model)).run(["y"], {"x": x, "w": w, "b": b})[0]
    want = F.conv2d(F.pad(torch.tensor(x), [0, 0, 1, 1]), torch.tensor(w), torch.tensor(b)).numpy()
    np.testing.assert_allclose(got, want, atol=FLOAT64_ATOL, rtol=FLOAT64_RTOL)


# ---- 1b. the weight gradient, end to end ---------------------------------------------------


@SETTINGS
@given(conv_cases(), st.sampled_from(sorted(FORMS)))
def test_weight_gradient_matches_torch(case, form):
    """The Conv rule's weight gradient, rewritten by the pass in each form, is torch's float64 dW."""
    xshape, wshape, attrs, auto_pad, pads = case
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal(xshape), rng.standard_normal(wshape)
    full_pads = _onnx_pads(auto_pad, pads, xshape[2:], wshape[2:], attrs["strides"], attrs["dilations"])
    tx, tw = torch.tensor(x), torch.tensor(w, requires_grad=True)
    y = _torch_conv(tx, tw, full_pads, attrs["strides"], attrs["dilations"], attrs["group"])
    r = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(r)).sum().backward()
    model = build_gradient_graph(_conv_model(xshape, wshape, attrs, loss=True), "loss", ["w"], as_ir=True)
    grad = next(v for v in model.graph.outputs if v.name == "w_grad")
    model.graph.outputs.clear()
    model.graph.outputs.append(grad)
    RemoveUnusedNodesPass()(model)
    _rewrite(model, FORMS[form])
    got = _session(ir.to_proto(model)).run(["w_grad"], {"x": x, "w": w, "r": r})[0]
    assert tw.grad is not None
    np.testing.assert_allclose(got, tw.grad.numpy(), atol=FLOAT64_ATOL, rtol=FLOAT64_RTOL)


def _input_gradient(xshape, wshape, attrs, x, w, r) -> tuple[np.ndarray, set[str]]:
    """dX in float32 (onnxruntime's CPU Conv and ConvTranspose have no float64 kernel)."""
    model = build_gradient_graph(_conv_model(xshape, wshape, attrs, loss=True, dtype=TensorProto.FLOAT),
                                 "loss", ["x"])
    feeds = {"x": x.astype(np.float32), "w": w.astype(np.float32), "r": r.astype(np.float32)}
    return _session(model).run(["x_grad"], feeds)[0], {n.op_type for n in model.graph.node}


def _close_to_float64(got: np.ndarray, want: np.ndarray) -> None:
    """float32 sums of at most a few hundred products of unit normals: rel 1e-4 of the largest."""
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max())))


@SETTINGS
@given(conv_cases())
def test_input_gradient_matches_torch(case):
    """The Conv rule's input gradient (float32) is torch's float64 dX: with stride 1 a Conv of
    dY with the flipped, channel-swapped kernel (no ConvTranspose), else a ConvTranspose and a
    crop."""
    xshape, wshape, attrs, auto_pad, pads = case
    # onnxruntime's forward Conv refuses dilations with SAME_* (the weight test rewrites it away)
    assume(not (auto_pad.startswith("SAME") and any(d > 1 for d in attrs["dilations"])))
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal(xshape), rng.standard_normal(wshape)
    full_pads = _onnx_pads(auto_pad, pads, xshape[2:], wshape[2:], attrs["strides"], attrs["dilations"])
    tx = torch.tensor(x, requires_grad=True)
    y = _torch_conv(tx, torch.tensor(w), full_pads, attrs["strides"], attrs["dilations"], attrs["group"])
    r = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(r)).sum().backward()
    got, ops = _input_gradient(xshape, wshape, attrs, x, w, r)
    assert tx.grad is not None
    _close_to_float64(got, tx.grad.numpy())
    assert ("ConvTranspose" in ops) == any(s != 1 for s in attrs["strides"]), ops


def test_input_gradient_with_a_pad_wider_than_the_window_keeps_the_transpose():
    """A forward pad of 3 on a 2-tap kernel: the Conv form would need a negative pad."""
    xshape, wshape = [2, 3, 5, 6], [4, 3, 2, 2]
    attrs = dict(strides=[1, 1], dilations=[1, 1], group=1, kernel_shape=[2, 2], pads=[3, 0, 1, 3])
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal(xshape), rng.standard_normal(wshape)
    tx = torch.tensor(x, requires_grad=True)
    y = _torch_conv(tx, torch.tensor(w), attrs["pads"], [1, 1], [1, 1], 1)
    r = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(r)).sum().backward()
    got, ops = _input_gradient(xshape, wshape, attrs, x, w, r)
    assert tx.grad is not None
    _close_to_float64(got, tx.grad.numpy())
    assert "ConvTranspose" in ops


@pytest.mark.parametrize("taps,flip_op", [(9, "MatMul"), (400, "Slice")])
def test_input_gradient_kernel_flip(taps, flip_op):
    """The stride-1 input gradient reverses the kernel's taps with a MatMul by the reversal
    matrix, or a Slice above 343 taps (the matrix is taps x taps)."""
    xshape, wshape = [2, 3, taps + 5], [4, 3, taps]
    attrs = dict(strides=[1], dilations=[1], group=1, kernel_shape=[taps], pads=[1, 2])
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal(xshape), rng.standard_normal(wshape)
    tx = torch.tensor(x, requires_grad=True)
    y = _torch_conv(tx, torch.tensor(w), attrs["pads"], [1], [1], 1)
    r = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(r)).sum().backward()
    got, ops = _input_gradient(xshape, wshape, attrs, x, w, r)
    assert tx.grad is not None
    _close_to_float64(got, tx.grad.numpy())
    assert flip_op in ops and "ConvTranspose" not in ops
    assert ("MatMul" in ops) == (flip_op == "MatMul")


# ---- 2. pools whose windows tile the input -------------------------------------------------


@st.composite
def tiled_pool_cases(draw):
    dims = draw(st.integers(1, 3))
    kernel = [draw(st.integers(1, 4 if dims < 3 else 2)) for _ in range(dims)]
    spatial = [k * draw(st.integers(1, 4)) + draw(st.integers(0, k - 1)) for k in kernel]  # tails dropped
    return [draw(st.integers(1, 2)), draw(st.integers(1, 3)), *spatial], kernel


def _pool_grads(op: str, xshape, kernel, x: np.ndarray, r: np.ndarray, *, static: bool) -> np.ndarray:
    shape = xshape if static else ["n", "c", *[f"s{a}" for a in range(len(kernel))]]
    nodes = [helper.make_node(op, ["x"], ["y"], kernel_shape=kernel, strides=kernel),
             helper.make_node("Mul", ["y", "r"], ["yr"]), helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
                                              helper.make_tensor_value_info("r", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)
    grad = build_gradient_graph(proto, "loss", ["x"])
    ops = {n.op_type for n in grad.graph.node}
    assert not ops & {"ScatterElements", "ConvTranspose"}, ops
    return _session(grad).run(["x_grad"], {"x": x, "r": r})[0]


@SETTINGS
@given(tiled_pool_cases(), st.booleans())
def test_max_pool_ties_go_to_the_first_maximum(case, static):
    xshape, kernel = case
    rng = np.random.default_rng(3)
    x = np.maximum(rng.integers(-2, 3, xshape), 0).astype(np.float32)  # ReLU'd: windows full of ties
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[len(kernel) - 1]
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = pool(tx, kernel, kernel)
    r = rng.integers(-3, 4, tuple(y.shape)).astype(np.float32)
    (y * torch.tensor(r, dtype=torch.float64)).sum().backward()
    got = _pool_grads("MaxPool", xshape, kernel, x, r, static=static)
    assert tx.grad is not None
    np.testing.assert_allclose(got, tx.grad.numpy(), atol=POOL_ATOL, rtol=POOL_RTOL)


@SETTINGS
@given(tiled_pool_cases(), st.booleans())
def test_average_pool_tiled_matches_torch(case, static):
    xshape, kernel = case
    rng = np.random.default_rng(4)
    x = rng.standard_normal(xshape).astype(np.float32)
    pool = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[len(kernel) - 1]
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = pool(tx, kernel, kernel)
    r = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    (y * torch.tensor(r, dtype=torch.float64)).sum().backward()
    got = _pool_grads("AveragePool", xshape, kernel, x, r, static=static)
    assert tx.grad is not None
    np.testing.assert_allclose(got, tx.grad.numpy(), atol=POOL_ATOL, rtol=POOL_RTOL)


# ---- 3. the form rule ----------------------------------------------------------------------


def _conv_node(xshape, wshape, **attrs) -> ir.Node:
    model = ir.from_proto(_conv_model(xshape, wshape, attrs, loss=False))
    return next(iter(model.graph))


@pytest.mark.parametrize("xshape,wshape,attrs,form", [
    # a forward 3x3 conv: its kernel is far smaller than its output
    ([32, 64, 16, 16], [64, 64, 3, 3], dict(pads=[1, 1, 1, 1]), None),
    # weight gradients of the benchmark CNN (data: input channels x batch, kernel: the output gradient)
    # (float64, batch 32: each window row a block of 256 bytes, gathered)
    ([3, 32, 34, 34], [32, 32, 32, 32], {}, "gather"),
    ([64, 32, 10, 10], [128, 32, 8, 8], {}, "gather"),
    ([64, 32, 16, 16], [128, 32, 16, 16], {}, "gather"),  # a 1x1 conv's: one position
    # batch 4: blocks of 32 bytes, below gather_min_block_bytes: Slices and one Concat
    ([64, 4, 16, 16], [128, 4, 16, 16], {}, "unfold"),
    # ResNet's last stage (4x4): 16 kernel taps for 9 positions; its forward conv has 16 positions
    ([256, 32, 6, 6], [256, 32, 4, 4], {}, "gather"),
    # ... except in the gather form where its output has few positions per image (one GEMM
    # over the batch instead of onnxruntime's thin per-image GEMMs), but not a 1x1 kernel
    ([32, 256, 4, 4], [256, 256, 3, 3], dict(pads=[1, 1, 1, 1]), "gather"),
    ([32, 256, 4, 4], [256, 256, 1, 1], {}, None),
    # depthwise (group = channels, one data channel per group), stride 1 and stride 2
    ([1, 96 * 32, 18, 18], [96, 32, 16, 16], dict(group=96), "grouped"),
    ([1, 96 * 32, 17, 17], [96, 32, 8, 8], dict(group=96, dilations=[2, 2]), None),
])
def test_form_rule_picks_from_the_shapes(xshape, wshape, attrs, form):
    geo = geometry(_conv_node(xshape, wshape, **attrs))
    assert geo is not None
    assert choose_form(geo, ConvGemmOptions()) == form


def test_gather_options_take_effect():
    """max_gather_index_bytes sends a weight gradient's windows back to the unfold;
    gather_max_forward_positions 0 leaves a small-image forward Conv to onnxruntime."""
    weight_grad = geometry(_conv_node([64, 32, 10, 10], [128, 32, 8, 8]))
    forward = geometry(_conv_node([32, 256, 4, 4], [256, 256, 3, 3], pads=[1, 1, 1, 1]))
    assert weight_grad is not None and forward is not None
    assert choose_form(weight_grad, ConvGemmOptions()) == "gather"
    assert choose_form(weight_grad, ConvGemmOptions(max_gather_index_bytes=8)) == "unfold"
    assert choose_form(forward, ConvGemmOptions()) == "gather"
    assert choose_form(forward, ConvGemmOptions(gather_max_forward_positions=0)) is None


def test_unfold_falls_back_to_taps_above_its_byte_limit():
    geo = geometry(_conv_node([3, 32, 34, 34], [32, 32, 32, 32]))
    assert geo is not None
    assert choose_form(geo, ConvGemmOptions(max_unfold_bytes=1024)) == "taps"


def test_forward_gather_keeps_to_the_unfold_byte_limit():
    """The gather form of a small-kernel Conv holds every window, K times the data it reads
    (ResNet's 7x7 stage at batch 512 would gather 441 MiB): above ``max_unfold_bytes`` the Conv
    is left to onnxruntime, as a weight gradient's windows fall back to taps."""
    geo = geometry(_conv_node([32, 256, 4, 4], [256, 256, 3, 3], pads=[1, 1, 1, 1]))
    assert geo is not None and geo.channels is not None
    windows = geo.batch * geo.positions * math.prod(geo.kernel) * geo.channels * geo.itemsize
    assert choose_form(geo, ConvGemmOptions(max_unfold_bytes=windows)) == "gather"
    assert choose_form(geo, ConvGemmOptions(max_unfold_bytes=windows - 1)) is None


def test_symbolic_spatial_size_is_left_alone():
    node = _conv_node([3, 32, "h", "w"], [32, 32, 32, 32])
    assert geometry(node) is None
