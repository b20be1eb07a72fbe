"""`gradgraph check`: its oracles, non-finite gradients, argument errors, and no tracebacks.

Oracle tolerances are gradgraph.check's defaults, asserted below:
float64 (onnxruntime or the ONNX reference evaluator): eps 1e-6, rtol 1e-3, atol 1e-5;
float32 (onnxruntime): eps 3e-4 * max(1, |x|), rtol 1e-2, atol 5e-3 * max(1, |loss|).
"""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, parser
from onnx import helper as oh

from gradgraph import check
from gradgraph.check import gradcheck, oracles
from gradgraph.cli.main import main as cli_main
from passes.autodiff import GradientError, registry
from passes.forward.to_double import ToDoublePass

torch = pytest.importorskip("torch")
F = torch.nn.functional

CNN_WEIGHTS = ["conv.weight", "conv.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias"]
CONV_WEIGHTS = ["conv.weight", "conv.bias", "bn.weight", "bn.bias"]  # upstream of the ReLU6


# ---- models -------------------------------------------------------------------------------------


class _CNN(torch.nn.Module):
    """Conv2d + BatchNorm2d + ReLU6 + AvgPool + Linear, cross-entropy loss (float64 Conv and
    AveragePool have no onnxruntime CPU kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 3 * 3, 5)

    def forward(self, x, y):
        h = F.avg_pool2d(F.relu6(self.bn(self.conv(x)) * 3.0), 2)
        return F.cross_entropy(self.fc(h.flatten(1)), y)


class _GeluChunk(torch.nn.Module):
    """GELU (Erf: no float64 kernel), chunk (Split / SplitToSequence) and expand of new_ones."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        h1, h2 = F.gelu(self.a(x)).chunk(2, dim=-1)
        h = h1 * torch.sigmoid(h2) + h1.new_ones(1).expand(h1.shape) * 0.5
        return F.cross_entropy(self.b(h), y)


class _SiluChunk(_GeluChunk):
    """As _GeluChunk with SiLU: every op has a float64 kernel once the copy is typed right."""

    def forward(self, x, y):
        h1, h2 = F.silu(self.a(x)).chunk(2, dim=-1)
        h = h1 * torch.sigmoid(h2) + h1.new_ones(1).expand(h1.shape) * 0.5
        h = torch.cat([h, h.new_zeros(h.shape[0], 1)], -1)[:, :4]
        return F.cross_entropy(self.b(h), y)


def _export(module, args, path, **kwargs) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=["x", "y"], output_names=["loss"],
                          **kwargs)
    return str(path)


class _Exports:
    """The test models, each exported on first use (a dynamo export takes a few seconds)."""

    def __init__(self, folder) -> None:
        self.folder = folder
        self.paths: dict[str, str] = {}

    def __getitem__(self, name: str) -> str:
        if name not in self.paths:
            torch.manual_seed(0)
            mlp_args = (torch.randn(4, 6), torch.tensor([0, 1, 2, 1]))
            path = self.folder / f"{name}.onnx"
            if name == "cnn_noopt":
                cnn_args = (torch.randn(2, 3, 6, 6), torch.tensor([1, 3]))
                self.paths[name] = _export(_CNN().train(), cnn_args, path, optimize=False)
            elif name == "gelu_legacy":
                self.paths[name] = _export(_GeluChunk(), mlp_args, path, dynamo=False)
            elif name == "gelu_noopt":
                self.paths[name] = _export(_GeluChunk(), mlp_args, path, optimize=False)
            elif name == "silu_noopt":
                self.paths[name] = _export(_SiluChunk(), mlp_args, path, optimize=False)
            else:
                raise KeyError(name)
        return self.paths[name]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    return _Exports(tmp_path_factory.mktemp("check_exports"))


def _wrong_clip(monkeypatch) -> None:
    """Make Clip's gradient the identity (wrong wherever ReLU6 clips)."""
    rule = registry.lookup("", "Clip", 18)
    wrong = registry.GradRule(rule.domain, rule.op_type, lambda b, n, g: [g[0], None, None],
                              rule.since, rule.until, rule.diff_inputs, rule.broadcast)
    monkeypatch.setitem(registry._RULES, ("", "Clip"), [wrong])


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _table(out: str) -> dict[str, list[str]]:
    """name -> [checked, max abs err, max rel err, result...] of the printed table."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["name", "checked"])
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("oracle:"):
            break
        parts = line.split()
        rows[parts[0]] = parts[1:]
    return rows


# ---- oracles ------------------------------------------------------------------------------------


def test_oracle_constants_are_the_documented_ones():
    assert (check.FLOAT64_EPS, check.FLOAT64_RTOL, check.FLOAT64_ATOL) == (1e-6, 1e-3, 1e-5)
    assert (check.FLOAT32_EPS, check.FLOAT32_RTOL, check.FLOAT32_ATOL) == (3e-4, 1e-2, 5e-3)
    assert check.REFERENCE_MAX_VALUES >= 10_000 and check.REFERENCE_MAX_SECONDS > 0


def test_missing_float64_conv_kernel_falls_back_to_the_reference_evaluator(exports, capsys):
    report = gradcheck(exports["cnn_noopt"], "loss", CNN_WEIGHTS)
    assert report.oracle == check.ORACLE_FLOAT64_REFERENCE
    assert "no float64 kernel for Conv" in report.oracle_reason
    assert (report.eps, report.rtol, report.atol) == (1e-6, 1e-3, 1e-5)
    assert [r.name for r in report] == CNN_WEIGHTS and all(r.ok and r.checked for r in report), report
    assert sum(r.kinks for r in report) <= sum(r.checked for r in report) // 4  # kinks are rare
    code, out, err = _cli(capsys, exports["cnn_noopt"], "--loss", "loss", "--weights", *CNN_WEIGHTS)
    assert code == 0, out + err
    assert ("oracle: float64 central differences in the ONNX reference evaluator "
            "(onnxruntime has no float64 kernel for Conv") in out
    assert out.splitlines()[-1].startswith("6 passed, 0 failed (float64 central differences in the "
                                           "ONNX reference evaluator, eps=1e-06, rtol=0.001, atol=1e-05)")


def test_float32_oracle_when_the_model_is_over_the_reference_limit(exports, capsys, monkeypatch):
    monkeypatch.setattr(oracles, "REFERENCE_MAX_VALUES", 0)
    report = gradcheck(exports["cnn_noopt"], "loss", CNN_WEIGHTS)
    assert report.oracle == check.ORACLE_FLOAT32_ORT
    assert "no float64 kernel for Conv" in report.oracle_reason
    assert "over the reference evaluator's limit of 0" in report.oracle_reason
    assert (report.eps, report.rtol, report.atol) == (3e-4, 1e-2, 5e-3)
    assert all(r.ok and r.checked for r in report), report
    assert sum(r.kinks for r in report) <= sum(r.checked for r in report) // 4  # kinks are rare
    code, out, _ = _cli(capsys, exports["cnn_noopt"], "--loss", "loss", "--weights", *CNN_WEIGHTS)
    assert code == 0
    assert "oracle: float32 central differences in onnxruntime (onnxruntime has no float64 kernel for Conv" in out
    assert "eps=0.0003 x max(1, |x|), rtol=0.01, atol=0.005 x max(1, |loss|)" in out.splitlines()[-1]


@pytest.mark.parametrize("limit", [check.REFERENCE_MAX_VALUES, 0], ids=["float64-reference", "float32"])
def test_each_fallback_oracle_catches_a_wrong_rule(exports, monkeypatch, limit):
    monkeypatch.setattr(oracles, "REFERENCE_MAX_VALUES", limit)
    _wrong_clip(monkeypatch)
    report = gradcheck(exports["cnn_noopt"], "loss", CNN_WEIGHTS)
    assert report.oracle == (check.ORACLE_FLOAT32_ORT if limit == 0 else check.ORACLE_FLOAT64_REFERENCE)
    failed = {r.name for r in report.failed}
    assert failed and failed <= set(CONV_WEIGHTS), report
    assert {"fc.weight", "fc.bias"} <= {r.name for r in report.passed}  # downstream of the Clip
    assert not report.ok


def test_reference_evaluator_also_stops_at_its_time_budget(exports, monkeypatch):
    monkeypatch.setattr(oracles, "REFERENCE_MAX_SECONDS", 0.0)
    report = gradcheck(exports["cnn_noopt"], "loss", ["fc.bias"])
    assert report.oracle == check.ORACLE_FLOAT32_ORT
    assert "would take about" in report.oracle_reason and report.ok


@pytest.mark.parametrize("name", ["gelu_legacy", "gelu_noopt"])
def test_missing_float64_erf_kernel_falls_back(exports, capsys, name):
    code, out, err = _cli(capsys, exports[name], "--loss", "loss",
                          "--weights", "a.weight", "a.bias", "b.weight", "b.bias")
    assert code == 0, out + err
    assert "oracle: float64 central differences in the ONNX reference evaluator " \
           "(onnxruntime has no float64 kernel for Erf)" in out
    assert out.splitlines()[-1].startswith("4 passed, 0 failed")


def test_dynamo_unoptimized_export_runs_in_float64_onnxruntime(exports):
    """Constant value_float -> Expand -> CastLike and SplitToSequence: the float64 copy is typed
    consistently, so onnxruntime runs it (these were type errors)."""
    report = gradcheck(exports["silu_noopt"], "loss", ["a.weight", "a.bias", "b.weight", "b.bias"])
    assert report.oracle == check.ORACLE_FLOAT64_ORT and report.oracle_reason == ""
    assert report.ok and all(r.checked for r in report), report


@pytest.mark.parametrize("name", ["cnn_noopt", "gelu_noopt", "silu_noopt", "gelu_legacy"])
def test_float64_copy_of_real_exports_is_well_typed(exports, name):
    from gradgraph.io import load_model
    from passes.forward.prepare import PrepareForGradientPass

    forward = PrepareForGradientPass()(load_model(exports[name])).model
    ToDoublePass()(forward)
    proto = ir.to_proto(forward)
    onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    types = {v.name: v.type.tensor_type.elem_type for v in proto.graph.value_info
             if v.type.HasField("tensor_type")}
    assert TensorProto.FLOAT not in types.values()


# ---- ToDoublePass on the cases torch exports produce --------------------------------------------


def _double(model: onnx.ModelProto) -> onnx.ModelProto:
    """ToDoublePass after shape inference, as in `gradcheck` (PrepareForGradientPass infers)."""
    m = ir.from_proto(onnx.shape_inference.infer_shapes(model))
    ToDoublePass()(m)
    out = ir.to_proto(m)
    onnx.shape_inference.infer_shapes(out, check_type=True, strict_mode=True)
    return out


def _run(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


TYPED_CASES = {
    "value_float_expand_castlike": """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2, 3] x) => (float[2, 3] y) {
  one = Constant<value_float = 1.5>()
  shp = Constant<value_ints = [2, 3]>()
  e = Expand(one, shp)
  c = CastLike(e, x)
  f = Constant<value_floats = [0.5, 1., 2.]>()
  cx = Mul(c, x)
  y = Mul(cx, f)
}""",
    "constant_of_shape_default": """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2, 3] x) => (float[2, 5] y) {
  shp = Constant<value_ints = [2, 2]>()
  z = ConstantOfShape(shp)
  y = Concat<axis = 1>(x, z)
}""",
    "split_to_sequence": """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2, 4] x) => (float[2, 2] y) {
  two = Constant<value = int64[2] {2, 2}>()
  s = SplitToSequence<axis = 1>(x, two)
  i = Constant<value = int64 {1}>()
  a = SequenceAt(s, i)
  y = Tanh(a)
}""",
    "layer_norm_range": """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2, 4] x) => (float[2, 4] y) <float[4] w = {1., 2., 3., 4.}> {
  start = Constant<value_float = 0.>()
  limit = Constant<value_float = 2.>()
  delta = Constant<value_float = 0.5>()
  r = Range(start, limit, delta)
  n = LayerNormalization<epsilon = 0.001>(x, w, r)
  y = Cast<to = 1>(n)
}""",
}


@pytest.mark.parametrize("case", sorted(TYPED_CASES))
def test_to_double_types_what_torch_exports_emit(case):
    model = parser.parse_model(TYPED_CASES[case])
    x = np.random.default_rng(0).standard_normal(
        [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)
    double = _double(model)
    assert double.graph.output[0].type.tensor_type.elem_type == TensorProto.DOUBLE
    got = _run(double, {"x": x.astype(np.float64)})[0]
    want = _run(model, {"x": x})[0]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_to_double_sets_dtype_of_ops_that_default_to_float32():
    model = parser.parse_model("""
<ir_version: 9, opset_import: ["" : 18]>
g (float[2] x) => (float[2, 2] y, float[2] w) {
  r = RandomNormal<shape = [2, 2], seed = 1.>()
  y = Mul(r, x)
  n = Constant<value = int64 {2}>()
  w = HannWindow(n)
}""")
    double = _double(model)
    nodes = {n.op_type: n for n in double.graph.node}
    assert oh.get_attribute_value(next(a for a in nodes["RandomNormal"].attribute if a.name == "dtype")) == TensorProto.DOUBLE
    assert oh.get_attribute_value(next(a for a in nodes["HannWindow"].attribute if a.name == "output_datatype")) == TensorProto.DOUBLE


# ---- float16 models: the oracle is the exact math ------------------------------------------------

F16_MLP = """
<ir_version: 9, opset_import: ["" : 18]>
g (float16[8, 16] x) => (float16 loss) {
  y = MatMul(x, W1)
  r = Tanh(y)
  z = MatMul(r, W2)
  s = Softmax<axis = -1>(z)
  q = Mul(s, z)
  loss = ReduceSum<keepdims = 0>(q)
}
"""

CAST_INSIDE = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[8, 16] x) => (float loss) {
  xh = Cast<to = 10>(x)
  wh = Cast<to = 10>(W)
  yh = MatMul(xh, wh)
  y = Cast<to = 1>(yh)
  t = Tanh(y)
  loss = ReduceSum<keepdims = 0>(t)
}
"""


WEIGHT_SHAPES = {"W1": (16, 32), "W2": (32, 8), "W": (16, 8)}


def _with_weights(text: str, dtype, seed: int = 0) -> onnx.ModelProto:
    """The model of ``text`` with random initializers for the weights it reads."""
    model = parser.parse_model(text)
    rng = np.random.default_rng(seed)
    read = {x for n in model.graph.node for x in n.input}
    for name, shape in WEIGHT_SHAPES.items():
        if name in read:
            model.graph.initializer.append(onnx.numpy_helper.from_array(
                (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(dtype), name))
    return model


@pytest.mark.parametrize("text, dtype", [(F16_MLP, np.float16), (CAST_INSIDE, np.float32)],
                         ids=["float16-weights", "cast-to-float16-inside"])
def test_float16_model_is_checked_against_the_float64_math(text, dtype, capsys, tmp_path):
    """A float16 model (or a float32 one that computes in float16): the float64 copy retypes
    float16 too (a step of 1e-6 does not move a float16 weight: the check used to stop), with
    tolerances 1e-2 (rtol, and atol x the largest gradient entry). A gradient 5% off fails."""
    model = _with_weights(text, dtype)
    report = gradcheck(model, "loss", max_elements=32)
    assert report.oracle == check.ORACLE_FLOAT64_ORT and report.low_precision == "float16"
    assert (report.rtol, report.atol) == (check.LOW_PRECISION_TOL["float16"],) * 2 == (1e-2, 1e-2)
    assert report.ok and all(r.checked for r in report), report
    analytic = {r.name: None for r in report}
    names = list(analytic)
    grads = gradgraph_grads(model, names)
    feeds = check.random_inputs(model)
    again = check.compare_with_central_differences(model, "loss", grads, feeds, max_elements=32)
    assert again.ok
    wrong = check.compare_with_central_differences(
        model, "loss", {k: v * np.asarray(1.05, v.dtype) for k, v in grads.items()}, feeds,
        max_elements=32)
    assert {r.name for r in wrong.failed} == set(names)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    code, out, err = _cli(capsys, str(path), "--loss", "loss")
    assert code == 0, out + err
    assert "(the model computes in float16)" in out.splitlines()[-1]


def gradgraph_grads(model: onnx.ModelProto, names: list[str]) -> dict[str, np.ndarray]:
    """The analytic gradients of ``names`` at gradcheck's random inputs, run in onnxruntime."""
    from gradgraph.api import build_gradient_graph
    from passes.marks import GRADIENT_OF_KEY

    grad = build_gradient_graph(model, "loss", names)
    outs = {p.value: o.name for o in grad.graph.output for p in o.metadata_props if p.key == GRADIENT_OF_KEY}
    sess = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = check.random_inputs(model)
    values = sess.run([outs[n] for n in names], {i.name: feeds[i.name] for i in sess.get_inputs()})
    return dict(zip(names, values))


def test_to_double_keeps_float16_unless_asked():
    model = _with_weights(CAST_INSIDE, np.float32)
    kept = ir.from_proto(model)
    ToDoublePass()(kept)
    assert {n.attributes["to"].value for n in kept.graph if n.op_type == "Cast"} == {10, 11}
    low = ir.from_proto(model)
    ToDoublePass(low_precision=True)(low)
    assert {n.attributes["to"].value for n in low.graph if n.op_type == "Cast"} == {11}
    assert check.low_precision_of(model) == "float16"
    assert check.low_precision_of(parser.parse_model(NAN_MODEL)) is None


# ---- non-finite gradients -----------------------------------------------------------------------

NAN_MODEL = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2, 3] x) => (float loss) <float[3] Z = {0., 0., 0.}, float[3] w = {1., 2., 3.}> {
  xw = Mul(x, w)
  s = Tanh(xw)
  zz = Mul(Z, Z)
  n2 = ReduceSum<keepdims = 0>(zz)
  n = Sqrt(n2)
  a = ReduceSum<keepdims = 0>(s)
  loss = Add(a, n)
}
"""


def test_nan_gradient_is_shown_as_nan_and_fails(tmp_path, capsys):
    """d/dZ sqrt(sum Z^2) at Z = 0 is 0/0: the gradient graph gives NaN; it must not pass."""
    path = tmp_path / "nan.onnx"
    onnx.save(parser.parse_model(NAN_MODEL), path)
    report = gradcheck(str(path), "loss", ["Z", "w"])
    z, w = report
    assert not z.ok and z.result == "FAIL" and math.isnan(z.max_abs_err) and z.nonfinite == 3
    assert w.ok
    code, out, err = _cli(capsys, str(path), "--loss", "loss", "--weights", "Z", "w")
    assert code == 1, out + err
    row = _table(out)["Z"]
    assert row[:3] == ["3", "nan", "nan"] and row[3] == "FAIL" and "non-finite analytic" in " ".join(row)
    assert "0.000e+00" not in " ".join(row)
    assert "1 passed, 1 failed" in out.splitlines()[-1]


def test_infinite_error_is_shown_as_inf():
    """An analytic inf against a finite difference quotient is an infinite error, not 0."""
    loss_of = lambda feeds: float(np.sum(feeds["v"]))  # noqa: E731 - d loss / dv = 1
    oracle = check._Oracle(check.ORACLE_FLOAT64_ORT, "", loss_of, {"v": np.zeros(3)}, 0.0)
    grad = np.array([1.0, np.inf, 1.0])
    row = check._check_one("v", oracle, grad, np.random.default_rng(0), 1e-6, False, 1e-3, 1e-5, 8, "m")
    assert row.result == "FAIL" and row.max_abs_err == math.inf and row.nonfinite == 1
    assert f"{row.max_abs_err:>11.3e}".strip() == "inf"
    good = check._check_one("v", oracle, np.ones(3), np.random.default_rng(0), 1e-6, False, 1e-3, 1e-5, 8, "m")
    assert good.ok and good.max_abs_err < 1e-8


def test_entries_at_a_kink_are_not_compared(tmp_path, capsys):
    """Relu at exactly 0 has no derivative: those entries are counted, the others compared."""
    path = tmp_path / "relu.onnx"
    onnx.save(parser.parse_model("""
<ir_version: 9, opset_import: ["" : 18]>
g (float[2] x) => (float loss) <float[5] W = {0., 1., -1., 0., 2.}> {
  r = Relu(W)
  s = ReduceSum<keepdims = 0>(r)
  t = ReduceSum<keepdims = 0>(x)
  loss = Mul(s, t)
}"""), path)
    x = np.array([1.5, 0.5], np.float32)
    (row,) = gradcheck(str(path), "loss", ["W"], {"x": x})
    assert (row.checked, row.kinks, row.result) == (3, 2, "ok"), row
    np.savez(tmp_path / "x.npz", x=x)
    code, out, _ = _cli(capsys, str(path), "--loss", "loss", "--weights", "W", "--inputs", str(tmp_path / "x.npz"))
    assert code == 0 and _table(out)["W"][3:] == ["ok", "(2", "at", "kinks,", "not", "compared)"]


# ---- arguments and errors -----------------------------------------------------------------------

LINEAR = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2, 3] x) => (float loss) <float[3, 0] E = {}, float[3] w = {1., 2., 3.}> {
  xe = MatMul(x, E)
  c = Concat<axis = 1>(x, xe)
  cw = Mul(c, w)
  t = Tanh(cw)
  loss = ReduceSum<keepdims = 0>(t)
}
"""


@pytest.fixture
def linear(tmp_path):
    path = tmp_path / "linear.onnx"
    onnx.save(parser.parse_model(LINEAR), path)
    return str(path)


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_elements_below_one_is_refused(linear, capsys, value):
    code, out, err = _cli(capsys, linear, "--loss", "loss", f"--max-elements={value}")
    assert code == 2 and out == ""
    assert err.strip() == (f"gradgraph check: error: max_elements (--max-elements) must be a positive "
                           f"integer, the entries checked per name; got {value}")
    with pytest.raises(GradientError, match="max_elements"):
        gradcheck(linear, "loss", max_elements=0)


def test_empty_tensor_is_skipped_not_passed(linear, capsys):
    code, out, _ = _cli(capsys, linear, "--loss", "loss", "--weights", "E", "w")
    assert code == 0
    assert _table(out)["E"] == ["0", "-", "-", "skipped", "(empty)"]
    assert out.splitlines()[-1].startswith("1 passed, 0 failed, 1 skipped (")
    code, out, _ = _cli(capsys, linear, "--loss", "loss", "--weights", "E")
    assert code == 1  # nothing at all was compared: not a pass
    assert "0 passed, 0 failed, 1 skipped: nothing was checked" in out


RESHAPE = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2, 3] x, int64[2] shape) => (float loss) <float[3] w = {1., 2., 3.}> {
  xw = Mul(x, w)
  r = Reshape(xw, shape)
  t = Tanh(r)
  loss = ReduceSum<keepdims = 0>(t)
}
"""


def _no_traceback_cases(tmp_path, exports, linear, monkeypatch):
    reshape = tmp_path / "reshape.onnx"
    onnx.save(parser.parse_model(RESHAPE), reshape)
    bad_shape = tmp_path / "bad_shape.npz"
    np.savez(bad_shape, x=np.ones((2, 3), np.float32), shape=np.array([4, 4]))

    def no_float32_runtime():
        monkeypatch.setattr(oracles, "REFERENCE_MAX_VALUES", 0)
        real = check._ort_loss

        def ort_loss(model, loss):
            if any(i.type.tensor_type.elem_type == TensorProto.FLOAT for i in model.graph.input):
                raise ort.capi.onnxruntime_pybind11_state.NotImplemented(
                    "[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation "
                    "for Conv(11) node with name 'node_conv2d'")
            return real(model, loss)
        monkeypatch.setattr(oracles, "_ort_loss", ort_loss)

    def small_float32_step():
        monkeypatch.setattr(oracles, "REFERENCE_MAX_VALUES", 0)

    cnn = [exports["cnn_noopt"], "--loss", "loss", "--weights", "conv.bias"]
    return {
        "missing file": ([str(tmp_path / "nope.onnx"), "--loss", "loss"], None, "does not exist"),
        "max-elements 0": ([linear, "--loss", "loss", "--max-elements", "0"], None, "--max-elements"),
        "eps 0": ([linear, "--loss", "loss", "--eps", "0"], None, "--eps"),
        "eps nan": ([linear, "--loss", "loss", "--eps", "nan"], None, "--eps"),
        "rtol -1": ([linear, "--loss", "loss", "--rtol", "-1"], None, "--rtol"),
        "unknown loss": ([linear, "--loss", "nope", "--weights", "w"], None, "nope"),
        "gradient graph fails to run": ([str(reshape), "--loss", "loss", "--weights", "w", "--inputs",
                                         str(bad_shape)], None, "at its Reshape node"),
        "no oracle runs the model": (cnn, no_float32_runtime, "no oracle can run its forward model"),
        "step lost in float32 rounding": (cnn + ["--eps", "1e-12"], small_float32_step,
                                          "does not change 'conv.bias'"),
    }


CASES = ["missing file", "max-elements 0", "eps 0", "eps nan", "rtol -1", "unknown loss",
         "gradient graph fails to run", "no oracle runs the model", "step lost in float32 rounding"]


@pytest.mark.parametrize("case", CASES)
def test_cli_errors_are_one_line_without_traceback(tmp_path, exports, linear, capsys, monkeypatch, case):
    argv, setup, expected = _no_traceback_cases(tmp_path, exports, linear, monkeypatch)[case]
    if setup is not None:
        setup()
    code, out, err = _cli(capsys, *argv)
    assert code == 2, out + err
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradgraph check: error: "), err
    assert expected in lines[0]


def test_report_is_a_sequence_of_rows(linear):
    report = gradcheck(linear, "loss", ["w"], max_elements=2)
    assert len(report) == 1 and report[0].name == "w" and report[0].checked == 2
    assert [r.name for r in report] == ["w"] and report.ok
    assert re.fullmatch(r"float64 central differences in onnxruntime", report.oracle_text)


NAN_AT_RANDOM_INPUTS = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2, 3] x) => (float loss) <float[3] w = {1.5, 0.5, 2.}> {
  y = Pow(x, w)
  loss = ReduceSum<keepdims = 0>(y)
}
"""


def test_a_loss_not_finite_at_the_inputs_is_an_input_problem(tmp_path, capsys):
    """x ** 1.5 of a negative x is NaN: at random (normal) inputs the check cannot compare
    anything, and says so and what to do (it used to fail the gradient as 'non-finite');
    at inputs where the model is defined it passes."""
    path = tmp_path / "pow.onnx"
    onnx.save(parser.parse_model(NAN_AT_RANDOM_INPUTS), path)
    code, out, err = _cli(capsys, str(path), "--loss", "loss")
    assert code == 2 and "Traceback" not in err
    assert ("its loss 'loss' is nan at random inputs (standard normal floats, integers 0 or 1, "
            "seed 0), so no difference quotient is finite there; pass inputs where the model is "
            "defined (--inputs FILE.npz)") in err
    with pytest.raises(GradientError, match="is nan at the inputs given"):
        gradcheck(parser.parse_model(NAN_AT_RANDOM_INPUTS), "loss",
                  inputs={"x": -np.ones((2, 3), np.float32)})
    np.savez(tmp_path / "x.npz", x=np.full((2, 3), 0.7, np.float32))
    code, out, err = _cli(capsys, str(path), "--loss", "loss", "--inputs", str(tmp_path / "x.npz"))
    assert code == 0, out + err


LRN_MODEL = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2, 5, 3, 3] x) => (float loss) <float[5, 3, 3] w = {}> {
  y = Mul(x, w)
  n = LRN<size = 3, alpha = 0.5, beta = 0.75, bias = 1.>(y)
  t = Tanh(n)
  loss = ReduceSum<keepdims = 0>(t)
}
"""


def _lrn_model() -> onnx.ModelProto:
    model = parser.parse_model(LRN_MODEL.replace(" = {}", ""))
    w = np.random.default_rng(3).uniform(0.5, 1.5, (5, 3, 3)).astype(np.float32)
    model.graph.initializer.append(onnx.numpy_helper.from_array(w, "w"))
    return model


def test_a_reference_kernel_that_disagrees_with_onnxruntime_is_not_the_oracle(monkeypatch):
    """onnxruntime has no float64 LRN, so the reference evaluator is the float64 oracle; the
    stock reference LRN sums over the batch axis (a different function: every entry failed).
    Its loss is compared with onnxruntime's float32 one first: with the stock kernel the check
    falls back to the float32 oracle and says why; with gradgraph's kernel it is the oracle."""
    report = gradcheck(_lrn_model(), "loss")
    assert report.oracle == check.ORACLE_FLOAT64_REFERENCE and report.ok, report
    stock = [k for k in check.REFERENCE_OVERRIDES if k.__name__ != "LRN"]
    monkeypatch.setattr(oracles, "REFERENCE_OVERRIDES", stock)
    report = gradcheck(_lrn_model(), "loss")
    assert report.oracle == check.ORACLE_FLOAT32_ORT and report.ok, report
    assert re.search(r"the ONNX reference evaluator's loss \(\S+\) differs from onnxruntime's "
                     r"\(\S+\): one of its kernels computes something else", report.oracle_reason)


def test_an_array_that_is_no_input_of_the_model_is_refused(tmp_path, capsys):
    """A misspelt input in --inputs was ignored (the check ran on the other arrays)."""
    path = tmp_path / "pow.onnx"
    onnx.save(parser.parse_model(NAN_AT_RANDOM_INPUTS), path)
    np.savez(tmp_path / "x.npz", x=np.full((2, 3), 0.7, np.float32), X=np.ones((2, 3), np.float32))
    code, out, err = _cli(capsys, str(path), "--loss", "loss", "--inputs", str(tmp_path / "x.npz"))
    assert code == 2 and "Traceback" not in err
    assert "the inputs given hold ['X'], which is not an input of model file" in err
    assert "its inputs are ['x']" in err


NON_SCALAR_MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
agraph (float[2, 3] x) => (float[2, 4] loss)
<float[3, 4] w = {0.5, -1.0, 0.25, 2.0, -0.5, 1.5, 0.75, -2.0, 1.0, 0.1, -0.3, 0.6}>
{
  y = MatMul (x, w)
  loss = Tanh (y)
}
"""


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_check_reduces_a_non_scalar_loss_as_grad_does(tmp_path, capsys, reduction):
    """`check --reduce` (as `grad --reduce`): the gradient and the central differences are of
    the reduced loss; without it a non-scalar loss is refused, naming the option."""
    path = tmp_path / "nonscalar.onnx"
    onnx.save(parser.parse_model(NON_SCALAR_MODEL), path)
    code, out, err = _cli(capsys, str(path), "--loss", "loss")
    assert code == 2 and "not a scalar" in err and "--reduce sum|mean" in err
    code, out, err = _cli(capsys, str(path), "--loss", "loss", "--reduce", reduction)
    assert code == 0, out + err
    assert _table(out)["w"][0] == "12" and "1 passed, 0 failed" in out
    report = gradcheck(str(path), "loss", loss_reduction=reduction)
    assert report.ok and [r.name for r in report] == ["w"]


_DROPOUT = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[4, 3] x) => (float loss) <float[3, 5] w = {PLACEHOLDER}, float ratio = {0.3}, bool train = {1}> {
    h = MatMul(x, w)
    t = Tanh(h)
    d, m = Dropout(t, ratio, train)
    loss = ReduceSum(d)
}
"""


def test_a_training_dropout_is_checked_with_one_fixed_mask_and_said_so(tmp_path, capsys):
    """Each run of a training-mode Dropout draws a new mask: the check draws one, feeds it to
    both sides and says so (it reported every entry as a kink and nothing compared)."""
    w = np.linspace(-1, 1, 15).reshape(3, 5).astype(np.float32)
    text = _DROPOUT.replace("{PLACEHOLDER}", "{" + ", ".join(map(str, w.ravel())) + "}")
    path = tmp_path / "drop.onnx"
    onnx.save(parser.parse_model(text), path)
    report = gradcheck(str(path), "loss")
    assert report.ok and all(r.checked for r in report) and len(report.notes) == 1
    assert "random draws held fixed" in report.notes[0]
    code, out, _ = _cli(capsys, str(path), "--loss", "loss")
    assert code == 0 and "note: random draws held fixed" in out


def test_other_random_draws_are_held_fixed_too(tmp_path):
    model = parser.parse_model("""
<ir_version: 9, opset_import: ["" : 18]>
g (float[4, 3] x) => (float loss) <float[3] w = {1.0, 2.0, 3.0}> {
    n = RandomNormalLike(x)
    y = Add(x, n)
    z = Mul(y, w)
    loss = ReduceSum(z)
}
""")
    report = gradcheck(model, "loss")
    assert report.ok and "RandomNormalLike" in report.notes[0]
