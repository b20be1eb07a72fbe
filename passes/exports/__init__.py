"""Passes that read what an exporter recorded about a model and act on it.

- :mod:`signature`: the torch export signature (parameters, buffers, user inputs) and the FX
  node each ONNX node came from, as a dynamo export stores them in metadata;
- :mod:`recover`: ``RecoverParametersPass`` undoes the exporter's folds of parameters where
  they are invertible (transposed copies, equal-valued parameters merged into one) and
  refuses the rest (:mod:`refusal` words it); it first runs
- :mod:`dropped_bias`: ``RestoreDroppedBiasesPass`` gives back the zero biases onnxscript's
  ``RemoveOptionalBiasFrom*`` rules dropped, and
- :mod:`merged_calls`: ``SplitMergedCallsPass`` clones torch calls that its CSE merged (two
  modules equal at init on one input) and gives the clone its own parameters;
- :mod:`conventions`: ``TorchConventionsPass`` marks nodes whose torch gradient differs from
  the ONNX op's plain one (embedding ``padding_idx``, clamp vs hardtanh at the bounds);
- :mod:`classify`: ``ClassifyWeightsPass`` marks every float initializer parameter, buffer or
  constant (the default trained set is the parameters).
"""

from passes.exports.classify import KIND_KEY, REASON_KEY, ClassifyWeightsPass, WeightKind
from passes.exports.conventions import TorchConventionsPass
from passes.exports.dropped_bias import RestoreDroppedBiasesPass
from passes.exports.merged_calls import SplitMergedCallsPass
from passes.exports.recover import RecoverParametersPass
from passes.exports.signature import TorchSignature, fx_call

__all__ = [
    "KIND_KEY",
    "REASON_KEY",
    "ClassifyWeightsPass",
    "RecoverParametersPass",
    "RestoreDroppedBiasesPass",
    "SplitMergedCallsPass",
    "TorchConventionsPass",
    "TorchSignature",
    "WeightKind",
    "fx_call",
]
