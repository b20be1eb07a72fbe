"""RandomInputsPass: a random op reads its draws from a graph input.

onnxruntime's random kernels draw from a generator seeded once, when the session is made: a
caller cannot make them repeat a draw (``torch.manual_seed`` in gradgraph's ORTModule). This
pass gives each of them a new graph input of standard draws, which the caller fills on every
run from its own generator (ORTModule: torch's), and computes the op from it::

    RandomNormal(Like)   Y = mean + scale * N        N a standard normal draw
    RandomUniform(Like)  Y = low + (high - low) * U  U uniform on [0, 1)
    Bernoulli(P)         Y = Cast(U < P)             U uniform on [0, 1), P's shape

The input is named ``<Y's name>.draws``; its metadata ``DRAWS_KEY`` says ``normal`` or
``uniform``; :func:`random_inputs` lists them. Rewritten: such a default-domain node of the main
graph whose output (Bernoulli, or a ``Like`` op of unknown output shape: input) has a static
shape and a float32 / float64 type. Anything
else (Multinomial, a shape known only at run time, a subgraph's node) is left to onnxruntime.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.kernels._graph import DEFAULT_DOMAINS, take_over
from passes.names import free_name

DRAWS_KEY = "gradgraph.random_draws"
_FLOATS = {ir.DataType.FLOAT: np.float32, ir.DataType.DOUBLE: np.float64}


@dataclasses.dataclass(frozen=True)
class RandomInput:
    """A graph input of draws: its ``kind`` (``normal`` / ``uniform``), shape and numpy dtype."""

    kind: str
    shape: tuple[int, ...]
    dtype: type


def _static(value: ir.Value | None) -> tuple[int, ...] | None:
    if value is None or value.shape is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return tuple(int(d) for d in value.shape)  # type: ignore[arg-type]


class RandomInputsPass(InPlacePass):
    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        found = []
        for node in graph:
            if node.domain not in DEFAULT_DOMAINS or node.op_type not in (
                    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli"):
                continue
            shaped = node.inputs[0] if node.op_type == "Bernoulli" else node.outputs[0]
            if _static(shaped) is None and node.op_type.endswith("Like"):
                shaped = node.inputs[0]  # the output's shape is its input's
            shape = _static(shaped)
            dtype = node.outputs[0].dtype or (shaped.dtype if shaped is not None else None)
            if node.op_type == "Bernoulli" and shaped is not None:
                dtype = shaped.dtype  # the draws compare with the probabilities
            if shape is not None and dtype in _FLOATS:
                found.append((node, shape, dtype))
        if not found:
            return PassResult(model, False)
        taken = {v.name for v in graph.inputs} | set(graph.initializers) | {v.name for n in graph for v in n.outputs}
        for node, shape, dtype in found:
            self._rewrite(graph, node, shape, dtype, taken)
        return PassResult(model, True)

    @staticmethod
    def _rewrite(graph: ir.Graph, node: ir.Node, shape: tuple[int, ...], dtype: ir.DataType, taken: set) -> None:
        out = node.outputs[0]
        to = ir.AttrInt64("to", int(out.dtype or dtype))
        name = free_name(f"{out.name or node.name or node.op_type}.draws", taken)
        normal = node.op_type.startswith("RandomNormal")
        draws = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))
        draws.metadata_props[DRAWS_KEY] = "normal" if normal else "uniform"
        graph.inputs.append(draws)
        prefix = f"{node.name or name}/draws"
        np_type = _FLOATS[dtype]

        def const(value: float, suffix: str) -> ir.Node:
            return ir.node("Constant", [], attributes={"value": ir.tensor(np.array(value, np_type))},
                           name=f"{prefix}_{suffix}")

        made: list[ir.Node]
        if node.op_type == "Bernoulli":
            less = ir.node("Less", [draws, node.inputs[0]], name=f"{prefix}_less")
            result = ir.node("Cast", [less.outputs[0]], attributes={"to": to}, name=f"{prefix}_cast")
            made = [less, result]
        else:
            if normal:
                shift, width = node.attributes.get_float("mean", 0.0), node.attributes.get_float("scale", 1.0)
            else:
                low = node.attributes.get_float("low", 0.0)
                shift, width = low, node.attributes.get_float("high", 1.0) - low
            a, b = const(width, "scale"), const(shift, "shift")
            mul = ir.node("Mul", [draws, a.outputs[0]], name=f"{prefix}_mul")
            add = ir.node("Add", [mul.outputs[0], b.outputs[0]], name=f"{prefix}_add")
            made = [a, b, mul, add]
            if dtype != out.dtype:  # the op's own dtype attribute
                made.append(ir.node("Cast", [add.outputs[0]], attributes={"to": to},
                                    name=f"{prefix}_cast"))
            result = made[-1]
        for new in made:
            new.metadata_props.update(node.metadata_props)
            for k, value in enumerate(new.outputs):
                value.name = value.name or (f"{new.name}_{k}" if k else new.name)
        result.outputs[0].type, result.outputs[0].shape = out.type, ir.Shape(shape)
        graph.insert_before(node, made)
        take_over(graph, out, result.outputs[0])
        graph.remove(node, safe=True)


def random_inputs(graph: ir.Graph) -> dict[str, RandomInput]:
    """The graph inputs :class:`RandomInputsPass` made, in graph-input order."""
    found = {}
    for v in graph.inputs:
        kind = v.metadata_props.get(DRAWS_KEY)
        shape = _static(v)
        if kind is not None and shape is not None and v.dtype in _FLOATS:
            found[v.name or ""] = RandomInput(kind, shape, _FLOATS[v.dtype])
    return found
