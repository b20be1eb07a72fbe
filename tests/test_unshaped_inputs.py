"""Graph inputs declared without a shape, feeds of a wider float type, and other input checks.

onnxruntime reports an input declared without a shape as ``[]``, as it does a scalar: the feed
check takes the shape from the model, so such an input accepts any rank (it refused a matrix
as "expects rank 0"). A rule that needs a rank names the values without one. ``gradcheck``
casts float64 inputs given for a float input, as training does.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgraph import GradientError, TrainingConfig, TrainingSession
from gradgraph.check import gradcheck
from gradgraph.feeds import InputError, unshaped_inputs


def _model(op: str, x_shape) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "W"], ["y"]),
         helper.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_unshaped_input_takes_any_rank() -> None:
    model = _model("Mul", None)
    assert unshaped_inputs(model) == {"x"}
    x = np.random.default_rng(1).standard_normal((2, 4, 3)).astype(np.float32)
    session = TrainingSession(model, TrainingConfig(loss="loss"))
    loss = session.train_step({"x": x}, lr=0.0)
    w = numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_allclose(loss, float(((x * w) ** 2).sum()), rtol=1e-5)
    report = gradcheck(model, "loss", inputs={"x": x})
    assert all(row.result == "ok" for row in report.rows), report


def test_scalar_input_still_refuses_a_matrix() -> None:
    model = _model("Mul", [])
    assert unshaped_inputs(model) == set()
    session = TrainingSession(model, TrainingConfig(loss="loss"))
    with pytest.raises(InputError, match=r"input 'x' .* expects rank 0"):
        session.train_step({"x": np.ones((4, 3), np.float32)}, lr=0.0)


def test_rule_needing_a_rank_names_the_shapeless_input() -> None:
    with pytest.raises(GradientError, match=r"model input\(s\) \['x'\] declare none"):
        TrainingSession(_model("MatMul", None), TrainingConfig(loss="loss"))


def test_gradcheck_casts_float64_inputs_for_a_float_model() -> None:
    x = np.random.default_rng(2).standard_normal((5, 4))  # float64 for a float input
    report = gradcheck(_model("MatMul", [5, 4]), "loss", inputs={"x": x})
    assert [row.result for row in report.rows] == ["ok"]


def test_legacy_group_norm_at_opset_13_keeps_its_shapes(tmp_path) -> None:
    """torch's legacy GroupNorm export reshapes back with ``Reshape(y, Shape(x))``; onnx's data
    propagation does not see through opset 13's Shape, so what followed had no shape and the
    InstanceNormalization rule after it failed. Gradients against torch autograd."""
    torch = pytest.importorskip("torch")
    import onnxruntime as ort

    from gradgraph import build_gradient_graph

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv1d(3, 8, 3, padding=1)
            self.gn = torch.nn.GroupNorm(2, 8)
            self.norm = torch.nn.InstanceNorm1d(8, affine=True)

        def forward(self, x):
            return self.norm(self.gn(self.conv(x))).pow(2).mean()

    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 3, 10)
    path = tmp_path / "gn13.onnx"
    torch.onnx.export(net, (x,), str(path), input_names=["x"], output_names=["loss"], dynamo=False,
                      opset_version=13)
    names = ["conv.weight", "conv.bias", "norm.weight"]  # the GroupNorm affine: onnx::Mul_N names
    grads = build_gradient_graph(str(path), "loss", names)
    session = ort.InferenceSession(grads.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run([f"{n}_grad" for n in names], {"x": x.numpy()})
    net(x).backward()
    params = dict(net.named_parameters())
    for name, value in zip(names, got, strict=True):
        np.testing.assert_allclose(value, params[name].grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_learning_rate_given_as_text_is_refused() -> None:
    session = TrainingSession(_model("Mul", [2, 4, 3]), TrainingConfig(loss="loss"))
    x = np.ones((2, 4, 3), np.float32)
    for bad in ("0.1", True, [0.1, 0.2]):
        with pytest.raises(InputError, match="learning rate must be a number"):
            session.train_step({"x": x}, lr=bad)  # type: ignore[arg-type]
    for negative in (-1, np.float32(-0.5)):
        with pytest.raises(InputError, match="learning rate must be >= 0"):
            session.train_step({"x": x}, lr=negative)
    assert session.step == 0
    session.train_step({"x": x}, lr=np.float32(0.1))


def test_a_training_session_of_the_wrong_arguments_says_what_it_takes() -> None:
    from gradgraph import GradientError

    with pytest.raises(InputError, match="second argument is a TrainingConfig"):
        TrainingSession(_model("Mul", [2, 4, 3]), "loss")  # type: ignore[arg-type]
    with pytest.raises(GradientError, match="the model must be an onnx.ModelProto.*not NoneType"):
        TrainingSession(None, TrainingConfig(loss="loss"))  # type: ignore[arg-type]


def test_an_empty_list_of_weights_is_refused() -> None:
    from gradgraph import build_gradient_graph

    with pytest.raises(GradientError, match="weights_to_train is empty"):
        build_gradient_graph(_model("Mul", [2, 4, 3]), "loss", [])


def test_a_huge_difference_step_is_named_when_everything_looks_like_a_kink() -> None:
    model = _model("MatMul", [5, 4])
    model.graph.node.insert(1, helper.make_node("Tanh", ["y"], ["t"]))  # smooth, not quadratic
    model.graph.node[2].input[0] = "t"
    (row,) = gradcheck(model, "loss", eps=10.0).rows
    assert row.result == "skipped" and "a step of 10 is wide enough" in row.detail
    (row,) = gradcheck(model, "loss").rows
    assert row.result == "ok" and "wide enough" not in row.detail


def test_option_values_of_the_wrong_kind_are_named() -> None:
    from gradgraph import CastPropagationConfig, CastStrategy, GraphTransformerOptions
    from passes.recompute import RecomputeOptions

    cases = [
        (lambda: RecomputeOptions(memory_budget="50%"), r"memory_budget must be a whole number of bytes"),  # type: ignore[arg-type]
        (lambda: RecomputeOptions(memory_budget=1.5), r"a fraction or percentage"),  # type: ignore[arg-type]
        (lambda: RecomputeOptions(number_recompute_layers=1.5), r"number_recompute_layers must be a whole"),  # type: ignore[arg-type]
        (lambda: RecomputeOptions(gelu="yes"), r"gelu must be True or False"),  # type: ignore[arg-type]
        (lambda: GraphTransformerOptions(recompute=True), r"recompute must be a RecomputeOptions"),  # type: ignore[arg-type]
        (lambda: CastPropagationConfig(level=2.5), r"level must be a whole number"),  # type: ignore[arg-type]
        (lambda: CastPropagationConfig(allow="MatMul"), r"not the single string 'MatMul'"),  # type: ignore[arg-type]
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()
    assert RecomputeOptions(dims={"batch": 4}).dims == (("batch", 4),)  # type: ignore[arg-type]
    assert CastPropagationConfig(3, level=1).strategy == CastStrategy.INSERT_AND_REDUCE | CastStrategy.FLOOD_FILL  # type: ignore[arg-type]


def test_a_budget_over_unsized_activations_is_warned_about() -> None:
    from gradgraph import GraphTransformerOptions
    from passes.recompute import RecomputeOptions

    model = _model("MatMul", ["batch", 4])
    model.graph.node.insert(1, helper.make_node("Tanh", ["y"], ["t"]))
    model.graph.node[2].input[0] = "t"
    options = GraphTransformerOptions(recompute=RecomputeOptions(memory_budget=0))
    with pytest.warns(UserWarning, match=r"symbolic size \(dims \['batch'\]\) count as 0 bytes"):
        TrainingSession(model, TrainingConfig(loss="loss", graph_transformer=options))
    sized = GraphTransformerOptions(recompute=RecomputeOptions(memory_budget=10**9, dims=(("batch", 2),)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TrainingSession(model, TrainingConfig(loss="loss", graph_transformer=sized))
    # Sized: no unsized-activation warning (a budget that already fits says it recomputed nothing).
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "symbolic size" in m], messages
    assert [m for m in messages if "recomputed nothing" in m], messages


def test_the_budget_warning_offers_dim_only_for_dims_an_input_names() -> None:
    """A dim shape inference made up (``unk__1``: a size computed at run time) cannot be given
    with --dim (the CLI refuses a name the model lacks): the warning says so instead."""
    import onnx_ir as ir

    from passes.recompute import RecomputeOptions
    from passes.recompute.recompute_pass import _warn_unsized

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", 4]))
    a = ir.node("Tanh", [x], name="a")
    a.outputs[0].shape = ir.Shape(["batch", 4])
    b = ir.node("NonZero", [a.outputs[0]], name="b")
    b.outputs[0].shape = ir.Shape([2, "unk__1"])
    c = ir.node("Identity", [b.outputs[0]])
    ir.node("Identity", [a.outputs[0]])  # a's output is read
    graph = ir.Graph([x], [c.outputs[0]], nodes=[a, b, c], name="g")
    with pytest.warns(UserWarning) as caught:
        _warn_unsized(graph, [a, b], RecomputeOptions(memory_budget=0))
    said = str(caught[0].message)
    assert "--dim batch=N" in said and "['unk__1'] are sizes computed at run time" in said
    assert "--dim unk__1" not in said
