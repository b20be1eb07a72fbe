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

The package: :mod:`gradgraph.check.oracles` (the oracles, their steps and tolerances),
:mod:`gradgraph.check.compare` (the entry-by-entry comparison and kink screen),
:mod:`gradgraph.check.draws` (random draws held fixed), :mod:`gradgraph.check.report` (what is
reported); this module is the check itself and the public names.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import PassError

from gradgraph.api import build_gradient_graph
from gradgraph.check.compare import (
    KinkScreen,
    _check_one,
    _Probe,
    _validate,
    compare_with_central_differences,
)
from gradgraph.check.draws import freeze_random_draws
from gradgraph.check.large import skeleton
from gradgraph.check.oracles import (
    _NP_OF,
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
    REFERENCE_AGREEMENT,
    REFERENCE_MAX_SECONDS,
    REFERENCE_MAX_VALUES,
    _as_double,
    _describe_failure,
    _options,
    _Oracle,
    _ort_loss,
    _reference_loss,
    _session,
    _short,
    low_precision_of,
    random_inputs,
)
from gradgraph.check.report import (
    _ORACLE_TEXT,
    ORACLE_FLOAT32_ORT,
    ORACLE_FLOAT64_ORT,
    ORACLE_FLOAT64_REFERENCE,
    RESULT_FAIL,
    RESULT_OK,
    RESULT_SKIPPED,
    CheckReport,
    CheckRow,
)
from gradgraph.feeds import NP_OF_ORT, InputError, check_feeds, unshaped_inputs
from gradgraph.index_inputs import IndexCheck
from gradgraph.io import load_model
from gradgraph.runtime.external import inference_session, is_large
from gradgraph.runtime.reference_kernels import REFERENCE_OVERRIDES
from passes.autodiff import GradientError
from passes.forward.prepare import PrepareForGradientPass
from passes.forward.reduce_loss import ReduceLossPass
from passes.marks import GRADIENT_OF_KEY

__all__ = [
    "FLOAT32_ATOL", "FLOAT32_EPS", "FLOAT32_RTOL", "FLOAT64_ATOL", "FLOAT64_EPS", "FLOAT64_RTOL",
    "KINK_ATOL", "KINK_RTOL", "LARGE_STEP", "LOW_PRECISION_TOL", "ORACLE_FLOAT32_ORT",
    "ORACLE_FLOAT64_ORT", "ORACLE_FLOAT64_REFERENCE", "REFERENCE_AGREEMENT", "REFERENCE_MAX_SECONDS",
    "REFERENCE_MAX_VALUES", "REFERENCE_OVERRIDES", "RESULT_FAIL", "RESULT_OK", "RESULT_SKIPPED",
    "CheckReport", "CheckRow", "KinkScreen", "compare_with_central_differences", "gradcheck",
    "low_precision_of", "random_inputs",
    # internals the check's tests reach (patch them in gradgraph.check.oracles, where they are read)
    "_NP_OF", "_ORACLE_TEXT", "_Oracle", "_Probe", "_as_double", "_check_one", "_describe_failure",
    "_ort_loss", "_reference_loss", "_session", "_short",
]


def _unwrap_pass_error(exc: PassError, model_desc: str) -> GradientError:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, GradientError):
            return cause
        cause = cause.__cause__
    root = exc.__cause__ or exc
    return GradientError(f"cannot prepare {model_desc} for the check: {type(root).__name__}: {_short(root)}")


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
    large = is_large(prepared)  # its weights never go into a protobuf (gradgraph.check.large)
    given = skeleton(prepared) if large else ir.to_proto(prepared)
    feeds = dict(inputs) if inputs is not None else random_inputs(given, seed)
    names = [i.name for i in given.graph.input]
    extra = sorted(set(feeds) - set(names))
    if extra:
        raise InputError(f"the inputs given hold {extra}, which {'is' if len(extra) == 1 else 'are'} "
                         f"not an input of {model_desc}; its inputs are {names}")
    if inputs is not None:  # torch's IndexError for a negative or out-of-range label or id
        IndexCheck(prepared)(feeds, "the inputs given")
    # a random draw is made once and fed to both sides (gradgraph.check.draws)
    draws, notes = freeze_random_draws(prepared, feeds, seed, model_desc)
    feeds.update(draws)
    forward: onnx.ModelProto | ir.Model = prepared if large else ir.to_proto(prepared) if draws else given
    try:
        grad_ir = build_gradient_graph(forward, loss, weights, as_ir=True) if large else None
        grad_model = skeleton(grad_ir) if grad_ir is not None else build_gradient_graph(forward, loss, weights)
    except PassError as exc:
        raise _unwrap_pass_error(exc, model_desc) from exc
    # the gradient outputs, found by their mark (passes.marks), and the names they belong to
    marked = [(o.name, p.value) for o in grad_model.graph.output for p in o.metadata_props
              if p.key == GRADIENT_OF_KEY]
    grad_names = [g for g, _ in marked]
    trained = [w for _, w in marked]
    try:
        grad_session = _session(grad_model) if grad_ir is None else inference_session(
            grad_ir, _options(large=True), providers=["CPUExecutionProvider"])
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
    del grad_session  # its arena goes back before the oracle's grows (the size of a large model's run)

    where = ("at the inputs given" if inputs is not None else
             f"at random inputs (standard normal floats, integers 0 or 1, seed {seed})")
    # the arrays leave ``analytic``: compare_with_central_differences lets a large model's go
    # once it has read the entries it compares
    report = compare_with_central_differences(
        forward, loss, {w: analytic.pop(g) for g, w in zip(grad_names, trained)}, feeds, eps=eps,
        rtol=rtol, atol=atol, max_elements=max_elements, seed=seed, model_desc=model_desc,
        inputs_text=where)
    return dataclasses.replace(report, notes=tuple(notes))
