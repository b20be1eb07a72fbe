"""Hypothesis strategies drawing small, valid, trainable ONNX models, for property tests of passes.

API
---
``random_models(opset=18, *, max_steps=7, dropout=True, dead_code=True, extra_outputs=True)``
    A strategy of ``onnx.ModelProto`` (IR 9, or 10 from opset 21; default domain at ``opset``).
    Each model has:

    1. float32 inputs ``x`` (and sometimes ``x2``) with a static batch dim first, shape
       ``(B, F)`` or ``(B, S, F)``, all dims in 1..5; ``training_mode`` (a bool scalar input)
       when the model has a Dropout;
    2. float32 initializers, every one with at least two elements, so gradgraph classifies
       each as a parameter (:func:`trainable_names` lists them). At least one reaches the loss;
       with ``dead_code`` some may feed only dead nodes or an extra output;
    3. a DAG of at most ~20 nodes drawn from: Add/Sub/Mul/Div (denominator ``d*d + 1``) with
       broadcasting pairs (weights of suffix shapes with 1s, or two values of the graph), Tanh,
       Sigmoid, Relu, Neg, Exp (of values bounded by a Tanh), MatMul (weights ``(K, N)``,
       ``(1, K, N)``, ``(B, K, N)``, or value @ Transpose(value)), Reshape (shape from a Constant
       or from ``Concat`` of Constants: constant folding has work), Transpose, Softmax,
       LayerNormalization, Gelu (the op from opset 20, else ``x*0.5*(1+Erf(x/sqrt(2)))``),
       Dropout (ratio a Constant in {0, 0.1, 0.5}, ``training_mode`` the graph input), and, for
       cleanup passes, Identity nodes, twin nodes (the same op on the same inputs twice: CSE
       work) and dead nodes (outputs nobody reads);
    4. the output ``loss``: a float32 scalar, ``ReduceMean`` / ``ReduceSum`` of the last value,
       or of its square; and sometimes extra outputs (intermediate values, kept names).

    Values are kept tame: every value carries a rough magnitude bound and is squashed with a
    Tanh before an op could make it exceed ``_MAX_BOUND``; weights are uniform in a small range
    (1/sqrt(K) for MatMul). Every model passes ``onnx.checker.check_model(full_check=True)``,
    runs on onnxruntime CPU, and ``gradgraph.build_gradient_graph(model, "loss", None)``
    succeeds on it (tests/test_graph_strategies.py).

``random_training_models(opset=18, **kw)``
    The same without dead code or weights off the loss path: every initializer reaches
    ``loss``, so ``build_gradient_graph(model, "loss", trainable_names(model))`` succeeds.

``feeds(model, seed=0, *, training=False) -> dict[str, np.ndarray]``
    Inputs for ``model``: float inputs standard normal clipped to [-2.5, 2.5]; bool inputs
    (``training_mode``) set to ``training``. Deterministic in ``seed``.

``trainable_names(model) -> list[str]``
    The float initializers, in order (all of them are parameters, see 2.).

``has_random_ops(model) -> bool``
    Whether the model holds a Dropout (random when ``training_mode`` is fed True and its ratio
    is not 0).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

# Squash a value with a Tanh before an op could push its magnitude bound past this.
_MAX_BOUND = 30.0
# Most nodes a drawn model has (the loss and the twin/dead extras included, roughly).
_MAX_NODES = 20
_FLOAT_INPUT_CLIP = 2.5
_DROPOUT_RATIOS = (0.0, 0.1, 0.5)
_UNARY = ("Tanh", "Sigmoid", "Relu", "Neg", "Exp")
_BINARY = ("Add", "Sub", "Mul", "Div")
_KINDS = ("unary", "binary", "binary", "matmul", "reshape", "transpose", "softmax", "layernorm",
          "gelu", "dropout", "identity", "twin", "dead")
_CLEANUP_KINDS = frozenset({"identity", "twin", "dead"})
TRAINING_MODE = "training_mode"


@dataclasses.dataclass(frozen=True)
class _Val:
    name: str
    shape: tuple[int, ...]
    bound: float  # a rough bound on |value|


class _Draft:
    """The model being drawn: nodes, initializers, inputs, and the values ops may read."""

    def __init__(self, draw: st.DrawFn, opset: int, rng: np.random.Generator) -> None:
        self.draw, self.opset, self.rng = draw, opset, rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.pool: list[_Val] = []
        self.count = 0

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def node(self, op: str, inputs: list[str], shape: tuple[int, ...], bound: float,
             **attrs: Any) -> _Val:
        out = _Val(self.fresh("v"), shape, bound)
        self.nodes.append(helper.make_node(op, inputs, [out.name], name=self.fresh(f"{op}_"), **attrs))
        return out

    def add(self, op: str, inputs: list[str], shape: tuple[int, ...], bound: float,
            **attrs: Any) -> _Val:
        out = self.node(op, inputs, shape, bound, **attrs)
        self.pool.append(out)
        return out

    def weight(self, shape: tuple[int, ...], scale: float, center: float = 0.0) -> str:
        name = self.fresh("w")
        array = (center + self.rng.uniform(-scale, scale, size=shape)).astype(np.float32)
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def const(self, array: np.ndarray) -> str:
        name = self.fresh("c")
        self.nodes.append(helper.make_node("Constant", [], [name], name=self.fresh("Constant_"),
                                           value=numpy_helper.from_array(array)))
        return name

    def tame(self, v: _Val, limit: float = _MAX_BOUND) -> _Val:
        """``v`` itself, or Tanh(v) when its bound is over ``limit``."""
        return v if v.bound <= limit else self.add("Tanh", [v.name], v.shape, 1.0)

    def training_mode(self) -> str:
        if not any(i.name == TRAINING_MODE for i in self.inputs):
            self.inputs.append(helper.make_tensor_value_info(TRAINING_MODE, TensorProto.BOOL, []))
        return TRAINING_MODE


def _broadcast_weight_shape(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A suffix of ``shape`` with some dims set to 1, of at least two elements."""
    rank = draw(st.integers(1, len(shape)))
    suffix = list(shape[len(shape) - rank:])
    ones = draw(st.lists(st.booleans(), min_size=rank, max_size=rank))
    dims = [1 if one else d for d, one in zip(suffix, ones)]
    if math.prod(dims) < 2:  # the drawn values keep >= 2 elements past the batch dim
        dims = suffix if math.prod(suffix) >= 2 else list(shape[1:])
    return tuple(dims)


def _step(d: _Draft, kind: str, v: _Val) -> None:
    draw = d.draw
    if kind == "unary":
        op = draw(st.sampled_from(_UNARY))
        if op == "Exp":
            v = d.tame(v, 3.0)
            d.add("Exp", [v.name], v.shape, math.exp(v.bound))
        else:
            d.add(op, [v.name], v.shape, 1.0 if op in ("Tanh", "Sigmoid") else v.bound)
    elif kind == "binary":
        _binary(d, v)
    elif kind == "matmul":
        _matmul(d, v)
    elif kind == "reshape":
        _reshape(d, v)
    elif kind == "transpose" and len(v.shape) == 3:
        d.add("Transpose", [v.name], (v.shape[0], v.shape[2], v.shape[1]), v.bound, perm=[0, 2, 1])
    elif kind == "softmax":
        d.add("Softmax", [v.name], v.shape, 1.0, axis=draw(st.sampled_from([-1, *range(1, len(v.shape))])))
    elif kind == "layernorm":
        f = v.shape[-1]
        if f < 2:
            return
        scale, bias = d.weight((f,), 0.2, center=1.0), d.weight((f,), 0.2)
        d.add("LayerNormalization", [v.name, scale, bias], v.shape, 1.2 * math.sqrt(f) + 0.2, axis=-1)
    elif kind == "gelu":
        _gelu(d, v)
    elif kind == "dropout":
        ratio = d.const(np.array(draw(st.sampled_from(_DROPOUT_RATIOS)), np.float32))
        d.add("Dropout", [v.name, ratio, d.training_mode()], v.shape, 2.0 * v.bound)
    elif kind == "identity":
        d.add("Identity", [v.name], v.shape, v.bound)
    elif kind == "twin":
        op = draw(st.sampled_from(("Tanh", "Sigmoid", "Neg")))
        a = d.node(op, [v.name], v.shape, v.bound)
        b = d.node(op, [v.name], v.shape, v.bound)
        d.add("Add", [a.name, b.name], v.shape, 2.0 * v.bound)
    elif kind == "dead":
        if draw(st.booleans()):
            d.node("Mul", [v.name, d.weight(_broadcast_weight_shape(draw, v.shape), 0.5)], v.shape, v.bound)
        else:
            d.node("Sigmoid", [v.name], v.shape, 1.0)


def _binary(d: _Draft, v: _Val) -> None:
    draw = d.draw
    op = draw(st.sampled_from(_BINARY))
    partners = [u for u in d.pool if u.name != v.name and _broadcasts(u.shape, v.shape)]
    if draw(st.booleans()) and partners:
        partner = draw(st.sampled_from(partners))
        other, other_shape, other_bound = partner.name, partner.shape, partner.bound
    else:
        other_shape = _broadcast_weight_shape(draw, v.shape)
        other, other_bound = d.weight(other_shape, 0.5), 0.5
    if draw(st.booleans()):  # the weight or partner on the left
        (a, a_shape, a_bound), (b, b_shape, b_bound) = (other, other_shape, other_bound), (v.name, v.shape, v.bound)
    else:
        (a, a_shape, a_bound), (b, b_shape, b_bound) = (v.name, v.shape, v.bound), (other, other_shape, other_bound)
    shape = tuple(np.broadcast_shapes(a_shape, b_shape))
    if op == "Mul" and a_bound * b_bound > _MAX_BOUND:
        a_bound, a = 1.0, d.tame(_Val(a, a_shape, a_bound), 0.0).name
        b_bound, b = 1.0, d.tame(_Val(b, b_shape, b_bound), 0.0).name
    if op == "Div":
        square = d.node("Mul", [b, b], b_shape, b_bound * b_bound)
        one = d.const(np.array(1.0, np.float32))
        b = d.node("Add", [square.name, one], b_shape, b_bound * b_bound + 1.0).name
        d.add("Div", [a, b], shape, a_bound)
    else:
        d.add(op, [a, b], shape, a_bound * b_bound if op == "Mul" else a_bound + b_bound)


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    try:
        return tuple(np.broadcast_shapes(a, b)) == b
    except ValueError:
        return False


def _matmul(d: _Draft, v: _Val) -> None:
    draw = d.draw
    k = v.shape[-1]
    same = [u for u in d.pool if u.shape == v.shape]
    if len(v.shape) == 3 and v.shape[1] >= 2 and len(same) > 1 and draw(st.booleans()):
        u = d.tame(draw(st.sampled_from(same)), 3.0)
        v = d.tame(v, 3.0)
        t = d.add("Transpose", [u.name], (u.shape[0], u.shape[2], u.shape[1]), u.bound, perm=[0, 2, 1])
        d.add("MatMul", [v.name, t.name], (v.shape[0], v.shape[1], v.shape[1]), v.bound * u.bound * k)
        return
    n = draw(st.integers(2, 5))
    lead = draw(st.sampled_from([(), (1,), (v.shape[0],)])) if len(v.shape) == 3 else ()
    v = d.tame(v, 5.0)
    w = d.weight((*lead, k, n), 1.0 / math.sqrt(k))
    d.add("MatMul", [v.name, w], (*v.shape[:-1], n), v.bound * math.sqrt(k))


def _reshape(d: _Draft, v: _Val) -> None:
    draw = d.draw
    new_shape: tuple[int, ...]
    if len(v.shape) == 3:
        target, new_shape = [0, -1], (v.shape[0], v.shape[1] * v.shape[2])
    else:
        f = v.shape[1]
        splits = [a for a in range(2, f) if f % a == 0]
        a = draw(st.sampled_from(splits)) if splits else 1
        target, new_shape = [0, a, -1], (v.shape[0], a, f // a)
    if draw(st.booleans()):
        shape = d.const(np.array(target, np.int64))
    else:  # a shape computed from Constants only: work for constant folding
        parts = [d.const(np.array([t], np.int64)) for t in target]
        shape = d.fresh("shape")
        d.nodes.append(helper.make_node("Concat", parts, [shape], name=d.fresh("Concat_"), axis=0))
    d.add("Reshape", [v.name, shape], new_shape, v.bound)


def _gelu(d: _Draft, v: _Val) -> None:
    if d.opset >= 20 and d.draw(st.booleans()):
        approximate = d.draw(st.sampled_from(["none", "tanh"]))
        d.add("Gelu", [v.name], v.shape, v.bound, approximate=approximate)
        return
    root2 = d.const(np.array(math.sqrt(2.0), np.float32))
    half, one = d.const(np.array(0.5, np.float32)), d.const(np.array(1.0, np.float32))
    scaled = d.node("Div", [v.name, root2], v.shape, v.bound)
    erf = d.node("Erf", [scaled.name], v.shape, 1.0)
    shifted = d.node("Add", [erf.name, one], v.shape, 2.0)
    times = d.node("Mul", [v.name, shifted.name], v.shape, 2.0 * v.bound)
    d.add("Mul", [times.name, half], v.shape, v.bound)


def _first(d: _Draft, x: _Val) -> _Val:
    """An op reading a weight, so that at least one trainable initializer reaches the loss."""
    choice = d.draw(st.sampled_from(["matmul", "add", "mul", "layernorm"]))
    if choice == "matmul" or (choice == "layernorm" and x.shape[-1] < 2):
        _matmul(d, x)
    elif choice == "layernorm":
        _step(d, "layernorm", x)
    else:
        w = d.weight(_broadcast_weight_shape(d.draw, x.shape), 0.5, center=0.5 if choice == "mul" else 0.0)
        d.add("Add" if choice == "add" else "Mul", [x.name, w], x.shape, x.bound + 1.0)
    return d.pool[-1]


@st.composite
def _models(draw: st.DrawFn, opset: int, max_steps: int, dropout: bool, dead_code: bool,
            extra_outputs: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    d = _Draft(draw, opset, rng)
    batch = draw(st.integers(1, 3))
    # the last dim is >= 2: every value keeps >= 2 elements past the batch dim (weights of a
    # broadcast shape are then parameters)
    dims = (*draw(st.lists(st.integers(1, 5), max_size=1)), draw(st.integers(2, 5)))
    x = _Val("x", (batch, *dims), _FLOAT_INPUT_CLIP)
    d.inputs.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape)))
    d.pool.append(x)
    if draw(st.booleans()):
        x2_shape = (batch, *_broadcast_weight_shape(draw, dims)) if draw(st.booleans()) else x.shape
        x2 = _Val("x2", x2_shape, _FLOAT_INPUT_CLIP)
        d.inputs.append(helper.make_tensor_value_info("x2", TensorProto.FLOAT, list(x2_shape)))
        d.pool.append(x2)
    last = _first(d, x)
    kinds = [k for k in _KINDS if (dropout or k != "dropout") and (dead_code or k not in _CLEANUP_KINDS)]
    for _ in range(draw(st.integers(1, max_steps))):
        if len(d.nodes) >= _MAX_NODES - 6:
            break
        kind = draw(st.sampled_from(kinds))
        # mostly extend the chain, sometimes branch from an earlier value (a DAG)
        source = last if draw(st.integers(0, 3)) else draw(st.sampled_from(d.pool))
        if kind == "dead":
            _step(d, kind, source)
            continue
        before = len(d.pool)
        _step(d, kind, source)
        if len(d.pool) > before:
            last = d.pool[-1]
    if "x2" in {i.name for i in d.inputs} and draw(st.booleans()):
        x2v = next(u for u in d.pool if u.name == "x2")
        if _broadcasts(x2v.shape, last.shape):
            last = d.add("Add", [last.name, "x2"], last.shape, last.bound + x2v.bound)
    if not {t.name for t in d.inits} & _ancestors(d.nodes, last.name):
        w = d.weight(_broadcast_weight_shape(draw, last.shape), 0.5, center=1.0)
        last = d.add("Mul", [last.name, w], last.shape, 1.5 * last.bound)
    last = d.tame(last)
    reduce_op = draw(st.sampled_from(["ReduceMean", "ReduceSum"]))
    if draw(st.booleans()):
        last = d.node("Mul", [last.name, last.name], last.shape, last.bound * last.bound)
    d.nodes.append(helper.make_node(reduce_op, [last.name], ["loss"], name=d.fresh(f"{reduce_op}_"),
                                    keepdims=0))
    outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    reachable = _ancestors(d.nodes, "loss")
    candidates = [u for u in d.pool if u.name not in {i.name for i in d.inputs}]
    if not dead_code:
        candidates = [u for u in candidates if u.name in reachable]
    if extra_outputs and candidates:
        for u in draw(st.lists(st.sampled_from(candidates), max_size=2, unique_by=lambda u: u.name)):
            outputs.append(helper.make_tensor_value_info(u.name, TensorProto.FLOAT, list(u.shape)))
    graph = helper.make_graph(d.nodes, "drawn", d.inputs, outputs, initializer=d.inits)
    ir_version = 9 if opset <= 20 else 10
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              ir_version=ir_version, producer_name="graph_strategies")
    if not dead_code:
        used = _ancestors(d.nodes, "loss")
        del model.graph.initializer[:]
        model.graph.initializer.extend(t for t in d.inits if t.name in used)
        _prune(model)
    return model


def _ancestors(nodes: list[onnx.NodeProto], output: str) -> set[str]:
    """Names of every value ``output`` depends on (itself included)."""
    producer = {o: n for n in nodes for o in n.output}
    seen, stack = {output}, [output]
    while stack:
        node = producer.get(stack.pop())
        for name in node.input if node is not None else ():
            if name and name not in seen:
                seen.add(name)
                stack.append(name)
    return seen


def _prune(model: onnx.ModelProto) -> None:
    """Drop nodes no graph output depends on (dead code off)."""
    needed: set[str] = set()
    for out in model.graph.output:
        needed |= _ancestors(list(model.graph.node), out.name)
    keep = [n for n in model.graph.node if any(o in needed for o in n.output)]
    del model.graph.node[:]
    model.graph.node.extend(keep)


def random_models(opset: int = 18, *, max_steps: int = 7, dropout: bool = True,
                  dead_code: bool = True, extra_outputs: bool = True) -> st.SearchStrategy[onnx.ModelProto]:
    """Small valid ONNX models ending in a scalar float ``loss`` (see the module docstring)."""
    if opset < 17:
        raise ValueError("random_models draws LayerNormalization: opset 17 or later")
    return _models(opset, max_steps, dropout, dead_code, extra_outputs)


def random_training_models(opset: int = 18, *, max_steps: int = 7, dropout: bool = True,
                           extra_outputs: bool = True) -> st.SearchStrategy[onnx.ModelProto]:
    """Like :func:`random_models`, with every initializer on the loss path and no dead code."""
    return random_models(opset, max_steps=max_steps, dropout=dropout, dead_code=False,
                         extra_outputs=extra_outputs)


_NUMPY_OF = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64,
             TensorProto.FLOAT16: np.float16}


def feeds(model: onnx.ModelProto, seed: int = 0, *, training: bool = False) -> dict[str, np.ndarray]:
    """Inputs for ``model``: floats standard normal clipped, bools (``training_mode``) = ``training``."""
    rng = np.random.default_rng(seed)
    initializers = {t.name for t in model.graph.initializer}
    result: dict[str, np.ndarray] = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 1 for d in tensor.shape.dim]
        if tensor.elem_type == TensorProto.BOOL:
            result[value.name] = np.full(shape, training, dtype=np.bool_)
        elif tensor.elem_type in _NUMPY_OF:
            array = np.clip(rng.standard_normal(shape), -_FLOAT_INPUT_CLIP, _FLOAT_INPUT_CLIP)
            result[value.name] = array.astype(_NUMPY_OF[tensor.elem_type])
        else:
            raise ValueError(f"feeds: input {value.name!r} has an unsupported type {tensor.elem_type}")
    return result


def trainable_names(model: onnx.ModelProto) -> list[str]:
    """The float initializers of at least two elements (gradgraph's parameters), in order."""
    return [t.name for t in model.graph.initializer
            if t.data_type in _NUMPY_OF and math.prod(t.dims) >= 2]


def has_random_ops(model: onnx.ModelProto) -> bool:
    return any(n.op_type in ("Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform",
                             "RandomUniformLike", "Bernoulli", "Multinomial") for n in model.graph.node)
