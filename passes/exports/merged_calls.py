"""SplitMergedCallsPass: undo the exporter's merge of two torch calls that were equal at init.

onnxscript's optimizer (dynamo ``torch.onnx.export``, ``optimize=True``) ends with
``DeduplicateInitializersPass`` (equal-valued initializers become one: a fresh model's
LayerNorm weights are all ones, its biases zeros) and ``CommonSubexpressionEliminationPass``
(nodes with the same op, inputs and attributes become one). Two calls of different modules on
the same input, e.g. a parallel-residual block's ``ln_1(x)`` and ``ln_2(x)``, thus become one
node: the second module's parameters vanish, and the survivor's parameters would be trained
with the sum of both gradients. Every node records its torch call (``fx_call``) with the FX
names of its inputs, and a call's output value is named after its FX node, so:

1. a consumer ``C`` reads the output ``V`` of another call ``P`` (FX name ``p``) where its
   recorded call names a value ``x`` that no longer exists, with ``p``'s base name
   (``layer_norm_1`` / ``layer_norm``): ``C`` read the merged call ``x``. Inputs and recorded
   args of that base are paired in order (``ln_a(x) * ln_b(x)`` reads ``V`` twice, the second
   time for ``x``); a single vanished name that ``C`` reads ``V`` for takes all such inputs;
2. if ``P``'s nodes that compute ``V`` read no parameter, the merge is exact (the same function
   of the same values, so the same gradients): left alone;
3. else those nodes are cloned for ``x``'s consumers (the clone's output is named ``x`` and its
   recorded call names ``x`` and its own parameters), and each parameter the clone reads gets
   its own initializer, a copy of the survivor's value, named:

   a. after the torch parameters that the export lost and that no node reads, of the one
      module holding every parameter suffix the survivor reads (``ln_2.weight``/``ln_2.bias``
      for ``ln_1.weight``/``ln_1.bias``); among several such modules, the one sharing the
      longest module-path prefix with ``C``;
   b. when several modules fit equally: ``<survivor parameter>@merged:<x>``, with a warning
      (``--list-weights`` gives the reason); the torch parameters stay missing and are
      reported by ``RecoverParametersPass``;
   c. when no lost module fits at all: nothing is split. The vanished call read the survivor's
      own parameters (one module applied twice to the same input), and the merged node's
      gradient is torch's;
4. a merge that cannot be undone raises :class:`GradientError` naming the calls and
   ``optimize=False``: the uses cannot be paired (a node of a several-node call, repeated
   args), the call holds a subgraph, or the consumer sits in one. Merges of calls that read
   no parameter are left alone in each case (rule 2).
"""

from __future__ import annotations

import re
import warnings

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff.errors import GradientError
from passes.exports.signature import (
    FX_NODE_KEY,
    RECOVERED_KEY,
    TorchSignature,
    folded_from,
    fx_call,
    fx_name,
    module_path,
)
from passes.names import free_name

# On a clone: the FX name of the merged call it stands for.
MERGED_CALL_KEY = "gradgraph.merged_call"
MERGED_SUFFIX = "@merged:"


def _base(fx: str) -> str:
    return re.sub(r"_\d+$", "", fx)


def _common_prefix(a: str, b: str) -> int:
    parts_a, parts_b = a.split("."), b.split(".")
    n = 0
    while n < min(len(parts_a), len(parts_b)) and parts_a[n] == parts_b[n]:
        n += 1
    return n


class SplitMergedCallsPass(InPlacePass):
    def __init__(self) -> None:
        super().__init__()
        self.recovered: dict[str, str] = {}  # parameter -> how
        self.split: list[str] = []  # FX names of the merged calls given back
        self._placeholders: dict[str, str] = {}

    def call(self, model: ir.Model) -> PassResult:
        signature = TorchSignature.read(model)
        if signature is None:
            return PassResult(model, False)
        graph = model.graph
        merges, unmapped = self._find(graph, signature)
        if not merges and not unmapped:
            return PassResult(model, False)
        parameters = signature.parameters
        self._placeholders = signature.targets("PARAMETER")

        def reads_of(nodes: list[ir.Node]) -> list[ir.Value]:
            return list(dict.fromkeys(v for n in nodes for v in n.inputs if v is not None and v.is_initializer()
                                      and (v.name in parameters or RECOVERED_KEY in v.metadata_props)))

        for value, calls in unmapped:  # rule 4
            if reads_of(self._call_nodes(value)):
                raise GradientError(
                    f"the exporter's optimizer merged torch calls {['%' + n for n in calls]} into "
                    f"%{fx_name(value.producer())} (equal at init), and a node reads several of them, so "  # type: ignore[arg-type]
                    "gradgraph cannot tell which use was which; re-export with "
                    "torch.onnx.export(..., optimize=False)")
        lost = self._lost_unread(graph, signature)
        modified = False
        for (value, merged), uses in merges.items():
            nodes = self._call_nodes(value)
            reads = reads_of(nodes)
            if not reads:
                continue  # rule 2: the same function of the same values
            nested = value.graph is not graph or any(c.graph is not graph for c, _ in uses)
            if nested or any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
                             for n in nodes for a in n.attributes.values()):
                raise GradientError(
                    f"the exporter's optimizer merged torch call %{merged} into %{fx_name(nodes[-1])} "
                    "(equal at init) "
                    + ("inside a subgraph" if nested else "whose nodes hold a subgraph")
                    + ", where gradgraph cannot give it back; re-export with "
                    "torch.onnx.export(..., optimize=False)")
            names = self._names(self._torch_names(nodes, reads), lost, uses[0][0], merged, value)
            if names is None:
                continue  # rule 3c
            self._clone(graph, nodes, value, merged, uses, names)
            self.split.append(merged)
            modified = True
        return PassResult(model, modified)

    # ---- detection ---------------------------------------------------------------------------

    @staticmethod
    def _find(graph: ir.Graph, signature: TorchSignature) -> tuple[
            dict[tuple[ir.Value, str], list[tuple[ir.Node, int]]], list[tuple[ir.Value, list[str]]]]:
        """({(survivor output, vanished FX name): [(consumer, input index)]}, [(survivor output,
        vanished names) a consumer reads but whose uses cannot be told apart])."""
        existing = {v.name for n in ir.traversal.RecursiveGraphIterator(graph) for v in n.outputs}
        existing |= {v.name for v in graph.inputs} | set(graph.initializers)
        merges: dict[tuple[ir.Value, str], list[tuple[ir.Node, int]]] = {}
        unmapped: list[tuple[ir.Value, list[str]]] = []
        for node in ir.traversal.RecursiveGraphIterator(graph):
            call, own = fx_call(node), fx_name(node)
            if call is None:
                continue
            recorded = call.placeholders()
            reads: dict[str, list[tuple[int, ir.Value, str]]] = {}  # base -> inputs from other calls
            for index, value in enumerate(node.inputs):
                producer = value.producer() if value is not None else None
                source = fx_name(producer) if producer is not None else None
                if value is not None and source is not None and source != own:
                    reads.setdefault(_base(source), []).append((index, value, source))
            for base, inputs in reads.items():
                args = [a for a in recorded if _base(a) == base and a not in signature.kinds]
                vanished = [a for a in args if a not in existing]
                if not vanished:
                    continue
                if len(args) == len(inputs):  # one recorded arg per input, in order
                    pairs = [(index, value, arg) for (index, value, _), arg in zip(inputs, args, strict=True)]
                elif len(set(vanished)) == 1 and not any(source in recorded for _, _, source in inputs):
                    pairs = [(index, value, vanished[0]) for index, value, _ in inputs]
                else:  # a node of a several-node call, or repeated args: uses cannot be told apart
                    unmapped.extend((value, sorted(set(vanished))) for _, value, _ in inputs)
                    continue
                for index, value, arg in pairs:
                    if arg not in existing:
                        merges.setdefault((value, arg), []).append((node, index))
        return merges, unmapped

    @staticmethod
    def _call_nodes(value: ir.Value) -> list[ir.Node]:
        """The nodes of ``value``'s call that ``value`` depends on, in graph order."""
        producer = value.producer()
        assert producer is not None
        fx = fx_name(producer)
        found: dict[int, ir.Node] = {}
        stack = [producer]
        while stack:
            node = stack.pop()
            if id(node) in found:
                continue
            found[id(node)] = node
            for v in node.inputs:
                source = v.producer() if v is not None else None
                if source is not None and fx_name(source) == fx:
                    stack.append(source)
        order = {id(n): i for i, n in enumerate(producer.graph or [])}
        return sorted(found.values(), key=lambda n: order.get(id(n), 0))

    @staticmethod
    def _lost_unread(graph: ir.Graph, signature: TorchSignature) -> set[str]:
        """Torch parameters that are no initializer and that no node's call or folded constant names."""
        placeholders = signature.targets("PARAMETER")
        named = {placeholders[p] for n in ir.traversal.RecursiveGraphIterator(graph)
                 if (c := fx_call(n)) is not None for p in c.placeholders() if p in placeholders}
        named |= {s for v in graph.initializers.values() for s in folded_from(v)}
        present = set(graph.initializers) | {v.name for v in graph.inputs}
        return {fqn for fqn in placeholders.values() if fqn not in present and fqn not in named}

    # ---- naming -----------------------------------------------------------------------------

    def _torch_names(self, nodes: list[ir.Node], reads: list[ir.Value]) -> dict[str, str]:
        """Initializer name -> the torch parameter it stands for in the survivor's call: itself,
        or (an initializer deduplicated with another parameter's, e.g. ``scale`` for a
        LayerNorm weight of ones) the call's recorded parameters not matched, in order."""
        recorded = [self._placeholders[p] for n in nodes if (c := fx_call(n)) is not None
                    for p in c.placeholders() if p in self._placeholders]
        recorded = list(dict.fromkeys(recorded))
        spare = [fqn for fqn in recorded if fqn not in {v.name for v in reads}]
        own: dict[str, str] = {}
        for v in reads:
            name = v.name or ""
            own[name] = name if name in recorded or not spare else spare.pop(0)
        return own

    def _names(self, reads: dict[str, str], lost: set[str], consumer: ir.Node, merged: str,
               value: ir.Value) -> dict[str, str] | None:
        """Initializer the survivor reads -> the name of the clone's own copy (rules 3a-3c)."""
        leaves = {fqn.rsplit(".", 1)[-1] for fqn in reads.values()}
        modules = {fqn.rsplit(".", 1)[0] for fqn in lost if "." in fqn}
        fits = [m for m in modules if all(f"{m}.{leaf}" in lost for leaf in leaves)]
        if not fits:
            return None
        where = module_path(consumer)
        best = max(_common_prefix(m, where) for m in fits)
        fits = [m for m in fits if _common_prefix(m, where) == best]
        if len(fits) == 1:
            module = fits[0]
            names = {init: f"{module}.{fqn.rsplit('.', 1)[-1]}" for init, fqn in reads.items()}
            lost.difference_update(names.values())
            return names
        warnings.warn(
            f"the exporter's optimizer merged torch call %{merged} into %{fx_name(value.producer())} "  # type: ignore[arg-type]
            f"(equal at init); gradgraph gives it its own copy of the parameters, but cannot tell "
            f"which of the modules {sorted(fits)} it belongs to, so they are named "
            f"'<parameter>{MERGED_SUFFIX}{merged}' (see --list-weights); re-export with "
            "torch.onnx.export(..., optimize=False) to keep the torch names", UserWarning, stacklevel=2)
        return {init: f"{fqn}{MERGED_SUFFIX}{merged}" for init, fqn in reads.items()}

    # ---- cloning ----------------------------------------------------------------------------

    def _clone(self, graph: ir.Graph, nodes: list[ir.Node], value: ir.Value, merged: str,
               uses: list[tuple[ir.Node, int]], names: dict[str, str]) -> None:
        taken = {v.name or "" for n in graph for v in n.outputs} | set(graph.initializers)
        taken |= {v.name or "" for v in graph.inputs}
        survivor = fx_name(nodes[-1]) or ""
        copies: dict[str, ir.Value] = {}
        mapping: dict[int, ir.Value] = {}
        for old, new in names.items():
            source = graph.initializers[old]
            own = graph.initializers.get(new)
            if own is None:
                assert source.const_value is not None
                own = ir.Value(name=new, shape=source.shape, type=source.type,
                               const_value=ir.tensor(source.const_value.numpy().copy(), name=new))
                how = (f"own copy for torch call %{merged}, which the exporter's optimizer merged "
                       f"into %{survivor} (equal at init)")
                own.metadata_props[RECOVERED_KEY] = how
                graph.register_initializer(own)
                self.recovered[new] = how
            copies[old] = own
        by_leaf = {new.split(MERGED_SUFFIX)[0].rsplit(".", 1)[-1]: re.sub(r"\W", "_", f"p_{new}")
                   for new in names.values()}
        clones = []
        for node in nodes:
            inputs = [mapping.get(id(v), copies.get(v.name or "", v)) if v is not None else None
                      for v in node.inputs]
            clone = ir.Node(node.domain, node.op_type, inputs, [a for a in node.attributes.values()],
                            overload=node.overload, num_outputs=len(node.outputs), version=node.version,
                            name=free_name(f"{node.name or node.op_type}/{merged}", taken),
                            metadata_props=dict(node.metadata_props))
            text = clone.metadata_props.get(FX_NODE_KEY, "")
            text = re.sub(rf"%{survivor}\b", f"%{merged}", text)
            call = fx_call(node)
            for arg in call.placeholders() if call is not None else []:
                leaf = self._placeholders.get(arg, "").rsplit(".", 1)[-1]
                if leaf in by_leaf:
                    text = re.sub(rf"%{arg}\b", f"%{by_leaf[leaf]}", text)
            clone.metadata_props[FX_NODE_KEY] = text
            clone.metadata_props[MERGED_CALL_KEY] = merged
            for old_out, new_out in zip(node.outputs, clone.outputs, strict=True):
                new_out.type, new_out.shape = old_out.type, old_out.shape
                wanted = merged if old_out is value else f"{merged}/{old_out.name}"
                new_out.name = free_name(wanted, taken)
                mapping[id(old_out)] = new_out
            clones.append(clone)
        graph.insert_after(nodes[-1], clones)
        for consumer, index in uses:
            consumer.replace_input_with(index, mapping[id(value)])
