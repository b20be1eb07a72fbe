"""Public API, errors and CLI of the gradient builder."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, parser

import gradgraph
from gradgraph.cli.main import main as cli_main

EXAMPLE = Path(gradgraph.__file__).parent / "examples" / "mlp.onnx"
BATCH = Path(gradgraph.__file__).parent / "examples" / "mlp_batch.npz"

LINEAR = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, 3] x) => (float loss, int64[B] arg) <float[3, 2] W = {1.,2.,3.,4.,5.,6.}, float[2] b = {0.5, -0.5}, float[2] unused = {1., 1.}> {
  h = MatMul(x, W)
  y = Add(h, b)
  arg = ArgMax<axis=1, keepdims=0>(y)
  sq = Mul(y, y)
  loss = ReduceSum<keepdims=0>(sq)
}
"""


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], names: list[str]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(names, feeds)


def test_gradients_match_torch_autograd():
    model = parser.parse_model(LINEAR)
    grad = gradgraph.build_gradient_graph(model, "loss", ["W", "b", "x"])
    onnx.checker.check_model(grad, full_check=True)
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    dw, db, dx = _run(grad, {"x": x}, ["W_grad", "b_grad", "x_grad"])
    tw = torch.tensor([[1., 2.], [3., 4.], [5., 6.]], requires_grad=True)
    tb = torch.tensor([0.5, -0.5], requires_grad=True)
    tx = torch.tensor(x, requires_grad=True)
    ((tx @ tw + tb) ** 2).sum().backward()
    for ours, ref in ((dw, tw.grad), (db, tb.grad), (dx, tx.grad)):
        np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-5, atol=1e-5)


def test_outputs_keep_forward_and_add_typed_grads():
    grad = gradgraph.build_gradient_graph(parser.parse_model(LINEAR), "loss", ["W", "b"])
    outputs = {o.name: o for o in grad.graph.output}
    assert list(outputs)[:2] == ["loss", "arg"]
    assert [d.dim_value for d in outputs["W_grad"].type.tensor_type.shape.dim] == [3, 2]
    assert outputs["b_grad"].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert {i.name for i in grad.graph.initializer} >= {"W", "b", "unused"}


def test_default_weights_are_initializers_on_the_loss_path():
    grad = gradgraph.build_gradient_graph(parser.parse_model(LINEAR), "loss")
    names = {o.name for o in grad.graph.output}
    assert {"W_grad", "b_grad"} <= names
    assert "unused_grad" not in names


def test_seed_from_input_scales_gradient():
    model = parser.parse_model(LINEAR)
    grad = gradgraph.build_gradient_graph(model, "loss", ["b"], seed_from_input=True)
    x = np.ones((2, 3), np.float32)
    (one,) = _run(gradgraph.build_gradient_graph(model, "loss", ["b"]), {"x": x}, ["b_grad"])
    (three,) = _run(grad, {"x": x, "loss_grad": np.array(3.0, np.float32)}, ["b_grad"])
    np.testing.assert_allclose(three, 3 * one, rtol=1e-6)


def test_unused_weight_is_an_error_unless_allowed():
    model = parser.parse_model(LINEAR)
    with pytest.raises(gradgraph.GradientError, match="'unused' does not reach loss 'loss'"):
        gradgraph.build_gradient_graph(model, "loss", ["W", "unused"])
    grad = gradgraph.build_gradient_graph(model, "loss", ["W", "unused"], allow_unused=True)
    (zero,) = _run(grad, {"x": np.ones((2, 3), np.float32)}, ["unused_grad"])
    np.testing.assert_array_equal(zero, np.zeros(2, np.float32))


TRAIN_BN = """
<ir_version: 9, opset_import: ["" : 15]>
g (float[4, 2] x) => (float loss) <float[2] s = {1., 2.}, float[2] b = {0., 1.}, float[2] mean = {0., 0.},
                                   float[2] var = {1., 1.}> {
  y, rm, rv = BatchNormalization<training_mode=1>(x, s, b, mean, var)
  sq = Mul(y, y)
  loss = ReduceSum<keepdims=0>(sq)
}
"""


def test_a_running_statistic_the_loss_does_not_read_is_refused_though_connected():
    """A training-mode BatchNorm's running mean feeds the node whose Y makes the loss, but Y does
    not depend on it: naming it is refused like an unconnected name, saying why (it got a zero
    gradient silently); allow_unused gives the zero; the default set leaves it out."""
    model = parser.parse_model(TRAIN_BN)
    with pytest.raises(gradgraph.GradientError, match=r"'mean' does not reach loss 'loss': it is input 3 of "
                                                      r"BatchNormalization node"):
        gradgraph.build_gradient_graph(model, "loss", ["s", "mean"])
    grad = gradgraph.build_gradient_graph(model, "loss", ["s", "mean"], allow_unused=True)
    (zero,) = _run(grad, {"x": np.arange(8, dtype=np.float32).reshape(4, 2)}, ["mean_grad"])
    np.testing.assert_array_equal(zero, np.zeros(2, np.float32))
    default = gradgraph.build_gradient_graph(model, "loss")
    assert {o.name for o in default.graph.output} >= {"s_grad", "b_grad"}
    assert not {"mean_grad", "var_grad"} & {o.name for o in default.graph.output}


CLIPPED = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2, 3] x) => (float loss) <float[3, 2] W = {1., 2., 3., 4., 5., 6.}, float hi = {0.5},
                                   float lo = {-0.5}> {
  y = MatMul(x, W)
  c = Clip(y, lo, hi)
  loss = ReduceSum<keepdims=0>(c)
}
"""


def test_weight_behind_a_non_differentiable_input_is_named_with_that_input():
    """Clip's bounds reach the loss but ONNX gives them no gradient: the error names the input
    and the node (it said "no differentiable path connects them" and pointed at a path); with
    allow_unused the zero gradient comes with a warning naming them, not silently."""
    model = parser.parse_model(CLIPPED)
    model.graph.node[1].name = "clamp"
    with pytest.raises(gradgraph.GradientError, match=re.escape(
            "'hi' does not reach loss 'loss' through any differentiable path: its way there runs "
            "through input 2 (max) of Clip node 'clamp', which has no gradient")):
        gradgraph.build_gradient_graph(model, "loss", ["W", "hi"])
    with pytest.warns(UserWarning, match=re.escape(
            "the gradient of 'hi' is zero: it reaches loss 'loss' only through input 2 (max) of "
            "Clip node 'clamp'")):
        grad = gradgraph.build_gradient_graph(model, "loss", ["W", "hi"], allow_unused=True)
    (zero,) = _run(grad, {"x": np.ones((2, 3), np.float32)}, ["hi_grad"])
    np.testing.assert_array_equal(zero, np.zeros((), np.float32))


def test_unrelated_unused_weight_builds_without_a_warning():
    model = parser.parse_model(LINEAR)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradgraph.build_gradient_graph(model, "loss", ["W", "unused"], allow_unused=True)
    with pytest.raises(gradgraph.GradientError, match="no path of the graph connects them"):
        gradgraph.build_gradient_graph(model, "loss", ["W", "unused"])


def test_missing_rule_names_op_node_opset_and_path():
    model = parser.parse_model("""
<ir_version: 9, opset_import: ["" : 18, "custom.domain" : 1]>
g (float[2] x) => (float loss) <float[2] w = {1., 2.}> {
  a = Mul(x, w)
  b = custom.domain.Mystery(a)
  c = Exp(b)
  loss = ReduceSum<keepdims=0>(c)
}
""")
    with pytest.raises(gradgraph.GradientError) as info:
        gradgraph.build_gradient_graph(model, "loss", ["w"])
    err = info.value
    assert err.op_type == "Mystery" and err.domain == "custom.domain" and err.opset == 1
    assert err.path[0] == "b" and err.path[-1] == "loss"
    assert "custom.domain::Mystery" in str(err)


def test_non_float_loss_and_missing_names():
    model = parser.parse_model(LINEAR)
    with pytest.raises(gradgraph.GradientError, match="loss 'arg' has type INT64"):
        gradgraph.build_gradient_graph(model, "arg", ["W"])
    with pytest.raises(gradgraph.GradientError, match="loss 'nope' is not a tensor"):
        gradgraph.build_gradient_graph(model, "nope", ["W"])
    with pytest.raises(gradgraph.GradientError, match="'h' is neither an initializer nor a graph input"):
        gradgraph.build_gradient_graph(model, "loss", ["h"])


def test_malformed_and_missing_files(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00this is not protobuf\xff" * 10)
    with pytest.raises(gradgraph.GradientError, match="bad.onnx"):
        gradgraph.build_gradient_graph(bad, "loss")
    with pytest.raises(gradgraph.GradientError, match="does not exist"):
        gradgraph.build_gradient_graph(tmp_path / "missing.onnx", "loss")
    # a model whose external data file did not travel with it: the file is named
    (tmp_path / "moved").mkdir()
    model = parser.parse_model(LINEAR)
    for init in model.graph.initializer:  # raw data, which onnx moves to the external file
        init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init), init.name))
    onnx.save(model, tmp_path / "ext.onnx", save_as_external_data=True,
              all_tensors_to_one_file=True, location="ext.onnx.data", size_threshold=0)
    (tmp_path / "ext.onnx").rename(tmp_path / "moved" / "ext.onnx")
    with pytest.raises(gradgraph.GradientError, match=r"external data file\(s\) \['ext.onnx.data'\]"):
        gradgraph.build_gradient_graph(tmp_path / "moved" / "ext.onnx", "loss")


def test_reference_compatible_builder(tmp_path):
    model = parser.parse_model(LINEAR)
    builder = gradgraph.GradientGraphBuilder(model.SerializeToString(), {"loss"}, {"W", "b"}, "loss")
    with pytest.raises(gradgraph.GradientError, match="build"):
        builder.get_model()
    builder.build()
    out = onnx.load_from_string(builder.get_model())
    assert {"W_grad", "b_grad"} <= {o.name for o in out.graph.output}
    builder.save(tmp_path / "g.onnx")
    assert onnx.load(tmp_path / "g.onnx").graph.output[-1].name in {"W_grad", "b_grad"}


def test_cli_grad_check_and_stages(tmp_path, capsys):
    out = tmp_path / "grad.onnx"
    assert cli_main(["grad", str(EXAMPLE), "--loss", "loss", "-o", str(out),
                     "--save-stages", str(tmp_path / "stages")]) == 0
    onnx.checker.check_model(onnx.load(out), full_check=True)
    stages = sorted(p.name for p in (tmp_path / "stages").iterdir())
    assert stages == ["00_forward.onnx", "01_gradient.onnx"]
    assert cli_main(["check", str(EXAMPLE), "--loss", "loss", "--inputs", str(BATCH)]) == 0
    assert "6 passed, 0 failed" in capsys.readouterr().out


def test_cli_error_writes_nothing(tmp_path, capsys):
    out = tmp_path / "grad.onnx"
    assert cli_main(["grad", str(EXAMPLE), "--loss", "nope", "-o", str(out)]) == 2
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert "loss 'nope' is not a tensor" in capsys.readouterr().err


def test_cli_check_fails_on_a_wrong_rule(tmp_path, monkeypatch):
    """A deliberately wrong rule must make `gradgraph check` exit non-zero."""
    from passes.autodiff import registry

    rule = registry.lookup("", "Tanh", 18)
    wrong = registry.GradRule(rule.domain, rule.op_type, lambda b, n, g: [g[0]], rule.since,
                              rule.until, rule.diff_inputs, rule.broadcast)
    monkeypatch.setitem(registry._RULES, ("", "Tanh"), [wrong])
    assert cli_main(["check", str(EXAMPLE), "--loss", "loss", "--inputs", str(BATCH)]) == 1


def test_console_script_runs():
    result = subprocess.run([sys.executable, "-m", "gradgraph.cli.main", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "gradgraph" in result.stdout


def test_old_opset_model_is_converted():
    """Gemm at opset 10 (onnxruntime-training's #18344) is upgraded to 13, then differentiated."""
    model = parser.parse_model("""
<ir_version: 7, opset_import: ["" : 10]>
g (float[2, 3] x) => (float loss) <float[4, 3] W = {1.,2.,3.,4.,5.,6.,7.,8.,9.,1.,2.,3.}, float[4] b = {1.,2.,3.,4.}> {
  y = Gemm<transB=1>(x, W, b)
  t = Tanh(y)
  loss = ReduceSum<keepdims=0>(t)
}
""")
    with pytest.warns(UserWarning, match="opset 10"):
        grad = gradgraph.build_gradient_graph(model, "loss", ["W", "b"])
    x = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32) * 0.1
    dw, db = _run(grad, {"x": x}, ["W_grad", "b_grad"])
    tw = torch.tensor(onnx.numpy_helper.to_array(model.graph.initializer[0]), requires_grad=True)
    tb = torch.tensor(onnx.numpy_helper.to_array(model.graph.initializer[1]), requires_grad=True)
    torch.tanh(torch.tensor(x) @ tw.T + tb).sum().backward()
    np.testing.assert_allclose(dw, tw.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(db, tb.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_cli_reports_bad_feeds_without_traceback(tmp_path, capsys):
    missing = tmp_path / "missing.npz"
    np.savez(missing, x=np.zeros((3, 16), np.float32))
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, x=np.zeros((3, 5), np.float32), labels=np.zeros(3, np.int64))
    assert cli_main(["check", str(EXAMPLE), "--loss", "loss", "--inputs", str(missing)]) == 2
    assert "model input(s) ['labels'] missing" in capsys.readouterr().err
    assert cli_main(["check", str(EXAMPLE), "--loss", "loss", "--inputs", str(wrong)]) == 2
    assert "input 'x'" in capsys.readouterr().err
    code = cli_main(["train", str(EXAMPLE), "--loss", "loss", "--data", str(wrong), "--steps", "2",
                     "--batch-size", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "wrong.npz" in err and "dimension 1 must be 16" in err
    assert "Traceback" not in err


def test_gradient_name_already_taken_gets_a_free_one() -> None:
    """A model that already has a value named ``w_grad``: the gradient output is ``w_grad_1``,
    marked with the weight it belongs to; the graph stays valid."""
    model = onnx.parser.parse_model('''<ir_version: 9, opset_import: ["" : 18]>
g (float[2,3] x) => (float l, float[2,4] w_grad) <float[3,4] w = {1,2,3,4,5,6,7,8,9,10,11,12}> {
 w_grad = MatMul(x, w)
 z = Tanh(w_grad)
 l = ReduceSum <keepdims=0> (z)
}''')
    grad = gradgraph.build_gradient_graph(model, "l", ["w"])
    onnx.checker.check_model(grad, full_check=True)
    names = [o.name for o in grad.graph.output]
    assert names == ["l", "w_grad", "w_grad_1"]
    marks = {p.value for p in grad.graph.output[2].metadata_props if p.key == "gradgraph.gradient_of"}
    assert marks == {"w"}


def test_save_model_over_the_protobuf_limit_keeps_weights_beside(tmp_path, monkeypatch) -> None:
    """Models over 2 GiB cannot be one protobuf: weights go to <name>.data, written atomically
    (the limit is lowered here so that a small model takes that path)."""
    import numpy as np

    import gradgraph.io as gio

    monkeypatch.setattr(gio, "PROTOBUF_LIMIT", 1000)
    weight = np.arange(2048, dtype=np.float32).reshape(32, 64)
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 32])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])],
        [onnx.numpy_helper.from_array(weight, "w")]))
    gio.save_model(model, tmp_path / "big.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]
    loaded = onnx.load(str(tmp_path / "big.onnx"))
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(loaded.graph.initializer[0]), weight)


def test_omit_unused_leaves_names_off_the_loss_path_without_a_gradient_output():
    """PyTorch's None gradient (ORTModule): no output, no warning, for an unconnected name and
    for one behind an input without a gradient; the others' gradients as without the option."""
    import onnx_ir as ir

    from passes.autodiff import GradientOptions
    from passes.autodiff.gradient_pass import GradientPass

    model = parser.parse_model(CLIPPED)
    plain = gradgraph.build_gradient_graph(model, "loss", ["W"])
    ir_model = ir.from_proto(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradient = GradientPass("loss", ["W", "hi", "lo"], GradientOptions(omit_unused=True))
        gradient(ir_model)
    assert set(gradient.gradients) == {"W"}
    omitted = ir.to_proto(ir_model)
    assert not {"hi_grad", "lo_grad"} & {o.name for o in omitted.graph.output}
    x = {"x": np.arange(6, dtype=np.float32).reshape(2, 3) / 4}
    np.testing.assert_array_equal(_run(omitted, x, ["W_grad"])[0], _run(plain, x, ["W_grad"])[0])


def test_feeds_that_disagree_on_a_named_dimension_are_named() -> None:
    """Inputs sharing a dimension name (the batch) get one size: feeds that disagree are an
    InputError naming both inputs and the dimension, not onnxruntime's error from a node deep in
    the training graph (a Gather out of bounds, a broadcast that fails)."""

    from gradgraph.feeds import InputError, check_feeds

    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["sx"], keepdims=0), helper.make_node("ReduceSum", ["y"], ["sy"], keepdims=0),
         helper.make_node("Add", ["sx", "sy"], ["s"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 5]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", None])],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    inputs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).get_inputs()
    check_feeds(inputs, {"x": np.zeros((3, 5), np.float32), "y": np.zeros((3, 7), np.float32)})
    with pytest.raises(InputError, match=r"'x' and 'y' .* disagree on dimension 'batch': 3 .* vs 4"):
        check_feeds(inputs, {"x": np.zeros((3, 5), np.float32), "y": np.zeros((4, 7), np.float32)})
