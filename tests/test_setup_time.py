"""What keeps a training build's setup short (issue 34 §3), each against the slow way it replaced:

- the scatter-add rewrite infers the shapes of its Sum's inputs from the nodes that compute
  them (``passes.shapes.infer_shapes_for``), not by a shape inference of the whole graph, and
  takes back what it gave where that is not enough (then the whole-graph inference runs, as
  before);
- the index inputs of a ModelProto are found in the proto itself, with the same result as in
  its IR (no IR copy of a training graph's thousands of nodes).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import parser

import passes.kernels.scatter_accumulate as scatter_accumulate
from gradgraph import build_gradient_graph
from gradgraph.index_inputs import ALLOW_NEGATIVE_KEY, _index_uses, _proto_index_uses, index_uses
from passes.kernels import ScatterAddIntoSumPass
from passes.shapes import infer_missing_shapes, infer_shapes_for, static_shape

# A tied embedding: W is gathered and multiplied with, so its gradient is a Sum of a
# zero-filled scatter-add and a MatMul's gradient (the rewrite's pattern). 2-D, as GPT-2's
# dynamo export is where it matters: a 3-D MatMul's gradient flattens its operands to a shape
# computed from Shape (data propagation, which the whole-graph inference does), see
# tests/test_kernel_rewrites.py::test_kernel_passes_keep_training_gradients.
_TIED = """
<ir_version: 10, opset_import: ["" : 18]>
tied (int64[15] ids, float[15, 7] target) => (float loss) <float[7, 4] W = {WEIGHTS}> {
  h = Gather(W, ids)
  t = Tanh(h)
  wt = Transpose<perm = [1, 0]>(W)
  scores = MatMul(t, wt)
  d = Sub(scores, target)
  sq = Mul(d, d)
  loss = ReduceSum<keepdims = 0>(sq)
}
"""


def _tied() -> onnx.ModelProto:
    weights = np.random.default_rng(0).standard_normal(28).round(3)
    return parser.parse_model(_TIED.replace("{WEIGHTS}", "{" + ", ".join(map(str, weights)) + "}"))


def _sum_of_scatter(model: ir.Model) -> ir.Node:
    return next(n for n in model.graph if n.op_type == "Sum"
                and any(v is not None and v.producer() is not None and v.producer().op_type == "ScatterND"
                        for v in n.inputs))


def test_scatter_rewrite_infers_only_what_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rewrite happens without a whole-graph inference, and computes what the graph did."""
    grads = build_gradient_graph(_tied(), "loss")
    model = ir.from_proto(grads)

    def whole_graph(*args: object, **kwargs: object) -> bool:
        raise AssertionError("the whole graph's shapes were inferred")

    monkeypatch.setattr(scatter_accumulate, "infer_missing_shapes", whole_graph)
    assert ScatterAddIntoSumPass()(model).modified
    assert not any(n.op_type == "ConstantOfShape" for n in model.graph)
    rng = np.random.default_rng(1)
    feeds = {"ids": rng.integers(0, 7, 15), "target": rng.standard_normal((15, 7)).astype(np.float32)}
    names = [o.name for o in grads.graph.output]
    want = ort.InferenceSession(grads.SerializeToString(), providers=["CPUExecutionProvider"]).run(names, feeds)
    got = ort.InferenceSession(ir.to_proto(model).SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(names, feeds)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_infer_shapes_for_agrees_with_the_whole_graph() -> None:
    targets_model = ir.from_proto(build_gradient_graph(_tied(), "loss"))
    whole_model = ir.from_proto(build_gradient_graph(_tied(), "loss"))
    targets = [*_sum_of_scatter(targets_model).inputs]
    assert any(static_shape(v) is None for v in targets)
    assert infer_shapes_for(targets_model, targets)
    assert infer_missing_shapes(whole_model)
    whole = {v.name: static_shape(v) for v in _sum_of_scatter(whole_model).inputs}
    assert {v.name: static_shape(v) for v in targets} == whole
    assert all(shape is not None for shape in whole.values())


def test_infer_shapes_for_takes_back_what_it_gave_when_it_falls_short() -> None:
    """A shape only data propagation gives (Reshape to a shape computed by Concat): False, and
    every value has the type and shape it had before."""
    text = """
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[6] x, float[2, 3] y) => (float[2, 3] z) {
      s = Shape(y)
      a = Slice(s, start, end)
      b = Concat<axis = 0>(a, three)
      r = Reshape(x, b)
      t = Tanh(r)
      z = Add(t, y)
    }
    """
    proto = parser.parse_model(text)
    for name, value in (("start", [0]), ("end", [1]), ("three", [3])):
        proto.graph.initializer.append(onnx.numpy_helper.from_array(np.array(value, np.int64), name))
    model = ir.from_proto(proto)
    tanh = next(n for n in model.graph if n.op_type == "Tanh")
    before = {v.name: (v.type, v.shape) for n in model.graph for v in n.outputs}
    assert not infer_shapes_for(model, [tanh.outputs[0]])
    assert {v.name: (v.type, v.shape) for n in model.graph for v in n.outputs} == before
    assert infer_missing_shapes(model)  # the whole graph's inference (data propagation) knows it
    assert static_shape(tanh.outputs[0]) == (2, 3)


_LABELS = """
<ir_version: 10, opset_import: ["" : 18]>
labels (int64[4, 3] ids, int64[4] y, int64[2] pick) => (float loss) <float[10, 2] E = {EMB}, float[2, 5] W = {W}> {
  e = Gather(E, ids)
  r = ReduceMean<keepdims = 0>(e, one)
  scores = MatMul(r, W)
  p = Gather<axis = 1>(scores, pick)
  q = Identity(y)
  c = Cast<to = 7>(q)
  loss = SoftmaxCrossEntropyLoss<ignore_index = -100>(scores, c)
}
"""


@pytest.mark.parametrize("allow_negative", [False, True])
def test_index_uses_of_a_proto_equal_those_of_its_ir(monkeypatch: pytest.MonkeyPatch, allow_negative: bool) -> None:
    rng = np.random.default_rng(0)
    text = _LABELS.replace("{EMB}", "{" + ", ".join(map(str, rng.standard_normal(20).round(3))) + "}")
    proto = parser.parse_model(text.replace("{W}", "{" + ", ".join(map(str, rng.standard_normal(10).round(3))) + "}"))
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int64), "one"))
    proto = onnx.shape_inference.infer_shapes(proto)  # the sizes, as a built training graph has them
    if allow_negative:
        onnx.helper.set_model_props(proto, {ALLOW_NEGATIVE_KEY: "true"})
    want = _index_uses(ir.from_proto(proto))
    assert set(want) == {"ids", "y", "pick"}  # every kind of use is in the comparison
    assert _proto_index_uses(proto) == want

    def no_ir(*args: object, **kwargs: object) -> ir.Model:
        raise AssertionError("the proto was converted to IR")

    monkeypatch.setattr(ir, "from_proto", no_ir)
    assert index_uses(proto) == want
