"""A graph output whose declared shape contradicts what the graph computes (torch 2.13's
dynamo export declares a per-sample loss ``reduction="none"`` as ``[]``): the computed shape
is used, with a warning naming the output, so that ``loss_reduction`` applies (it was skipped:
the sum's gradient came back for "mean") and a missing reduction is a clear error (it was an
onnxruntime traceback). A declaration that agrees keeps its own dim names."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from gradgraph import build_gradient_graph
from passes.autodiff.errors import GradientError


def _per_sample(declared: list) -> onnx.ModelProto:
    """loss = sum_j x_bj w_j per sample b, its output declared ``declared``."""
    mk = helper.make_node
    graph = helper.make_graph(
        [mk("Constant", [], ["axes"], value=helper.make_tensor("a", TensorProto.INT64, [1], [1])),
         mk("Mul", ["x", "w"], ["p"]), mk("ReduceSum", ["p", "axes"], ["loss"], keepdims=0)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, declared)],
        [helper.make_tensor("w", TensorProto.FLOAT, [3], [1.0, -2.0, 0.5])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_per_sample_loss_declared_scalar_is_reduced_as_asked():
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    with pytest.warns(UserWarning, match=r"'loss' is declared with shape \[\] but the graph computes shape \['b'\]"):
        grads = build_gradient_graph(_per_sample([]), loss="loss", loss_reduction="mean", weights_to_train=["w"])
    loss, dw = ort.InferenceSession(grads.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["loss", "w_grad"], {"x": x})
    assert loss.shape == ()
    np.testing.assert_allclose(loss, (x * [1.0, -2.0, 0.5]).sum(1).mean(), rtol=1e-6)
    np.testing.assert_allclose(dw, x.mean(0), rtol=1e-6)  # d mean_i sum_j x_ij w_j / d w = mean_i x_i


def test_without_a_reduction_the_error_names_the_computed_shape():
    with pytest.warns(UserWarning, match="declared with shape"), \
            pytest.raises(GradientError, match=r"loss 'loss' has shape \['b'\], not a scalar"):
        build_gradient_graph(_per_sample([]), loss="loss", weights_to_train=["w"])


def test_a_declaration_that_agrees_keeps_its_names(recwarn):
    grads = build_gradient_graph(_per_sample(["batch"]), loss="loss", loss_reduction="sum", weights_to_train=["w"])
    unreduced = [v for v in list(grads.graph.value_info) + list(grads.graph.output) if v.name == "loss_unreduced"]
    assert not [w for w in recwarn if "declared with shape" in str(w.message)]
    assert unreduced and [d.dim_param for d in unreduced[0].type.tensor_type.shape.dim] == ["batch"]
