"""SplitToSequence -> SequenceAt gradients (the dynamo exporter's torch.split), in onnxruntime.

loss = sum_k ReduceSum(SequenceAt(seq, pos_k) * w_k): the gradient of x is each w_k placed
back at the position of its chunk (summed where a chunk is read twice, zero where unread).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgraph.api import build_gradient_graph

SHAPE = (3, 10, 4)


def _chunks(x: np.ndarray, axis: int, split, keepdims: int) -> list[np.ndarray]:
    size = x.shape[axis]
    if split is None:
        parts = np.split(x, size, axis=axis)
        return parts if keepdims else [np.squeeze(p, axis) for p in parts]
    if np.ndim(split) == 0:
        bounds = list(range(int(split), size, int(split)))
    else:
        bounds = list(np.cumsum(split)[:-1])
    return np.split(x, bounds, axis=axis)


def _model(axis, split, keepdims, positions, pos_dtype, weights):
    inits = []
    inputs = ["x"]
    if split is not None:
        inits.append(numpy_helper.from_array(np.asarray(split, np.int64), "split"))
        inputs.append("split")
    attrs = {"axis": axis} if split is not None else {"axis": axis, "keepdims": keepdims}
    nodes = [helper.make_node("SplitToSequence", inputs, ["seq"], **attrs)]
    terms = []
    for k, (pos, w) in enumerate(zip(positions, weights)):
        inits.append(numpy_helper.from_array(np.asarray(pos, pos_dtype), f"p{k}"))
        inits.append(numpy_helper.from_array(w, f"w{k}"))
        nodes += [helper.make_node("SequenceAt", ["seq", f"p{k}"], [f"c{k}"]),
                  helper.make_node("Mul", [f"c{k}", f"w{k}"], [f"m{k}"]),
                  helper.make_node("ReduceSum", [f"m{k}"], [f"s{k}"], keepdims=0)]
        terms.append(f"s{k}")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    graph = helper.make_graph(nodes, "seq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


CASES = {
    "no-split-keepdims": (0, None, 1, [0, -1, 2, 0]),
    "no-split-squeeze": (1, None, 0, [3, -2, 9]),
    "scalar-split": (1, 4, 1, [-1, 0, 2]),
    "list-split": (-1, [1, 2, 1], 1, [1, -3, 1]),
    "list-split-unused-chunk": (1, [2, 5, 3], 1, [2, 0]),
}


@pytest.mark.parametrize("pos_dtype", [np.int64, np.int32])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_split_to_sequence_at(case, pos_dtype):
    axis, split, keepdims, positions = CASES[case]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(SHAPE).astype(np.float32)
    chunk_ids = _chunks(np.arange(x.size).reshape(SHAPE), axis, split, keepdims)
    weights = [rng.standard_normal(chunk_ids[p].shape).astype(np.float32) for p in positions]
    model = _model(axis, split, keepdims, positions, pos_dtype, weights)
    grad_model = build_gradient_graph(model, "loss", ["x"])
    onnx.checker.check_model(grad_model, full_check=True)
    sess = ort.InferenceSession(grad_model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = sess.run(["x_grad"], {"x": x})
    expected = np.zeros(x.size, np.float32)
    for p, w in zip(positions, weights):
        np.add.at(expected, chunk_ids[p].reshape(-1), w.reshape(-1))
    np.testing.assert_allclose(got, expected.reshape(SHAPE), rtol=1e-6, atol=1e-6)


def test_sequence_at_of_a_constructed_sequence():
    """SequenceConstruct(x, x)[0]: the gradient of x is 1 (element 0), not 2 (once refused)."""
    text = """
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[2] x) => (float loss) {
        seq = SequenceConstruct(x, x)
        p = Constant<value = int64 {0}>()
        c = SequenceAt(seq, p)
        loss = ReduceSum<keepdims = 0>(c)
    }
    """
    grad = build_gradient_graph(onnx.parser.parse_model(text), "loss", ["x"])
    session = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    out = dict(zip([o.name for o in session.get_outputs()],
                   session.run(None, {"x": np.array([0.5, -2.0], np.float32)})))
    np.testing.assert_array_equal(out["x_grad"], np.ones(2, np.float32))
