"""The reference's recompute patterns: which forward nodes to recompute, as groups.

Each function reads a forward+backward graph and returns :class:`RecomputeGroup` s; the
rewrite itself (clone, rewire, place) is :func:`passes.recompute.recompute_pass.apply_groups`.

1. :func:`gelu_groups` (ORT ``localized_recompute.cc``, GeluRecompute): a Gelu, FastGelu or
   BiasGelu, or the erf form exporters write, ``x * 0.5 * (1 + Erf(x / sqrt 2))``, or the tanh
   form (GPT-2's ``gelu_new``, :func:`match_tanh_gelu`), whose output's
   first forward consumer is a MatMul. The backward reads a recomputed output (the erf form's
   intermediates too), so only ``x`` stays stashed;
2. :func:`attn_dropout_groups` (``dropout_recompute.cc``): a training Dropout fed by Softmax (through dtype Casts or Identities)
   whose output's first consumer is a MatMul. The clone is ``Where(mask, x / (1 - ratio), 0)``
   over the forward's mask, so the result is exact;
3. :func:`transformer_layer_groups` (``transformer_layer_recompute.cc``): layers found by the
   reference's start / end edges (start: output 0 of a LayerNorm or Dropout with exactly
   ``layer_start_edges`` forward edges; end: from each Gelu, first consumers to the next Dropout,
   then to the next LayerNorm), else by the module scopes nodes carry (dynamo's
   ``pkg.torch.onnx.name_scopes`` / ``namespace``, or legacy node names ``/model/h.3/...``),
   else as the blocks repeating along the residual stream (:mod:`passes.recompute.residual`).
   The first ``number_recompute_layers`` layers (0 = all but the last) are recomputed from
   their inputs; values a layer hands to later layers stay saved.

Random ops and ops with subgraphs are never recomputed (Dropout only from its saved mask);
nor are nodes with only non-float outputs (shapes, indices) unless ``recompute_non_float``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable

import onnx_ir as ir

from passes.marks import RECOMPUTE_OF_KEY, Role, role_of
from passes.recompute.analysis import is_activation_producer
from passes.recompute.options import GELU_OPS, LAYER_NORM_OPS, LAYER_START_OPS, RecomputeOptions
from passes.recompute.residual import residual_layers
from passes.subgraphs import has_subgraphs

FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE,
                    ir.DataType.BFLOAT16})
# How far the reference's end-edge search follows first consumers (Gelu -> Dropout -> LayerNorm).
MAX_END_WALK = 64
SCOPE_KEYS = ("pkg.torch.onnx.name_scopes", "namespace")


@dataclasses.dataclass(frozen=True)
class RecomputeGroup:
    """Forward nodes recomputed together: a clone reads the clones of producers in the group.

    ``keep_outputs``: values the group hands to forward nodes outside it stay saved (layers).
    ``option``: the :class:`RecomputeOptions` switch that chose it (``gelu``, ...).
    """

    label: str
    nodes: tuple[ir.Node, ...]
    keep_outputs: bool = False
    # The RecomputeOptions switch that chose the group (its clones are marked with it).
    option: str = ""


def is_dropout_with_mask(node: ir.Node) -> bool:
    """A training Dropout (training_mode constant True, constant ratio) with a named mask."""
    if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx") or len(node.outputs) < 2 \
            or not node.outputs[1].name:
        return False
    if len(node.inputs) < 3 or const_scalar(node.inputs[2]) != 1.0:
        return False
    return len(node.inputs) < 2 or node.inputs[1] is None or const_scalar(node.inputs[1]) is not None


def recomputable(node: ir.Node, options: RecomputeOptions) -> bool:
    """A forward node the patterns may clone (see the module docstring)."""
    if not is_activation_producer(node) or RECOMPUTE_OF_KEY in node.metadata_props:
        return False
    if node.op_type in options.banned_ops and not is_dropout_with_mask(node):
        return False
    if has_subgraphs(node):
        return False
    return options.recompute_non_float or any(o.dtype in FLOATS for o in node.outputs)


def has_clone(graph: ir.Graph) -> set[str]:
    """Names of the forward nodes that already have a recompute clone."""
    return {n.metadata_props[RECOMPUTE_OF_KEY] for n in graph if RECOMPUTE_OF_KEY in n.metadata_props}


def forward_users(value: ir.Value) -> list[ir.Node]:
    """Forward nodes reading ``value``, in graph order, each once."""
    graph = value.graph
    users = {id(u.node): u.node for u in value.uses() if role_of(u.node) == Role.FORWARD}
    if graph is None:
        return list(users.values())
    return [n for n in graph if id(n) in users]


def _first_user(value: ir.Value) -> ir.Node | None:
    users = forward_users(value)
    return users[0] if users else None


def const_scalar(value: ir.Value | None) -> float | None:
    """The scalar a constant value holds (initializer, Constant node or const_value)."""
    if value is None:
        return None
    tensor = value.const_value
    producer = value.producer()
    if tensor is None and producer is not None and producer.op_type == "Constant":
        attr = producer.attributes.get("value")
        tensor = attr.value if attr is not None else None
    if tensor is None:
        return None
    array = tensor.numpy()
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def _near(value: float | None, target: float, rel: float = 1e-3) -> bool:
    return value is not None and abs(value - target) <= rel * abs(target)


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    others = [v for v in node.inputs if v is not value]
    return others[0] if len(others) == 1 else None


def match_erf_gelu(erf: ir.Node) -> tuple[list[ir.Node], ir.Value] | None:
    """(nodes, output) of ``x * 0.5 * (1 + Erf(x / sqrt 2))`` around ``erf``, else None."""
    pre = erf.inputs[0].producer() if erf.inputs and erf.inputs[0] is not None else None
    if pre is None or pre.op_type not in ("Div", "Mul") or len(pre.inputs) != 2:
        return None
    x, c = pre.inputs
    if x is None or not (_near(const_scalar(c), 2 ** 0.5) if pre.op_type == "Div"
                         else _near(const_scalar(c), 2 ** -0.5)):
        return None
    add = _first_user(erf.outputs[0])
    if add is None or add.op_type != "Add" or not _near(const_scalar(_other(add, erf.outputs[0])), 1.0):
        return None
    mul = _first_user(add.outputs[0])
    if mul is None or mul.op_type != "Mul":
        return None
    t = _other(mul, add.outputs[0])
    if t is x:  # (x * (1 + erf)) * 0.5
        half = _first_user(mul.outputs[0])
        if half is None or half.op_type != "Mul" or not _near(const_scalar(_other(half, mul.outputs[0])), 0.5):
            return None
        return [pre, erf, add, mul, half], half.outputs[0]
    half = t.producer() if t is not None else None  # (x * 0.5) * (1 + erf)
    if half is None or half.op_type != "Mul" or x not in half.inputs \
            or not _near(const_scalar(_other(half, x)), 0.5):
        return None
    return [pre, half, erf, add, mul], mul.outputs[0]


def _cube_of(value: ir.Value | None) -> tuple[ir.Value, list[ir.Node]] | None:
    """(x, nodes) of ``Pow(x, 3)`` or ``x * x * x``."""
    node = value.producer() if value is not None else None
    if node is None:
        return None
    if node.op_type == "Pow" and len(node.inputs) == 2 and node.inputs[0] is not None \
            and _near(const_scalar(node.inputs[1]), 3.0):
        return node.inputs[0], [node]
    if node.op_type == "Mul" and len(node.inputs) == 2:
        for square, x in (node.inputs, node.inputs[::-1]):
            inner = square.producer() if square is not None else None
            if inner is not None and inner.op_type == "Mul" and x is not None \
                    and list(inner.inputs) == [x, x]:
                return x, [inner, node]
    return None


def match_tanh_gelu(tanh: ir.Node) -> tuple[list[ir.Node], ir.Value] | None:
    """(nodes, output) of ``0.5 * x * (1 + Tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))`` around
    ``tanh`` (GPT-2's ``gelu_new``; the cube as ``Pow(x, 3)`` or ``x * x * x``), else None."""
    scale = tanh.inputs[0].producer() if tanh.inputs and tanh.inputs[0] is not None else None
    if scale is None or scale.op_type != "Mul" or len(scale.inputs) != 2:
        return None
    inner = next((v for v in scale.inputs if not _near(const_scalar(v), (2 / math.pi) ** 0.5)), None)
    if inner is None or sum(_near(const_scalar(v), (2 / math.pi) ** 0.5) for v in scale.inputs) != 1:
        return None
    add = inner.producer()
    if add is None or add.op_type != "Add" or len(add.inputs) != 2:
        return None
    for x, term in (add.inputs, add.inputs[::-1]):
        coef = term.producer() if term is not None else None
        if x is None or coef is None or coef.op_type != "Mul" or len(coef.inputs) != 2:
            continue
        cube = next((_cube_of(v) for v in coef.inputs
                     if v is not None and _near(const_scalar(_other(coef, v)), 0.044715)), None)
        if cube is not None and cube[0] is x:
            before = [*cube[1], coef, add, scale]
            break
    else:
        return None
    plus = _first_user(tanh.outputs[0])
    if plus is None or plus.op_type != "Add" or not _near(const_scalar(_other(plus, tanh.outputs[0])), 1.0):
        return None
    mul = _first_user(plus.outputs[0])
    if mul is None or mul.op_type != "Mul":
        return None
    t = _other(mul, plus.outputs[0])
    if t is x:  # (x * (1 + tanh)) * 0.5
        half = _first_user(mul.outputs[0])
        if half is None or half.op_type != "Mul" or not _near(const_scalar(_other(half, mul.outputs[0])), 0.5):
            return None
        return [*before, tanh, plus, mul, half], half.outputs[0]
    half = t.producer() if t is not None else None  # (x * 0.5) * (1 + tanh)
    if half is None or half.op_type != "Mul" or x not in half.inputs \
            or not _near(const_scalar(_other(half, x)), 0.5):
        return None
    return [half, *before, tanh, plus, mul], mul.outputs[0]


def gelu_groups(graph: ir.Graph, options: RecomputeOptions) -> list[RecomputeGroup]:
    """Case 1 of the module docstring."""
    groups = []
    for node in graph:
        if not recomputable(node, options):
            continue
        if node.op_type in GELU_OPS:
            found: tuple[list[ir.Node], ir.Value] | None = ([node], node.outputs[0])
        elif node.op_type == "Erf":
            found = match_erf_gelu(node)
        elif node.op_type == "Tanh":
            found = match_tanh_gelu(node)
        else:
            continue
        if found is None or not all(recomputable(n, options) for n in found[0]):
            continue
        first = _first_user(found[1])
        if first is not None and first.op_type in options.gelu_consumers:
            groups.append(RecomputeGroup(f"gelu {node.name}", tuple(found[0]), option="gelu"))
    return groups


def attn_dropout_groups(graph: ir.Graph, options: RecomputeOptions) -> list[RecomputeGroup]:
    """Case 2 of the module docstring."""
    groups = []
    for node in graph:
        if not is_dropout_with_mask(node) or not recomputable(node, options):
            continue
        data = node.inputs[0]
        producer = data.producer() if data is not None else None
        # exporters may put a dtype Cast / Identity between them (HF GPT-2: softmax(...).type(v))
        while producer is not None and producer.op_type in ("Cast", "Identity") and producer.inputs:
            source = producer.inputs[0]
            producer = source.producer() if source is not None else None
        first = _first_user(node.outputs[0])
        if producer is not None and producer.op_type == "Softmax" and first is not None \
                and first.op_type in ("MatMul", "FusedMatMul"):
            groups.append(RecomputeGroup(f"attention dropout {node.name}", (node,),
                                         option="attn_dropout"))
    return groups


# ---- transformer layers --------------------------------------------------------------------


def _edge_count(value: ir.Value) -> int:
    return sum(1 for u in value.uses() if role_of(u.node) == Role.FORWARD)


def _end_from(gelu_out: ir.Value) -> ir.Value | None:
    value, seen_dropout = gelu_out, False
    for _ in range(MAX_END_WALK):
        user = _first_user(value)
        if user is None or not user.outputs:
            return None
        if not seen_dropout and user.op_type in ("Dropout", "BiasDropout"):
            seen_dropout = True
        elif seen_dropout and user.op_type in LAYER_NORM_OPS:
            return user.outputs[0]
        value = user.outputs[0]
    return None


def reference_layers(graph: ir.Graph, options: RecomputeOptions) -> list[list[ir.Node]]:
    """Layers between the reference's start and end edges; [] when the counts differ."""
    forward = [n for n in graph if role_of(n) == Role.FORWARD]
    starts = [n.outputs[0] for n in forward if n.op_type in LAYER_START_OPS and n.outputs
              and _edge_count(n.outputs[0]) == options.layer_start_edges]
    ends = []
    for node in forward:
        gelu = node.outputs[0] if node.op_type in GELU_OPS else None
        if node.op_type in ("Erf", "Tanh"):
            match = match_erf_gelu(node) if node.op_type == "Erf" else match_tanh_gelu(node)
            gelu = match[1] if match else None
        end = _end_from(gelu) if gelu is not None else None
        if end is not None and end not in ends:
            ends.append(end)
    if not starts or len(starts) != len(ends):
        return []
    layers = []
    for start, end in zip(starts, ends):
        below = _reachable([end.producer()], lambda n: [v.producer() for v in n.inputs if v is not None])
        above = _reachable([u.node for u in start.uses()],
                           lambda n: [u.node for o in n.outputs for u in o.uses()])
        layers.append([n for n in forward if id(n) in below and id(n) in above])
    return layers


def _reachable(roots: Iterable[ir.Node | None],
               step: Callable[[ir.Node], Iterable[ir.Node | None]]) -> set[int]:
    seen: set[int] = set()
    todo = [n for n in roots if n is not None]
    while todo:
        node = todo.pop()
        if id(node) in seen or role_of(node) != Role.FORWARD:
            continue
        seen.add(id(node))
        todo.extend(n for n in step(node) if n is not None)
    return seen


def layer_scope(node: ir.Node, pattern: re.Pattern[str]) -> str | None:
    """The outermost numbered module scope of ``node`` (``model.bert.encoder.layer.3``)."""
    scopes: list[str] = []
    raw = node.metadata_props.get(SCOPE_KEYS[0])
    if raw:
        scopes = [s.strip(" '\"") for s in raw.strip("[]").split(",")]
    elif node.metadata_props.get(SCOPE_KEYS[1]):
        scopes = [part.split(":")[0].strip() for part in node.metadata_props[SCOPE_KEYS[1]].split("/")]
    elif node.name and "/" in node.name:
        parts = [p for p in node.name.split("/") if p][:-1]
        scopes = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return next((s for s in scopes if pattern.search(s)), None)


def scope_layers(graph: ir.Graph, options: RecomputeOptions) -> list[list[ir.Node]]:
    """Forward nodes grouped by numbered module scope, in order of first appearance."""
    pattern = re.compile(options.layer_scope_pattern)
    layers: dict[str, list[ir.Node]] = {}
    for node in graph:
        if role_of(node) == Role.FORWARD:
            scope = layer_scope(node, pattern)
            if scope is not None:
                layers.setdefault(scope, []).append(node)
    return list(layers.values())


LAYER_SEARCHES = (
    "the reference's start / end edges (a LayerNorm or Dropout output with layer_start_edges "
    "forward edges; Gelu -> Dropout -> LayerNorm)",
    "numbered module scopes (node metadata pkg.torch.onnx.name_scopes / namespace, or node "
    "names such as /h.3/...) matching layer_scope_pattern",
    "blocks repeating along the residual stream (a residual Add read by a LayerNorm, RMSNorm "
    "or their decomposition)",
)


def find_layers(graph: ir.Graph, options: RecomputeOptions) -> tuple[list[list[ir.Node]], str]:
    """The transformer layers and the search that found them (module docstring, case 3)."""
    for search, find in zip(LAYER_SEARCHES, (reference_layers, scope_layers, _residual)):
        layers = find(graph, options)
        if layers:
            return layers, search
    return [], ""


def _residual(graph: ir.Graph, options: RecomputeOptions) -> list[list[ir.Node]]:
    return residual_layers(graph)


def transformer_layer_groups(graph: ir.Graph, options: RecomputeOptions) -> list[RecomputeGroup]:
    """Case 3 of the module docstring."""
    layers, _ = find_layers(graph, options)
    count = len(layers) - 1
    if 0 < options.number_recompute_layers < count:
        count = options.number_recompute_layers
    return [RecomputeGroup(f"layer {i}", tuple(n for n in layer if recomputable(n, options)),
                           keep_outputs=True, option="transformer_layers")
            for i, layer in enumerate(layers[:max(count, 0)])]
