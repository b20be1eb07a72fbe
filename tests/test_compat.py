"""gradgraph.runtime.compat.for_runtime and the target_ir_version/max_opset options (no reference venv needed)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest

from gradgraph import GradientError, build_gradient_graph
from gradgraph.runtime.compat import default_opset, for_runtime

MLP_23 = """<ir_version: 11, opset_import: ["" : 23]>
g (float[2,4] x, int64[2] y) => (float loss)
  <float[4,3] W = {0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2}, float[3] b = {0.1,0.2,0.3}> {
  h = MatMul(x, W)
  z = Add(h, b)
  r = Relu(z)
  loss = SoftmaxCrossEntropyLoss<reduction="mean">(r, y)
}"""


def _run(model, names, feeds):
    return ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(names, feeds)


def test_build_targets_ir10_opset21_and_matches_untargeted():
    model = onnx.parser.parse_model(MLP_23)
    targeted = build_gradient_graph(model, "loss", target_ir_version=10, max_opset=21)
    assert targeted.ir_version == 10 and default_opset(targeted) == 21
    onnx.checker.check_model(targeted, full_check=True)
    plain = build_gradient_graph(model, "loss")
    assert plain.ir_version == 11 and default_opset(plain) == 23
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32),
             "y": np.array([0, 2], dtype=np.int64)}
    names = ["loss", "W_grad", "b_grad"]
    for got, want in zip(_run(targeted, names, feeds), _run(plain, names, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_for_runtime_leaves_a_compatible_model_alone():
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
g (float[2] x) => (float[2] y) { y = Relu(x) }""")
    out = for_runtime(model)
    assert out == model and out is not model


def test_for_runtime_names_an_op_missing_at_the_target():
    model = onnx.parser.parse_model("""<ir_version: 11, opset_import: ["" : 23]>
g (float[2,4] x, float[4] s) => (float[2,4] y) { y = RMSNormalization(x, s) }""")
    with pytest.raises(GradientError, match="RMSNormalization do not exist at opset 21"):
        for_runtime(model)


def test_for_runtime_names_an_op_without_a_down_conversion():
    with pytest.raises(GradientError, match="no conversion for op 'Add'"):
        build_gradient_graph(onnx.parser.parse_model(MLP_23), "loss", max_opset=12)


def test_for_runtime_refuses_a_dtype_the_ir_version_lacks():
    model = onnx.parser.parse_model("""<ir_version: 11, opset_import: ["" : 21]>
g (float[2,4] x) => (float4e2m1[2,4] y) { y = Cast<to=23>(x) }""")
    with pytest.raises(GradientError, match="FLOAT4E2M1, which needs IR version 11"):
        for_runtime(model)


def test_training_parameters_refuse_unknown_properties() -> None:
    import pytest

    from gradgraph import TrainingParameters

    params = TrainingParameters()
    params.gradient_accumulation_steps = 2  # known: fine
    with pytest.raises(AttributeError, match="use_mixed_precison.*did you mean 'use_mixed_precision'"):
        params.use_mixed_precison = True


def test_inference_session_lowers_an_ir_version_newer_than_the_runtime() -> None:
    """A model written by a newer onnx package (IR version above onnxruntime's) still loads:
    lowered to the maximum onnxruntime names in its refusal."""
    from onnx import TensorProto, helper

    from gradgraph.runtime.compat import inference_session

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 99
    with pytest.raises(Exception, match="Unsupported model IR version: 99"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    session = inference_session(model, providers=["CPUExecutionProvider"])
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], np.maximum(x, 0))
    assert model.ir_version == 99, "the caller's model is not changed"
