"""The torch export signature and FX provenance that a dynamo export keeps in metadata.

A model saved by ``torch.onnx.export(..., dynamo=True)`` (torch >= 2.5) carries

1. in ``graph.metadata_props["pkg.torch.export.ExportedProgram.graph_signature"]`` one line
   per graph input of the exported program: ``p_fc_weight: PARAMETER target='fc.weight'``,
   ``b_bn_running_mean: BUFFER target='bn.running_mean' persistent=True``, ``x: USER_INPUT``;
2. on each node, ``metadata_props["pkg.torch.onnx.fx_node"]``, the FX node it was translated
   from: ``%linear : [...] = call_function[target=torch.ops.aten.linear.default](args = (%x,
   %p_fc_weight), kwargs = {})``.

The legacy exporter keeps neither; :meth:`TorchSignature.read` then returns None.
"""

from __future__ import annotations

import ast
import dataclasses
import re

import onnx_ir as ir

SIGNATURE_KEY = "pkg.torch.export.ExportedProgram.graph_signature"
FX_NODE_KEY = "pkg.torch.onnx.fx_node"
FOLDED_FROM_KEY = "pkg.onnxscript.optimizer.folded_from"
# On a node an onnxscript rewrite rule wrote: the rule's name.
RULE_NAME_KEY = "pkg.onnxscript.rewriter.rule_name"
# Value metadata gradgraph writes: how a parameter was recovered (read by ClassifyWeightsPass).
RECOVERED_KEY = "gradgraph.recovered"

NAME_SCOPES_KEY = "pkg.torch.onnx.name_scopes"

_NAME = re.compile(r"^%(\w+) :")
_LINE = re.compile(r"^(\w+): (\w+)(?: target='([^']*)')?")
_CALL = re.compile(r"target=(?:torch\.ops\.)?([\w.]+)\]\(args = \((.*)\), kwargs = (\{.*\})\)\s*$", re.S)


@dataclasses.dataclass(frozen=True)
class TorchSignature:
    """Placeholder name -> (kind, target) for every input of the exported program."""

    kinds: dict[str, tuple[str, str]]

    @classmethod
    def read(cls, model: ir.Model) -> TorchSignature | None:
        text = model.graph.metadata_props.get(SIGNATURE_KEY)
        if not text:
            return None
        kinds: dict[str, tuple[str, str]] = {}
        inputs = text.split("# outputs")[0]
        for line in inputs.splitlines():
            match = _LINE.match(line.strip())
            if match:
                placeholder, kind, target = match.groups()
                kinds[placeholder] = (kind, target or placeholder)
        return cls(kinds) if kinds else None

    def targets(self, kind: str) -> dict[str, str]:
        """Placeholder -> target name (the torch FQN) of every input of ``kind``."""
        return {p: t for p, (k, t) in self.kinds.items() if k == kind}

    @property
    def parameters(self) -> set[str]:
        return set(self.targets("PARAMETER").values())

    @property
    def buffers(self) -> set[str]:
        return set(self.targets("BUFFER").values()) | set(self.targets("CONSTANT_TENSOR").values())


@dataclasses.dataclass(frozen=True)
class FxCall:
    """The aten call an ONNX node was translated from: target and positional args (as text)."""

    target: str
    args: list[str]

    def placeholders(self) -> list[str]:
        """Names of the FX values among the positional args (``%name`` -> ``name``)."""
        return re.findall(r"%(\w+)", ", ".join(self.args))


def _split_args(text: str) -> list[str]:
    args, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            args.append(text[start:i].strip())
            start = i + 1
    tail = text[start:].strip()
    if tail:
        args.append(tail)
    return args


def fx_call(node: ir.Node) -> FxCall | None:
    """The FX call recorded on ``node``, or None (no metadata, or not a call_function)."""
    text = node.metadata_props.get(FX_NODE_KEY)
    if not text:
        return None
    match = _CALL.search(text)
    if match is None:
        return None
    target, args, _ = match.groups()
    return FxCall(target, _split_args(args))


def torch_parameter_names(model: ir.Model) -> set[str]:
    """The torch names of every parameter the export signature lists (none without one), also
    of those the exporter's optimizer folded away: names ``--freeze`` may give."""
    signature = TorchSignature.read(model)
    return signature.parameters if signature is not None else set()


def fx_name(node: ir.Node) -> str | None:
    """The FX node name recorded on ``node`` (``%layer_norm_1 : ... = call_function...`` ->
    ``layer_norm_1``): the exporter names the call's output value after it."""
    match = _NAME.match(node.metadata_props.get(FX_NODE_KEY, ""))
    return match.group(1) if match else None


def module_path(node: ir.Node) -> str:
    """The torch module path ``node`` was called in (``h.0.mlp.c_fc``; ``""`` for the root or
    when unrecorded), from ``pkg.torch.onnx.name_scopes``."""
    try:
        scopes = ast.literal_eval(node.metadata_props.get(NAME_SCOPES_KEY, "[]"))
    except (ValueError, SyntaxError):
        return ""
    return str(scopes[-2]) if isinstance(scopes, list) and len(scopes) >= 2 else ""


def folded_from(value: ir.Value) -> list[str]:
    """The names an onnxscript-folded constant was computed from ([] when not folded)."""
    text = value.metadata_props.get(FOLDED_FROM_KEY)
    if not text:
        return []
    return re.findall(r"'([^']*)'", text)
