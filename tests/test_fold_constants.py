"""FoldConstantsPass: folds Constant-only nodes, never initializers; outputs unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import parser

import gradgraph
from passes.forward.fold_constants import FoldConstantsPass, FoldOptions

MODEL = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[4, 6] x) => (float[4, 3] y, float loss) <float[6] w = {1., 2., 3., 4., 5., 6.}> {
  c0 = Constant<value = int64[1] {1}>()
  start = Unsqueeze(c_one, c_zero)
  c_one = Constant<value = int64 {1}>()
  c_zero = Constant<value = int64[1] {0}>()
  end = Constant<value = int64[1] {4}>()
  axes = Constant<value = int64[1] {1}>()
  steps = Unsqueeze(c_one, c_zero)
  xw = Mul(x, w)
  y = Slice(xw, start, end, axes, steps)
  wide = Unsqueeze(w, c_zero)
  s = ReduceSum<keepdims=0>(y)
  loss = Mul(s, s)
}
"""


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def _fold(proto: onnx.ModelProto, **options) -> tuple[onnx.ModelProto, bool, bool]:
    model = ir.from_proto(proto)
    ir.passes.common.TopologicalSortPass()(model)
    first = FoldConstantsPass(FoldOptions(**options))(model).modified
    second = FoldConstantsPass(FoldOptions(**options))(model).modified
    return ir.to_proto(model), first, second


def test_folds_constant_chains_only_and_keeps_outputs():
    proto = parser.parse_model(MODEL)
    folded, first, second = _fold(proto)
    assert first and not second
    onnx.checker.check_model(folded, full_check=True)
    ops = [n.op_type for n in folded.graph.node]
    # Both Unsqueeze(Constant) are folded; Unsqueeze(w) reads an initializer and stays.
    assert ops.count("Unsqueeze") == 1
    unsq = next(n for n in folded.graph.node if n.op_type == "Unsqueeze")
    assert unsq.input[0] == "w"
    assert [i.name for i in folded.graph.initializer] == ["w"]
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    for a, b in zip(_run(proto, x), _run(folded, x)):
        np.testing.assert_array_equal(a, b)


def test_large_results_are_not_folded():
    proto = parser.parse_model("""
<ir_version: 9, opset_import: ["" : 18]>
g (float[2] x) => (float[2] y) {
  shape = Constant<value = int64[1] {10000}>()
  big = ConstantOfShape(shape)
  s = ReduceSum<keepdims=1>(big)
  y = Add(x, s)
}
""")
    folded, first, _ = _fold(proto, max_elements=100)
    assert "ConstantOfShape" in [n.op_type for n in folded.graph.node]
    assert not first  # ReduceSum of it is not foldable either: its input is not a Constant
    folded_all, _, _ = _fold(proto, max_elements=20000)
    assert "ConstantOfShape" not in [n.op_type for n in folded_all.graph.node]


def test_slice_with_computed_steps_gets_the_pad_gradient():
    """With steps folded to a constant 1, the Slice gradient is a Pad, not a flat scatter."""
    grad = gradgraph.build_gradient_graph(parser.parse_model(MODEL), "loss", ["w"])
    ops = {n.op_type for n in grad.graph.node}
    assert "Pad" in ops and "Range" not in ops  # no flat-index scatter over the input
    x = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    w = np.arange(1, 7, dtype=np.float64)
    y = (x.astype(np.float64) * w)[:, 1:4]
    expected = 2 * y.sum() * np.concatenate([[0], x[:, 1:4].sum(0), [0, 0]])
    sess = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    (dw,) = sess.run(["w_grad"], {"x": x})
    np.testing.assert_allclose(dw, expected, rtol=1e-5)


def test_huge_results_are_not_evaluated() -> None:
    """ConstantOfShape / Expand / Tile / Range claiming huge results are left alone quickly,
    never allocated (10**12 elements would need terabytes)."""
    import time

    model = ir.from_onnx_text('''<ir_version: 9, opset_import: ["" : 18]>
g (float[2] x) => (float[?] a, float[?,?] b, int64[?] c) {
 s = Constant <value_ints = [1000000, 1000000]> ()
 z = ConstantOfShape (s)
 one = Constant <value = float[1] {1.0}> ()
 e = Expand (one, s)
 start = Constant <value = int64 {0}> ()
 limit = Constant <value = int64 {1000000000000}> ()
 delta = Constant <value = int64 {1}> ()
 c = Range (start, limit, delta)
 a = Add (x, x)
 b = Add (z, e)
}''')
    begin = time.perf_counter()
    result = FoldConstantsPass()(model)
    assert time.perf_counter() - begin < 5
    assert not result.modified
    assert {n.op_type for n in model.graph} >= {"ConstantOfShape", "Expand", "Range"}


def test_value_ints_constants_fold() -> None:
    model = ir.from_onnx_text('''<ir_version: 9, opset_import: ["" : 18]>
g (float[2,3] x) => (float[6] y) {
 s = Constant <value_ints = [6]> ()
 t = Identity (s)
 y = Reshape (x, t)
}''')
    assert FoldConstantsPass()(model).modified
    assert [n.op_type for n in model.graph] == ["Constant", "Reshape"]
