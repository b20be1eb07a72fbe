"""Finite-difference gradient check: the analytic gradient graph against central differences.

For each trained name, up to ``max_elements`` entries are perturbed by +/- a step in a
copy of the forward model (the *oracle*); the difference quotient of the loss is compared
with the entry of the gradient that the gradient graph computes in onnxruntime.

The oracle is the first of these that can run the model (:func:`gradcheck` reports which):

1. ``float64-ort``: central differences of a float64 copy of the forward model
   (:class:`passes.forward.to_double.ToDoublePass`; normalizations' ``stash_type`` set to
   float64 too) in onnxruntime; step :data:`FLOAT64_EPS`,
   tolerances :data:`FLOAT64_RTOL` / :data:`FLOAT64_ATOL`.
2. ``float64-reference``: the same float64 copy in ``onnx.reference.ReferenceEvaluator``,
   when onnxruntime's CPU provider cannot load or run it (it lacks float64 kernels for
   Conv, ConvTranspose, AveragePool, Erf, ...). Only for models holding at most
   :data:`REFERENCE_MAX_VALUES` values (initializers + inputs) whose whole check is
   estimated, from one timed run, to take at most :data:`REFERENCE_MAX_SECONDS`; the
   evaluator is pure numpy and slow. Same step and tolerances as 1. Its loss must agree with
   onnxruntime's float32 loss (:data:`REFERENCE_AGREEMENT`): a reference kernel that computes
   another function is not an oracle.
3. ``float32-ort``: central differences of the original float32 model in onnxruntime, with
   a relative step :data:`FLOAT32_EPS` (``h = eps * max(1, |x|)``) and tolerances
   :data:`FLOAT32_RTOL` and :data:`FLOAT32_ATOL` (the latter in units of ``max(1, |loss|)``,
   as float32 rounding of the loss is relative to its size).

The float64 copy retypes float16 and bfloat16 too, so a model that computes in them (its
weights, inputs or a Cast inside) is checked against the exact math; its analytic gradient
carries the rounding of that arithmetic, so the float64 oracles' tolerances become
:data:`LOW_PRECISION_TOL` of the lowest precision found (``rtol``, and ``atol`` in units of
the largest entry of the name's analytic gradient: the rounding is relative to the values).

Explicit ``eps`` / ``rtol`` / ``atol`` arguments replace the oracle's defaults. An entry
passes when ``|analytic - numeric| <= atol + rtol * |numeric|``; a NaN or infinity in either
fails it and shows in the row's errors. An entry that does not pass is re-probed at half the
step: where the difference quotients show a kink of the loss within the step (a ReLU or Clip
switching; the derivative does not exist there), it is counted in ``kinks`` and not compared.
Anything that stops the check (a model no oracle can run, a gradient graph onnxruntime cannot
load or run) is a :class:`GradientError`.

This is the one finite-difference oracle of the project: :func:`gradcheck` (``gradgraph
check``) computes the analytic gradients and hands them to
:func:`compare_with_central_differences`, which the op-level test suites (``tests/fdcheck.py``)
call directly with their own gradients, step and tolerances, ``float64_only=True`` and a
:class:`KinkScreen` (every entry screened for a kink by its one-sided quotients, instead of
re-probing the mismatching ones).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast, overload

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx.reference import ReferenceEvaluator
from onnx_ir.passes import PassError

from gradgraph.api import build_gradient_graph
from gradgraph.check_draws import freeze_random_draws
from gradgraph.feeds import NP_OF_ORT, InputError, check_feeds, unshaped_inputs
from gradgraph.index_inputs import IndexCheck
from gradgraph.io import load_model
from gradgraph.reference_kernels import REFERENCE_OVERRIDES
from passes.autodiff import GradientError
from passes.autodiff.rules.shape import PADDING_IDX_KEY
from passes.forward.prepare import PrepareForGradientPass
from passes.forward.reduce_loss import ReduceLossPass
from passes.forward.to_double import ToDoublePass
from passes.marks import GRADIENT_OF_KEY

_NP_OF = {1: np.float32, 10: np.float16, 11: np.float64, 16: np.float32, 6: np.int32, 7: np.int64,
          9: np.bool_, 2: np.uint8, 3: np.int8}

# float64 oracles: absolute central-difference step and tolerances.
FLOAT64_EPS = 1e-6
FLOAT64_RTOL = 1e-3
FLOAT64_ATOL = 1e-5
# float32 oracle: relative step (h = FLOAT32_EPS * max(1, |x|)). Rounding of the float32 loss
# (~1e-7 * |loss|) divided by h puts up to ~4e-4 * |loss| of noise into a difference quotient
# at this step; larger steps cross more ReLU/Clip kinks, smaller ones add noise. On
# MobileNet-style CNNs (BatchNorm + ReLU6, where a first-layer weight moves every activation of
# its channel) the quotient is off by up to ~2e-3 * |loss| at this step, so the absolute
# tolerance is 5e-3 * max(1, |loss|): the float32 oracle finds errors above that scale only.
FLOAT32_EPS = 3e-4
FLOAT32_RTOL = 1e-2
FLOAT32_ATOL = 5e-3  # times max(1, |loss|)
# Models computing in float16 / bfloat16 (against a float64 oracle): rtol, and atol in units of
# the largest |entry| of the name's analytic gradient; about 10 units in the last place of the
# type (float16 2^-10, bfloat16 2^-7): each op of the analytic gradient rounds to it.
LOW_PRECISION_TOL = {"float16": 1e-2, "bfloat16": 8e-2}
# KinkScreen: relative disagreement of the one-sided quotients (x+h vs x-h) that marks a kink,
# and its floor, in units of the loss gradient.
KINK_RTOL = 1e-2
# A difference step from which every entry looking like a kink says more about the step.
LARGE_STEP = 1e-2
KINK_ATOL = 1e-4
# The ONNX reference evaluator is tried only on models with at most this many values
# (initializers + inputs) ...
REFERENCE_MAX_VALUES = 200_000
# ... and only when one timed run predicts that the whole check takes at most this long, and
# its loss agrees with onnxruntime's float32 one within this, relative to max(1, |loss|).
REFERENCE_MAX_SECONDS = 30.0
REFERENCE_AGREEMENT = 1e-3

ORACLE_FLOAT64_ORT = "float64-ort"
ORACLE_FLOAT64_REFERENCE = "float64-reference"
ORACLE_FLOAT32_ORT = "float32-ort"
_ORACLE_TEXT = {
    ORACLE_FLOAT64_ORT: "float64 central differences in onnxruntime",
    ORACLE_FLOAT64_REFERENCE: "float64 central differences in the ONNX reference evaluator",
    ORACLE_FLOAT32_ORT: "float32 central differences in onnxruntime",
}

RESULT_OK, RESULT_FAIL, RESULT_SKIPPED = "ok", "FAIL", "skipped"


@dataclasses.dataclass(frozen=True)
class CheckRow:
    """One trained name: ``checked`` entries compared, their worst errors, the outcome.

    ``result`` is ``"ok"``, ``"FAIL"`` or ``"skipped"`` (nothing to compare: an empty tensor,
    or every entry picked sits at a kink); ``detail`` says why. The errors are NaN or infinite
    when an analytic or numeric value was (``nonfinite`` counts those entries). ``kinks``
    counts entries not compared because the loss has a kink within the step (a ReLU or Clip
    switching), where the difference quotient does not estimate the derivative.
    """

    name: str
    checked: int
    max_abs_err: float
    max_rel_err: float
    result: str = RESULT_OK
    detail: str = ""
    nonfinite: int = 0
    kinks: int = 0
    mismatches: tuple[str, ...] = ()  # "[flat index] analytic A vs numeric N" per failing entry

    @property
    def ok(self) -> bool:
        return self.result == RESULT_OK

    @property
    def result_text(self) -> str:
        return f"{self.result} ({self.detail})" if self.detail else self.result


@dataclasses.dataclass(frozen=True)
class CheckReport(Sequence[CheckRow]):
    """The rows of a check (it is a sequence of them) and how the numeric side was computed.

    ``oracle`` is one of ``ORACLE_FLOAT64_ORT``, ``ORACLE_FLOAT64_REFERENCE``,
    ``ORACLE_FLOAT32_ORT``; ``oracle_reason`` says why a fallback was needed ("" for the
    first); ``eps`` / ``rtol`` / ``atol`` are the values used (``atol`` before scaling by
    ``max(1, |loss|)`` for the float32 oracle, ``eps`` relative there).
    """

    rows: tuple[CheckRow, ...]
    oracle: str
    oracle_reason: str
    eps: float
    rtol: float
    atol: float
    loss_value: float
    low_precision: str | None = None  # "float16" / "bfloat16" when the model computes in it
    notes: tuple[str, ...] = ()  # what the check changed in the model to compare it (Dropout off)

    @overload
    def __getitem__(self, index: int) -> CheckRow: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[CheckRow]: ...
    def __getitem__(self, index: int | slice) -> CheckRow | Sequence[CheckRow]:
        return self.rows[index]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[CheckRow]:
        return iter(self.rows)

    @property
    def passed(self) -> list[CheckRow]:
        return [r for r in self.rows if r.result == RESULT_OK]

    @property
    def failed(self) -> list[CheckRow]:
        return [r for r in self.rows if r.result == RESULT_FAIL]

    @property
    def skipped(self) -> list[CheckRow]:
        return [r for r in self.rows if r.result == RESULT_SKIPPED]

    @property
    def ok(self) -> bool:
        """No row failed and at least one entry was compared."""
        return not self.failed and any(r.checked for r in self.rows)

    @property
    def oracle_label(self) -> str:
        """What computed the numeric side, e.g. "float64 central differences in onnxruntime"."""
        return _ORACLE_TEXT[self.oracle]

    @property
    def oracle_text(self) -> str:
        """:attr:`oracle_label`, with the reason for a fallback in parentheses."""
        return f"{self.oracle_label} ({self.oracle_reason})" if self.oracle_reason else self.oracle_label

    @property
    def tolerance_text(self) -> str:
        if self.low_precision and self.oracle != ORACLE_FLOAT32_ORT:
            return (f"eps={self.eps:g}, rtol={self.rtol:g}, atol={self.atol:g} x max |gradient| "
                    f"(the model computes in {self.low_precision})")
        if self.oracle == ORACLE_FLOAT32_ORT:
            return (f"eps={self.eps:g} x max(1, |x|), rtol={self.rtol:g}, "
                    f"atol={self.atol:g} x max(1, |loss|)")
        return f"eps={self.eps:g}, rtol={self.rtol:g}, atol={self.atol:g}"


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 4  # fatal only: a missing kernel is reported by the check itself
    opts.intra_op_num_threads = 2
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def random_inputs(model: onnx.ModelProto, seed: int = 0, dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Random feeds for the graph inputs that are not initializers (symbolic dims -> 2)."""
    rng = np.random.default_rng(seed)
    init = {i.name for i in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for inp in model.graph.input:
        if inp.name in init:
            continue
        t = inp.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (dims or {}).get(d.dim_param, 2)
                 for d in t.shape.dim]
        dtype = _NP_OF.get(t.elem_type)
        if dtype is None:
            raise GradientError(f"cannot make random data for input {inp.name!r} of type {t.elem_type}")
        if "mask" in inp.name.lower() and not np.issubdtype(dtype, np.floating):
            feeds[inp.name] = np.ones(shape, dtype)  # attention masks: attend everywhere
        elif np.issubdtype(dtype, np.floating):
            feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[inp.name] = rng.random(shape) > 0.5
        else:
            feeds[inp.name] = rng.integers(0, 2, size=shape).astype(dtype)
    return feeds


def _as_double(model: onnx.ModelProto) -> onnx.ModelProto:
    """float32 -> float64, normalizations included (their ``stash_type`` defaults to float32)."""
    m = ir.from_proto(model)
    ToDoublePass(low_precision=True)(m)
    for node in ir.traversal.RecursiveGraphIterator(m.graph):
        if _has_stash_type(node, m.opset_imports):
            node.attributes["stash_type"] = ir.AttrInt64("stash_type", int(ir.DataType.DOUBLE))
    return ir.to_proto(m)


_RETYPED = ("float32", "float16", "bfloat16")
_LOW = {int(onnx.TensorProto.FLOAT16): "float16", int(onnx.TensorProto.BFLOAT16): "bfloat16"}


def low_precision_of(model: onnx.ModelProto) -> str | None:
    """"float16" or "bfloat16" (the lower) when ``model`` holds or casts to it, else None."""
    found: set[str] = set()

    def visit(graph: onnx.GraphProto) -> None:
        for v in [*graph.input, *graph.output, *graph.value_info]:
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type in _LOW:
                found.add(_LOW[v.type.tensor_type.elem_type])
        for t in graph.initializer:
            if t.data_type in _LOW:
                found.add(_LOW[t.data_type])
        for node in graph.node:
            for a in node.attribute:
                if a.name in ("to", "dtype") and a.type == onnx.AttributeProto.INT and a.i in _LOW:
                    found.add(_LOW[a.i])
                elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type in _LOW:
                    found.add(_LOW[a.t.data_type])
                elif a.type == onnx.AttributeProto.GRAPH:
                    visit(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for g in a.graphs:
                        visit(g)

    visit(model.graph)
    return "bfloat16" if "bfloat16" in found else ("float16" if found else None)


def _has_stash_type(node: ir.Node, opsets: Mapping[str, int]) -> bool:
    domain = "" if node.domain == "ai.onnx" else node.domain
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
    except onnx.defs.SchemaError:
        return False
    return "stash_type" in schema.attributes


# ---- errors ------------------------------------------------------------------------------------

_NO_KERNEL = re.compile(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'")
_RUNNING = re.compile(r"while running (\w+) node\. Name:'([^']*)'")
_NODE_NAME = re.compile(r"[Nn]ode \(([^)]*)\)|node with name '([^']*)'|[Nn]ode name: ([^\s,)]+)")
# onnxruntime's run-time messages: "... Status Message: /src/file.h:91 ns::Fn(args) what went wrong"
_STATUS = re.compile(r"Status Message:\s*(?:\S+:\d+\s+)?(?:\S*::\S*\([^)]*\)\s*)?(.*)", re.S)


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _op_of_node(model: onnx.ModelProto, name: str) -> str | None:
    for node in model.graph.node:
        if node.name == name:
            return node.op_type
    return None


def _describe_failure(exc: BaseException, model: onnx.ModelProto, what: str,
                      kernel: str = "") -> tuple[str, str | None]:
    """(one-line reason, op type) for onnxruntime failing to load or run ``model`` (``what``)."""
    text = " ".join(str(exc).split())
    match = _NO_KERNEL.search(text)
    if match:
        op, _, node = match.groups()
        where = f" (node {node!r})" if node else ""
        return f"onnxruntime has no {kernel + ' ' if kernel else ''}kernel for {op}{where}", op
    match = _RUNNING.search(text)
    if match:
        op, node = match.groups()
        status = _STATUS.search(text)
        detail = status.group(1) if status else _short(exc)
        where = f" {node!r}" if node else ""
        return f"onnxruntime failed running the {what} at its {op} node{where}: {detail[:240]}", op
    match = _NODE_NAME.search(text)
    if match:
        node = next(g for g in match.groups() if g is not None)
        found = _op_of_node(model, node)
        if found is not None:
            return (f"onnxruntime cannot run the {what} at its {found} node {node!r}: "
                    f"{_short(exc)}", found)
    return f"onnxruntime cannot run the {what}: {_short(exc)}", None


def _unwrap_pass_error(exc: PassError, model_desc: str) -> GradientError:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, GradientError):
            return cause
        cause = cause.__cause__
    root = exc.__cause__ or exc
    return GradientError(f"cannot prepare {model_desc} for the check: {type(root).__name__}: {_short(root)}")


# ---- oracles -----------------------------------------------------------------------------------


Runner = Callable[[Mapping[str, np.ndarray]], float]


@dataclasses.dataclass
class _Oracle:
    kind: str
    reason: str
    loss_of: Runner
    base: dict[str, np.ndarray]  # feeds and trained values, in the oracle's dtypes
    f0: float


def _with_trained_as_inputs(model: onnx.ModelProto, loss: str, trained: Sequence[str]) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A copy whose trained initializers are graph inputs and whose outputs include ``loss``.

    Returns the copy and the trained initializers' values.
    """
    m = onnx.ModelProto()
    m.CopyFrom(model)
    wanted = set(trained)
    values: dict[str, np.ndarray] = {}
    keep = []
    for t in m.graph.initializer:
        if t.name in wanted:
            values[t.name] = onnx.numpy_helper.to_array(t)
            if t.name not in {i.name for i in m.graph.input}:
                m.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            keep.append(t)
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    # The other graph outputs stay: onnxruntime's BatchNormalization in training mode computes
    # its running variance from uninitialized memory (a different loss on every run) when its
    # other outputs are not graph outputs.
    if loss not in {o.name for o in m.graph.output}:
        typed = [v for v in m.graph.value_info if v.name == loss]
        out = onnx.ValueInfoProto()
        if typed:
            out.CopyFrom(typed[0])
        else:
            out.name = loss
        m.graph.output.append(out)
    return m, values


def _model_values(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> int:
    inits = sum(math.prod(t.dims) for t in model.graph.initializer)
    return int(inits + sum(np.asarray(v).size for v in feeds.values()))


def _loss_runner(run: Callable[[Mapping[str, np.ndarray]], Any]) -> Runner:
    def loss_of(feeds: Mapping[str, np.ndarray]) -> float:
        with np.errstate(all="ignore"):
            return float(np.sum(np.asarray(run(feeds), dtype=np.float64)))
    return loss_of


def _ort_loss(model: onnx.ModelProto, loss: str) -> Runner:
    sess = _session(model)
    return _loss_runner(lambda feeds: sess.run([loss], dict(feeds))[0])


def _reference_loss(model: onnx.ModelProto, loss: str) -> Runner:
    ref = ReferenceEvaluator(model, new_ops=REFERENCE_OVERRIDES)
    return _loss_runner(lambda feeds: cast(list, ref.run([loss], dict(feeds)))[0])


def _choose_oracle(forward: onnx.ModelProto, loss: str, trained: Sequence[str],
                   feeds: Mapping[str, np.ndarray], runs: int, model_desc: str,
                   float64_only: bool = False) -> _Oracle:
    """The first oracle that can load ``forward`` and compute the loss at ``feeds``.

    With ``float64_only`` the float32 fallback is not taken (the check fails instead), and the
    reference evaluator's size and time limits do not apply: they only exist to prefer it.
    """
    reasons: list[str] = []
    try:
        f64, trained64 = _with_trained_as_inputs(_as_double(forward), loss, trained)
    except Exception as exc:  # noqa: BLE001 - a pass failing on a model it does not expect
        f64 = None
        trained64 = {}
        reasons.append(f"the float64 copy could not be built ({type(exc).__name__}: {_short(exc)})")
    if f64 is not None:
        base64 = {k: (np.asarray(v).astype(np.float64) if np.asarray(v).dtype.name in _RETYPED else v)
                  for k, v in feeds.items()}
        base64.update(trained64)
        try:
            loss_of = _ort_loss(f64, loss)
            f0 = loss_of(base64)
            return _Oracle(ORACLE_FLOAT64_ORT, "", loss_of, base64, f0)
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises several types
            reasons.append(_describe_failure(exc, f64, "float64 copy", "float64")[0])
        size = _model_values(f64, base64)
        if size > REFERENCE_MAX_VALUES and not float64_only:
            reasons.append(f"the model holds {size:,} values, over the reference evaluator's limit "
                           f"of {REFERENCE_MAX_VALUES:,}")
        else:
            try:
                loss_of = _reference_loss(f64, loss)
                start = time.perf_counter()
                f0 = loss_of(base64)
                estimate = (time.perf_counter() - start) * runs
            except Exception as exc:  # noqa: BLE001 - the evaluator raises anything numpy does
                reasons.append(f"the ONNX reference evaluator cannot run it either "
                               f"({type(exc).__name__}: {_short(exc, 200)})")
            else:
                differs = "" if float64_only else _reference_differs(forward, loss, trained, feeds, f0)
                if differs:
                    reasons.append(differs)
                elif estimate <= REFERENCE_MAX_SECONDS or float64_only:
                    return _Oracle(ORACLE_FLOAT64_REFERENCE, reasons[0], loss_of, base64, f0)
                else:
                    reasons.append(f"the ONNX reference evaluator would take about {estimate:.0f} s "
                                   f"(limit {REFERENCE_MAX_SECONDS:g} s)")
    if float64_only:
        raise GradientError(f"cannot check {model_desc}: no float64 oracle can run its forward "
                            "model: " + "; ".join(reasons))
    f32, trained32 = _with_trained_as_inputs(forward, loss, trained)
    base32 = dict(feeds)
    base32.update(trained32)
    try:
        loss_of = _ort_loss(f32, loss)
        f0 = loss_of(base32)
    except Exception as exc:  # noqa: BLE001
        reason, op = _describe_failure(exc, f32, "forward model")
        raise GradientError(f"cannot check {model_desc}: no oracle can run its forward model: "
                            + "; ".join(reasons + [reason]), op_type=op) from exc
    return _Oracle(ORACLE_FLOAT32_ORT, "; ".join(reasons), loss_of, base32, f0)


def _reference_differs(forward: onnx.ModelProto, loss: str, trained: Sequence[str],
                       feeds: Mapping[str, np.ndarray], f0: float) -> str:
    """Why the reference evaluator's loss ``f0`` is not the model's: "" when it agrees with
    onnxruntime's (the runtime the gradients are for) within :data:`REFERENCE_AGREEMENT` (or
    the precision the model computes in) relative to ``max(1, |loss|)``, or onnxruntime cannot
    run the model. A stock reference kernel that computes something else (LRN summed over the
    batch axis) would make every entry of the check fail."""
    try:
        f32, trained32 = _with_trained_as_inputs(forward, loss, trained)
        f_ort = _ort_loss(f32, loss)({**feeds, **trained32})
    except Exception:  # noqa: BLE001 - then the reference is the only float64 oracle left
        return ""
    low = low_precision_of(forward)
    tol = LOW_PRECISION_TOL[low] if low else REFERENCE_AGREEMENT
    if not (math.isfinite(f0) and math.isfinite(f_ort)) or abs(f0 - f_ort) <= tol * max(1.0, abs(f_ort)):
        return ""
    return (f"the ONNX reference evaluator's loss ({f0:.7g}) differs from onnxruntime's "
            f"({f_ort:.7g}): one of its kernels computes something else")


# ---- the check ---------------------------------------------------------------------------------


def _validate(eps: float | None, rtol: float | None, atol: float | None, max_elements: int) -> None:
    if isinstance(max_elements, bool) or not isinstance(max_elements, (int, np.integer)) or max_elements < 1:
        raise GradientError(f"max_elements (--max-elements) must be a positive integer, the entries "
                            f"checked per name; got {max_elements!r}")
    if eps is not None and not (math.isfinite(eps) and eps > 0):
        raise GradientError(f"eps (--eps) must be a positive finite step; got {eps!r}")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise GradientError(f"{name} (--{name}) must be a finite number >= 0; got {value!r}")


def _describe_model(model: object) -> str:
    return f"model file {os.fspath(model)!r}" if isinstance(model, (str, os.PathLike)) else "the model"


def gradcheck(
    model: onnx.ModelProto | str | os.PathLike,
    loss: str,
    weights: Sequence[str] | None = None,
    inputs: Mapping[str, np.ndarray] | None = None,
    *,
    eps: float | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    max_elements: int = 16,
    seed: int = 0,
    loss_reduction: str | None = None,
) -> CheckReport:
    """Check the gradient of ``loss`` w.r.t. ``weights`` at ``inputs`` (random if None).

    ``eps`` / ``rtol`` / ``atol`` default to the chosen oracle's (see the module docstring).
    ``loss_reduction`` ("sum" or "mean"): a non-scalar loss is reduced first, as
    :func:`gradgraph.build_gradient_graph` reduces it; both the gradient and the differences
    are of the reduced loss.
    Returns a :class:`CheckReport`: a sequence of :class:`CheckRow`, one per trained name, plus
    the oracle used. Raises :class:`GradientError` for anything that stops the check.
    """
    _validate(eps, rtol, atol, max_elements)
    model_desc = _describe_model(model)
    try:
        # as build_gradient_graph: folded parameters are refused only for the default trained set
        prepare = PrepareForGradientPass(strict_parameters=weights is None)
        prepared = ReduceLossPass(loss, loss_reduction)(prepare(load_model(model)).model).model
    except PassError as exc:
        raise _unwrap_pass_error(exc, model_desc) from exc
    given = ir.to_proto(prepared)
    feeds = dict(inputs) if inputs is not None else random_inputs(given, seed)
    names = [i.name for i in given.graph.input]
    extra = sorted(set(feeds) - set(names))
    if extra:
        raise InputError(f"the inputs given hold {extra}, which {'is' if len(extra) == 1 else 'are'} "
                         f"not an input of {model_desc}; its inputs are {names}")
    if inputs is not None:  # torch's IndexError for a negative or out-of-range label or id
        IndexCheck(prepared)(feeds, "the inputs given")
    # a random draw is made once and fed to both sides (gradgraph.check_draws)
    draws, notes = freeze_random_draws(prepared, feeds, seed, model_desc)
    feeds.update(draws)
    forward = ir.to_proto(prepared) if draws else given
    try:
        grad_model = build_gradient_graph(forward, loss, weights)
    except PassError as exc:
        raise _unwrap_pass_error(exc, model_desc) from exc
    # the gradient outputs, found by their mark (passes.marks), and the names they belong to
    marked = [(o.name, p.value) for o in grad_model.graph.output for p in o.metadata_props
              if p.key == GRADIENT_OF_KEY]
    grad_names = [g for g, _ in marked]
    trained = [w for _, w in marked]
    try:
        grad_session = _session(grad_model)
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises several types
        reason, op = _describe_failure(exc, grad_model, "gradient graph")
        raise GradientError(f"cannot check {model_desc}: {reason}", op_type=op) from exc
    check_feeds(grad_session.get_inputs(), feeds, "the inputs given", unshaped=unshaped_inputs(grad_model))
    # a float64 array for a float input is accepted (check_feeds: a same-kind cast), as in training
    feeds = {i.name: np.asarray(feeds[i.name], dtype=NP_OF_ORT.get(i.type)) for i in grad_session.get_inputs()}
    try:
        analytic = dict(zip(grad_names, grad_session.run(grad_names, feeds)))
    except Exception as exc:  # noqa: BLE001
        reason, op = _describe_failure(exc, grad_model, "gradient graph")
        raise GradientError(f"cannot check {model_desc}: {reason}", op_type=op) from exc

    where = ("at the inputs given" if inputs is not None else
             f"at random inputs (standard normal floats, integers 0 or 1, seed {seed})")
    report = compare_with_central_differences(
        forward, loss, {w: analytic[g] for g, w in zip(grad_names, trained)}, feeds, eps=eps,
        rtol=rtol, atol=atol, max_elements=max_elements, seed=seed, model_desc=model_desc,
        inputs_text=where)
    return dataclasses.replace(report, notes=tuple(notes))


def compare_with_central_differences(
    forward: onnx.ModelProto,
    loss: str,
    analytic: Mapping[str, np.ndarray],
    feeds: Mapping[str, np.ndarray],
    *,
    eps: float | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    max_elements: int = 16,
    seed: int = 0,
    float64_only: bool = False,
    kink_screen: KinkScreen | None = None,
    model_desc: str = "the model",
    inputs_text: str = "at the inputs given",
) -> CheckReport:
    """The numeric side of the check: ``analytic`` gradients against central differences.

    ``forward`` outputs ``loss``; ``analytic`` maps each name to check (a graph input given in
    ``feeds``, or an initializer) to its gradient, however it was computed. The oracle is
    chosen as the module docstring says: with ``float64_only`` only the two float64 ones (the
    reference evaluator then without its size and time limits), else a :class:`GradientError`.
    ``eps`` / ``rtol`` / ``atol`` default to the oracle's. ``seed`` picks the entries, from one
    generator in the order of ``analytic``. With a :class:`KinkScreen`, every entry is first
    screened for a kink and the others are compared strictly; without one, only mismatching
    entries are re-probed for a kink. Rows of embedding tables
    marked with a ``padding_idx`` are not compared. This is the oracle :func:`gradcheck` and
    the op-level test suites (``tests/fdcheck.py``) share.
    """
    _validate(eps, rtol, atol, max_elements)
    trained = list(analytic)
    runs = 1 + 2 * sum(min(max_elements, int(np.asarray(a).size)) for a in analytic.values())
    oracle = _choose_oracle(forward, loss, trained, feeds, runs, model_desc, float64_only)
    if not math.isfinite(oracle.f0):
        raise GradientError(f"cannot check {model_desc}: its loss {loss!r} is {oracle.f0} "
                            f"{inputs_text}, so no difference quotient is finite there; pass "
                            "inputs where the model is defined (--inputs FILE.npz)")
    float32 = oracle.kind == ORACLE_FLOAT32_ORT
    low = low_precision_of(forward)
    low_tol = LOW_PRECISION_TOL[low] if low and not float32 else None
    step = eps if eps is not None else (FLOAT32_EPS if float32 else FLOAT64_EPS)
    r_tol = rtol if rtol is not None else (FLOAT32_RTOL if float32 else low_tol or FLOAT64_RTOL)
    a_tol = atol if atol is not None else (FLOAT32_ATOL if float32 else low_tol or FLOAT64_ATOL)
    a_tol_used = a_tol * max(1.0, abs(oracle.f0)) if float32 and math.isfinite(oracle.f0) else a_tol

    rng = np.random.default_rng(seed)
    rows = []
    padding = _padding_rows(forward)
    for name in trained:
        grad = np.asarray(analytic[name])
        a_tol_name = a_tol_used
        if low_tol is not None:
            finite = np.abs(grad[np.isfinite(grad)].astype(np.float64))
            a_tol_name = a_tol * (float(finite.max()) if finite.size else 0.0)
        rows.append(_check_one(name, oracle, grad, rng, step, float32,
                               r_tol, a_tol_name, max_elements, model_desc, padding.get(name, set()),
                               kink_screen))
    return CheckReport(tuple(rows), oracle.kind, oracle.reason, step, r_tol, a_tol, oracle.f0,
                       low if low_tol is not None else None)


def _padding_rows(forward: onnx.ModelProto) -> dict[str, set[int]]:
    """Rows of embedding tables that follow torch's ``padding_idx`` (no gradient by convention,
    not by the graph's math): they are not compared."""
    rows: dict[str, set[int]] = {}
    for node in forward.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if node.op_type == "Gather" and PADDING_IDX_KEY in meta and axis == 0:
            rows.setdefault(node.input[0], set()).add(int(meta[PADDING_IDX_KEY]))
    return rows


def _check_one(name: str, oracle: _Oracle, grad: np.ndarray, rng: np.random.Generator, step: float,
               relative_step: bool, rtol: float, atol: float, max_elements: int,
               model_desc: str, skip_rows: set[int] | None = None,
               kink_screen: KinkScreen | None = None) -> CheckRow:
    x = np.asarray(oracle.base[name])
    if grad.shape != x.shape:
        return CheckRow(name, 0, math.nan, math.nan, RESULT_FAIL,
                        f"gradient shape {list(grad.shape)} != {list(x.shape)}")
    if x.size == 0:
        return CheckRow(name, 0, 0.0, 0.0, RESULT_SKIPPED, "empty")
    pool = np.arange(x.size)
    if skip_rows and x.ndim >= 1:
        pool = pool[~np.isin(pool // max(1, x.size // x.shape[0]), list(skip_rows))]
    if pool.size == 0:
        return CheckRow(name, 0, 0.0, 0.0, RESULT_SKIPPED, "only padding rows")
    picks = rng.choice(pool, size=min(max_elements, pool.size), replace=False)
    got = grad.astype(np.float64).reshape(-1)
    errs: list[float] = []
    rels: list[float] = []
    mismatches: list[str] = []
    ok = True
    bad_analytic = bad_numeric = nonfinite = kinks = 0
    for k in sorted(int(k) for k in picks):
        probe = _Probe(name, oracle, x, k, model_desc)
        h = step * max(1.0, abs(probe.x0)) if relative_step else step
        if kink_screen is not None and kink_screen.at_kink(probe, h):
            kinks += 1
            continue
        numeric = probe.central(h)
        analytic = float(got[k])
        finite_a, finite_n = math.isfinite(analytic), math.isfinite(numeric)
        if finite_a and finite_n:
            err = abs(numeric - analytic)
            tol = atol + rtol * abs(numeric)
            if err > tol and kink_screen is None and probe.kink(h, tol):
                kinks += 1  # no derivative to compare with in this step's window
                continue
            passed = err <= tol
            ok &= passed
        else:
            err = _nonfinite_err(analytic, numeric)
            bad_analytic += not finite_a
            bad_numeric += not finite_n
            nonfinite += 1
            ok = passed = False
        if not passed:
            mismatches.append(f"[{k}] analytic {analytic:.8g} vs numeric {numeric:.8g}")
        errs.append(err)
        rels.append(err / max(abs(numeric), 1e-12) if math.isfinite(err) else err)
    parts = []
    if bad_analytic:
        parts.append(f"{bad_analytic} non-finite analytic")
    if bad_numeric:
        parts.append(f"{bad_numeric} non-finite numeric")
    if kinks:
        parts.append(f"{kinks} at kinks, not compared")
        if not errs and step >= LARGE_STEP:  # a smooth loss curves within so wide a window too
            parts.append(f"a step of {step:g} is wide enough to look like a kink anywhere: try a "
                         "smaller --eps / eps")
    if not errs:  # every pick sat at a kink
        return CheckRow(name, 0, math.nan, math.nan, RESULT_SKIPPED, ", ".join(parts), kinks=kinks)
    # np.max propagates NaN: a NaN entry shows as nan, never as a small number
    max_abs, max_rel = float(np.max(errs)), float(np.max(rels))
    return CheckRow(name, len(errs), max_abs, max_rel, RESULT_OK if ok else RESULT_FAIL,
                    ", ".join(parts), nonfinite, kinks, tuple(mismatches))


def _nonfinite_err(analytic: float, numeric: float) -> float:
    """NaN when either side is NaN (or both are the same infinity), else infinity."""
    if math.isnan(analytic) or math.isnan(numeric):
        return math.nan
    if math.isinf(analytic) and math.isinf(numeric) and analytic == numeric:
        return math.nan
    return math.inf


@dataclasses.dataclass(frozen=True)
class KinkScreen:
    """Screen every entry for a kink before comparing it, instead of re-probing mismatches.

    An entry is at a kink when the loss is not finite at x or x +/- h (a domain edge) or when
    the one-sided difference quotients disagree: ``|up - down| > atol + rtol * max(|up|,
    |down|)``. The op-level test suites use it (defaults :data:`KINK_RTOL`, :data:`KINK_ATOL`)
    so that an entry at a tie or a kink is never compared, even where the analytic value
    happens to match the central difference; it needs a float64 oracle (float32 rounding makes
    one-sided quotients too noisy for it). An entry that passes the screen is compared strictly:
    a mismatch there is a failure, not re-probed at half the step.
    """

    rtol: float = KINK_RTOL
    atol: float = KINK_ATOL

    def at_kink(self, probe: _Probe, h: float) -> bool:
        (x_plus, f_plus), (x_minus, f_minus) = probe.at(h), probe.at(-h)
        f_zero = probe.oracle.f0
        if not np.isfinite([f_plus, f_zero, f_minus]).all():
            return True
        with np.errstate(all="ignore"):
            up = (f_plus - f_zero) / (x_plus - probe.x0)
            down = (f_zero - f_minus) / (probe.x0 - x_minus)
        return not abs(up - down) <= self.atol + self.rtol * max(abs(up), abs(down))


class _Probe:
    """The loss as a function of entry ``k`` of ``name``, evaluated on demand at x_k + offsets."""

    def __init__(self, name: str, oracle: _Oracle, x: np.ndarray, k: int, model_desc: str) -> None:
        self.name, self.oracle, self.k, self.model_desc = name, oracle, k, model_desc
        self.flat = x.reshape(-1)
        self.shape = x.shape
        self.x0 = float(self.flat[k])
        self.values: dict[float, tuple[float, float]] = {0.0: (self.x0, oracle.f0)}

    def at(self, offset: float) -> tuple[float, float]:
        """(the point actually taken, which float32 rounds; the loss there)."""
        if offset not in self.values:
            xp = self.flat.copy()
            xp[self.k] = xp[self.k] + xp.dtype.type(offset)
            feeds = dict(self.oracle.base)
            feeds[self.name] = xp.reshape(self.shape)
            try:
                loss = self.oracle.loss_of(feeds)
            except Exception as exc:  # noqa: BLE001 - a runtime failing part-way through
                raise GradientError(f"cannot check {self.model_desc}: the "
                                    f"{_ORACLE_TEXT[self.oracle.kind]} failed perturbing "
                                    f"{self.name!r}: {type(exc).__name__}: {_short(exc)}") from exc
            self.values[offset] = (float(xp[self.k]), loss)
        return self.values[offset]

    def central(self, h: float) -> float:
        (x_plus, f_plus), (x_minus, f_minus) = self.at(h), self.at(-h)
        if x_plus == x_minus:
            raise GradientError(f"the step {h:g} does not change {self.name!r} (entry {self.k}, value "
                                f"{self.x0!r}, {self.flat.dtype}); use a larger eps")
        with np.errstate(all="ignore"):
            return (f_plus - f_minus) / (x_plus - x_minus)

    def _second(self, h: float) -> float:
        """Right minus left one-sided quotient: ~f''h where smooth, the slope jump at a kink."""
        (xp, fp), (xm, fm) = self.at(h), self.at(-h)
        return (fp - self.oracle.f0) / (xp - self.x0) - (self.oracle.f0 - fm) / (self.x0 - xm)

    def kink(self, h: float, tol: float) -> bool:
        """Whether the loss has a kink within +/- h of the entry (checked on a mismatch only).

        Where the loss is smooth, central quotients at h and h/2 agree to O(h^2) and the
        one-sided difference scales with the step (S(h) = 2 S(h/2)); a kink inside the window
        breaks one of the two by about the mismatch it causes.
        """
        if not math.isfinite(self.oracle.f0):
            return False
        half = self.central(h / 2)
        with np.errstate(all="ignore"):
            jump = self._second(h) - 2 * self._second(h / 2)
        if not (math.isfinite(half) and math.isfinite(jump)):
            return False
        return abs(self.central(h) - half) > tol / 2 or abs(jump) > tol
