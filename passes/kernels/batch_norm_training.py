"""DecomposeTrainingBatchNormPass: a training-mode ``BatchNormalization`` as its ONNX definition.

onnxruntime's CUDA kernel refuses ``BatchNormalization`` with ``training_mode = 1`` at opset 14
and later ("Training mode does not support BN opset 14 (or higher) yet", onnxruntime 1.29), so a
graph for a CUDA session computes it from standard ops, as the operator's definition says
(axes: every axis but the channel axis 1)::

    mean = ReduceMean(X, axes)              var = ReduceMean((X - mean)^2, axes)   (biased)
    Y = (X - mean) / Sqrt(var + epsilon) * scale + B          (scale, B per channel)
    running_mean = input_mean * momentum + mean * (1 - momentum)
    running_var  = input_var * momentum + var * (1 - momentum)

Outputs the node did not have (or that nothing reads) are not computed. Run before the
gradient: the gradient rules then differentiate the standard ops. Values agree with the kernel
to float rounding. Nodes made carry the BatchNorm's metadata (its marks and torch conventions).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff.builder import OpBuilder, scope_taken_names
from passes.kernels._graph import DEFAULT_DOMAINS, default_opset, take_over


def _training(node: ir.Node) -> bool:
    return bool(node.attributes.get_int("training_mode", 0))


class DecomposeTrainingBatchNormPass(InPlacePass):
    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        found = [n for n in graph if n.op_type == "BatchNormalization" and n.domain in DEFAULT_DOMAINS
                 and _training(n) and len(n.inputs) >= 5]
        for node in found:
            self._decompose(model, node)
        return PassResult(model, bool(found))

    @staticmethod
    def _decompose(model: ir.Model, node: ir.Node) -> None:
        graph = model.graph
        x, scale, bias, mean_in, var_in = node.inputs[:5]
        assert x is not None and scale is not None and bias is not None
        rank = len(x.shape) if x.shape is not None else None
        if rank is None:
            raise ValueError(f"BatchNormalization {node.name!r}: the rank of its input is unknown "
                             "(run shape inference first)")
        b = OpBuilder(default_opset(model), dict(model.opset_imports))
        b.prefix = f"{node.name or 'BatchNormalization'}/decomposed"
        b.marks = dict(node.metadata_props)
        x_dtype = x.dtype or ir.DataType.FLOAT
        # float16 / bfloat16 inputs (autocast; scale, bias and statistics often float32, as the
        # operator allows) are normalized in float32, as cuDNN's kernel accumulates
        dtype = ir.DataType.FLOAT if x_dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16) else x_dtype
        epsilon = node.attributes.get_float("epsilon", 1e-5)
        momentum = node.attributes.get_float("momentum", 0.9)
        axes = [0, *range(2, rank)]
        per_channel = b.const(np.array([1, -1] + [1] * (rank - 2), np.int64))
        xv = b.cast_to(b.wrap(x), dtype)
        mean = b.reduce("ReduceMean", xv, axes)
        centered = b.Sub(xv, mean)
        var = b.reduce("ReduceMean", b.Mul(centered, centered), axes)
        inv_std = b.Reciprocal(b.Sqrt(b.Add(var, b.const(epsilon, dtype))))
        y = b.Add(b.Mul(b.Mul(centered, inv_std), b.Reshape(b.cast_to(b.wrap(scale), dtype), per_channel)),
                  b.Reshape(b.cast_to(b.wrap(bias), dtype), per_channel))
        replaced = [(node.outputs[0], b.cast_to(y, x_dtype))]
        keep, take = b.const(momentum, dtype), b.const(1.0 - momentum, dtype)
        flat = b.const(np.array([-1], np.int64))
        for index, (batch_stat, running) in enumerate(((mean, mean_in), (var, var_in)), start=1):
            if index >= len(node.outputs) or running is None:
                continue
            out = node.outputs[index]
            if not out.uses() and not out.is_graph_output():
                continue
            stat_dtype = running.dtype or dtype
            updated = b.Add(b.Mul(b.wrap(running), b.cast_to(keep, stat_dtype)),
                            b.Mul(b.cast_to(b.Reshape(batch_stat, flat), stat_dtype), b.cast_to(take, stat_dtype)))
            replaced.append((out, updated))
        scope_taken_names(graph, b.nodes, b.prefix)
        graph.insert_before(node, b.nodes)
        for old, new in replaced:
            new.value.type, new.value.shape = old.type, old.shape
            take_over(graph, old, new.value)
        graph.remove(node, safe=True)
