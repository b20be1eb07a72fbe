"""make_batch_dynamic: a model exported at a fixed batch, made to run at any batch size, verified.

``DynamicBatchPass`` (``passes/batching``) makes the batch symbolic and rewrites the constants
that bake it in; this module then checks the result in onnxruntime (CPU) before handing it out:

1. at the export batch B, on random inputs, every output equals the original model's
   (rtol 1e-5, atol 1e-6; integer and bool outputs exactly);
2. at batch 1 and 2B+1 it runs, every output has the shape its declaration promises (the
   batch dim scaled, static dims unchanged) and every float output that was finite at B is
   finite;
3. at batch 2B with every row given twice, each output with one row per batch entry equals the
   batch-B output given twice (rows stay independent of the batch size).
Steps 1 and 3 compare values only for graphs without random ops (active Dropout, Random*).

Random inputs: floats standard normal; integers in [0, bound) where bound is the smallest size
that the input indexes (Gather / GatherElements data along the axis, the classes of
SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss, OneHot depth), found through value-preserving
ops, else 2; bools fair coins; symbolic dims other than the batch are 2.

An export at batch 1 is converted with a warning: there a batch of 1 cannot always be told from
other sizes of 1, and torch.export drops a division by the batch size (``x.sum() / x.shape[0]``
becomes a plain sum); the checks above cannot tell a sum from a mean.

Anything that fails (the pass refuses or fails, or a check above) raises one
:class:`GradientError` with :data:`BATCH_ERROR`, which names the batched inputs and how to export
them with a dynamic batch.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from gradgraph.io import load_model, model_proto
from gradgraph.runtime import external
from passes.autodiff.errors import GradientError, unwrap_pass_errors
from passes.batching import BATCH_ERROR, DynamicBatchPass, batch_error, select_batch_inputs
from passes.cleanup import RANDOM_OPS

__all__ = ["BATCH_ERROR", "batch_dynamic_ir", "make_batch_dynamic"]

_VALUE_PRESERVING = frozenset({"Cast", "Concat", "Expand", "Flatten", "Identity", "Reshape",
                               "SequenceAt", "Slice", "Split", "SplitToSequence", "Squeeze", "Tile",
                               "Transpose", "Unsqueeze"})
_RTOL, _ATOL = 1e-5, 1e-6


def make_batch_dynamic(
    model: onnx.ModelProto | ir.Model | bytes | str | os.PathLike,
    batch_inputs: Sequence[str] | None = None,
    *,
    dim_name: str = "batch",
    seed: int = 0,
) -> onnx.ModelProto:
    """The model with a symbolic batch ``dim_name`` on its batched inputs (see
    ``passes.batching.dynamic_batch`` for which inputs and which constants), verified at three
    batch sizes. A model without a static batch is returned unchanged."""
    return model_proto(batch_dynamic_ir(model, batch_inputs, dim_name=dim_name, seed=seed))


def batch_dynamic_ir(
    model: onnx.ModelProto | ir.Model | bytes | str | os.PathLike,
    batch_inputs: Sequence[str] | None = None,
    *,
    dim_name: str = "batch",
    seed: int = 0,
) -> ir.Model:
    """:func:`make_batch_dynamic` as an ``onnx_ir.Model``: the tensors are the loaded model's
    (a model over 1 GiB keeps them in its external data files; no ModelProto holds them)."""
    working = load_model(model)  # a copy: the caller's model is never edited
    original = working.clone(deep_copy=True)  # the graph copied, the tensors shared
    size, chosen = select_batch_inputs(working.graph, batch_inputs)
    names = [v.name or "" for v in chosen]
    try:
        result = DynamicBatchPass(batch_inputs, dim_name)(working)
    except Exception as exc:  # noqa: BLE001 - onnx_ir wraps what passes raise; a user gets one error
        error = unwrap_pass_errors(exc)
        if isinstance(error, GradientError):
            raise error from None
        raise batch_error(names, f"the batch analysis failed ({type(exc).__name__}: {exc})") from exc
    if result.modified and size == 1:
        warnings.warn(f"{names} were exported with batch 1, where the batch cannot always be told from "
                      "other sizes of 1 (torch.export drops a division by the batch size, x / 1): "
                      "export with a batch of 2 or more, or with a dynamic batch", stacklevel=2)
    if result.modified:
        _Verifier(original, working, names, size, dim_name, seed).run()
    return working


def _dims(value: ir.Value) -> list[int | str] | None:
    """A value's declared dims: ints, symbolic names ("" when unnamed: 0 as in a proto), None
    without a shape."""
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else (d.value or 0) for d in value.shape]  # type: ignore[misc]


class _Verifier:
    def __init__(self, original: ir.Model, dynamic: ir.Model, names: list[str], size: int,
                 dim_name: str, seed: int) -> None:
        self.names, self.size, self.dim_name = names, size, dim_name
        self.rng = np.random.default_rng(seed)
        self.original, self.dynamic = _session(original, names), _session(dynamic, names)
        graph = dynamic.graph
        self.inputs = [v for v in graph.inputs if not v.is_initializer()]
        self.bounds = {v.name: _index_bound(v) for v in self.inputs}
        self.outputs = [(o.name, _dims(o)) for o in graph.outputs]
        self.random = any(_is_random(n) for n in graph)

    def fail(self, reason: str) -> GradientError:
        return batch_error(self.names, f"the rewritten model was checked in onnxruntime and {reason}")

    def run(self) -> None:
        feeds = self.feeds(self.size)
        reference = self.original.run(None, feeds)
        at_size = self.run_at(feeds, self.size)
        if not self.random:
            for (name, _), want, got in zip(self.outputs, reference, at_size):
                if not _close(want, got):
                    raise self.fail(f"output {name!r} differs from the original model's at the export "
                                    f"batch {self.size}")
        finite = [not _is_float(r) or bool(np.isfinite(r).all()) for r in reference]
        for batch in (1, 2 * self.size + 1):
            for (name, _), ok, got in zip(self.outputs, finite, self.run_at(self.feeds(batch), batch)):
                if ok and _is_float(got) and not np.isfinite(got).all():
                    raise self.fail(f"output {name!r} is not finite at batch {batch}")
        if self.random:
            return
        doubled = {k: np.concatenate([v, v]) if k in self.names else v for k, v in feeds.items()}
        for (name, dims), once, twice in zip(self.outputs, at_size, self.run_at(doubled, 2 * self.size)):
            if dims and dims[0] == self.dim_name and not _close(np.concatenate([once, once]), twice, 1e-4):
                raise self.fail(f"the rows of output {name!r} change when every input row is given twice "
                                "(the batch is mixed into other dimensions)")

    def run_at(self, feeds: dict[str, np.ndarray], batch: int) -> list[Any]:
        try:
            outputs = self.dynamic.run(None, feeds)
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises several types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise self.fail(f"fails at batch {batch}: {first}") from None
        for (name, dims), out in zip(self.outputs, outputs):
            want = None if dims is None else [self.expected(d, batch) for d in dims]
            shape = list(np.shape(out))
            if want is not None and (len(want) != len(shape)
                                     or any(w is not None and w != s for w, s in zip(want, shape))):
                raise self.fail(f"output {name!r} has shape {shape} at batch {batch}, not {want}")
        return list(outputs)

    def expected(self, dim: int | str, batch: int) -> int | None:
        if isinstance(dim, int):
            return dim or None
        if dim == self.dim_name:
            return batch
        head, _, factor = dim.partition("*")
        return batch * int(factor) if head == self.dim_name and factor.isdigit() else None

    def feeds(self, batch: int) -> dict[str, np.ndarray]:
        feeds = {}
        for value in self.inputs:
            dims = [batch if isinstance(d, ir.SymbolicDim) and d.value == self.dim_name
                    else d if isinstance(d, int) else 2 for d in (value.shape or [])]
            dtype = (value.dtype or ir.DataType.FLOAT).numpy()
            if dtype.kind == "f":
                array = self.rng.standard_normal(dims).astype(dtype)
            elif dtype.kind == "b":
                array = self.rng.random(dims) < 0.5
            else:
                array = self.rng.integers(0, self.bounds[value.name], dims).astype(dtype)
            feeds[value.name or ""] = array
        return feeds


def _session(model: ir.Model, names: list[str]) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 4  # failures are raised and reported by us, not logged twice
    try:  # the weights injected as OrtValues over the model's arrays (no 2 GB protobuf)
        return external.inference_session(model, options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001
        raise batch_error(names, f"onnxruntime cannot load the model ({exc})") from None


def _index_bound(value: ir.Value) -> int:
    """The smallest size the integer input ``value`` indexes, else 2 (see the module docstring)."""
    bounds: list[object] = []
    stack, seen = [value], set()
    while stack:
        current = stack.pop()
        for node, index in ((u.node, u.idx) for u in current.uses()):
            if id(node) in seen:
                continue
            seen.add(id(node))
            data = node.inputs[0]
            dims = list(data.shape) if data is not None and data.shape is not None else []
            if node.op_type in ("Gather", "GatherElements") and index == 1 and dims:
                bounds.append(dims[node.attributes.get_int("axis", 0) % len(dims)])
            elif node.op_type in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss") and index == 1:
                bounds.append(dims[1] if len(dims) > 1 else None)
            elif node.op_type == "OneHot" and index == 0:
                depth = ir.convenience.get_const_tensor(node.inputs[1]) if node.inputs[1] else None
                bounds.append(int(depth.numpy().reshape(-1)[0]) if depth is not None else None)
            elif node.op_type in _VALUE_PRESERVING and (index == 0 or node.op_type == "Concat"):
                stack.extend(node.outputs)
    sizes = [b for b in bounds if isinstance(b, int) and b > 0]
    return min(sizes) if sizes else 2


def _is_random(node: ir.Node) -> bool:
    if node.op_type in RANDOM_OPS:
        return True
    if node.op_type != "Dropout" or len(node.inputs) < 3 or node.inputs[2] is None:
        return False
    mode = ir.convenience.get_const_tensor(node.inputs[2])
    return mode is None or bool(mode.numpy().any())


def _is_float(array: Any) -> bool:
    return isinstance(array, np.ndarray) and array.dtype.kind == "f"


def _close(want: Any, got: Any, rtol: float = _RTOL) -> bool:
    want, got = np.asarray(want), np.asarray(got)
    if want.shape != got.shape:
        return False
    if want.dtype.kind != "f":
        return bool(np.array_equal(want, got))
    return bool(np.allclose(got, want, rtol=rtol, atol=_ATOL, equal_nan=True))
