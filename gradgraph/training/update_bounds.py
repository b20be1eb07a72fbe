"""Proving a step's update finite from bounds, so the update need not be computed twice.

The split step (:mod:`gradgraph.training.step_split`) runs the update in place only when it
cannot make a weight or state non-finite. The plain way to know is to compute the update once
without writing it (:func:`step_split.finite_check`): a second update's worth of time (0.56 s of
GPT-2 small's 2 s AdamW step). This module proves the same thing from intervals instead:

- the held tensors the update reads (weights, optimizer state, step counter) have known bounds:
  measured once (the minimum and maximum of each), then carried from step to step as the bounds
  the proof computes for their updated values;
- the gradients' bounds are measured each step (their minimum and maximum: exact, no rounding);
- the learning rate is one number.

:class:`UpdateProof` propagates these intervals through the update graph, node by node (interval
arithmetic, each bound widened by a relative 2^-20 for float rounding). When every float value
of the graph stays within half its type's range, with no division by an interval holding zero,
no square root or logarithm of a possibly negative value, the update is finite and the check
run is skipped. Otherwise (an op it does not know, AdamW with ``eps=0``, LAMB's trust ratio, a
learning rate of 1e30) the session runs the check as before: the proof is only ever a shortcut.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

Interval = tuple[float, float]
INF = math.inf
UNKNOWN: Interval = (-INF, INF)
ROUND = 2.0 ** -20  # relative widening of each computed bound: float rounding (a few ulps)
EPS32 = 2.0 ** -23
SUBNORMAL = 1e-44  # above float32's spacing of subnormal numbers (1.4e-45)
TINY = 1e-30  # a divisor's smallest magnitude that is trusted to stay non-zero after rounding
MARGIN = 0.5  # a float value is proven finite within this share of its type's range
# The float types the rounding model (ROUND, SUBNORMAL) covers: a graph with a value of any other
# float type (float16, bfloat16, float8: coarser rounding, values flushed to 0) is not proven.
LIMITS: dict[int, float] = {
    TensorProto.FLOAT: float(np.finfo(np.float32).max),
    TensorProto.DOUBLE: float(np.finfo(np.float64).max),
}
INTEGERS: dict[int, tuple[float, float]] = {
    t: (float(np.iinfo(d).min), float(np.iinfo(d).max)) for t, d in (
        (TensorProto.INT8, np.int8), (TensorProto.INT16, np.int16), (TensorProto.INT32, np.int32),
        (TensorProto.INT64, np.int64), (TensorProto.UINT8, np.uint8), (TensorProto.UINT16, np.uint16),
        (TensorProto.UINT32, np.uint32), (TensorProto.UINT64, np.uint64))
}
# Ops whose integer result is exact (no rounding, no truncation) while it stays in range.
EXACT_INTEGER_OPS = frozenset({"Add", "Sub", "Mul", "Neg", "Abs", "Max", "Min", "Sum", "Identity", "Reshape",
                               "Squeeze", "Unsqueeze", "Concat", "Gather", "Slice", "Expand", "Constant"})
BOOL_OPS = frozenset({"Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "And", "Or", "Not",
                      "Xor", "IsNaN", "IsInf"})
# Ops whose outputs hold elements of their first input (or, for Concat, of any input).
MOVE_OPS = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand", "Transpose",
                      "Slice", "Split", "Gather", "GatherElements", "Tile", "Concat"})


def _widen(lo: float, hi: float) -> Interval:
    """``[lo, hi]`` widened outward by :data:`ROUND` relative and :data:`SUBNORMAL` absolute
    (rounding in the subnormal range), never across zero: rounding keeps a value's sign."""
    if math.isnan(lo) or math.isnan(hi):
        return UNKNOWN
    low = lo - abs(lo) * ROUND - SUBNORMAL
    high = hi + abs(hi) * ROUND + SUBNORMAL
    return (max(low, 0.0) if lo >= 0.0 else low), (min(high, 0.0) if hi <= 0.0 else high)


def _corners(op: Callable[[float, float], float], a: Interval, b: Interval) -> Interval:
    try:
        values = [op(x, y) for x in a for y in b]
    except (OverflowError, ZeroDivisionError, ValueError):
        return UNKNOWN
    if any(math.isnan(v) for v in values):
        return UNKNOWN  # 0 * inf: an unbounded operand
    return _widen(min(values), max(values))


def _hull(intervals: Sequence[Interval]) -> Interval:
    return min(i[0] for i in intervals), max(i[1] for i in intervals)


def _square(a: Interval) -> Interval:
    lo, hi = a
    big = max(lo * lo, hi * hi)
    small = 0.0 if lo <= 0.0 <= hi else min(lo * lo, hi * hi)
    return _widen(small, big)


def _mul(a: Interval, b: Interval) -> Interval:
    return _corners(lambda x, y: x * y, a, b)


def _div(a: Interval, b: Interval) -> Interval:
    if not (b[0] > TINY or b[1] < -TINY):
        return UNKNOWN  # the divisor may be zero (or round to it)
    return _corners(lambda x, y: x / y, a, b)


def _pow(a: Interval, b: Interval) -> Interval:
    if b[0] == b[1] and float(b[0]).is_integer() and abs(b[0]) <= 64:
        k = int(b[0])
        if k == 0:
            return 1.0, 1.0
        if k > 0 and k % 2 == 0:
            lo, hi = _square(a)
            return _corners(lambda x, y: x ** y, (math.sqrt(lo), math.sqrt(hi)), (k, k))
        if k > 0:
            return _corners(lambda x, y: math.copysign(abs(x) ** y, x), a, (k, k))
    if a[0] > TINY:  # a positive base: monotone in each argument, extremes at the corners
        return _corners(math.pow, a, b)
    return UNKNOWN


def _monotone(f: Callable[[float], float], a: Interval) -> Interval:
    try:
        return _widen(f(a[0]), f(a[1]))
    except (OverflowError, ValueError):
        return UNKNOWN


def _exp(x: float) -> float:
    return math.exp(x) if x < 709.0 else INF


def _sqrt(a: Interval) -> Interval:
    return _monotone(math.sqrt, a) if a[0] >= 0.0 else UNKNOWN


def _log(a: Interval) -> Interval:
    return _monotone(math.log, a) if a[0] > TINY else UNKNOWN


def _reduce_sum(a: Interval, n: float) -> Interval:
    """The sum of at most ``n`` elements in ``a``, widened by the worst summation error."""
    if not math.isfinite(n):
        return UNKNOWN
    lo, hi = min(a[0], n * a[0]), max(a[1], n * a[1])
    error = n * max(abs(a[0]), abs(a[1])) * n * EPS32
    return _widen(lo - error, hi + error)


def _constant(node: onnx.NodeProto) -> Interval:
    for attr in node.attribute:
        if attr.name == "value":
            array = numpy_helper.to_array(attr.t)
        elif attr.name in ("value_float", "value_int", "value_floats", "value_ints"):
            array = np.asarray(onnx.helper.get_attribute_value(attr))
        else:
            return UNKNOWN
        if array.dtype == bool:
            array = array.astype(np.int8)
        if array.size == 0 or array.dtype.kind not in "fiu":
            return UNKNOWN
        lo, hi = float(np.min(array)), float(np.max(array))
        return UNKNOWN if math.isnan(lo) or math.isnan(hi) else (lo, hi)
    return UNKNOWN


_UNARY: dict[str, Callable[[Interval], Interval]] = {
    "Neg": lambda x: (-x[1], -x[0]),
    "Abs": lambda x: (0.0 if x[0] <= 0.0 <= x[1] else min(abs(x[0]), abs(x[1])), max(abs(x[0]), abs(x[1]))),
    "Sqrt": _sqrt,
    "Reciprocal": lambda x: _div((1.0, 1.0), x),
    "Sign": lambda x: (float(np.sign(x[0])), float(np.sign(x[1]))),
    "Exp": lambda x: _monotone(_exp, x),
    "Log": _log,
    "Tanh": lambda x: _monotone(math.tanh, x),
    "Sigmoid": lambda x: (0.0, 1.0),
    "Relu": lambda x: (max(x[0], 0.0), max(x[1], 0.0)),
}


class UpdateProof:
    """Interval propagation through one update graph (see the module docstring).

    ``prove(bounds)`` takes the intervals of the graph's inputs (absent: unknown) and returns
    the intervals of its outputs when every float value is proven finite, else None."""

    def __init__(self, update: onnx.ModelProto) -> None:
        try:  # the update graph holds no weights: its types are inferred in milliseconds
            shaped = onnx.shape_inference.infer_shapes(update)
        except Exception:  # noqa: BLE001 - onnx raises several types; types then stay unknown
            shaped = update
        graph = shaped.graph
        self.types: dict[str, int] = {}
        self.sizes: dict[str, float] = {}
        for value in [*graph.input, *graph.value_info, *graph.output]:
            tensor = value.type.tensor_type
            if tensor.elem_type:
                self.types[value.name] = tensor.elem_type
            if tensor.HasField("shape"):
                dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
                self.sizes[value.name] = math.prod(d for d in dims if d is not None) if None not in dims else INF
        for tensor in graph.initializer:
            self.types[tensor.name] = tensor.data_type
            self.sizes[tensor.name] = math.prod(tensor.dims)
        self.nodes = list(graph.node)
        # What does not change between steps, read once: the small initializers' bounds and
        # the Constant nodes' (a larger initializer stays unknown, as an unbounded input).
        self.initializers: dict[str, Interval] = {}
        for tensor in graph.initializer:
            if math.prod(tensor.dims) <= 1 << 16:
                array = numpy_helper.to_array(tensor)
                if array.size and array.dtype.kind in "fiub":
                    values = array.astype(np.float64)
                    self.initializers[tensor.name] = (float(values.min()), float(values.max()))
        self.constants = {n.output[0]: _constant(n) for n in self.nodes
                          if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output}
        self.outputs = [o.name for o in graph.output]
        self.inputs = [i.name for i in graph.input]

    def _limit(self, name: str) -> float:
        return LIMITS.get(self.types.get(name, TensorProto.UNDEFINED), 0.0) * MARGIN

    def _within(self, name: str, interval: Interval, op: str = "") -> Interval | None:
        """``interval`` as the value ``name`` holds it (an integer's rounded outward), or None
        where the value may be non-finite, out of its type's range, or of a type the proof
        does not model (float16 and other floats, unknown: nothing is proven)."""
        dtype = self.types.get(name, TensorProto.UNDEFINED)
        lo, hi = interval
        if dtype in LIMITS:
            limit = self._limit(name)
            return interval if -limit <= lo <= hi <= limit else None
        if dtype in INTEGERS:
            low, high = INTEGERS[dtype]
            if not (math.isfinite(lo) and math.isfinite(hi)):
                return UNKNOWN  # an unbounded integer: only a float computed from it fails
            if op in EXACT_INTEGER_OPS and max(abs(lo), abs(hi)) < 2.0 ** 18:
                lo, hi = round(lo), round(hi)  # an integer widened by far less than 1/2
            else:
                lo, hi = math.floor(lo), math.ceil(hi)  # a division or a cast truncates
            return (lo, hi) if low <= lo <= hi <= high else UNKNOWN  # overflow wraps
        if dtype == TensorProto.BOOL:
            return 0.0, 1.0
        return None

    def prove(self, bounds: Mapping[str, Interval]) -> dict[str, Interval] | None:
        """The outputs' intervals when the whole update is proven finite, else None."""
        known: dict[str, Interval] = {**self.initializers, **bounds}
        for name in self.inputs:  # an input the proof has no bound of is unknown
            checked = self._within(name, known.get(name, UNKNOWN))
            if checked is None:
                return None
            known[name] = checked
        for node in self.nodes:
            results = self._node(node, known)
            for out, interval in zip(node.output, results):
                if not out:
                    continue
                checked = self._within(out, interval, node.op_type)
                if checked is None:
                    return None
                known[out] = checked
        return {o: known.get(o, UNKNOWN) for o in self.outputs}

    def _node(self, node: onnx.NodeProto, known: Mapping[str, Interval]) -> list[Interval]:
        if node.domain not in ("", "ai.onnx"):
            return [UNKNOWN] * len(node.output)
        op = node.op_type
        args = [known.get(i, UNKNOWN) if i else None for i in node.input]
        a = args[0] if args else None
        n_out = len(node.output)
        if op == "Constant":
            return [self.constants.get(node.output[0], UNKNOWN)]
        if op in BOOL_OPS:
            return [(0.0, 1.0)]
        if op in MOVE_OPS and a is not None:
            present = [x for x in args if x is not None]
            return [_hull(present) if op == "Concat" else a] * n_out
        if op == "Cast":
            assert a is not None
            to = next(attr.i for attr in node.attribute if attr.name == "to")
            if to == TensorProto.BOOL:
                return [(0.0, 1.0)]
            return [_widen(*a)]  # a float's rounding; an integer's is floored in _node's caller
        if a is None:
            return [UNKNOWN] * n_out
        if op in ("Add", "Sum", "Mean"):
            lo, hi = sum(x[0] for x in args if x), sum(x[1] for x in args if x)
            count = len([x for x in args if x])
            return [_widen(lo / count, hi / count) if op == "Mean" else _widen(lo, hi)]
        b = args[1] if len(args) > 1 else None
        if op == "Sub" and b is not None:
            return [_widen(a[0] - b[1], a[1] - b[0])]
        if op == "Mul" and b is not None:
            return [_square(a) if node.input[0] == node.input[1] else _mul(a, b)]
        if op == "Div" and b is not None:
            return [_div(a, b)]
        if op == "Pow" and b is not None:
            return [_pow(a, b)]
        if op in ("Max", "Min"):
            pick = max if op == "Max" else min
            present = [x for x in args if x]
            return [(pick(x[0] for x in present), pick(x[1] for x in present))]
        if op == "Clip":
            lo, hi = a
            floats = {attr.name: attr.f for attr in node.attribute if attr.name in ("min", "max")}
            if "min" in floats:  # opset 6-10: the bounds are attributes
                lo, hi = max(lo, floats["min"]), max(hi, floats["min"])
            if "max" in floats:
                lo, hi = min(lo, floats["max"]), min(hi, floats["max"])
            if b is not None:  # Clip(x, low, high) = Min(Max(x, low), high)
                lo, hi = max(lo, b[0]), max(hi, b[1])
            top = args[2] if len(args) > 2 else None
            if top is not None:
                lo, hi = min(lo, top[0]), min(hi, top[1])
            return [(lo, hi)]
        if op == "Where" and b is not None and len(args) > 2 and args[2] is not None:
            return [_hull([b, args[2]])]
        if op in _UNARY:
            return [_UNARY[op](a)]
        size = self.sizes.get(node.input[0], INF)
        if op in ("ReduceMax", "ReduceMin"):  # of an empty tensor: -inf / inf
            return [a if 0 < size < INF else UNKNOWN]
        if op in ("ReduceSum", "ReduceMean"):
            total = _reduce_sum(a, size)  # a mean is a sum divided: the sum must stay finite too
            if op == "ReduceSum":
                return [total]
            limit = self._limit(node.input[0])
            if not -limit <= total[0] <= total[1] <= limit:
                return [UNKNOWN]
            error = max(abs(a[0]), abs(a[1])) * size * EPS32  # the sum's rounding, divided by n
            return [_widen(a[0] - error, a[1] + error)]
        if op in ("ReduceSumSquare", "ReduceL2"):
            total = _reduce_sum(_square(a), size)
            return [total if op == "ReduceSumSquare" else _sqrt(total)]
        return [UNKNOWN] * n_out


def array_bounds(array: np.ndarray) -> Interval:
    """The minimum and maximum of ``array`` (unknown when one is NaN or the array is empty)."""
    if array.size == 0:
        return 0.0, 0.0
    if array.dtype == bool:
        return 0.0, 1.0
    if array.dtype.kind not in "fiu":
        return UNKNOWN
    lo, hi = float(np.min(array)), float(np.max(array))
    if math.isnan(lo) or math.isnan(hi):
        return UNKNOWN
    return lo, hi
