"""Gradients of elementwise ops: arithmetic, activations, comparisons-free selection.

Rules with ``broadcast=True`` return gradients in the output's shape; the engine
reduces them to each input's shape.
"""

from __future__ import annotations

import math

from passes.autodiff.registry import grad_rule

# ---- arithmetic ------------------------------------------------------------------------------


@grad_rule("Add", broadcast=True)
def _add(b, n, g):
    return [g[0], g[0]]


@grad_rule("Sub", broadcast=True)
def _sub(b, n, g):
    return [g[0], -g[0] if n.needs_grad(1) else None]


@grad_rule("Mul", broadcast=True)
def _mul(b, n, g):
    a, c = n.inputs
    return [g[0] * c if n.needs_grad(0) else None, g[0] * a if n.needs_grad(1) else None]


# Node metadata on torch's atan2 as torchlib writes it, ``Atan(Div(y, x))`` (set from the
# exporter's record, passes.exports.conventions): "atan" on the Atan, which passes its gradient
# on unchanged, "ratio" on the Div, which applies atan2's derivative (x, -y) / (x^2 + y^2), 0 at
# (0, 0) as torch: the chain through y / x is 0 * inf at x = 0.
ATAN2_KEY = "gradgraph.atan2"


@grad_rule("Div", broadcast=True)
def _div(b, n, g):
    a, c = n.inputs
    if n.node.metadata_props.get(ATAN2_KEY) == "ratio":
        radius = a * a + c * c
        at_origin = b.Equal(radius, 0.0)
        safe = b.Where(at_origin, 1.0, radius, _like=radius)
        zero = b.const(0.0, g[0].dtype)
        return [b.Where(at_origin, zero, g[0] * c / safe) if n.needs_grad(0) else None,
                b.Where(at_origin, zero, -(g[0] * a) / safe) if n.needs_grad(1) else None]
    da = g[0] / c if n.needs_grad(0) else None
    dc = -(g[0] * n.outputs[0]) / c if n.needs_grad(1) else None
    return [da, dc]


# Node metadata on the Pow / Sqrt nodes of a norm or distance (torch.norm, linalg.vector_norm,
# dist, cdist, pdist; set from the exporter's record, passes.exports.conventions): "zero" = the
# gradient where the base is 0 is 0, torch's subgradient for norms, where the plain chain rule
# gives inf * 0 = NaN (|x|^p's root at a zero norm). A plain sqrt / pow keeps torch's inf there.
NORM_KEY = "gradgraph.norm"


def _norm_zero(b, n, base, grad):
    """``grad``, or 0 where ``base`` is 0 on a node marked ``NORM_KEY``."""
    if n.node.metadata_props.get(NORM_KEY) != "zero":
        return grad
    return b.Where(b.Equal(base, 0.0), b.const(0.0, grad.dtype), grad)


@grad_rule("Pow", broadcast=True)
def _pow(b, n, g):
    a, e = n.inputs
    y = n.outputs[0]
    ef = b.CastLike(e, a)
    zero = b.const(0.0, a.dtype)
    da = None
    if n.needs_grad(0):  # torch: 0 where e = 0 (e * a^(e-1) is 0 * inf at a = 0)
        da = _norm_zero(b, n, a, b.Where(b.Equal(ef, 0.0), zero, g[0] * ef * b.Pow(a, ef - 1)))
    de = None
    if n.needs_grad(1):  # d/de a^e = a^e log a; torch takes 0 at a = 0 for e >= 0 (0 * -inf)
        at_zero = b.And(b.Equal(a, 0.0), b.GreaterOrEqual(ef, 0.0))
        de = b.Where(at_zero, zero, g[0] * y * b.Log(a))
    return [da, de]


@grad_rule("Sum", broadcast=True)
def _sum(b, n, g):
    return [g[0]] * len(n.inputs)


@grad_rule("Mean", broadcast=True)
def _mean(b, n, g):
    return [g[0] / float(len(n.inputs))] * len(n.inputs)


@grad_rule("Min", "Max", broadcast=True)
def _min_max(b, n, g):
    """Ties split the gradient evenly, as torch.minimum/maximum do."""
    y = n.outputs[0]
    masks = [b.CastLike(b.Equal(x, y), y) for x in n.inputs]
    count = masks[0] if len(masks) == 1 else b.Sum(*masks)
    share = g[0] / count
    return [share * m if n.needs_grad(i) else None for i, m in enumerate(masks)]


@grad_rule("Where", diff_inputs=(1, 2), broadcast=True)
def _where(b, n, g):
    cond = n.inputs[0]
    zero = b.const(0.0, g[0].dtype)
    return [None,
            b.Where(cond, g[0], zero) if n.needs_grad(1) else None,
            b.Where(cond, zero, g[0]) if n.needs_grad(2) else None]


@grad_rule("Identity")
def _identity(b, n, g):
    return [g[0]]


@grad_rule("Cast")
def _cast(b, n, g):
    return [b.cast_to(g[0], n.inputs[0].dtype)]


@grad_rule("CastLike", diff_inputs=(0,))
def _cast_like(b, n, g):
    return [b.cast_to(g[0], n.inputs[0].dtype), None]


# ---- unary math ------------------------------------------------------------------------------


def _unary(op_type: str, formula) -> None:
    """Register ``d/dx op(x) = formula(b, x, y) * g``."""
    grad_rule(op_type)(lambda b, n, g: [g[0] * formula(b, n.inputs[0], n.outputs[0], n)])


_unary("Neg", lambda b, x, y, n: b.const(-1.0, x.dtype))
_unary("Abs", lambda b, x, y, n: b.Sign(x))
_unary("Reciprocal", lambda b, x, y, n: -(y * y))
_unary("Exp", lambda b, x, y, n: y)
_unary("Log", lambda b, x, y, n: b.Reciprocal(x))
_unary("Sin", lambda b, x, y, n: b.Cos(x))
_unary("Cos", lambda b, x, y, n: -b.Sin(x))
_unary("Tan", lambda b, x, y, n: 1.0 + y * y)
_unary("Asin", lambda b, x, y, n: b.Reciprocal(b.Sqrt(1.0 - x * x)))
_unary("Acos", lambda b, x, y, n: -b.Reciprocal(b.Sqrt(1.0 - x * x)))
_unary("Atan", lambda b, x, y, n: (b.const(1.0, x.dtype) if n.node.metadata_props.get(ATAN2_KEY) == "atan"
                                   else b.Reciprocal(1.0 + x * x)))
_unary("Sinh", lambda b, x, y, n: b.Cosh(x))
_unary("Cosh", lambda b, x, y, n: b.Sinh(x))
_unary("Asinh", lambda b, x, y, n: b.Reciprocal(b.Sqrt(x * x + 1.0)))
_unary("Acosh", lambda b, x, y, n: b.Reciprocal(b.Sqrt(x * x - 1.0)))
_unary("Atanh", lambda b, x, y, n: b.Reciprocal(1.0 - x * x))
_unary("Tanh", lambda b, x, y, n: 1.0 - y * y)


@grad_rule("Sqrt")
def _sqrt(b, n, g):
    """g / (2 sqrt x): inf at 0 as torch's sqrt; 0 there on a norm's Sqrt (``NORM_KEY``)."""
    y = n.outputs[0]
    return [_norm_zero(b, n, y, g[0] * (0.5 / y))]
_unary("Sigmoid", lambda b, x, y, n: y * (1.0 - y))
_unary("Erf", lambda b, x, y, n: (2.0 / math.sqrt(math.pi)) * b.Exp(-(x * x)))
_unary("Softplus", lambda b, x, y, n: b.Sigmoid(x))
_unary("Softsign", lambda b, x, y, n: b.Reciprocal((1.0 + b.Abs(x)) * (1.0 + b.Abs(x))))
# Relu's mask from y (y > 0 exactly where x > 0): x need not be kept for the backward
_unary("Relu", lambda b, x, y, n: b.CastLike(b.Greater(y, 0.0), x))
_unary("LeakyRelu", lambda b, x, y, n: b.Where(b.Greater(x, 0.0), 1.0, n.attr("alpha", 0.01), _like=x))
_unary("ThresholdedRelu", lambda b, x, y, n: b.CastLike(b.Greater(x, n.attr("alpha", 1.0)), x))
_unary("Elu", lambda b, x, y, n: b.Where(b.Greater(x, 0.0), 1.0, y + n.attr("alpha", 1.0), _like=x))
_unary("Celu", lambda b, x, y, n: b.Where(b.Greater(x, 0.0), 1.0, b.Exp(x / n.attr("alpha", 1.0)), _like=x))
_unary("Mish", lambda b, x, y, n: _mish_grad(b, x))


def _mish_grad(b, x):
    tsp = b.Tanh(b.Softplus(x))
    return tsp + x * b.Sigmoid(x) * (1.0 - tsp * tsp)


@grad_rule("Selu")
def _selu(b, n, g):
    x, y = n.inputs[0], n.outputs[0]
    alpha, gamma = n.attr("alpha", 1.67326319217681884765625), n.attr("gamma", 1.05070102214813232421875)
    return [g[0] * b.Where(b.Greater(x, 0.0), gamma, y + alpha * gamma, _like=x)]


@grad_rule("HardSigmoid")
def _hard_sigmoid(b, n, g):
    x = n.inputs[0]
    alpha, beta = n.attr("alpha", 0.2), n.attr("beta", 0.5)
    z = x * alpha + beta
    inside = b.And(b.Greater(z, 0.0), b.Less(z, 1.0))
    return [g[0] * b.Where(inside, alpha, 0.0, _like=x)]


@grad_rule("HardSwish")
def _hard_swish(b, n, g):
    x = n.inputs[0]
    slope = x * (1.0 / 3.0) + 0.5
    d = b.Where(b.Less(x, -3.0), 0.0, b.Where(b.Greater(x, 3.0), 1.0, slope, _like=x), _like=x)
    return [g[0] * d]


@grad_rule("PRelu", broadcast=True)
def _prelu(b, n, g):
    x, slope = n.inputs
    pos = b.Greater(x, 0.0)
    zero = b.const(0.0, x.dtype)
    dx = b.Where(pos, g[0], g[0] * slope) if n.needs_grad(0) else None
    dslope = b.Where(pos, zero, g[0] * x) if n.needs_grad(1) else None
    return [dx, dslope]


# |x| beyond which the tanh GELU's derivative is 0 or 1 in every float type (gelu_derivative).
_TANH_GELU_CLIP = 20.0


def gelu_derivative(b, x, approximate: str):
    """d Gelu(x) / dx from ``x`` alone, in few passes over it (a fused Gelu keeps only ``x``).

    tanh: with ``t = tanh(k (x + a x^3))``, ``0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 a x^2)``
    is written ``(1 + t) (0.5 + x (1 - t) (0.5 k + 1.5 k a x^2))`` (``1 - t^2 = (1 - t)(1 + t)``)
    on ``x`` clipped to [-20, 20]: 14 nodes with the Clip. Beyond 20 the derivative is its limit, 0 or 1, to
    float64 precision (``t`` rounds to -1 or 1 from ``|x| ~ 6``), and the clip keeps ``x^2`` and
    the product finite in float16 (unclipped, ``x^2`` overflows from 256 and ``0 * inf`` made the
    gradient NaN from ``x ~ -86``). erf: ``Phi(x) + x phi(x)`` with ``u = x / sqrt 2`` shared by
    the Erf and the Gaussian ``exp(-u^2)`` (``exp(-inf) = 0``: finite everywhere): 10 nodes.
    """
    if approximate == "tanh":
        k, a = math.sqrt(2.0 / math.pi), 0.044715
        x = b.Clip(x, -_TANH_GELU_CLIP, _TANH_GELU_CLIP, _like=x)
        x2 = x * x
        t = b.Tanh(x * (x2 * (k * a) + k))
        slope = x2 * (1.5 * k * a) + 0.5 * k
        return (t + 1.0) * (x * (1.0 - t) * slope + 0.5)
    u = x * (1.0 / math.sqrt(2.0))
    cdf = b.Erf(u) * 0.5 + 0.5
    return cdf + x * b.Exp(b.Neg(u * u)) * (1.0 / math.sqrt(2.0 * math.pi))


@grad_rule("Gelu", since=20)
def _gelu(b, n, g):
    return [g[0] * gelu_derivative(b, n.inputs[0], n.attr("approximate", "none"))]


# onnxruntime's contrib GELUs (stock onnxruntime, CPU and CUDA): what GeluFusionPass writes below
# opset 20, and what onnxruntime's transformer optimizer writes into exported models.
@grad_rule("Gelu", domain="com.microsoft")
def _ms_gelu(b, n, g):
    return [g[0] * gelu_derivative(b, n.inputs[0], "none")]


@grad_rule("FastGelu", domain="com.microsoft", broadcast=True)
def _ms_fast_gelu(b, n, g):
    """FastGelu(X, bias?) = tanh-approximated Gelu(X + bias)."""
    x = n.inputs[0] + n.inputs[1] if n.has_input(1) else n.inputs[0]
    dx = g[0] * gelu_derivative(b, x, "tanh")
    return [dx, dx] if n.has_input(1) else [dx]


@grad_rule("BiasGelu", domain="com.microsoft", broadcast=True)
def _ms_bias_gelu(b, n, g):
    """BiasGelu(A, B) = Gelu(A + B), erf form."""
    dx = g[0] * gelu_derivative(b, n.inputs[0] + n.inputs[1], "none")
    return [dx, dx]


def swish_derivative(b, x, alpha: float):
    """d/dx of ``x * sigmoid(alpha x)``: ``s (1 + alpha x (1 - s))`` with ``s = sigmoid(alpha x)``
    (opset 24's Swish, onnxruntime's QuickGelu)."""
    ax = x * alpha
    s = b.Sigmoid(ax)
    return s * (1.0 + ax * (1.0 - s))


@grad_rule("QuickGelu", domain="com.microsoft")
def _ms_quick_gelu(b, n, g):
    """QuickGelu(x) = x * sigmoid(alpha x) (CLIP's activation, alpha 1.702 by default)."""
    return [g[0] * swish_derivative(b, n.inputs[0], float(n.attr("alpha", 1.702)))]


# Node metadata that says how Clip treats x exactly at a bound (set from an exporter's record of
# the source op, see passes.exports.torch_conventions): "closed" passes the gradient there.
CLIP_BOUNDS_KEY = "gradgraph.clip_bounds"


@grad_rule("Clip", diff_inputs=(0,))
def _clip(b, n, g):
    """Gradient passes where min < x < max (torch's hardtanh/ReLU6, TF's relu6: the default), or
    min <= x <= max when the node is marked ``closed`` (torch.clamp).

    The open mask is read from y: min < y < max holds exactly where min < x < max (y is x there,
    a bound elsewhere), so x need not be kept for the backward. dX = dY * Cast(mask): onnxruntime's
    ``Where`` with a scalar branch is 5x slower than Cast + Mul (46 vs 11 ms on a
    [32, 144, 32, 32] ReLU6, 2 threads); MobileNetV2's step 0.885x (tools/ab_rule.py, 16 pairs).
    A non-finite dY outside the mask gives NaN instead of 0, as the Relu rule does."""
    closed = n.node.metadata_props.get(CLIP_BOUNDS_KEY) == "closed"
    x = n.inputs[0] if closed else n.outputs[0]
    above, below = ("GreaterOrEqual", "LessOrEqual") if closed else ("Greater", "Less")
    keep = None
    if n.has_input(1):
        keep = b.op(above, x, n.inputs[1])
    if n.has_input(2):
        upper = b.op(below, x, n.inputs[2])
        keep = upper if keep is None else b.And(keep, upper)
    if keep is None:
        return [g[0]]
    return [g[0] * b.CastLike(keep, g[0]), None, None]
