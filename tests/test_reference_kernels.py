"""The vectorized pooling kernels of the check's reference oracle (gradgraph.runtime.reference_kernels)
against onnxruntime's float32 pooling, on random geometries: kernel sizes, strides,
dilations, explicit/SAME/VALID pads, ceil mode, count_include_pad, p."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from gradgraph.runtime.reference_kernels import REFERENCE_OVERRIDES


def _random_pool(rng: np.random.Generator) -> tuple[str, list[int], dict]:
    rank = int(rng.integers(1, 4))
    op = str(rng.choice(["AveragePool", "LpPool"]))
    kernel = [int(v) for v in rng.integers(1, 4, rank)]
    attrs: dict = {"kernel_shape": kernel, "strides": [int(v) for v in rng.integers(1, 4, rank)]}
    auto = str(rng.choice(["NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"]))
    if auto != "NOTSET":
        attrs["auto_pad"] = auto
    else:
        if rng.random() < 0.6:
            attrs["pads"] = [int(rng.integers(0, k)) for k in kernel * 2]
        if rng.random() < 0.4:
            attrs["ceil_mode"] = 1
    if rng.random() < 0.3:
        attrs["dilations"] = [int(v) for v in rng.integers(1, 3, rank)]
    if op == "AveragePool" and rng.random() < 0.5:
        attrs["count_include_pad"] = 1
    if op == "LpPool":
        attrs["p"] = int(rng.choice([1, 2, 3]))
    return op, [2, 3, *[int(v) for v in rng.integers(4, 9, rank)]], attrs


@pytest.mark.parametrize("seed", range(4))
def test_pooling_kernels_match_onnxruntime(seed: int) -> None:
    rng = np.random.default_rng(seed)
    compared = 0
    for _ in range(60):
        op, shape, attrs = _random_pool(rng)
        node = helper.make_node(op, ["x"], ["y"], **attrs)
        graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
        model.ir_version = 9
        x = rng.standard_normal(shape).astype(np.float32)
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        try:
            want = ort.InferenceSession(model.SerializeToString(), opts,
                                        providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        except Exception:  # noqa: BLE001 - a geometry onnxruntime refuses: nothing to compare
            continue
        got = ReferenceEvaluator(model, new_ops=REFERENCE_OVERRIDES).run(None, {"x": x})[0]
        assert got.shape == want.shape, (op, shape, attrs)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{op} {shape} {attrs}")
        compared += 1
    assert compared >= 40


def test_pooling_kernels_are_float64() -> None:
    """The oracle computes in float64 (a 1e-6 central-difference step needs it)."""
    x = np.random.default_rng(0).standard_normal([1, 2, 5, 5])
    node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2], pads=[1, 1, 1, 1])
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    got = ReferenceEvaluator(model, new_ops=REFERENCE_OVERRIDES).run(None, {"x": x})[0]
    assert got.dtype == np.float64
    # corner window: only x[0, 0] is inside the input (count_include_pad=0)
    assert got[0, 0, 0, 0] == x[0, 0, 0, 0]
    assert got[0, 1, 2, 3] == pytest.approx(x[0, 1, 1:3, 2:4].mean(), rel=1e-15)


@pytest.mark.parametrize("shape, size", [((2, 5, 3, 3), 3), ((3, 4, 2, 2), 7), ((1, 6, 2, 3), 5), ((4, 1, 2, 2), 1)])
def test_lrn_kernel_matches_onnxruntime_and_torch(shape, size) -> None:
    """LRN with batch != channels (the stock reference kernel loops over the batch axis)."""
    torch = pytest.importorskip("torch")
    attrs = {"size": size, "alpha": 0.3, "beta": 0.6, "bias": 1.5}
    node = helper.make_node("LRN", ["x"], ["y"], **attrs)
    graph = helper.make_graph([node], "lrn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    x = np.random.default_rng(size).standard_normal(shape).astype(np.float32)
    ours = ReferenceEvaluator(model, new_ops=REFERENCE_OVERRIDES).run(None, {"x": x})[0]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-6)
    torch_y = torch.nn.functional.local_response_norm(torch.from_numpy(x.astype(np.float64)), size,
                                                      alpha=0.3, beta=0.6, k=1.5).numpy()
    np.testing.assert_allclose(ours, torch_y, rtol=1e-5, atol=1e-6)
