"""Clip (ReLU6) and Relu gradients in the form the CNN benchmarks run (issue 37).

The open Clip and Relu read their mask from the output y (min < y < max exactly where
min < x < max) and multiply by it (no ``Where``, onnxruntime's slow kernel). Oracle: torch
float64 autograd of ``sum(op(x) * R)`` with elements of x drawn on the bounds themselves, with
one bound, the other or both; tolerance 1e-4 (float32 rounding).
"""

from __future__ import annotations

import fdcheck
import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from gradgraph.api import build_gradient_graph

torch = pytest.importorskip("torch")
F = torch.nn.functional

ATOL = RTOL = 1e-4
SETTINGS = settings(max_examples=20, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
SHAPE = (2, 3, 4)
# float64 stand-in for "no bound" in torch's hardtanh (open at both ends, as ONNX Clip's default here)
FAR = 1e30


def _model(op: str, lo: float | None, hi: float | None) -> onnx.ModelProto:
    consts = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in (("lo", lo), ("hi", hi))
              if v is not None]
    inputs = ["x"] + (["lo" if lo is not None else "", "hi"] if hi is not None else ["lo"] if lo is not None
                      else [])
    node = helper.make_node(op, inputs, ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    return fdcheck.with_weighted_loss(model, {"y": SHAPE})


def _weight(model: onnx.ModelProto) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name.startswith("fdcheck_w_")))


def _elements(points: list[float]) -> st.SearchStrategy[np.ndarray]:
    element = st.one_of(st.sampled_from(points), st.floats(-8.0, 8.0, width=32))
    size = int(np.prod(SHAPE))
    return st.lists(element, min_size=size, max_size=size).map(lambda v: np.array(v, np.float32).reshape(SHAPE))


@SETTINGS
@given(data=st.data(), bounds=st.sampled_from([(0.0, 6.0), (-1.0, 1.0), (0.0, None), (None, 6.0), (-2.5, None)]))
def test_open_clip_gradient_matches_torch_on_the_bounds(data, bounds):
    lo, hi = bounds
    model = _model("Clip", lo, hi)
    x = data.draw(_elements([v for v in bounds if v is not None] + [0.0]), label="x")
    ours = fdcheck.session(build_gradient_graph(model, fdcheck.LOSS, ["x"])).run(["x_grad"], {"x": x})[0]
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = F.hardtanh(xt, -FAR if lo is None else lo, FAR if hi is None else hi)
    (y * torch.tensor(_weight(model), dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(ours, xt.grad.numpy(), atol=ATOL, rtol=RTOL)


@SETTINGS
@given(data=st.data())
def test_relu_gradient_matches_torch_at_zero(data):
    model = _model("Relu", None, None)
    x = data.draw(_elements([0.0, -0.0]), label="x")
    ours = fdcheck.session(build_gradient_graph(model, fdcheck.LOSS, ["x"])).run(["x_grad"], {"x": x})[0]
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    (torch.relu(xt) * torch.tensor(_weight(model), dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(ours, xt.grad.numpy(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("op", "lo", "hi"), [("Clip", 0.0, 6.0), ("Clip", None, 6.0), ("Relu", None, None)])
def test_open_mask_reads_the_output_and_multiplies(op, lo, hi):
    """The backward reads y, not x (x need not be kept), and has no Where (5x slower than Cast +
    Mul in onnxruntime on a ReLU6 of MobileNetV2's size)."""
    grad = build_gradient_graph(_model(op, lo, hi), fdcheck.LOSS, ["x"])
    backward = [n for n in grad.graph.node if n.output[0] != "y" and not n.output[0].startswith("fdcheck")]
    assert not any(n.op_type == "Where" for n in backward), [n.op_type for n in backward]
    readers = {n.op_type for n in backward if "x" in n.input}
    assert not readers, f"the backward reads x in {readers}"
