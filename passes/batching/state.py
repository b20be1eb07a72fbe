"""What the batch analysis tracks: where a value holds the batch, and the edits it plans."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir

INT64_MAX = int(np.iinfo(np.int64).max)
TO_THE_END = int(np.iinfo(np.int32).max)  # Slice ends from here on mean "to the end" (exporters use both)


@dataclasses.dataclass(frozen=True)
class Batch:
    """The batch of a value: ``axis`` holds ``factor`` * N entries laid out outer x N x inner
    (outer * inner = factor; outer > 1 once a reshape merged leading dims with the batch)."""

    axis: int
    factor: int = 1
    outer: int = 1

    def at(self, axis: int) -> Batch:
        return dataclasses.replace(self, axis=axis)


UNKNOWN = Batch(-1, 0)


@dataclasses.dataclass(frozen=True)
class N:
    """A shape entry N * factor, computed from the batch size at run time."""

    factor: int = 1


@dataclasses.dataclass(frozen=True)
class Edit:
    """What replaces one node input: ``entries`` (a shape); ``affine``: a constant whose slices
    along ``axis`` are C0 + b*D, rebuilt for N (C0 expanded to N * ``factor`` when ``expand``);
    ``divisor``: N * ``scale`` (its reciprocal for Mul); ``scalar``: N * ``factor`` (Range limit)."""

    kind: str
    entries: tuple[int | N, ...] = ()
    axis: int = 0
    factor: int = 1
    expand: bool = False
    scale: float = 1.0


class Refusal(Exception):
    pass


SAME = frozenset(
    "Abs Acos Acosh Asin Asinh Atan Atanh Cast Ceil Celu Clip Cos Cosh CumSum Dropout Elu "
    "Erf Exp Floor Gelu HardSigmoid HardSwish Hardmax Identity IsInf IsNaN LeakyRelu Log LogSoftmax "
    "LpNormalization MeanVarianceNormalization Mish Neg Not Reciprocal Relu Round Selu Shrink "
    "Sigmoid Sign Sin Sinh Softmax Softplus Softsign Sqrt Tan Tanh ThresholdedRelu Trilu".split())
BROADCAST = frozenset(
    "Add And BitShift BitwiseAnd BitwiseOr BitwiseXor Div Equal Greater GreaterOrEqual Less "
    "LessOrEqual Max Mean Min Mod Mul Or PRelu Pow Sub Sum Where Xor".split())
SPATIAL = frozenset(
    "AveragePool BatchNormalization Conv ConvTranspose DepthToSpace GlobalAveragePool GlobalLpPool "
    "GlobalMaxPool GroupNormalization InstanceNormalization LRN LpPool MaxPool SpaceToDepth".split())
REDUCE = frozenset(
    "ArgMax ArgMin ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin "
    "ReduceProd ReduceSum ReduceSumSquare".split())
RECURRENT = frozenset({"GRU", "LSTM", "RNN"})
SUMS = frozenset({"ReduceSum", "ReduceSumSquare", "ReduceL1"})
SUM_PASS = frozenset({"Identity", "Cast", "Neg", "Squeeze", "Unsqueeze", "Reshape", "Flatten"})
RANDOM = frozenset("Bernoulli Dropout Multinomial RandomNormal RandomNormalLike RandomUniform "
                    "RandomUniformLike".split())
GENERATORS = {"Expand": 1, "ConstantOfShape": 0, "Tile": 1}


def leading(value: ir.Value) -> int | None:
    dims = dims_of(value)
    return dims[0] if dims and isinstance(dims[0], int) else None


def dims_of(value: ir.Value | None) -> list[int | None] | None:
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape]


def rank_of(value: ir.Value | None) -> int:
    return len(value.shape) if value is not None and value.shape is not None else 0


def static_dims(value: ir.Value | None) -> list[int] | None:
    dims = dims_of(value)
    return None if dims is None or None in dims else [int(d or 0) for d in dims]


def int_list(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return None if attr is None else [int(x) for x in attr.value]


def regroup(dims: list[int], batch: Batch, size: int, out: list[int]) -> Batch | None:
    """Where the batch lands when ``dims`` (batch ``batch``, batch size ``size``) are reshaped to
    ``out``: the one output dim that holds all N rows whole, or None when a reshape splits them."""
    before = math.prod(dims[: batch.axis]) * batch.outer  # elements laid out ahead of N
    acc = 1
    for j, width in enumerate(out):
        if before % acc == 0 and width and (acc * width) % (before * size) == 0:
            outer, inner = before // acc, acc * width // (before * size)
            return Batch(j, outer * inner, outer)
        acc *= width
        if acc > before:
            return None
    return None



def reshaped(dims: list[int], target: np.ndarray, allowzero: int) -> list[int] | None:
    out = [dims[i] if x == 0 and not allowzero and i < len(dims) else int(x) for i, x in enumerate(target)]
    if out.count(-1) == 1:
        known = math.prod(x for x in out if x != -1)
        if known <= 0:
            return None
        out[out.index(-1)] = math.prod(dims) // known
    return out if min(out, default=0) >= 0 else None


# ---------------------------------------------------------------------------------------------
# Applying the planned rewrites



def as_numpy(value: ir.Value) -> np.ndarray:
    tensor = ir.convenience.get_const_tensor(value)
    assert tensor is not None, f"{value.name!r} is not a constant"
    return tensor.numpy()
