"""Finite-difference checks of gradient graphs, shared by the op-level test suites.

A thin adapter over the package's oracle, the one ``gradgraph check`` uses:
:func:`gradgraph.check.compare_with_central_differences`. Only the analytic side is here:
the gradient graph of ``LOSS`` (:func:`build_gradient_graph`, no preparation pass) run in
onnxruntime in the model's own dtype. The numeric side comes from the package: a float64
central difference of the forward model retyped to float64 (normalizations' ``stash_type``
included), run in onnxruntime or, where onnxruntime has no float64 kernel for an op, in
``onnx.reference.ReferenceEvaluator`` (no float32 fallback: the check fails instead).

Steps and tolerances (unchanged since the suites were written):

- step ``FD_EPS`` = 1e-6, absolute, in float64;
- an element passes when ``|analytic - numeric| <= atol + rtol * |numeric|``, with
  ``FLOAT32_TOL`` (atol 1e-4, rtol 1e-3) for float32 gradients and ``FLOAT64_TOL``
  (atol 1e-6, rtol 1e-5) for float64 ones (see :func:`tolerance_for`);
- at most ``MAX_ELEMENTS`` = 24 elements of each input, picked with ``seed``;
- every element is first screened for a kink (:class:`gradgraph.check.KinkScreen`,
  ``KINK_RTOL`` = 1e-2, ``KINK_ATOL`` = 1e-4): where the one-sided difference quotients
  disagree (a kink, a tie, a jump) or the loss is not finite within the step (a domain
  edge), the element is reported in ``kinks`` and not compared: the derivative does not
  exist there. The other elements are compared strictly (no re-probing of a mismatch at
  half the step, which ``gradgraph check`` does instead of the screen).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from gradgraph import check
from gradgraph.api import build_gradient_graph

LOSS = "fdcheck_loss"
GRAD_SUFFIX = "_grad"
# Central-difference step, applied in float64.
FD_EPS = 1e-6
# The kink screen's thresholds (gradgraph.check's): one-sided quotients' relative disagreement
# and its floor, in units of the loss gradient.
KINK_RTOL = check.KINK_RTOL
KINK_ATOL = check.KINK_ATOL
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
    """One input's comparison (from a :class:`gradgraph.check.CheckRow`): ``checked`` elements
    compared, ``kinks`` left out, and one line per element that disagrees (or the reason the
    input could not be compared, e.g. a wrong gradient shape). ``ok``: nothing disagrees."""

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


def compare_gradients(model: onnx.ModelProto, wrt: Sequence[str], feeds: Mapping[str, np.ndarray],
                      tol: Tolerance, *, max_elements: int = MAX_ELEMENTS,
                      seed: int = 0, eps: float = FD_EPS) -> list[GradReport]:
    """Gradient graph of LOSS (which ``model`` outputs) w.r.t. ``wrt`` vs float64 central differences."""
    analytic = analytic_gradients(model, wrt, feeds)
    report = check.compare_with_central_differences(
        model, LOSS, analytic, feeds, eps=eps, rtol=tol.rtol, atol=tol.atol,
        max_elements=max_elements, seed=seed, float64_only=True,
        kink_screen=check.KinkScreen(KINK_RTOL, KINK_ATOL))
    return [_report(row) for row in report]


def _report(row: check.CheckRow) -> GradReport:
    mismatches = list(row.mismatches)
    if row.result == check.RESULT_FAIL and not mismatches:  # e.g. a wrong gradient shape
        mismatches.append(row.detail)
    max_abs_err = row.max_abs_err if row.checked else 0.0
    return GradReport(row.name, row.checked, row.kinks, max_abs_err, mismatches)


def describe(reports: Sequence[GradReport]) -> str:
    lines = []
    for r in reports:
        head = f"{r.name}: checked {r.checked}, kinks {r.kinks}, max abs err {r.max_abs_err:.3g}"
        lines.append(head + "".join(f"\n    {m}" for m in r.mismatches[:8]))
    return "\n".join(lines)
