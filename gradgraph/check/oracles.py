"""The numeric side of the check: which oracle computes the loss, and how (see
:mod:`gradgraph.check`): the float64 copy of the forward model in onnxruntime or in the ONNX
reference evaluator, else the float32 model in onnxruntime; their steps and tolerances, and the
one-line reasons onnxruntime's failures are reported with."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx.reference import ReferenceEvaluator

from gradgraph.check.report import (
    ORACLE_FLOAT32_ORT,
    ORACLE_FLOAT64_ORT,
    ORACLE_FLOAT64_REFERENCE,
)
from gradgraph.runtime.reference_kernels import REFERENCE_OVERRIDES
from passes.autodiff import GradientError
from passes.forward.to_double import ToDoublePass

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


def _options(large: bool = False) -> ort.SessionOptions:
    """The check's session options: its sessions run the graphs as they are, on 2 threads.
    ``large`` (a model over the external-data threshold): without onnxruntime's memory pattern,
    which, from the second run on, asks its arena for one block of all of a run's intermediates
    beside what the first run left there (the float64 oracle of tests/test_large_models.py's
    2.2 GB model peaked at 11.6 GB with it, 6.9 GB without, at the same speed)."""
    opts = ort.SessionOptions()
    opts.enable_mem_pattern = not large
    opts.log_severity_level = 4  # fatal only: a missing kernel is reported by the check itself
    opts.intra_op_num_threads = 2
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return opts


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), _options(), providers=["CPUExecutionProvider"])


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


# ---- oracles -----------------------------------------------------------------------------------


Runner = Callable[[Mapping[str, np.ndarray]], float]


@dataclasses.dataclass
class _Oracle:
    kind: str
    reason: str
    loss_of: Runner
    base: dict[str, np.ndarray]  # feeds and trained values, in the oracle's dtypes
    f0: float
    # (name, flat index, offset) -> (the point taken, the feeds there); None: the entry is set
    # in a copy of the name's array in ``base`` (gradgraph.check.large sets it by an input)
    perturb: Callable[[str, int, float], tuple[float, dict[str, np.ndarray]]] | None = None


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
