"""ORTModule's check of index inputs before onnxruntime runs (issue 36 §5).

torch raises for an embedding id, a class label or a ``torch.gather`` index out of range,
negative ones included; ONNX's Gather reads a negative index from the end and onnxruntime's
loss kernels do not check a target, so such a call trained silently on the wrong rows. The
graph's index inputs are found once per signature (:func:`gradgraph.index_inputs.index_uses`
on the exported graph); a call whose index values torch may refuse runs in PyTorch instead of
onnxruntime: torch raises its own exception (``IndexError``, ``RuntimeError``), its message
followed by the input's name, the value and the valid range; where torch accepts the values
(``x[idx]`` reads a negative index from the end, as ONNX's Gather does) the call's result is
PyTorch's. Index values that reach a Gather through arithmetic (``ids + 1``) are not followed.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
from torch.utils import _pytree as pytree

from gradgraph.index_inputs import IndexUse, index_uses
from passes.exports.signature import FX_NODE_KEY

# aten calls whose Gather reads a negative index from the end, as torch does (advanced indexing)
_WRAPPING = ("aten.index.Tensor", "aten.index_put", "aten._unsafe_index")
_INPUT = re.compile(r"^input_(\d+)$")


@dataclasses.dataclass(frozen=True)
class BadIndex:
    """One index value torch may refuse: the call's input, the value, where, the valid range."""

    input: str
    value: int
    position: list[int]
    valid: str

    def note(self) -> str:
        return (f"(ORTModule: input {self.input} holds {self.value} at position {self.position}, "
                f"outside {self.valid}; checked before onnxruntime ran, the call ran in PyTorch)")


class IndexGuard:
    """The flat tensor inputs of one signature's graph that hold indices, and their check."""

    def __init__(self, model: onnx.ModelProto) -> None:
        wraps = {n.name for n in model.graph.node if n.op_type == "Gather" and any(
            p.key == FX_NODE_KEY and any(t in p.value for t in _WRAPPING) for p in n.metadata_props)}
        self.uses: dict[int, list[IndexUse]] = {}
        for name, uses in index_uses(model).items():
            match = _INPUT.match(name)
            if match:
                self.uses[int(match.group(1))] = [
                    dataclasses.replace(u, negative_ok=True) if u.op_type == "Gather" and u.node in wraps else u
                    for u in uses]

    def __bool__(self) -> bool:
        return bool(self.uses)

    def find(self, tensors: list[torch.Tensor], describe: Callable[[int], str]) -> BadIndex | None:
        """The first index value of ``tensors`` (the call's flat tensor inputs) outside its valid
        range, or None. ``describe(k)`` names the k-th input for the message."""
        for k, uses in self.uses.items():
            if k >= len(tensors) or tensors[k].is_floating_point() or tensors[k].dtype == torch.bool:
                continue
            array = tensors[k].detach().cpu().numpy()
            for use in uses:
                bad = use.bad(array)
                if bad.any():
                    position = [int(i) for i in np.argwhere(bad)[0]]
                    return BadIndex(describe(k), int(array[tuple(position)]), position, use.valid_text())
        return None


def run_checked_in_torch(run: Callable[[], Any], bad: BadIndex) -> Any:
    """``run()`` (the call in PyTorch); an exception it raises gets ``bad``'s note appended to
    its message, its type kept."""
    try:
        return run()
    except Exception as exc:
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (f"{exc.args[0]} {bad.note()}", *exc.args[1:])
        raise


def input_describer(forward: Callable, args: tuple, kwargs: dict) -> Callable[[int], str]:
    """Names for the flat tensor inputs of ``forward(*args, **kwargs)`` (ORTModule's order:
    ``(args, kwargs)`` flattened by torch's pytree): the parameter's name and the path inside it
    (``'labels'``, ``"batch['ids']"``)."""
    try:
        positional = [p.name for p in inspect.signature(forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        positional = []

    def describe(k: int) -> str:
        leaves = [path for path, leaf in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]
                  if isinstance(leaf, torch.Tensor)]
        if k >= len(leaves) or len(leaves[k]) < 2:
            return f"#{k}"
        (part, key, *rest) = leaves[k]
        index = getattr(key, "idx", None)
        name = getattr(key, "key", None)
        if part == pytree.SequenceKey(0) and isinstance(index, int):
            name = positional[index] if index < len(positional) else f"args[{index}]"
        return repr(f"{name}{pytree.keystr(tuple(rest))}")

    return describe
