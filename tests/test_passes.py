"""Every forward-graph pass: checker passes, a second run reports no change, outputs unchanged.

The fixture has what the passes act on: a local function (inlined), Constant-only shape
arguments (folded), a training-mode Dropout without its mask (exposed) and BatchNormalization.
Outputs are compared in onnxruntime with dropout ratio 0 so that runs are deterministic.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import parser

from passes.forward.expose_dropout_mask import ExposeDropoutMaskPass
from passes.forward.fold_constants import FoldConstantsPass
from passes.forward.prepare import PrepareForGradientPass
from passes.forward.sequence_types import TypeSequenceOutputsPass

MODEL = """
<ir_version: 9, opset_import: ["" : 18, "local" : 1]>
g (float[2, 3, 4, 4] x) => (float loss, float[2, 3, 4, 4] y)
  <float[3] gamma = {1., 2., 3.}, float[3] beta = {0.1, 0.2, 0.3},
   float[3] mean = {0., 0., 0.}, float[3] var = {1., 1., 1.}> {
  ratio = Constant<value = float {0.0}>()
  training = Constant<value = bool {1}>()
  one = Constant<value = int64 {1}>()
  zero = Constant<value = int64[1] {0}>()
  axes = Unsqueeze(one, zero)
  bn = BatchNormalization<training_mode = 0>(x, gamma, beta, mean, var)
  act = local.Swish(bn)
  y = Dropout(act, ratio, training)
  s = ReduceSum<keepdims = 0>(y, axes)
  loss = ReduceSum<keepdims = 0>(s)
}
<domain: "local", opset_import: ["" : 18]>
Swish (a) => (b) {
  sig = Sigmoid(a)
  b = Mul(a, sig)
}
"""

PASSES = {
    "prepare": PrepareForGradientPass,
    "fold_constants": FoldConstantsPass,
    "expose_dropout_mask": ExposeDropoutMaskPass,
    "type_sequence_outputs": TypeSequenceOutputsPass,
}


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output][:2]
    return sess.run(names, {"x": x})


@pytest.mark.parametrize("name", sorted(PASSES))
def test_pass_is_idempotent_checked_and_output_preserving(name):
    proto = parser.parse_model(MODEL)
    model = ir.from_proto(proto)
    ir.passes.common.TopologicalSortPass()(model)
    first = PASSES[name]()(model)
    second = PASSES[name]()(first.model)
    assert not second.modified, f"{name}: a second run reports a change"
    out = ir.to_proto(second.model)
    onnx.checker.check_model(out, full_check=True)
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32)
    for before, after in zip(_run(proto, x), _run(out, x)):
        np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


def test_prepare_does_what_it_says():
    model = ir.from_proto(parser.parse_model(MODEL))
    result = PrepareForGradientPass()(model)
    assert result.modified
    ops = [n.op_type for n in result.model.graph]
    assert "Swish" not in ops and "Sigmoid" in ops            # inlined
    assert "Unsqueeze" not in ops                             # folded (Constant-only input)
    dropout = next(n for n in result.model.graph if n.op_type == "Dropout")
    assert len(dropout.outputs) == 2 and dropout.outputs[1].name  # mask exposed
    assert all(v.shape is not None for n in result.model.graph for v in n.outputs)


SEQUENCE_LOOP = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[3, 2] x, int64 trips) => (float[6, 2] y) {
  cond = Constant <value = bool {1}> ()
  empty = SequenceEmpty <dtype = 1> ()
  rows = Loop (trips, cond, empty) <body = step (int64 i, bool c, seq_in) => (bool c_out, seq_out) {
    c_out = Identity (c)
    scale = Cast <to = 1> (i)
    scaled = Mul (x, scale)
    seq_out = SequenceInsert (seq_in, scaled)
  }>
  y = ConcatFromSequence <axis = 0> (rows)
}
"""


def test_sequences_carried_by_a_loop_keep_their_type_through_shape_inference():
    """A sequence carried by a Loop (torchlib's EmbeddingBag did that): shape inference typed
    the body's carried input and output and the Loop's output as tensors; onnxruntime refused
    the model ("Type mismatch")."""
    model = ir.from_proto(parser.parse_model(SEQUENCE_LOOP))
    PrepareForGradientPass()(model)
    loop = next(n for n in model.graph if n.op_type == "Loop")
    body = loop.attributes["body"].value
    for value in (body.inputs[2], body.outputs[1], loop.outputs[0]):
        assert isinstance(value.type, ir.SequenceType), value
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    sess = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": x, "trips": np.array(2, np.int64)})
    np.testing.assert_array_equal(y, np.concatenate([x * 0, x * 1]))
