"""ReduceLossPass: make a non-scalar loss output a scalar, or refuse it.

1. a loss of one element (shape ``[]``, ``[1]``, ``[1, 1]`` ...) is left alone;
2. with ``reduction`` "sum" or "mean", the loss output is replaced by ``Reduce<Sum|Mean>`` of
   it under the same name (the original value is renamed ``<loss>_unreduced``);
3. otherwise a loss of known shape with more than one element is a :class:`GradientError`
   naming the loss, its shape and the ways out, the first of them to compute the loss in the
   model's forward (a model that outputs logits has no loss: ``--reduce mean`` would train the
   logits' mean). A loss of unknown shape is left to the runtime check of the session.
"""

from __future__ import annotations

import warnings

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff.engine import FLOAT_TYPES
from passes.autodiff.errors import GradientError

REDUCTIONS = {"sum": "ReduceSum", "mean": "ReduceMean"}


class ReduceLossPass(InPlacePass):
    def __init__(self, loss: str, reduction: str | None = None) -> None:
        super().__init__()
        if reduction is not None and reduction not in REDUCTIONS:
            raise GradientError(f"loss reduction must be one of {sorted(REDUCTIONS)} or None, "
                                f"not {reduction!r}")
        self.loss, self.reduction = loss, reduction

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        value = next((v for v in graph.outputs if v.name == self.loss), None)
        if value is None:
            value = next((o for n in graph for o in n.outputs if o.name == self.loss), None)
        if value is None:
            outputs = ", ".join(repr(v.name) for v in graph.outputs)
            kind = ("a graph input; the loss must be computed by the graph" if any(
                v.name == self.loss for v in graph.inputs) else "not a tensor of the graph")
            scalars = [v for v in graph.outputs if v.shape is not None and all(d == 1 for d in v.shape)]
            hint = "" if scalars or not graph.outputs else (
                "; none of them is a scalar: compute the loss in the model's forward and export again")
            raise GradientError(f"loss {self.loss!r} is {kind}; graph outputs are: {outputs}{hint}")
        if value.dtype is not None and value.dtype not in FLOAT_TYPES:
            raise GradientError(f"loss {self.loss!r} has type {value.dtype.name}; the loss must be a "
                                "floating-point tensor (float, float16, bfloat16 or double)")
        dims = list(value.shape) if value.shape is not None else None
        if dims is None or all(d == 1 for d in dims):  # unknown shape, or one element
            if self.reduction is not None and dims is not None:
                warnings.warn(f"loss reduction {self.reduction!r} changes nothing: the loss "
                              f"{self.loss!r} is already a scalar", UserWarning, stacklevel=3)
            return PassResult(model, False)
        if self.reduction is None:
            raise GradientError(
                f"loss {self.loss!r} has shape {[str(d) for d in dims]}, not a scalar. If it is no "
                "loss yet (logits, predictions), compute the loss in the model's forward (e.g. "
                "return F.cross_entropy(logits, labels)) and export again; if it is a per-sample "
                "loss, reduce it in the model, or ask for a reduction (--reduce sum|mean, "
                "loss_reduction='sum'|'mean'), or seed its gradient from an input "
                "(seed_from_input=True)")
        if value not in graph.outputs:
            raise GradientError(f"loss {self.loss!r}: a reduction applies to a graph output; reduce "
                                "the tensor in the model instead")
        node = ir.Node("", REDUCTIONS[self.reduction], [value], [ir.AttrInt64("keepdims", 0)],
                       name=f"{self.loss}/{REDUCTIONS[self.reduction]}")
        reduced = node.outputs[0]
        reduced.type, reduced.shape = value.type, ir.Shape([])
        graph.append(node)
        index = list(graph.outputs).index(value)
        value.name = f"{self.loss}_unreduced"
        reduced.name = self.loss
        graph.outputs[index] = reduced
        return PassResult(model, True)
