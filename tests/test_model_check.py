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


def _external_model(location: str) -> onnx.ModelProto:
    w = onnx.TensorProto(name="w", data_type=T.FLOAT, dims=[2], data_location=T.EXTERNAL)
    entry = w.external_data.add()
    entry.key, entry.value = "location", location
    return _model([h.make_node("Mul", ["x", "w"], ["a"])], [w])


def test_external_data_of_bytes_or_protos_is_never_read(tmp_path) -> None:
    """A model given as bytes / ModelProto has no folder: external data anywhere is refused,
    before anything reads the file it points at."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(2, dtype=np.float32).tobytes())
    for location in (str(secret), "../secret.bin", "secret.bin"):
        model = _external_model(location)
        for given in (model, model.SerializeToString()):
            with pytest.raises(GradientError, match="external file.*pass the path of the .onnx"):
                build_gradient_graph(given, "a", ["w"], loss_reduction="sum")


def test_external_data_outside_the_model_folder_is_refused(tmp_path) -> None:
    (tmp_path / "secret.bin").write_bytes(np.arange(2, dtype=np.float32).tobytes())
    folder = tmp_path / "models"
    folder.mkdir()
    for location in ("../secret.bin", str(tmp_path / "secret.bin")):
        path = folder / "m.onnx"
        onnx.save(_external_model(location), str(path))
        with pytest.raises(GradientError, match="m.onnx"):
            build_gradient_graph(str(path), "a", ["w"], loss_reduction="sum")


def test_external_data_inside_the_model_folder_loads(tmp_path) -> None:
    (tmp_path / "weights.bin").write_bytes(np.array([2.0, 3.0], np.float32).tobytes())
    path = tmp_path / "m.onnx"
    onnx.save(_external_model("weights.bin"), str(path))
    grad = build_gradient_graph(str(path), "a", ["w"], loss_reduction="sum")
    assert any(o.name == "w_grad" for o in grad.graph.output)


def test_an_opset_newer_than_onnx_or_none_is_refused_by_name() -> None:
    import gradgraph
    from gradgraph.io import load_model

    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    newer = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 99)])
    with pytest.raises(gradgraph.GradientError, match="imports ONNX opset 99, newer than"):
        load_model(newer)
    none = onnx.helper.make_model(graph)
    del none.opset_import[:]
    with pytest.raises(gradgraph.GradientError, match="imports no opset"):
        load_model(none)
