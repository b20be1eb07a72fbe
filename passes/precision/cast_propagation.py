"""CastPropagationPass: grow the low-precision regions of a forward graph (PropagateCastOps).

The reference is onnxruntime's ``PropagateCastOps`` transformer; ops are *allowed* (may run in
the low type) per :func:`passes.precision.policy.allowed_ops` for the level, plus Softmax
between a Cast to fp32 and a single Cast back to the low type. Only the relevant ports
(:func:`passes.precision.policy.relevant_ports`) of a node change type. Levels < 0 do nothing;
levels > 2 act as 2. In every graph (subgraphs included):

1. ``INSERT_AND_REDUCE``: every allowed node with float32 relevant ports is converted: its
   float32 relevant inputs get a ``Cast->low``, its relevant outputs become low and their
   other consumers read them through one ``Cast->fp32`` each.
2. Then, until nothing changes (step 1 included, as the reductions can put a Softmax
   between casts): the reductions of :mod:`passes.precision.cast_cleanup`
   (casts to the type their input has, sibling casts, back-to-back casts), and with
   ``FLOOD_FILL``:

   a. outputs to inputs: an allowed node whose float outputs feed at least two ``Cast->low``
      (and, below level 2, nothing else) is converted;
   b. inputs to outputs: an allowed node with at least two float inputs from single-use
      ``Cast->fp32`` (below level 2: all of them) is converted;
   c. forwards, from each ``Cast(low->fp32)``: the allowed nodes downstream (below level 2
      only those whose other float inputs are in the region) are converted and the Cast is
      removed, when every consumer of the Cast joins;
   d. backwards, from each ``Cast(fp32->low)``: the allowed producers upstream are converted
      and the Cast removed; below level 2 the walk stops at values with several consumers or
      that are graph outputs.

A converted node's consumers outside the region read a ``Cast->fp32``; graph outputs keep
their name and dtype. Every node converts at most once, so the loop ends. Casts from
non-float types (bool) are never touched.

Kernels: with ``supported`` (see :func:`gradgraph.runtime.kernels.kernel_predicate`), an allowed op the
predicate rejects in the low type is treated as not allowed: it keeps its fp32 computation (the
original numerics; nothing to emulate, cast propagation only moves existing precision
boundaries), and is counted in ``rejected`` after the call.

Values without a type get one from ONNX shape inference first (not reported as a change).
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Iterable

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.precision.cast_cleanup import (
    F32,
    LOW_TYPES,
    CastEditor,
    cast_to,
    ensure_types,
    fuse_sibling_casts,
    is_float_cast,
    remove_back_to_back_casts,
    remove_unnecessary_casts,
    subgraphs,
)
from passes.precision.policy import MAX_LEVEL, allowed_ops, relevant_ports
from passes.subgraphs import has_subgraphs

KernelPredicate = Callable[[str, str, ir.DataType], bool]


class Strategy(enum.IntFlag):
    """The reference's PropagateCastOpsStrategy (bit flags: 3 = both)."""

    NONE = 0
    INSERT_AND_REDUCE = 1
    FLOOD_FILL = 2


def _has_subgraph(node: ir.Node) -> bool:
    return has_subgraphs(node)


class _Propagation:
    """Cast propagation over one graph (state of one call)."""

    def __init__(self, graph: ir.Graph, cfg: CastPropagationPass, opset: int, edit: CastEditor,
                 rejected: dict[int, str]) -> None:
        self.graph, self.low, self.level = graph, cfg.low, cfg.level
        self.strategy, self.supported = cfg.strategy, cfg.supported
        self.ops = allowed_ops(cfg.level, cfg.allow)
        self.opset, self.edit, self.rejected = opset, edit, rejected

    # ---- node properties ---------------------------------------------------------------------

    def _softmax_between_casts(self, node: ir.Node) -> bool:
        source, out = node.inputs[0] if node.inputs else None, node.outputs[0]
        producer = source.producer() if source is not None else None
        uses = list(out.uses())
        return (producer is not None and is_float_cast(producer, self.low, src=self.low, dst=F32)
                and len(uses) == 1 and not out.is_graph_output()
                and is_float_cast(uses[0].node, self.low, src=F32, dst=self.low))

    def allowed(self, node: ir.Node) -> bool:
        if node.graph is not self.graph or _has_subgraph(node):
            return False
        if node.op_type not in self.ops and not (
                node.op_type == "Softmax" and self._softmax_between_casts(node)):
            return False
        if self.supported is not None and not self.supported(node.op_type, node.domain, self.low):
            self.rejected[id(node)] = node.op_type
            return False
        return True

    def float_ins(self, node: ir.Node) -> list[tuple[int, ir.Value]]:
        ins, _ = relevant_ports(node, self.opset)
        return [(i, v) for i in ins if i < len(node.inputs) and (v := node.inputs[i]) is not None
                and v.dtype in (F32, self.low)]

    def float_outs(self, node: ir.Node) -> list[ir.Value]:
        _, outs = relevant_ports(node, self.opset)
        return [node.outputs[i] for i in outs
                if i < len(node.outputs) and node.outputs[i].dtype in (F32, self.low)]

    def fp32_state(self, node: ir.Node) -> bool:
        return (any(v.dtype == F32 for _, v in self.float_ins(node))
                or any(v.dtype == F32 for v in self.float_outs(node)))

    def _reads_low(self, node: ir.Node, index: int, members: set[int]) -> bool:
        if cast_to(node) is not None:
            return True
        return id(node) in members and index in relevant_ports(node, self.opset)[0]

    # ---- conversion --------------------------------------------------------------------------

    def convert(self, region: list[ir.Node], remove: ir.Node | None = None) -> None:
        """Run ``region`` in the low type; ``remove`` (a Cast at its border) is bypassed."""
        members = {id(n) for n in region}
        retyped = [v for n in region for v in self.float_outs(n) if v.dtype == F32]
        for value in retyped:
            self.edit.retype(value, self.low, self.graph)
        # found before ``remove`` goes: its consumers read the low type already
        outsides = [[(u.node, u.idx) for u in value.uses()
                     if not self._reads_low(u.node, u.idx, members)] for value in retyped]
        if remove is not None and remove.graph is self.graph:
            source = remove.inputs[0]
            assert source is not None
            self.edit.bypass(remove, source, self.graph)
        for value, outside in zip(retyped, outsides):
            if outside:
                back = self.edit.new_cast(value, F32, self.graph)
                for node, index in outside:
                    node.replace_input_with(index, back)
        down: dict[int, ir.Value] = {}
        for node in region:
            for index, value in self.float_ins(node):
                if value.dtype == F32:
                    if id(value) not in down:
                        down[id(value)] = self.edit.new_cast(value, self.low, self.graph)
                    node.replace_input_with(index, down[id(value)])

    def _live(self) -> list[ir.Node]:
        return list(self.graph)

    # ---- step 1 ------------------------------------------------------------------------------

    def insert_and_reduce(self) -> bool:
        region = [n for n in self._live() if self.allowed(n) and self.fp32_state(n)]
        if region:
            self.convert(region)
        return bool(region)

    # ---- step 2: flood fill ------------------------------------------------------------------

    def outputs_to_inputs(self) -> bool:
        modified = False
        for node in self._live():
            if node.graph is not self.graph or not self.allowed(node) or not self.fp32_state(node):
                continue
            outs = [v for v in self.float_outs(node) if v.dtype == F32]
            uses = [u.node for v in outs for u in v.uses()]
            casts = [n for n in uses if is_float_cast(n, self.low, src=F32, dst=self.low)]
            if outs and len(casts) > 1 and (self.level >= MAX_LEVEL or len(casts) == len(uses)):
                self.convert([node])
                modified = True
        return modified

    def _single_use_up_cast(self, value: ir.Value, node: ir.Node) -> bool:
        producer = value.producer()
        return (producer is not None and producer.graph is self.graph
                and is_float_cast(producer, self.low, src=self.low, dst=F32)
                and {id(u.node) for u in value.uses()} == {id(node)}
                and not value.is_graph_output())

    def inputs_to_outputs(self) -> bool:
        modified = False
        for node in self._live():
            if node.graph is not self.graph or not self.allowed(node) or not self.fp32_state(node):
                continue
            ins = [v for _, v in self.float_ins(node) if v.dtype == F32]
            casts = [v for v in dict.fromkeys(ins) if self._single_use_up_cast(v, node)]
            if len(casts) > 1 and (self.level >= MAX_LEVEL or len(casts) == len(set(map(id, ins)))):
                self.convert([node])
                modified = True
        return modified

    def _forward_region(self, seed: ir.Value) -> list[ir.Node]:
        values: dict[int, ir.Value] = {id(seed): seed}
        region: list[ir.Node] = []
        members: set[int] = set()
        grown = True
        while grown:
            grown = False
            for value in list(values.values()):
                for use in value.uses():
                    node = use.node
                    if id(node) in members or use.idx not in relevant_ports(node, self.opset)[0]:
                        continue
                    if not self.allowed(node) or not self.fp32_state(node):
                        continue
                    others = [v for _, v in self.float_ins(node)
                              if v.dtype == F32 and id(v) not in values]
                    if others and self.level < MAX_LEVEL:
                        continue
                    members.add(id(node))
                    region.append(node)
                    values.update((id(v), v) for v in self.float_outs(node) if v.dtype == F32)
                    grown = True
        return region

    def forwards(self) -> bool:
        modified = False
        for cast in self._live():
            if cast.graph is not self.graph or not is_float_cast(cast, self.low, src=self.low, dst=F32):
                continue
            out = cast.outputs[0]
            if out.is_graph_output() or not out.uses():
                continue
            region = self._forward_region(out)
            members = {id(n) for n in region}
            if all(id(u.node) in members and u.idx in relevant_ports(u.node, self.opset)[0]
                   for u in out.uses()):
                self.convert(region, remove=cast)
                modified = True
        return modified

    def _backward_region(self, seed: ir.Value) -> list[ir.Node]:
        region: list[ir.Node] = []
        members: set[int] = set()
        stack = [seed]
        while stack:
            value = stack.pop()
            producer = value.producer()
            if producer is None or id(producer) in members or not self.allowed(producer):
                continue
            outs = self.float_outs(producer)
            if not any(v is value for v in outs) or value.dtype != F32:
                continue
            consumers = {id(u.node) for u in value.uses()}
            if self.level < MAX_LEVEL and (len(consumers) > 1 or value.is_graph_output()):
                continue
            if any(v is not value and v.dtype == F32 and (v.uses() or v.is_graph_output())
                   for v in outs):
                continue
            members.add(id(producer))
            region.append(producer)
            stack.extend(v for _, v in self.float_ins(producer) if v.dtype == F32)
        return region

    def backwards(self) -> bool:
        modified = False
        for cast in self._live():
            if cast.graph is not self.graph or not is_float_cast(cast, self.low, src=F32, dst=self.low):
                continue
            source = cast.inputs[0]
            assert source is not None
            if cast.outputs[0].is_graph_output():
                continue
            region = self._backward_region(source)
            if region:
                self.convert(region, remove=cast)
                modified = True
        return modified

    def run(self) -> bool:
        modified = False
        steps = [remove_unnecessary_casts, fuse_sibling_casts, remove_back_to_back_casts]
        while True:
            # step 1 repeats: the reductions can create a Softmax between casts
            changed = bool(self.strategy & Strategy.INSERT_AND_REDUCE) and self.insert_and_reduce()
            for step in steps:
                changed |= step(self.graph, self.low, self.edit)
            if self.strategy & Strategy.FLOOD_FILL:
                for flood in (self.outputs_to_inputs, self.inputs_to_outputs, self.forwards,
                              self.backwards):
                    changed |= flood()
            if not changed:
                return modified
            modified = True


class CastPropagationPass(InPlacePass):
    """See the module docstring; ``low`` is float16 (default) or bfloat16."""

    def __init__(self, strategy: Strategy | int = Strategy.FLOOD_FILL, level: int = 1,
                 allow: Iterable[str] = (), *, low: ir.DataType = ir.DataType.FLOAT16,
                 supported: KernelPredicate | None = None) -> None:
        super().__init__()
        if low not in LOW_TYPES:
            raise ValueError(f"low must be one of {[t.name for t in LOW_TYPES]}, not {low!r}")
        self.strategy = Strategy(int(strategy))
        self.level = min(level, MAX_LEVEL)
        self.allow = tuple(allow)
        self.low = low
        self.supported = supported
        # After a call: op_type -> how many allowed nodes ``supported`` rejected.
        self.rejected: dict[str, int] = {}

    def call(self, model: ir.Model) -> PassResult:
        self.rejected = {}
        if self.level < 0:
            return PassResult(model, False)
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
        ensure_types(model)
        edit = CastEditor(model)
        rejected: dict[int, str] = {}
        modified = False
        for graph in subgraphs(model.graph):
            modified |= _Propagation(graph, self, opset, edit, rejected).run()
        for op_type in rejected.values():
            self.rejected[op_type] = self.rejected.get(op_type, 0) + 1
        if not modified:  # nothing silent: the option was asked for and did nothing
            warnings.warn(f"CastPropagationPass: propagate_cast_ops level {self.level} changed nothing: "
                          "FLOOD_FILL only moves existing precision boundaries (Casts between float32 "
                          "and the low type; a float32 graph without mixed precision has none), "
                          "INSERT_AND_REDUCE converts the ops the level allows (level 0: the allow "
                          "list only)", UserWarning, stacklevel=3)
        return PassResult(model, modified)
