"""passes.kernels: each rewrite gives the same values as the original graph in onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from passes.kernels import SplitSoftmaxCrossEntropyPass


def _sce_model(reduction: str, ignore_index: int | None, weights: bool, log_prob: bool,
               rank: int = 2) -> onnx.ModelProto:
    shape = [6, 5] if rank == 2 else [6, 5, 3]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
              helper.make_tensor_value_info("y", TensorProto.INT64, [6] if rank == 2 else [6, 3])]
    if weights:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [5]))
    outputs = ["loss"] + (["log_prob"] if log_prob else [])
    attrs = {"reduction": reduction}
    if ignore_index is not None:
        attrs["ignore_index"] = ignore_index
    node = helper.make_node("SoftmaxCrossEntropyLoss", [i.name for i in inputs], outputs, name="sce",
                            **attrs)
    # A consumer of the loss inside the graph, so replacing uses is exercised too.
    double = helper.make_node("Add", ["loss", "loss"], ["twice"])
    graph = helper.make_graph([node, double], "g", inputs,
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                               for n in [*outputs, "twice"]])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [None, 2])
@pytest.mark.parametrize("weights,log_prob", [(False, False), (True, True)])
def test_split_softmax_cross_entropy_same_values(reduction, ignore_index, weights, log_prob) -> None:
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((6, 5)).astype(np.float32),
             "y": np.array([0, 2, 4, 2, 1, 3], np.int64),
             "w": rng.uniform(0.5, 2.0, 5).astype(np.float32)}
    model = _sce_model(reduction, ignore_index, weights, log_prob)
    ir_model = ir.from_proto(model)
    assert SplitSoftmaxCrossEntropyPass()(ir_model).modified
    rewritten = ir.to_proto(ir_model)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "SoftmaxCrossEntropyLoss" not in ops and ops.count("LogSoftmax") == 1
    assert [o.name for o in rewritten.graph.output] == [o.name for o in model.graph.output]
    for ours, ref in zip(_run(rewritten, feeds), _run(model, feeds), strict=True):
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("axis", [None, 1, -1, 0])
@pytest.mark.parametrize("before", [False, True])
def test_split_softmax_of_the_scores_from_log_prob(axis, before) -> None:
    """A row softmax of the scores read after the loss becomes Exp(log_prob); one before the
    loss (the LogSoftmax does not exist there yet) or over the other axis stays."""
    model = _sce_model("mean", None, False, False)
    softmax = helper.make_node("Softmax", ["x"], ["probs"], **({} if axis is None else {"axis": axis}))
    nodes = list(model.graph.node)
    nodes.insert(0 if before else len(nodes), softmax)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.output.append(helper.make_tensor_value_info("probs", TensorProto.FLOAT, None))
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((6, 5)).astype(np.float32) * 3, "y": np.array([0, 2, 4, 2, 1, 3], np.int64)}
    ir_model = ir.from_proto(model)
    assert SplitSoftmaxCrossEntropyPass()(ir_model).modified
    rewritten = ir.to_proto(ir_model)
    ops = [n.op_type for n in rewritten.graph.node]
    assert ("Exp" in ops) == (not before and axis != 0) and ("Softmax" in ops) == (before or axis == 0)
    for ours, ref in zip(_run(rewritten, feeds), _run(model, feeds), strict=True):
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7)


def test_higher_rank_scores_are_left_alone() -> None:
    model = ir.from_proto(_sce_model("mean", None, False, False, rank=3))
    assert not SplitSoftmaxCrossEntropyPass()(model).modified
    assert [n.op_type for n in model.graph][0] == "SoftmaxCrossEntropyLoss"


# ---- WholeScoresLossPass: a loss over sliced scores computed over all of them ---------------

_INT64_MAX = 2**63 - 1


def _sliced_loss_model(form: str, reduction: str, cut: str, label_dtype: int, weights: bool,
                       dynamic: bool) -> onnx.ModelProto:
    """logits = h @ W ([B, S, V]); loss over logits sliced on the leading axes, labels sliced
    the same way; ``cut``: "causal" (positions :-1 of axis 1), "tail" (1: of axis 1, end given
    as INT64_MAX), "both" (1: of axis 0 and 2:-1 of axis 1, negative axes)."""
    B, S, D, V = 3, 6, 4, 5
    slices = {"causal": ([0], [-1], [1]), "tail": ([1], [_INT64_MAX], [1]),
              "both": ([1, 2], [_INT64_MAX, -1], [-3, -2])}[cut]
    starts, ends, axes = slices
    lead = ["B", "S"] if dynamic else [B, S]
    kept = {"causal": B * (S - 1), "tail": B * (S - 1), "both": (B - 1) * (S - 3)}[cut]
    inputs = [helper.make_tensor_value_info("h", TensorProto.FLOAT, [*lead, D]),
              helper.make_tensor_value_info("y", label_dtype, lead)]
    inits = [onnx.numpy_helper.from_array(np.linspace(-1, 1, D * V, dtype=np.float32).reshape(D, V), "W"),
             onnx.numpy_helper.from_array(np.array(starts, np.int64), "starts"),
             onnx.numpy_helper.from_array(np.array(ends, np.int64), "ends"),
             onnx.numpy_helper.from_array(np.array([a + 1 if a < 0 else a for a in axes], np.int64), "yaxes"),
             onnx.numpy_helper.from_array(np.array(axes, np.int64), "axes"),
             # static: the dynamo exporter's explicit [n, V] with allowzero=1; dynamic: legacy's [-1, V]
             onnx.numpy_helper.from_array(np.array([-1 if dynamic else kept, V], np.int64), "flat2"),
             onnx.numpy_helper.from_array(np.array([-1], np.int64), "flat1")]
    if weights:
        inits.append(onnx.numpy_helper.from_array(np.linspace(0.5, 2.0, V, dtype=np.float32), "cw"))
    nodes = [helper.make_node("MatMul", ["h", "W"], ["logits"]),
             helper.make_node("Slice", ["logits", "starts", "ends", "axes"], ["sliced"]),
             helper.make_node("Reshape", ["sliced", "flat2"], ["scores"], allowzero=0 if dynamic else 1),
             # the labels' rank is one less: the same leading axes, counted from their end
             helper.make_node("Slice", ["y", "starts", "ends", "yaxes"], ["y_sliced"]),
             helper.make_node("Reshape", ["y_sliced", "flat1"], ["labels"])]
    loss_inputs = ["scores", "labels"] + (["cw"] if weights else [])
    attrs = {"reduction": reduction, "ignore_index": -100}
    if form == "sce":
        nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", loss_inputs, ["loss"], name="ce", **attrs))
    else:
        nodes.append(helper.make_node("LogSoftmax", ["scores"], ["logp"], axis=1))
        nodes.append(helper.make_node("NegativeLogLikelihoodLoss", ["logp", *loss_inputs[1:]], ["loss"],
                                      name="ce", **attrs))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)  # the pass reads the logits' rank


def _torch_sliced_loss(feeds: dict, W: np.ndarray, cw: np.ndarray | None, reduction: str, cut: str):
    """The oracle: torch float64 autograd of the same loss, slicing written in torch."""
    import torch

    h = torch.tensor(feeds["h"], dtype=torch.float64, requires_grad=True)
    w = torch.tensor(W, dtype=torch.float64, requires_grad=True)
    logits = h @ w
    y = torch.tensor(feeds["y"].astype(np.int64))
    index = {"causal": (slice(None), slice(0, -1)), "tail": (slice(None), slice(1, None)),
             "both": (slice(1, None), slice(2, -1))}[cut]
    loss = torch.nn.functional.cross_entropy(
        logits[index].reshape(-1, logits.shape[-1]), y[index].reshape(-1), ignore_index=-100,
        reduction=reduction, weight=None if cw is None else torch.tensor(cw, dtype=torch.float64))
    loss.backward()
    return loss.item(), h.grad.numpy(), w.grad.numpy()


@pytest.mark.parametrize("form", ["sce", "nll"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("cut,label_dtype,weights,dynamic", [
    ("causal", TensorProto.INT64, False, False), ("causal", TensorProto.INT32, True, True),
    ("tail", TensorProto.INT64, True, True), ("both", TensorProto.INT64, False, False),
    ("both", TensorProto.INT32, True, True)])
def test_whole_scores_loss_same_loss_and_gradient(form, reduction, cut, label_dtype, weights, dynamic) -> None:
    from gradgraph import build_gradient_graph

    rng = np.random.default_rng(1)
    model = _sliced_loss_model(form, reduction, cut, label_dtype, weights, dynamic)
    y = rng.integers(0, 5, (3, 6))
    y[0, 3] = -100  # an ignored label inside the slice stays ignored
    feeds = {"h": rng.standard_normal((3, 6, 4)).astype(np.float32),
             "y": y.astype(np.int32 if label_dtype == TensorProto.INT32 else np.int64)}
    ir_model = ir.from_proto(model)
    from passes.kernels import WholeScoresLossPass

    assert WholeScoresLossPass()(ir_model).modified
    rewritten = ir.to_proto(ir_model)
    assert not any(n.op_type == "Slice" and n.input[0] == "logits" for n in rewritten.graph.node)
    (ours,) = _run(rewritten, feeds)
    (original,) = _run(model, feeds)
    np.testing.assert_allclose(ours, original, rtol=1e-6)
    grads = build_gradient_graph(rewritten, "loss", ["h", "W"])
    assert not any(n.op_type == "Pad" and "logits" in n.output[0] for n in grads.graph.node)
    session = ort.InferenceSession(grads.SerializeToString(), providers=["CPUExecutionProvider"])
    loss, dh, dW = session.run(["loss", "h_grad", "W_grad"], feeds)
    W = onnx.numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "W"))
    cw = np.linspace(0.5, 2.0, 5, dtype=np.float32) if weights else None
    ref_loss, ref_dh, ref_dW = _torch_sliced_loss(feeds, W, cw, reduction, cut)
    # float32 graph against a float64 oracle
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(dh, ref_dh, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dW, ref_dW, rtol=1e-4, atol=1e-6)


def test_whole_scores_loss_leaves_others_alone() -> None:
    from passes.kernels import WholeScoresLossPass

    # reduction none: the per-position losses keep the sliced shape
    model = _sliced_loss_model("sce", "none", "causal", TensorProto.INT64, False, False)
    assert not WholeScoresLossPass()(ir.from_proto(model)).modified
    # the sliced logits are used elsewhere too (a graph output): the copy is needed anyway
    model = _sliced_loss_model("sce", "mean", "causal", TensorProto.INT64, False, False)
    model.graph.output.append(helper.make_tensor_value_info("sliced", TensorProto.FLOAT, None))
    assert not WholeScoresLossPass()(ir.from_proto(model)).modified
    # no ignore_index: no value to give the cut-away labels
    model = _sliced_loss_model("nll", "mean", "tail", TensorProto.INT64, False, False)
    loss = next(n for n in model.graph.node if n.name == "ce")
    del loss.attribute[[a.name for a in loss.attribute].index("ignore_index")]
    assert not WholeScoresLossPass()(ir.from_proto(model)).modified
    # a slice of the class axis
    model = _sliced_loss_model("sce", "mean", "causal", TensorProto.INT64, False, False)
    axes = next(i for i in model.graph.initializer if i.name == "axes")
    axes.CopyFrom(onnx.numpy_helper.from_array(np.array([2], np.int64), "axes"))
    assert not WholeScoresLossPass()(ir.from_proto(model)).modified


def test_training_build_takes_whole_scores() -> None:
    """The training build runs the pass: no Slice of the logits, no Pad of their gradient."""
    from gradgraph.training.build import build_training_artifacts
    from gradgraph.training.options import TrainingConfig

    model = _sliced_loss_model("sce", "mean", "causal", TensorProto.INT64, False, False)
    artifacts = build_training_artifacts(model, TrainingConfig(loss="loss"))
    ops = [n.op_type for n in artifacts.train.graph.node]
    assert "Pad" in ops  # the labels' (int64)
    assert not any(n.op_type == "Pad" and n.input[0] != "" and "grad" in n.input[0]
                   for n in artifacts.train.graph.node)
    assert not any(n.op_type == "Slice" and n.input[0] == "logits" for n in artifacts.train.graph.node)


# ---- ScatterAddIntoSumPass; the kernel passes together --------------------------------------------

def _single(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _rewritten(model: onnx.ModelProto, rewrite) -> onnx.ModelProto:
    ir_model = ir.from_proto(model)
    assert rewrite(ir_model).modified
    return ir.to_proto(ir_model)


@pytest.mark.parametrize("others", [1, 2])
def test_scatter_add_into_sum_same_values(others) -> None:
    from passes.kernels import ScatterAddIntoSumPass

    inputs = [helper.make_tensor_value_info("idx", TensorProto.INT64, [5, 1]),
              helper.make_tensor_value_info("upd", TensorProto.FLOAT, [5, 3])]
    inputs += [helper.make_tensor_value_info(f"a{i}", TensorProto.FLOAT, [4, 3]) for i in range(others)]
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["zeros"], value=zero),
             helper.make_node("ScatterND", ["zeros", "idx", "upd"], ["scattered"], reduction="add"),
             helper.make_node("Sum", [f"a{i}" for i in range(others)] + ["scattered"], ["total"])]
    model = _single(nodes, inputs, [helper.make_tensor_value_info("total", TensorProto.FLOAT, [4, 3])],
                    [onnx.numpy_helper.from_array(np.array([4, 3], np.int64), "shape")])
    rewritten = _rewritten(model, ScatterAddIntoSumPass())
    ops = [n.op_type for n in rewritten.graph.node]
    assert "ConstantOfShape" not in ops and ops.count("ScatterND") == 1
    rng = np.random.default_rng(2)
    feeds = {"idx": np.array([[0], [2], [0], [3], [2]], np.int64),  # repeated rows add up
             "upd": rng.standard_normal((5, 3)).astype(np.float32)}
    feeds.update({f"a{i}": rng.standard_normal((4, 3)).astype(np.float32) for i in range(others)})
    np.testing.assert_allclose(_run(rewritten, feeds)[0], _run(model, feeds)[0], rtol=1e-6, atol=1e-6)


def test_kernel_passes_keep_training_gradients() -> None:
    """A model with every pattern (tied embedding + output projection with a bias, cross-entropy):
    its gradients with the kernel passes equal torch's (float64 autograd)."""
    import torch

    from gradgraph import build_gradient_graph
    from passes.kernels import kernel_passes

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(11, 6)
            self.bias = torch.nn.Parameter(torch.linspace(-1, 1, 11))

        def forward(self, ids, labels):
            h = torch.tanh(self.emb(ids))
            logits = h @ self.emb.weight.T + self.bias
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1))

    torch.manual_seed(0)
    module = Tied()
    ids, labels = torch.randint(0, 11, (3, 5)), torch.randint(0, 11, (3, 5))
    import io

    f = io.BytesIO()
    torch.onnx.export(module, (ids, labels), f, dynamo=False, input_names=["ids", "labels"],
                      output_names=["loss"], opset_version=17, do_constant_folding=False)
    grads = ir.from_proto(build_gradient_graph(f.getvalue(), "loss"))
    for rewrite in kernel_passes():
        rewrite(grads)
    ops = [n.op_type for n in grads.graph]
    assert "SoftmaxCrossEntropyLoss" not in ops
    # the gradient's softmax of the scores: Exp of the forward's log-probabilities
    assert "Softmax" not in ops
    (log_softmax,) = [n for n in grads.graph if n.op_type == "LogSoftmax"]
    assert any(n.op_type == "Exp" and n.inputs[0] is log_softmax.outputs[0] for n in grads.graph)
    scatter = next(n for n in grads.graph if n.op_type == "ScatterND")
    assert scatter.inputs[0].producer().op_type != "ConstantOfShape"  # the tied weight's two uses
    assert not any(n.op_type == "ReduceSum" and n.inputs[0].shape is not None and len(n.inputs[0].shape) == 3
                   for n in grads.graph)  # the bias's gradient: a MatMul (OpBuilder.sum_leading)
    proto = ir.to_proto(grads)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in proto.graph.output]
    outs = dict(zip(names, session.run(None, {"ids": ids.numpy(), "labels": labels.numpy()}), strict=True))
    reference = Tied().double()
    reference.load_state_dict(module.state_dict())
    loss = reference(ids, labels)
    loss.backward()
    np.testing.assert_allclose(outs["loss"], loss.item(), rtol=1e-5)
    for name, p in reference.named_parameters():
        np.testing.assert_allclose(outs[f"{name}_grad"], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dynamic", [False, True])
def test_sum_leading_bias_gradient(dtype, dynamic) -> None:
    """OpBuilder.sum_leading (a broadcast operand's gradient as ones @ g): the bias gradient of
    y = x @ W + b, loss = sum(y * y), is sum over the batch axes of 2 y (numpy, float64)."""
    from gradgraph import build_gradient_graph

    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    rng = np.random.default_rng(3)
    W, bias = rng.standard_normal((4, 3)).astype(dtype), rng.standard_normal(3).astype(dtype)
    model = _single([helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"]),
                     helper.make_node("Mul", ["y", "y"], ["sq"]), helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)],
                    [helper.make_tensor_value_info("x", elem, ["n", "s", 4] if dynamic else [2, 5, 4])],
                    [helper.make_tensor_value_info("loss", elem, [])],
                    [onnx.numpy_helper.from_array(W, "W"), onnx.numpy_helper.from_array(bias, "b")])
    grads = build_gradient_graph(model, "loss", ["b", "W"])
    # the Add's gradient to b sums over (n, s) by a MatMul, not a ReduceSum
    assert not any(n.op_type == "ReduceSum" and n.name.startswith("Add_grad") for n in grads.graph.node)
    x = rng.standard_normal((2, 5, 4)).astype(dtype)
    session = ort.InferenceSession(grads.SerializeToString(), providers=["CPUExecutionProvider"])
    (db,) = session.run(["b_grad"], {"x": x})
    y = x.astype(np.float64) @ W + bias
    np.testing.assert_allclose(db, (2 * y).sum(axis=(0, 1)), rtol=1e-5 if dtype == np.float32 else 1e-12)


def test_rewrites_leave_edge_cases_alone() -> None:
    """A log_prob that is a graph output keeps the sliced rows; a Sum reading the same scatter
    twice is not a scatter into the other input; LayerNormalization with a float16 stash_type
    keeps its single output (onnxruntime refuses its statistics as outputs then)."""
    from passes.forward.expose_norm_stats import ExposeNormStatsPass
    from passes.kernels import ScatterAddIntoSumPass, WholeScoresLossPass

    model = _sliced_loss_model("sce", "mean", "causal", TensorProto.INT64, False, False)
    loss = next(n for n in model.graph.node if n.name == "ce")
    loss.output.append("log_prob")
    model.graph.output.append(helper.make_tensor_value_info("log_prob", TensorProto.FLOAT, None))
    assert not WholeScoresLossPass()(ir.from_proto(model)).modified

    zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
    twice = _single([helper.make_node("ConstantOfShape", ["shape"], ["zeros"], value=zero),
                     helper.make_node("ScatterND", ["zeros", "idx", "upd"], ["s"], reduction="add"),
                     helper.make_node("Sum", ["s", "s"], ["total"])],
                    [helper.make_tensor_value_info("idx", TensorProto.INT64, [5, 1]),
                     helper.make_tensor_value_info("upd", TensorProto.FLOAT, [5, 3])],
                    [helper.make_tensor_value_info("total", TensorProto.FLOAT, [4, 3])],
                    [onnx.numpy_helper.from_array(np.array([4, 3], np.int64), "shape")])
    assert not ScatterAddIntoSumPass()(ir.from_proto(twice)).modified

    for stash, exposed in ((None, True), (1, True), (10, False)):
        attrs = {} if stash is None else {"stash_type": stash}
        norm = _single([helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], **attrs)],
                       [helper.make_tensor_value_info(n, TensorProto.FLOAT16, s)
                        for n, s in (("x", [2, 4]), ("g", [4]), ("b", [4]))],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)])
        ir_model = ir.from_proto(norm)
        assert ExposeNormStatsPass()(ir_model).modified is exposed
        if exposed:  # the float32 statistics run in onnxruntime
            proto = ir.to_proto(ir_model)
            x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float16)
            feeds = {"x": x, "g": np.ones(4, np.float16), "b": np.zeros(4, np.float16)}
            np.testing.assert_allclose(_run(proto, feeds)[0], _run(norm, feeds)[0], rtol=1e-3, atol=1e-3)


# ---- DecomposeTrainingBatchNormPass ----------------------------------------------------------------

def _bn_training_model(shape: tuple[int, ...], momentum: float, stats_out: bool) -> onnx.ModelProto:
    channels = shape[1]
    rng = np.random.default_rng(5)
    inits = [onnx.numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "scale"),
             onnx.numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "bias"),
             onnx.numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "mean"),
             onnx.numpy_helper.from_array(rng.uniform(0.5, 2, channels).astype(np.float32), "var")]
    outs = ["y", "mean_out", "var_out"]  # training mode has all three; unread without stats_out
    nodes = [helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], outs,
                              epsilon=1e-3, momentum=momentum, training_mode=1),
             helper.make_node("Mul", ["y", "y"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    graph_outs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                  helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))]
    if stats_out:
        graph_outs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [channels]) for n in outs[1:]]
    return _single(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))], graph_outs,
                   inits, opset=15)


@pytest.mark.parametrize("shape,momentum,stats_out", [((4, 3, 5, 6), 0.9, True), ((6, 2, 7), 0.3, True),
                                                      ((5, 4), 0.9, False), ((2, 3, 2, 3, 4), 0.1, True)])
def test_decomposed_training_batch_norm_same_values_and_gradients(shape, momentum, stats_out) -> None:
    """onnxruntime's BatchNormalization kernel (training mode) is the oracle for the values, the
    gradient graph of the kernel's op for the gradients (rtol 1e-5)."""
    from pass_harness import assert_pass_preserves

    from passes.kernels import DecomposeTrainingBatchNormPass

    model = _bn_training_model(shape, momentum, stats_out)
    feeds = {"x": np.random.default_rng(8).standard_normal(shape).astype(np.float32) * 2 + 0.5}
    check = assert_pass_preserves(model, DecomposeTrainingBatchNormPass, feeds=feeds, rtol=1e-5, atol=1e-5,
                                  weights=["scale", "bias"])
    assert "BatchNormalization" not in {n.op_type for n in check.transformed.graph.node}


def test_inference_batch_norm_is_left_alone() -> None:
    from passes.kernels import DecomposeTrainingBatchNormPass

    model = _bn_training_model((4, 3, 5), 0.9, False)
    for attr in model.graph.node[0].attribute:
        if attr.name == "training_mode":
            attr.i = 0
    assert not DecomposeTrainingBatchNormPass()(ir.from_proto(model)).modified


@pytest.mark.parametrize("x_type", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_decomposed_training_batch_norm_with_half_inputs_and_float_statistics(x_type) -> None:
    """Autocast's BatchNorm: a float16 / bfloat16 input with float32 scale, bias and running
    statistics (the operator allows it). Normalized in float32; oracle: the ONNX definition in
    float64 numpy on the same (rounded) input, tolerance of the output's precision."""
    from onnx.reference import ReferenceEvaluator

    from passes.kernels import DecomposeTrainingBatchNormPass

    shape, momentum, eps = (4, 3, 5), 0.8, 1e-3
    model = _bn_training_model(shape, momentum, True)
    graph = model.graph
    graph.input[0].type.tensor_type.elem_type = x_type
    graph.output[1].type.tensor_type.elem_type = x_type  # y
    sq, loss = graph.node[1], graph.node[2]
    graph.node.remove(sq)
    graph.node.remove(loss)
    graph.output.remove(graph.output[0])  # no loss: the values only
    del graph.value_info[:]
    rewritten = _rewritten(model, DecomposeTrainingBatchNormPass())
    onnx.checker.check_model(rewritten, full_check=True)
    x32 = np.random.default_rng(3).standard_normal(shape).astype(np.float32) * 3 + 1
    np_type = {TensorProto.FLOAT16: np.float16}.get(x_type)
    if np_type is None:  # bfloat16: fed through onnx's reference evaluator (ml_dtypes)
        import ml_dtypes

        np_type = ml_dtypes.bfloat16
    x = x32.astype(np_type)
    y, mean_out, var_out = ReferenceEvaluator(rewritten).run(None, {"x": x})
    init = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64) for t in graph.initializer}
    xd = x.astype(np.float64)
    mean, var = xd.mean(axis=(0, 2)), xd.var(axis=(0, 2))
    c = (1, -1, 1)
    want = (xd - mean.reshape(c)) / np.sqrt(var.reshape(c) + eps) * init["scale"].reshape(c) + init["bias"].reshape(c)
    assert y.dtype == np_type
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(mean_out, init["mean"] * momentum + mean * (1 - momentum), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var_out, init["var"] * momentum + var * (1 - momentum), rtol=1e-5, atol=1e-6)


def test_split_unnamed_losses_get_distinct_names() -> None:
    """Two unnamed SoftmaxCrossEntropyLoss nodes: their LogSoftmax values are named apart."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("SoftmaxCrossEntropyLoss", ["x", "y"], ["l1"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["x2", "y"], ["l2"]),
             helper.make_node("Add", ["l1", "l2"], ["loss"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 5]),
                                           helper.make_tensor_value_info("x2", TensorProto.FLOAT, [6, 5]),
                                           helper.make_tensor_value_info("y", TensorProto.INT64, [6])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    ir_model = ir.from_proto(onnx.shape_inference.infer_shapes(model))
    assert SplitSoftmaxCrossEntropyPass()(ir_model).modified
    rewritten = ir.to_proto(ir_model)
    onnx.checker.check_model(rewritten)
    feeds = {"x": rng.standard_normal((6, 5)).astype(np.float32), "x2": rng.standard_normal((6, 5)).astype(np.float32),
             "y": np.array([0, 2, 4, 2, 1, 3], np.int64)}
    np.testing.assert_allclose(_run(rewritten, feeds)[0], _run(model, feeds)[0], rtol=1e-6)
