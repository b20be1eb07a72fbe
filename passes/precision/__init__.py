"""Precision passes: cast propagation (onnxruntime's PropagateCastOps) and mixed precision
(fp16 / bf16 compute with fp32 master weights), driven by the per-op tables of ``policy``."""

from passes.precision.cast_propagation import CastPropagationPass, KernelPredicate, Strategy
from passes.precision.mixed_precision import MixedPrecisionOptions, MixedPrecisionPass

__all__ = [
    "CastPropagationPass",
    "KernelPredicate",
    "MixedPrecisionOptions",
    "MixedPrecisionPass",
    "Strategy",
]
