"""RecoverParametersPass: undo the exporter's folds of torch parameters where they are invertible.

``torch.onnx.export`` (dynamo, ``optimize=True``) runs onnxscript's optimizer, which treats
parameters as constants. Using the export signature (see :mod:`passes.exports.signature`):

0. zero biases dropped by ``RemoveOptionalBiasFrom*`` are restored
   (:class:`~passes.exports.dropped_bias.RestoreDroppedBiasesPass`), and calls merged by its
   CSE are cloned with their own parameters
   (:class:`~passes.exports.merged_calls.SplitMergedCallsPass`);
1. a parameter ``P`` folded alone into a 2-D constant ``V`` read by ``aten.linear`` nodes is
   ``V = P^T``: ``P`` is restored as an initializer and ``V`` becomes ``Transpose(P)``;
2. parameters with equal values merged into one initializer ``X``: each use of ``X`` by a node
   whose FX call names a different, missing parameter ``Q`` is given its own initializer ``Q``
   (a copy of ``X``'s value), so each parameter gets its own gradient;
3. (exports without a signature) ``Identity(kept) -> name`` nodes with which the legacy
   exporter deduplicates equal initializers become initializers ``name`` again, unless
   ``name`` is an exporter name (``onnx::...``: the same tensor used twice);
4. any other parameter that the graph's FX calls or folded constants name but that is no longer
   an initializer (folded with other values, e.g. Conv+BatchNorm fusion or a lookup at
   constant indices; or an initializer that kept its name but holds folded values) cannot be
   recovered: in strict mode a :class:`GradientError` (:func:`~passes.exports.refusal.lost_error`)
   names them and what avoids the fold, unless each is in ``frozen`` and gone from the file
   (held fixed, its folded constants keep its init values); they are listed in ``self.lost``
   and in the graph's ``metadata_props[LOST_KEY]`` either way;
5. a parameter that is no initializer and that nothing names (unused by forward, tied to a
   parameter the export keeps, or removed by a no-op rule such as ``x*1`` together with its
   record) is listed in ``self.unread`` and ``metadata_props[UNREAD_KEY]`` (``--list-weights``
   shows it): the file cannot tell these cases apart.
"""

from __future__ import annotations

import re

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.exports.dropped_bias import RestoreDroppedBiasesPass
from passes.exports.merged_calls import SplitMergedCallsPass
from passes.exports.refusal import REEXPORT_HINT as REEXPORT_HINT
from passes.exports.refusal import lost_error
from passes.exports.signature import RECOVERED_KEY, TorchSignature, folded_from, fx_call

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
# FX targets whose weight operand is used transposed (torch.nn.functional.linear).
_LINEAR = frozenset({"aten.linear.default"})
# The per-value kind a dynamo export writes for initializers it kept as they were.
SIGNATURE_KIND_KEY = "pkg.torch.export.graph_signature.InputSpec.kind"
# Graph metadata listing the parameters that could not be recovered (comma-separated).
LOST_KEY = "gradgraph.lost_parameters"
# Graph metadata: parameters neither in the export nor read by any node (comma-separated).
UNREAD_KEY = "gradgraph.unread_parameters"
# Base names of the FX calls that read rows of a tensor (a folded one keeps its FX name).
_LOOKUPS = frozenset({"embedding", "index", "index_select", "select", "slice", "narrow", "gather"})


class RecoverParametersPass(InPlacePass):
    def __init__(self, strict: bool = True, frozen: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.strict = strict
        # Parameters the caller holds fixed (--freeze / weights_not_to_train): one folded away is
        # no refusal, its folded constants hold its init values. One whose name now holds fused
        # values (Conv+BatchNorm) still is: a checkpoint would save them under its name.
        self.frozen = frozen
        self.lost: list[str] = []
        self.dropped: list[str] = []  # lost ones no folded constant names (see _find_lost)
        self.optimized = False  # the export has folded constants (its optimizer ran)
        self.fused: set[str] = set()
        self.recovered: dict[str, str] = {}  # parameter -> how
        self.unread: list[str] = []  # not in the export, read by nothing (see call)

    def call(self, model: ir.Model) -> PassResult:
        signature = TorchSignature.read(model)
        if signature is None:
            return PassResult(model, self._undedup(model.graph))
        graph = model.graph
        biases, merges = RestoreDroppedBiasesPass(), SplitMergedCallsPass()
        modified = biases(model).modified | merges(model).modified
        self.recovered.update(biases.recovered)
        self.recovered.update(merges.recovered)
        placeholders = signature.targets("PARAMETER")
        present = set(graph.initializers) | {v.name for v in graph.inputs}
        missing = {fqn for fqn in placeholders.values() if fqn not in present}
        modified |= self._untranspose(graph, placeholders, missing)
        modified |= self._unmerge(graph, placeholders, missing)
        self._find_lost(graph, placeholders, missing)
        if self.lost:
            graph.metadata_props[LOST_KEY] = ",".join(self.lost)
        refused = [p for p in self.lost if p not in self.frozen or p in graph.initializers]
        if refused and self.strict:
            folded = [p for p in refused if p not in self.dropped]
            sources = {s for name, v in graph.initializers.items()
                       if re.sub(r"_\d+$", "", name) in _LOOKUPS for s in folded_from(v)}
            read_at_constants = [p for p in folded if p in sources and p not in self.fused]
            dropped = [p for p in self.dropped if p in refused]
            raise lost_error(folded, dropped, optimized=self.optimized, read_at_constants=read_at_constants,
                             freezable=not any(p in graph.initializers for p in refused))
        # Read by nothing and in no constant: unused by forward, tied to a parameter the export
        # keeps (one placeholder per tensor), or removed with an x*1-style call (the call is gone
        # with its record). These cannot be told apart in the file: --list-weights shows them.
        self.unread = sorted(missing - set(self.lost))
        if self.unread:
            graph.metadata_props[UNREAD_KEY] = ",".join(self.unread)
        return PassResult(model, modified)

    def _untranspose(self, graph: ir.Graph, placeholders: dict[str, str], missing: set[str]) -> bool:
        modified = False
        fqn_placeholder = {fqn: p for p, fqn in placeholders.items()}
        restored: dict[str, ir.Value] = {}
        # a parameter kept for one use and folded for another (a tied embedding and output
        # projection): its transposed copy becomes Transpose of it
        for fqn in placeholders.values():
            kept = graph.initializers.get(fqn)
            if kept is not None and kept.const_value is not None:
                restored[fqn] = kept
        for name, value in list(graph.initializers.items()):
            sources = folded_from(value)
            if len(sources) != 1 or value.const_value is None or sources[0] == name:
                continue
            if sources[0] not in missing and sources[0] not in restored:
                continue
            param = sources[0]
            calls = [fx_call(node) for node, _ in value.uses()]
            linear = all(c is not None and c.target in _LINEAR
                         and fqn_placeholder[param] in c.placeholders() for c in calls)
            if not calls or not linear or len(value.shape or ()) != 2:
                continue
            data = np.ascontiguousarray(value.const_value.numpy().T)
            if param in restored:  # kept, or another copy of it (a module used twice): same values
                if not np.array_equal(restored[param].const_value.numpy(), data):  # type: ignore[union-attr]
                    continue
            else:
                restored[param] = ir.Value(name=param, shape=ir.Shape(data.shape), type=value.type,
                                           const_value=ir.tensor(data, name=param))
                restored[param].metadata_props[RECOVERED_KEY] = f"transpose of folded {name}"
                graph.register_initializer(restored[param])
            node = ir.Node("", "Transpose", [restored[param]], [ir.AttrInt64s("perm", [1, 0])],
                           name=f"{name}/Transpose")
            graph.initializers.pop(name)
            value.replace_all_uses_with(node.outputs[0])
            node.outputs[0].name = name
            node.outputs[0].shape, node.outputs[0].type = value.shape, value.type
            graph.insert_before(graph.node(0), node) if len(graph) else graph.append(node)
            missing.discard(param)
            self.recovered[param] = "transposed copy"
            modified = True
        return modified

    def _unmerge(self, graph: ir.Graph, placeholders: dict[str, str], missing: set[str]) -> bool:
        modified = False
        own_placeholder = {fqn: p for p, fqn in placeholders.items()}
        for name, value in list(graph.initializers.items()):
            if name not in own_placeholder or value.const_value is None:
                continue
            if SIGNATURE_KIND_KEY not in value.metadata_props and RECOVERED_KEY not in value.metadata_props:
                # The exporter rewrote this parameter's value (a fusion, e.g. Conv+BatchNorm):
                # it keeps the name but lost its signature entry.
                self.fused.add(name)
                continue
            copies: dict[str, ir.Value] = {}
            for node, index in list(value.uses()):
                call = fx_call(node)
                if call is None or own_placeholder[name] in call.placeholders():
                    continue
                others = [placeholders[p] for p in call.placeholders()
                          if p in placeholders and placeholders[p] in missing | set(copies)]
                if len(others) > 1:  # e.g. LayerNorm(x, ln1.weight, ln1.bias) for ln2: match the leaf name
                    leaf = name.rsplit(".", 1)[-1]
                    others = [o for o in others if o.rsplit(".", 1)[-1] == leaf]
                if len(others) != 1:
                    continue
                param = others[0]
                if param not in copies:
                    copy = ir.Value(name=param, shape=value.shape, type=value.type,
                                    const_value=ir.tensor(value.const_value.numpy().copy(), name=param))
                    copy.metadata_props[RECOVERED_KEY] = f"merged into {name} (equal values)"
                    graph.register_initializer(copy)
                    copies[param] = copy
                    missing.discard(param)
                    self.recovered[param] = f"equal-valued copy of {name}"
                node.replace_input_with(index, copies[param])
                modified = True
        return modified

    def _undedup(self, graph: ir.Graph) -> bool:
        """Legacy exports replace an initializer equal to another by ``Identity(kept) -> name``:
        give ``name`` its own initializer again, unless it is an exporter name (``onnx::``, the
        same tensor used twice, e.g. a shared layer)."""
        modified = False
        for node in list(graph):
            source = node.inputs[0] if node.op_type == "Identity" and node.inputs else None
            out = node.outputs[0] if node.outputs else None
            if (source is None or out is None or not source.is_initializer() or source.const_value is None
                    or not out.name or out.name.startswith("onnx::") or out.is_graph_output()
                    or out.name in graph.initializers):
                continue
            copy = ir.Value(name=out.name, shape=source.shape, type=source.type,
                            const_value=ir.tensor(source.const_value.numpy().copy(), name=out.name))
            copy.metadata_props[RECOVERED_KEY] = f"deduplicated into {source.name} by the exporter"
            out.name = None
            out.replace_all_uses_with(copy)
            graph.remove(node, safe=True)
            graph.register_initializer(copy)
            self.recovered[copy.name or ""] = f"equal-valued copy of {source.name}"
            modified = True
        return modified

    def _find_lost(self, graph: ir.Graph, placeholders: dict[str, str], missing: set[str]) -> None:
        named: set[str] = set()
        for node in ir.traversal.RecursiveGraphIterator(graph):
            call = fx_call(node)
            if call is not None:
                named.update(placeholders[p] for p in call.placeholders() if p in placeholders)
        refolded = []
        parameters = set(placeholders.values())
        for name, value in graph.initializers.items():
            sources = folded_from(value)
            named.update(s for s in sources if s in missing)
            if name in parameters and sources:
                refolded.append(name)  # kept a parameter's name, holds folded values
            elif value.uses() and value.dtype in _FLOATS:
                # a constant folded from a parameter the graph still has (used elsewhere):
                # this use would get no gradient
                refolded.extend(s for s in sources if s in parameters and s in graph.initializers)
        self.lost = sorted((missing & named) | set(refolded) | self.fused)
        # lost without a trace of folding: no folded constant names them (the exporter's
        # translation of their call dropped them, e.g. LSTM(proj_size=...)'s projection)
        folded_sources = {s for value in graph.initializers.values() for s in folded_from(value)}
        self.dropped = sorted(p for p in self.lost if p in missing and p not in folded_sources)
        self.optimized = bool(folded_sources)

