"""Analytic gradients against central differences of the loss, entry by entry, with the
kink screen and re-probe (see :mod:`gradgraph.check`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir

from gradgraph.check.large import large_float64_oracle, skeleton
from gradgraph.check.oracles import (
    FLOAT32_ATOL,
    FLOAT32_EPS,
    FLOAT32_RTOL,
    FLOAT64_ATOL,
    FLOAT64_EPS,
    FLOAT64_RTOL,
    KINK_ATOL,
    KINK_RTOL,
    LARGE_STEP,
    LOW_PRECISION_TOL,
    _choose_oracle,
    _Oracle,
    _short,
    low_precision_of,
)
from gradgraph.check.report import (
    _ORACLE_TEXT,
    ORACLE_FLOAT32_ORT,
    RESULT_FAIL,
    RESULT_OK,
    RESULT_SKIPPED,
    CheckReport,
    CheckRow,
)
from passes.autodiff import GradientError
from passes.autodiff.rules.shape import PADDING_IDX_KEY


def _validate(eps: float | None, rtol: float | None, atol: float | None, max_elements: int) -> None:
    if isinstance(max_elements, bool) or not isinstance(max_elements, (int, np.integer)) or max_elements < 1:
        raise GradientError(f"max_elements (--max-elements) must be a positive integer, the entries "
                            f"checked per name; got {max_elements!r}")
    if eps is not None and not (math.isfinite(eps) and eps > 0):
        raise GradientError(f"eps (--eps) must be a positive finite step; got {eps!r}")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise GradientError(f"{name} (--{name}) must be a finite number >= 0; got {value!r}")


def compare_with_central_differences(
    forward: onnx.ModelProto | ir.Model,
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

    ``forward`` outputs ``loss`` (an ``onnx_ir.Model`` for a model over the external-data
    threshold: then the oracle is :func:`gradgraph.check.large.large_float64_oracle`, whatever
    ``float64_only`` says, and a dict ``analytic`` is emptied once its entries are read, so
    that the arrays are freed before the oracle runs); ``analytic`` maps each name to check (a graph input given in
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
    if isinstance(forward, ir.Model):  # a large model: its own float64 oracle, no weight copied
        return _compare_large(forward, loss, analytic, feeds, eps=eps, rtol=rtol, atol=atol,
                              max_elements=max_elements, seed=seed, model_desc=model_desc,
                              inputs_text=inputs_text)
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


def _compare_large(forward: ir.Model, loss: str, analytic: Mapping[str, np.ndarray],
                   feeds: Mapping[str, np.ndarray], *, eps: float | None, rtol: float | None,
                   atol: float | None, max_elements: int, seed: int, model_desc: str,
                   inputs_text: str) -> CheckReport:
    """:func:`compare_with_central_differences` of a large model: the entries to compare are
    picked and read first (the same picks, from the same generator), and a dict ``analytic``
    is emptied as they are (``gradcheck`` holds no other reference to its arrays: W bytes less
    at the oracle's peak) before :func:`gradgraph.check.large.large_float64_oracle` runs."""
    shape = skeleton(forward)
    low = low_precision_of(shape)
    low_tol = LOW_PRECISION_TOL[low] if low else None
    padding = _padding_rows(shape)
    rng = np.random.default_rng(seed)
    chosen: dict[str, CheckRow | dict[int, float]] = {}
    scales: dict[str, float] = {}
    for name in list(analytic):
        grad = np.asarray(analytic.pop(name) if isinstance(analytic, dict) else analytic[name])
        value = forward.graph.initializers.get(name)
        x_shape = (tuple(value.const_value.shape.numpy()) if value is not None and value.const_value is not None
                   else np.shape(feeds[name]) if name in feeds else grad.shape)
        picked = _select(name, grad.shape, x_shape, rng, max_elements, padding.get(name, set()))
        got = grad.reshape(-1)
        chosen[name] = picked if isinstance(picked, CheckRow) else {k: float(got[k]) for k in picked}
        if low_tol is not None:
            finite = np.abs(grad[np.isfinite(grad)].astype(np.float64))
            scales[name] = float(finite.max()) if finite.size else 0.0
        del grad, got
    oracle = large_float64_oracle(forward, loss, list(chosen), feeds, model_desc)
    if not math.isfinite(oracle.f0):
        raise GradientError(f"cannot check {model_desc}: its loss {loss!r} is {oracle.f0} "
                            f"{inputs_text}, so no difference quotient is finite there; pass "
                            "inputs where the model is defined (--inputs FILE.npz)")
    step = eps if eps is not None else FLOAT64_EPS
    r_tol = rtol if rtol is not None else low_tol or FLOAT64_RTOL
    a_tol = atol if atol is not None else low_tol or FLOAT64_ATOL
    rows = []
    for name, entries in chosen.items():
        if isinstance(entries, CheckRow):
            rows.append(entries)
            continue
        a_tol_name = a_tol * scales[name] if low_tol is not None else a_tol
        rows.append(_compare_entries(name, oracle, np.asarray(oracle.base[name]), entries, step, False,
                                     r_tol, a_tol_name, model_desc))
    return CheckReport(tuple(rows), oracle.kind, oracle.reason, step, r_tol, a_tol, oracle.f0, low)


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


def _select(name: str, grad_shape: tuple[int, ...], x_shape: tuple[int, ...], rng: np.random.Generator,
            max_elements: int, skip_rows: set[int] | None = None) -> CheckRow | list[int]:
    """The flat indices of the entries to compare, sorted, or the row that says why none is."""
    if grad_shape != x_shape:
        return CheckRow(name, 0, math.nan, math.nan, RESULT_FAIL,
                        f"gradient shape {list(grad_shape)} != {list(x_shape)}")
    size = math.prod(x_shape)
    if size == 0:
        return CheckRow(name, 0, 0.0, 0.0, RESULT_SKIPPED, "empty")
    # the population as a count where every entry may be picked (the same picks as from
    # arange(size), without an index per entry: 8 bytes each, 2.2 GB for a 1.1 GB weight)
    pool: int | np.ndarray = size
    if skip_rows and len(x_shape) >= 1:
        pool = np.arange(size)
        pool = pool[~np.isin(pool // max(1, size // x_shape[0]), list(skip_rows))]
        if pool.size == 0:
            return CheckRow(name, 0, 0.0, 0.0, RESULT_SKIPPED, "only padding rows")
    count = pool if isinstance(pool, int) else int(pool.size)
    return sorted(int(k) for k in rng.choice(pool, size=min(max_elements, count), replace=False))


def _check_one(name: str, oracle: _Oracle, grad: np.ndarray, rng: np.random.Generator, step: float,
               relative_step: bool, rtol: float, atol: float, max_elements: int,
               model_desc: str, skip_rows: set[int] | None = None,
               kink_screen: KinkScreen | None = None) -> CheckRow:
    x = np.asarray(oracle.base[name])
    picked = _select(name, grad.shape, x.shape, rng, max_elements, skip_rows)
    if isinstance(picked, CheckRow):
        return picked
    got = grad.reshape(-1)
    return _compare_entries(name, oracle, x, {k: float(got[k]) for k in picked}, step, relative_step,
                            rtol, atol, model_desc, kink_screen)


def _compare_entries(name: str, oracle: _Oracle, x: np.ndarray, entries: dict[int, float], step: float,
                     relative_step: bool, rtol: float, atol: float, model_desc: str,
                     kink_screen: KinkScreen | None = None) -> CheckRow:
    """The row of ``name``: each analytic entry (flat index -> value) against the oracle's
    difference quotient there."""
    errs: list[float] = []
    rels: list[float] = []
    mismatches: list[str] = []
    ok = True
    bad_analytic = bad_numeric = nonfinite = kinks = 0
    for k, analytic in entries.items():
        probe = _Probe(name, oracle, x, k, model_desc)
        h = step * max(1.0, abs(probe.x0)) if relative_step else step
        if kink_screen is not None and kink_screen.at_kink(probe, h):
            kinks += 1
            continue
        numeric = probe.central(h)
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
            if self.oracle.perturb is not None:
                point, feeds = self.oracle.perturb(self.name, self.k, offset)
            else:
                xp = self.flat.copy()
                xp[self.k] = xp[self.k] + xp.dtype.type(offset)
                point = float(xp[self.k])
                feeds = dict(self.oracle.base)
                feeds[self.name] = xp.reshape(self.shape)
            try:
                loss = self.oracle.loss_of(feeds)
            except Exception as exc:  # noqa: BLE001 - a runtime failing part-way through
                raise GradientError(f"cannot check {self.model_desc}: the "
                                    f"{_ORACLE_TEXT[self.oracle.kind]} failed perturbing "
                                    f"{self.name!r}: {type(exc).__name__}: {_short(exc)}") from exc
            self.values[offset] = (point, loss)
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
