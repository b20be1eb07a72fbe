"""Malformed graphs are refused at load time with an error naming the value or node."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from gradgraph import GradientError, build_gradient_graph
from gradgraph.cli.main import main as cli_main

X = [h.make_tensor_value_info("x", T.FLOAT, [2])]
A = [h.make_tensor_value_info("a", T.FLOAT, [2])]


def _model(nodes, inits=(), outputs=A) -> onnx.ModelProto:
    return h.make_model(h.make_graph(nodes, "g", X, outputs, list(inits)),
                        opset_imports=[h.make_opsetid("", 18)])


def test_cycle_is_refused_not_hung() -> None:
    model = _model([h.make_node("Add", ["x", "b"], ["a"], name="add"),
                    h.make_node("Relu", ["a"], ["b"], name="relu")])
    with pytest.raises(GradientError, match=r"cycle.*'add' \(Add\).*'relu' \(Relu\)"):
        build_gradient_graph(model, "a", ["x"], loss_reduction="sum")


def test_value_produced_twice() -> None:
    model = _model([h.make_node("Relu", ["x"], ["a"]), h.make_node("Tanh", ["x"], ["a"])])
    with pytest.raises(GradientError, match=r"'a' is produced twice.*#1 \(Tanh\)"):
        build_gradient_graph(model, "a", ["x"], loss_reduction="sum")


def test_initializer_with_too_little_data(tmp_path) -> None:
    w = onnx.numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    w.dims[:] = [4, 3]
    model = _model([h.make_node("Add", ["x", "w"], ["a"])], [w])
    with pytest.raises(GradientError, match=r"initializer 'w' holds 24 bytes.*48 expected"):
        build_gradient_graph(model, "a", ["w"], loss_reduction="sum")
    path = tmp_path / "broken.onnx"
    onnx.save(model, str(path))
    assert cli_main(["grad", str(path), "--loss", "a", "--reduce", "sum", "-o",
                     str(tmp_path / "out.onnx")]) == 2
    assert not (tmp_path / "out.onnx").exists()


def test_typed_field_count_checked() -> None:
    w = h.make_tensor("w", T.FLOAT, [2], [1.0, 2.0])
    w.dims[:] = [3]
    model = _model([h.make_node("Add", ["x", "w"], ["a"])], [w])
    with pytest.raises(GradientError, match=r"holds 2 values for dims \[3\]"):
        build_gradient_graph(model, "a", ["w"], loss_reduction="sum")


def test_node_overwriting_an_initializer() -> None:
    w = onnx.numpy_helper.from_array(np.ones(2, np.float32), "w")
    model = _model([h.make_node("Relu", ["x"], ["w"]), h.make_node("Add", ["x", "w"], ["a"])], [w])
    with pytest.raises(GradientError, match="writes 'w', which is also an initializer"):
        build_gradient_graph(model, "a", ["x"], loss_reduction="sum")


def test_well_formed_unsorted_graph_is_accepted() -> None:
    """Nodes out of topological order are not a cycle."""
    model = _model([h.make_node("Relu", ["t"], ["a"]), h.make_node("Tanh", ["x"], ["t"])])
    grad = build_gradient_graph(model, "a", ["x"], loss_reduction="sum")
    assert any(o.name == "x_grad" for o in grad.graph.output)
