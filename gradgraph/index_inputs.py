"""Graph inputs that hold indices, and the refusal of index values torch would refuse.

torch raises ``IndexError`` for a negative class label or embedding id, and for one past the
end; ONNX's Gather reads a negative index from the end and onnxruntime's loss kernels do not
check a target at all, so such data trained silently on the wrong rows. An input is an index
input when its values reach, unchanged (through Identity, Cast, Reshape, Squeeze, Unsqueeze,
Flatten, Transpose, Expand, Tile, Slice, Concat, or as the data of a Gather, GatherElements,
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
                           "GatherElements", "GatherND", "Compress"})


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


def _size(value: ir.Value | None, axis: int) -> int | None:
    if value is None or value.shape is None or not len(value.shape):
        return None
    dim = value.shape[axis % len(value.shape)]
    return dim if isinstance(dim, int) else None


def _use_of(node: ir.Node, index: int, negative_ok: bool) -> IndexUse | None:
    """The index use of ``node``'s input ``index``, or None where it is no index."""
    name = node.name or (node.outputs[0].name or "")
    if node.op_type in _GATHERS and index == 1:
        axis = node.attributes.get_int("axis", 0)
        return IndexUse(node.op_type, name, _size(node.inputs[0], axis), negative_ok=negative_ok)
    if node.op_type in _LOSSES and index == 1:
        ignore = node.attributes.get("ignore_index")
        return IndexUse(node.op_type, name, _size(node.inputs[0], 1),
                        ignore.as_int() if ignore is not None else None)
    return None


def index_uses(model: ir.Model | onnx.ModelProto) -> dict[str, list[IndexUse]]:
    """Graph input name -> where its values are used as indices (module docstring). Where a
    size is not known, shapes are inferred (into an IR model given, into a copy of a proto)."""
    model = ir.from_proto(model) if isinstance(model, onnx.ModelProto) else model
    found = _index_uses(model)
    if all(u.size is not None for uses in found.values() for u in uses):
        return found
    # onnx_ir's pass leaves the initializers out of onnx's inference: > 2 GB models too
    return _index_uses(common.ShapeInferencePass(strict_mode=False)(model).model)


def _index_uses(model: ir.Model) -> dict[str, list[IndexUse]]:
    negative_ok = str(model.metadata_props.get(ALLOW_NEGATIVE_KEY, "")).lower() in ("1", "true")
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
                use = _use_of(node, index, negative_ok)
                if use is not None:
                    found.setdefault(start.name or "", []).append(use)
                elif node.op_type in _PASS_THROUGH and (index == 0 or node.op_type == "Concat"):
                    for out in node.outputs[:1]:
                        if out not in seen:
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
