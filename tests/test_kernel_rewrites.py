"""passes.kernels: each rewrite gives the same values as the original graph in onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from passes.kernels import SplitSoftmaxCrossEntropyPass


def _sce_model(reduction: str, ignore_index: int | None, weights: bool, log_prob: bool,
               rank: int = 2) -> onnx.ModelProto:
    shape = [6, 5] if rank == 2 else [6, 5, 3]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
              helper.make_tensor_value_info("y", TensorProto.INT64, [6] if rank == 2 else [6, 3])]
    if weights:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [5]))
    outputs = ["loss"] + (["log_prob"] if log_prob else [])
    attrs = {"reduction": reduction}
    if ignore_index is not None:
        attrs["ignore_index"] = ignore_index
    node = helper.make_node("SoftmaxCrossEntropyLoss", [i.name for i in inputs], outputs, name="sce",
                            **attrs)
    # A consumer of the loss inside the graph, so replacing uses is exercised too.
    double = helper.make_node("Add", ["loss", "loss"], ["twice"])
    graph = helper.make_graph([node, double], "g", inputs,
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                               for n in [*outputs, "twice"]])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [None, 2])
@pytest.mark.parametrize("weights,log_prob", [(False, False), (True, True)])
def test_split_softmax_cross_entropy_same_values(reduction, ignore_index, weights, log_prob) -> None:
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((6, 5)).astype(np.float32),
             "y": np.array([0, 2, 4, 2, 1, 3], np.int64),
             "w": rng.uniform(0.5, 2.0, 5).astype(np.float32)}
    model = _sce_model(reduction, ignore_index, weights, log_prob)
    ir_model = ir.from_proto(model)
    assert SplitSoftmaxCrossEntropyPass()(ir_model).modified
    rewritten = ir.to_proto(ir_model)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "SoftmaxCrossEntropyLoss" not in ops and ops.count("LogSoftmax") == 1
    assert [o.name for o in rewritten.graph.output] == [o.name for o in model.graph.output]
    for ours, ref in zip(_run(rewritten, feeds), _run(model, feeds), strict=True):
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7)


def test_higher_rank_scores_are_left_alone() -> None:
    model = ir.from_proto(_sce_model("mean", None, False, False, rank=3))
    assert not SplitSoftmaxCrossEntropyPass()(model).modified
    assert [n.op_type for n in model.graph][0] == "SoftmaxCrossEntropyLoss"
