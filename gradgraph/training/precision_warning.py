"""A warning when mixed precision computes nothing in the low precision on the chosen device.

The precision passes convert the ops whose kernels the session's providers load in fp16/bf16
(:mod:`gradgraph.runtime.kernels`). onnxruntime's CPU provider loads many of them only by running them
in float32 behind casts it inserts itself, and then drops the Cast pairs that meet: fp16
training on the CPU gave a loss and an update bit-identical to fp32 with nothing said (bf16 is
emulated by rounding, see :func:`gradgraph.training.build.kernel_support`). Here each op type
the training graph computes in the low precision is loaded alone on the CPU provider with the
optimized graph written out: a Cast inserted before it means no kernel of that dtype. When no
node of the graph computes in it natively, :func:`warn_if_emulated` warns naming the option.
"""

from __future__ import annotations

import functools
import os
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

import onnx
import onnx_ir as ir

from gradgraph.runtime.kernels import probe_model

_LOW = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}
_SHAPELESS = ("Cast", "CastLike", "Identity", "Constant", "Reshape", "Shape", "Squeeze",
              "Unsqueeze", "Transpose", "Flatten", "Concat", "Slice", "Gather", "Expand")


def low_precision_ops(model: onnx.ModelProto, dtype: int) -> set[tuple[str, str]]:
    """(op_type, domain) of the nodes that compute on a ``dtype`` input (data movement left out)."""
    typed = {v.name: v.type.tensor_type.elem_type for v in
             [*model.graph.input, *model.graph.value_info, *model.graph.output]}
    typed.update({t.name: t.data_type for t in model.graph.initializer})
    found = set()
    for node in model.graph.node:  # in order: a Cast's ``to`` and the inputs' type carry on
        low = any(typed.get(name) == dtype for name in node.input if name)
        to = next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None
        for out in node.output:
            if to is not None:
                typed.setdefault(out, to)
            elif low:
                typed.setdefault(out, dtype)
        if low and node.op_type not in _SHAPELESS:
            found.add((node.op_type, node.domain))
    return found


@functools.cache
def runs_natively(op_type: str, domain: str, dtype: int) -> bool | None:
    """Whether the CPU provider runs ``op_type`` in ``dtype`` without inserting casts (None:
    the probe could not tell: no schema, no model, the session failed to load)."""
    import onnxruntime as ort

    try:
        model = probe_model(op_type, "" if domain in ("", "ai.onnx") else domain, ir.DataType(dtype))
    except Exception:  # noqa: BLE001 - ops without a probe model
        return None
    with tempfile.TemporaryDirectory(prefix="gradgraph-probe-") as folder:
        path = os.path.join(folder, "optimized.onnx")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 4
        options.optimized_model_filepath = path
        try:
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            optimized = onnx.load(path)
        except Exception:  # noqa: BLE001 - no kernel at all: the pass kept it in fp32
            return None
    return not any(n.op_type == "Cast" for n in optimized.graph.node)


def warn_if_emulated(model: onnx.ModelProto, dtype: str | None, providers: Sequence[Any]) -> bool:
    """Warn (and return True) when ``dtype`` mixed precision runs on the CPU provider and no op
    of ``model`` computes in ``dtype`` there."""
    first = providers[0] if providers else "CPUExecutionProvider"
    first = first[0] if isinstance(first, tuple) else first
    if dtype not in _LOW or first != "CPUExecutionProvider":
        return False
    ops = low_precision_ops(model, _LOW[dtype])
    if any(runs_natively(op, domain, _LOW[dtype]) for op, domain in sorted(ops)):
        return False
    effect = ("the loss and the updates are float32's" if dtype == "float16" else
              "values are rounded to bfloat16, the arithmetic is float32")
    names = sorted({op for op, _ in ops})
    why = (f"it runs the converted ops ({', '.join(names[:6])}{' ...' if len(names) > 6 else ''}) "
           "in float32 behind casts it inserts" if names else "it has no kernel of that type for them")
    warnings.warn(
        f"mixed_precision.dtype={dtype!r} (--mixed-precision {dtype}): no op of this model "
        f"computes in {dtype} on onnxruntime's CPUExecutionProvider ({why}): {effect}, with no "
        "gain in speed or memory; use a GPU provider, or train without mixed precision", stacklevel=3)
    return True
