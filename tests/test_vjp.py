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
