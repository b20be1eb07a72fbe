"""Every registered gradient rule against float64 central differences.

One test, parametrized over ``passes.autodiff.registered_rules()``: each rule needs a
case generator here (``CASES`` for the core rule families and the clean stops,
``OTHER_CASES`` for conv, resize, recurrent, newer-opset, attention, quantization, signal,
detection, control-flow and sequence rules), else the test fails with "no case for X".
Every case also runs with symbolic input dims half the time (``symbolic``).
Set EVERY_RULE_EXAMPLES to change the examples per rule, EVERY_RULE_RANDOM for fresh ones.
Generators draw shapes (broadcast pairs for broadcasting ops), attributes and dtypes
with hypothesis and keep inputs away from non-differentiable points (kinks, ties,
domain edges); the check itself lives in ``opcases.check_spec``.

Tolerances (``fdcheck``): |analytic - numeric| <= atol + rtol * |numeric| with
float32: atol 1e-4, rtol 1e-3; float64: atol 1e-6, rtol 1e-5; numeric = float64
central difference with step 1e-6. Non-differentiable rules are checked to be clean
stops: with ``loss += ReduceSum(x * V)`` the gradient of every float input is exactly V.
Where no float64 runtime runs an op (or runs it right) a case names its own check
(``Spec.custom``): float64 central differences of a numpy forward (``_numpy_oracle``),
unit steps of onnxruntime's own forward for ops linear in their input
(``_check_linear_in_ort``), the reference evaluator (``_check_in_reference``), or, for
QuantizeLinear's straight-through estimator, torch's fake-quantize gradients written out.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from collections.abc import Callable

import numpy as np
import onnx
import opcases
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from opcases import Spec
from single_op import linear_attention_reference, max_roi_pool_reference

from gradgraph import check
from gradgraph.api import build_gradient_graph
from passes.autodiff import registered_rules

MAX_EXAMPLES = int(os.environ.get("EVERY_RULE_EXAMPLES", "25"))
# The same examples every run unless EVERY_RULE_RANDOM is set (then fresh ones each run).
DERANDOMIZE = "EVERY_RULE_RANDOM" not in os.environ
SEEDS = st.integers(0, 2**32 - 1)
DTYPES = st.sampled_from([np.float32, np.float64])
OPSETS = (13, 18, 21)
MAX_SIDE = 4
# Distance kept between an input and a non-differentiable point (>> the FD step).
MARGIN = 0.05
# Redraws of the entries that land too close to a non-differentiable point.
MAX_RESAMPLES = 100
# Spacing of the inputs of normalizations (a group of two close values is a near-singular point).
NORM_SPACING = 0.3

Generator = Callable[[str], st.SearchStrategy[Spec]]
CASES: dict[str, Generator] = {}
# Cases for rules that other modules own (conv, resize, recurrent, control, sequence).
OTHER_CASES: dict[str, Generator] = {}


def case(*ops: str, registry: dict[str, Generator] = CASES):
    """Register ``fn(draw, op) -> Spec`` as the case generator of ``ops``."""

    def decorate(fn):
        strategy = st.composite(fn)
        for op in ops:
            registry[op] = strategy
        return fn

    return decorate


# ---- value helpers ---------------------------------------------------------------------------


def rng_of(draw) -> np.random.Generator:
    return np.random.default_rng(draw(SEEDS))


def uniform(rng, shape, lo, hi, dtype=np.float64) -> np.ndarray:
    return rng.uniform(lo, hi, size=shape).astype(dtype)


def away(rng, shape, lo, hi, points=(0.0,), dtype=np.float64, margin=MARGIN) -> np.ndarray:
    """Uniform in [lo, hi] but at least ``margin`` from each of ``points``."""
    x = rng.uniform(lo, hi, size=shape)
    for _ in range(MAX_RESAMPLES):
        bad = np.zeros(np.shape(x), bool)
        for p in points:
            bad |= np.abs(x - p) < margin
        if not bad.any():
            break
        x = np.where(bad, rng.uniform(lo, hi, size=shape), x)
    return np.asarray(x, dtype=dtype)


def distinct(rng, shapes, dtype=np.float64, spacing=0.1) -> list[np.ndarray]:
    """Arrays whose elements are all distinct, ``spacing`` apart (no ties anywhere)."""
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    values = (rng.permutation(sum(sizes)) - sum(sizes) / 2) * spacing
    out, start = [], 0
    for shape, size in zip(shapes, sizes):
        out.append(values[start:start + size].reshape(shape).astype(dtype))
        start += size
    return out


def spread(rng, shape, dtype=np.float64) -> np.ndarray:
    """Distinct values ``NORM_SPACING`` apart: normalized groups keep a variance >> epsilon."""
    [x] = distinct(rng, [shape], dtype, spacing=NORM_SPACING)
    return x


def shape_st(min_dims=0, max_dims=4, min_side=1, max_side=MAX_SIDE):
    return st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


def broadcast_shapes(draw, count, min_dims=0, max_dims=4):
    """``count`` shapes that broadcast together (dims dropped or set to 1 at random)."""
    out = draw(shape_st(min_dims, max_dims))
    shapes = []
    for _ in range(count):
        rank = draw(st.integers(0, len(out))) if draw(st.booleans()) else len(out)
        dims = [1 if draw(st.integers(0, 3)) == 0 else d for d in out[len(out) - rank:]]
        shapes.append(tuple(dims))
    return shapes


def ints(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _defined(op: str, opset: int) -> bool:
    try:
        onnx.defs.get_schema(op, opset)
    except onnx.defs.SchemaError:
        return False
    return True


def opset_for(draw, op, since=13, choices=OPSETS) -> int:
    """An opset from ``choices`` (>= since) where ``op`` exists."""
    return draw(st.sampled_from([o for o in choices if o >= since and _defined(op, o)]))


# ---- elementwise -----------------------------------------------------------------------------

UNARY_DOMAINS = {
    # op: (lo, hi, points to stay away from)
    "Identity": (-2, 2, ()), "Neg": (-2, 2, ()), "Abs": (-2, 2, (0.0,)),
    "Sqrt": (0.2, 3, ()), "Reciprocal": (-2, 2, (0.0,)), "Exp": (-2, 2, ()), "Log": (0.2, 3, ()),
    "Sin": (-3, 3, ()), "Cos": (-3, 3, ()), "Tan": (-1.2, 1.2, ()), "Asin": (-0.9, 0.9, ()),
    "Acos": (-0.9, 0.9, ()), "Atan": (-3, 3, ()), "Sinh": (-2, 2, ()), "Cosh": (-2, 2, ()),
    "Asinh": (-3, 3, ()), "Acosh": (1.2, 3, ()), "Atanh": (-0.9, 0.9, ()), "Tanh": (-3, 3, ()),
    "Sigmoid": (-3, 3, ()), "Erf": (-2, 2, ()), "Softplus": (-3, 3, ()), "Softsign": (-3, 3, ()),
    "Relu": (-2, 2, (0.0,)), "Mish": (-3, 3, ()), "HardSwish": (-5, 5, (-3.0, 3.0)),
}
# Reciprocal near 0 is steep: keep |x| >= this.
RECIPROCAL_MIN = 0.3


@case(*UNARY_DOMAINS)
def unary(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    lo, hi, points = UNARY_DOMAINS[op]
    margin = RECIPROCAL_MIN if op == "Reciprocal" else MARGIN
    x = away(rng, draw(shape_st()), lo, hi, points, dtype, margin)
    return Spec(op, [("x", x)], ("x",), opset=opset_for(draw, op))


@case("LeakyRelu", "Elu", "Celu", "ThresholdedRelu", "Selu")
def unary_alpha(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    attrs = {}
    if draw(st.booleans()):
        attrs["alpha"] = draw(st.floats(0.1, 2.0))
    if op == "Selu" and draw(st.booleans()):
        attrs["gamma"] = draw(st.floats(0.5, 2.0))
    kink = attrs.get("alpha", 1.0) if op == "ThresholdedRelu" else 0.0
    x = away(rng, draw(shape_st()), -3, 3, (kink,), dtype)
    return Spec(op, [("x", x)], ("x",), attrs, opset=opset_for(draw, op))


@case("HardSigmoid")
def hard_sigmoid(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    alpha, beta = draw(st.floats(0.1, 1.0)), draw(st.floats(-0.5, 1.0))
    # Kinks where alpha * x + beta is 0 or 1.
    x = away(rng, draw(shape_st()), -4, 4, (-beta / alpha, (1 - beta) / alpha), dtype)
    return Spec(op, [("x", x)], ("x",), {"alpha": alpha, "beta": beta}, opset=opset_for(draw, op))


@case("Gelu")
def gelu(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    attrs = {"approximate": draw(st.sampled_from(["none", "tanh"]))}
    x = uniform(rng, draw(shape_st()), -3, 3, dtype)
    return Spec(op, [("x", x)], ("x",), attrs, opset=opset_for(draw, op, 20, (20, 21)))


def _gelu_forward(approximate: str, with_bias: bool):
    def forward(inputs, attrs):
        x = inputs["x"] + inputs["bias"] if with_bias else inputs["x"]
        if approximate == "tanh":
            return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))
        return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / np.sqrt(2.0)))
    return forward


@case("com.microsoft::Gelu", "com.microsoft::FastGelu", "com.microsoft::BiasGelu")
def contrib_gelu(draw, op):
    """onnxruntime's contrib GELUs (float32 kernels only): FastGelu with or without its bias,
    BiasGelu's bias, both over the last axis."""
    rng = rng_of(draw)
    shape = draw(shape_st(min_dims=1))
    x = uniform(rng, shape, -3, 3, np.float32)
    with_bias = op == "BiasGelu" or (op == "FastGelu" and draw(st.booleans()))
    inputs = [("x", x)] + ([("bias", uniform(rng, shape[-1:], -1, 1, np.float32))] if with_bias else [])
    forward = _gelu_forward("tanh" if op == "FastGelu" else "none", with_bias)
    return Spec(op, inputs, _subset(draw, [name for name, _ in inputs]), domain="com.microsoft",
                custom=_numpy_oracle(forward))


@case("com.microsoft::QuickGelu")
def contrib_quick_gelu(draw, op):
    """x * sigmoid(alpha x), onnxruntime's float32 kernel; alpha its default or drawn."""
    rng = rng_of(draw)
    x = uniform(rng, draw(shape_st()), -4, 4, np.float32)
    attrs = {"alpha": draw(st.sampled_from([1.702, 0.5, -1.3]))} if draw(st.booleans()) else {}
    alpha = attrs.get("alpha", 1.702)
    forward = lambda inputs, _attrs: np.asarray(inputs["x"] / (1.0 + np.exp(-alpha * inputs["x"])))  # noqa: E731
    return Spec(op, [("x", x)], ("x",), attrs, domain="com.microsoft", custom=_numpy_oracle(forward))


@case("Cast")
def cast(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    to = draw(st.sampled_from([1, 11]))  # FLOAT, DOUBLE
    x = uniform(rng, draw(shape_st()), -2, 2, dtype)
    return Spec(op, [("x", x)], ("x",), {"to": to}, opset=opset_for(draw, op))


@case("CastLike")
def cast_like(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    like = draw(DTYPES)
    x = uniform(rng, draw(shape_st()), -2, 2, dtype)
    return Spec(op, [("x", x), ("like", np.zeros(2, like))], ("x",), opset=opset_for(draw, op))


@case("Add", "Sub", "Mul", "Div")
def binary(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    sa, sb = broadcast_shapes(draw, 2)
    a = uniform(rng, sa, -2, 2, dtype)
    # Keep divisors away from 0.
    b = away(rng, sb, -2, 2, (0.0,), dtype, 0.5) if op == "Div" else uniform(rng, sb, -2, 2, dtype)
    wrt = draw(st.sampled_from([("a", "b"), ("a",), ("b",)]))
    return Spec(op, [("a", a), ("b", b)], wrt, opset=opset_for(draw, op))


@case("Pow")
def power(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    sa, sb = broadcast_shapes(draw, 2)
    variant = draw(st.sampled_from(["float", "int", "const"]))
    if variant == "float":  # positive base, both trained
        inputs = [("a", uniform(rng, sa, 0.5, 2, dtype)), ("e", uniform(rng, sb, -2, 2, dtype))]
        wrt = ("a", "e")
    elif variant == "int":  # integer exponent, any nonzero base
        inputs = [("a", away(rng, sa, -2, 2, (0.0,), dtype, 0.3)), ("e", ints(rng.integers(-2, 4, sb)))]
        wrt = ("a",)
    else:  # constant integer-valued float exponent, negative bases allowed
        inputs = [("a", away(rng, sa, -2, 2, (0.0,), dtype, 0.3)),
                  ("e", np.asarray(rng.integers(1, 4, sb), dtype))]
        wrt = ("a",)
    return Spec(op, inputs, wrt, opset=opset_for(draw, op))


@case("Sum", "Mean", "Max", "Min")
def variadic(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    count = draw(st.integers(1, 3))
    shapes = broadcast_shapes(draw, count)
    arrays = distinct(rng, shapes, dtype, spacing=0.1)
    names = [f"x{i}" for i in range(count)]
    wrt = tuple(n for n in names if draw(st.booleans())) or (names[0],)
    return Spec(op, list(zip(names, arrays)), wrt, opset=opset_for(draw, op))


@case("Where")
def where(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    sc, sx, sy = broadcast_shapes(draw, 3)
    inputs = [("cond", rng.random(sc) > 0.5), ("x", uniform(rng, sx, -2, 2, dtype)),
              ("y", uniform(rng, sy, -2, 2, dtype))]
    wrt = draw(st.sampled_from([("x", "y"), ("x",), ("y",)]))
    return Spec(op, inputs, wrt, opset=opset_for(draw, op))


@case("PRelu")
def prelu(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    sx = draw(shape_st(1))
    rank = draw(st.integers(0, len(sx)))
    ss = tuple(1 if draw(st.booleans()) else d for d in sx[len(sx) - rank:])
    inputs = [("x", away(rng, sx, -2, 2, (0.0,), dtype)), ("slope", uniform(rng, ss, -1, 1, dtype))]
    return Spec(op, inputs, draw(st.sampled_from([("x", "slope"), ("x",), ("slope",)])),
                opset=opset_for(draw, op))


@case("Clip")
def clip(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    lo = draw(st.one_of(st.none(), st.floats(-1.5, 0.0)))
    hi = draw(st.one_of(st.none(), st.floats(0.2, 1.5)))
    bounds = tuple(v for v in (lo, hi) if v is not None)
    x = away(rng, draw(shape_st()), -2, 2, bounds, dtype)
    inputs = [("x", x), ("min", None if lo is None else np.asarray(lo, dtype)),
              ("max", None if hi is None else np.asarray(hi, dtype))]
    return Spec(op, inputs, ("x",), opset=opset_for(draw, op))


# ---- linear algebra --------------------------------------------------------------------------


def _batch_dims(draw, rank, out_batch):
    """The last ``rank - 2`` dims of ``out_batch``, some set to 1 (broadcast)."""
    dims = out_batch[len(out_batch) - max(rank - 2, 0):] if rank > 2 else ()
    return tuple(1 if draw(st.integers(0, 3)) == 0 else d for d in dims)


@case("MatMul")
def matmul(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    ra, rc = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    m, k, n = (draw(st.integers(1, MAX_SIDE)) for _ in range(3))
    out_batch = draw(shape_st(max(ra, rc) - 2, max(ra, rc) - 2, 1, 3)) if max(ra, rc) > 2 else ()
    sa = (k,) if ra == 1 else _batch_dims(draw, ra, out_batch) + (m, k)
    sc = (k,) if rc == 1 else _batch_dims(draw, rc, out_batch) + (k, n)
    inputs = [("a", uniform(rng, sa, -1, 1, dtype)), ("c", uniform(rng, sc, -1, 1, dtype))]
    return Spec(op, inputs, draw(st.sampled_from([("a", "c"), ("a",), ("c",)])), opset=opset_for(draw, op))


@case("com.microsoft::FusedMatMul")
def fused_matmul(draw, op):
    """onnxruntime's float32 FusedMatMul: alpha * op(A) @ op(B), 2-4-D, broadcast batch dims,
    transA / transB drawn (1-D operands without them)."""
    rng = rng_of(draw)
    ra, rc = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    m, k, n = (draw(st.integers(1, MAX_SIDE)) for _ in range(3))
    ta = draw(st.integers(0, 1)) if ra > 1 else 0
    tb = draw(st.integers(0, 1)) if rc > 1 else 0
    out_batch = draw(shape_st(max(ra, rc) - 2, max(ra, rc) - 2, 1, 3)) if max(ra, rc) > 2 else ()
    sa = (k,) if ra == 1 else _batch_dims(draw, ra, out_batch) + ((k, m) if ta else (m, k))
    sc = (k,) if rc == 1 else _batch_dims(draw, rc, out_batch) + ((n, k) if tb else (k, n))
    attrs = {"transA": ta, "transB": tb}
    if draw(st.booleans()):
        attrs["alpha"] = draw(st.sampled_from([0.125, -1.5, 2.0]))
    inputs = [("a", uniform(rng, sa, -1, 1, np.float32)), ("c", uniform(rng, sc, -1, 1, np.float32))]

    def forward(values, attrs):
        a, c = values["a"], values["c"]
        a = np.swapaxes(a, -1, -2) if attrs["transA"] else a
        c = np.swapaxes(c, -1, -2) if attrs["transB"] else c
        return np.asarray(attrs.get("alpha", 1.0) * np.matmul(a, c))

    return Spec(op, inputs, draw(st.sampled_from([("a", "c"), ("a",), ("c",)])), attrs,
                domain="com.microsoft", custom=_numpy_oracle(forward))


@case("Gemm")
def gemm(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    m, k, n = (draw(st.integers(1, MAX_SIDE)) for _ in range(3))
    ta, tb = draw(st.integers(0, 1)), draw(st.integers(0, 1))
    attrs = {"transA": ta, "transB": tb}
    if draw(st.booleans()):
        attrs["alpha"] = draw(st.floats(-2, 2))
    if draw(st.booleans()):
        attrs["beta"] = draw(st.floats(-2, 2))
    sc = draw(st.sampled_from([None, (), (n,), (1, n), (m, 1), (m, n)]))
    inputs = [("a", uniform(rng, (k, m) if ta else (m, k), -1, 1, dtype)),
              ("b", uniform(rng, (n, k) if tb else (k, n), -1, 1, dtype)),
              ("c", None if sc is None else uniform(rng, sc, -1, 1, dtype))]
    names = ("a", "b") if sc is None else ("a", "b", "c")
    wrt = tuple(x for x in names if draw(st.booleans())) or ("a",)
    return Spec(op, inputs, wrt, attrs, opset=opset_for(draw, op))


EINSUM_EQUATIONS = [
    "ij,jk->ik", "bij,bjk->bik", "ij->ji", "i,i->", "ij->i", "ij->", "i,j->ij", "ij,kj->ik",
    "...ij,...jk->...ik", "bhqd,bhkd->bhqk", "ij,jk", "ij,j->i", "ijk->kj", "ij,ij->ij", "ab,bc,cd->ad",
    "...i->...", "...ij,jk->...ki", "i...j,j->...i", "ij...,jk->k...i", "a...,...b->...ab",
]


@case("Einsum")
def einsum(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    eq = draw(st.sampled_from(EINSUM_EQUATIONS))
    sizes = {ch: draw(st.integers(1, 3)) for ch in "abcdhijkq"}
    ellipsis = draw(shape_st(0, 2, 1, 3))
    terms = eq.split("->")[0].split(",")
    inputs = []
    for i, term in enumerate(terms):
        # Each operand's ellipsis may have size 1 where another's does not (broadcasting).
        own = tuple(1 if draw(st.booleans()) else d for d in ellipsis)
        head, dots, tail = term.partition("...")
        shape = (tuple(sizes[ch] for ch in head) + (own if dots else ())
                 + tuple(sizes[ch] for ch in tail))
        inputs.append((f"x{i}", uniform(rng, shape, -1, 1, dtype)))
    wrt = tuple(n for n, _ in inputs if draw(st.booleans())) or ("x0",)
    return Spec(op, inputs, wrt, {"equation": eq}, opset=opset_for(draw, op))


# ---- shape and data movement -----------------------------------------------------------------


def _factor_shape(draw, numel):
    """A random shape with ``numel`` elements."""
    dims = []
    rest = numel
    for _ in range(draw(st.integers(0, 3))):
        divisors = [d for d in range(1, rest + 1) if rest % d == 0]
        d = draw(st.sampled_from(divisors))
        dims.append(d)
        rest //= d
    return dims + [rest]


@case("Reshape")
def reshape(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    target = _factor_shape(draw, int(np.prod(shape)))
    if draw(st.booleans()):
        target[draw(st.integers(0, len(target) - 1))] = -1
    for i in range(min(len(shape), len(target))):
        if target[i] == shape[i] and draw(st.booleans()):
            target[i] = 0
    return Spec(op, [("x", uniform(rng, shape, -1, 1, dtype)), ("shape", ints(target))], ("x",),
                opset=opset_for(draw, op), dynamic=("shape",) if draw(st.booleans()) else ())


@case("Flatten")
def flatten(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    axis = draw(st.integers(-len(shape), len(shape)))
    return Spec(op, [("x", uniform(rng, shape, -1, 1, dtype))], ("x",), {"axis": axis}, opset=opset_for(draw, op))


@case("Squeeze")
def squeeze(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(st.lists(st.sampled_from([1, 1, 2, 3]), min_size=1, max_size=4).map(tuple))
    ones = [i for i, d in enumerate(shape) if d == 1]
    axes = [a - len(shape) if draw(st.booleans()) else a for a in ones if draw(st.booleans())]
    axes_in = ints(axes) if axes or draw(st.booleans()) else None
    if axes_in is not None and not axes:
        axes_in = None
    return Spec(op, [("x", uniform(rng, shape, -1, 1, dtype)), ("axes", axes_in)], ("x",),
                opset=opset_for(draw, op))


@case("Unsqueeze")
def unsqueeze(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(0, 3))
    count = draw(st.integers(1, 2))
    out_rank = len(shape) + count
    axes = draw(st.lists(st.integers(0, out_rank - 1), min_size=count, max_size=count, unique=True))
    axes = [a - out_rank if draw(st.booleans()) else a for a in axes]
    return Spec(op, [("x", uniform(rng, shape, -1, 1, dtype)), ("axes", ints(axes))], ("x",),
                opset=opset_for(draw, op))


@case("Transpose")
def transpose(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    attrs = {}
    if draw(st.booleans()):
        attrs["perm"] = list(draw(st.permutations(range(len(shape)))))
    return Spec(op, [("x", uniform(rng, shape, -1, 1, dtype))], ("x",), attrs, opset=opset_for(draw, op))


@case("Expand")
def expand(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    sx, ss = broadcast_shapes(draw, 2)
    return Spec(op, [("x", uniform(rng, sx, -1, 1, dtype)), ("shape", ints(ss))], ("x",),
                opset=opset_for(draw, op))


@case("Tile")
def tile(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1, 3))
    repeats = [draw(st.integers(1, 3)) for _ in shape]
    return Spec(op, [("x", uniform(rng, shape, -1, 1, dtype)), ("repeats", ints(repeats))], ("x",),
                opset=opset_for(draw, op), dynamic=("repeats",) if draw(st.booleans()) else ())


@case("Concat")
def concat(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = list(draw(shape_st(1)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    count = draw(st.integers(1, 3))
    inputs = []
    for i in range(count):
        shape[axis] = draw(st.integers(1, 3))
        inputs.append((f"x{i}", uniform(rng, tuple(shape), -1, 1, dtype)))
    wrt = tuple(n for n, _ in inputs if draw(st.booleans())) or ("x0",)
    return Spec(op, inputs, wrt, {"axis": axis}, opset=opset_for(draw, op))


@case("Split")
def split(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = list(draw(shape_st(1)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    opset = opset_for(draw, op)
    parts = draw(st.integers(1, 3))
    inputs = [("x", None)]
    attrs = {"axis": axis}
    if draw(st.booleans()):
        sizes = [draw(st.integers(1, 3)) for _ in range(parts)]
        shape[axis] = sum(sizes)
        inputs.append(("split", ints(sizes)))
    else:
        shape[axis] = parts * draw(st.integers(1, 2))
        if opset >= 18:
            attrs["num_outputs"] = parts
    inputs[0] = ("x", uniform(rng, tuple(shape), -1, 1, dtype))
    used = tuple(i for i in range(parts) if draw(st.booleans())) or (0,)
    return Spec(op, inputs, ("x",), attrs, opset=opset, outputs=parts, loss_outputs=used)


@case("GatherElements")
def gather_elements(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    idx_shape = list(shape)
    idx_shape[axis] = draw(st.integers(1, MAX_SIDE))
    size = shape[axis]
    idx = rng.integers(-size, size, idx_shape)
    return Spec(op, [("x", uniform(rng, shape, -1, 1, dtype)), ("idx", ints(idx))], ("x",), {"axis": axis},
                opset=opset_for(draw, op))


@case("GatherND")
def gather_nd(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    batch_dims = draw(st.integers(0, min(1, len(shape) - 1)))
    q = draw(st.integers(1, len(shape) - batch_dims))
    middle = draw(shape_st(0, 2, 1, 3))
    idx_shape = shape[:batch_dims] + middle
    cols = [rng.integers(-shape[batch_dims + j], shape[batch_dims + j], idx_shape) for j in range(q)]
    idx = np.stack(cols, axis=-1) if cols else np.zeros(idx_shape + (0,), np.int64)
    return Spec(op, [("x", uniform(rng, shape, -1, 1, dtype)), ("idx", ints(idx))], ("x",),
                {"batch_dims": batch_dims}, opset=opset_for(draw, op))


@case("DepthToSpace", "SpaceToDepth")
def depth_space(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    bs = draw(st.integers(1, 3))
    n, c, h, w = (draw(st.integers(1, 2)) for _ in range(4))
    attrs = {"blocksize": bs}
    if op == "DepthToSpace":
        shape = (n, c * bs * bs, h, w)
        attrs["mode"] = draw(st.sampled_from(["DCR", "CRD"]))
    else:
        shape = (n, c, h * bs, w * bs)
    return Spec(op, [("x", uniform(rng, shape, -1, 1, dtype))], ("x",), attrs, opset=opset_for(draw, op))


@case("ReverseSequence")
def reverse_sequence(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    batch_axis = draw(st.integers(0, 1))
    time_axis = 1 - batch_axis
    shape = draw(shape_st(2))
    lens = rng.integers(1, shape[time_axis] + 1, shape[batch_axis])
    return Spec(op, [("x", uniform(rng, shape, -1, 1, dtype)), ("lens", ints(lens))], ("x",),
                {"batch_axis": batch_axis, "time_axis": time_axis}, opset=opset_for(draw, op))


def _slice_axis(draw, size):
    """(start, end, step) selecting at least one element of an axis of ``size``."""
    step = draw(st.sampled_from([1, 1, 2, -1, -2]))
    while True:
        start = draw(st.integers(-size - 2, size + 2))
        end = draw(st.integers(-size - 2, size + 2))
        if len(range(size)[slice(start, end, step)]) > 0:
            return start, end, step


@case("Slice")
def slice_(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    axes = draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape), unique=True))
    picks = [_slice_axis(draw, shape[a]) for a in axes]
    starts, ends, steps = (ints([p[i] for p in picks]) for i in range(3))
    neg_axes = ints([a - len(shape) if draw(st.booleans()) else a for a in axes])
    with_axes = draw(st.booleans()) or axes != list(range(len(axes)))
    with_steps = draw(st.booleans()) or bool(np.any(steps != 1))
    inputs = [("x", uniform(rng, shape, -1, 1, dtype)), ("starts", starts), ("ends", ends),
              ("axes", neg_axes if with_axes else None), ("steps", steps if with_steps else None)]
    dynamic = tuple(n for n in ("starts", "ends", "axes", "steps") if draw(st.integers(0, 3)) == 0)
    return Spec(op, inputs, ("x",), opset=opset_for(draw, op), dynamic=dynamic)


@case("Gather")
def gather(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    size = shape[axis]
    idx = rng.integers(-size, size, draw(shape_st(0, 2, 1, 3)))
    return Spec(op, [("x", uniform(rng, shape, -1, 1, dtype)), ("idx", ints(idx))], ("x",), {"axis": axis},
                opset=opset_for(draw, op), dynamic=("idx",) if draw(st.booleans()) else ())


@case("ScatterND")
def scatter_nd(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    q = draw(st.integers(1, len(shape)))
    cells = int(np.prod(shape[:q]))
    opset = opset_for(draw, op)
    attrs = _scatter_reduction(draw, opset)
    count = draw(st.integers(1, cells + 2 if attrs else cells))
    # Overwriting scatters need unique targets; reductions combine duplicates.
    flat = rng.choice(cells, size=count, replace="reduction" in attrs)
    idx = np.stack(np.unravel_index(flat, shape[:q]), axis=-1)
    upd_shape = (count,) + tuple(shape[q:])
    x, upd = _scatter_values(rng, attrs, shape, upd_shape, dtype)
    inputs = [("x", x), ("idx", ints(idx)), ("upd", upd)]
    return Spec(op, inputs, draw(st.sampled_from([("x", "upd"), ("x",), ("upd",)])), attrs, opset=opset)


# First opsets with the reduction attribute of ScatterND/ScatterElements ("add", "mul"), and
# with its "min" and "max".
SCATTER_REDUCTION_SINCE = 16
SCATTER_MIN_MAX_SINCE = 18


def _scatter_reduction(draw, opset) -> dict:
    if opset < SCATTER_REDUCTION_SINCE or not draw(st.booleans()):
        return {}
    reductions = ["add", "mul"] + (["min", "max"] if opset >= SCATTER_MIN_MAX_SINCE else [])
    return {"reduction": draw(st.sampled_from(reductions))}


def _scatter_values(rng, attrs, shape, upd_shape, dtype):
    """(data, updates); for min / max all distinct, so that no update ties the data or another."""
    if attrs.get("reduction") in ("min", "max"):
        return distinct(rng, [shape, upd_shape], dtype)
    return uniform(rng, shape, -1, 1, dtype), uniform(rng, upd_shape, -1, 1, dtype)


@case("ScatterElements")
def scatter_elements(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    opset = opset_for(draw, op)
    attrs = {"axis": axis, **_scatter_reduction(draw, opset)}
    idx_shape = [draw(st.integers(1, d)) for d in shape]
    ax = axis % len(shape)
    moved = [s for i, s in enumerate(idx_shape) if i != ax]
    if "reduction" in attrs:  # duplicates are combined
        idx = rng.integers(-shape[ax], shape[ax], idx_shape)
    else:  # unique targets: along the axis, each position gets a distinct index
        lines = [rng.permutation(shape[ax])[:idx_shape[ax]] for _ in range(int(np.prod(moved)))]
        idx = np.moveaxis(np.asarray(lines).reshape(moved + [idx_shape[ax]]), -1, ax)
    x, upd = _scatter_values(rng, attrs, shape, tuple(idx_shape), dtype)
    inputs = [("x", x), ("idx", ints(idx)), ("upd", upd)]
    return Spec(op, inputs, draw(st.sampled_from([("x", "upd"), ("x",), ("upd",)])), attrs, opset=opset)


@case("Pad")
def pad(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    opset = opset_for(draw, op)
    modes = ["constant", "reflect", "edge"] + (["wrap"] if opset >= 19 else [])
    mode = draw(st.sampled_from(modes))
    shape = draw(shape_st(1, 3, 2))
    rank = len(shape)
    with_axes = opset >= 18 and draw(st.booleans())
    axes = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True)) \
        if with_axes else list(range(rank))
    low = -1 if mode == "constant" else 0
    begins = [draw(st.integers(low, shape[a] - 1)) for a in axes]
    ends = [draw(st.integers(low, shape[a] - 1)) for a in axes]
    inputs = [("x", uniform(rng, shape, -1, 1, dtype)), ("pads", ints(begins + ends))]
    if mode == "constant" and draw(st.booleans()):
        inputs.append(("value", np.asarray(draw(st.floats(-1, 1)), dtype)))
    elif with_axes:
        inputs.append(("value", None))
    if with_axes:
        inputs.append(("axes", ints([a - rank if draw(st.booleans()) else a for a in axes])))
    return Spec(op, inputs, ("x",), {"mode": mode}, opset=opset)


@case("Trilu")
def trilu(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(2, 3))
    k = draw(st.one_of(st.none(), st.integers(-3, 3)))
    inputs = [("x", uniform(rng, shape, -1, 1, dtype)), ("k", None if k is None else ints(k))]
    return Spec(op, inputs, ("x",), {"upper": draw(st.integers(0, 1))}, opset=opset_for(draw, op))


@case("TopK")
def topk(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    k = draw(st.integers(1, shape[axis]))
    [x] = distinct(rng, [shape], dtype)
    attrs = {"axis": axis, "largest": draw(st.integers(0, 1)), "sorted": draw(st.integers(0, 1))}
    return Spec(op, [("x", x), ("k", ints([k]))], ("x",), attrs, opset=opset_for(draw, op), outputs=2)


@case("OneHot")
def one_hot(draw, op):
    """Linear in its values (off, on); onnxruntime has no float64 OneHot (float32 runs)."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    depth = draw(st.integers(1, 4))
    idx = ints(rng.integers(-depth, depth, draw(shape_st(1, 2))))
    inputs = [("idx", idx), ("depth", ints(depth)), ("values", uniform(rng, (2,), -1, 1, dtype))]
    return Spec(op, inputs, ("values",), {"axis": draw(st.integers(-1, idx.ndim))}, opset=opset_for(draw, op))


@case("Range")
def range_(draw, op):
    """Linear in start and delta; the limit sits half a step past the last element, so the
    count stays put within the difference step (limit itself only sets the count)."""
    dtype = draw(DTYPES)
    start, delta = draw(st.floats(-2, 2)), draw(st.sampled_from([0.5, 1.0, -0.7]))
    limit = start + delta * draw(st.integers(1, 5)) - delta / 2
    inputs = [(k, np.asarray(v, dtype)) for k, v in (("start", start), ("limit", limit), ("delta", delta))]
    return Spec(op, inputs, _subset(draw, ["start", "delta"]), opset=opset_for(draw, op))


# ---- reductions ------------------------------------------------------------------------------

REDUCE_VALUES = {
    # op: (lo, hi, points to avoid); ReduceMax/ReduceMin use distinct values instead
    "ReduceSum": (-2, 2, ()), "ReduceMean": (-2, 2, ()), "ReduceProd": (-2, 2, (0.0,)),
    "ReduceL1": (-2, 2, (0.0,)), "ReduceL2": (-2, 2, ()), "ReduceSumSquare": (-2, 2, ()),
    "ReduceLogSumExp": (-2, 2, ()), "ReduceLogSum": (0.5, 2, ()),
}
# Keep ReduceProd factors away from 0 so the product's derivative is well scaled.
PROD_MARGIN = 0.3
# Share of ReduceProd inputs set to exactly 0 in the zeros variant.
ZERO_FRACTION = 0.3


@case("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
      "ReduceSumSquare", "ReduceLogSumExp", "ReduceLogSum")
def reduction(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    opset = opset_for(draw, op)
    shape = draw(shape_st(1, 4, 1, 3))
    rank = len(shape)
    if op in ("ReduceMax", "ReduceMin"):
        [x] = distinct(rng, [shape], dtype)
    else:
        lo, hi, points = REDUCE_VALUES[op]
        x = away(rng, shape, lo, hi, points, dtype, PROD_MARGIN if op == "ReduceProd" else MARGIN)
        if op == "ReduceProd" and draw(st.booleans()):  # exact zeros: the product is multilinear
            x[rng.random(shape) < ZERO_FRACTION] = 0.0
    attrs = {"keepdims": draw(st.integers(0, 1))}
    axes = draw(st.one_of(st.none(), st.lists(st.integers(0, rank - 1), max_size=rank, unique=True)))
    if axes is not None:
        axes = [a - rank if draw(st.booleans()) else a for a in axes]
    inputs = [("x", x)]
    dynamic = ()
    axes_as_input = op == "ReduceSum" or opset >= 18
    if axes_as_input and draw(st.booleans()):
        attrs["noop_with_empty_axes"] = draw(st.integers(0, 1))
    if axes is not None and axes_as_input:
        inputs.append(("axes", ints(axes)))
        dynamic = ("axes",) if draw(st.booleans()) else ()
    elif axes:
        attrs["axes"] = axes
    return Spec(op, inputs, ("x",), attrs, opset=opset, dynamic=dynamic)


@case("CumSum")
def cumsum(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    axis_dtype = draw(st.sampled_from([np.int32, np.int64]))
    attrs = {"exclusive": draw(st.integers(0, 1)), "reverse": draw(st.integers(0, 1))}
    inputs = [("x", uniform(rng, shape, -1, 1, dtype)), ("axis", np.asarray(axis, axis_dtype))]
    return Spec(op, inputs, ("x",), attrs, opset=opset_for(draw, op),
                dynamic=("axis",) if draw(st.booleans()) else ())


# ---- neural-network ops ----------------------------------------------------------------------


@case("Softmax", "LogSoftmax")
def softmax(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    attrs = {"axis": draw(st.integers(-len(shape), len(shape) - 1))} if draw(st.booleans()) else {}
    return Spec(op, [("x", uniform(rng, shape, -2, 2, dtype))], ("x",), attrs, opset=opset_for(draw, op))


def _subset(draw, names, required=()):
    return tuple(n for n in names if n in required or draw(st.booleans())) or (names[0],)


@case("LayerNormalization")
def layer_norm(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1, 4, 2))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    norm_shape = shape[axis % len(shape):]
    with_bias = draw(st.booleans())
    inputs = [("x", spread(rng, shape, dtype)), ("scale", uniform(rng, norm_shape, 0.5, 1.5, dtype))]
    if with_bias:
        inputs.append(("bias", uniform(rng, norm_shape, -1, 1, dtype)))
    attrs = {"axis": axis, "epsilon": draw(st.sampled_from([1e-5, 1e-2]))}
    outputs = draw(st.integers(1, 3))
    wrt = _subset(draw, [n for n, _ in inputs])
    return Spec(op, inputs, wrt, attrs, opset=opset_for(draw, op, 17), outputs=outputs)


@case("BatchNormalization")
def batch_norm(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(2, 4, 2))
    c = shape[1]
    opset = opset_for(draw, op, 13, (13, 15, 21))
    training = opset >= 15 and draw(st.booleans())
    inputs = [("x", spread(rng, shape, dtype)), ("scale", uniform(rng, (c,), 0.5, 1.5, dtype)),
              ("bias", uniform(rng, (c,), -1, 1, dtype)), ("mean", uniform(rng, (c,), -1, 1, dtype)),
              ("var", uniform(rng, (c,), 0.5, 1.5, dtype))]
    attrs = {"epsilon": draw(st.sampled_from([1e-5, 1e-2]))}
    outputs, used = 1, None
    if training:  # Y, running_mean, running_var (the spec requires all three)
        attrs.update(training_mode=1, momentum=draw(st.floats(0.1, 0.9)))
        outputs, used = 3, _subset(draw, [0, 1, 2])
    names = [n for n, _ in inputs]
    if training and not {1, 2} & set(used or ()):  # Y alone does not read the running statistics:
        names = [n for n in names if n not in ("mean", "var")]  # naming them is refused (test_api)
    wrt = _subset(draw, names)
    return Spec(op, inputs, wrt, attrs, opset=opset, outputs=outputs, loss_outputs=used)


@case("InstanceNormalization")
def instance_norm(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(3, 4, 2))
    c = shape[1]
    inputs = [("x", spread(rng, shape, dtype)), ("scale", uniform(rng, (c,), 0.5, 1.5, dtype)),
              ("bias", uniform(rng, (c,), -1, 1, dtype))]
    attrs = {"epsilon": draw(st.sampled_from([1e-5, 1e-2]))}
    return Spec(op, inputs, _subset(draw, ["x", "scale", "bias"]), attrs, opset=opset_for(draw, op))


@case("GroupNormalization")
def group_norm(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    groups = draw(st.integers(1, 3))
    per_group = draw(st.integers(1, 2))
    spatial = draw(shape_st(1, 2, 1, 3))
    shape = (draw(st.integers(1, 2)), groups * per_group) + spatial
    opset = opset_for(draw, op, 18, (18, 21))
    params = shape[1] if opset >= 21 else groups
    inputs = [("x", spread(rng, shape, dtype)), ("scale", uniform(rng, (params,), 0.5, 1.5, dtype)),
              ("bias", uniform(rng, (params,), -1, 1, dtype))]
    attrs = {"num_groups": groups, "epsilon": draw(st.sampled_from([1e-5, 1e-2]))}
    return Spec(op, inputs, _subset(draw, ["x", "scale", "bias"]), attrs, opset=opset)


DROPOUT_SEED = 7


def _check_dropout_training(spec: Spec) -> None:
    """dX = W * mask / (1 - ratio): the mask is read from the same run as the gradient."""
    model, feeds = opcases.loss_model(spec)
    mask, grad = opcases.run_gradient_model(model, ["x"], feeds, ["y1"])
    weight = opcases.initializer(model, "fdcheck_w_0")
    ratio = float(spec.array("ratio"))
    expected = weight.astype(np.float64) * mask / (1.0 - ratio)
    tol = opcases.fdcheck.tolerance_for(spec.dtype)
    np.testing.assert_allclose(grad, expected, rtol=tol.rtol, atol=tol.atol)


@case("Dropout")
def dropout(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    x = uniform(rng, draw(shape_st(1)), -2, 2, dtype)
    variant = draw(st.sampled_from(["inference", "training_off", "training"]))
    if variant == "inference":
        return Spec(op, [("x", x)], ("x",), opset=opset_for(draw, op), outputs=draw(st.integers(1, 2)))
    ratio = np.asarray(draw(st.floats(0.1, 0.7)), dtype)
    if variant == "training_off":
        inputs = [("x", x), ("ratio", ratio), ("training", np.asarray(False))]
        return Spec(op, inputs, ("x",), opset=opset_for(draw, op))
    inputs = [("x", x), ("ratio", ratio), ("training", np.asarray(True))]
    return Spec(op, inputs, ("x",), {"seed": DROPOUT_SEED}, opset=opset_for(draw, op), outputs=2,
                loss_outputs=(0,), custom=_check_dropout_training)


def _labels(draw, rng, shape, classes):
    labels = rng.integers(0, classes, shape)
    ignore = None
    if draw(st.booleans()):
        ignore = draw(st.sampled_from([-1, 0, classes - 1]))
        hit = rng.random(shape) < 0.3
        labels = np.where(hit, ignore, labels)
        labels.reshape(-1)[0] = (ignore + 1) % classes if ignore >= 0 else 0  # one kept sample
    return ints(labels), ignore


@case("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
def cross_entropy(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    n, c = draw(st.integers(1, 3)), draw(st.integers(2, 4))
    extra = draw(shape_st(0, 2, 1, 2))
    labels, ignore = _labels(draw, rng, (n,) + extra, c)
    inputs = [("scores", uniform(rng, (n, c) + extra, -2, 2, dtype)), ("labels", labels)]
    if draw(st.booleans()):
        inputs.append(("weights", uniform(rng, (c,), 0.5, 1.5, dtype)))
    attrs = {"reduction": draw(st.sampled_from(["none", "sum", "mean"]))}
    if ignore is not None:
        attrs["ignore_index"] = ignore
    outputs = draw(st.integers(1, 2)) if op == "SoftmaxCrossEntropyLoss" else 1
    return Spec(op, inputs, ("scores",), attrs, opset=opset_for(draw, op), outputs=outputs)


# ---- non-differentiable ops: clean stops -------------------------------------------------------


def _stop(op, inputs, wrt, attrs=None):
    return Spec(op, inputs, wrt, attrs or {}, kind="stop")


@case("Round", "Floor", "Ceil", "Sign", "Shape", "Size", "NonZero", "IsNaN", "IsInf",
      "RandomNormalLike", "RandomUniformLike", "EyeLike")
def stop_unary(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(2, 2)) if op == "EyeLike" else draw(shape_st())
    return _stop(op, [("x", uniform(rng, shape, -3, 3, dtype))], ("x",))


@case("ArgMax", "ArgMin")
def stop_arg(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    attrs = {"axis": draw(st.integers(-len(shape), len(shape) - 1)), "keepdims": draw(st.integers(0, 1))}
    return _stop(op, [("x", uniform(rng, shape, -3, 3, dtype))], ("x",), attrs)


@case("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual")
def stop_compare(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    sa, sb = broadcast_shapes(draw, 2)
    return _stop(op, [("a", uniform(rng, sa, -1, 1, dtype)), ("b", uniform(rng, sb, -1, 1, dtype))],
                 ("a", "b"))


@case("Not", "And", "Or", "Xor")
def stop_logic(draw, op):
    rng = rng_of(draw)
    sa, sb = broadcast_shapes(draw, 2)
    inputs = [("a", rng.random(sa) > 0.5)] + ([] if op == "Not" else [("b", rng.random(sb) > 0.5)])
    return _stop(op, inputs, ())


@case("ConstantOfShape")
def stop_constant_of_shape(draw, op):
    shape = draw(shape_st(0, 3))
    return _stop(op, [("shape", ints(shape))], ())


@case("Constant")
def stop_constant(draw, op):
    rng = rng_of(draw)
    value = numpy_helper.from_array(uniform(rng, draw(shape_st()), -1, 1, np.float32))
    return _stop(op, [], (), {"value": value})


@case("RandomNormal", "RandomUniform")
def stop_random(draw, op):
    return _stop(op, [], (), {"shape": list(draw(shape_st(1)))})


@case("Multinomial", "Bernoulli")
def stop_sampling(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(2, 2))
    if op == "Multinomial":
        return _stop(op, [("x", uniform(rng, shape, -1, 1, dtype))], ("x",),
                     {"sample_size": draw(st.integers(1, 3))})
    return _stop(op, [("x", uniform(rng, shape, 0.1, 0.9, dtype))], ("x",))


@case("BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot")
def stop_bitwise(draw, op):
    rng = rng_of(draw)
    dtype = draw(st.sampled_from([np.uint8, np.uint32]) if op == "BitShift" else
                 st.sampled_from([np.int32, np.int64, np.uint8]))
    sa, sb = broadcast_shapes(draw, 2)
    inputs = [("a", np.asarray(rng.integers(0, 100, sa), dtype))]
    attrs = {}
    if op == "BitShift":
        inputs.append(("b", np.asarray(rng.integers(0, 4, sb), dtype)))
        attrs["direction"] = draw(st.sampled_from(["LEFT", "RIGHT"]))
    elif op != "BitwiseNot":
        inputs.append(("b", np.asarray(rng.integers(0, 100, sb), dtype)))
    return Spec(op, inputs, (), attrs, kind="stop", opset=opset_for(draw, op, 18, (18, 21)))


@case("BitCast")
def stop_bit_cast(draw, op):
    """float32 -> int32 or float64 -> int64: the same bits."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    to = onnx.TensorProto.INT32 if dtype == np.float32 else onnx.TensorProto.INT64
    return Spec(op, [("x", uniform(rng, draw(shape_st()), -2, 2, dtype))], ("x",), {"to": to}, kind="stop",
                opset=opset_for(draw, op, 26, (26, 28)))


@case("HannWindow", "HammingWindow", "BlackmanWindow")
def stop_window(draw, op):
    size = np.asarray(draw(st.integers(1, 6)), draw(st.sampled_from([np.int32, np.int64])))
    attrs = {"periodic": draw(st.integers(0, 1)),
             "output_datatype": draw(st.sampled_from([onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE]))}
    return Spec(op, [("size", size)], (), attrs, kind="stop", opset=opset_for(draw, op, 17, (17, 21)))


@case("MelWeightMatrix")
def stop_mel_weight_matrix(draw, op):
    """The band edges are float inputs: the matrix is piecewise constant in them."""
    dtype = draw(DTYPES)
    lower = draw(st.floats(0.0, 1000.0))
    inputs = [("bins", ints(draw(st.integers(1, 4)))), ("dft_length", ints(draw(st.sampled_from([8, 16])))),
              ("rate", ints(8000)), ("lower", np.asarray(lower, dtype)),
              ("upper", np.asarray(lower + draw(st.floats(500.0, 3000.0)), dtype))]
    return Spec(op, inputs, ("lower", "upper"), kind="stop", opset=opset_for(draw, op, 17, (17, 21)))


@case("MatMulInteger", "ConvInteger")
def stop_integer_products(draw, op):
    rng = rng_of(draw)
    if op == "MatMulInteger":
        m, k, n = (draw(st.integers(1, 3)) for _ in range(3))
        sa, sb = (m, k), (k, n)
    else:
        c, spatial = draw(st.integers(1, 2)), draw(shape_st(1, 2, 2, 4))
        kernel = tuple(draw(st.integers(1, d)) for d in spatial)
        sa, sb = (1, c) + spatial, (draw(st.integers(1, 2)), c) + kernel
    inputs = [("a", np.asarray(rng.integers(0, 255, sa), np.uint8)),
              ("b", np.asarray(rng.integers(0, 255, sb), np.uint8))]
    if draw(st.booleans()):
        inputs += [("a_zero", np.asarray(rng.integers(0, 255), np.uint8)),
                   ("b_zero", np.asarray(rng.integers(0, 255), np.uint8))]
    return Spec(op, inputs, (), kind="stop", opset=opset_for(draw, op))


@case("QLinearMatMul", "QLinearConv")
def stop_qlinear(draw, op):
    """Integer in, integer out; the float scales get no gradient either."""
    rng, dtype = rng_of(draw), np.float32  # the scales are float32 only
    if op == "QLinearMatMul":
        m, k, n = (draw(st.integers(1, 3)) for _ in range(3))
        sa, sb = (m, k), (k, n)
    else:
        c, spatial = draw(st.integers(1, 2)), draw(shape_st(1, 2, 2, 4))
        sa, sb = (1, c) + spatial, (draw(st.integers(1, 2)), c) + tuple(draw(st.integers(1, d)) for d in spatial)

    def quantized(name, shape):
        return [(name, np.asarray(rng.integers(0, 255, shape), np.uint8)),
                (f"{name}_scale", uniform(rng, (), 0.01, 0.1, dtype)),
                (f"{name}_zero", np.asarray(rng.integers(0, 255), np.uint8))]

    inputs = quantized("a", sa) + quantized("b", sb)
    out = [("y_scale", uniform(rng, (), 0.05, 0.5, dtype)), ("y_zero", np.asarray(rng.integers(0, 255), np.uint8))]
    scales = ("a_scale", "b_scale", "y_scale")
    return Spec(op, inputs + out, _subset(draw, scales), kind="stop", opset=opset_for(draw, op))


@case("NonMaxSuppression")
def stop_non_max_suppression(draw, op):
    rng, dtype = rng_of(draw), np.float32  # onnxruntime: float32 boxes and scores only
    batch, boxes, classes = draw(st.integers(1, 2)), draw(st.integers(1, 5)), draw(st.integers(1, 2))
    corners = uniform(rng, (batch, boxes, 2), 0, 1, dtype)
    inputs = [("boxes", np.concatenate([corners, corners + uniform(rng, (batch, boxes, 2), 0.1, 0.5, dtype)], -1)),
              ("scores", uniform(rng, (batch, classes, boxes), 0, 1, dtype)),
              ("max_boxes", ints([draw(st.integers(0, 3))])),
              ("iou", np.asarray([draw(st.floats(0.1, 0.9))], dtype)),
              ("score_threshold", np.asarray([draw(st.floats(0.0, 0.5))], dtype))]
    return Spec(op, inputs, _subset(draw, ["boxes", "scores"]), {"center_point_box": draw(st.integers(0, 1))},
                kind="stop", opset=opset_for(draw, op))


@case("Unique")
def stop_unique(draw, op):
    """Y holds values of X, but no derivative at the ties that make it useful: a clean stop."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1, 3))
    x = np.asarray(rng.integers(-2, 3, shape), dtype)  # repeated values
    attrs = {"sorted": draw(st.integers(0, 1))}
    if draw(st.booleans()):
        attrs["axis"] = draw(st.integers(-len(shape), len(shape) - 1))
    return Spec(op, [("x", x)], ("x",), attrs, kind="stop", opset=opset_for(draw, op), outputs=4)


def _strings(rng, shape, words=("ab", "Cd", "e f", "GH i", "")):
    return np.asarray(rng.choice(words, shape), dtype=object)


# The string ops' outputs enter the loss through their shapes (strings cannot be cast to floats).
_SHAPE_OF_Y0 = (helper.make_node("Shape", ["y0"], ["y0_shape"]),)


@case("StringNormalizer", "StringConcat", "StringSplit", "RegexFullMatch")
def stop_strings(draw, op):
    rng = rng_of(draw)
    if op == "StringNormalizer":  # [C] or [1, C]
        shape = draw(st.sampled_from([(), (1,)])) + (draw(st.integers(1, MAX_SIDE)),)
    else:
        shape = draw(shape_st(0, 2))
    inputs, attrs, outputs, read = [("s", _strings(rng, shape))], {}, 1, _SHAPE_OF_Y0
    graph_outputs = ("y0_shape",)
    if op == "StringNormalizer":  # the "C" locale: onnxruntime's default, en_US.UTF-8, may be missing
        attrs = {"case_change_action": draw(st.sampled_from(["LOWER", "UPPER", "NONE"])), "locale": "C"}
    elif op == "StringConcat":
        inputs.append(("t", _strings(rng, shape)))
    elif op == "StringSplit":
        attrs, outputs, read, graph_outputs = {"delimiter": " "}, 2, (), ("y1",)
    else:
        attrs, read, graph_outputs = {"pattern": "[a-z]+"}, (), ("y0",)
    return Spec(op, inputs, (), attrs, kind="stop", opset=opset_for(draw, op, 20, (20, 21)), outputs=outputs,
                extra_nodes=read, graph_outputs=graph_outputs)


@case("TfIdfVectorizer")
def stop_tf_idf(draw, op):
    rng = rng_of(draw)
    x = ints(rng.integers(0, 5, draw(shape_st(1, 2, 1, 5))))
    attrs = {"mode": draw(st.sampled_from(["TF", "IDF", "TFIDF"])), "min_gram_length": 1, "max_gram_length": 1,
             "max_skip_count": 0, "ngram_counts": [0], "ngram_indexes": [0, 1, 2], "pool_int64s": [1, 2, 3]}
    return Spec(op, [("x", x)], (), attrs, kind="stop", opset=opset_for(draw, op))


def _check_stop_in_reference(spec: Spec) -> None:
    """``opcases.check_stop`` with every run in the reference evaluator (no onnxruntime kernel)."""
    model, feeds = opcases.forward_model(spec)
    names = [o.name for o in model.graph.output]
    values = ReferenceEvaluator(model).run(names, feeds)
    model = opcases.fdcheck.with_weighted_loss(model, {n: np.shape(v) for n, v in zip(names, values)})
    model, probes = opcases._with_passthrough(model, spec, feeds, 0)
    grad_model = build_gradient_graph(model, opcases.fdcheck.LOSS, list(probes))
    grads = ReferenceEvaluator(grad_model).run([f"{p}{opcases.fdcheck.GRAD_SUFFIX}" for p in probes], feeds)
    for (name, expected), got in zip(probes.items(), grads):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6, err_msg=f"{name} of {spec.describe()}")


@case("ImageDecoder")
def stop_image_decoder(draw, op):
    """A PNG or BMP of a few pixels. onnxruntime has no ImageDecoder kernel: the reference
    evaluator runs it (with Pillow, a dependency of matplotlib). A float64 value beside it,
    read by nothing but the stop check's own term, is what is trained: opcases.runnable then
    hands the spec on (as float32) instead of failing on the missing kernel."""
    import PIL.Image

    rng = rng_of(draw)
    pixels = np.asarray(rng.integers(0, 256, (draw(st.integers(1, 3)), draw(st.integers(1, 3)), 3)), np.uint8)
    encoded = io.BytesIO()
    PIL.Image.fromarray(pixels).save(encoded, format=draw(st.sampled_from(["PNG", "BMP"])))
    attrs = {"pixel_format": draw(st.sampled_from(["RGB", "BGR", "Grayscale"]))}
    return Spec(op, [("encoded", np.frombuffer(encoded.getvalue(), np.uint8).copy())], ("beside",), attrs,
                kind="stop", opset=opset_for(draw, op, 20, (20, 21)), custom=_check_stop_in_reference,
                side_inputs=[("beside", uniform(rng, (2,), -1, 1))])


# ---- rules owned by other modules (conv, resize, recurrent, control, sequence, ...) ------------


def other(*ops: str):
    return case(*ops, registry=OTHER_CASES)


def _window(draw, size, with_dilation=True):
    """(kernel, stride, dilation, pad_begin, pad_end) with at least one output position."""
    while True:
        k, stride = draw(st.integers(1, 3)), draw(st.integers(1, 2))
        dil = draw(st.integers(1, 2)) if with_dilation else 1
        pb, pe = draw(st.integers(0, 1)), draw(st.integers(0, 1))
        if pb < k and pe < k and size + pb + pe >= dil * (k - 1) + 1:
            return k, stride, dil, pb, pe


def _windows(draw, spatial, with_dilation=True):
    picks = [_window(draw, d, with_dilation) for d in spatial]
    attrs = {"kernel_shape": [p[0] for p in picks], "strides": [p[1] for p in picks],
             "pads": [p[3] for p in picks] + [p[4] for p in picks]}
    if with_dilation:
        attrs["dilations"] = [p[2] for p in picks]
    return attrs


@other("Conv")
def conv(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    group = draw(st.integers(1, 2))
    c, m = group * draw(st.integers(1, 2)), group * draw(st.integers(1, 2))
    spatial = draw(shape_st(1, 2, 3, 5))
    attrs = _windows(draw, spatial)
    w_shape = (m, c // group) + tuple(attrs["kernel_shape"])
    inputs = [("x", uniform(rng, (draw(st.integers(1, 2)), c) + spatial, -1, 1, dtype)),
              ("w", uniform(rng, w_shape, -1, 1, dtype))]
    if draw(st.booleans()):
        inputs.append(("b", uniform(rng, (m,), -1, 1, dtype)))
    if draw(st.booleans()):
        del attrs["pads"]
        attrs["auto_pad"] = draw(st.sampled_from(["SAME_UPPER", "SAME_LOWER", "VALID"]))
        attrs["dilations"] = [1] * len(spatial)
    attrs["group"] = group
    return Spec(op, inputs, _subset(draw, [n for n, _ in inputs]), attrs, opset=opset_for(draw, op))


@other("ConvTranspose")
def conv_transpose(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    group = draw(st.integers(1, 2))
    c, m = group * draw(st.integers(1, 2)), group * draw(st.integers(1, 2))
    spatial = draw(shape_st(1, 2, 2, 4))
    attrs = _windows(draw, spatial)
    attrs["output_padding"] = [draw(st.integers(0, s - 1)) for s in attrs["strides"]]
    w_shape = (c, m // group) + tuple(attrs["kernel_shape"])
    inputs = [("x", uniform(rng, (draw(st.integers(1, 2)), c) + spatial, -1, 1, dtype)),
              ("w", uniform(rng, w_shape, -1, 1, dtype))]
    if draw(st.booleans()):
        inputs.append(("b", uniform(rng, (m,), -1, 1, dtype)))
    attrs["group"] = group
    return Spec(op, inputs, _subset(draw, [n for n, _ in inputs]), attrs, opset=opset_for(draw, op))


def _pool_input(draw, rng, dtype, op):
    spatial = draw(shape_st(1, 2, 3, 5))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 2))) + spatial
    if op in ("MaxPool", "GlobalMaxPool"):  # no ties inside a window
        return spread(rng, shape, dtype), spatial
    if op == "LpPool":  # |x|^p has a kink at 0 for p = 1
        return away(rng, shape, -2, 2, (0.0,), dtype, 0.1), spatial
    return uniform(rng, shape, -2, 2, dtype), spatial


@other("AveragePool", "MaxPool", "LpPool")
def pool(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    x, spatial = _pool_input(draw, rng, dtype, op)
    attrs = _windows(draw, spatial, with_dilation=op == "MaxPool")
    if op == "AveragePool":
        attrs["count_include_pad"] = draw(st.integers(0, 1))
    if op == "MaxPool" and draw(st.booleans()):  # column-major Indices
        attrs["storage_order"] = 1
    if op == "LpPool":
        attrs["p"] = draw(st.integers(1, 3))
    opset = opset_for(draw, op)
    if op != "LpPool" and draw(st.booleans()):
        attrs["ceil_mode"] = 1
        if _drops_last_window(spatial, attrs):
            opset = CEIL_DROP_OPSET
    outputs = draw(st.integers(1, 2)) if op == "MaxPool" else 1
    return Spec(op, [("x", x)], ("x",), attrs, opset=opset, outputs=outputs)


# ONNX shape inference before opset 22 keeps a ceil_mode window that starts in the right
# padding; onnxruntime (and ONNX from opset 22) drops it. The loss weight has onnxruntime's
# output shape, so such cases run at opset 22 (else the loss model itself fails to load).
CEIL_DROP_OPSET = 22


def _drops_last_window(spatial, attrs) -> bool:
    """True when ceil_mode adds a window starting past the input and the begin padding."""
    dims = len(spatial)
    dilations = attrs.get("dilations", [1] * dims)
    for i, size in enumerate(spatial):
        k, s, d = attrs["kernel_shape"][i], attrs["strides"][i], dilations[i]
        pb, pe = attrs["pads"][i], attrs["pads"][i + dims]
        out = -(-(size + pb + pe - (k - 1) * d - 1) // s) + 1
        if (out - 1) * s >= size + pb:
            return True
    return False


@other("GlobalAveragePool", "GlobalMaxPool")
def global_pool(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    x, _ = _pool_input(draw, rng, dtype, op)
    return Spec(op, [("x", x)], ("x",), opset=opset_for(draw, op))


@other("DeformConv")
def deform_conv(draw, op):
    """2-D (onnxruntime runs no other): groups and offset groups, offsets up to 2 pixels (some
    samples land partly or wholly outside X), an optional bias and mask."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    group, offset_group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    channels = int(np.lcm(group, offset_group)) * draw(st.integers(1, 2))
    outs, n = group * draw(st.integers(1, 2)), draw(st.integers(1, 2))
    spatial = draw(shape_st(2, 2, 3, 5))
    attrs = _windows(draw, spatial)
    kernel = attrs["kernel_shape"]
    out = [(size + attrs["pads"][a] + attrs["pads"][2 + a] - (k - 1) * d - 1) // s + 1
           for a, (size, k, d, s) in enumerate(zip(spatial, kernel, attrs["dilations"], attrs["strides"]))]
    taps = int(np.prod(kernel))
    inputs = [("x", uniform(rng, (n, channels) + spatial, -1, 1, dtype)),
              ("w", uniform(rng, (outs, channels // group, *kernel), -1, 1, dtype)),
              ("offset", uniform(rng, (n, offset_group * taps * 2, *out), -2, 2, dtype)),
              ("bias", uniform(rng, (outs,), -1, 1, dtype) if draw(st.booleans()) else None),
              ("mask", uniform(rng, (n, offset_group * taps, *out), -1, 1.5, dtype) if draw(st.booleans()) else None)]
    attrs.update(group=group, offset_group=offset_group)
    static = ()
    if draw(st.booleans()):  # the kernel read from W's shape, which must then be static
        del attrs["kernel_shape"]
        static = (("w", 2), ("w", 3))
    return Spec(op, inputs, _subset(draw, [k for k, v in inputs if v is not None]), attrs,
                opset=opset_for(draw, op, 19, (19, 22)), static_dims=static)


GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


@other("RNN", "GRU", "LSTM")
def recurrent(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    seq, batch, size, hidden = (draw(st.integers(1, 3)) for _ in range(4))
    direction = draw(st.sampled_from(["forward", "reverse", "bidirectional"]))
    dirs, gates = 2 if direction == "bidirectional" else 1, GATES[op]
    inputs = [("x", uniform(rng, (seq, batch, size), -1, 1, dtype)),
              ("w", uniform(rng, (dirs, gates * hidden, size), -1, 1, dtype)),
              ("r", uniform(rng, (dirs, gates * hidden, hidden), -1, 1, dtype)),
              ("b", uniform(rng, (dirs, 2 * gates * hidden), -1, 1, dtype) if draw(st.booleans()) else None),
              ("lens", None),
              ("h0", uniform(rng, (dirs, batch, hidden), -1, 1, dtype) if draw(st.booleans()) else None)]
    if op == "LSTM":
        inputs.append(("c0", uniform(rng, (dirs, batch, hidden), -1, 1, dtype) if draw(st.booleans()) else None))
        inputs.append(("p", uniform(rng, (dirs, 3 * hidden), -1, 1, dtype) if draw(st.booleans()) else None))
    attrs = {"hidden_size": hidden, "direction": direction}
    if op == "GRU":
        attrs["linear_before_reset"] = draw(st.integers(0, 1))
    outputs = 3 if op == "LSTM" else 2
    used = _subset(draw, list(range(outputs)))
    wrt = _subset(draw, [n for n, v in inputs if v is not None])
    # The rules unroll the time loop: the sequence length must be static.
    return Spec(op, inputs, wrt, attrs, opset=opset_for(draw, op), outputs=outputs, loss_outputs=used,
                static_dims=(("x", 0),))


RESIZE_COORDS = ["half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"]


@other("Resize")
def resize(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    mode = draw(st.sampled_from(["nearest", "linear", "cubic"]))
    # onnxruntime: cubic resizes 2-D images only
    spatial = draw(shape_st(2, 2, 2, 4)) if mode == "cubic" else draw(shape_st(1, 2, 2, 4))
    shape = (1, draw(st.integers(1, 2))) + spatial
    attrs = {"mode": mode, "coordinate_transformation_mode": draw(st.sampled_from(RESIZE_COORDS))}
    if mode == "nearest":
        attrs["nearest_mode"] = draw(st.sampled_from(["round_prefer_floor", "floor", "ceil"]))
    inputs = [("x", uniform(rng, shape, -1, 1, dtype)), ("roi", None)]
    if draw(st.booleans()):
        scales = [1.0, 1.0] + [draw(st.sampled_from([0.5, 1.0, 1.5, 2.0])) for _ in spatial]
        inputs.append(("scales", np.asarray(scales, np.float32)))
    else:
        inputs += [("scales", None), ("sizes", ints(list(shape[:2]) + [draw(st.integers(1, 6)) for _ in spatial]))]
    # Resize is linear in x: checked against onnxruntime's own forward. The float64 oracle
    # would be the ONNX reference evaluator (onnxruntime has no float64 Resize), which takes
    # other conventions than onnxruntime (and the spec) in corners: pytorch_half_pixel onto
    # one output samples at -0.5 (or 0.5 / scale - 0.5), not 0; align_corners with a
    # fractional in * scale divides by the unrounded output length.
    return Spec(op, inputs, ("x",), attrs, opset=opset_for(draw, op), custom=_check_linear_in_ort)


@case("Shrink")
def shrink(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    lambd = draw(st.sampled_from([0.0, 0.5, 1.0]))
    attrs = {"lambd": lambd, "bias": draw(st.sampled_from([0.0, 0.25]))}
    x = away(rng, draw(shape_st()), -3, 3, (-lambd, lambd), dtype)
    # onnxruntime computes a float64 Shrink in float32: checked against its slopes (1 outside
    # [-lambd, lambd], 0 inside) rather than float64 central differences.
    return Spec(op, [("x", x)], ("x",), attrs, opset=opset_for(draw, op), custom=_check_shrink)


def _check_shrink(spec: Spec) -> None:
    model, feeds = opcases.loss_model(spec)
    (grad,) = opcases.run_gradient_model(model, spec.wrt, feeds, [])
    weight = opcases.initializer(model, "fdcheck_w_0").astype(np.float64)
    x = feeds["x"].astype(np.float64)
    expected = np.where(np.abs(x) > spec.attrs["lambd"], weight, 0.0)
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=0, err_msg=spec.describe())


def _central_differences(loss: Callable, values: dict, name: str, step: float) -> np.ndarray:
    """``(loss(x + step e_k) - loss(x - step e_k)) / (2 step)`` for every element k of ``values[name]``."""
    x = values[name]
    numeric = np.empty(x.size)
    for k in range(x.size):
        losses = []
        for sign in (1, -1):
            bumped = x.copy().reshape(-1)
            bumped[k] += sign * step
            losses.append(loss({**values, name: bumped.reshape(x.shape)}))
        numeric[k] = (losses[0] - losses[1]) / (2 * step)
    return numeric


def _check_linear_in_ort(spec: Spec) -> None:
    """For an op linear in each trained input: the gradient vs unit-step central differences
    of onnxruntime's own forward (exact up to rounding), every element of each."""
    model, feeds = opcases.loss_model(spec)
    grads = opcases.run_gradient_model(model, spec.wrt, feeds, [])
    run = opcases.fdcheck.session(model).run
    weight = opcases.initializer(model, "fdcheck_w_0").astype(np.float64)
    tol = opcases.fdcheck.tolerance_for(spec.dtype)
    def loss(values):
        return np.sum(run(["y0"], values)[0].astype(np.float64) * weight)

    for name, grad in zip(spec.wrt, grads):
        numeric = _central_differences(loss, feeds, name, 1.0)
        np.testing.assert_allclose(grad.reshape(-1), numeric, rtol=tol.rtol, atol=tol.atol,
                                   err_msg=f"{name} of {spec.describe()}")


def _branch(name, nodes, out):
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(out, 0, None)])


@other("If")
def if_(draw, op):
    """Both branches read the outer x and a; the condition picks one."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    sx, sa = broadcast_shapes(draw, 2)
    then_branch = _branch("then", [helper.make_node("Mul", ["x", "a"], ["t_out"])], "t_out")
    else_branch = _branch("else", [helper.make_node("Sin", ["x"], ["e_sin"]),
                                   helper.make_node("Add", ["e_sin", "a"], ["e_out"])], "e_out")
    inputs = [("cond", np.asarray(draw(st.booleans()))), ("x", uniform(rng, sx, -2, 2, dtype)),
              ("a", uniform(rng, sa, -2, 2, dtype))]
    attrs = {"then_branch": then_branch, "else_branch": else_branch}
    return Spec(op, inputs[:1], _subset(draw, ["x", "a"]), attrs, opset=opset_for(draw, op),
                side_inputs=inputs[1:])


@other("SplitToSequence", "SequenceAt")
def sequence(draw, op):
    """x -> SplitToSequence -> SequenceAt(position) -> z."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = list(draw(shape_st(1, 3, 1, 4)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    inputs = [("x", None)]
    attrs = {"axis": axis}
    if draw(st.booleans()):
        sizes = [draw(st.integers(1, 2)) for _ in range(draw(st.integers(1, 3)))]
        shape[axis] = sum(sizes)
        inputs.append(("split", ints(sizes)))
        parts = len(sizes)
    else:
        attrs["keepdims"] = draw(st.integers(0, 1))
        parts = shape[axis]
    inputs[0] = ("x", uniform(rng, tuple(shape), -1, 1, dtype))
    position = draw(st.integers(-parts, parts - 1))
    at = helper.make_node("SequenceAt", ["y0", "position"], ["z"])
    return Spec("SplitToSequence", inputs, ("x",), attrs, opset=opset_for(draw, "SplitToSequence"),
                extra_nodes=(at,), graph_outputs=("z",), side_inputs=[("position", ints(position))])


# ---- rules of newer opsets (newer.py) ----------------------------------------------------------


@other("Compress")
def compress(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1, 3))
    axis = draw(st.one_of(st.none(), st.integers(-len(shape), len(shape) - 1)))
    length = int(np.prod(shape)) if axis is None else shape[axis]
    cond = np.asarray(draw(st.lists(st.booleans(), min_size=1, max_size=length)))
    attrs = {} if axis is None else {"axis": axis}
    return Spec(op, [("x", uniform(rng, shape, -1, 1, dtype)), ("cond", cond)], ("x",), attrs,
                opset=opset_for(draw, op), dynamic=("cond",) if draw(st.booleans()) else ())


@other("CenterCropPad")
def center_crop_pad(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1, 3))
    rank = len(shape)
    axes = draw(st.one_of(st.none(), st.lists(st.integers(-rank, rank - 1), min_size=1, max_size=rank,
                                              unique_by=lambda a: a % rank)))
    target = ints([draw(st.integers(1, MAX_SIDE + 2)) for _ in range(rank if axes is None else len(axes))])
    return Spec(op, [("x", uniform(rng, shape, -1, 1, dtype)), ("shape", target)], ("x",),
                {} if axes is None else {"axes": axes}, opset=opset_for(draw, op, 18, (18, 21)))


@other("Col2Im")
def col2im(draw, op):
    """Blocks (N, C * prod(block), L) summed into an image; L follows from the geometry."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    dims = draw(st.integers(1, 2))
    image = [draw(st.integers(2, 5)) for _ in range(dims)]
    block, strides, dilations, pads, blocks = [], [], [], [], 1
    for size in image:
        while True:
            k, s, d = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
            pb, pe = draw(st.integers(0, 1)), draw(st.integers(0, 1))
            count = (size + pb + pe - (k - 1) * d - 1) // s + 1
            if count >= 1:
                break
        block.append(k)
        strides.append(s)
        dilations.append(d)
        pads.append((pb, pe))
        blocks *= count
    channels = draw(st.integers(1, 2))
    x = uniform(rng, (draw(st.integers(1, 2)), channels * int(np.prod(block)), blocks), -1, 1, dtype)
    attrs = {"strides": strides, "dilations": dilations,
             "pads": [p[0] for p in pads] + [p[1] for p in pads]}
    return Spec(op, [("x", x), ("image_shape", ints(image)), ("block_shape", ints(block))], ("x",), attrs,
                opset=opset_for(draw, op, 18, (18, 21)))


@other("MaxUnpool")
def max_unpool(draw, op):
    """Indices from a MaxPool of another tensor (overlapping windows repeat an index)."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    dims = draw(st.integers(1, 2))
    kernel = [draw(st.integers(1, 3)) for _ in range(dims)]
    strides = [draw(st.integers(1, 2)) for _ in range(dims)]
    source = (draw(st.integers(1, 2)), draw(st.integers(1, 2))) + tuple(draw(st.integers(k, k + 3))
                                                                          for k in kernel)
    pool = helper.make_graph([helper.make_node("MaxPool", ["s"], ["y", "i"], kernel_shape=kernel, strides=strides)],
                             "pool", [helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, source)],
                             [onnx.ValueInfoProto(name="y"), onnx.ValueInfoProto(name="i")])
    # onnxruntime's MaxPool (the reference evaluator's misplaces indices of some windows)
    pooled, indices = opcases.fdcheck.session(helper.make_model(
        pool, opset_imports=[helper.make_opsetid("", 13)], ir_version=opcases.IR_VERSION)).run(
        None, {"s": spread(rng, source, np.float32)})
    inferred = source[:2] + tuple((o - 1) * s + k for o, s, k in zip(pooled.shape[2:], strides, kernel))
    inputs = [("x", uniform(rng, pooled.shape, -1, 1, dtype)), ("i", ints(indices))]
    if inferred != source or draw(st.booleans()):
        inputs.append(("output_shape", ints(source)))
    # Linear in x; onnxruntime's own forward is the oracle: the reference evaluator lays out
    # output_shape differently.
    return Spec(op, inputs, ("x",), {"kernel_shape": kernel, "strides": strides},
                opset=opset_for(draw, op, 13, (13, 18, 21, 22)), custom=_check_linear_in_ort)


@other("LpNormalization")
def lp_normalization(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    attrs = {"p": draw(st.sampled_from([1, 2])), "axis": draw(st.integers(-len(shape), len(shape) - 1))}
    # |x| has a kink at 0 (p = 1); the norm stays well away from 0
    x = away(rng, shape, -2, 2, (0.0,), dtype, 0.3)
    return Spec(op, [("x", x)], ("x",), attrs, opset=opset_for(draw, op, 13, (13, 18, 21, 22)))


Forward = Callable[[dict[str, np.ndarray], dict], "np.ndarray | list[np.ndarray]"]


def _numpy_oracle(forward: Forward) -> Callable[[Spec], None]:
    """A check of the gradients against float64 central differences (step ``fdcheck.FD_EPS``,
    every element) of ``forward(inputs by name, attrs)`` in numpy, which returns the op's
    output (or outputs y0, y1, ...): for ops that no float64 runtime runs, or runs right."""

    def check(spec: Spec) -> None:
        model, feeds = opcases.loss_model(spec)
        forward_model, _ = opcases.forward_model(spec)
        weighted = [(int(name[1:]), opcases.initializer(model, f"fdcheck_w_{k}").astype(np.float64))
                    for k, name in enumerate(opcases.float_outputs(forward_model, spec.loss_outputs))]
        grads = opcases.run_gradient_model(model, spec.wrt, feeds, [])
        values = {k: v for k, v in spec.all_inputs() if v is not None}
        values.update({k: np.asarray(v, np.float64) for k, v in feeds.items()})

        def loss(inputs):
            outs = forward(inputs, spec.attrs)
            outs = [outs] if isinstance(outs, np.ndarray) else outs
            return sum(np.sum(outs[i] * w) for i, w in weighted)

        step, tol = opcases.fdcheck.FD_EPS, opcases.fdcheck.tolerance_for(spec.dtype)
        for name, grad in zip(spec.wrt, grads):
            numeric = _central_differences(loss, values, name, step)
            np.testing.assert_allclose(grad.reshape(-1), numeric, rtol=tol.rtol, atol=tol.atol,
                                       err_msg=f"{name} of {spec.describe()}")

    return check


def _lrn(inputs, attrs):
    x = inputs["x"]
    size = attrs["size"]
    alpha, beta, bias = attrs.get("alpha", 1e-4), attrs.get("beta", 0.75), attrs.get("bias", 1.0)
    channels = x.shape[1]
    sums = np.zeros_like(x)
    for c in range(channels):
        lo, hi = max(0, c - (size - 1) // 2), min(channels, c + size // 2 + 1)
        sums[:, c] = np.sum(x[:, lo:hi] ** 2, axis=1)
    return x / (bias + alpha / size * sums) ** beta


@other("LRN")
def lrn(draw, op):
    """Checked against numpy: the reference LRN loops over the batch axis instead of the
    channels, and onnxruntime has no float64 LRN (and runs odd sizes on 4-D inputs only)."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    attrs = {"size": draw(st.sampled_from([1, 3, 5])), "alpha": draw(st.floats(1e-3, 2.0)),
             "beta": draw(st.floats(0.3, 1.5)), "bias": draw(st.floats(0.5, 2.0))}
    return Spec(op, [("x", uniform(rng, shape, -2, 2, dtype))], ("x",), attrs, opset=opset_for(draw, op),
                custom=_numpy_oracle(_lrn))


def _global_lp_pool(inputs, attrs):
    x = inputs["x"]
    p = attrs.get("p", 2)
    return np.sum(np.abs(x) ** p, axis=tuple(range(2, x.ndim)), keepdims=True) ** (1.0 / p)


@other("GlobalLpPool")
def global_lp_pool(draw, op):
    """Checked against numpy: nothing runs GlobalLpPool in float64 (onnxruntime's kernel is
    opset 2's, so the cases stay below opset 22)."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 2))) + draw(shape_st(1, 3, 1, 3))
    attrs = {"p": draw(st.integers(1, 3))}
    x = away(rng, shape, -2, 2, (0.0,), dtype, 0.1)  # |x|^p: a kink at 0 for p = 1
    return Spec(op, [("x", x)], ("x",), attrs, opset=opset_for(draw, op), custom=_numpy_oracle(_global_lp_pool))


@other("Det")
def det(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    size = draw(st.integers(1, 4))
    shape = draw(shape_st(0, 2, 1, 3)) + (size, size)
    rank = len(shape)
    # The rule needs the matrix size: those dims stay static.
    return Spec(op, [("x", uniform(rng, shape, -1, 1, dtype))], ("x",), opset=opset_for(draw, op, 13, (13, 21, 22)),
                static_dims=(("x", rank - 2), ("x", rank - 1)))


@other("CumProd")
def cumprod(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    x = uniform(rng, shape, -1.5, 1.5, dtype)
    if draw(st.booleans()):  # exact zeros: the product stays linear in each factor
        x[rng.random(shape) < ZERO_FRACTION] = 0.0
    axis = np.asarray(draw(st.integers(-len(shape), len(shape) - 1)), draw(st.sampled_from([np.int32, np.int64])))
    attrs = {"exclusive": draw(st.integers(0, 1)), "reverse": draw(st.integers(0, 1))}
    return Spec(op, [("x", x), ("axis", axis)], ("x",), attrs, opset=opset_for(draw, op, 26, (26, 28)),
                dynamic=("axis",) if draw(st.booleans()) else ())


# First opset whose Mod takes fmod=0 (floor) for floats.
MOD_FLOOR_SINCE = 28
# Distance kept between a / b and an integer (where the remainder jumps).
MOD_MARGIN = 0.1


@other("Mod")
def mod(draw, op):
    """fmod=1 (C's fmod) or fmod=0 (floor); a / b kept away from the integers, where C jumps.
    The operand of full (output) shape is made from the other and the chosen quotients."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    fmod = draw(st.integers(0, 1))
    opset = MOD_FLOOR_SINCE if fmod == 0 else draw(st.sampled_from([13, 21, MOD_FLOOR_SINCE]))
    full, part = broadcast_shapes(draw, 2)
    full = np.broadcast_shapes(full, part)
    quotient = rng.integers(-3, 4, full) + rng.uniform(MOD_MARGIN, 1 - MOD_MARGIN, full)
    if draw(st.booleans()):  # a full, b broadcast
        b = away(rng, part, -2, 2, (0.0,), np.float64, 0.5)
        a = b * quotient
    else:  # b full, a broadcast
        a = away(rng, part, -3, 3, (0.0,), np.float64, 0.5)
        b = a / quotient
    inputs = [("a", np.asarray(a, dtype)), ("b", np.asarray(b, dtype))]
    return Spec(op, inputs, draw(st.sampled_from([("a", "b"), ("a",), ("b",)])), {"fmod": fmod}, opset=opset)


@other("Hardmax")
def hardmax(draw, op):
    """Piecewise constant: a zero gradient (no ties, so no jump within the step)."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    [x] = distinct(rng, [shape], dtype)
    attrs = {"axis": draw(st.integers(-len(shape), len(shape) - 1))} if draw(st.booleans()) else {}
    return Spec(op, [("x", x)], ("x",), attrs, opset=opset_for(draw, op))


@other("GridSample")
def grid_sample(draw, op):
    """Opsets 20 and 22 (16's mode names have no float64 kernel nor reference); the grid
    reaches beyond [-1, 1], so that every padding mode maps some coordinates."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    mode = draw(st.sampled_from(["nearest", "linear", "cubic"]))
    dims = 2 if mode == "cubic" else draw(st.sampled_from([2, 3]))
    attrs = {"mode": mode, "padding_mode": draw(st.sampled_from(["zeros", "border", "reflection"])),
             "align_corners": draw(st.integers(0, 1))}
    n = draw(st.integers(1, 2))
    x_shape = (n, draw(st.integers(1, 2))) + tuple(draw(st.integers(1, 4)) for _ in range(dims))
    grid_shape = (n,) + tuple(draw(st.integers(1, 3)) for _ in range(dims)) + (dims,)
    inputs = [("x", uniform(rng, x_shape, -1, 1, dtype)), ("grid", uniform(rng, grid_shape, -2.6, 2.6, dtype))]
    return Spec(op, inputs, draw(st.sampled_from([("x", "grid"), ("x",), ("grid",)])), attrs,
                opset=opset_for(draw, op, 20, (20, 22)))


@other("AffineGrid")
def affine_grid(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    dims = draw(st.sampled_from([2, 3]))
    n = draw(st.integers(1, 2))
    size = ints([n, draw(st.integers(1, 3))] + [draw(st.integers(1, 4)) for _ in range(dims)])
    theta = uniform(rng, (n, dims, dims + 1), -1, 1, dtype)
    return Spec(op, [("theta", theta), ("size", size)], ("theta",), {"align_corners": draw(st.integers(0, 1))},
                opset=opset_for(draw, op, 20, (20, 21)))


# ---- attention and the newest normalizations (attention.py) -----------------------------------


@other("Attention")
def attention(draw, op):
    """4-D (B, H, S, D) or 3-D (B, S, H * D) Q, K, V; grouped heads, a float or bool mask,
    causal, scale and softcap."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    batch, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    hq, sq, skv = hkv * group, draw(st.integers(1, 3)), draw(st.integers(1, 4))
    d, dv = draw(st.sampled_from([2, 4])), draw(st.sampled_from([2, 3]))
    attrs = {}
    if draw(st.booleans()):
        attrs["is_causal"] = 1
    if draw(st.booleans()):
        attrs["scale"] = draw(st.floats(0.2, 1.0))
    if draw(st.booleans()):
        attrs["softcap"] = draw(st.floats(1.0, 3.0))
    static = ()
    if draw(st.booleans()):
        attrs.update(q_num_heads=hq, kv_num_heads=hkv)
        shapes = [(batch, sq, hq * d), (batch, skv, hkv * d), (batch, skv, hkv * dv)]
        # ONNX shape inference (1.23) gives Y's hidden size 0 when V's is unknown
        static = (("v", 2),)
    else:
        shapes = [(batch, hq, sq, d), (batch, hkv, skv, d), (batch, hkv, skv, dv)]
    inputs = [(name, uniform(rng, shape, -1, 1, dtype)) for name, shape in zip("qkv", shapes)]
    mask_shape = draw(st.sampled_from([(sq, skv), (1, hq, sq, skv), (batch, 1, sq, skv)]))
    kind = draw(st.sampled_from(["none", "float", "bool"]))
    if kind == "float":
        inputs.append(("mask", uniform(rng, mask_shape, -1, 1, dtype)))
    elif kind == "bool":
        mask = rng.random(mask_shape) > 0.3
        mask[..., 0] = True  # every query sees a key (a fully masked row is NaN in onnxruntime)
        inputs.append(("mask", mask))
    float_inputs = [n for n, v in inputs if v.dtype == dtype]
    return Spec(op, inputs, _subset(draw, float_inputs), attrs, opset=opset_for(draw, op, 23, (23, 24)),
                static_dims=static)


@other("RMSNormalization")
def rms_norm(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    trailing = shape[axis % len(shape):]
    scale_shape = draw(st.sampled_from([trailing, trailing[1:], tuple(1 for _ in trailing)]))
    inputs = [("x", uniform(rng, shape, -2, 2, dtype)), ("scale", uniform(rng, scale_shape, 0.5, 1.5, dtype))]
    attrs = {"axis": axis, "epsilon": draw(st.sampled_from([1e-5, 1e-2]))}
    return Spec(op, inputs, _subset(draw, ["x", "scale"]), attrs, opset=opset_for(draw, op, 23, (23, 24)))


@other("SimplifiedLayerNormalization")
def simplified_layer_norm(draw, op):
    """onnxruntime's RMS norm (default domain, opset-independent): its kernel takes a scale of the
    normalized shape only."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    inputs = [("x", uniform(rng, shape, -2, 2, dtype)),
              ("scale", uniform(rng, shape[axis % len(shape):], 0.5, 1.5, dtype))]
    attrs = {"axis": axis, "epsilon": draw(st.sampled_from([1e-5, 1e-2]))}
    return Spec(op, inputs, _subset(draw, ["x", "scale"]), attrs, opset=draw(st.sampled_from(OPSETS)))


@other("com.microsoft::SkipLayerNormalization", "com.microsoft::SkipSimplifiedLayerNormalization")
def contrib_skip_norm(draw, op):
    """onnxruntime's float32 kernels: ``s = x + skip (+ bias)`` normalized over the last axis
    (LayerNorm with gamma and beta, or RMS norm with gamma), 2-D or 3-D, the skip of x's shape,
    (S, H) or (1, S, H); the loss reads Y and ``s`` (input_skip_bias_sum), not the statistics.
    x spaced, skip and bias small: each group of ``s`` keeps a variance >> epsilon."""
    rng = rng_of(draw)
    simplified = op == "SkipSimplifiedLayerNormalization"
    shape = draw(shape_st(2, 3, 2))
    skip_shape = draw(st.sampled_from([shape] + ([shape[1:], (1, *shape[1:])] if len(shape) == 3 else [])))
    hidden = shape[-1:]
    inputs = [("x", spread(rng, shape, np.float32)), ("skip", uniform(rng, skip_shape, -0.05, 0.05, np.float32)),
              ("gamma", uniform(rng, hidden, 0.5, 1.5, np.float32))]
    if not simplified:
        inputs.append(("beta", uniform(rng, hidden, -1, 1, np.float32) if draw(st.booleans()) else None))
    with_bias = draw(st.booleans())
    inputs.append(("bias", uniform(rng, hidden, -0.05, 0.05, np.float32) if with_bias else None))
    while inputs[-1][1] is None:
        inputs.pop()
    attrs = {"epsilon": draw(st.sampled_from([1e-5, 1e-2]))} if draw(st.booleans()) else {}
    eps = attrs.get("epsilon", 1e-12)

    def forward(values, attrs):
        total = values["x"] + values["skip"] + (values["bias"] if "bias" in values else 0.0)
        if simplified:
            inv = 1.0 / np.sqrt((total * total).mean(-1, keepdims=True) + eps)
            mean = np.zeros_like(inv)
            y = total * inv * values["gamma"]
        else:
            mean = total.mean(-1, keepdims=True)
            inv = 1.0 / np.sqrt(((total - mean) ** 2).mean(-1, keepdims=True) + eps)
            y = (total - mean) * inv * values["gamma"] + (values["beta"] if "beta" in values else 0.0)
        return [y, mean, inv, total]

    names = [n for n, v in inputs if v is not None]
    return Spec(op, inputs, _subset(draw, names), attrs, domain="com.microsoft", outputs=4, loss_outputs=(0, 3),
                custom=_numpy_oracle(forward))


@other("RotaryEmbedding")
def rotary_embedding(draw, op):
    """4-D (B, H, S, D) or 3-D (B, S, H * D) x; cos / sin per (batch, position) or a cache
    indexed by position_ids (repeated positions accumulate); part of the head rotated."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    batch, seq, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    head = draw(st.sampled_from([2, 4, 6]))
    rot = draw(st.sampled_from([0] + [r for r in (2, 4) if r < head]))
    attrs = {"interleaved": draw(st.integers(0, 1))}
    if rot:
        attrs["rotary_embedding_dim"] = rot
    if draw(st.booleans()):
        attrs["num_heads"] = heads
        x_shape = (batch, seq, heads * head)
    else:
        x_shape = (batch, heads, seq, head)
    half = (rot or head) // 2
    if draw(st.booleans()):
        positions = draw(st.integers(seq, seq + 2))
        ids = ints(rng.integers(0, positions, (batch, seq)))
        cache_shape = (positions, half)
    else:
        ids, cache_shape = None, (batch, seq, half)
    inputs = [("x", uniform(rng, x_shape, -1, 1, dtype)), ("cos", uniform(rng, cache_shape, -1, 1, dtype)),
              ("sin", uniform(rng, cache_shape, -1, 1, dtype)), ("position_ids", ids)]
    return Spec(op, inputs, _subset(draw, ["x", "cos", "sin"]), attrs, opset=opset_for(draw, op, 23, (23, 24)))


@other("Swish")
def swish(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    attrs = {"alpha": draw(st.floats(0.2, 2.5))} if draw(st.booleans()) else {}
    return Spec(op, [("x", uniform(rng, draw(shape_st()), -3, 3, dtype))], ("x",), attrs,
                opset=opset_for(draw, op, 24, (24,)))  # onnxruntime 1.32 runs no Swish-25


# MeanVarianceNormalization's function body: (x - mean) / (std + this).
MVN_EPSILON = 1e-9


def _mean_variance_norm(inputs, attrs):
    x = inputs["x"]
    axes = tuple(attrs["axes"])
    mean = x.mean(axes, keepdims=True)
    return (x - mean) / (np.sqrt((x * x).mean(axes, keepdims=True) - mean * mean) + MVN_EPSILON)


@other("MeanVarianceNormalization")
def mean_variance_norm(draw, op):
    """Checked against numpy: its function body adds a float32 epsilon, so no float64 copy runs."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = tuple(draw(st.integers(2, 3)) for _ in range(4))  # every group has a variance
    # axes always given: ONNX's strict shape inference fails on the function body without it
    axes = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True)) if draw(st.booleans()) \
        else [0, 2, 3]
    attrs = {"axes": axes}
    return Spec(op, [("x", spread(rng, shape, dtype))], ("x",), attrs, opset=opset_for(draw, op),
                custom=_numpy_oracle(_mean_variance_norm))


# ---- quantization (quant_signal.py) -----------------------------------------------------------

# Integer range of each zero-point dtype.
QUANT_TYPES = {np.uint8: (0, 255), np.int8: (-128, 127)}
# First opset with blocked quantization (block_size).
QUANT_BLOCKED_SINCE = 21


def _quant_params(draw, rng, shape, opset):
    """(attrs, scale, zero point or None, the zero point's dtype) for x of ``shape``: per tensor,
    per axis or (opset 21+) in blocks along the axis."""
    grain = draw(st.sampled_from(["tensor", "axis", "blocked"] if opset >= QUANT_BLOCKED_SINCE
                                 else ["tensor", "axis"]))
    attrs, p_shape = {}, ()
    if grain != "tensor":
        axis = draw(st.integers(-len(shape), len(shape) - 1))
        attrs["axis"] = axis
        p_shape = (shape[axis],)
    if grain == "blocked":
        block = draw(st.integers(1, 3))
        blocks = tuple(-(-d // block) if i == attrs["axis"] % len(shape) else d for i, d in enumerate(shape))
        if int(np.prod(blocks)) > 1:  # onnxruntime takes a single scale as per tensor
            attrs["block_size"] = block
            p_shape = blocks
    zp_type = draw(st.sampled_from(list(QUANT_TYPES)))
    lo, hi = QUANT_TYPES[zp_type]
    zp = np.asarray(rng.integers(lo, hi + 1, p_shape), zp_type) if draw(st.booleans()) else None
    if zp is None:
        zp_type = np.uint8  # the default zero point
    # steps of 0.005 to 0.03: QuantizeLinear's x in [-3, 3] spans 200 to 1200 levels, so some clip
    return attrs, uniform(rng, p_shape, 0.005, 0.03, np.float32), zp, zp_type


def _expand_param(p, attrs, shape):
    """A scale / zero point broadcast against x (per tensor, per axis or blocked)."""
    p = np.asarray(p)
    if p.ndim == 0:
        return p
    axis = attrs["axis"] % len(shape)
    if "block_size" in attrs:
        return np.take(np.repeat(p, attrs["block_size"], axis=axis), range(shape[axis]), axis=axis)
    return p.reshape([-1 if i == axis else 1 for i in range(len(shape))])


def _reduce_param(v, p, attrs):
    """Sum ``v`` (shaped like x) down to the shape of the parameter ``p``."""
    if np.ndim(p) == 0:
        return v.sum()
    axis = attrs["axis"] % v.ndim
    if "block_size" not in attrs:
        return v.sum(axis=tuple(i for i in range(v.ndim) if i != axis))
    starts = np.arange(0, v.shape[axis], attrs["block_size"])
    return np.add.reduceat(v, starts, axis=axis)


def _check_fake_quantize(spec: Spec) -> None:
    """QuantizeLinear -> DequantizeLinear vs torch's learnable fake-quantize gradients (the
    straight-through estimator): dx = g inside the integer range, 0 where clipped; d scale =
    g * (round(x / s) - x / s) inside, g * (q - zp) (q the clipped bound) outside."""
    model, feeds = opcases.loss_model(spec)
    grads = dict(zip(spec.wrt, opcases.run_gradient_model(model, spec.wrt, feeds, [])))
    g = opcases.initializer(model, "fdcheck_w_0").astype(np.float64)
    x, scale, zp = spec.array("x"), spec.array("scale"), spec.array("zp")
    lo, hi = QUANT_TYPES[np.uint8 if zp is None else zp.dtype.type]
    s = _expand_param(scale, spec.attrs, x.shape)
    z = 0 if zp is None else _expand_param(zp, spec.attrs, x.shape).astype(np.float64)
    ratio = (x / s).astype(np.float32).astype(np.float64)  # as the runtime divides: in float32
    level = np.round(ratio) + z
    inside = (level >= lo) & (level <= hi)
    expected = {"x": g * inside,
                "scale": _reduce_param(g * np.where(inside, np.round(ratio) - ratio, np.clip(level, lo, hi) - z),
                                       scale, spec.attrs)}
    tol = opcases.fdcheck.FLOAT32_TOL
    for name in spec.wrt:
        np.testing.assert_allclose(grads[name], np.reshape(expected[name], np.shape(grads[name])),
                                   rtol=tol.rtol, atol=tol.atol, err_msg=f"{name} of {spec.describe()}")


@other("QuantizeLinear")
def quantize_linear(draw, op):
    """A Q -> DQ pair (fake quantization; the rule refuses a Q read by anything else)."""
    rng = rng_of(draw)
    opset = opset_for(draw, op, 13, (13, 19, 21))
    shape = draw(shape_st(1))
    attrs, scale, zp, _ = _quant_params(draw, rng, shape, opset)
    x = uniform(rng, shape, -3, 3, np.float32)
    inputs = [("x", x), ("scale", scale), ("zp", zp)]
    dq = helper.make_node("DequantizeLinear", ["y0", "scale"] + ([] if zp is None else ["zp"]), ["z"], **attrs)
    return Spec(op, inputs, _subset(draw, ["x", "scale"]), attrs, opset=opset, extra_nodes=(dq,),
                graph_outputs=("z",), custom=_check_fake_quantize)


@other("DequantizeLinear")
def dequantize_linear(draw, op):
    """y = (q - zp) * scale: linear in the scale (q, an integer input, takes no gradient here)."""
    rng = rng_of(draw)
    opset = opset_for(draw, op, 13, (13, 19, 21))
    shape = draw(shape_st(1))
    attrs, scale, zp, q_type = _quant_params(draw, rng, shape, opset)
    lo, hi = QUANT_TYPES[q_type]
    q = np.asarray(rng.integers(lo, hi + 1, shape), q_type)
    # No float64 oracle: the scale of a DequantizeLinear cannot be float64.
    return Spec(op, [("q", q), ("scale", scale), ("zp", zp)], ("scale",), attrs, opset=opset,
                custom=_check_linear_in_ort)


# ---- sequences and optionals (sequence.py) ----------------------------------------------------


def _read_sequence(draw, seq, shapes, concat=True):
    """Nodes that turn sequence ``seq`` (elements of ``shapes``) into tensors, the values they
    read besides (positions) and their outputs: SequenceAt at one or two positions, or (equal
    shapes, ``concat``) a ConcatFromSequence."""
    count = len(shapes)
    if concat and len(set(shapes)) == 1 and draw(st.booleans()):
        rank, new_axis = len(shapes[0]), draw(st.integers(0, 1))
        axis = draw(st.integers(-rank - new_axis, rank - 1 + new_axis))
        return [helper.make_node("ConcatFromSequence", [seq], ["z0"], axis=axis, new_axis=new_axis)], [], ("z0",)
    nodes, side, outs = [], [], []
    for k in range(draw(st.integers(1, 2))):
        pos = np.asarray(draw(st.integers(-count, count - 1)), draw(st.sampled_from([np.int32, np.int64])))
        side.append((f"pos{k}", pos))
        nodes.append(helper.make_node("SequenceAt", [seq, f"pos{k}"], [f"z{k}"]))
        outs.append(f"z{k}")
    return nodes, side, tuple(outs)


def _elements(draw, count):
    """(names, arrays) of ``count`` sequence elements of one rank (equal shapes half the time)."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    rank = draw(st.integers(1, 3))
    if draw(st.booleans()):
        shapes = [draw(shape_st(rank, rank, 1, 3))] * count
    else:
        shapes = [draw(shape_st(rank, rank, 1, 3)) for _ in range(count)]
    return [f"x{i}" for i in range(count)], [uniform(rng, s, -1, 1, dtype) for s in shapes]


def _shapes(arrays):
    return [a.shape for a in arrays]


@other("SequenceConstruct")
def sequence_construct(draw, op):
    """x0..xk -> SequenceConstruct -> SequenceAt(s) or ConcatFromSequence."""
    names, arrays = _elements(draw, draw(st.integers(1, 3)))
    reads, side, outs = _read_sequence(draw, "y0", _shapes(arrays))
    return Spec(op, list(zip(names, arrays)), _subset(draw, names), opset=opset_for(draw, op),
                extra_nodes=tuple(reads), graph_outputs=outs, side_inputs=side)


@other("ConcatFromSequence")
def concat_from_sequence(draw, op):
    """x0..xk -> SequenceConstruct -> ConcatFromSequence (along an axis, or a new one)."""
    new_axis = draw(st.integers(0, 1))
    rank = draw(st.integers(1, 3))
    axis = draw(st.integers(-rank - new_axis, rank - 1 + new_axis))
    count = draw(st.integers(1, 3))
    rng, dtype = rng_of(draw), draw(DTYPES)
    base = [draw(st.integers(1, 3)) for _ in range(rank)]
    arrays = []
    for _ in range(count):
        shape = list(base)
        if not new_axis:
            shape[axis % rank] = draw(st.integers(1, 3))
        arrays.append(uniform(rng, tuple(shape), -1, 1, dtype))
    names = [f"x{i}" for i in range(count)]
    concat = helper.make_node(op, ["y0"], ["z"], axis=axis, new_axis=new_axis)
    return Spec("SequenceConstruct", list(zip(names, arrays)), _subset(draw, names), opset=opset_for(draw, op),
                extra_nodes=(concat,), graph_outputs=("z",))


@other("SequenceInsert")
def sequence_insert(draw, op):
    """x0..xk -> SequenceConstruct -> SequenceInsert(t, at position or at the end) -> read out."""
    names, arrays = _elements(draw, draw(st.integers(1, 3)) + 1)
    t, names, arrays = arrays[-1], names[:-1], arrays[:-1]
    count = len(names)
    side, inputs = [("t", t)], ["y0", "t"]
    position = count
    if draw(st.booleans()):
        position = draw(st.integers(-count, count))
        side.append(("at", ints(position)))
        inputs.append("at")
    shapes = _shapes(arrays)
    shapes.insert(position if position >= 0 else position + count, t.shape)
    reads, read_side, outs = _read_sequence(draw, "s1", shapes)
    insert = helper.make_node(op, inputs, ["s1"])
    return Spec("SequenceConstruct", list(zip(names, arrays)), _subset(draw, names + ["t"]),
                opset=opset_for(draw, op), extra_nodes=(insert, *reads), graph_outputs=outs,
                side_inputs=side + read_side)


@other("SequenceErase")
def sequence_erase(draw, op):
    """x0..xk (k >= 1) -> SequenceConstruct -> SequenceErase(at position or the last) -> read out."""
    names, arrays = _elements(draw, draw(st.integers(2, 4)))
    count = len(names)
    side, inputs = [], ["y0"]
    position = -1
    if draw(st.booleans()):
        position = draw(st.integers(-count, count - 1))
        side.append(("at", ints(position)))
        inputs.append("at")
    shapes = _shapes(arrays)
    del shapes[position]
    reads, read_side, outs = _read_sequence(draw, "s1", shapes)
    erase = helper.make_node(op, inputs, ["s1"])
    return Spec("SequenceConstruct", list(zip(names, arrays)), _subset(draw, names), opset=opset_for(draw, op),
                extra_nodes=(erase, *reads), graph_outputs=outs, side_inputs=side + read_side)


@other("SequenceEmpty")
def sequence_empty(draw, op):
    """SequenceEmpty -> SequenceInsert(x) (one or more) -> read out: the gradient reaches x
    around the empty sequence's clean stop."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    shape = draw(shape_st(1, 3, 1, 3))
    count = draw(st.integers(1, 2))
    names = [f"x{i}" for i in range(count)]
    side = [(n, uniform(rng, shape, -1, 1, dtype)) for n in names]
    nodes, seq = [], "y0"
    for i, name in enumerate(names):
        nodes.append(helper.make_node("SequenceInsert", [seq, name], [f"s{i}"]))
        seq = f"s{i}"
    # SequenceAt only: ONNX shape inference leaves the elements of SequenceEmpty + SequenceInsert
    # without a rank, and the ConcatFromSequence rule needs it.
    reads, read_side, outs = _read_sequence(draw, seq, [shape] * count, concat=False)
    attrs = {"dtype": helper.np_dtype_to_tensor_dtype(np.dtype(dtype))}
    return Spec(op, [], _subset(draw, names), attrs, opset=opset_for(draw, op), extra_nodes=(*nodes, *reads),
                graph_outputs=outs, side_inputs=side + read_side)


@other("SequenceLength")
def sequence_length(draw, op):
    """x -> SequenceConstruct -> SequenceLength: a clean stop (an int64 count)."""
    names, arrays = _elements(draw, draw(st.integers(1, 3)))
    length = helper.make_node("SequenceLength", ["y0"], ["n"])
    return Spec("SequenceConstruct", list(zip(names, arrays)), _subset(draw, names), opset=opset_for(draw, op),
                extra_nodes=(length,), graph_outputs=("n",), kind="stop")


@other("Optional", "OptionalGetElement")
def optional(draw, op):
    """Optional of a tensor (or of a SequenceConstruct's sequence) -> OptionalGetElement."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    opset = opset_for(draw, "OptionalGetElement", 15)
    x = uniform(rng, draw(shape_st()), -1, 1, dtype)
    if draw(st.booleans()):
        get = helper.make_node("OptionalGetElement", ["y0"], ["z"])
        return Spec("Optional", [("x", x)], ("x",), opset=opset, extra_nodes=(get,), graph_outputs=("z",))
    inputs = [("x", x), ("x1", uniform(rng, draw(shape_st()), -1, 1, dtype))]
    nodes = (helper.make_node("Optional", ["y0"], ["opt"]),
             helper.make_node("OptionalGetElement", ["opt"], ["got"]),
             helper.make_node("SequenceAt", ["got", "pos"], ["z"]))
    return Spec("SequenceConstruct", inputs, _subset(draw, ["x", "x1"]), opset=opset, extra_nodes=nodes,
                graph_outputs=("z",), side_inputs=[("pos", ints(draw(st.integers(-2, 1))))])


@other("OptionalHasElement")
def optional_has_element(draw, op):
    """x -> Optional -> OptionalHasElement: a clean stop (a bool)."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    has = helper.make_node("OptionalHasElement", ["y0"], ["h"])
    return Spec("Optional", [("x", uniform(rng, draw(shape_st()), -1, 1, dtype))], ("x",),
                opset=opset_for(draw, op, 15), extra_nodes=(has,), graph_outputs=("h",), kind="stop")


# ---- signal, detection and the newest fused ops (quant_signal.py) ------------------------------


@other("DFT")
def dft(draw, op):
    """Every mode: forward / inverse, complex or real input, onesided (RFFT of a real input,
    IRFFT of the standard N // 2 + 1 bins), a dft_length that pads or cuts."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    opset = opset_for(draw, op, 17, (17, 20))
    dims = list(draw(shape_st(1, 3, 1, 5)))
    axis = draw(st.integers(0, len(dims) - 1))
    inverse, onesided = draw(st.sampled_from([(0, 0), (0, 1), (1, 0), (1, 1)]))
    complex_in = inverse if onesided else draw(st.integers(0, 1))
    length = draw(st.sampled_from([None, max(1, dims[axis] - 2), dims[axis] + 2]))
    if inverse and onesided:  # the rule supports the standard layout only
        length = draw(st.sampled_from([2 * dims[axis] - 1] + ([None, 2 * dims[axis] - 2] if dims[axis] > 1 else [])))
    shape = tuple(dims) + (1 + complex_in,)
    signed = axis - len(shape) if draw(st.booleans()) else axis
    inputs = [("x", uniform(rng, shape, -1, 1, dtype)), ("length", None if length is None else ints(length))]
    attrs = {"inverse": inverse, "onesided": onesided}
    if opset >= 20:
        inputs.append(("axis", ints(signed)))
    else:
        attrs["axis"] = signed
    # The rule needs the real / complex axis and (IRFFT) the bin count.
    return Spec(op, inputs, ("x",), attrs, opset=opset, static_dims=(("x", len(dims)), ("x", axis)))


@other("STFT")
def stft(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    batch, signal = draw(st.integers(1, 2)), draw(st.integers(4, 10))
    complex_in = draw(st.integers(0, 1))
    frame = draw(st.integers(2, signal))
    form = draw(st.sampled_from(["window", "frame_length", "both"]))
    inputs = [("x", uniform(rng, (batch, signal, 1 + complex_in), -1, 1, dtype)), ("step", ints(draw(st.integers(1, 4)))),
              ("window", uniform(rng, (frame,), 0, 1, dtype) if form != "frame_length" else None),
              ("frame_length", ints(frame) if form != "window" else None)]
    attrs = {"onesided": 0 if complex_in else draw(st.integers(0, 1))}
    wrt = _subset(draw, ["x", "window"] if form != "frame_length" else ["x"])
    return Spec(op, inputs, wrt, attrs, opset=opset_for(draw, op, 17, (17, 21)), static_dims=(("x", 2),))


@other("TensorScatter")
def tensor_scatter(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    rank = draw(st.integers(3, 4))
    axis = draw(st.integers(1, rank - 1))
    cache = [draw(st.integers(1, 3)) for _ in range(rank)]
    cache[axis] = draw(st.integers(2, 5))
    update = list(cache)
    update[axis] = draw(st.integers(1, cache[axis]))
    mode = draw(st.sampled_from(["linear", "circular"]))
    at = None
    if draw(st.booleans()):
        top = cache[axis] if mode == "circular" else cache[axis] - update[axis]
        at = ints(rng.integers(0, top + 1, cache[0]))
    inputs = [("past", uniform(rng, tuple(cache), -1, 1, dtype)), ("update", uniform(rng, tuple(update), -1, 1, dtype)),
              ("at", at)]
    attrs = {"axis": axis - rank if draw(st.booleans()) else axis, "mode": mode}
    return Spec(op, inputs, _subset(draw, ["past", "update"]), attrs, opset=opset_for(draw, op, 24, (24, 25)))


def _check_in_reference(spec: Spec) -> None:
    """``opcases.check_grad`` with the analytic side run in the reference evaluator too (the
    numeric side is float64 central differences, in it or in onnxruntime)."""
    model, feeds = opcases.forward_model(spec)
    names = opcases.float_outputs(model, spec.loss_outputs)
    values = ReferenceEvaluator(model).run(names, feeds)
    model = opcases.fdcheck.with_weighted_loss(model, {n: np.shape(v) for n, v in zip(names, values)})
    grad_model = build_gradient_graph(model, opcases.fdcheck.LOSS, list(spec.wrt))
    grads = ReferenceEvaluator(grad_model).run([f"{w}{opcases.fdcheck.GRAD_SUFFIX}" for w in spec.wrt], feeds)
    tol = opcases.fdcheck.tolerance_for(spec.dtype)
    report = check.compare_with_central_differences(
        model, opcases.fdcheck.LOSS, dict(zip(spec.wrt, grads)), feeds, eps=opcases.fdcheck.FD_EPS,
        rtol=tol.rtol, atol=tol.atol, max_elements=opcases.fdcheck.MAX_ELEMENTS, float64_only=True,
        kink_screen=check.KinkScreen(opcases.fdcheck.KINK_RTOL, opcases.fdcheck.KINK_ATOL))
    rows = [opcases.fdcheck._report(row) for row in report]
    assert all(r.ok for r in rows), f"gradient mismatch for {spec.describe()}\n{opcases.fdcheck.describe(rows)}"


@other("SwiGLU")
def swiglu(draw, op):
    """onnxruntime cannot run SwiGLU-28 (its function body's Swish): checked in the reference
    evaluator. Drawn in float64 so that opcases.runnable hands the spec on (as float32)."""
    rng = rng_of(draw)
    shape = draw(shape_st())
    attrs = {"alpha": draw(st.floats(0.5, 2.0))} if draw(st.booleans()) else {}
    inputs = [("a", uniform(rng, shape, -3, 3)), ("v", uniform(rng, shape, -2, 2))]
    return Spec(op, inputs, _subset(draw, ["a", "v"]), attrs, opset=opset_for(draw, op, 28, (28,)),
                custom=_check_in_reference)


def _causal_conv(inputs, attrs):
    """y = act(depthwise conv of [past (zeros), x] with w + bias), state = its last k - 1 steps."""
    x, w = inputs["x"], inputs["w"]
    taps = w.shape[2]
    past = inputs.get("past")
    if past is None:
        past = np.zeros(x.shape[:2] + (taps - 1,))
    padded = np.concatenate([past, x], axis=2)
    z = sum(w[None, :, 0, j, None] * padded[:, :, j:j + x.shape[2]] for j in range(taps))
    if inputs.get("bias") is not None:
        z = z + inputs["bias"][None, :, None]
    if attrs.get("activation", "none") != "none":
        z = z / (1 + np.exp(-z))
    return [z, padded[:, :, x.shape[2]:]]


@other("CausalConvWithState")
def causal_conv_with_state(draw, op):
    """Checked against numpy: onnxruntime runs it in float32 only, and the reference evaluator
    computes SiLU in float32."""
    rng, dtype = rng_of(draw), np.float32
    batch, channels, length, taps = (draw(st.integers(1, n)) for n in (2, 3, 4, 3))
    inputs = [("x", uniform(rng, (batch, channels, length), -1, 1, dtype)),
              ("w", uniform(rng, (channels, 1, taps), -1, 1, dtype)),
              ("bias", uniform(rng, (channels,), -1, 1, dtype) if draw(st.booleans()) else None),
              ("past", uniform(rng, (batch, channels, taps - 1), -1, 1, dtype)
               if taps > 1 and draw(st.booleans()) else None)]
    attrs = {"activation": draw(st.sampled_from(["none", "silu", "swish"]))}
    # Both outputs named (ONNX shape inference fails on the node without present_state); with
    # an activation, y is in the loss: the rule refuses an activation when only present_state
    # has a gradient (a rule bug, reported).
    used = _subset(draw, [0, 1], required=(0,) if attrs["activation"] != "none" else ())
    # All dims static: onnxruntime expands this op's function only for known shapes.
    static = tuple((n, i) for n, v in inputs if v is not None for i in range(v.ndim))
    return Spec(op, inputs, _subset(draw, [n for n, v in inputs if v is not None]), attrs,
                opset=opset_for(draw, op, 27, (27, 28)), outputs=2, loss_outputs=used,
                custom=_numpy_oracle(_causal_conv), static_dims=static)


def _boxes(rng, count, height, width, scale, dtype):
    """RoIs (x1, y1, x2, y2) in input coordinates, some reaching past the image."""
    lo = rng.uniform([-1.0, -1.0], [width - 1.0, height - 1.0], (count, 2))
    hi = lo + rng.uniform(0.3, 1.0, (count, 2)) * np.array([width, height]) * 0.8
    return (np.concatenate([lo, hi], axis=1) / scale).astype(dtype)


@other("RoiAlign")
def roi_align(draw, op):
    """float32 only: the rule's gradient graph holds a float64 OneHot in float64, which
    onnxruntime has no kernel for (a rule bug, reported)."""
    rng, dtype = rng_of(draw), np.float32
    opset = opset_for(draw, op, 13, (13, 16, 21))
    n, c, h, w = (draw(st.integers(1, k)) for k in (2, 2, 5, 5))
    count = draw(st.integers(1, 3))
    scale = draw(st.sampled_from([1.0, 0.5]))
    attrs = {"mode": draw(st.sampled_from(["avg", "max"])), "spatial_scale": scale,
             "output_height": draw(st.integers(1, 3)), "output_width": draw(st.integers(1, 3)),
             "sampling_ratio": draw(st.integers(0, 2))}
    if opset >= 16:
        attrs["coordinate_transformation_mode"] = draw(st.sampled_from(["half_pixel", "output_half_pixel"]))
    x = uniform(rng, (n, c, h, w), -1, 1, dtype)
    if attrs["mode"] == "max":  # the max of weighted corner values: no ties, no zeros (w0 x vs w1 x)
        x = spread(rng, (n, c, h, w), dtype)
        x = np.where(x >= 0, x + MARGIN * 2, x - MARGIN * 2).astype(dtype)
    inputs = [("x", x), ("rois", _boxes(rng, count, h, w, scale, dtype)), ("batch", ints(rng.integers(0, n, count)))]
    return Spec(op, inputs, ("x",), attrs, opset=opset)


def _max_roi_pool(inputs, attrs):
    """onnxruntime's MaxRoiPool (float32 rounding of the RoI corners and bin sizes)."""
    scale = attrs.get("spatial_scale", 1.0)
    return max_roi_pool_reference(inputs["x"], inputs["rois"], attrs["pooled_shape"], scale)[0]


@other("MaxRoiPool")
def max_roi_pool(draw, op):
    """Checked against a numpy port of onnxruntime's kernel (float32 only: no float64 oracle)."""
    rng, dtype = rng_of(draw), np.float32
    n, c, h, w = (draw(st.integers(1, k)) for k in (2, 2, 5, 5))
    count = draw(st.integers(1, 3))
    scale = draw(st.sampled_from([1.0, 0.5, 0.25]))
    rois = np.concatenate([rng.integers(0, n, (count, 1)), _boxes(rng, count, h, w, scale, dtype)], axis=1)
    attrs = {"pooled_shape": [draw(st.integers(1, 3)), draw(st.integers(1, 3))], "spatial_scale": scale}
    inputs = [("x", spread(rng, (n, c, h, w), dtype)), ("rois", rois.astype(dtype))]
    return Spec(op, inputs, ("x",), attrs, opset=opset_for(draw, op), custom=_numpy_oracle(_max_roi_pool))


def _linear_attention(inputs, attrs):
    """The recurrence of LinearAttention's reference implementation (single_op's, in float64)."""
    import torch

    tensors = {name: torch.from_numpy(np.asarray(value, np.float64)) for name, value in inputs.items()}
    outs = linear_attention_reference(attrs["q_num_heads"], attrs["kv_num_heads"], attrs.get("scale") or 0.0,
                                      **tensors)
    return [out.numpy() for out in outs]


@other("LinearAttention")
def linear_attention(draw, op):
    """Every update rule, grouped heads, a past state, per-head or per-key decay, shared or
    per-head beta. Checked against numpy: the op's function body and the reference evaluator
    compute in float32."""
    rng, dtype = rng_of(draw), np.float32
    rule = draw(st.sampled_from(["linear", "gated", "delta", "gated_delta"]))
    kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    batch, steps, d_k, d_v = (draw(st.integers(1, n)) for n in (2, 3, 3, 3))
    shapes = {"query": (batch, steps, kv_heads * group * d_k), "key": (batch, steps, kv_heads * d_k),
              "value": (batch, steps, kv_heads * d_v),
              "past": (batch, kv_heads, d_k, d_v) if draw(st.booleans()) else None,
              "decay": (batch, steps, kv_heads * draw(st.sampled_from([1, d_k]))) if "gated" in rule else None,
              "beta": (batch, steps, draw(st.sampled_from([1, kv_heads]))) if "delta" in rule else None}
    inputs = [(name, None if shape is None else uniform(rng, shape, -0.5, 0.5, dtype)) for name, shape in shapes.items()]
    values = dict(inputs)
    if values["decay"] is not None:  # log-space decay: a = exp(decay) < 1
        values["decay"] = -np.abs(values["decay"])
    if values["beta"] is not None:
        values["beta"] = uniform(rng, shapes["beta"], 0.1, 0.9, dtype)
    inputs = [(name, values[name]) for name, _ in inputs]
    attrs = {"update_rule": rule, "q_num_heads": kv_heads * group, "kv_num_heads": kv_heads}
    if draw(st.booleans()):
        attrs["scale"] = draw(st.floats(0.3, 1.0))
    fed = [n for n, v in inputs if v is not None]
    # All dims static: onnxruntime expands this op's function only for known shapes.
    static = tuple((n, i) for n, v in inputs if v is not None for i in range(v.ndim))
    return Spec(op, inputs, _subset(draw, fed), attrs, opset=opset_for(draw, op, 27, (27, 28)), outputs=2,
                loss_outputs=_subset(draw, [0, 1]), custom=_numpy_oracle(_linear_attention), static_dims=static)


# ---- Loop and Scan (control.py) -----------------------------------------------------------------


def _body(name, nodes, inputs, outputs):
    """A subgraph; ``inputs`` and ``outputs`` are (name, elem type) with shapes left open, but
    for a Loop's iteration number and condition (scalars: onnxruntime needs their shapes)."""
    scalars = ("iter", "cond_in", "cond_out")

    def info(name, elem):
        return helper.make_tensor_value_info(name, elem, [] if name in scalars else None)

    return helper.make_graph(nodes, name, [info(*i) for i in inputs], [info(*o) for o in outputs])


def _state_and_weight(draw, rng, dtype):
    """A state v and an outer weight a that broadcasts onto v without growing it."""
    shape = draw(shape_st(0, 3, 1, 3))
    rank = draw(st.integers(0, len(shape)))
    a_shape = tuple(1 if draw(st.integers(0, 2)) == 0 else d for d in shape[len(shape) - rank:])
    return uniform(rng, shape, -1, 1, dtype), uniform(rng, a_shape, -1, 1, dtype)


@other("Loop")
def loop(draw, op):
    """v_{k+1} = sin(v_k) * a + v_k * k, scan output v_k * a; a is read from the outer scope.
    A trip count (0 to 3), with or without a (true) condition."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    v0, a = _state_and_weight(draw, rng, dtype)
    body = _body("step", [
        helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        helper.make_node("Sin", ["v"], ["sin_v"]),
        helper.make_node("Mul", ["sin_v", "a"], ["sin_va"]),
        helper.make_node("Cast", ["iter"], ["k"], to=elem),
        helper.make_node("Mul", ["v", "k"], ["vk"]),
        helper.make_node("Add", ["sin_va", "vk"], ["v_next"]),
        helper.make_node("Mul", ["v", "a"], ["y"]),
    ], [("iter", onnx.TensorProto.INT64), ("cond_in", onnx.TensorProto.BOOL), ("v", elem)],
        [("cond_out", onnx.TensorProto.BOOL), ("v_next", elem), ("y", elem)])
    cond = np.asarray(True) if draw(st.booleans()) else None
    inputs = [("trips", ints(draw(st.integers(0, 3)))), ("cond", cond), ("v0", v0)]
    return Spec(op, inputs, _subset(draw, ["v0", "a"]), {"body": body}, opset=opset_for(draw, op), outputs=2,
                loss_outputs=_subset(draw, [0, 1]), side_inputs=[("a", a)],
                dynamic=("trips",) if draw(st.booleans()) else ())


@other("Scan")
def scan(draw, op):
    """h_{t+1} = sin(h_t * x_t) + a, scan output h_{t+1} * x_t, over 1 to 3 steps along any
    axis, in either direction, stacked along any axis and direction; a from the outer scope."""
    rng, dtype = rng_of(draw), draw(DTYPES)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    h0, a = _state_and_weight(draw, rng, dtype)
    steps, rank = draw(st.integers(1, 3)), h0.ndim
    in_axis = draw(st.integers(-rank - 1, rank))
    xs_shape = list(h0.shape)
    xs_shape.insert(in_axis % (rank + 1), steps)
    body = _body("step", [
        helper.make_node("Mul", ["h", "x_t"], ["hx"]),
        helper.make_node("Sin", ["hx"], ["sin_hx"]),
        helper.make_node("Add", ["sin_hx", "a"], ["h_next"]),
        helper.make_node("Mul", ["h_next", "x_t"], ["y_t"]),
    ], [("h", elem), ("x_t", elem)], [("h_next", elem), ("y_t", elem)])
    attrs = {"body": body, "num_scan_inputs": 1, "scan_input_axes": [in_axis],
             "scan_input_directions": [draw(st.integers(0, 1))],
             "scan_output_axes": [draw(st.integers(-rank - 1, rank))],
             "scan_output_directions": [draw(st.integers(0, 1))]}
    inputs = [("h0", h0), ("xs", uniform(rng, tuple(xs_shape), -1, 1, dtype))]
    return Spec(op, inputs, _subset(draw, ["h0", "xs", "a"]), attrs, opset=opset_for(draw, op), outputs=2,
                loss_outputs=_subset(draw, [0, 1]), side_inputs=[("a", a)])


# ---- the test ----------------------------------------------------------------------------------


def _rule_id(rule) -> str:
    domain = f"{rule.domain}::" if rule.domain else ""
    until = "" if rule.until is None else f"-{rule.until}"
    return f"{domain}{rule.op_type}@{rule.since}{until}"


RULES = sorted(registered_rules(), key=_rule_id)


def _generator(rule) -> Generator | None:
    """The case generator of ``rule``: keyed ``domain::op_type`` outside the ONNX domain."""
    key = f"{rule.domain}::{rule.op_type}" if rule.domain not in ("", "ai.onnx") else rule.op_type
    return CASES.get(key) or OTHER_CASES.get(key)


@pytest.mark.parametrize("rule", RULES, ids=_rule_id)
@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.large_base_example,
                                 HealthCheck.filter_too_much])
@given(data=st.data())
def test_rule(rule, data):
    generator = _generator(rule)
    if generator is None:
        pytest.fail(f"no case for {_rule_id(rule)}: add a generator to CASES or OTHER_CASES")
    spec = data.draw(generator(rule.op_type), label="spec")
    assert spec.domain == (rule.domain if rule.domain != "ai.onnx" else "")
    if data.draw(st.booleans(), label="symbolic dims"):
        spec = dataclasses.replace(spec, symbolic=True)
    assert rule.op_type in spec.op_types
    assert rule.covers(spec.opset), f"case opset {spec.opset} outside {_rule_id(rule)}"
    if spec.kind == "stop":
        assert rule.diff_inputs == (), f"{rule.op_type} is checked as a stop but marks differentiable inputs"
    opcases.check_spec(spec)
