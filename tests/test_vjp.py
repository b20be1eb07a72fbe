"""VjpSeedPass: seeds per float output, marks, idempotence, refusals. (Its gradients are checked
against torch autograd in tests/test_torch_factory.py and tests/test_ortmodule.py.)"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from passes.autodiff.vjp import VjpSeedPass
from passes.marks import Role, role_of

TEXT = """
<ir_version: 8, opset_import: ["" : 18]>
g (float[2,3] x, int64[2] i) => (float[2,3] y, float s, int64[2] j) {
  y = Tanh(x)
  s = ReduceSum<keepdims=0>(y)
  j = Identity(i)
}
"""


def _model() -> ir.Model:
    return ir.from_proto(onnx.parser.parse_model(TEXT))


def test_one_seed_per_float_output_and_backward_marks():
    model = _model()
    vjp = VjpSeedPass()
    assert vjp(model).modified
    assert vjp.seeds == {"y": "y_grad_output", "s": "s_grad_output"}
    seeds = {v.name: v for v in model.graph.inputs}
    assert seeds["y_grad_output"].shape == ir.Shape([2, 3]) and seeds["s_grad_output"].shape == ir.Shape([])
    added = [n for n in model.graph if n.op_type in ("Mul", "ReduceSum", "Sum") and "vjp" in (n.name or "")]
    assert added and all(role_of(n) == Role.BACKWARD for n in added)
    assert any(v.name == vjp.loss for n in model.graph for v in n.outputs)
    onnx.checker.check_model(ir.to_proto(model), full_check=True)


def test_second_run_changes_nothing():
    model = _model()
    VjpSeedPass()(model)
    before = ir.to_proto(model).SerializeToString()
    again = VjpSeedPass()
    assert not again(model).modified
    assert again.seeds == {"y": "y_grad_output", "s": "s_grad_output"}
    assert ir.to_proto(model).SerializeToString() == before


def test_selected_outputs_and_refusals():
    model = _model()
    vjp = VjpSeedPass(["s"])
    vjp(model)
    assert vjp.seeds == {"s": "s_grad_output"}
    with pytest.raises(ValueError, match="not graph outputs"):
        VjpSeedPass(["nope"])(_model())
    with pytest.raises(ValueError, match="no floating-point graph output"):
        VjpSeedPass(["j"])(_model())
    with pytest.raises(ValueError, match="already has a value named 'y'"):
        VjpSeedPass(loss="y")(_model())


def test_each_output_is_seeded_by_its_seed_directly():
    """The gradient of the VJP scalar reads the seeds as the outputs' gradients: no node of the
    gradient reads the product ``output * seed`` (so a split drops it, and the backward does not
    read the output for it). Values against numpy float64: dx = (g_y + g_s) * (1 - tanh(x)^2)."""
    import numpy as np
    import onnxruntime as ort

    from passes.autodiff.gradient_pass import GradientPass

    model = _model()
    vjp = VjpSeedPass()
    vjp(model)
    GradientPass(vjp.loss, ["x"])(model)
    products = [n for n in model.graph if n.op_type == "Mul" and "vjp" in (n.name or "")]
    assert products and all([u.node.op_type for u in n.outputs[0].uses()] == ["ReduceSum"] for n in products)
    assert "x_grad" in {v.name for v in model.graph.outputs}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    gy = rng.standard_normal((2, 3)).astype(np.float32)
    gs = np.array(0.7, np.float32)
    sess = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": x, "i": np.array([1, 2], np.int64), "y_grad_output": gy, "s_grad_output": gs}
    got = sess.run(["x_grad"], feeds)[0]
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(got, (gy + 0.7) * (1 - np.tanh(x64) ** 2), rtol=1e-5, atol=1e-6)
