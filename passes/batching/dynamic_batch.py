"""DynamicBatchPass: make the fixed batch dimension of a model's inputs symbolic.

Which graph inputs are batched (B is the static leading size they share):
1. ``batch_inputs`` given: exactly those inputs; each needs rank >= 1 and the same static
   leading size.
2. Otherwise the candidates are the inputs a dynamo export marks ``USER_INPUT`` (value metadata
   ``pkg.torch.export.graph_signature.InputSpec.kind``), or every non-initializer graph input
   when none is marked. Among candidates of rank >= 1 with a static leading size, B is the most
   common leading size (a tie goes to the earliest input) and exactly the candidates whose
   leading size is B are batched.
3. No such candidate (e.g. the batch is symbolic already): nothing changes (``modified=False``).

The graph is sorted and shapes are inferred at B (on a copy whose constant-only nodes are
folded). An analysis then walks the graph in order and records for each value the axis holding
the batch (an axis of k*N entries when a reshape merged the batch with other dims, e.g. [N, 6, 8]
-> [6N, 8] or [L, N, E] -> [L*N, E]), or that the value is batch-free, or "unknown" after ops it
does not model; and which entries of shape tensors computed by ``Shape`` hold N. Constants
holding B are rewritten by their role, never by their value alone (a hidden size equal to B
stays):
1. Reshape / Flatten of a batched value: the target entry of the dim that receives the batch
   rows becomes 0 (``allowzero=0``, same axis and layout), else -1 (no other -1), else
   ``Concat(..., N*k, ...)``. A constant target that splits the rows across dims
   (``x.reshape(2, -1)``) is refused.
2. A batch-free value meeting a batched one on the batch axis (broadcasting ops, Concat, MatMul,
   Gemm's C, the initial states of LSTM/GRU/RNN, the indices of Gather/GatherND into the batch
   axis, the data of GatherElements / ScatterElements, a graph output with leading size B) is
   traced back through elementwise ops, Cast, Transpose, (Un)squeeze, Concat, Slice (of other
   axes), Gather and Expand (to ``u`` when the shape is ``Shape(u)``) to where it comes from,
   which is rewritten: an Expand / ConstantOfShape / Tile shape entry or a
   Range limit (start 0, step 1) becomes N*k; a constant (initializer or Constant) whose slices
   along that axis are all equal becomes its first slice (broadcast, or expanded to N); an
   integer constant whose slices are C0 + b*D (batch indices, a folded ``arange``) becomes
   C0 + arange(N)*D. Anything else is refused (a per-row parameter of shape [B, ...]).
3. An Expand shape entry facing a batched data axis becomes 1.
4. Slice over the batch axis with start 0, step 1 and end k*B: the end becomes INT64_MAX; other
   starts/ends holding k*B there are refused. Slices of other axes are kept.
5. Resize ``sizes``: the batch entry becomes N*k.
6. Mean losses: ``Div(s, c)`` (or ``Mul(s, 1/c)``) where ``s`` sums over the batch axis
   (ReduceSum, ReduceSumSquare, ReduceL1, a loss with ``reduction="sum"``) and ``c`` is B, k*B or
   the number of summed elements: ``c`` becomes ``N*c/B``. ReduceMean needs nothing.
7. Refused rather than guessed: a shape-like argument holding B (Reshape, Expand, Tile, Slice,
   Resize) of a value whose batch is unknown, and a small integer constant holding B fed to an
   op the analysis does not model together with a batched or unknown value.
Finally the batched inputs' leading dim becomes ``dim_name``; batched values get ``dim_name``
(or ``"dim_name*k"``) on their batch axis; values whose batch is unknown lose their shape.
A refusal raises :class:`GradientError` with :data:`BATCH_ERROR`.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnx_ir.passes.common import TopologicalSortPass

from passes.autodiff.errors import GradientError
from passes.batching.emit import Emitter
from passes.batching.op_rules import Analysis
from passes.batching.state import UNKNOWN, Refusal, leading
from passes.shapes import infer_missing_shapes

USER_INPUT_KEY = "pkg.torch.export.graph_signature.InputSpec.kind"

BATCH_ERROR = (
    "cannot make the batch dimension of model input(s) {inputs} dynamic: {reason}. Export the "
    "model with a dynamic batch instead: with the dynamo exporter, batch = "
    "torch.export.Dim(\"batch\"); torch.onnx.export(model, args, path, "
    "dynamic_shapes={dynamic_shapes}); with dynamo=False, torch.onnx.export(model, args, path, "
    "input_names=[...], dynamic_axes={dynamic_axes})"
)


def batch_error(inputs: Sequence[str], reason: str) -> GradientError:
    """The one documented refusal: names the inputs and how to export them with a dynamic batch."""
    shapes = "{" + ", ".join(f"{n!r}: {{0: batch}}" for n in inputs) + "}"
    axes = "{" + ", ".join(f"{n!r}: {{0: 'batch'}}" for n in inputs) + "}"
    return GradientError(BATCH_ERROR.format(inputs=", ".join(repr(n) for n in inputs), reason=reason,
                                            dynamic_shapes=shapes, dynamic_axes=axes))


def select_batch_inputs(graph: ir.Graph, names: Sequence[str] | None = None) -> tuple[int, list[ir.Value]]:
    """(B, batched inputs) by the numbered rule above; (0, []) when no input has a static batch."""
    inputs = [v for v in graph.inputs if not v.is_initializer()]
    if names is not None:
        by_name = {v.name: v for v in inputs}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise batch_error(list(names), f"{missing} are not graph inputs (inputs: {list(by_name)})")
        sizes = {leading(by_name[n]) for n in names}
        if len(sizes) != 1 or None in sizes:
            raise batch_error(list(names), f"their leading dimensions are not one static size ({sizes})")
        return int(sizes.pop() or 0), [by_name[n] for n in names]
    marked = [v for v in inputs if v.metadata_props.get(USER_INPUT_KEY) == "USER_INPUT"]
    candidates = [v for v in (marked or inputs) if leading(v) is not None]
    if not candidates:
        return 0, []
    sizes_seen = [leading(v) for v in candidates]
    counts = collections.Counter(sizes_seen)
    size = max(counts, key=lambda s: (counts[s], -sizes_seen.index(s)))
    return int(size or 0), [v for v in candidates if leading(v) == size]


class DynamicBatchPass(InPlacePass):
    def __init__(self, batch_inputs: Sequence[str] | None = None, dim_name: str = "batch") -> None:
        super().__init__()
        self.batch_inputs = None if batch_inputs is None else list(batch_inputs)
        self.dim_name = dim_name

    def call(self, model: ir.Model) -> PassResult:
        size, inputs = select_batch_inputs(model.graph, self.batch_inputs)
        if not inputs:
            return PassResult(model, False)
        TopologicalSortPass()(model)  # the analysis walks the graph once, in order
        infer_missing_shapes(model, replace_dynamic=True)  # static shapes at B, read by the analysis
        analysis = Analysis(model, size, inputs)
        try:
            analysis.run()
        except Refusal as refusal:
            raise batch_error([v.name or "" for v in inputs], str(refusal)) from None
        Emitter(model.graph, inputs[0]).apply({**analysis.edits, **analysis.fixed})
        for value in inputs:
            value.shape = ir.Shape([ir.SymbolicDim(self.dim_name), *list(value.shape or [])[1:]])
        for value, batch in analysis.state.items():
            if batch is None or value.is_graph_input() or not isinstance(value.type, ir.TensorType):
                continue
            if value.shape is None or batch is UNKNOWN or batch.axis >= len(value.shape):
                value.shape = None
            else:
                dims = list(value.shape)
                name = self.dim_name if batch.factor == 1 else f"{self.dim_name}*{batch.factor}"
                dims[batch.axis] = ir.SymbolicDim(name)
                value.shape = ir.Shape(dims)
        return PassResult(model, True)


# ---------------------------------------------------------------------------------------------
# The analysis: where the batch is, and which constants to rewrite (planned, applied afterwards)
