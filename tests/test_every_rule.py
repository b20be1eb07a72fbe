"""Every registered gradient rule against float64 central differences.

One test, parametrized over ``passes.autodiff.registered_rules()``: each rule needs a
case generator here (``CASES`` for the core rule families, ``OTHER_CASES`` for conv,
resize, recurrent, control-flow and sequence rules), else the test fails with "no case
for X". Every case also runs with symbolic input dims half the time (``symbolic``).
Set EVERY_RULE_EXAMPLES to change the examples per rule, EVERY_RULE_RANDOM for fresh ones.
Generators draw shapes (broadcast pairs for broadcasting ops), attributes and dtypes
with hypothesis and keep inputs away from non-differentiable points (kinks, ties,
domain edges); the check itself lives in ``opcases.check_spec``.

Tolerances (``fdcheck``): |analytic - numeric| <= atol + rtol * |numeric| with
float32: atol 1e-4, rtol 1e-3; float64: atol 1e-6, rtol 1e-5; numeric = float64
central difference with step 1e-6. Non-differentiable rules are checked to be clean
stops: with ``loss += ReduceSum(x * V)`` the gradient of every float input is exactly V.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import numpy as np
import onnx
import opcases
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper
from opcases import Spec

from passes.autodiff import registered_rules

MAX_EXAMPLES = int(os.environ.get("EVERY_RULE_EXAMPLES", "40"))
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
    "...i->...",
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
        shape = (ellipsis if "..." in term else ()) + tuple(sizes[ch] for ch in term.replace("...", ""))
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
    # Overwriting scatters need unique targets; 'add' accumulates duplicates.
    flat = rng.choice(cells, size=count, replace="reduction" in attrs)
    idx = np.stack(np.unravel_index(flat, shape[:q]), axis=-1)
    upd_shape = (count,) + tuple(shape[q:])
    inputs = [("x", uniform(rng, shape, -1, 1, dtype)), ("idx", ints(idx)),
              ("upd", uniform(rng, upd_shape, -1, 1, dtype))]
    return Spec(op, inputs, draw(st.sampled_from([("x", "upd"), ("x",), ("upd",)])), attrs, opset=opset)


# First opset with the reduction attribute of ScatterND/ScatterElements.
SCATTER_REDUCTION_SINCE = 16


def _scatter_reduction(draw, opset) -> dict:
    if opset < SCATTER_REDUCTION_SINCE or not draw(st.booleans()):
        return {}
    return {"reduction": "add"}


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
    if "reduction" in attrs:  # duplicates accumulate
        idx = rng.integers(-shape[ax], shape[ax], idx_shape)
    else:  # unique targets: along the axis, each position gets a distinct index
        lines = [rng.permutation(shape[ax])[:idx_shape[ax]] for _ in range(int(np.prod(moved)))]
        idx = np.moveaxis(np.asarray(lines).reshape(moved + [idx_shape[ax]]), -1, ax)
    inputs = [("x", uniform(rng, shape, -1, 1, dtype)), ("idx", ints(idx)),
              ("upd", uniform(rng, tuple(idx_shape), -1, 1, dtype))]
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
    wrt = _subset(draw, [n for n, _ in inputs])
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


@case("OneHot")
def stop_one_hot(draw, op):
    rng, dtype = rng_of(draw), draw(DTYPES)
    depth = draw(st.integers(1, 4))
    idx = ints(rng.integers(-depth, depth, draw(shape_st(1, 2))))
    inputs = [("idx", idx), ("depth", ints(depth)), ("values", uniform(rng, (2,), -1, 1, dtype))]
    return _stop(op, inputs, ("values",), {"axis": draw(st.integers(-1, idx.ndim))})


@case("Range")
def stop_range(draw, op):
    dtype = draw(DTYPES)
    start, delta = draw(st.floats(-2, 2)), draw(st.sampled_from([0.5, 1.0, -0.7]))
    limit = start + delta * draw(st.integers(1, 5)) - delta / 2
    inputs = [(k, np.asarray(v, dtype)) for k, v in (("start", start), ("limit", limit), ("delta", delta))]
    return _stop(op, inputs, ("start", "limit", "delta"))


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


# ---- rules owned by other modules (conv, resize, recurrent, control, sequence) -----------------


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


def _check_linear_in_ort(spec: Spec) -> None:
    """For an op linear in x: the gradient vs unit-step central differences of onnxruntime's
    own forward (exact up to rounding), every element of x."""
    model, feeds = opcases.loss_model(spec)
    [grad] = opcases.run_gradient_model(model, ["x"], feeds, [])
    run = opcases.fdcheck.session(model).run
    weight = opcases.initializer(model, "fdcheck_w_0").astype(np.float64)
    x = feeds["x"]
    numeric = np.empty(x.size)
    for k in range(x.size):
        ys = []
        for sign in (1, -1):
            bumped = x.copy().reshape(-1)
            bumped[k] += sign
            ys.append(run(["y0"], {**feeds, "x": bumped.reshape(x.shape)})[0].astype(np.float64))
        numeric[k] = np.sum((ys[0] - ys[1]) * weight) / 2
    tol = opcases.fdcheck.tolerance_for(spec.dtype)
    np.testing.assert_allclose(grad.reshape(-1), numeric, rtol=tol.rtol, atol=tol.atol,
                               err_msg=spec.describe())


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


# ---- the test ----------------------------------------------------------------------------------


def _rule_id(rule) -> str:
    domain = f"{rule.domain}::" if rule.domain else ""
    until = "" if rule.until is None else f"-{rule.until}"
    return f"{domain}{rule.op_type}@{rule.since}{until}"


RULES = sorted(registered_rules(), key=_rule_id)


def _generator(op_type: str) -> Generator | None:
    return CASES.get(op_type) or OTHER_CASES.get(op_type)


@pytest.mark.parametrize("rule", RULES, ids=_rule_id)
@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.large_base_example,
                                 HealthCheck.filter_too_much])
@given(data=st.data())
def test_rule(rule, data):
    generator = _generator(rule.op_type)
    if generator is None:
        pytest.fail(f"no case for {_rule_id(rule)}: add a generator to CASES or OTHER_CASES")
    spec = data.draw(generator(rule.op_type), label="spec")
    if data.draw(st.booleans(), label="symbolic dims"):
        spec = dataclasses.replace(spec, symbolic=True)
    assert rule.op_type in spec.op_types
    assert rule.covers(spec.opset), f"case opset {spec.opset} outside {_rule_id(rule)}"
    if spec.kind == "stop":
        assert rule.diff_inputs == (), f"{rule.op_type} is checked as a stop but marks differentiable inputs"
    opcases.check_spec(spec)
