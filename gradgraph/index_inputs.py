"""Graph inputs that hold indices, and the refusal of index values torch would refuse.

torch raises ``IndexError`` for a negative class label or embedding id, and for one past the
end; ONNX's Gather reads a negative index from the end and onnxruntime's loss kernels do not
check a target at all, so such data trained silently on the wrong rows. An input is an index
input when its values reach, unchanged (through Identity, Cast, Reshape, Squeeze, Unsqueeze,
Flatten, Transpose, Expand, Tile, Slice, Concat, Pad (HF's causal-LM loss pads its labels with
-100 and shifts them), or as the data of a Gather, GatherElements,
GatherND or Compress: a training graph's loss reads the labels of the rows it does not
ignore), one of:

1. the ``indices`` of a Gather or GatherElements (embedding ids, ``torch.gather``): valid are
   ``0 <= i < n``, ``n`` the data's size on the gathered axis;
2. the ``target`` of a SoftmaxCrossEntropyLoss or NegativeLogLikelihoodLoss (class labels):
   valid are ``0 <= i < C``, ``C`` the scores' size on axis 1, and the loss's
   ``ignore_index`` (torch's ``-100`` in its exports).

An upper bound is checked where the size is static. A model built by hand that means ONNX's
negative Gather / GatherElements indices opts in with the model metadata property
:data:`ALLOW_NEGATIVE_KEY` set to ``"true"``: then ``-n <= i < n`` is valid there (a loss
target never wraps). Only the main graph is searched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import common

from gradgraph.feeds import InputError

ALLOW_NEGATIVE_KEY = "gradgraph.allow_negative_indices"
_GATHERS = frozenset({"Gather", "GatherElements"})
_LOSSES = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
# ops whose output holds (some of) the values of their first input (Concat: of every input)
_PASS_THROUGH = frozenset({"Identity", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Flatten",
                           "Transpose", "Expand", "Tile", "Slice", "Concat", "Gather",
                           "GatherElements", "GatherND", "Compress", "Pad"})


@dataclasses.dataclass(frozen=True)
class IndexUse:
    """One place an input's values are used as indices."""

    op_type: str
    node: str
    size: int | None  # the indexed size, when static
    ignore_index: int | None = None
    negative_ok: bool = False  # -size <= i < 0 allowed (the model opted in; Gather only)

    @property
    def what(self) -> str:
        kind = "class labels" if self.op_type in _LOSSES else "indices"
        return f"{kind} of {self.op_type} {self.node!r}"

    def valid_text(self) -> str:
        low = f"-{self.size}" if self.negative_ok and self.size is not None else "0"
        high = f"{self.size}" if self.size is not None else "its size"
        text = f"[{low}, {high})"
        if self.ignore_index is not None:
            text += f" or ignore_index {self.ignore_index}"
        return text

    def bad(self, array: np.ndarray) -> np.ndarray:
        """A boolean array: where ``array`` holds an invalid value."""
        low = -self.size if self.negative_ok and self.size is not None else (None if self.negative_ok else 0)
        bad = np.zeros(array.shape, bool)
        if low is not None:
            bad |= array < low
        if self.size is not None:
            bad |= array >= self.size
        if self.ignore_index is not None:
            bad &= array != self.ignore_index
        return bad


def _static(dims: list[int | None] | None, axis: int) -> int | None:
    if not dims:
        return None
    return dims[axis % len(dims)]


def _use_of(op_type: str, name: str, index: int, attrs: Mapping[str, int],
            data: list[int | None] | None, negative_ok: bool) -> IndexUse | None:
    """The index use of input ``index`` of a node (``attrs``: its int attributes; ``data``: the
    dims of its first input, None for unknown ones), or None where it is no index."""
    if op_type in _GATHERS and index == 1:
        return IndexUse(op_type, name, _static(data, attrs.get("axis", 0)), negative_ok=negative_ok)
    if op_type in _LOSSES and index == 1:
        return IndexUse(op_type, name, _static(data, 1), attrs.get("ignore_index"))
    return None


def index_uses(model: ir.Model | onnx.ModelProto) -> dict[str, list[IndexUse]]:
    """Graph input name -> where its values are used as indices (module docstring). Where a
    size is not known, shapes are inferred (into an IR model given, into a copy of a proto).
    A ModelProto is searched as it is (a training graph's: no IR copy of its thousands of nodes
    is made, 0.5 s of GPT-2 small's setup)."""
    found = _proto_index_uses(model) if isinstance(model, onnx.ModelProto) else _index_uses(model)
    if all(u.size is not None for uses in found.values() for u in uses):
        return found
    model = ir.from_proto(model) if isinstance(model, onnx.ModelProto) else model
    # onnx_ir's pass leaves the initializers out of onnx's inference: > 2 GB models too
    return _index_uses(common.ShapeInferencePass(strict_mode=False)(model).model)


def _allows_negative(props: Mapping[str, str]) -> bool:
    return str(props.get(ALLOW_NEGATIVE_KEY, "")).lower() in ("1", "true")


def _index_uses(model: ir.Model) -> dict[str, list[IndexUse]]:
    negative_ok = _allows_negative(model.metadata_props)
    found: dict[str, list[IndexUse]] = {}
    for start in model.graph.inputs:
        if start.dtype is None or not start.dtype.is_integer():
            continue
        seen, todo = {start}, [start]
        while todo:
            value = todo.pop()
            for node, index in value.uses():
                if node.domain not in ("", "ai.onnx"):
                    continue
                data = node.inputs[0] if node.inputs else None
                dims = None if data is None or data.shape is None else [
                    d if isinstance(d, int) else None for d in data.shape]
                attrs = {a.name: a.as_int() for a in node.attributes.values()
                         if a.type == ir.AttributeType.INT}
                use = _use_of(node.op_type, node.name or (node.outputs[0].name or ""), index, attrs,
                              dims, negative_ok)
                if use is not None:
                    found.setdefault(start.name or "", []).append(use)
                elif node.op_type in _PASS_THROUGH and (index == 0 or node.op_type == "Concat"):
                    for out in node.outputs[:1]:
                        if out not in seen:
                            seen.add(out)
                            todo.append(out)
    return found


def _proto_index_uses(model: onnx.ModelProto) -> dict[str, list[IndexUse]]:
    """:func:`_index_uses` on a ModelProto's main graph, by value names."""
    graph = model.graph
    negative_ok = _allows_negative({p.key: p.value for p in model.metadata_props})
    dims: dict[str, list[int | None]] = {t.name: list(t.dims) for t in graph.initializer}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            dims[info.name] = [d.dim_value if d.HasField("dim_value") else None
                               for d in info.type.tensor_type.shape.dim]
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name:
                uses.setdefault(name, []).append((node, index))
    found: dict[str, list[IndexUse]] = {}
    for start in graph.input:
        elem = start.type.tensor_type.elem_type if start.type.HasField("tensor_type") else 0
        if not elem or not ir.DataType(elem).is_integer():
            continue
        seen, todo = {start.name}, [start.name]
        while todo:
            for node, index in uses.get(todo.pop(), []):
                if node.domain not in ("", "ai.onnx"):
                    continue
                attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
                use = _use_of(node.op_type, node.name or (node.output[0] if node.output else ""), index,
                              attrs, dims.get(node.input[0]) if node.input else None, negative_ok)
                if use is not None:
                    found.setdefault(start.name, []).append(use)
                elif node.op_type in _PASS_THROUGH and (index == 0 or node.op_type == "Concat"):
                    for out in node.output[:1]:
                        if out and out not in seen:
                            seen.add(out)
                            todo.append(out)
    return found


def refuse_bad_indices(uses: Mapping[str, list[IndexUse]], feeds: Mapping[str, object],
                       source: str) -> None:
    """Raise :class:`InputError` at the first index value of ``feeds`` that torch refuses,
    naming ``source``, the input, the value and its position (see the module docstring)."""
    for name, where in uses.items():
        if name not in feeds:
            continue
        array = np.asarray(feeds[name])
        if array.dtype.kind not in "iu":
            continue
        for use in where:
            bad = use.bad(array)
            if bad.any():
                position = tuple(int(i) for i in np.argwhere(bad)[0])
                value = array[position]
                opt_in = (f"; a model meant for ONNX's negative indices sets the metadata property "
                          f"{ALLOW_NEGATIVE_KEY}=true" if use.op_type in _GATHERS and value < 0
                          and not use.negative_ok else "")
                raise InputError(f"{source}: input {name!r} holds {value} at position "
                                 f"{list(position)}; as {use.what} it must be in {use.valid_text()} "
                                 f"(torch raises IndexError){opt_in}")


class IndexCheck:
    """:func:`refuse_bad_indices` for the index inputs of one or more models (a training
    session's graphs), found once."""

    def __init__(self, *models: ir.Model | onnx.ModelProto) -> None:
        self.uses: dict[str, list[IndexUse]] = {}
        for model in models:
            for name, uses in index_uses(model).items():
                known = self.uses.setdefault(name, [])
                known += [u for u in uses if u not in known]

    def __call__(self, feeds: Mapping[str, object], source: str) -> None:
        if self.uses:
            refuse_bad_indices(self.uses, feeds, source)
