"""GeluFusionPass: the GELU an exporter writes as a chain of elementwise ops, as one Gelu node.

torch's legacy exporter (and any opset below 20) writes ``F.gelu`` as its formula:

* erf form: ``x * 0.5 * (1 + Erf(x / sqrt(2)))`` (5 nodes);
* tanh form (``approximate="tanh"``, HF ``gelu_new``): ``0.5 * x * (1 + Tanh(sqrt(2 / pi) *
  (x + 0.044715 * x ** 3)))`` (8 nodes), or HF's ``gelu_fast``, the same function written
  ``0.5 * x * (1 + Tanh(x * sqrt(2 / pi) * (1 + 0.044715 * x * x)))`` (9 nodes).

In a training graph each node of the chain is a pass over the activation in the forward, keeps
its output alive for the backward, and gets a gradient of its own (the tanh form's backward is
12 nodes, the sum of three contributions to ``x`` included). One Gelu node is one pass forward,
keeps nothing but ``x``, and its gradient rule (passes/autodiff/rules/elementwise.py) is 11 (erf)
or 15 (tanh, x clipped first) nodes computed from ``x`` alone. The fused node is the standard ``Gelu``
(``approximate`` "none" / "tanh") where the model's opset is 20 or newer, else onnxruntime's
``com.microsoft`` ``Gelu`` / ``FastGelu`` (same formulas; stock onnxruntime has them on CPU and
CUDA). Measured on the GPT-2-like benchmark model (tools/bench_training.py's models): see the
figures in this pass's test module docstring and the closing note of the issue.

Matched (anything else is left alone): the constants 0.5, 1 and 3 exactly, the irrational ones
(sqrt 2, sqrt(2 / pi), 0.044715) within 1e-4 relative of their values (1e-3 in float16, 8e-3 in
bfloat16), one finite element each, of a rank at most x's (a larger
one would broadcast the result up), each a Constant node or an initializer that is not a graph
input and not marked a parameter or buffer (``passes.exports.ClassifyWeightsPass``; a trained
scalar that happens to hold 0.5 stays a weight); ``x / sqrt 2`` or ``x * (1 / sqrt 2)``; the cube as ``Pow(x, 3)``,
``x * x * x`` in either association (``gelu_fast``: ``0.044715 * x * x`` in any association,
multiplied by ``x * sqrt(2 / pi)``); the three factors ``x``, ``0.5`` and ``(1 + ...)`` of the
result multiplied in any order and association; every intermediate read only inside the pattern
(not in an If/Loop body) and not a graph output; ``x`` a float tensor (float32, or any float type for the standard op).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff.engine import WEIGHT_KIND_KEY
from passes.kernels._graph import (
    DEFAULT_DOMAINS,
    MS_DOMAIN,
    const_array,
    default_opset,
    only_use,
    take_over,
)

# How far a constant may be from its exact value, by its dtype's precision (float16 rounds
# sqrt(2) by 1.1e-4 relative, bfloat16 by up to 3.9e-3).
_RTOL = {ir.DataType.FLOAT16: 1e-3, ir.DataType.BFLOAT16: 8e-3}
_DEFAULT_RTOL = 1e-4
# Constants every float type holds exactly: matched only when equal (Pow(x, 3.0003) is not a cube).
_EXACT = frozenset({0.5, 1.0, 3.0})
_NOT_CONSTANT_KINDS = ("parameter", "buffer")
_TANH_K = math.sqrt(2.0 / math.pi)
_TANH_A = 0.044715
# The float types each fused op takes: onnxruntime's com.microsoft Gelu/FastGelu CPU kernels
# are float32 only (its CUDA ones take float16 too, but a CPU session would then fail to load).
_MS_TYPES = (ir.DataType.FLOAT,)
_STD_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)


def _scalar(value: ir.Value | None) -> tuple[float, int, ir.DataType | None] | None:
    """(value, rank, dtype) of a one-element constant: a Constant node's output, or an
    initializer that is not a graph input and not marked a parameter or buffer (a trained
    scalar is not a GELU constant, whatever its value)."""
    if value is None:
        return None
    producer = value.producer()
    if producer is None:
        kind = value.metadata_props.get(WEIGHT_KIND_KEY)
        if not value.is_initializer() or value.is_graph_input() or kind in _NOT_CONSTANT_KINDS:
            return None
    elif producer.op_type != "Constant" or producer.domain not in DEFAULT_DOMAINS:
        return None
    array = const_array(value)
    if array is None or array.size != 1:
        return None
    return float(array.reshape(-1)[0]), array.ndim, ir.DataType.from_numpy(array.dtype)


def _op(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    """The default-domain binary ``op_types`` node that makes ``value``, else None."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type not in op_types or node.domain not in DEFAULT_DOMAINS:
        return None
    return node if len(node.inputs) == 2 and all(v is not None for v in node.inputs) else None


def _pair(node: ir.Node, match) -> ir.Value | None:  # type: ignore[no-untyped-def]
    """The input of a binary ``node`` that is not the one ``match`` accepts, if one is."""
    a, b = node.inputs
    if match(b):
        return a
    if match(a):
        return b
    return None


class _Match:
    def __init__(self, graph: ir.Graph, keep: frozenset[str]) -> None:
        self.graph = graph
        self.keep = keep
        self.outputs = {id(v) for v in graph.outputs}
        self.const_rank = 0  # the largest rank of the constants of the pattern being matched

    def near(self, value: ir.Value | None, target: float) -> bool:
        """``value`` is a one-element constant equal to ``target`` (within its dtype's precision)."""
        found = _scalar(value) if value is None or value.name not in self.keep else None
        if found is None:
            return False
        got, rank, dtype = found
        tolerance = 0.0 if target in _EXACT else _RTOL.get(dtype, _DEFAULT_RTOL) * abs(target)  # type: ignore[arg-type]
        if not abs(got - target) <= tolerance:  # NaN is never near
            return False
        self.const_rank = max(self.const_rank, rank)
        return True

    def single_user(self, value: ir.Value) -> ir.Node | None:
        users = {id(u): u for u, _ in value.uses()}
        if len(users) != 1 or id(value) in self.outputs:
            return None
        user = next(iter(users.values()))
        return user if user.graph is self.graph else None  # not into an If/Loop body

    def erf_input(self, erf: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
        """x of ``Erf(x / sqrt 2)``."""
        pre = _op(erf.inputs[0], "Div", "Mul")
        if pre is None or not only_use(erf.inputs[0], self.graph, erf):
            return None
        if pre.op_type == "Div":
            x = pre.inputs[0]
            return (x, [pre]) if x is not None and self.near(pre.inputs[1], math.sqrt(2.0)) else None
        x = _pair(pre, lambda v: self.near(v, 1.0 / math.sqrt(2.0)))
        return (x, [pre]) if x is not None else None

    def cube_of(self, value: ir.Value, x: ir.Value | None) -> tuple[ir.Value, list[ir.Node]] | None:
        """(x, nodes) of ``value = x ** 3`` (Pow(x, 3), x * x * x), x given or found."""
        node = _op(value, "Pow", "Mul")
        if node is None:
            return None
        if node.op_type == "Pow":
            base = node.inputs[0]
            ok = self.near(node.inputs[1], 3.0) and (x is None or base is x)
            return (base, [node]) if ok and base is not None else None
        a, b = node.inputs
        for square, single in ((a, b), (b, a)):
            sq = _op(square, "Mul")
            if sq is not None and single is not None and sq.inputs[0] is sq.inputs[1] is single \
                    and (x is None or single is x) and only_use(square, self.graph, node):
                return single, [sq, node]
        return None

    def tanh_input(self, tanh: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
        """x of ``Tanh(sqrt(2/pi) * (x + 0.044715 * x ** 3))``."""
        scaled = _op(tanh.inputs[0], "Mul")
        if scaled is None or not only_use(tanh.inputs[0], self.graph, tanh):
            return None
        inner = _pair(scaled, lambda v: self.near(v, _TANH_K))
        add = _op(inner, "Add")
        if add is None or not only_use(inner, self.graph, scaled):
            return None
        for x, term in (add.inputs, add.inputs[::-1]):
            mul = _op(term, "Mul")
            if mul is None or not only_use(term, self.graph, add):
                continue
            cube = _pair(mul, lambda v: self.near(v, _TANH_A))
            found = self.cube_of(cube, x) if cube is not None and only_use(cube, self.graph, mul) else None
            if found is not None and x is not None:
                return x, [scaled, add, mul, *found[1]]
        return None

    def fast_tanh_input(self, tanh: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
        """x of ``Tanh((x * sqrt(2/pi)) * (1 + 0.044715 * x * x))`` (HF's ``gelu_fast``), the
        products in any order."""
        scaled = _op(tanh.inputs[0], "Mul")
        if scaled is None or not only_use(tanh.inputs[0], self.graph, tanh):
            return None
        for p, q in (scaled.inputs, scaled.inputs[::-1]):
            xk, add = _op(p, "Mul"), _op(q, "Add")
            if xk is None or add is None or not only_use(p, self.graph, scaled) \
                    or not only_use(q, self.graph, scaled):
                continue
            x = _pair(xk, lambda v: self.near(v, _TANH_K))
            term = _pair(add, lambda v: self.near(v, 1.0))
            if x is None or term is None or not only_use(term, self.graph, add):
                continue
            square = self.scaled_square(term, x)
            if square is not None:
                return x, [scaled, xk, add, *square]
        return None

    def scaled_square(self, value: ir.Value, x: ir.Value) -> list[ir.Node] | None:
        """The nodes of ``value = 0.044715 * x * x`` in any order and association."""
        node = _op(value, "Mul")
        if node is None:
            return None
        a, b = node.inputs
        for inner, single in ((a, b), (b, a)):  # (0.044715 * x) * x
            scaled_x = _op(inner, "Mul")
            if single is x and scaled_x is not None and only_use(inner, self.graph, node) \
                    and _pair(scaled_x, lambda v: self.near(v, _TANH_A)) is x:
                return [scaled_x, node]
        square = _pair(node, lambda v: self.near(v, _TANH_A))  # 0.044715 * (x * x)
        sq = _op(square, "Mul")
        if sq is not None and sq.inputs[0] is sq.inputs[1] is x and only_use(square, self.graph, node):
            return [sq, node]
        return None

    def product(self, one_plus: ir.Value, x: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
        """(output, nodes) of ``x * 0.5 * one_plus`` in any order and association."""
        nodes: list[ir.Node] = []
        have_x = have_half = False
        current = one_plus
        while not (have_x and have_half):
            user = self.single_user(current)
            if user is None or user.op_type != "Mul" or user.domain not in DEFAULT_DOMAINS \
                    or len(user.inputs) != 2 or user.inputs[0] is user.inputs[1]:
                return None
            other = user.inputs[1] if user.inputs[0] is current else user.inputs[0]
            if other is x and not have_x:
                have_x = True
            elif self.near(other, 0.5) and not have_half:
                have_half = True
            else:
                half = _op(other, "Mul")
                if half is None or have_x or have_half or not only_use(other, self.graph, user) \
                        or _pair(half, lambda v: self.near(v, 0.5)) is not x:
                    return None
                nodes.append(half)
                have_x = have_half = True
            nodes.append(user)
            current = user.outputs[0]
        return current, nodes

    def gelu(self, node: ir.Node) -> tuple[ir.Value, ir.Value, list[ir.Node], str] | None:
        """(x, output, nodes, approximate) of a GELU whose Erf or Tanh is ``node``."""
        self.const_rank = 0
        found = self.erf_input(node) if node.op_type == "Erf" else \
            (self.tanh_input(node) or self.fast_tanh_input(node))
        if found is None:
            return None
        x, before = found
        add = self.single_user(node.outputs[0])
        if add is None or add.op_type != "Add" or add.domain not in DEFAULT_DOMAINS or len(add.inputs) != 2 \
                or _pair(add, lambda v: self.near(v, 1.0)) is not node.outputs[0]:
            return None
        product = self.product(add.outputs[0], x)
        if product is None:
            return None
        out, after = product
        if self.const_rank and (x.shape is None or len(x.shape) < self.const_rank):
            return None  # a [1, 1] constant would broadcast a lower-rank x up: not Gelu(x)'s shape
        approximate = "none" if node.op_type == "Erf" else "tanh"
        return x, out, [*before, node, add, *after], approximate


def _drop_unread_constants(graph: ir.Graph, values: list[ir.Value]) -> None:
    """The formula's constants that nothing reads any more (Constant nodes, initializers that
    are not graph inputs)."""
    outputs = {id(v) for v in graph.outputs}
    for value in {id(v): v for v in values}.values():
        if value.uses() or id(value) in outputs:
            continue
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant" and producer.graph is graph:
            graph.remove(producer, safe=True)
        elif producer is None and value.is_initializer() and not value.is_graph_input() \
                and graph.initializers.get(value.name or "") is value:
            graph.initializers.pop(value.name or "")


class GeluFusionPass(InPlacePass):
    """See the module docstring. ``contrib=False``: below opset 20, leave the chains alone (no
    ``com.microsoft`` op in the result). ``keep``: names of values never taken for a constant of
    the formula (weights to train that the weight classification calls constants)."""

    def __init__(self, contrib: bool = True, keep: Iterable[str] = ()) -> None:
        super().__init__()
        self.contrib = contrib
        self.keep = frozenset(keep)

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        standard = default_opset(model) >= 20
        if not standard and not self.contrib:
            return PassResult(model, False)
        match = _Match(graph, self.keep)
        fused = 0
        for node in list(graph):
            if node.op_type not in ("Erf", "Tanh") or node.domain not in DEFAULT_DOMAINS or node.graph is not graph:
                continue
            found = match.gelu(node)
            if found is None:
                continue
            x, out, nodes, approximate = found
            if x.dtype not in (_STD_TYPES if standard else _MS_TYPES):
                continue
            if standard:
                gelu = ir.node("Gelu", [x], attributes={"approximate": approximate})
            else:
                gelu = ir.node("Gelu" if approximate == "none" else "FastGelu", [x], domain=MS_DOMAIN)
                model.opset_imports.setdefault(MS_DOMAIN, 1)
            last = nodes[-1]
            gelu.name = f"{last.name}/gelu_fusion" if last.name else None
            gelu.outputs[0].shape, gelu.outputs[0].type = out.shape, out.type
            gelu.metadata_props.update(last.metadata_props)
            graph.insert_after(last, gelu)
            take_over(graph, out, gelu.outputs[0])
            read = [v for n in nodes for v in n.inputs if v is not None]
            graph.remove(nodes, safe=True)
            _drop_unread_constants(graph, read)
            fused += 1
        return PassResult(model, fused > 0)
