"""A model saved by onnxruntime's graph optimizer (``SessionOptions.optimized_model_filepath``)
keeps its gradients: the contrib ops that optimizer writes (FusedMatMul from a MatMul with a
Transpose or a scale folded in, FastGelu) have rules, and the gradients of the optimized model
equal those of the original (float32, rtol 1e-5)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from gradgraph import build_gradient_graph


def _original() -> onnx.ModelProto:
    mk = helper.make_node
    nodes = [mk("Transpose", ["W"], ["Wt"], perm=[1, 0]), mk("MatMul", ["x", "Wt"], ["h"]),
             mk("Mul", ["h", "scale"], ["hs"]), mk("Transpose", ["hs"], ["ht"], perm=[0, 2, 1]),
             mk("MatMul", ["ht", "x"], ["y"]), mk("ReduceSumSquare", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4]),
         helper.make_tensor_value_info("W", TensorProto.FLOAT, [5, 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [helper.make_tensor("scale", TensorProto.FLOAT, [], [0.125])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _optimized(model: onnx.ModelProto, tmp_path: Path) -> onnx.ModelProto:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return onnx.load(opts.optimized_model_filepath)


def _grads(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    grad_model = build_gradient_graph(model, "loss", ["x", "W"])
    session = ort.InferenceSession(grad_model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["x_grad", "W_grad"], feeds)


def test_fused_matmul_of_an_optimized_model(tmp_path: Path) -> None:
    original = _original()
    optimized = _optimized(original, tmp_path)
    fused = [n for n in optimized.graph.node if n.op_type == "FusedMatMul"]
    assert fused, [n.op_type for n in optimized.graph.node]  # the case this test is about
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, 4)).astype(np.float32),
             "W": rng.standard_normal((5, 4)).astype(np.float32)}
    for got, want in zip(_grads(optimized, feeds), _grads(original, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_fused_matmul_shapes_are_numpy_matmul_shapes() -> None:
    from passes.forward.contrib_shapes import _matmul_shape

    rng = np.random.default_rng(1)
    for _ in range(200):
        ra, rc = rng.integers(1, 5, 2)
        m, k, n = rng.integers(1, 4, 3)
        batch = list(rng.integers(1, 3, max(ra, rc) - 2)) if max(ra, rc) > 2 else []
        a = [k] if ra == 1 else [d if rng.random() < 0.7 else 1 for d in batch[len(batch) - (ra - 2):]] + [m, k]
        c = [k] if rc == 1 else [d if rng.random() < 0.7 else 1 for d in batch[len(batch) - (rc - 2):]] + [k, n]
        ta, tc = ra > 1 and rng.random() < 0.5, rc > 1 and rng.random() < 0.5
        stored_a = a[:-2] + [a[-1], a[-2]] if ta else a
        stored_c = c[:-2] + [c[-1], c[-2]] if tc else c
        want = list(np.matmul(np.zeros(a), np.zeros(c)).shape)
        assert _matmul_shape(stored_a, stored_c, ta, tc) == want, (stored_a, stored_c, ta, tc)


def test_llama_style_rms_norm_before_opset_23() -> None:
    """onnxruntime's default-domain SimplifiedLayerNormalization feeding a MatMul (whose rule
    needs the rank the contrib shapes give): gradients against float64 torch."""
    import torch

    mk = helper.make_node
    graph = helper.make_graph(
        [mk("SimplifiedLayerNormalization", ["x", "g"], ["n"], axis=-1, epsilon=1e-6),
         mk("MatMul", ["n", "W"], ["y"]), mk("ReduceSumSquare", ["y"], ["loss"], keepdims=0)],
        "rms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8]),
                helper.make_tensor_value_info("g", TensorProto.FLOAT, [8]),
                helper.make_tensor_value_info("W", TensorProto.FLOAT, [8, 5])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((2, 3, 8)).astype(np.float32),
             "g": rng.uniform(0.5, 1.5, 8).astype(np.float32),
             "W": rng.standard_normal((8, 5)).astype(np.float32)}
    grad_model = build_gradient_graph(model, "loss", ["x", "g", "W"])
    session = ort.InferenceSession(grad_model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(["x_grad", "g_grad", "W_grad"], feeds)
    x, g, w = (torch.tensor(feeds[k], dtype=torch.float64, requires_grad=True) for k in ("x", "g", "W"))
    n = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * g
    ((n @ w) ** 2).sum().backward()
    for ours, ref in zip(got, (x.grad, g.grad, w.grad), strict=True):
        np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-4, atol=1e-4)


def test_rms_norm_output_has_its_scales_type() -> None:
    """onnxruntime's SimplifiedLayerNormalization computes Y in its scale's type (float16 here,
    X float32): the contrib shapes type it so, and the gradient graph loads and runs."""
    rng = np.random.default_rng(0)
    mk = helper.make_node
    scale = onnx.numpy_helper.from_array(rng.uniform(0.5, 1.5, 4).astype(np.float16), "s")
    graph = helper.make_graph(
        [mk("SimplifiedLayerNormalization", ["x", "s"], ["y"], axis=-1, epsilon=1e-5),
         mk("Cast", ["y"], ["yf"], to=TensorProto.FLOAT), mk("ReduceSumSquare", ["yf"], ["loss"], keepdims=0)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [scale])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    grad_model = build_gradient_graph(model, "loss", ["x", "s"])
    session = ort.InferenceSession(grad_model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((2, 4)).astype(np.float32)
    dx, ds = session.run(["x_grad", "s_grad"], {"x": x})
    assert dx.dtype == np.float32 and ds.dtype == np.float16
    xd, sd = x.astype(np.float64), onnx.numpy_helper.to_array(scale).astype(np.float64)
    inv = 1 / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(ds, (2 * (xd * inv * sd) * xd * inv).sum(0), rtol=2e-2, atol=2e-2)


def test_a_generator_of_weights_is_read_once() -> None:
    model = _original()
    grads = build_gradient_graph(model, "loss", (name for name in ["W"]))
    assert [o.name for o in grads.graph.output] == ["loss", "W_grad"]


def test_bert_style_skip_layer_norm_between_matmuls() -> None:
    """onnxruntime's transformer optimizer writes a residual Add + LayerNormalization as
    com.microsoft SkipLayerNormalization (here with its bias and its input_skip_bias_sum output
    read by the next residual, shaped by ContribShapesPass for the MatMul rules after it):
    gradients against float64 torch."""
    import torch

    mk = helper.make_node
    graph = helper.make_graph(
        [mk("MatMul", ["x", "W"], ["h"]),
         mk("SkipLayerNormalization", ["h", "x", "g", "b", "bias"], ["n", "", "", "s"], domain="com.microsoft"),
         mk("MatMul", ["n", "V"], ["y"]), mk("Add", ["y", "s"], ["z"]),
         mk("ReduceSumSquare", ["z"], ["loss"], keepdims=0)],
        "skip", [helper.make_tensor_value_info(k, TensorProto.FLOAT, shape) for k, shape in
                 (("x", [2, 3, 8]), ("W", [8, 8]), ("g", [8]), ("b", [8]), ("bias", [8]), ("V", [8, 8]))],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    rng = np.random.default_rng(3)
    names = ["x", "W", "g", "b", "bias", "V"]
    feeds = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in
             zip(names, ((2, 3, 8), (8, 8), (8,), (8,), (8,), (8, 8)))}
    grad_model = build_gradient_graph(model, "loss", names)
    session = ort.InferenceSession(grad_model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run([f"{k}_grad" for k in names], feeds)
    x, w, g, b, bias, v = (torch.tensor(feeds[k], dtype=torch.float64, requires_grad=True) for k in names)
    s = x @ w + x + bias
    n = torch.nn.functional.layer_norm(s, (8,), g, b, eps=1e-12)
    ((n @ v + s) ** 2).sum().backward()
    for name, ours, ref in zip(names, got, (x.grad, w.grad, g.grad, b.grad, bias.grad, v.grad), strict=True):
        np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-4, atol=1e-3, err_msg=name)


def test_onnxruntime_layer_norm_below_opset_17() -> None:
    """onnxruntime's optimizer writes its own default-domain LayerNormalization into opset-14
    models (legacy exports it optimizes); onnx knows the op only from opset 17: shaped and
    differentiated as ONNX's (gradients against float64 torch)."""
    import torch

    mk = helper.make_node
    graph = helper.make_graph(
        [mk("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1, epsilon=1e-5),
         mk("MatMul", ["n", "W"], ["y"]), mk("ReduceSumSquare", ["y"], ["loss"], keepdims=0)],
        "ln14", [helper.make_tensor_value_info(k, TensorProto.FLOAT, shape) for k, shape in
                 (("x", [2, 3, 8]), ("g", [8]), ("b", [8]), ("W", [8, 5]))],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    rng = np.random.default_rng(4)
    names = ["x", "g", "b", "W"]
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in zip(names, ((2, 3, 8), (8,), (8,), (8, 5)))}
    grad_model = build_gradient_graph(model, "loss", names)
    session = ort.InferenceSession(grad_model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run([f"{k}_grad" for k in names], feeds)
    x, g, b, w = (torch.tensor(feeds[k], dtype=torch.float64, requires_grad=True) for k in names)
    ((torch.nn.functional.layer_norm(x, (8,), g, b, eps=1e-5) @ w) ** 2).sum().backward()
    for name, ours, ref in zip(names, got, (x.grad, g.grad, b.grad, w.grad), strict=True):
        np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-4, atol=1e-4, err_msg=name)
