"""The autodiff engine: the cross-cutting work that rules do not do.

Given a forward graph, a loss value and the values to differentiate:

1. walk forward from the trained values along differentiable edges (float tensors,
   inputs the rule marks differentiable) and backward from the loss; the nodes on
   both walks are the only ones that get gradient code;
2. visit those nodes in reverse topological order, sum the gradient contributions of
   each output (fan-out), call the op's rule, un-broadcast and cast each input
   gradient to the input's shape and dtype;
3. expose ``<name>_grad`` graph outputs for the trained values.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence

import onnx
import onnx_ir as ir

from passes.autodiff.builder import NodeView, OpBuilder, Var, scope_taken_names, shape_dims
from passes.autodiff.errors import GradientError
from passes.autodiff.registry import GradRule, lookup
from passes.autodiff.vjp import VJP_KEY
from passes.marks import GRAD_OF_KEY, GRADIENT_OF_KEY, OUTPUT_KEY, STAGE_KEY, OutputRole, Role
from passes.subgraphs import has_subgraphs, node_subgraphs

# The mark passes.exports.ClassifyWeightsPass puts on initializers (parameter/buffer/constant);
# when present, the default trained set is the parameters.
WEIGHT_KIND_KEY = "gradgraph.weight_kind"

# Error messages show at most this many value names on the path from a node to the loss.
MAX_PATH_SHOWN = 64

FLOAT_TYPES = frozenset(
    {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16}
)


# What to do about a trained name without a gradient (build_gradient_graph / gradgraph grad
# take allow_unused; the training build only trains names that have one).
UNUSED_HINT = ("do not train it, or pass allow_unused=True (gradgraph grad --allow-unused) "
               "to get a zero gradient for it")


@dataclasses.dataclass(frozen=True)
class GradientOptions:
    """Options of the gradient builder."""

    # Give zero gradients to trained values that do not reach the loss instead of failing.
    allow_unused: bool = False
    # Leave trained values that do not reach the loss (or reach it only through ops without a
    # gradient) without a gradient output, silently: PyTorch's ``None`` gradient (ORTModule).
    omit_unused: bool = False
    # Take the loss gradient from an extra graph input ``<loss><suffix>`` instead of ones.
    seed_from_input: bool = False
    # Suffix of the gradient outputs (and of the seed input).
    grad_suffix: str = "_grad"


def is_float(value: ir.Value) -> bool:
    return value.dtype is None or value.dtype in FLOAT_TYPES


def captured_values(node: ir.Node) -> list[ir.Value]:
    """Outer-scope values read inside ``node``'s subgraphs (If/Loop/Scan bodies)."""
    found: dict[int, ir.Value] = {}
    for graph in node_subgraphs(node):
        _collect_outer(graph, found)
    return list(found.values())


def _collect_outer(graph: ir.Graph, found: dict[int, ir.Value]) -> None:
    local = {id(v) for v in graph.inputs} | {id(v) for v in graph.initializers.values()}
    for node in graph:
        local.update(id(o) for o in node.outputs)
    for node in graph:
        for value in node.inputs:
            if value is not None and id(value) not in local:
                found.setdefault(id(value), value)
        for inner in captured_values(node):
            if id(inner) not in local:
                found.setdefault(id(inner), inner)


def _edges(node: ir.Node) -> list[tuple[int, ir.Value]]:
    edges = [(i, v) for i, v in enumerate(node.inputs) if v is not None]
    if has_subgraphs(node):
        base = len(node.inputs)
        edges += [(base + k, v) for k, v in enumerate(captured_values(node))]
    return edges


def is_quantized(value: ir.Value) -> bool:
    """An output of QuantizeLinear: it carries the straight-through gradient (in floating point)."""
    producer = value.producer()
    return producer is not None and producer.op_type == "QuantizeLinear" and producer.domain in ("", "ai.onnx")


# Ops with a float output whose derivative is zero almost everywhere (in rules/nondiff.py):
# PyTorch gives their inputs zero gradients, not None.
ZERO_DERIVATIVE_OPS = frozenset({"Round", "Floor", "Ceil", "Sign"})


def _unread_inputs(node: ir.Node, wanted: set[int]) -> frozenset[int]:
    """Inputs of ``node`` that none of its outputs in ``wanted`` (ids) depends on: a
    training-mode BatchNormalization's running mean and variance (inputs 3, 4) feed only its
    running-statistics outputs (1, 2), not Y, which is normalized with the batch's statistics."""
    if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and len(node.inputs) >= 5 \
            and (bool(node.attributes.get_int("training_mode")) or len(node.outputs) > 1) \
            and not any(id(o) in wanted for o in node.outputs[1:3]):
        return frozenset({3, 4})
    return frozenset()


def _is_diff_edge(rule: GradRule | None, index: int, value: ir.Value) -> bool:
    if is_quantized(value):  # only into DequantizeLinear's quantized input
        return rule is not None and rule.op_type == "DequantizeLinear" and index == 0
    return is_float(value) and (rule is None or rule.is_diff_input(index))


def _describe(value: ir.Value) -> str:
    return value.name or "<unnamed>"


class GradientSweep:
    """Builds the gradient of ``loss`` w.r.t. ``weights`` inside ``model`` (in place)."""

    def __init__(self, model: ir.Model, loss: str, weights: Sequence[str] | None,
                 options: GradientOptions | None = None) -> None:
        self.model = model
        self.graph = model.graph
        self.options = options or GradientOptions()
        self.opset = model.opset_imports.get("", None) or model.opset_imports.get("ai.onnx", 0)
        if self.opset < 13:
            raise GradientError(
                f"the model imports ONNX opset {self.opset}; gradgraph needs opset >= 13 "
                "(convert it with onnx.version_converter.convert_version(model, 13))",
                opset=self.opset,
            )
        self.values = self._index_values()
        self.loss = self._find_loss(loss)
        self.weights = self._find_weights(weights)
        self._vjp = self._vjp_terms()
        self._all_initializers = weights is None
        self.opset_imports = dict(model.opset_imports)
        self.b = OpBuilder(self.opset, self.opset_imports)
        self._exposed_names: set[str] = set()
        self._rules = {id(n): lookup(n.domain, n.op_type, self._opset_of(n)) for n in self.graph}

    # ---- inputs ---------------------------------------------------------------------------
    def _opset_of(self, node: ir.Node) -> int:
        domain = "" if node.domain == "ai.onnx" else node.domain
        return self.opset_imports.get(domain, self.opset if domain == "" else 1)

    def _index_values(self) -> dict[str, ir.Value]:
        values: dict[str, ir.Value] = {}
        for v in self.graph.inputs:
            if v.name is not None:  # an unnamed input cannot be asked for by name
                values[v.name] = v
        for name, v in self.graph.initializers.items():
            values[name] = v
        for node in self.graph:
            for out in node.outputs:
                if out.name:
                    values[out.name] = out
        return values

    def _find_loss(self, name: str) -> ir.Value:
        value = self.values.get(name)
        if value is None:
            outputs = ", ".join(repr(v.name) for v in self.graph.outputs)
            raise GradientError(
                f"loss {name!r} is not a tensor of the graph; graph outputs are: {outputs}"
            )
        if value.dtype is not None and value.dtype not in FLOAT_TYPES:
            raise GradientError(
                f"loss {name!r} has type {value.dtype.name}; the loss must be a floating-point "
                "tensor (float, float16, bfloat16 or double)"
            )
        return value

    def _find_weights(self, names: Sequence[str] | None) -> list[ir.Value]:
        if names is None:  # the default trained set; those off the loss path are dropped later
            floats = [v for v in self.graph.initializers.values() if v.dtype in FLOAT_TYPES]
            if any(WEIGHT_KIND_KEY in v.metadata_props for v in floats):  # ClassifyWeightsPass ran
                return [v for v in floats if v.metadata_props.get(WEIGHT_KIND_KEY) == "parameter"]
            return floats
        found = []
        for name in names:
            value = self.values.get(name)
            if value is None or not (value.is_graph_input() or value.is_initializer()):
                hint = ""
                node = value.producer() if value is not None else None
                if node is not None:  # e.g. a folded parameter an export's recovery recomputes
                    sources = [v.name for v in node.inputs if v is not None and v.is_initializer()]
                    hint = f"; it is computed by a {node.op_type} node" + (
                        f" from {sources}: train {', '.join(map(repr, sources))} instead" if sources else "")
                raise GradientError(
                    f"trained name {name!r} is neither an initializer nor a graph input of the model{hint}"
                )
            if value.dtype is not None and value.dtype not in FLOAT_TYPES:
                raise GradientError(
                    f"trained name {name!r} has type {value.dtype.name}; only floating-point "
                    "tensors have gradients"
                )
            found.append(value)
        return found

    # ---- reachability ---------------------------------------------------------------------
    def _reachable(self) -> tuple[list[ir.Node], set[int], dict[int, ir.Value]]:
        forward = {id(w) for w in self.weights}
        for node in self.graph:
            rule = self._rules[id(node)]
            if any(id(v) in forward and _is_diff_edge(rule, i, v) for i, v in _edges(node)):
                forward.update(id(o) for o in node.outputs if is_float(o) or is_quantized(o))
        needs: set[int] = set()
        toward_loss: dict[int, ir.Value] = {}
        needs.update(id(v) for v in self._seed_targets() if id(v) in forward)
        active: list[ir.Node] = []
        for node in reversed(list(self.graph)):
            out = next((o for o in node.outputs if id(o) in needs), None)
            if out is None:
                continue
            active.append(node)
            rule = self._rules[id(node)]
            unread = _unread_inputs(node, needs)
            for i, v in _edges(node):
                if id(v) in forward and _is_diff_edge(rule, i, v) and i not in unread:
                    needs.add(id(v))
                    toward_loss.setdefault(id(v), out)
        return active, needs, toward_loss

    def _loss_text(self) -> str:
        """The loss as the user named it: the scaled loss of mixed precision (a ``Mul`` of the
        loss and the scale, marked by LossScalePass) is shown as the loss it scales."""
        producer = self.loss.producer()
        if (self.loss.metadata_props.get(OUTPUT_KEY) == OutputRole.SCALED_LOSS.value
                and producer is not None and producer.inputs and producer.inputs[0] is not None):
            return f"{producer.inputs[0].name!r} (scaled for mixed precision as {self.loss.name!r})"
        return repr(self.loss.name)

    def _blocking(self, weight: ir.Value) -> list[tuple[ir.Node, int]]:
        """Where ``weight`` (which has no differentiable path to the loss) meets a
        non-differentiable input on its ways there: (node, input index) pairs in graph order;
        [] when the loss does not depend on it at all."""
        toward: set[int] = {id(self.loss)}
        for node in reversed(list(self.graph)):
            if any(id(o) in toward for o in node.outputs):
                unread = _unread_inputs(node, toward)
                toward.update(id(v) for i, v in _edges(node) if i not in unread)
        if id(weight) not in toward:
            return []
        forward = {id(weight)}
        found = []
        for node in self.graph:
            rule = self._rules[id(node)]
            for i, v in _edges(node):
                if id(v) not in forward:
                    continue
                if _is_diff_edge(rule, i, v):
                    forward.update(id(o) for o in node.outputs if is_float(o) or is_quantized(o))
                elif any(id(o) in toward for o in node.outputs):
                    found.append((node, i))
        return found

    def _carried_to_loss(self) -> set[int]:
        """Values from which a differentiable path leads to the loss (ids)."""
        carried = {id(self.loss)}
        for node in reversed(list(self.graph)):
            if any(id(o) in carried for o in node.outputs):
                rule = self._rules[id(node)]
                unread = _unread_inputs(node, carried)
                carried.update(id(v) for i, v in _edges(node) if _is_diff_edge(rule, i, v) and i not in unread)
        return carried

    def _blocked_at(self, weight: ir.Value) -> str:
        """The first place :meth:`_blocking` finds, e.g. "input 2 (max) of Clip node 'clip'";
        "" when the loss does not depend on ``weight`` at all."""
        found = self._blocking(weight)
        if not found:
            return ""
        node, index = found[0]
        return f"{self._input_text(node, index)} of {node.op_type} node {node.name!r}"

    def _input_text(self, node: ir.Node, index: int) -> str:
        if index >= len(node.inputs):
            return "a value its subgraph reads"
        try:
            domain = "" if node.domain == "ai.onnx" else node.domain
            schema = onnx.defs.get_schema(node.op_type, self._opset_of(node), domain)
            formal = schema.inputs[min(index, len(schema.inputs) - 1)].name
        except (onnx.defs.SchemaError, IndexError):
            return f"input {index}"
        return f"input {index} ({formal})"

    def _seed_targets(self) -> list[ir.Value]:
        """The values whose gradient is seeded: the loss, or the outputs of a VJP loss."""
        return [output for output, _ in self._vjp] if self._vjp else [self.loss]

    def _vjp_terms(self) -> list[tuple[ir.Value, ir.Value]]:
        """(output, seed) pairs when the loss is the VJP scalar of :class:`VjpSeedPass`
        (``Sum`` of ``ReduceSum(Mul(output, seed))``, the seed a graph input of the output's
        type and shape): the gradient of each output is then its seed, used as it is rather
        than differentiated through the product and the sum (which stay unread, so a split
        drops them). Else []."""
        if self.graph.metadata_props.get(VJP_KEY) != self.loss.name:
            return []
        total = self.loss.producer()
        sums = list(total.inputs) if total is not None and total.op_type == "Sum" else [self.loss]
        inputs = {id(v) for v in self.graph.inputs}
        pairs = []
        for term in sums:
            reduce = term.producer() if term is not None else None
            if reduce is None or reduce.op_type != "ReduceSum" or len(reduce.inputs) != 1:
                return []
            product = reduce.inputs[0].producer() if reduce.inputs[0] is not None else None
            if product is None or product.op_type != "Mul":
                return []
            output, seed = product.inputs
            if (output is None or seed is None or id(seed) not in inputs
                    or seed.shape != output.shape or seed.dtype != output.dtype):
                return []
            pairs.append((output, seed))
        return pairs

    def _path(self, value: ir.Value, toward_loss: dict[int, ir.Value]) -> list[str]:
        path = [_describe(value)]
        while id(value) in toward_loss and len(path) < MAX_PATH_SHOWN:
            value = toward_loss[id(value)]
            path.append(_describe(value))
        return path

    # ---- sweep ------------------------------------------------------------------------------
    def build(self) -> dict[str, ir.Value]:
        """Emit the gradient nodes and outputs; returns {weight name: grad output value}."""
        active, needs, toward_loss = self._reachable()
        if self._all_initializers:
            self.weights = [w for w in self.weights if id(w) in needs]
            if not self.weights:
                raise GradientError(f"no parameter (floating-point initializer) reaches loss "
                                    f"{self._loss_text()}; --list-weights shows each initializer "
                                    "and why it is not trained; to differentiate others, name them "
                                    "(grad/check --weights, weights_to_train in the Python API)")
        unused = [w for w in self.weights if id(w) not in needs]
        if self.options.omit_unused:
            # PyTorch's convention: a zero gradient where a way to the loss runs through an op
            # whose derivative is zero (round, floor, ceil, sign), None where no way carries one
            carried = self._carried_to_loss() if unused else set()
            zero = {id(w) for w in unused
                    if any(n.op_type in ZERO_DERIVATIVE_OPS and id(n.outputs[0]) in carried
                           for n, _ in self._blocking(w))}
            self.weights = [w for w in self.weights if id(w) in needs or id(w) in zero]
            unused = []
        if unused and not self.options.allow_unused:
            w = unused[0]
            blocked = self._blocked_at(w)
            if blocked:
                raise GradientError(
                    f"trained name {w.name!r} does not reach loss {self._loss_text()} through any "
                    f"differentiable path: its way there runs through {blocked}, which has no "
                    f"gradient ({UNUSED_HINT})")
            unread = next(((n, i) for n in self.graph for i, v in enumerate(n.inputs)
                           if v is w and i in _unread_inputs(n, set())), None)
            if unread is not None:
                node, index = unread
                raise GradientError(
                    f"trained name {w.name!r} does not reach loss {self._loss_text()}: it is input "
                    f"{index} of {node.op_type} node {node.name!r}, whose output the loss reads does "
                    f"not depend on it (in training mode Y is normalized with the batch's statistics; "
                    f"the running ones only feed their update) ({UNUSED_HINT})")
            raise GradientError(
                f"trained name {w.name!r} does not reach loss {self._loss_text()}: no path of the "
                f"graph connects them ({UNUSED_HINT})")
        for w in unused:
            blocked = self._blocked_at(w)
            if blocked:
                warnings.warn(f"the gradient of {w.name!r} is zero: it reaches loss "
                              f"{self._loss_text()} only through {blocked}, which has no gradient",
                              stacklevel=2)
        b = self.b
        b.marks = {STAGE_KEY: Role.BACKWARD.value}
        seeds: dict[int, list[Var]] = {}
        if self._vjp:
            for output, seed in self._vjp:
                if id(output) in needs:
                    seeds.setdefault(id(output), []).append(b.wrap(seed))
        elif id(self.loss) in needs:
            seeds[id(self.loss)] = [self._seed()]
        total = self._sweep(active, needs, toward_loss, seeds)

        b.prefix = "grad_outputs"
        results: dict[str, ir.Value] = {}
        for w in self.weights:
            g = total(w) if id(w) in needs else None
            if g is None:
                g = b.zeros_like(b.wrap(w))
            results[w.name or ""] = self._expose(g, w)
        scope_taken_names(self.graph, b.nodes, "grad")  # the model may hold builder constants
        self.graph.extend(b.nodes)
        for value in results.values():
            self.graph.outputs.append(value)
        return results

    def _sweep(self, active: list[ir.Node], needs: set[int], toward_loss: dict[int, ir.Value],
               seeds: dict[int, list[Var]]) -> Callable[[ir.Value], Var | None]:
        """Visit ``active`` in reverse order from the ``seeds`` gradients; returns ``total(value)``."""
        b = self.b
        outer = dict(b.marks)  # restored after each rule: nested sweeps (If bodies) share b
        contribs: dict[int, list[Var]] = {k: list(v) for k, v in seeds.items()}
        done: dict[int, Var | None] = {}

        def total(value: ir.Value) -> Var | None:
            if id(value) not in done:
                parts = contribs.get(id(value), [])
                if not parts:
                    done[id(value)] = None
                else:
                    b.prefix = f"{_describe(value)}_grad_sum"
                    done[id(value)] = parts[0] if len(parts) == 1 else b.Sum(*parts)
            return done[id(value)]

        for node in active:
            rule = self._rules[id(node)]
            path = self._path(node.outputs[0], toward_loss)
            if rule is None:
                raise GradientError(
                    f"no gradient rule for {node.domain or 'ai.onnx'}::{node.op_type} at opset "
                    f"{self._opset_of(node)}, and node {node.name!r} lies between the trained "
                    "names and the loss (freeze the weights before it, or register a rule with "
                    "passes.autodiff.grad_rule)",
                    op_type=node.op_type, domain=node.domain, opset=self._opset_of(node),
                    node=node.name, path=path,
                )
            out_grads = [total(o) if id(o) in needs else None for o in node.outputs]
            if all(g is None for g in out_grads):
                continue
            edges = _edges(node)
            mask = [False] * (max((i for i, _ in edges), default=-1) + 1)
            for i, v in edges:
                mask[i] = id(v) in needs and _is_diff_edge(rule, i, v)
            captured = [v for i, v in edges if i >= len(node.inputs)]
            b.prefix = f"{node.name or node.op_type}_grad"
            b.marks = {**outer, STAGE_KEY: Role.BACKWARD.value, GRAD_OF_KEY: node.name or ""}
            view = NodeView(node, b, mask, captured)
            try:
                in_grads = list(rule.fn(b, view, out_grads))
            except GradientError:
                raise
            except Exception as exc:  # noqa: BLE001 - re-raised with the node named
                raise GradientError(
                    f"the gradient rule for {node.op_type} failed: {type(exc).__name__}: {exc}"
                    f"{self._shapeless_hint(node)}",
                    op_type=node.op_type, domain=node.domain, opset=self._opset_of(node),
                    node=node.name, path=path,
                ) from exc
            out_shape = shape_dims(node.outputs[0].shape)
            for i, v in edges:
                g = in_grads[i] if i < len(in_grads) else None
                if g is None or not mask[i]:
                    continue
                if rule.broadcast:
                    g = b.unbroadcast(g, out_shape, b.wrap(v))
                if is_float(v):  # a quantized value's gradient stays in floating point
                    g = b.cast_to(g, v.dtype)
                contribs.setdefault(id(v), []).append(g)
            b.marks = dict(outer)

        return total

    def _shapeless_hint(self, node: ir.Node) -> str:
        """Where a rule's failure may come from values of unknown rank: those inputs of ``node``
        and the graph inputs declared without a shape, which no shape inference can give one."""
        unknown = [v.name for v in node.inputs if v is not None and v.shape is None]
        if not unknown:
            return ""
        declared = [v.name for v in self.graph.inputs if v.shape is None]
        hint = f" (no shape is known for {unknown}"
        if declared:
            hint += (f"; the model input(s) {declared} declare none: give them one, with named "
                     "dimensions for the sizes that vary")
        return hint + ")"

    def _seed(self) -> Var:
        b = self.b
        loss = b.wrap(self.loss)
        dtype = self.loss.dtype or ir.DataType.FLOAT
        if self.options.seed_from_input:
            seed = ir.Value(name=f"{self.loss.name}{self.options.grad_suffix}",
                            type=ir.TensorType(dtype), shape=self.loss.shape)
            self.graph.inputs.append(seed)
            return b.wrap(seed)
        if loss.rank == 0:
            return b.const(1.0, dtype)
        b.prefix = f"{self.loss.name}_grad_seed"
        return b.ones_like(loss)

    def _expose(self, g: Var, w: ir.Value) -> ir.Value:
        name = self._free_name(f"{w.name}{self.options.grad_suffix}")
        value = g.value
        producer = value.producer()
        owned = self.b.owns(value)
        # owned implies a producer; the None test only tells the type checker so
        if (not owned or producer is None or producer.op_type == "Constant"
                or value.is_graph_output() or value.name in self._exposed_names):
            value = self.b.Identity(g).value
        value.name = name
        value.type = w.type
        value.shape = w.shape
        value.metadata_props[GRADIENT_OF_KEY] = w.name or ""
        self._exposed_names.add(name)
        return value


    def _free_name(self, name: str) -> str:
        """``name``, or ``name_1``, ``name_2`` ... when the model already has a value so named
        (the output still carries the ``gradient_of`` mark that names its weight)."""
        taken = set(self.values) | self._exposed_names
        if name not in taken:
            return name
        k = 1
        while f"{name}_{k}" in taken:
            k += 1
        return f"{name}_{k}"


def build_gradient(model: ir.Model, loss: str, weights: Sequence[str] | None = None,
                   options: GradientOptions | None = None) -> dict[str, ir.Value]:
    """Add the gradient of ``loss`` w.r.t. ``weights`` to ``model`` in place."""
    return GradientSweep(model, loss, weights, options).build()


class GraphGradient(GradientSweep):
    """Vector-Jacobian product of a graph's values: the hook for rules of ops with subgraphs.

    ``seeds`` pairs values of ``graph`` with their incoming gradients (``Var`` of ``builder``,
    ``None`` for no gradient); ``wrt`` lists values the graph's nodes read (outer-scope values
    included). The gradient nodes go to ``builder.nodes``; ``graph`` itself is not modified.
    """

    def __init__(self, graph: ir.Graph, seeds: Sequence[tuple[ir.Value, Var | None]],
                 wrt: Sequence[ir.Value], builder: OpBuilder) -> None:
        self.graph = graph
        self.options = GradientOptions(allow_unused=True)
        self.opset = builder.opset
        self.opset_imports = dict(builder.opset_imports)
        self.b = builder
        self.weights = list(wrt)
        self._seeds = [(value, grad) for value, grad in seeds if grad is not None]
        self._rules = {id(n): lookup(n.domain, n.op_type, self._opset_of(n)) for n in graph}

    def _seed_targets(self) -> list[ir.Value]:
        return [value for value, _ in self._seeds]

    def gradients(self) -> list[Var | None]:
        """One gradient per ``wrt`` value, ``None`` where no seeded value depends on it."""
        active, needs, toward_loss = self._reachable()
        seeds: dict[int, list[Var]] = {}
        for value, grad in self._seeds:
            if id(value) in needs:
                seeds.setdefault(id(value), []).append(grad)
        total = self._sweep(active, needs, toward_loss, seeds)
        return [total(w) if id(w) in needs else None for w in self.weights]
