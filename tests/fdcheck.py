"""Finite-difference checks of gradient graphs, shared by the op-level test suites.

The analytic gradient comes from the gradient graph run in onnxruntime (in the
model's own dtype). The numeric one is a float64 central difference of the same
forward model retyped to float64, run in onnxruntime or, where onnxruntime has no
float64 kernel for an op, in ``onnx.reference.ReferenceEvaluator``.

Elements where the one-sided difference quotients disagree (a kink, a tie, a jump)
are reported as ``kinks`` and not compared: the derivative does not exist there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from gradgraph.api import build_gradient_graph
from gradgraph.check import REFERENCE_OVERRIDES
from passes.forward.to_double import ToDoublePass

LOSS = "fdcheck_loss"
GRAD_SUFFIX = "_grad"
# Central-difference step, applied in float64.
FD_EPS = 1e-6
# Relative disagreement of the one-sided quotients (x+eps vs x-eps) that marks a kink.
KINK_RTOL = 1e-2
# Floor of the kink test, in units of the loss gradient.
KINK_ATOL = 1e-4
# At most this many elements of each input are perturbed.
MAX_ELEMENTS = 24
LOSS_FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """|analytic - numeric| <= atol + rtol * |numeric| for every compared element."""

    atol: float
    rtol: float


# float32 gradients carry float32 rounding of the forward values; float64 ones only FD error.
FLOAT32_TOL = Tolerance(atol=1e-4, rtol=1e-3)
FLOAT64_TOL = Tolerance(atol=1e-6, rtol=1e-5)


def tolerance_for(dtype: np.dtype) -> Tolerance:
    return FLOAT64_TOL if np.dtype(dtype) == np.float64 else FLOAT32_TOL


@dataclasses.dataclass
class GradReport:
    name: str
    checked: int = 0
    kinks: int = 0
    max_abs_err: float = 0.0
    mismatches: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


class KernelMissing(Exception):
    """onnxruntime cannot load or run the forward model (no kernel for an op or dtype)."""


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 4  # fatal only: probes for missing kernels are expected to fail
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def ort_runner(model: onnx.ModelProto) -> Callable[[Sequence[str], Mapping[str, np.ndarray]], list]:
    try:
        sess = session(model)
    except Exception as exc:  # noqa: BLE001 - any load failure means "cannot run here"
        raise KernelMissing(f"{type(exc).__name__}: {exc}") from exc
    return lambda names, feeds: sess.run(list(names), dict(feeds))


# The reference evaluator fixes (float64-exact Erf/Gelu, grouped ConvTranspose, ...) live in the
# package, where `gradgraph check` uses them too.


def reference_runner(model: onnx.ModelProto) -> Callable[[Sequence[str], Mapping[str, np.ndarray]], list]:
    ref = ReferenceEvaluator(model, new_ops=REFERENCE_OVERRIDES)
    return lambda names, feeds: ref.run(list(names), dict(feeds))


class FallbackRunner:
    """onnxruntime when it has the kernels, else the ONNX reference evaluator.

    Some kernels fail only when run (e.g. "LSTM operator does not support double yet"),
    so a failing onnxruntime run also switches to the reference evaluator, for good.
    """

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.fell_back = False
        try:
            self.run_ = ort_runner(model)
        except KernelMissing:
            self.run_ = reference_runner(model)

    def __call__(self, names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list:
        try:
            return self.run_(names, feeds)
        except Exception:  # noqa: BLE001 - fall back once; the reference's errors propagate
            if self.fell_back:
                raise
            self.fell_back = True
            self.run_ = reference_runner(self.model)
            return self.run_(names, feeds)


def any_runner(model: onnx.ModelProto) -> FallbackRunner:
    return FallbackRunner(model)


def as_double(model: onnx.ModelProto) -> onnx.ModelProto:
    """float32 -> float64, normalizations included (their ``stash_type`` defaults to float32)."""
    m = ir.from_proto(model)
    ToDoublePass()(m)
    for node in ir.traversal.RecursiveGraphIterator(m.graph):
        if _has_stash_type(node, m.opset_imports):
            node.attributes["stash_type"] = ir.AttrInt64("stash_type", int(ir.DataType.DOUBLE))
    return ir.to_proto(m)


def _has_stash_type(node: ir.Node, opsets: Mapping[str, int]) -> bool:
    domain = "" if node.domain == "ai.onnx" else node.domain
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
    except onnx.defs.SchemaError:
        return False
    return "stash_type" in schema.attributes


# ---- loss construction -----------------------------------------------------------------------


def elem_type(model: onnx.ModelProto, name: str) -> int:
    for vi in list(model.graph.output) + list(model.graph.value_info) + list(model.graph.input):
        if vi.name == name and vi.type.HasField("tensor_type"):
            return vi.type.tensor_type.elem_type
    return TensorProto.UNDEFINED


def with_weighted_loss(model: onnx.ModelProto, outputs: Mapping[str, tuple[int, ...]],
                       seed: int = 0) -> onnx.ModelProto:
    """Add ``LOSS = sum_k ReduceSum(Cast(y_k) * W_k)`` with fixed random ``W_k`` over ``outputs``.

    The loss is float64 when any output is, else float32; outputs of another float
    type are cast to it.
    """
    rng = np.random.default_rng(seed)
    types = {name: elem_type(model, name) for name in outputs}
    loss_type = TensorProto.DOUBLE if TensorProto.DOUBLE in types.values() else TensorProto.FLOAT
    np_type = helper.tensor_dtype_to_np_dtype(loss_type)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    terms = []
    for k, (name, shape) in enumerate(outputs.items()):
        value = name
        if types[name] != loss_type:
            value = f"fdcheck_cast_{k}"
            m.graph.node.append(helper.make_node("Cast", [name], [value], to=loss_type))
        weight = f"fdcheck_w_{k}"
        m.graph.initializer.append(
            numpy_helper.from_array(rng.standard_normal(shape).astype(np_type), weight))
        m.graph.node.append(helper.make_node("Mul", [value, weight], [f"fdcheck_wy_{k}"]))
        m.graph.node.append(helper.make_node("ReduceSum", [f"fdcheck_wy_{k}"], [f"fdcheck_term_{k}"],
                                             keepdims=0))
        terms.append(f"fdcheck_term_{k}")
    m.graph.node.append(helper.make_node("Sum", terms, [LOSS]))
    m.graph.output.append(helper.make_tensor_value_info(LOSS, loss_type, []))
    return m


# ---- the comparison --------------------------------------------------------------------------


def analytic_gradients(model: onnx.ModelProto, wrt: Sequence[str],
                       feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Build the gradient graph of LOSS and run it in onnxruntime (no fallback)."""
    grad_model = build_gradient_graph(model, LOSS, list(wrt))
    names = [f"{w}{GRAD_SUFFIX}" for w in wrt]
    values = session(grad_model).run(names, dict(feeds))
    return dict(zip(wrt, values))


def _double_feeds(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}


def _compare_element(report: GradReport, index: int, got: float, f_plus: float, f_zero: float,
                     f_minus: float, tol: Tolerance) -> None:
    up, down = (f_plus - f_zero) / FD_EPS, (f_zero - f_minus) / FD_EPS
    outside = not np.isfinite([f_plus, f_zero, f_minus]).all()  # at a domain edge
    if outside or abs(up - down) > KINK_ATOL + KINK_RTOL * max(abs(up), abs(down)):
        report.kinks += 1
        return
    numeric = (f_plus - f_minus) / (2 * FD_EPS)
    err = abs(got - numeric)
    report.checked += 1
    report.max_abs_err = max(report.max_abs_err, err)
    if not err <= tol.atol + tol.rtol * abs(numeric):
        report.mismatches.append(f"[{index}] analytic {got:.8g} vs numeric {numeric:.8g}")


def compare_gradients(model: onnx.ModelProto, wrt: Sequence[str], feeds: Mapping[str, np.ndarray],
                      tol: Tolerance, *, max_elements: int = MAX_ELEMENTS,
                      seed: int = 0) -> list[GradReport]:
    """Gradient graph of LOSS (which ``model`` outputs) w.r.t. ``wrt`` vs float64 central differences."""
    analytic = analytic_gradients(model, wrt, feeds)
    loss_of = _fd_loss(model)
    base = _double_feeds(feeds)
    f_zero = loss_of(base)
    rng = np.random.default_rng(seed)
    reports = []
    for name in wrt:
        x = base[name]
        got = np.asarray(analytic[name], dtype=np.float64)
        report = GradReport(name)
        if got.shape != x.shape:
            report.mismatches.append(f"gradient shape {list(got.shape)} != input shape {list(x.shape)}")
            reports.append(report)
            continue
        got = got.reshape(-1)
        picks = rng.choice(x.size, size=min(max_elements, x.size), replace=False)
        for k in sorted(picks):
            f = [loss_of({**base, name: _bumped(x, k, sign)}) for sign in (1.0, -1.0)]
            _compare_element(report, int(k), float(got[k]), f[0], f_zero, f[1], tol)
        reports.append(report)
    return reports


def _bumped(x: np.ndarray, index: int, sign: float) -> np.ndarray:
    flat = x.copy().reshape(-1)
    flat[index] += sign * FD_EPS
    return flat.reshape(x.shape)


def _fd_loss(model: onnx.ModelProto) -> Callable[[Mapping[str, np.ndarray]], float]:
    run = any_runner(as_double(model))

    def loss(feeds: Mapping[str, np.ndarray]) -> float:
        with np.errstate(all="ignore"):  # stepping past a domain edge is detected, not an error
            return float(np.sum(run([LOSS], feeds)[0]))

    return loss


def describe(reports: Sequence[GradReport]) -> str:
    lines = []
    for r in reports:
        head = f"{r.name}: checked {r.checked}, kinks {r.kinks}, max abs err {r.max_abs_err:.3g}"
        lines.append(head + "".join(f"\n    {m}" for m in r.mismatches[:8]))
    return "\n".join(lines)
