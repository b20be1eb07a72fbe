"""Ops that pass no gradient to any input.

Their outputs are integers, booleans or strings (so no gradient could flow anyway), or
piecewise-constant functions whose derivative is zero almost everywhere (Round, Floor,
Ceil, Sign, bit reinterpretation), or functions of integer inputs only (window functions),
or random draws. Listing them makes each a clean stop-gradient edge instead of a "missing
rule" error: a graph holding one off the gradient path builds; a trained value whose only
way to the loss runs through one gets "does not reach loss" (see ``engine.py``).

An op whose output is a differentiable function of a float input belongs in a rule
module, not here.
"""

from passes.autodiff.registry import non_differentiable

non_differentiable(
    # zero derivative almost everywhere
    "Round", "Floor", "Ceil", "Sign",
    # shape and index producers
    # (Range is linear in start and delta, OneHot in its values: their rules are in shape.py)
    "Shape", "Size", "ConstantOfShape", "NonZero", "ArgMax", "ArgMin", "EyeLike", "NonMaxSuppression",
    # Unique's Y holds values of X, but its shape and order change as soon as two equal
    # values move apart: no derivative at the ties that make it useful (the schema marks
    # every input and output NonDifferentiable; PyTorch and TensorFlow give it no gradient).
    "Unique",
    # comparisons and logic
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf",
    # bit-level integer ops; BitCast reinterprets bits (float16 <-> bfloat16 included)
    "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "BitShift", "BitCast",
    # integer-only arithmetic on quantized tensors (int32 / 8-bit outputs)
    "MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv",
    # functions of integer sizes only; MelWeightMatrix's float band edges are rounded to
    # integer DFT bins, so the matrix is piecewise constant in them
    "HannWindow", "HammingWindow", "BlackmanWindow", "MelWeightMatrix",
    # strings and images
    "StringNormalizer", "StringConcat", "StringSplit", "RegexFullMatch", "TfIdfVectorizer",
    "ImageDecoder",
    # constants and random draws
    "Constant", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
    "Multinomial", "Bernoulli",
)
