"""Fixed-batch exports made batch-dynamic: DynamicBatchPass (passes/batching) and the verified
``make_batch_dynamic`` (gradgraph/batching).

Pass fixtures are ONNX text at batch 4 whose constants hold 4 both as the batch and as something
else (a feature size, a temperature, a column count); each is checked for what was rewritten and
against numpy at batch 9. The torch models are exported at batch 4 three ways and must give
torch's loss at batch 2, 4 and 9; two models that depend on the batch must be refused with
``BATCH_ERROR``.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import parser

from gradgraph.batching import BATCH_ERROR, make_batch_dynamic
from passes.autodiff import GradientError
from passes.batching import DynamicBatchPass, select_batch_inputs

HEAD = '<ir_version: 9, opset_import: ["" : 18]>\n'
ERROR_HEAD = BATCH_ERROR.split("{inputs}")[0]


def _pass(text: str) -> tuple[onnx.ModelProto, ir.Model]:
    model = ir.from_proto(parser.parse_model(HEAD + text))
    assert DynamicBatchPass()(model).modified
    assert not DynamicBatchPass()(model).modified, "a second run changes nothing"
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    return proto, model


def _run(proto: onnx.ModelProto, **feeds: np.ndarray) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _target(model: ir.Model, output: str) -> list[int] | str:
    """The shape argument of the node producing ``output``: its values, or the op computing it."""
    node = next(n for n in model.graph if n.outputs[0].name == output)
    shape = node.inputs[1]
    tensor = ir.convenience.get_const_tensor(shape) if shape is not None else None
    if tensor is not None:
        return tensor.numpy().tolist()
    producer = shape.producer() if shape is not None else None
    return producer.op_type if producer is not None else "input"


def _x(*shape: int) -> np.ndarray:
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


# -- the pass, on ONNX text ---------------------------------------------------------------------

def test_reshape_targets_rewritten_at_the_batch_position_only():
    proto, model = _pass("""
    g (float[4, 8] x) => (float[4, 2, 4] r2) {
      t0 = Constant<value = int64[3] {4, 4, 2}>()
      r0 = Reshape(x, t0)
      t1 = Constant<value = int64[3] {4, 2, 4}>()
      r1 = Reshape<allowzero = 1>(r0, t1)
      t2 = Constant<value = int64[3] {4, -1, 4}>()
      r2 = Reshape<allowzero = 1>(r1, t2)
    }""")
    assert _target(model, "r0") == [0, 4, 2]  # allowzero=0: copy the batch; the feature 4 stays
    assert _target(model, "r1") == [-1, 2, 4]  # allowzero=1: -1; the trailing 4 stays
    assert _target(model, "r2") == "Concat"  # -1 taken: Concat(N, [-1, 4])
    assert [str(d) for d in model.graph.outputs[0].shape] == ["batch", "2", "4"]
    x = _x(9, 8)
    np.testing.assert_array_equal(_run(proto, x=x)[0], x.reshape(9, 2, 4))


def test_merged_batch_flattened_and_split_back():
    proto, model = _pass("""
    g (float[4, 6, 2] x) => (float[4, 6, 2] y) {
      flat = Constant<value = int64[2] {24, 2}>()
      f = Reshape(x, flat)
      e = Exp(f)
      back = Constant<value = int64[3] {4, 6, 2}>()
      y = Reshape(e, back)
    }""")
    assert _target(model, "f") == [-1, 2]
    assert _target(model, "y") == [-1, 6, 2]
    f = next(n for n in model.graph if n.op_type == "Exp").outputs[0]
    assert [str(d) for d in f.shape] == ["batch*6", "2"]
    x = _x(9, 6, 2)
    np.testing.assert_allclose(_run(proto, x=x)[0], np.exp(x), rtol=1e-6)


def test_mean_divisor_follows_the_batch_but_a_temperature_of_four_stays():
    proto, model = _pass("""
    g (float[4, 3] x) => (float loss, float per_element, float[4, 3] scaled) {
      four = Constant<value = float {4.0}>()
      twelve = Constant<value = float {12.0}>()
      s = ReduceSum<keepdims = 0>(x)
      loss = Div(s, four)
      per_element = Div(s, twelve)
      scaled = Div(x, four)
    }""")
    scaled = next(n for n in model.graph if n.outputs[0].name == "scaled")
    assert ir.convenience.get_const_tensor(scaled.inputs[1]).numpy() == 4.0
    x = _x(9, 3)
    loss, per_element, out = _run(proto, x=x)
    np.testing.assert_allclose(loss, x.sum() / 9, rtol=1e-5)
    np.testing.assert_allclose(per_element, x.mean(), rtol=1e-5)
    np.testing.assert_allclose(out, x / 4, rtol=1e-6)


def test_generators_joining_the_batch_get_its_size():
    proto, _ = _pass("""
    g (float[4, 2] x, float[4] v) => (float[4, 3] y, float[4] w) {
      shape = Constant<value = int64[2] {4, 1}>()
      ones = ConstantOfShape<value = float[1] {1.0}>(shape)
      y = Concat<axis = 1>(x, ones)
      start = Constant<value = int64 {0}>()
      limit = Constant<value = int64 {4}>()
      step = Constant<value = int64 {1}>()
      index = Range(start, limit, step)
      rows = Cast<to = 1>(index)
      w = Add(v, rows)
    }""")
    x, v = _x(9, 2), _x(9)
    y, w = _run(proto, x=x, v=v)
    np.testing.assert_array_equal(y, np.concatenate([x, np.ones((9, 1), np.float32)], 1))
    np.testing.assert_allclose(w, v + np.arange(9), rtol=1e-6)


def test_slice_to_the_batch_end_widens_and_column_slice_stays():
    proto, _ = _pass("""
    g (float[4, 6] x) => (float[4, 4] y) {
      zero = Constant<value = int64[1] {0}>()
      four = Constant<value = int64[1] {4}>()
      one = Constant<value = int64[1] {1}>()
      rows = Slice(x, zero, four, zero)
      y = Slice(rows, zero, four, one)
    }""")
    x = _x(9, 6)
    np.testing.assert_array_equal(_run(proto, x=x)[0], x[:, :4])


def test_constant_with_equal_rows_broadcasts():
    proto, model = _pass("""
    g (float[4, 3] x) => (float[4, 3] y) <float[4, 3] c = {1., 2., 3., 1., 2., 3., 1., 2., 3., 1., 2., 3.}> {
      y = Add(x, c)
    }""")
    assert list(model.graph.initializers["c"].shape) == [1, 3]
    x = _x(9, 3)
    np.testing.assert_allclose(_run(proto, x=x)[0], x + np.array([1, 2, 3], np.float32), rtol=1e-6)


def test_batch_indices_from_a_folded_arange():
    # The attention-mask gather of legacy transformers exports: mask.flatten()[b * 8 + j], with
    # b a folded arange over the batch (a constant [4, 1, 1, 1] = 0..3): b becomes arange(N).
    proto, _ = _pass("""
    g (float[4, 8] mask) => (float[4, 1, 1, 8] m) {
      rows = Constant<value = int64[4, 1, 1, 1] {0, 1, 2, 3}>()
      eight = Constant<value = int64 {8}>()
      cols = Constant<value = int64[1, 1, 1, 8] {0, 1, 2, 3, 4, 5, 6, 7}>()
      scaled = Mul(rows, eight)
      index = Add(scaled, cols)
      all = Constant<value = int64[1] {-1}>()
      flat = Reshape(mask, all)
      m = Gather<axis = 0>(flat, index)
    }""")
    mask = _x(9, 8)
    np.testing.assert_array_equal(_run(proto, mask=mask)[0], mask[:, None, None, :])


RNN = """
g (float[4, 5, 3] x) => (float[1, 4, 2] yh)
  <float[1, 2, 3] w = {0.1, 0.2, 0.3, 0.4, 0.5, 0.6}, float[1, 2, 2] r = {0.1, -0.2, 0.3, 0.1}> {
  xt = Transpose<perm = [1, 0, 2]>(x)
  h0 = Constant<value = float[1, 4, 2] {0., 0., 0., 0., 0., 0., 0., 0.}>()
  y, yh = RNN<hidden_size = 2>(xt, w, r, "", "", h0)
}"""


def test_recurrent_initial_state_follows_the_batch():
    proto, model = _pass(RNN)
    assert [str(d) for d in model.graph.outputs[0].shape] == ["1", "batch", "2"]
    x = _x(9, 5, 3)
    rows = _run(parser.parse_model(HEAD + RNN), x=x[:4])[0]  # RNN rows are independent
    np.testing.assert_allclose(_run(proto, x=x)[0][:, :4], rows, rtol=1e-6)


@pytest.mark.parametrize("body, reason", [
    ("y = Add(x, c)", "rows differ"),
    ("t = Constant<value = int64[2] {2, -1}>()\n y = Reshape(x, t)", "splits the rows"),
    ("t = Constant<value = int64[2] {4, 3}>()\n y = CenterCropPad(x, t)", "holding the batch size 4"),
    ("s = Constant<value = int64[1] {1}>()\n e = Constant<value = int64[1] {4}>()\n y = Slice(x, s, e)",
     "takes rows 1:4"),
])
def test_refusals_name_the_inputs_and_the_export_fix(body, reason):
    text = ("g (float[4, 3] x) => (float[4, 3] y) <float[4, 3] c = {1., 2., 3., 4., 5., 6., 7., 8., 9., 1., 2., 3.}> {\n"
            f"{body}\n}}")
    with pytest.raises(GradientError) as info:
        DynamicBatchPass()(ir.from_proto(parser.parse_model(HEAD + text)))
    message = str(info.value)
    assert message.startswith(ERROR_HEAD + "'x'") and reason in message
    assert "dynamic_shapes={'x': {0: batch}}" in message and "dynamic_axes={'x': {0: 'batch'}}" in message


def test_which_inputs_are_batched():
    graph = ir.from_proto(parser.parse_model(HEAD + """
    g (float[4, 8] x, int64[4] labels, float[8, 8] mask, float scale) => (float[4, 8] y) {
      y = Add(x, mask)
    }""")).graph
    size, chosen = select_batch_inputs(graph)
    assert size == 4 and [v.name for v in chosen] == ["x", "labels"]
    assert [v.name for v in select_batch_inputs(graph, ["mask"])[1]] == ["mask"]
    graph.inputs[2].metadata_props["pkg.torch.export.graph_signature.InputSpec.kind"] = "USER_INPUT"
    assert select_batch_inputs(graph) == (8, [graph.inputs[2]])  # marked user inputs only
    with pytest.raises(GradientError, match="leading dimensions are not one static size"):
        select_batch_inputs(graph, ["x", "mask"])


def test_dynamic_model_is_left_alone():
    proto = parser.parse_model(HEAD + "g (float[N, 3] x) => (float[N, 3] y) { y = Relu(x) }")
    assert not DynamicBatchPass()(ir.from_proto(proto)).modified
    assert make_batch_dynamic(proto).graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"


def test_verification_refuses_what_the_pass_let_through():
    # x[3:4] + x: no constant holds 4 (the pass leaves the row pick alone), but the graph reads
    # row 3: at batch 1 the index is out of range, so the verification refuses.
    proto = parser.parse_model(HEAD + """
    g (float[4, 3] x) => (float loss) {
      rows = Constant<value = int64[1] {3}>()
      picked = Gather<axis = 0>(x, rows)
      both = Add(picked, x)
      loss = ReduceMean<keepdims = 0>(both)
    }""")
    with pytest.raises(GradientError) as info:
        make_batch_dynamic(proto)
    assert str(info.value).startswith(ERROR_HEAD + "'x'") and "fails at batch 1" in str(info.value)


# -- torch models exported at batch 4 ------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 5)

    def forward(self, x, labels):
        return F.cross_entropy(self.fc2(torch.relu(self.fc1(x))), labels)


class Block(nn.Module):
    """Attention with heads of size 4 (= the export batch) and a class token expanded to the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.cls = nn.Embedding(11, 8), nn.Parameter(torch.randn(1, 1, 8))
        self.ln, self.qkv = nn.LayerNorm(8), nn.Linear(8, 24)
        self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 11)

    def forward(self, ids, labels):
        x = self.emb(ids)
        b, s = x.shape[0], x.shape[1] + 1
        x = torch.cat([self.cls.expand(b, -1, -1), x], 1)
        q, k, v = (t.view(b, s, 2, 4).transpose(1, 2) for t in self.qkv(self.ln(x)).split(8, dim=-1))
        y = (torch.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1) @ v).transpose(1, 2).reshape(b, s, 8)
        logits = self.head((x + self.proj(y))[:, 1:])
        return F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1))


class SumOverBatch(nn.Module):
    """A regression whose hidden size equals the export batch; loss = sum / batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x, y):
        return ((self.fc2(torch.tanh(self.fc1(x))) - y) ** 2).sum() / x.shape[0]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 4, 3, padding=1), nn.Linear(64, 5)

    def forward(self, x, labels):
        h = F.max_pool2d(torch.relu(self.conv(x)), 2)
        return F.cross_entropy(self.fc(h.view(h.shape[0], -1)), labels)


class PerRowBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.row = nn.Linear(8, 8), nn.Parameter(torch.randn(4, 8))

    def forward(self, x, y):
        return ((self.fc(x) + self.row - y) ** 2).mean()


class MixRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 1)

    def forward(self, x, y):
        return (self.fc(x.reshape(2, -1)) ** 2).mean() + (y * 0).sum()


def _data(model: nn.Module, batch: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    if isinstance(model, Block):
        return torch.randint(0, 11, (batch, 6), generator=g), torch.randint(0, 11, (batch, 6), generator=g)
    x_shape = {MLP: (8,), SumOverBatch: (4,), ConvNet: (1, 8, 8), PerRowBias: (8,), MixRows: (8,)}
    x = torch.randn(batch, *x_shape[type(model)], generator=g)
    if isinstance(model, (MLP, ConvNet)):
        return x, torch.randint(0, 5, (batch,), generator=g)
    return x, torch.randn(batch, 8 if isinstance(model, PerRowBias) else 1, generator=g)


EXPORTS = {"dynamo": (True, True), "dynamo_noopt": (True, False), "legacy": (False, True)}  # dynamo, optimize


def _export(model: nn.Module, how: str, folder: Path) -> Path:
    path = folder / f"{type(model).__name__}_{how}.onnx"
    names = list(inspect.signature(model.forward).parameters)
    dynamo, optimize = EXPORTS[how]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, _data(model, 4, seed=0), str(path), input_names=names, verbose=False,
                          dynamo=dynamo, optimize=optimize)
    return path


@pytest.mark.parametrize("how", list(EXPORTS))
@pytest.mark.parametrize("make", [MLP, Block, SumOverBatch, ConvNet])
def test_fixed_batch_export_gives_torch_loss_at_other_batches(make, how, tmp_path):
    torch.manual_seed(0)
    model = make()
    path = _export(model, how, tmp_path)
    dynamic = make_batch_dynamic(path)
    onnx.checker.check_model(dynamic)
    assert [i.type.tensor_type.shape.dim[0].dim_param for i in dynamic.graph.input] == ["batch", "batch"]
    for batch in (2, 4, 9):
        args = _data(model, batch, seed=batch)
        feeds = {i.name: a.numpy() for i, a in zip(dynamic.graph.input, args)}
        with torch.no_grad():
            want = model(*args).item()
        (got,) = _run(dynamic, **feeds)
        np.testing.assert_allclose(got, want, rtol=1e-4, err_msg=f"batch {batch}")
        if batch != 4:  # the export itself refuses this batch: the rewrite is what makes it run
            with pytest.raises(Exception, match="(?i)dimension|shape"):
                _run(onnx.load(str(path)), **feeds)


@pytest.mark.parametrize("how", ["dynamo", "legacy"])
@pytest.mark.parametrize("make, reason", [(PerRowBias, "rows differ"), (MixRows, "splits the rows")])
def test_batch_dependent_export_is_refused_with_the_documented_message(make, reason, how, tmp_path):
    torch.manual_seed(0)
    path = _export(make(), how, tmp_path)
    with pytest.raises(GradientError) as info:
        make_batch_dynamic(path)
    message = str(info.value)
    assert message.startswith(ERROR_HEAD + "'x', 'y'") and reason in message
    assert 'torch.export.Dim("batch")' in message and "dynamic_axes={'x': {0: 'batch'}, 'y': {0: 'batch'}}" in message


# -- transformers models of the test zoo (masks built by advanced indexing, LSTM states) -----------

@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
@pytest.mark.parametrize("name", ["bert", "gpt2", "t5", "lstm"])
def test_zoo_export_gives_torch_loss_at_other_batches(name, exporter, tmp_path):
    import model_zoo as zoo  # imports transformers

    path, _, _ = zoo.export(name, exporter, "train_p0", str(tmp_path / f"{name}.onnx"))
    module, batch, names = zoo.build(name, "train_p0")
    dynamic = make_batch_dynamic(path)
    for rows in (1, 5):  # the export batch is 2
        args = tuple(torch.cat([t, t.flip(0), t])[:rows] for t in batch)
        with torch.no_grad():
            want = module(*args).item()
        feeds = dict(zip(names, (a.numpy() for a in args)))
        (got,) = _run(dynamic, **{i.name: feeds[i.name] for i in dynamic.graph.input})
        np.testing.assert_allclose(got, want, rtol=1e-4, err_msg=f"{rows} rows")


# -- the train command -----------------------------------------------------------------------------

REGRESSION = """
g (float[4, 3] x, float[4] y) => (float loss) <float[3, 1] w = {0.5, -0.25, 0.125}, float[1, 3] rows = ROWS> {
  xs = Add(x, rows)
  p = MatMul(xs, w)
  t = Constant<value = int64[1] {4}>()
  q = Reshape(p, t)
  d = Sub(q, y)
  squares = Mul(d, d)
  s = ReduceSum<keepdims = 0>(squares)
  four = Constant<value = float {4.0}>()
  loss = Div(s, four)
}"""


@pytest.mark.parametrize("rows, code", [("{0., 0., 0.}", 0), (None, 2)])
def test_train_at_another_batch_size_or_the_documented_refusal(rows, code, tmp_path, capsys):
    from gradgraph.cli.main import main

    text = REGRESSION.replace("ROWS", rows) if rows else REGRESSION.replace(
        "float[1, 3] rows = ROWS", "float[4, 3] rows = {1., 2., 3., 4., 5., 6., 7., 8., 9., 1., 2., 3.}")
    onnx.save(parser.parse_model(HEAD + text), tmp_path / "m.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((30, 3)).astype(np.float32),
             y=rng.standard_normal(30).astype(np.float32))
    assert main(["train", str(tmp_path / "m.onnx"), "--loss", "loss", "--data", str(tmp_path / "d.npz"),
                 "--steps", "3", "--batch-size", "6", "--optimizer", "sgd", "--lr", "0.1", "--quiet"]) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if code:
        assert ERROR_HEAD + "'x', 'y'" in err and "dynamic_axes={'x': {0: 'batch'}, 'y': {0: 'batch'}}" in err
