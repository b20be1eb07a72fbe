"""TorchOrtFactory's check of a call's tensors before onnxruntime runs (issue 36 §5).

onnxruntime reports a wrong rank or size with its own log line, and does not check what a loss
needs: a label batch of 6 against scores of 8 rows computed a loss from the first 6 rows; a
negative label or embedding id was read. Checked here, per call, naming the input:

1. the rank and the static sizes of each input, as the graph declares them (``RuntimeError``);
2. a symbolic size (``batch``) equal wherever the inputs share it, and a loss's labels
   against its scores (every size but the class axis: the batch), through the sizes shape
   inference gives the scores (``ValueError``, torch's ``Expected input batch_size (8) to
   match target batch_size (6)``);
3. index values (:mod:`gradgraph.index_inputs`: labels in ``[0, C)`` or the ignore_index,
   Gather ids in ``[0, n)``: ``IndexError``, as torch raises).
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir
import torch
from onnx_ir.passes import common

from gradgraph.feeds import InputError
from gradgraph.index_inputs import IndexCheck

_LOSSES = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
Dim = int | str | None  # a static size, a symbol, unknown


def _dims(value: ir.Value | None) -> list[Dim] | None:
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) else (d.value if isinstance(d, ir.SymbolicDim) else None)
            for d in value.shape]


class FeedCheck:
    """The checks of the module docstring for the graph inputs ``names`` of ``model`` (the
    user's graph, before the gradient; its shapes are inferred in place)."""

    def __init__(self, model: ir.Model, names: Sequence[str], owner: str) -> None:
        self.owner = owner
        self.names = list(names)
        inputs = {v.name: v for v in model.graph.inputs}
        self.declared = {n: _dims(inputs.get(n)) for n in self.names}
        self.index_check = IndexCheck(model)
        # a loss's labels against its scores: (label input, label axis, the scores' size there)
        self.pairs: list[tuple[str, int, Dim]] = []
        if not any(n.op_type in _LOSSES for n in model.graph):
            return
        # onnx_ir's pass leaves the initializers out of onnx's inference: > 2 GB models too
        for node in common.ShapeInferencePass(strict_mode=False)(model).model.graph:
            if node.op_type not in _LOSSES or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
                continue
            labels = node.inputs[1]
            scores = _dims(node.inputs[0])
            if labels is None or labels.name not in self.declared or scores is None:
                continue
            for axis in range(len(scores) - 1):
                self.pairs.append((labels.name, axis, scores[0 if axis == 0 else axis + 1]))

    def __call__(self, tensors: Sequence[torch.Tensor]) -> None:
        bound: dict[str, tuple[int, str]] = {}  # symbol -> (size, the input that set it)
        shapes = {}
        for name, tensor in zip(self.names, tensors):
            if not isinstance(tensor, torch.Tensor):
                continue
            shape = tuple(tensor.shape)
            shapes[name] = shape
            dims = self.declared.get(name)
            if dims is None:
                continue
            if len(shape) != len(dims):
                raise RuntimeError(f"{self.owner}: input {name!r} has shape {list(shape)}; the graph takes "
                                   f"rank {len(dims)} ({_text(dims)})")
            for axis, (size, dim) in enumerate(zip(shape, dims)):
                if isinstance(dim, int) and size != dim:
                    raise RuntimeError(f"{self.owner}: input {name!r} has shape {list(shape)}; the graph "
                                       f"takes size {dim} on axis {axis} ({_text(dims)})")
                if isinstance(dim, str):
                    seen = bound.setdefault(dim, (size, name))
                    if seen[0] != size:
                        raise ValueError(f"{self.owner}: input {name!r} has size {size} on axis {axis} and "
                                         f"input {seen[1]!r} {seen[0]} where the graph names both {dim!r} "
                                         "(a batch of labels unlike the inputs' batch?): give equal sizes")
        for name, axis, dim in self.pairs:
            want = dim if isinstance(dim, int) else bound.get(dim, (None, ""))[0] if isinstance(dim, str) else None
            if want is None or name not in shapes or axis >= len(shapes[name]):
                continue
            if shapes[name][axis] != want:
                what = "batch_size" if axis == 0 else f"size on axis {axis}"
                raise ValueError(f"{self.owner}: Expected input {what} ({want}) to match target {what} "
                                 f"({shapes[name][axis]}): the labels {name!r} have shape {list(shapes[name])}")
        if self.index_check.uses:
            feeds = {n: t.detach().cpu().numpy() for n, t in zip(self.names, tensors)
                     if n in self.index_check.uses and isinstance(t, torch.Tensor)}
            try:
                self.index_check(feeds, self.owner)
            except InputError as exc:
                raise IndexError(str(exc)) from None


def _text(dims: list[Dim]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"
