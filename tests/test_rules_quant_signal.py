"""Gradient rules of sequence / optional ops, signal and detection ops, the newest fused ops, and
QuantizeLinear / DequantizeLinear (straight-through estimator).

Smooth ops: hypothesis draws shapes and attributes; the gradient graph (float32) is compared with
float64 central differences (``gradgraph.check``, the oracle ``fdcheck`` uses). The gradient
graph runs in onnxruntime, or in ``onnx.reference.ReferenceEvaluator`` where onnxruntime has no
kernel for an op of the model (:func:`analytic`). Quantization is a step function: its
straight-through gradients are compared with torch's fake-quantize autograd instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import fdcheck
import numpy as np
import onnx
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from single_op import linear_attention_reference, max_roi_pool_reference

from gradgraph import check
from gradgraph.api import build_gradient_graph
from passes.autodiff import GradientError

SETTINGS = settings(max_examples=6, deadline=None, derandomize=True)
FLOAT = TensorProto.FLOAT
# Gradient graph (float32) vs torch float64 autograd.
TORCH_ATOL, TORCH_RTOL = 1e-4, 1e-4


# ---- harness -----------------------------------------------------------------------------------


def model_of(nodes, inputs: Mapping[str, Sequence[int]], outputs: Sequence[str], *, opset: int,
             inits: Sequence[onnx.TensorProto] = ()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, FLOAT, s) for k, s in inputs.items()],
                              [helper.make_tensor_value_info(o, FLOAT, None) for o in outputs], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def run(model: onnx.ModelProto, names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """``names`` of ``model`` in onnxruntime, or the reference evaluator where onnxruntime cannot."""
    try:
        runner = fdcheck.ort_runner(model)
    except fdcheck.KernelMissing:
        return list(ReferenceEvaluator(model).run(list(names), dict(feeds)))
    return runner(names, feeds)


def with_loss(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` plus fdcheck's weighted loss; its outputs get the shapes they have at ``feeds``."""
    values = run(model, [o.name for o in model.graph.output], feeds)
    model = fdcheck.with_weighted_loss(model, {o.name: np.shape(v) for o, v in zip(model.graph.output, values)})
    for out, value in zip(model.graph.output, values):
        out.CopyFrom(helper.make_tensor_value_info(out.name, out.type.tensor_type.elem_type, np.shape(value)))
    return model


def analytic(model: onnx.ModelProto, wrt: Sequence[str], feeds: Mapping[str, np.ndarray]) -> dict:
    grad_model = build_gradient_graph(model, fdcheck.LOSS, list(wrt))
    onnx.checker.check_model(grad_model, full_check=True)
    return dict(zip(wrt, run(grad_model, [w + fdcheck.GRAD_SUFFIX for w in wrt], feeds)))


def assert_fd(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], wrt: Sequence[str] | None = None) -> None:
    """Gradient graph of ``model`` plus a weighted loss vs float64 central differences."""
    wrt = list(wrt or feeds)
    model = with_loss(model, feeds)
    tol = fdcheck.FLOAT32_TOL
    report = check.compare_with_central_differences(
        model, fdcheck.LOSS, analytic(model, wrt, feeds), feeds, eps=fdcheck.FD_EPS, rtol=tol.rtol,
        atol=tol.atol, max_elements=fdcheck.MAX_ELEMENTS, float64_only=True,
        kink_screen=check.KinkScreen(fdcheck.KINK_RTOL, fdcheck.KINK_ATOL))
    rows = [fdcheck._report(row) for row in report]  # noqa: SLF001 - the shared row adapter
    assert all(r.ok and (r.checked or r.kinks) for r in rows), fdcheck.describe(rows)
    assert sum(r.checked for r in rows), fdcheck.describe(rows)


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def int64(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.int64), name)


# ---- sequences and optionals ---------------------------------------------------------------------


@SETTINGS
@given(data=st.data())
def test_sequence_construct_insert_erase_at(data):
    """Construct -> Insert (with / without position) -> Erase -> several SequenceAt (fan-out)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    shapes = [tuple(data.draw(st.lists(st.integers(1, 3), min_size=2, max_size=2))) for _ in range(4)]
    names = ["a", "b", "c", "d"]
    feeds = {k: randn(rng, *s) for k, s in zip(names, shapes)}
    inits, nodes = [], [helper.make_node("SequenceConstruct", ["a", "b", "c"], ["s0"])]
    insert_pos = data.draw(st.sampled_from([None, -3, -1, 0, 2, 3]))
    if insert_pos is None:
        nodes.append(helper.make_node("SequenceInsert", ["s0", "d"], ["s1"]))
    else:
        inits.append(int64("ip", insert_pos))
        nodes.append(helper.make_node("SequenceInsert", ["s0", "d", "ip"], ["s1"]))
    erase_pos = data.draw(st.sampled_from([None, -4, -2, 0, 1, 3]))
    erase_inputs = ["s1"] if erase_pos is None else ["s1", "ep"]
    if erase_pos is not None:
        inits.append(int64("ep", erase_pos))
    nodes.append(helper.make_node("SequenceErase", erase_inputs, ["s2"]))
    outputs = []
    for k, pos in enumerate(data.draw(st.lists(st.integers(-3, 2), min_size=1, max_size=3))):
        inits.append(numpy_helper.from_array(np.asarray(pos, data.draw(st.sampled_from([np.int32, np.int64]))),
                                             f"p{k}"))
        nodes.append(helper.make_node("SequenceAt", ["s2" if k % 2 == 0 else "s1", f"p{k}"], [f"y{k}"]))
        outputs.append(f"y{k}")
    if data.draw(st.booleans()):
        nodes.append(helper.make_node("SequenceLength", ["s2"], ["len"]))
        nodes.append(helper.make_node("Cast", ["len"], ["lenf"], to=FLOAT))
        nodes.append(helper.make_node("Mul", [outputs[0], "lenf"], ["scaled"]))
        outputs[0] = "scaled"
    assert_fd(model_of(nodes, dict(zip(names, shapes)), outputs, opset=18, inits=inits), feeds)


@SETTINGS
@given(data=st.data())
def test_concat_from_sequence(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    rank = data.draw(st.integers(1, 3))
    new_axis = data.draw(st.sampled_from([0, 1]))
    axis = data.draw(st.integers(-rank - new_axis, rank - 1 + new_axis))
    base = data.draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank))
    count = data.draw(st.integers(1, 3))
    shapes = []
    for _ in range(count):
        shape = list(base)
        if not new_axis:
            shape[axis] = data.draw(st.integers(1, 3))
        shapes.append(shape)
    names = [f"x{k}" for k in range(count)]
    split = data.draw(st.booleans()) and count == 1 and rank > 0 and not new_axis
    if split:  # a SplitToSequence sequence, with one chunk put back in front
        nodes = [helper.make_node("SplitToSequence", ["x0"], ["s"], axis=axis, keepdims=1),
                 helper.make_node("SequenceAt", ["s", "last"], ["chunk"]),
                 helper.make_node("SequenceInsert", ["s", "chunk", "zero"], ["seq"])]
        inits = [int64("last", -1), int64("zero", 0)]
    else:
        nodes, inits = [helper.make_node("SequenceConstruct", names, ["seq"])], []
    nodes.append(helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=axis, new_axis=new_axis))
    feeds = {k: randn(rng, *s) for k, s in zip(names, shapes)}
    assert_fd(model_of(nodes, dict(zip(names, shapes)), ["y"], opset=18, inits=inits), feeds)


@SETTINGS
@given(data=st.data())
def test_split_to_sequence_read_back(data):
    """SplitToSequence (every split form) -> Erase -> ConcatFromSequence and a SequenceAt."""
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    shape = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    size = shape[axis]
    form = data.draw(st.sampled_from(["none", "scalar", "list"]))
    chunks = size
    inits = [int64("p", data.draw(st.sampled_from([0, -1])))]
    inputs = ["x"]
    attrs = {"axis": axis}
    if form == "scalar":
        chunk = data.draw(st.integers(1, size))
        chunks = -(-size // chunk)
        inits.append(int64("split", chunk))
        inputs.append("split")
    elif form == "list":
        cuts = sorted(data.draw(st.lists(st.integers(0, size), min_size=1, max_size=3)))
        chunks = len(cuts) + 1
        inits.append(int64("split", np.diff([0, *cuts, size])))
        inputs.append("split")
    else:
        attrs["keepdims"] = data.draw(st.sampled_from([0, 1]))
    nodes = [helper.make_node("SplitToSequence", inputs, ["s"], **attrs),
             helper.make_node("SequenceAt", ["s", "p"], ["first"])]
    squeezed = int(attrs.get("keepdims", 1) == 0)
    nodes += [helper.make_node("SequenceErase", ["s"], ["rest"]),
              helper.make_node("ConcatFromSequence", ["s"], ["joined"], axis=axis, new_axis=squeezed)]
    outputs = ["first", "joined"]
    if chunks > 1:
        nodes.append(helper.make_node("ConcatFromSequence", ["rest"], ["partial"], axis=axis, new_axis=squeezed))
        outputs.append("partial")
    assert_fd(model_of(nodes, {"x": shape}, outputs, opset=18, inits=inits), {"x": randn(rng, *shape)})


def _seq_info(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_sequence_value_info(name, FLOAT, None)


def _optional_info(name: str, element: onnx.TypeProto) -> onnx.ValueInfoProto:
    return helper.make_value_info(name, helper.make_optional_type_proto(element))


@pytest.mark.parametrize("cond", [True, False])
def test_optional_and_sequence_through_if(cond):
    """Optional(tensor), Optional(sequence), and a sequence made in If branches (element sizes
    by the Loop fallback). The sequence and optional values are declared: the forward preparation
    types undeclared If / Optional / OptionalGetElement outputs as tensors."""
    then_branch = helper.make_graph([helper.make_node("SequenceConstruct", ["x", "y"], ["st"])], "t", [],
                                    [_seq_info("st")])
    else_branch = helper.make_graph([helper.make_node("Neg", ["x"], ["z"]),
                                     helper.make_node("SequenceConstruct", ["z"], ["sf"])], "e", [], [_seq_info("sf")])
    nodes = [helper.make_node("If", ["c"], ["branch"], then_branch=then_branch, else_branch=else_branch),
             helper.make_node("SequenceAt", ["branch", "zero"], ["f"]),
             helper.make_node("Optional", ["x"], ["ox"]),
             helper.make_node("OptionalGetElement", ["ox"], ["o"]),
             helper.make_node("OptionalHasElement", ["ox"], ["has"]),
             helper.make_node("SequenceConstruct", ["x", "y"], ["s"]),
             helper.make_node("Optional", ["s"], ["os"]),
             helper.make_node("OptionalGetElement", ["os"], ["s2"]),
             helper.make_node("SequenceAt", ["s2", "one"], ["e"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", FLOAT, [2, 3]), helper.make_tensor_value_info("y", FLOAT, [3]),
                     helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info(o, FLOAT, s) for o, s in (("f", [2, 3]), ("o", [2, 3]), ("e", [3]))],
        [int64("zero", 0), int64("one", 1)])
    tensor = helper.make_tensor_type_proto(FLOAT, None)
    graph.value_info.extend([_seq_info("branch"), _seq_info("s2"), _optional_info("ox", tensor),
                             _optional_info("os", helper.make_sequence_type_proto(tensor))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    rng = np.random.default_rng(0)
    feeds = {"x": randn(rng, 2, 3), "y": randn(rng, 3), "c": np.array(cond)}
    assert_fd(model, feeds, ["x", "y"])


# ---- QuantizeLinear / DequantizeLinear: straight-through estimator vs torch ----------------------

# Quantized-value types: onnx type, torch quant_min / quant_max.
QTYPES = {"uint8": (TensorProto.UINT8, 0, 255), "int8": (TensorProto.INT8, -128, 127)}
QDQ_TOL = {"rtol": 1e-6, "atol": 1e-6}
# Scale gradients sum g * ((q - zp) * s - x) / s: the float32 rounding of (q - zp) * s (about
# |q - zp| * 2**-24 * s per element) is what both sides differ by, not 1e-6 of the sum.
SCALE_TOL = {"rtol": 1e-5, "atol": 1e-4}


def _qdq(x: str, scale: str, zero: str, out: str, **attrs) -> list[onnx.NodeProto]:
    return [helper.make_node("QuantizeLinear", [x, scale, zero], [out + "_q"], **attrs),
            helper.make_node("DequantizeLinear", [out + "_q", scale, zero], [out], **attrs)]


def _fake_quant_linear(opset: int, act: str, per_channel: bool, rng: np.random.Generator, learnable: bool):
    """y = FQ(x) @ FQ(W)^T + bias, FQ = Q -> DQ: per-tensor on x, per-tensor or per-channel on W.

    With ``learnable``, x's zero point is not negative: torch's learnable per-tensor backward
    reads the zero point as ``int(zp + 0.5)`` (which is zp + 1 for a negative zp)."""
    n, d_in, d_out = 5, 4, 3
    act_type, act_min, act_max = QTYPES[act]
    x, w, bias = randn(rng, n, d_in) * 3, randn(rng, d_out, d_in), randn(rng, d_out)
    x_scale = np.array(0.008 + rng.random() * 0.006, np.float32)  # clips part of x
    low = max(act_min + 60, 0) if learnable else act_min + 60
    x_zero = np.array(rng.integers(low, act_max - 60), helper.tensor_dtype_to_np_dtype(act_type))
    w_scale = (0.004 + rng.random(d_out if per_channel else ()) * 0.008).astype(np.float32)
    w_zero = rng.integers(-5, 6, w_scale.shape).astype(np.int8)
    nodes = [*_qdq("x", "x_scale", "x_zero", "xq"), *_qdq("w", "w_scale", "w_zero", "wq", axis=0),
             helper.make_node("Gemm", ["xq", "wq", "bias"], ["y"], transB=1)]
    inits = [numpy_helper.from_array(v, k) for k, v in
             {"w": w, "bias": bias, "x_scale": x_scale, "x_zero": x_zero, "w_scale": w_scale, "w_zero": w_zero}.items()]
    model = model_of(nodes, {"x": x.shape}, ["y"], opset=opset, inits=inits)
    return with_loss(model, {"x": x}), {"x": x, "w": w, "bias": bias, "x_scale": x_scale, "w_scale": w_scale,
                                         "x_zero": x_zero, "w_zero": w_zero, "act": (act_min, act_max)}


def _torch_fake_quant_grads(v: dict, weight: np.ndarray, learnable: bool) -> dict[str, np.ndarray]:
    import torch

    t = {k: torch.tensor(v[k], requires_grad=True) for k in ("x", "w", "bias", "x_scale", "w_scale")}
    act_min, act_max = v["act"]
    if learnable:
        xq = torch._fake_quantize_learnable_per_tensor_affine(
            t["x"], t["x_scale"].reshape(1), torch.tensor([float(v["x_zero"])]), act_min, act_max, 1.0)
    else:
        xq = torch.fake_quantize_per_tensor_affine(t["x"], float(v["x_scale"]), int(v["x_zero"]), act_min, act_max)
    w_zero = torch.tensor(v["w_zero"].astype(np.int32)).reshape(-1)
    w_scale = t["w_scale"].reshape(-1)
    if w_scale.numel() == 1:
        w_scale = w_scale.expand(v["w"].shape[0])
        w_zero = w_zero.expand(v["w"].shape[0])
    if learnable:
        wq = torch._fake_quantize_learnable_per_channel_affine(t["w"], w_scale, w_zero.float(), 0, -128, 127, 1.0)
    else:
        wq = torch.fake_quantize_per_channel_affine(t["w"], w_scale.detach(), w_zero, 0, -128, 127)
    ((xq @ wq.T + t["bias"]) * torch.tensor(weight)).sum().backward()
    names = ("x", "w", "bias", "x_scale", "w_scale") if learnable else ("x", "w", "bias")
    return {k: t[k].grad.numpy() for k in names}


@pytest.mark.parametrize("opset", [13, 19, 21])
@pytest.mark.parametrize("act", list(QTYPES))
@pytest.mark.parametrize("per_channel", [False, True], ids=["w-per-tensor", "w-per-channel"])
@pytest.mark.parametrize("learnable", [False, True], ids=["fixed-scales", "learnable-scales"])
def test_fake_quantized_linear_matches_torch(opset, act, per_channel, learnable):
    model, v = _fake_quant_linear(opset, act, per_channel, np.random.default_rng(opset), learnable)
    wrt = ["x", "w", "bias"] + (["x_scale", "w_scale"] if learnable else [])
    ours = analytic(model, wrt, {"x": v["x"]})
    theirs = _torch_fake_quant_grads(v, numpy_helper.to_array(
        next(t for t in model.graph.initializer if t.name == "fdcheck_w_0")), learnable)
    levels = np.rint(v["x"] / v["x_scale"]) + v["x_zero"]
    assert np.any((levels < v["act"][0]) | (levels > v["act"][1])), "the test must clip some of x"
    for name in wrt:
        np.testing.assert_allclose(ours[name], theirs[name], err_msg=name,
                                   **(SCALE_TOL if name.endswith("_scale") else QDQ_TOL))


# name: onnx type, range, first opset
QUANT_TYPES = {"uint8": (TensorProto.UINT8, 0, 255, 13), "int8": (TensorProto.INT8, -128, 127, 13),
               "uint16": (TensorProto.UINT16, 0, 65535, 21), "int16": (TensorProto.INT16, -32768, 32767, 21),
               "uint4": (TensorProto.UINT4, 0, 15, 21), "int4": (TensorProto.INT4, -8, 7, 21)}


def _spread(p: np.ndarray, shape: tuple[int, ...], axis: int, block: int) -> np.ndarray:
    """A scale / zero point broadcast against the data (onnx's reshape_input)."""
    if p.ndim == 0:
        return p
    if not block:
        return p.reshape([-1 if i == axis else 1 for i in range(len(shape))])
    return np.repeat(p, block, axis=axis).take(range(shape[axis]), axis=axis)


def _gather_back(v: np.ndarray, p: np.ndarray, axis: int, block: int) -> np.ndarray:
    if p.ndim == 0:
        return v.sum()
    if not block:
        return v.sum(axis=tuple(i for i in range(v.ndim) if i != axis))
    ids = np.arange(v.shape[axis]) // block
    return np.stack([v.take(np.flatnonzero(ids == k), axis=axis).sum(axis=axis) for k in range(p.shape[axis])],
                    axis=axis)


@SETTINGS
@given(data=st.data())
def test_quantize_dequantize_straight_through(data):
    """Q -> DQ of every granularity and integer type: x gets g inside the range, 0 outside;
    the scale gets g * (round(x/s) - x/s) inside, g * (q - zp) outside (float64 reference)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    opset = data.draw(st.sampled_from([13, 19, 21, 23, 25]))
    name = data.draw(st.sampled_from([k for k, v in QUANT_TYPES.items() if v[3] <= opset]))
    qtype, qmin, qmax, _ = QUANT_TYPES[name]
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    kind = data.draw(st.sampled_from(["tensor", "axis"] + (["blocked"] if opset >= 21 else [])))
    block = data.draw(st.integers(1, 3)) if kind == "blocked" else 0
    pshape = () if kind == "tensor" else (shape[axis],) if kind == "axis" else tuple(
        -(-d // block) if i == axis % len(shape) else d for i, d in enumerate(shape))
    assume(kind != "blocked" or np.prod(pshape) > 1)  # onnxruntime takes a 1-element scale as per-tensor
    x = randn(rng, *shape) * 3
    scale = np.asarray((0.5 + rng.random(pshape)) * 4 / (qmax - qmin), np.float32)
    zero = np.asarray(rng.integers(qmin, qmax + 1, pshape))
    attrs = {"axis": axis, **({"block_size": block} if block else {})}
    # from_array packs 4-bit types into raw_data (gradgraph's model check miscounts them in int32_data)
    zero_init = numpy_helper.from_array(zero.astype(helper.tensor_dtype_to_np_dtype(qtype)), "zero")
    model = model_of(_qdq("x", "scale", "zero", "y", **attrs), {"x": shape, "scale": pshape}, ["y"], opset=opset,
                     inits=[zero_init])
    feeds = {"x": x, "scale": scale}
    model = with_loss(model, feeds)
    ours = analytic(model, ["x", "scale"], feeds)

    g = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "fdcheck_w_0")).astype(np.float64)
    s = _spread(scale, shape, axis % len(shape), block).astype(np.float64)
    z = _spread(zero, shape, axis % len(shape), block)
    ratio = (x / _spread(scale, shape, axis % len(shape), block)).astype(np.float64)  # float32 division, as run
    level = np.rint(ratio) + z
    inside = (level >= qmin) & (level <= qmax)
    expected_scale = np.where(inside, np.rint(ratio) - x / s, np.clip(level, qmin, qmax) - z) * g
    np.testing.assert_allclose(ours["x"], np.where(inside, g, 0), **QDQ_TOL)
    # float32 holds (q - zp) * s - x to about |q - zp| * 2**-24 * s: wide types lose more
    wide = _gather_back(np.abs(g), scale, axis % len(shape), block) * (qmax - qmin) * 2.0**-22
    expected = _gather_back(expected_scale, scale, axis % len(shape), block)
    assert np.all(np.abs(ours["scale"] - expected) <= SCALE_TOL["atol"] + SCALE_TOL["rtol"] * np.abs(expected) + wide)


# ---- signal ops ----------------------------------------------------------------------------------


@SETTINGS
@given(data=st.data())
def test_dft(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    opset = data.draw(st.sampled_from([17, 20]))
    dims = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    axis = data.draw(st.integers(0, len(dims) - 1))
    inverse, onesided = data.draw(st.sampled_from([(0, 0), (0, 1), (1, 0), (1, 1)]))
    # onesided: real input forward (RFFT), complex input inverse (IRFFT)
    complex_in = inverse if onesided else data.draw(st.sampled_from([0, 1]))
    length = data.draw(st.sampled_from([None, max(1, dims[axis] - 2), dims[axis] + 2]))
    if inverse and onesided:  # the standard IRFFT layout: length // 2 + 1 bins
        length = data.draw(st.sampled_from([2 * dims[axis] - 1] + ([None, 2 * dims[axis] - 2] if dims[axis] > 1 else [])))
    shape = [*dims, 1 + complex_in]
    inits, inputs, attrs = [], ["x", "" if length is None else "n"], {"inverse": inverse, "onesided": onesided}
    if length is not None:
        inits.append(int64("n", length))
    signed = axis - len(shape) if data.draw(st.booleans()) else axis
    if opset >= 20:
        inits.append(int64("axis", signed))
        inputs.append("axis")
    else:
        attrs["axis"] = signed
    nodes = [helper.make_node("DFT", inputs, ["y"], **attrs)]
    assert_fd(model_of(nodes, {"x": shape}, ["y"], opset=opset, inits=inits), {"x": randn(rng, *shape)})


@SETTINGS
@given(data=st.data())
def test_stft(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    batch, signal = data.draw(st.integers(1, 2)), data.draw(st.integers(4, 12))
    complex_in = data.draw(st.sampled_from([0, 1]))
    frame = data.draw(st.integers(2, signal))
    step = data.draw(st.integers(1, 4))
    form = data.draw(st.sampled_from(["window", "frame_length", "window+frame_length"]))
    inputs = {"x": (batch, signal, 1 + complex_in)}
    names = ["x", "step", "", ""]
    inits = [int64("step", step)]
    if "window" in form:
        inputs["w"] = (frame,)
        names[2] = "w"
    if "frame_length" in form:
        inits.append(int64("frame", frame))
        names[3] = "frame"
    onesided = 0 if complex_in else data.draw(st.sampled_from([0, 1]))
    nodes = [helper.make_node("STFT", [k for k in names], ["y"], onesided=onesided)]
    feeds = {k: randn(rng, *s) for k, s in inputs.items()}
    assert_fd(model_of(nodes, inputs, ["y"], opset=17, inits=inits), feeds)


# ---- TensorScatter, SwiGLU, CausalConvWithState --------------------------------------------------


@SETTINGS
@given(data=st.data())
def test_tensor_scatter(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    rank = data.draw(st.integers(3, 4))
    axis = data.draw(st.integers(1, rank - 1))
    cache = data.draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank))
    cache[axis] = data.draw(st.integers(2, 6))
    update = list(cache)
    update[axis] = data.draw(st.integers(1, cache[axis]))
    mode = data.draw(st.sampled_from(["linear", "circular"]))
    inputs = ["past", "update"]
    inits = []
    if data.draw(st.booleans()):
        top = cache[axis] if mode == "circular" else cache[axis] - update[axis]
        inits.append(int64("at", rng.integers(0, top + 1, cache[0])))
        inputs.append("at")
    signed = axis - rank if data.draw(st.booleans()) else axis
    nodes = [helper.make_node("TensorScatter", inputs, ["y"], axis=signed, mode=mode)]
    feeds = {"past": randn(rng, *cache), "update": randn(rng, *update)}
    assert_fd(model_of(nodes, {"past": cache, "update": update}, ["y"], opset=24, inits=inits), feeds)


@SETTINGS
@given(data=st.data())
def test_swiglu(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    shape = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    alpha = data.draw(st.sampled_from([None, 1.0, 1.702, 0.5]))
    attrs = {} if alpha is None else {"alpha": alpha}
    nodes = [helper.make_node("SwiGLU", ["a", "v"], ["y"], **attrs)]
    feeds = {"a": randn(rng, *shape), "v": randn(rng, *shape)}
    assert_fd(model_of(nodes, {"a": shape, "v": shape}, ["y"], opset=28), feeds)


def assert_matches_torch(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], fn) -> None:
    """The gradient graph (float32) vs torch float64 autograd of ``sum(fn(**inputs)[k] * W_k)``."""
    import torch

    model = with_loss(model, feeds)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name.startswith("fdcheck_w_")}
    ours = analytic(model, list(feeds), feeds)
    inputs = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in feeds.items()}
    outs = fn(**inputs)
    sum((o * torch.tensor(weights[f"fdcheck_w_{k}"], dtype=torch.float64)).sum() for k, o in enumerate(outs)).backward()
    for name, value in inputs.items():
        np.testing.assert_allclose(ours[name], value.grad.numpy(), atol=TORCH_ATOL, rtol=TORCH_RTOL, err_msg=name)


def _torch_causal_conv(activation: str, x, w, bias=None, past=None):
    import torch

    if past is None:
        past = torch.zeros(*x.shape[:2], w.shape[2] - 1, dtype=x.dtype)
    padded = torch.cat([past, x], dim=2)
    y = torch.nn.functional.conv1d(padded, w, bias, groups=x.shape[1])
    if activation != "none":
        y = torch.nn.functional.silu(y)
    return [y, padded[:, :, x.shape[2]:]] if w.shape[2] > 1 else [y]


@SETTINGS
@given(data=st.data())
def test_causal_conv_with_state(data):
    """Against torch (the reference evaluator computes SiLU in float32 even for float64 data, so
    central differences of it are too noisy)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    batch, channels, length, taps = (data.draw(st.integers(1, n)) for n in (2, 3, 5, 4))
    shapes = {"x": (batch, channels, length), "w": (channels, 1, taps)}
    names = ["x", "w", "", ""]
    if data.draw(st.booleans()):
        shapes["bias"] = (channels,)
        names[2] = "bias"
    if taps > 1 and data.draw(st.booleans()):
        shapes["past"] = (batch, channels, taps - 1)
        names[3] = "past"
    activation = data.draw(st.sampled_from(["none", "silu", "swish"]))
    nodes = [helper.make_node("CausalConvWithState", names, ["y", "state"], activation=activation)]
    feeds = {k: randn(rng, *s) for k, s in shapes.items()}
    outputs = ["y", "state"] if taps > 1 else ["y"]
    assert_matches_torch(model_of(nodes, shapes, outputs, opset=27), feeds,
                         lambda **t: _torch_causal_conv(activation, **t))


# ---- detection ops -------------------------------------------------------------------------------


def _boxes(rng: np.random.Generator, count: int, height: int, width: int, scale: float) -> np.ndarray:
    """RoIs (x1, y1, x2, y2) in input coordinates, some reaching past the image."""
    lo = rng.uniform([-1.0, -1.0], [width - 1.0, height - 1.0], (count, 2))
    hi = lo + rng.uniform(0.3, 1.0, (count, 2)) * np.array([width, height]) * 0.8
    return (np.concatenate([lo, hi], axis=1) / scale).astype(np.float32)


@SETTINGS
@given(data=st.data())
def test_roi_align(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    opset = data.draw(st.sampled_from([13, 16]))
    n, c, h, w = (data.draw(st.integers(1, k)) for k in (2, 2, 6, 6))
    count = data.draw(st.integers(1, 3))
    scale = data.draw(st.sampled_from([1.0, 0.5]))
    attrs = {"mode": data.draw(st.sampled_from(["avg", "max"])), "spatial_scale": scale,
             "output_height": data.draw(st.integers(1, 3)), "output_width": data.draw(st.integers(1, 3)),
             "sampling_ratio": data.draw(st.integers(0, 2))}
    if opset >= 16:
        attrs["coordinate_transformation_mode"] = data.draw(st.sampled_from(["half_pixel", "output_half_pixel"]))
    inits = [numpy_helper.from_array(_boxes(rng, count, h, w, scale), "rois"),
             int64("batch", rng.integers(0, n, count))]
    nodes = [helper.make_node("RoiAlign", ["x", "rois", "batch"], ["y"], **attrs)]
    assert_fd(model_of(nodes, {"x": (n, c, h, w)}, ["y"], opset=opset, inits=inits), {"x": randn(rng, n, c, h, w)})


@SETTINGS
@given(data=st.data())
def test_max_roi_pool(data):
    """onnxruntime runs MaxRoiPool in float32 only (no float64 oracle): against a NumPy port of its
    kernel, checked on the forward output first."""
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    n, c, h, w = (data.draw(st.integers(1, k)) for k in (2, 2, 7, 7))
    count = data.draw(st.integers(1, 3))
    scale = data.draw(st.sampled_from([1.0, 0.5, 0.25]))
    pooled = (data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)))
    rois = np.concatenate([rng.integers(0, n, (count, 1)), _boxes(rng, count, h, w, scale)], axis=1)
    rois = rois.astype(np.float32)
    nodes = [helper.make_node("MaxRoiPool", ["x", "rois"], ["y"], pooled_shape=list(pooled), spatial_scale=scale)]
    model = model_of(nodes, {"x": (n, c, h, w)}, ["y"], opset=13, inits=[numpy_helper.from_array(rois, "rois")])
    x = randn(rng, n, c, h, w)
    model = with_loss(model, {"x": x})
    dy = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "fdcheck_w_0"))
    y, dx = max_roi_pool_reference(x, rois, pooled, scale, dy)
    np.testing.assert_allclose(run(model, ["y"], {"x": x})[0], y, rtol=1e-6)
    np.testing.assert_allclose(analytic(model, ["x"], {"x": x})["x"], dx, rtol=1e-6, atol=1e-6)


# ---- LinearAttention ------------------------------------------------------------------------------


@SETTINGS
@given(data=st.data())
def test_linear_attention(data):
    """Against torch (the op's function body and the reference evaluator compute in float32)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    rule = data.draw(st.sampled_from(["linear", "gated", "delta", "gated_delta"]))
    kv_heads, group = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    batch, steps, d_k, d_v = (data.draw(st.integers(1, n)) for n in (2, 4, 3, 3))
    scale = data.draw(st.sampled_from([0.0, 0.7]))
    shapes = {"query": (batch, steps, kv_heads * group * d_k), "key": (batch, steps, kv_heads * d_k),
              "value": (batch, steps, kv_heads * d_v)}
    names = ["query", "key", "value", "", "", ""]
    if data.draw(st.booleans()):
        shapes["past"] = (batch, kv_heads, d_k, d_v)
        names[3] = "past"
    if rule in ("gated", "gated_delta"):
        shapes["decay"] = (batch, steps, kv_heads * data.draw(st.sampled_from([1, d_k])))
        names[4] = "decay"
    if rule in ("delta", "gated_delta"):
        shapes["beta"] = (batch, steps, data.draw(st.sampled_from([1, kv_heads])))
        names[5] = "beta"
    feeds = {k: randn(rng, *s) * 0.5 for k, s in shapes.items()}
    if "decay" in feeds:
        feeds["decay"] = -np.abs(feeds["decay"])
    if "beta" in feeds:
        feeds["beta"] = rng.uniform(0.1, 0.9, shapes["beta"]).astype(np.float32)
    nodes = [helper.make_node("LinearAttention", names, ["y", "state"], update_rule=rule, scale=scale,
                              q_num_heads=kv_heads * group, kv_num_heads=kv_heads)]
    assert_matches_torch(
        model_of(nodes, shapes, ["y", "state"], opset=27), feeds,
        lambda **t: linear_attention_reference(kv_heads * group, kv_heads, scale, **t))


# ---- refusals and the scale of a lone DequantizeLinear --------------------------------------------


@pytest.mark.parametrize("per_channel", [False, True])
def test_dequantize_trained_scale(per_channel):
    """W = DequantizeLinear(int8 weights, s): s gets sum(g * (q - zp)) (exact: W is linear in s)."""
    rng = np.random.default_rng(1)
    q = rng.integers(-128, 128, (3, 4)).astype(np.int8)
    zero = rng.integers(-4, 5, 3 if per_channel else ()).astype(np.int8)
    scale = np.asarray(rng.uniform(0.01, 0.02, 3 if per_channel else ()), np.float32)
    nodes = [helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["w"], axis=0),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    model = model_of(nodes, {"x": (2, 3), "scale": scale.shape}, ["y"], opset=19,
                     inits=[numpy_helper.from_array(q, "q"), numpy_helper.from_array(zero, "zero")])
    x = randn(rng, 2, 3)
    model = with_loss(model, {"x": x, "scale": scale})
    ours = analytic(model, ["scale"], {"x": x, "scale": scale})["scale"]
    g = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "fdcheck_w_0"))
    levels = q.astype(np.float64) - (zero.reshape(-1, 1) if per_channel else zero)
    expected = ((x.T.astype(np.float64) @ g) * levels).sum(axis=1 if per_channel else None)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)


def _refused(model: onnx.ModelProto, wrt: Sequence[str], match: str) -> None:
    with pytest.raises(GradientError, match=match):
        build_gradient_graph(model, "loss", list(wrt))


def _parsed(body: str, opset: int = 21) -> onnx.ModelProto:
    return onnx.parser.parse_model(f'<ir_version: 10, opset_import: ["" : {opset}]>\n{body}')


def test_quantize_read_by_other_ops_is_refused():
    _refused(_parsed("""
    g (float[4] x) => (float loss) {
        s = Constant<value = float {0.1}>()
        q = QuantizeLinear(x, s)
        y = DequantizeLinear(q, s)
        c = Cast<to = 1>(q)
        t = Add(y, c)
        loss = ReduceSum<keepdims = 0>(t)
    }"""), ["x"], "defined only for QuantizeLinear -> DequantizeLinear")


def test_quantize_to_float8_is_refused():
    _refused(_parsed("""
    g (float[4] x) => (float loss) {
        s = Constant<value = float {0.1}>()
        z = Constant<value = float8e4m3fn {0}>()
        q = QuantizeLinear(x, s, z)
        y = DequantizeLinear(q, s, z)
        loss = ReduceSum<keepdims = 0>(y)
    }"""), ["x"], "integer quantization")


def test_lone_quantize_does_not_reach_the_loss():
    """QuantizeLinear read by anything but DequantizeLinear carries no gradient."""
    _refused(_parsed("""
    g (float[4] x) => (float loss) {
        s = Constant<value = float {0.1}>()
        q = QuantizeLinear(x, s)
        c = Cast<to = 1>(q)
        loss = ReduceSum<keepdims = 0>(c)
    }"""), ["x"], "does not reach loss")


def test_dft_refusals():
    _refused(_parsed("""
    g (float[2,5,2] x) => (float loss) {
        n = Constant<value = int64 {4}>()
        y = DFT<inverse = 1, onesided = 1>(x, n)
        loss = ReduceSum<keepdims = 0>(y)
    }""", 20), ["x"], "dft_length // 2 \\+ 1")
    _refused(_parsed("""
    g (float[2,5,2] x, int64 axis) => (float loss) {
        y = DFT(x, , axis)
        loss = ReduceSum<keepdims = 0>(y)
    }""", 20), ["x"], "computed 'axis'")


@pytest.mark.parametrize("new_axis", [0, 1])
def test_sequence_rules_on_tensors_of_unknown_rank(new_axis):
    """A sequence of tensors whose rank shape inference does not know (a Loop's sequence in the
    dynamo exporter's EmbeddingBag; here a Reshape to a shape of unknown length):
    SplitToSequence and ConcatFromSequence with axes >= 0 need no rank (they refused: "tensor
    of unknown rank")."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]),
             helper.make_node("SplitToSequence", ["r"], ["s"], axis=1),
             helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=0, new_axis=new_axis),
             helper.make_node("Mul", ["y", "y"], ["z"])]
    model = model_of(nodes, {"x": [12]}, ["z"], opset=18)
    model.graph.input.append(helper.make_tensor_value_info("shape", onnx.TensorProto.INT64, ["n"]))
    assert_fd(model, {"x": randn(rng, 12), "shape": np.array([3, 4], np.int64)}, wrt=["x"])


@pytest.mark.parametrize("cond", [True, False])
def test_if_branch_returning_its_own_initializer(cond):
    """onnxscript's optimizer folds a branch's constant output into an initializer of the branch
    (seen in the dynamo exporter's EmbeddingBag): no gradient flows there, the other output's
    does (the rule refused the branch: "returns ..., which it does not compute")."""
    def branch(name: str, op: str, value: float) -> onnx.GraphProto:
        return helper.make_graph(
            [helper.make_node(op, ["x", "x"] if op == "Mul" else ["x"], [f"{name}_y"])], name, [],
            [helper.make_tensor_value_info(f"{name}_y", FLOAT, [2, 3]),
             helper.make_tensor_value_info(f"{name}_c", FLOAT, [2, 3])],
            [numpy_helper.from_array(np.full((2, 3), value, np.float32), f"{name}_c")])

    nodes = [helper.make_node("If", ["c"], ["y", "k"], then_branch=branch("t", "Mul", 2.0),
                              else_branch=branch("e", "Neg", -1.0)),
             helper.make_node("Mul", ["y", "k"], ["z"])]
    model = model_of(nodes, {"x": [2, 3]}, ["z"], opset=18)
    model.graph.input.append(helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, []))
    rng = np.random.default_rng(4)
    assert_fd(model, {"x": randn(rng, 2, 3), "c": np.array(cond)}, wrt=["x"])
