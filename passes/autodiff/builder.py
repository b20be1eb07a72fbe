"""A small graph builder whose methods mirror ONNX ops, for writing gradient rules.

``b.ReduceSum(x, [0], keepdims=0)`` appends a ``ReduceSum`` node and returns a
:class:`Var`; Python lists and numbers become constants (ints as int64, floats
in the dtype of the first tensor argument). ``Var`` supports ``+ - * / **`` and
unary minus, so a rule reads like its formula.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

# Output dtypes of ops whose result is not "the dtype of the first input".
_INT64_OPS = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin"})
_BOOL_OPS = frozenset(
    {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
     "IsNaN", "IsInf"}
)
# First default-domain opsets with CastLike, and with Reshape's allowzero.
CASTLIKE_SINCE = 15
RESHAPE_ALLOWZERO_SINCE = 14

# Scatters with a ``reduction``: see OpBuilder.op for their half-precision inputs.
_SCATTERS = frozenset({"ScatterND", "ScatterElements"})
_HALF_TYPES = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def _is_literal_shape(shape: Var | None, opset: int) -> bool:
    """``shape`` is a ``Shape`` output (no -1; a 0 means 0) and Reshape has ``allowzero``."""
    if shape is None or opset < RESHAPE_ALLOWZERO_SINCE:
        return False
    producer = shape.value.producer()
    return producer is not None and producer.op_type == "Shape" and producer.domain == ""


def dims_equal(a: Any, b: Any) -> bool:
    """True when two dims are known to be equal (same int, or same symbolic name)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    a_name = getattr(a, "value", a)
    b_name = getattr(b, "value", b)
    return isinstance(a_name, str) and a_name == b_name


def shape_dims(shape: ir.Shape | None) -> list[Any] | None:
    if shape is None:
        return None
    return [d if isinstance(d, int) else getattr(d, "value", None) for d in shape]


def _attribute(name: str, value: Any) -> ir.Attr:
    """An ONNX attribute from a plain Python value (fast path for what rules pass)."""
    if isinstance(value, bool) or isinstance(value, (int, np.integer)):
        return ir.AttrInt64(name, int(value))
    if isinstance(value, (float, np.floating)):
        return ir.AttrFloat32(name, float(value))
    if isinstance(value, str):
        return ir.AttrString(name, value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, np.integer)) for v in value):
        return ir.AttrInt64s(name, [int(v) for v in value])
    return ir.convenience.convert_attribute(name, value)


def _float_dtype(inputs: Sequence[Any]) -> ir.DataType | None:
    dtypes = [x.dtype for x in inputs if isinstance(x, Var) and x.dtype is not None]
    return next((d for d in dtypes if d.is_floating_point()), dtypes[0] if dtypes else None)


class Var:
    """A value in the graph under construction, with ONNX arithmetic."""

    __slots__ = ("value", "b")

    def __init__(self, value: ir.Value, builder: OpBuilder) -> None:
        self.value = value
        self.b = builder

    @property
    def dtype(self) -> ir.DataType | None:
        return self.value.dtype

    @property
    def known_dtype(self) -> ir.DataType:
        """``dtype``, which must be known (the graph is typed wherever a rule needs it)."""
        dtype = self.value.dtype
        if dtype is None:
            raise ValueError(f"element type of {self.value.name!r} is unknown")
        return dtype

    @property
    def shape(self) -> list[Any] | None:
        return shape_dims(self.value.shape)

    @property
    def rank(self) -> int | None:
        return None if self.value.shape is None else len(self.value.shape)

    @property
    def name(self) -> str | None:
        return self.value.name

    def __repr__(self) -> str:
        return f"Var({self.value.name!r}, {self.dtype}, {self.shape})"

    def __add__(self, o: Any) -> Var:
        return self.b.Add(self, o)

    def __radd__(self, o: Any) -> Var:
        return self.b.Add(o, self)

    def __sub__(self, o: Any) -> Var:
        return self.b.Sub(self, o)

    def __rsub__(self, o: Any) -> Var:
        return self.b.Sub(o, self)

    def __mul__(self, o: Any) -> Var:
        return self.b.Mul(self, o)

    def __rmul__(self, o: Any) -> Var:
        return self.b.Mul(o, self)

    def __truediv__(self, o: Any) -> Var:
        return self.b.Div(self, o)

    def __rtruediv__(self, o: Any) -> Var:
        return self.b.Div(o, self)

    def __neg__(self) -> Var:
        return self.b.Neg(self)

    def __pow__(self, o: Any) -> Var:
        return self.b.Pow(self, o)


class NodeView:
    """Read-only view of a forward node for gradient rules."""

    def __init__(self, node: ir.Node, builder: OpBuilder, needs: Sequence[bool],
                 captured: Sequence[ir.Value] = ()) -> None:
        self.node = node
        self.b = builder
        self.inputs: list[Var | None] = [builder.wrap(v) if v is not None else None for v in node.inputs]
        self.outputs: list[Var] = [builder.wrap(v) for v in node.outputs]
        self.captured: list[Var] = [builder.wrap(v) for v in captured]
        self._needs = list(needs)

    @property
    def op_type(self) -> str:
        return self.node.op_type

    @property
    def name(self) -> str:
        return self.node.name or self.node.op_type

    @property
    def opset(self) -> int:
        return self.b.opset

    def needs_grad(self, index: int) -> bool:
        """Whether the engine wants a gradient for input ``index`` (the mask)."""
        return index < len(self._needs) and self._needs[index]

    def has_input(self, index: int) -> bool:
        return index < len(self.inputs) and self.inputs[index] is not None

    def has_output(self, index: int) -> bool:
        return index < len(self.outputs) and bool(self.node.outputs[index].name)

    def attr(self, name: str, default: Any = None) -> Any:
        attr = self.node.attributes.get(name)
        if attr is None:
            return default
        value = attr.value
        if isinstance(value, Sequence) and not isinstance(value, str):
            return list(value)
        return value

    def const_input(self, index: int) -> np.ndarray | None:
        """The input's value when it is a constant or initializer, else None."""
        if not self.has_input(index):
            return None
        return self.b.const_value(self.inputs[index])


class OpBuilder:
    """Appends nodes to a list; the engine inserts them into the graph."""

    def __init__(self, opset: int, opset_imports: dict[str, int] | None = None) -> None:
        self.opset = opset
        self.opset_imports = dict(opset_imports or {"": opset})
        self.nodes: list[ir.Node] = []
        self._node_ids: set[int] = set()
        self.prefix = "grad"
        self._counter = 0
        self._consts: dict[tuple[bytes, str, tuple[int, ...]], Var] = {}
        self._wrapped: dict[int, Var] = {}
        # metadata_props put on every node appended from now on (see passes.marks)
        self.marks: dict[str, str] = {}

    def _append(self, node: ir.Node) -> None:
        for key, value in self.marks.items():
            node.metadata_props.setdefault(key, value)
        self.nodes.append(node)
        self._node_ids.add(id(node))

    def owns(self, value: ir.Value) -> bool:
        """Whether ``value`` is produced by a node this builder made."""
        producer = value.producer()
        return producer is not None and id(producer) in self._node_ids

    # ---- values -------------------------------------------------------------------------
    def wrap(self, value: ir.Value) -> Var:
        var = self._wrapped.get(id(value))
        if var is None or var.value is not value:
            var = Var(value, self)
            self._wrapped[id(value)] = var
        return var

    def fresh_name(self, hint: str) -> str:
        self._counter += 1
        return f"{self.prefix}/{hint}_{self._counter}"

    def const(self, array: Any, dtype: ir.DataType | np.dtype | None = None) -> Var:
        """A constant (deduplicated); ``dtype`` may be an ir.DataType or numpy dtype."""
        np_dtype: np.dtype | None
        if isinstance(dtype, ir.DataType):
            np_dtype = dtype.numpy()
        else:
            np_dtype = dtype
        arr = np.asarray(array, dtype=np_dtype)
        key = (arr.tobytes(), str(arr.dtype), arr.shape)
        cached = self._consts.get(key)
        if cached is not None:
            return cached
        self._counter += 1
        name = f"gradgraph_const_{self._counter}"
        tensor = ir.tensor(arr, name=name)
        node = ir.Node("", "Constant", [], [ir.AttrTensor("value", tensor)], name=name + "_node",
                       num_outputs=1)
        out = node.outputs[0]
        out.name = name
        out.type = ir.TensorType(tensor.dtype)
        out.shape = ir.Shape(arr.shape)
        out.const_value = tensor
        self._append(node)
        var = self.wrap(out)
        self._consts[key] = var
        return var

    def const_value(self, var: Var | None) -> np.ndarray | None:
        if var is None:
            return None
        value = var.value
        if value.const_value is not None:
            try:
                return value.const_value.numpy()
            except Exception:  # noqa: BLE001 - external data not loaded
                return None
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant" and producer.domain == "":
            attr = producer.attributes.get("value")
            if attr is not None:
                return attr.value.numpy()
        return None

    def _to_var(self, x: Any, like: ir.DataType | None) -> Var:
        if isinstance(x, Var):
            return x
        if isinstance(x, ir.Value):
            return self.wrap(x)
        if isinstance(x, np.ndarray):
            return self.const(x)
        if isinstance(x, (list, tuple)):
            if any(isinstance(e, float) for e in x):
                return self.const(np.array(x), like or ir.DataType.FLOAT)
            return self.const(np.array(x, dtype=np.int64))
        if isinstance(x, bool):
            return self.const(np.array(x))
        if isinstance(x, int) and like is not None and like.is_floating_point():
            return self.const(np.array(x), like)
        if isinstance(x, int):
            return self.const(np.array(x, dtype=np.int64) if like is None else np.array(x), like)
        if isinstance(x, float):
            return self.const(np.array(x), like or ir.DataType.FLOAT)
        raise TypeError(f"cannot turn {type(x).__name__} into an ONNX value")

    # ---- ops ---------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: Any, _outputs: int = 1, _domain: str = "",
           _like: Var | None = None, **attrs: Any) -> Any:
        """Append one node; ``_like`` gives the dtype of Python-number inputs."""
        like = _like.dtype if _like is not None else _float_dtype(inputs)
        vars_ = [None if x is None else self._to_var(x, like) for x in inputs]
        if op_type in _SCATTERS and not _domain and attrs.get("reduction", "none") != "none" \
                and vars_[0] is not None and vars_[0].dtype in _HALF_TYPES:
            # onnxruntime's CPU scatters do not reduce in float16 / bfloat16 ("MLFloat16 data type
            # is not supported with ScatterND opset 16 when reduction is 'add'"): accumulate in
            # float32 (more exact too), then cast back.
            half = vars_[0].known_dtype
            wide = self.op(op_type, self.Cast(vars_[0], to=int(ir.DataType.FLOAT)), vars_[1],
                           self.Cast(vars_[2], to=int(ir.DataType.FLOAT)), _outputs=_outputs, **attrs)
            return self.Cast(wide, to=int(half))
        if op_type == "CastLike" and not _domain and (
                self.opset < CASTLIKE_SINCE or (vars_[1] is not None and vars_[1].dtype is not None)):
            # Cast to a known dtype: a CastLike would read ``like`` only for its dtype, and so keep
            # a whole forward tensor alive until the backward (the split would stash it).
            op_type, vars_, attrs = "Cast", vars_[:1], {"to": int(self._castlike_target(vars_[1]))}
        if op_type == "Reshape" and not _domain and _is_literal_shape(vars_[1], self.opset):
            attrs = {**attrs, "allowzero": 1}  # a 0 in a Shape output is a real 0 (empty tensor)
        attributes = [_attribute(k, v) for k, v in attrs.items() if v is not None]
        node = ir.Node(_domain, op_type, [v.value if v is not None else None for v in vars_],
                       attributes, num_outputs=_outputs, name=self.fresh_name(op_type))
        dtype = self._out_dtype(op_type, vars_, attrs)
        for i, out in enumerate(node.outputs):
            out.name = f"{node.name}:{i}" if _outputs > 1 else node.name
            if dtype is not None and i == 0:
                out.type = ir.TensorType(dtype)
        self._append(node)
        wrapped = [self.wrap(o) for o in node.outputs]
        return wrapped[0] if _outputs == 1 else wrapped

    @staticmethod
    def _castlike_target(like: Var | None) -> ir.DataType:
        """CastLike is opset 15+; below it becomes Cast to the (known) dtype of ``like``."""
        if like is None or like.dtype is None:
            raise ValueError(f"CastLike needs opset {CASTLIKE_SINCE} or a target of known dtype")
        return like.dtype

    @staticmethod
    def _out_dtype(op_type: str, vars_: list[Var | None], attrs: dict[str, Any]) -> ir.DataType | None:
        if op_type in _INT64_OPS:
            return ir.DataType.INT64
        if op_type in _BOOL_OPS:
            return ir.DataType.BOOL
        if op_type == "Cast":
            return ir.DataType(attrs["to"])
        if op_type == "CastLike":
            return vars_[1].dtype if vars_[1] is not None else None
        if op_type == "ConstantOfShape":
            value = attrs.get("value")
            return ir.DataType.FLOAT if value is None else value.dtype
        if op_type == "OneHot":
            return vars_[2].dtype if vars_[2] is not None else None
        if op_type == "Where":
            return vars_[1].dtype if vars_[1] is not None else None
        first = next((v for v in vars_ if v is not None), None)
        return None if first is None else first.dtype

    def __getattr__(self, name: str) -> Any:
        if name[:1].isupper():
            return lambda *inputs, **attrs: self.op(name, *inputs, **attrs)
        raise AttributeError(name)

    # ---- helpers that hide opset differences -------------------------------------------
    def reduce(self, op_type: str, x: Var, axes: Sequence[int] | Var | None, keepdims: int = 1) -> Var:
        """Reduce over ``axes`` (None = all), axes as attribute or input as the opset wants."""
        axes_as_input = op_type == "ReduceSum" and self.opset >= 13 or self.opset >= 18
        if axes is None:
            return self.op(op_type, x, keepdims=keepdims)
        if axes_as_input:
            return self.op(op_type, x, axes if isinstance(axes, Var) else list(axes), keepdims=keepdims)
        if isinstance(axes, Var):
            raise ValueError(f"{op_type} at opset {self.opset} needs constant axes")
        return self.op(op_type, x, axes=list(axes), keepdims=keepdims)

    def zeros_like(self, x: Var) -> Var:
        return self.ConstantOfShape(self.Shape(x), value=ir.tensor(np.zeros(1, x.known_dtype.numpy())))

    def ones_like(self, x: Var) -> Var:
        return self.ConstantOfShape(self.Shape(x), value=ir.tensor(np.ones(1, x.known_dtype.numpy())))

    def cast_to(self, x: Var, dtype: ir.DataType | None) -> Var:
        if dtype is None or x.dtype == dtype:
            return x
        return self.Cast(x, to=int(dtype))

    def float_mask(self, cond: Var, like: Var) -> Var:
        return self.CastLike(cond, like)

    def dim(self, x: Var, axis: int) -> Var:
        """The 1-element int64 tensor holding ``x.shape[axis]``."""
        return self.Gather(self.Shape(x), [axis], axis=0)

    def unbroadcast(self, g: Var, from_shape: Sequence[Any] | None, x: Var) -> Var:
        """Sum ``g`` (shaped ``from_shape``) down to the shape of ``x``."""
        to = x.shape
        if from_shape is not None and to is not None:
            if len(from_shape) == len(to) and all(dims_equal(a, c) for a, c in zip(from_shape, to)):
                return g
            lead = len(from_shape) - len(to)
            if lead >= 0:
                axes: list[int] = []
                static = True
                for i, d in enumerate(to):
                    o = from_shape[lead + i]
                    if dims_equal(d, o):
                        continue
                    if d == 1:
                        axes.append(lead + i)
                    else:
                        static = False
                if static:
                    out = g
                    if axes:
                        out = self.reduce("ReduceSum", out, axes, keepdims=1)
                    if lead:
                        out = self.sum_leading(out, list(from_shape[:lead]), list(to))
                    return out
        return self._unbroadcast_dynamic(g, x)

    def sum_leading(self, g: Var, lead: Sequence[Any], trailing: Sequence[Any]) -> Var:
        """Sum ``g`` (shaped ``lead + trailing``) over its leading axes.

        For float tensors with a known, non-empty trailing shape this is ``ones[1, M] @ g[M, R]``:
        onnxruntime's (1.32) CPU GEMM sums leading axes 2-3x faster than its ReduceSum (2 threads:
        [8, 128, 8192] over (0, 1) 0.96 vs 2.66 ms, [8, 128, 256] 0.04 vs 0.08 ms), which is what
        every bias, LayerNorm scale and broadcast operand's gradient is. Otherwise ReduceSum.
        """
        k = len(lead)
        rows = [d for d in trailing if isinstance(d, int)]
        if (g.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE) or not trailing
                or len(rows) != len(trailing) or 0 in rows or 0 in lead):
            return self.reduce("ReduceSum", g, list(range(k)), keepdims=0)
        np_dtype = g.known_dtype.numpy()
        static = [d for d in lead if isinstance(d, int)]
        if len(static) == k:
            ones = self.const(np.ones((1, int(np.prod(static))), np_dtype))
        else:  # [1, M] from g's leading dims at run time
            count = self.ReduceProd(self.Slice(self.Shape(g), [0], [k]), keepdims=1)
            ones = self.ConstantOfShape(self.Concat(self.const(np.array([1])), count, axis=0),
                                        value=ir.tensor(np.ones(1, np_dtype)))
        summed = self.MatMul(ones, self.Reshape(g, [-1, int(np.prod(rows))]))
        return self.Reshape(summed, [int(d) for d in rows])

    def _unbroadcast_dynamic(self, g: Var, x: Var) -> Var:
        """Runtime shape comparison: works for any shapes, no static information needed."""
        sx = self.Shape(x)
        sg = self.Shape(g)
        missing = self.Sub(self.Size(sg), self.Size(sx))
        pad = self.ConstantOfShape(self.Reshape(missing, [1]),
                                   value=ir.tensor(np.ones(1, np.int64)))
        padded = self.Concat(pad, sx, axis=0)
        axes = self.Reshape(self.NonZero(self.Not(self.Equal(padded, sg))), [-1])
        summed = self.ReduceSum(g, axes, keepdims=1, noop_with_empty_axes=1)
        return self.Reshape(summed, sx)


def scope_taken_names(graph: ir.Graph, nodes: Sequence[ir.Node], prefix: str) -> None:
    """Rename the values of ``nodes`` (made by a builder, not yet in ``graph``) whose names
    ``graph`` already uses to ``<prefix>/<name>``, with their Constant nodes: each builder
    numbers its constants ``gradgraph_const_<n>`` from 1, so a second builder's collide."""
    taken = {v.name for v in graph.inputs} | set(graph.initializers)
    taken |= {o.name for n in graph for o in n.outputs if o.name}
    for node in nodes:
        for out in node.outputs:
            if out.name in taken:
                name, k = f"{prefix}/{out.name}", 0
                while name in taken:
                    k += 1
                    name = f"{prefix}/{out.name}_{k}"
                if node.name and node.name.startswith("gradgraph_const_"):
                    node.name = f"{name}_node"
                out.name = name
            taken.add(out.name)
