"""passes.kernels.GeluFusionPass: an exported GELU formula becomes one Gelu node; the values and
the gradients stay torch's (float64 autograd oracle, rtol 1e-4 / atol 1e-5 for the float32
graphs)."""

from __future__ import annotations

import io
import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from test_valid_rows_loss import (
    WEIGHTS,
    _decoder_input_rank,
    _feeds,
    _head_model,
    _params,
    _torch_head,
)

from gradgraph import build_gradient_graph
from passes.kernels import GeluFusionPass, ValidRowsLossPass

K, A = math.sqrt(2.0 / math.pi), 0.044715


class _Mlp(torch.nn.Module):
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3)
        self.act = torch.nn.GELU(approximate=approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x))).square().mean()


def _legacy_export(module: torch.nn.Module, x: torch.Tensor) -> onnx.ModelProto:
    f = io.BytesIO()
    torch.onnx.export(module, (x,), f, dynamo=False, opset_version=17, input_names=["x"], output_names=["loss"],
                      do_constant_folding=False)
    return onnx.shape_inference.infer_shapes(onnx.load_from_string(f.getvalue()))


def _fused(model: onnx.ModelProto, **kw) -> tuple[onnx.ModelProto, bool]:
    m = ir.from_proto(model)
    modified = GeluFusionPass(**kw)(m).modified
    return ir.to_proto(m), modified


def _run(model: onnx.ModelProto, feeds: dict, outputs: list[str] | None = None) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(outputs, feeds)


def _ops(model: onnx.ModelProto) -> list[tuple[str, str]]:
    return [(n.domain, n.op_type) for n in model.graph.node if n.op_type != "Constant"]


@pytest.mark.parametrize("approximate,fused_op", [("none", "Gelu"), ("tanh", "FastGelu")])
def test_torch_export_below_opset_20(approximate, fused_op) -> None:
    """torch's legacy export at opset 17: onnxruntime's contrib op, torch's gradients."""
    torch.manual_seed(0)
    module = _Mlp(approximate)
    x = torch.randn(5, 6)
    model = _legacy_export(module, x)
    fused, modified = _fused(model)
    assert modified
    assert ("com.microsoft", fused_op) in _ops(fused)
    assert not any(op in ("Erf", "Tanh", "Pow") for _, op in _ops(fused))
    feeds = {"x": x.numpy()}
    np.testing.assert_allclose(_run(fused, feeds)[0], _run(model, feeds)[0], rtol=1e-6)
    weights = [i.name for i in model.graph.initializer if i.data_type == TensorProto.FLOAT and len(i.dims) > 0]
    grads = build_gradient_graph(fused, "loss", ["x", *weights])
    ours = _run(grads, feeds, ["x_grad", *[f"{w}_grad" for w in weights]])
    ref_module = _Mlp(approximate).double()
    ref_module.load_state_dict(module.state_dict())
    xd = x.double().requires_grad_(True)
    ref_module(xd).backward()
    ref = {"x": xd.grad, **{n: p.grad for n, p in ref_module.named_parameters()}}
    for name, got in zip(["x", *weights], ours, strict=True):
        np.testing.assert_allclose(got, ref[name].numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def _chain(variant: str, opset: int, dtype: int = TensorProto.FLOAT,
           extra_output: str | None = None, c: float = A) -> onnx.ModelProto:
    """y = ReduceSum(GELU(x) * w): the GELU written out as ``variant``."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)

    def const(name: str, value: float) -> onnx.TensorProto:
        return numpy_helper.from_array(np.array(value, np_dtype), name)

    inits = [const("half", 0.5), const("one", 1.0), const("k", K), const("a", c), const("three", 3.0),
             const("sqrt2", math.sqrt(2.0)), const("rsqrt2", 1.0 / math.sqrt(2.0)),
             numpy_helper.from_array(np.linspace(-1, 1, 12).astype(np_dtype).reshape(3, 4), "w")]
    mk = helper.make_node
    if variant == "erf_div":  # (x * (1 + erf(x / sqrt 2))) * 0.5, torch's legacy export
        nodes = [mk("Div", ["x", "sqrt2"], ["u"]), mk("Erf", ["u"], ["e"]), mk("Add", ["e", "one"], ["p"]),
                 mk("Mul", ["x", "p"], ["xp"]), mk("Mul", ["xp", "half"], ["g"])]
    elif variant == "erf_mul":  # (0.5 * x) * (1 + erf(x * (1 / sqrt 2)))
        nodes = [mk("Mul", ["rsqrt2", "x"], ["u"]), mk("Erf", ["u"], ["e"]), mk("Add", ["one", "e"], ["p"]),
                 mk("Mul", ["half", "x"], ["hx"]), mk("Mul", ["hx", "p"], ["g"])]
    elif variant == "tanh_pow":  # 0.5 * x * (1 + tanh(k * (x + a * x ** 3))), GPT-2's export
        nodes = [mk("Mul", ["x", "half"], ["hx"]), mk("Pow", ["x", "three"], ["x3"]),
                 mk("Mul", ["x3", "a"], ["ax3"]), mk("Add", ["x", "ax3"], ["s"]), mk("Mul", ["s", "k"], ["ks"]),
                 mk("Tanh", ["ks"], ["t"]), mk("Add", ["t", "one"], ["p"]), mk("Mul", ["hx", "p"], ["g"])]
    elif variant == "tanh_fast":  # HF gelu_fast: 0.5 * x * (1 + tanh(x * k * (1 + a * x * x)))
        nodes = [mk("Mul", ["x", "k"], ["xk"]), mk("Mul", ["a", "x"], ["ax"]), mk("Mul", ["ax", "x"], ["ax2"]),
                 mk("Add", ["one", "ax2"], ["q"]), mk("Mul", ["xk", "q"], ["ks"]), mk("Tanh", ["ks"], ["t"]),
                 mk("Add", ["one", "t"], ["p"]), mk("Mul", ["half", "x"], ["hx"]), mk("Mul", ["hx", "p"], ["g"])]
    elif variant == "tanh_fast_sq":  # the same with a * (x * x), the tanh argument's factors swapped
        nodes = [mk("Mul", ["x", "x"], ["x2"]), mk("Mul", ["x2", "a"], ["ax2"]), mk("Add", ["ax2", "one"], ["q"]),
                 mk("Mul", ["k", "x"], ["xk"]), mk("Mul", ["q", "xk"], ["ks"]), mk("Tanh", ["ks"], ["t"]),
                 mk("Add", ["t", "one"], ["p"]), mk("Mul", ["x", "p"], ["xp"]), mk("Mul", ["xp", "half"], ["g"])]
    else:  # tanh_cube: x * x * x, the factors multiplied as ((1 + t) * x) * 0.5
        nodes = [mk("Mul", ["x", "x"], ["x2"]), mk("Mul", ["x", "x2"], ["x3"]),
                 mk("Mul", ["a", "x3"], ["ax3"]), mk("Add", ["ax3", "x"], ["s"]), mk("Mul", ["k", "s"], ["ks"]),
                 mk("Tanh", ["ks"], ["t"]), mk("Add", ["one", "t"], ["p"]), mk("Mul", ["p", "x"], ["px"]),
                 mk("Mul", ["px", "half"], ["g"])]
    nodes += [mk("Mul", ["g", "w"], ["gw"]), mk("ReduceSum", ["gw"], ["loss"], keepdims=0)]
    outputs = [helper.make_tensor_value_info("loss", dtype, [])]
    if extra_output is not None:
        outputs.append(helper.make_tensor_value_info(extra_output, dtype, None))
    graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", dtype, [3, 4])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return onnx.shape_inference.infer_shapes(model)


def _torch_gelu_grad(x: np.ndarray, variant: str) -> np.ndarray:
    xd = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    w = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(3, 4)
    approximate = "tanh" if variant.startswith("tanh") else "none"
    (torch.nn.functional.gelu(xd, approximate=approximate) * w).sum().backward()
    return xd.grad.numpy()


@pytest.mark.parametrize("variant", ["erf_div", "erf_mul", "tanh_pow", "tanh_cube", "tanh_fast", "tanh_fast_sq"])
@pytest.mark.parametrize("opset", [17, 20])
def test_written_forms(variant, opset) -> None:
    """Each written form becomes the standard Gelu at opset 20, the contrib op below."""
    model = _chain(variant, opset)
    fused, modified = _fused(model)
    assert modified
    approximate = "tanh" if variant.startswith("tanh") else "none"
    expected = ("", "Gelu") if opset >= 20 else ("com.microsoft", "FastGelu" if approximate == "tanh" else "Gelu")
    assert _ops(fused) == [expected, ("", "Mul"), ("", "ReduceSum")]
    # the formula's constants went with it; what the original did not read either stays
    read = {i for n in model.graph.node for i in n.input}
    assert {i.name for i in fused.graph.initializer} == {"w"} | {i.name for i in model.graph.initializer
                                                               if i.name not in read}
    if opset >= 20:
        (gelu,) = [n for n in fused.graph.node if n.op_type == "Gelu"]
        assert helper.get_attribute_value(gelu.attribute[0]) == approximate.encode()
    x = np.random.default_rng(0).uniform(-3, 3, (3, 4)).astype(np.float32)
    np.testing.assert_allclose(_run(fused, {"x": x})[0], _run(model, {"x": x})[0], rtol=1e-5)
    (dx,) = _run(build_gradient_graph(fused, "loss", ["x"]), {"x": x}, ["x_grad"])
    np.testing.assert_allclose(dx, _torch_gelu_grad(x, variant), rtol=1e-4, atol=1e-5)


class _FastGelu(torch.nn.Module):
    """transformers' FastGELUActivation (``gelu_fast``), as its source writes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def test_hf_gelu_fast_export() -> None:
    torch.manual_seed(0)
    module = _Mlp("tanh")
    module.act = _FastGelu()
    x = torch.randn(5, 6)
    model = _legacy_export(module, x)
    fused, modified = _fused(model)
    assert modified and ("com.microsoft", "FastGelu") in _ops(fused)
    assert not any(op in ("Tanh", "Pow") for _, op in _ops(fused))
    np.testing.assert_allclose(_run(fused, {"x": x.numpy()})[0], _run(model, {"x": x.numpy()})[0], rtol=1e-6)
    (dx,) = _run(build_gradient_graph(fused, "loss", ["x"]), {"x": x.numpy()}, ["x_grad"])
    xd = x.double().requires_grad_(True)
    reference = _Mlp("tanh").double()
    reference.load_state_dict(module.state_dict())
    reference.act = _FastGelu()
    reference(xd).backward()
    np.testing.assert_allclose(dx, xd.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_left_alone() -> None:
    # an intermediate read outside the pattern (a graph output)
    assert not _fused(_chain("tanh_pow", 20, extra_output="t"))[1]
    assert not _fused(_chain("erf_div", 17, extra_output="e"))[1]
    # another constant than 0.044715: not the GELU
    assert not _fused(_chain("tanh_pow", 20, c=0.05))[1]
    for variant in ("tanh_fast", "tanh_fast_sq"):
        assert not _fused(_chain(variant, 20, c=0.05))[1]
        assert not _fused(_chain(variant, 17, extra_output="q"))[1]
    # float64 below opset 20: onnxruntime's contrib kernels are float32 only
    assert not _fused(_chain("erf_div", 17, dtype=TensorProto.DOUBLE))[1]
    assert _fused(_chain("erf_div", 20, dtype=TensorProto.DOUBLE))[1]
    # contrib=False: no com.microsoft op
    assert not _fused(_chain("tanh_cube", 17), contrib=False)[1]
    assert _fused(_chain("tanh_cube", 20), contrib=False)[1]

    # 0.5, 1 and 3 only when exact (every float type holds them); never a NaN constant
    for variant, name, value in (("tanh_pow", "three", 3.0003), ("erf_div", "half", 0.50001),
                                 ("erf_div", "one", 1.00001), ("erf_div", "half", float("nan")),
                                 ("erf_div", "sqrt2", float("nan"))):
        model = _chain(variant, 20)
        (init,) = [i for i in model.graph.initializer if i.name == name]
        init.CopyFrom(numpy_helper.from_array(np.array(value, np.float32), name))
        assert not _fused(model)[1], (variant, name, value)


def test_rows_a_loss_ignores_skip_the_fused_gelu_too() -> None:
    """After the fusion, ValidRowsLossPass still computes the masked-LM head (now holding
    com.microsoft Gelu) on the labelled rows only; loss and gradients stay torch's."""
    rng = np.random.default_rng(3)
    params = _params(rng)
    model = _head_model("sce", "mean", TensorProto.INT64, False, True, params)
    feeds = _feeds(rng, TensorProto.INT64, ignored=0.6)
    m = ir.from_proto(model)
    assert GeluFusionPass()(m).modified and ValidRowsLossPass()(m).modified
    rewritten = ir.to_proto(m)
    (gelu,) = [n for n in rewritten.graph.node if n.op_type == "Gelu"]
    assert gelu.domain == "com.microsoft"
    assert _decoder_input_rank(rewritten) == 2
    grads = build_gradient_graph(rewritten, "loss", ["h", *WEIGHTS])
    names = ["loss", "h", *WEIGHTS]
    session = ort.InferenceSession(grads.SerializeToString(), providers=["CPUExecutionProvider"])
    ours = dict(zip(names, session.run(["loss", "h_grad", *[f"{w}_grad" for w in WEIGHTS]], feeds), strict=True))
    ref_loss, ref = _torch_head(feeds, params, "mean", False)
    np.testing.assert_allclose(ours["loss"], ref_loss, rtol=1e-5)
    for name, expected in ref.items():
        np.testing.assert_allclose(ours[name], expected, rtol=1e-4, atol=1e-5, err_msg=name)


def _with_half(model: onnx.ModelProto, kind: str | None = None, as_input: bool = False) -> onnx.ModelProto:
    """``model`` with its 0.5 constant marked ``kind`` (weight classification) or also fed."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    if kind is not None:
        (half,) = [i for i in model.graph.initializer if i.name == "half"]
        info = helper.make_tensor_value_info("half", half.data_type, [])
        info.metadata_props.add(key="gradgraph.weight_kind", value=kind)
        model.graph.value_info.append(info)
    if as_input:
        model.graph.input.append(helper.make_tensor_value_info("half", TensorProto.FLOAT, []))
    return model


def test_trained_scalars_are_not_constants(tmp_path) -> None:
    """A scalar weight holding 0.5 stays a weight: named in ``keep``, marked a parameter or a
    buffer, or a graph input (fed at run time)."""
    model = _chain("erf_div", 17)
    assert _fused(model)[1]
    assert not _fused(model, keep=["half"])[1]
    assert not _fused(_with_half(model, kind="parameter"))[1]
    assert not _fused(_with_half(model, kind="buffer"))[1]
    assert _fused(_with_half(model, kind="constant"))[1]
    assert not _fused(_with_half(model, as_input=True))[1]
    # the training build keeps the weights it is told to train (the build failed with a KeyError
    # on the fused-away weight)
    import gradgraph
    from gradgraph.training.build import TrainingConfig
    from passes.optimizer import SGDConfig

    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    config = TrainingConfig(loss="loss", optimizer=SGDConfig(), weights_to_train=("half", "w"))
    session = gradgraph.TrainingSession(str(path), config, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(2).uniform(-2, 2, (3, 4)).astype(np.float32)
    session.train_step({"x": x}, lr=1.0)
    xd = torch.tensor(x, dtype=torch.float64)
    w = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(3, 4)
    expected = 0.5 - float((xd * (1 + torch.erf(xd / math.sqrt(2.0))) * w).sum())  # 0.5 - lr * dloss/dhalf
    np.testing.assert_allclose(session.get_state()["half"], expected, rtol=1e-5)


def test_constants_that_broadcast_or_branches_are_left_alone() -> None:
    # a [1, 1] 0.5 with a 1-D x: the original's result is [1, n], Gelu(x)'s would be [n]
    model = _chain("erf_div", 20)
    (half,) = [i for i in model.graph.initializer if i.name == "half"]
    half.CopyFrom(numpy_helper.from_array(np.full((1, 1, 1), 0.5, np.float32), "half"))
    assert not _fused(onnx.shape_inference.infer_shapes(model))[1]  # x is [3, 4]: rank 2 < 3
    half.CopyFrom(numpy_helper.from_array(np.full((1, 1), 0.5, np.float32), "half"))
    fused, modified = _fused(onnx.shape_inference.infer_shapes(model))
    assert modified  # a [1, 1] constant does not change a [3, 4] result
    x = np.random.default_rng(0).uniform(-3, 3, (3, 4)).astype(np.float32)
    np.testing.assert_allclose(_run(fused, {"x": x})[0], _run(model, {"x": x})[0], rtol=1e-5)
    # the product continues inside an If branch: left alone (it crashed)
    branch = helper.make_graph([helper.make_node("Mul", ["x", "p"], ["xp"]), helper.make_node("Mul", ["xp", "half"], ["b"])],
                               "then", [], [helper.make_tensor_value_info("b", TensorProto.FLOAT, [3, 4])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["c"])], "else", [],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [3, 4])])
    nodes = [helper.make_node("Div", ["x", "sqrt2"], ["u"]), helper.make_node("Erf", ["u"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["p"]),
             helper.make_node("If", ["flag"], ["g"], then_branch=branch, else_branch=other),
             helper.make_node("ReduceSum", ["g"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(np.array(v, np.float32), n)
             for n, v in (("half", 0.5), ("one", 1.0), ("sqrt2", math.sqrt(2.0)))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4]),
                                           helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    assert not _fused(onnx.shape_inference.infer_shapes(model))[1]


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_half_precision_at_opset_20(dtype) -> None:
    """Constants stored in float16 / bfloat16 are as near their exact values as those types allow."""
    fused, modified = _fused(_chain("tanh_pow", 20, dtype=dtype))
    assert modified and _ops(fused)[0] == ("", "Gelu")


def test_mixed_precision_keeps_contrib_gelus_in_the_low_type() -> None:
    from passes.precision.policy import Precision, precision_of

    for op in ("Gelu", "FastGelu", "BiasGelu"):
        assert precision_of(op, "com.microsoft") == precision_of("Gelu", "") == Precision.PASS_THROUGH


def test_torch_ort_factory_trains_a_scalar_of_the_formula() -> None:
    """TorchOrtFactory with the formula's 0.5 as a weight to train: its gradient is torch's (the
    fusion took it for a constant: no gradient came back)."""
    from gradgraph.torch import TorchOrtFactory

    model = _chain("erf_div", 17)
    cls = TorchOrtFactory(model, ["half"], input_names=["x"], output_names=["loss"]).create_class()
    x = torch.tensor(np.random.default_rng(3).uniform(-2, 2, (3, 4)), dtype=torch.float32)
    half = torch.tensor(0.5, requires_grad=True)
    cls.apply(x, half).backward()
    xd = x.double()
    w = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(3, 4)
    expected = float((xd * (1 + torch.erf(xd / math.sqrt(2.0))) * w).sum())
    assert half.grad is not None
    np.testing.assert_allclose(half.grad.item(), expected, rtol=1e-5)


@pytest.mark.parametrize("contrib", [True, False])
def test_standard_ops_only(tmp_path, contrib) -> None:
    """GraphTransformerOptions(contrib_ops=False), the CLI's --standard-ops: no com.microsoft op
    in the training, eval and inference graphs of an opset-17 model (the chain stays); the
    default fuses it."""
    import gradgraph
    from gradgraph.cli.main import main as cli_main
    from gradgraph.training.build import TrainingConfig
    from gradgraph.training.options import GraphTransformerOptions
    from passes.optimizer import SGDConfig

    path = tmp_path / "m.onnx"
    onnx.save(_chain("tanh_pow", 17), path)
    config = TrainingConfig(loss="loss", optimizer=SGDConfig(), weights_to_train=("w",),
                            graph_transformer=GraphTransformerOptions(contrib_ops=contrib))
    session = gradgraph.TrainingSession(str(path), config, providers=["CPUExecutionProvider"])
    graphs = [session.artifacts.train, session.artifacts.eval, session.inference_model()]
    for graph in graphs:
        assert any(n.domain == "com.microsoft" for n in graph.graph.node) == contrib
        assert any(n.op_type == "Tanh" for n in graph.graph.node) == (not contrib)
    stages = tmp_path / f"stages_{contrib}"
    args = ["build", str(path), "--loss", "loss", "--save-stages", str(stages)] + ([] if contrib else ["--standard-ops"])
    assert cli_main(args) == 0
    saved = [onnx.load(str(p), load_external_data=False) for p in sorted(stages.rglob("*.onnx"))]
    assert saved and any(any(n.domain == "com.microsoft" for n in m.graph.node) for m in saved) == contrib


def test_check_uses_a_float64_oracle_for_the_contrib_gelus(tmp_path, capsys) -> None:
    """`gradgraph check` on a fused model (a stage file of the build): the reference evaluator
    knows com.microsoft Gelu/FastGelu in float64 (it refused them: a float32 fallback)."""
    from gradgraph.cli.main import main as cli_main

    fused, _ = _fused(_chain("erf_div", 17))
    path = tmp_path / "fused.onnx"
    onnx.save(fused, path)
    assert cli_main(["check", str(path), "--loss", "loss", "--weights", "w", "x"]) == 0
    out = capsys.readouterr()
    assert "float64 central differences in the ONNX reference evaluator" in out.out + out.err


def test_legacy_export_leaves_no_dead_constant() -> None:
    fused, modified = _fused(_legacy_export(_Mlp("tanh"), torch.randn(5, 6)))
    assert modified
    read = {i for n in fused.graph.node for i in n.input} | {o.name for o in fused.graph.output}
    assert all(n.output[0] in read for n in fused.graph.node if n.op_type == "Constant")

