"""Ops that pass no gradient to any input.

Their outputs are integers or booleans (so no gradient could flow anyway), or
piecewise-constant functions whose derivative is zero almost everywhere
(Round, Floor, Ceil, Sign), or random draws. Listing them makes each a clean
stop-gradient edge instead of a "missing rule" error.
"""

from passes.autodiff.registry import non_differentiable

non_differentiable(
    # zero derivative almost everywhere
    "Round", "Floor", "Ceil", "Sign",
    # shape and index producers
    "Shape", "Size", "ConstantOfShape", "Range", "NonZero", "ArgMax", "ArgMin", "OneHot",
    "EyeLike",
    # comparisons and logic
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf",
    # constants and random draws
    "Constant", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
    "Multinomial", "Bernoulli",
)
