"""passes.kernels.ValidRowsLossPass: the rows a cross-entropy ignores are not computed; the loss
and every gradient stay torch's (float64 autograd oracle)."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from gradgraph import build_gradient_graph
from passes.kernels import ValidRowsLossPass, WholeScoresLossPass

B, S, D, V = 3, 5, 4, 7
WEIGHTS = ["W1", "b1", "gamma", "beta", "W2", "b2"]


def _params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"W1": rng.standard_normal((D, D)).astype(np.float32) * 0.5,
            "b1": rng.standard_normal(D).astype(np.float32) * 0.1,
            "gamma": rng.uniform(0.5, 1.5, D).astype(np.float32),
            "beta": rng.standard_normal(D).astype(np.float32) * 0.1,
            "scale": rng.uniform(0.5, 1.5, (1, 1, D)).astype(np.float32),
            "W2": rng.standard_normal((D, V)).astype(np.float32) * 0.5,
            "b2": rng.standard_normal(V).astype(np.float32) * 0.1,
            "cw": np.linspace(0.5, 2.0, V, dtype=np.float32)}


def _head_model(form: str, reduction: str, label_dtype: int, weights: bool, dynamic: bool,
                params: dict[str, np.ndarray], extra_output: str | None = None) -> onnx.ModelProto:
    """A masked-LM head over h [B, S, D]: dense + bias, GELU (erf form), LayerNorm, a [1, 1, D]
    scale, a row mask (Where), decoder + bias, cross-entropy over Reshape(logits, [-1, V])."""
    lead = ["batch", "seq"] if dynamic else [B, S]
    inputs = [helper.make_tensor_value_info("h", TensorProto.FLOAT, [*lead, D]),
              helper.make_tensor_value_info("keep", TensorProto.BOOL, [*lead, 1]),
              helper.make_tensor_value_info("y", label_dtype, lead)]
    names = WEIGHTS + ["scale"] + (["cw"] if weights else [])
    inits = [numpy_helper.from_array(params[n], n) for n in names]
    inits += [numpy_helper.from_array(np.array([-1, V], np.int64), "flat2"),
              numpy_helper.from_array(np.array([-1], np.int64), "flat1"),
              numpy_helper.from_array(np.array(math.sqrt(2.0), np.float32), "sqrt2"),
              numpy_helper.from_array(np.array(1.0, np.float32), "one"),
              numpy_helper.from_array(np.array(0.5, np.float32), "half"),
              numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    nodes = [helper.make_node("MatMul", ["h", "W1"], ["d"]),
             helper.make_node("Add", ["b1", "d"], ["db"]),  # the bias first, as torch exports it
             helper.make_node("Div", ["db", "sqrt2"], ["g0"]),
             helper.make_node("Erf", ["g0"], ["g1"]),
             helper.make_node("Add", ["g1", "one"], ["g2"]),
             helper.make_node("Mul", ["db", "g2"], ["g3"]),
             helper.make_node("Mul", ["g3", "half"], ["gelu"]),
             helper.make_node("LayerNormalization", ["gelu", "gamma", "beta"], ["ln"], axis=-1, epsilon=1e-5),
             helper.make_node("Mul", ["ln", "scale"], ["scaled"]),
             helper.make_node("Where", ["keep", "scaled", "zero"], ["masked"]),
             helper.make_node("MatMul", ["masked", "W2"], ["dec"]),
             helper.make_node("Add", ["dec", "b2"], ["logits"]),
             helper.make_node("Reshape", ["logits", "flat2"], ["scores"]),
             helper.make_node("Reshape", ["y", "flat1"], ["labels"])]
    loss_inputs = ["scores", "labels"] + (["cw"] if weights else [])
    attrs = {"reduction": reduction, "ignore_index": -100}
    if form == "sce":
        nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", loss_inputs, ["loss"], name="ce", **attrs))
    else:
        nodes.append(helper.make_node("LogSoftmax", ["scores"], ["logp"], axis=1))
        nodes.append(helper.make_node("NegativeLogLikelihoodLoss", ["logp", *loss_inputs[1:]], ["loss"],
                                      name="ce", **attrs))
    outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    if extra_output is not None:
        outputs.append(helper.make_tensor_value_info(extra_output, TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "head", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _torch_head(feeds: dict, params: dict, reduction: str, weights: bool):
    """The oracle: the same head in torch, float64 autograd."""
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k in WEIGHTS) for k, v in params.items()}
    h = torch.tensor(feeds["h"], dtype=torch.float64, requires_grad=True)
    d = h @ t["W1"] + t["b1"]
    gelu = d * 0.5 * (1 + torch.erf(d / math.sqrt(2.0)))
    ln = torch.nn.functional.layer_norm(gelu, (D,), t["gamma"], t["beta"], eps=1e-5)
    masked = torch.where(torch.tensor(feeds["keep"]), ln * t["scale"], torch.zeros((), dtype=torch.float64))
    logits = masked @ t["W2"] + t["b2"]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, V), torch.tensor(feeds["y"].astype(np.int64)).reshape(-1), ignore_index=-100,
        reduction=reduction, weight=t["cw"].detach() if weights else None)
    loss.backward()
    return loss.item(), {"h": h.grad.numpy(), **{k: t[k].grad.numpy() for k in WEIGHTS}}


def _feeds(rng: np.random.Generator, label_dtype: int, ignored: float) -> dict[str, np.ndarray]:
    y = rng.integers(0, V, (B, S))
    y[rng.random((B, S)) < ignored] = -100
    return {"h": rng.standard_normal((B, S, D)).astype(np.float32),
            "keep": rng.random((B, S, 1)) < 0.8,
            "y": y.astype(np.int32 if label_dtype == TensorProto.INT32 else np.int64)}


def _rewritten(model: onnx.ModelProto) -> onnx.ModelProto:
    ir_model = ir.from_proto(model)
    assert ValidRowsLossPass()(ir_model).modified
    return ir.to_proto(ir_model)


def _run(model: onnx.ModelProto, feeds: dict, outputs: list[str] | None = None) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(outputs, {k: v for k, v in feeds.items() if k in names})


def _rank_of(model: onnx.ModelProto, name: str) -> int:
    inferred = onnx.shape_inference.infer_shapes(model)
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in
             [*inferred.graph.value_info, *inferred.graph.input] if v.type.tensor_type.HasField("shape")}
    return ranks[name]


def _decoder_input_rank(model: onnx.ModelProto) -> int:
    """The rank of what the decoder MatMul (the one reading W2) multiplies: 2 when it runs on the
    gathered rows, 3 on the whole [B, S, D] activation."""
    (node,) = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] == "W2"]
    return _rank_of(model, node.input[0])


@pytest.mark.parametrize("form", ["sce", "nll"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("label_dtype,weights,dynamic", [
    (TensorProto.INT64, False, False), (TensorProto.INT32, True, True), (TensorProto.INT64, True, True)])
def test_same_loss_and_gradients_as_torch(form, reduction, label_dtype, weights, dynamic) -> None:
    rng = np.random.default_rng(3)
    params = _params(rng)
    model = _head_model(form, reduction, label_dtype, weights, dynamic, params)
    feeds = _feeds(rng, label_dtype, ignored=0.6)
    rewritten = _rewritten(model)
    assert _decoder_input_rank(model) == 3 and _decoder_input_rank(rewritten) == 2  # rows only
    assert not any(n.op_type == "Erf" and n.input[0] == "g0" for n in rewritten.graph.node)
    np.testing.assert_allclose(_run(rewritten, feeds)[0], _run(model, feeds)[0], rtol=1e-6)
    grads = build_gradient_graph(rewritten, "loss", ["h", *WEIGHTS])
    ours = dict(zip(["loss", "h", *WEIGHTS],
                    _run(grads, feeds, ["loss", "h_grad", *[f"{w}_grad" for w in WEIGHTS]]), strict=True))
    ref_loss, ref = _torch_head(feeds, params, reduction, weights)
    # float32 graph against a float64 oracle
    np.testing.assert_allclose(ours["loss"], ref_loss, rtol=1e-5)
    for name, expected in ref.items():
        np.testing.assert_allclose(ours[name], expected, rtol=1e-4, atol=1e-5, err_msg=name)
    ignored = (feeds["y"] == -100).reshape(B, S)
    assert np.all(ours["h"][ignored] == 0.0)  # exact zeros where the label is ignored


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_label_ignored(reduction) -> None:
    rng = np.random.default_rng(4)
    params = _params(rng)
    model = _head_model("sce", reduction, TensorProto.INT64, False, True, params)
    feeds = _feeds(rng, TensorProto.INT64, ignored=1.1)
    grads = build_gradient_graph(_rewritten(model), "loss", ["h", "W2"])
    loss, dh, dw2 = _run(grads, feeds, ["loss", "h_grad", "W2_grad"])
    (original,) = _run(model, feeds, ["loss"])
    ref_loss, _ = _torch_head(feeds, params, reduction, False)
    if reduction == "mean":  # 0 / 0, as torch and the original graph give
        assert np.isnan(loss) and np.isnan(original) and math.isnan(ref_loss)
    else:
        assert loss == original == ref_loss == 0.0
        assert not dh.any() and not dw2.any()


def test_a_value_read_elsewhere_is_computed_whole() -> None:
    """The LayerNorm output is also a graph output: it stays whole and the rows are gathered
    after it; the output and the gradients are still torch's."""
    rng = np.random.default_rng(5)
    params = _params(rng)
    model = _head_model("sce", "mean", TensorProto.INT64, False, False, params, extra_output="ln")
    feeds = _feeds(rng, TensorProto.INT64, ignored=0.5)
    rewritten = _rewritten(model)
    assert any(n.op_type == "LayerNormalization" and n.output[0] == "ln" for n in rewritten.graph.node)
    assert _decoder_input_rank(rewritten) == 2
    for ours, ref in zip(_run(rewritten, feeds), _run(model, feeds), strict=True):
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7)
    grads = build_gradient_graph(rewritten, "loss", WEIGHTS)
    ours = _run(grads, feeds, [f"{w}_grad" for w in WEIGHTS])
    _, ref = _torch_head(feeds, params, "mean", False)
    for name, got in zip(WEIGHTS, ours, strict=True):
        np.testing.assert_allclose(got, ref[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_left_alone() -> None:
    rng = np.random.default_rng(6)
    params = _params(rng)
    # the logits are a graph output: nothing per row is left to skip but the softmax
    model = _head_model("sce", "mean", TensorProto.INT64, False, False, params, extra_output="logits")
    assert not ValidRowsLossPass()(ir.from_proto(model)).modified
    # per-position losses: every row is an output
    model = _head_model("nll", "none", TensorProto.INT64, False, False, params)
    assert not ValidRowsLossPass()(ir.from_proto(model)).modified
    # no ignore_index: every row counts
    model = _head_model("sce", "mean", TensorProto.INT64, False, False, params)
    (ce,) = [n for n in model.graph.node if n.op_type == "SoftmaxCrossEntropyLoss"]
    del ce.attribute[[a.name for a in ce.attribute].index("ignore_index")]
    assert not ValidRowsLossPass()(ir.from_proto(model)).modified


def test_rows_mixed_by_an_op_stop_the_rewrite_there() -> None:
    """A Transpose of the leading axes before the head: the rows are gathered after it."""
    rng = np.random.default_rng(7)
    params = _params(rng)
    model = _head_model("sce", "mean", TensorProto.INT64, False, False, params)
    # h -> Transpose(perm 1, 0, 2) of an input of shape [S, B, D]
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("hT", TensorProto.FLOAT, [S, B, D]))
    model.graph.node.insert(0, helper.make_node("Transpose", ["hT"], ["h"], perm=[1, 0, 2]))
    del model.graph.value_info[:]
    model = onnx.shape_inference.infer_shapes(model)
    rewritten = _rewritten(model)
    assert any(n.op_type == "Transpose" and n.output[0] == "h" for n in rewritten.graph.node)
    feeds = _feeds(rng, TensorProto.INT64, ignored=0.5)
    feeds["hT"] = np.ascontiguousarray(feeds.pop("h").transpose(1, 0, 2))
    grads = build_gradient_graph(rewritten, "loss", ["hT", "W1"])
    loss, dht, dw1 = _run(grads, feeds, ["loss", "hT_grad", "W1_grad"])
    ref_loss, ref = _torch_head({**feeds, "h": feeds["hT"].transpose(1, 0, 2)}, params, "mean", False)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(dht, ref["h"].transpose(1, 0, 2), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dw1, ref["W1"], rtol=1e-4, atol=1e-5)


def test_mlp_with_gemm_and_relu() -> None:
    """A classifier exported with Gemm (2-D rows): every layer runs on the labelled rows."""
    rng = np.random.default_rng(8)
    n, f, hidden, classes = 10, 6, 8, 4
    w1 = rng.standard_normal((hidden, f)).astype(np.float32) * 0.5  # transB=1, as torch's Linear
    c1 = rng.standard_normal(hidden).astype(np.float32) * 0.1
    w2 = rng.standard_normal((hidden, classes)).astype(np.float32) * 0.5
    c2 = rng.standard_normal((1, classes)).astype(np.float32) * 0.1
    nodes = [helper.make_node("Gemm", ["x", "w1", "c1"], ["a"], transB=1),
             helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "c2"], ["scores"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "y"], ["loss"], ignore_index=-1)]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", f]),
                       helper.make_tensor_value_info("y", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(a, k) for k, a in
                     {"w1": w1, "c1": c1, "w2": w2, "c2": c2}.items()])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    rewritten = _rewritten(model)
    assert [n.op_type for n in rewritten.graph.node].count("Gather") == 2  # the labels and x
    x = rng.standard_normal((n, f)).astype(np.float32)
    y = rng.integers(0, classes, n)
    y[[1, 4, 5]] = -1
    grads = build_gradient_graph(rewritten, "loss", ["x", "w1", "c1", "w2", "c2"])
    got = _run(grads, {"x": x, "y": y}, ["loss", "x_grad", "w1_grad", "c1_grad", "w2_grad", "c2_grad"])
    t = {k: torch.tensor(a, dtype=torch.float64, requires_grad=True)
         for k, a in {"x": x, "w1": w1, "c1": c1, "w2": w2, "c2": c2}.items()}
    logits = torch.relu(t["x"] @ t["w1"].T + t["c1"]) @ t["w2"] + t["c2"]
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(y), ignore_index=-1)
    loss.backward()
    np.testing.assert_allclose(got[0], loss.item(), rtol=1e-5)
    for value, key in zip(got[1:], ["x", "w1", "c1", "w2", "c2"], strict=True):
        np.testing.assert_allclose(value, t[key].grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.mark.parametrize("dynamic", [False, True])
def test_after_whole_scores_the_cut_rows_are_skipped_too(dynamic) -> None:
    """A causal LM's loss over logits[:, :-1] with padded labels: WholeScoresLossPass ignores
    the cut positions' labels (reading Shape(logits)), then this pass drops those rows and the
    padding's. Shape(logits) becomes a constant (static shapes) or the leading dims of the
    value the rows are gathered from (dynamic: the Reshape before the head, as GPT-2 has it,
    is then computed whole)."""
    rng = np.random.default_rng(9)
    w = rng.standard_normal((D, V)).astype(np.float32)
    lead = ["batch", "seq"] if dynamic else [B, S]
    nodes = [helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["ln"], axis=-1),
             helper.make_node("Shape", ["h"], ["h_shape"], end=-1),
             helper.make_node("Concat", ["h_shape", "width"], ["target"], axis=0),
             helper.make_node("Reshape", ["ln", "target"], ["r"]),
             helper.make_node("MatMul", ["r", "W"], ["logits"]),
             helper.make_node("Slice", ["logits", "starts", "ends", "axes"], ["sliced"]),
             helper.make_node("Reshape", ["sliced", "flat2"], ["scores"]),
             helper.make_node("Slice", ["y", "ystarts", "yends", "axes"], ["y_sliced"]),
             helper.make_node("Reshape", ["y_sliced", "flat1"], ["labels"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["loss"], ignore_index=-100)]
    inits = {"W": w, "gamma": np.linspace(0.5, 1.5, D), "beta": np.linspace(-0.1, 0.1, D),
             "starts": np.array([0]), "ends": np.array([-1]), "axes": np.array([1]),
             "ystarts": np.array([1]), "yends": np.array([2**62]), "flat2": np.array([-1, V]),
             "flat1": np.array([-1]), "width": np.array([D])}
    floats = ("W", "gamma", "beta")
    graph = helper.make_graph(
        nodes, "causal", [helper.make_tensor_value_info("h", TensorProto.FLOAT, [*lead, D]),
                          helper.make_tensor_value_info("y", TensorProto.INT64, lead)],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(np.asarray(a, np.float32 if k in floats else np.int64), k)
                     for k, a in inits.items()],
        # as the exporters record it: the reshaped value's leading dims under names of their own
        value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, [*(["rb", "rs"] if dynamic else lead), D])])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    ir_model = ir.from_proto(model)
    assert WholeScoresLossPass()(ir_model).modified
    assert ValidRowsLossPass()(ir_model).modified
    rewritten = ir.to_proto(ir_model)
    assert not any(n.op_type == "Shape" and n.input[0] == "logits" for n in rewritten.graph.node)
    assert _rank_of(rewritten, next(n for n in rewritten.graph.node if n.op_type == "MatMul").input[0]) == 2
    h = rng.standard_normal((B, S, D)).astype(np.float32)
    y = rng.integers(0, V, (B, S))
    y[0, 2:] = -100  # padding
    loss, dh, dw = _run(build_gradient_graph(rewritten, "loss", ["h", "W"]), {"h": h, "y": y},
                        ["loss", "h_grad", "W_grad"])
    th = torch.tensor(h, dtype=torch.float64, requires_grad=True)
    tw = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    ln = torch.nn.functional.layer_norm(th, (D,), torch.tensor(inits["gamma"]), torch.tensor(inits["beta"]))
    ref = torch.nn.functional.cross_entropy((ln @ tw)[:, :-1].reshape(-1, V), torch.tensor(y)[:, 1:].reshape(-1),
                                            ignore_index=-100)
    ref.backward()
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-5)
    np.testing.assert_allclose(dh, th.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dw, tw.grad.numpy(), rtol=1e-4, atol=1e-5)
    assert not dh[:, -1].any() and not dh[0, 1:].any()  # the last position and the padding are not read


def test_a_shape_read_in_a_subgraph_stops_the_rewrite_there() -> None:
    """An If branch reads Shape(logits): the logits stay whole (the branch is not rewritten)."""
    rng = np.random.default_rng(10)
    w = rng.standard_normal((D, V)).astype(np.float32)
    then = helper.make_graph([helper.make_node("Shape", ["logits"], ["s"])], "then", [],
                             [helper.make_tensor_value_info("s", TensorProto.INT64, [3])])
    nodes = [helper.make_node("MatMul", ["h", "W"], ["logits"]),
             helper.make_node("If", ["cond"], ["shape"], then_branch=then, else_branch=then),
             helper.make_node("Reshape", ["logits", "flat2"], ["scores"]),
             helper.make_node("Reshape", ["y", "flat1"], ["labels"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["loss"], ignore_index=-100)]
    graph = helper.make_graph(
        nodes, "sub", [helper.make_tensor_value_info("h", TensorProto.FLOAT, [B, S, D]),
                       helper.make_tensor_value_info("y", TensorProto.INT64, [B, S]),
                       helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [3])],
        initializer=[numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([-1, V]), "flat2"),
                     numpy_helper.from_array(np.array([-1]), "flat1")])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    ir_model = ir.from_proto(model)
    assert not ValidRowsLossPass()(ir_model).modified
    onnx.checker.check_model(ir.to_proto(ir_model))


def test_a_batch_without_labels_is_a_skipped_step(tmp_path) -> None:
    """Training: a batch whose labels are all ignored gives a NaN loss (mean, as torch) and the
    step changes nothing; the next batch trains as the same session without it would."""
    import gradgraph

    rng = np.random.default_rng(11)
    path = tmp_path / "head.onnx"
    onnx.save(_head_model("sce", "mean", TensorProto.INT64, False, True, _params(rng)), path)
    config = gradgraph.TrainingConfig(loss="loss", optimizer=gradgraph.AdamWConfig(), weights_to_train=tuple(WEIGHTS))
    session = gradgraph.TrainingSession(str(path), config, providers=["CPUExecutionProvider"])
    twin = gradgraph.TrainingSession(str(path), config, providers=["CPUExecutionProvider"])
    before = session.get_state()
    loss = session.train_step(_feeds(rng, TensorProto.INT64, ignored=1.1), lr=1e-2)
    assert np.isnan(loss) and not session.last_step_finite and session.skipped_steps == 1
    after = session.get_state()
    for name in WEIGHTS:
        np.testing.assert_array_equal(after[name], before[name])
    feeds = _feeds(rng, TensorProto.INT64, ignored=0.5)
    assert session.train_step(feeds, lr=1e-2) == twin.train_step(feeds, lr=1e-2)
    for name in WEIGHTS:
        np.testing.assert_array_equal(session.get_state()[name], twin.get_state()[name])


@pytest.mark.parametrize("form", ["sce", "nll"])
def test_every_label_ignored_gives_torchs_zero_gradient(form) -> None:
    """mean over no labels: the loss is NaN, the gradient zero (torch's), not NaN: a plain
    optimizer step after it changes nothing (ORTModule hands these gradients to torch)."""
    rng = np.random.default_rng(12)
    params = _params(rng)
    model = _head_model(form, "mean", TensorProto.INT64, True, False, params)
    feeds = _feeds(rng, TensorProto.INT64, ignored=1.1)
    grads = build_gradient_graph(model, "loss", ["h", *WEIGHTS])  # the rule alone, no rewrite
    loss, *got = _run(grads, feeds, ["loss", "h_grad", *[f"{w}_grad" for w in WEIGHTS]])
    t = torch.tensor(feeds["h"], dtype=torch.float64, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(t.reshape(-1, D) @ torch.ones(D, V, dtype=torch.float64),
                                            torch.full((B * S,), -100), ignore_index=-100)
    ref.backward()
    assert np.isnan(loss) and math.isnan(ref.item()) and not t.grad.any()
    for name, value in zip(["h", *WEIGHTS], got, strict=True):
        assert np.all(value == 0.0), name
