"""ContribShapesPass: shapes through the onnxruntime contrib ops that have gradient rules.

onnx's shape inference does not know the ``com.microsoft`` ops, so in a model that
onnxruntime's optimizer saved (``SessionOptions.optimized_model_filepath``, its transformer
optimizer) the outputs of FusedMatMul, Gelu, FastGelu, BiasGelu, QuickGelu,
SkipLayerNormalization and SkipSimplifiedLayerNormalization, and every value
computed from them, have no shape (as do those of ``SimplifiedLayerNormalization``, the RMS
norm onnxruntime defines in the default domain, and of its own LayerNormalization below ONNX's
opset 17); rules that need a rank (MatMul's, Softmax's, ...) then
fail. This pass walks the graph in order once: a contrib op's output gets the shape its
formula gives from its inputs' (FusedMatMul: a MatMul of the operands with the last two axes
swapped where transA / transB say; the GELUs: their input's), and a later default-domain node
whose outputs still have no shape gets onnx's inference of that one node
(``onnx.shape_inference.infer_node_outputs``, with the constant inputs it reads). It runs only
where a node's output has no shape: other graphs are left as they are. It also shapes
``Reshape(x, Shape(v))`` as ``v``, which onnx's data propagation misses at opset 13 (torch's
legacy GroupNorm export), and what follows it.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.shapes import infer_node, shape_of_shape_input, take_inferred

MS_DOMAIN = "com.microsoft"
# Ops onnxruntime defines in the default domain though ONNX does not (its RMS norm before opset
# 23, written by its optimizers and LLaMA-style exports): they load in stock onnxruntime.
ORT_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})
_SAME_SHAPE = frozenset({"Gelu", "FastGelu", "BiasGelu", "QuickGelu", "SimplifiedLayerNormalization"})
# outputs Y, mean, inverse std (or RMS), input_skip_bias_sum (shaped by _shape_norm, axis -1)
_SKIP_NORMS = frozenset({"SkipLayerNormalization", "SkipSimplifiedLayerNormalization"})


def _is_contrib(node: ir.Node) -> bool:
    """An onnxruntime op that onnx's shape inference does not know."""
    return node.domain == MS_DOMAIN or (node.domain in ("", "ai.onnx") and node.op_type in ORT_DEFAULT_DOMAIN_OPS)


def _broadcast_dim(x, y):  # type: ignore[no-untyped-def]
    """The broadcast of two dims; None (unknown) where a symbolic one may be 1 or not."""
    if x == y:
        return x
    if x == 1:
        return y
    if y == 1:
        return x
    if isinstance(x, int) and isinstance(y, int):
        return None  # they do not broadcast: onnxruntime refuses the run
    if isinstance(x, int) and x > 1:
        return x
    if isinstance(y, int) and y > 1:
        return y
    return None


def _matmul_shape(a: Sequence, c: Sequence, trans_a: bool, trans_c: bool) -> list | None:
    a, c = list(a), list(c)
    if (trans_a and len(a) < 2) or (trans_c and len(c) < 2) or not a or not c:
        return None
    if trans_a:
        a[-1], a[-2] = a[-2], a[-1]
    if trans_c:
        c[-1], c[-2] = c[-2], c[-1]
    squeeze_a, squeeze_c = len(a) == 1, len(c) == 1
    a = [1, *a] if squeeze_a else a
    c = [*c, 1] if squeeze_c else c
    batch_a, batch_c = a[:-2], c[:-2]
    n = max(len(batch_a), len(batch_c))
    batch_a = [1] * (n - len(batch_a)) + batch_a
    batch_c = [1] * (n - len(batch_c)) + batch_c
    batch = [_broadcast_dim(x, y) for x, y in zip(batch_a, batch_c)]
    out = [*batch, a[-2], c[-1]]
    if squeeze_c:
        out.pop(-1)
    if squeeze_a:
        out.pop(-2 if not squeeze_c else -1)
    return out


def _contrib_shape(node: ir.Node) -> ir.Shape | None:
    shapes = [v.shape if v is not None else None for v in node.inputs]
    if node.op_type in _SAME_SHAPE and shapes and shapes[0] is not None:
        return ir.Shape(list(shapes[0]))
    if node.op_type == "FusedMatMul" and len(shapes) >= 2 and shapes[0] is not None and shapes[1] is not None:
        if node.attributes.get_int("transBatchA", 0) or node.attributes.get_int("transBatchB", 0):
            return None
        dims = _matmul_shape(list(shapes[0]), list(shapes[1]), bool(node.attributes.get_int("transA", 0)),
                             bool(node.attributes.get_int("transB", 0)))
        return ir.Shape(dims) if dims is not None else None
    return None


def _shape_norm(node: ir.Node, axis: int) -> bool:
    """A normalization's outputs shaped from its input's (modified?): the statistics (outputs
    1 and 2: mean, inverse std or RMS) as the input with the axes from ``axis`` on 1, float32
    as onnxruntime's kernels keep them; the others (Y, SkipLayerNormalization's sum) as the
    input. onnxruntime's LayerNormalization below opset 17 and ``_SKIP_NORMS`` (axis -1)."""
    x = node.inputs[0]
    if x is None or x.shape is None:
        return False
    dims = list(x.shape)
    axis = axis + len(dims) if axis < 0 else axis
    modified = False
    for index, value in enumerate(node.outputs):
        if value.shape is not None:
            continue
        statistic = index in (1, 2)
        value.shape = ir.Shape([*dims[:axis], *[1] * (len(dims) - axis)] if statistic else dims)
        if value.type is None:
            value.type = ir.TensorType(ir.DataType.FLOAT) if statistic else x.type
        modified = True
    return modified


def opsets_of(model: ir.Model) -> dict[str, int]:
    """The model's opset imports, the default domain as ""."""
    return {"" if d == "ai.onnx" else d: v for d, v in model.opset_imports.items()}


def _infer_one(node: ir.Node, opsets: dict[str, int]) -> None:
    """onnx's inference of ``node`` alone, taken where its outputs have no shape."""
    found = infer_node(node, opsets)
    for value in node.outputs:
        proto = found.get(value.name or "")
        if proto is not None:
            take_inferred(value, proto)


class ContribShapesPass(InPlacePass):
    """See the module docstring."""

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        if not any(v.shape is None for n in graph for v in n.outputs):
            return PassResult(model, False)
        opsets = opsets_of(model)
        modified = False
        for node in graph:
            if all(v.shape is not None for v in node.outputs):
                continue
            if node.domain == MS_DOMAIN and node.op_type in _SKIP_NORMS:
                modified |= _shape_norm(node, -1)
            elif node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx") \
                    and opsets.get("", 17) < 17:  # onnxruntime's own, below ONNX's opset 17
                modified |= _shape_norm(node, node.attributes.get_int("axis", -1))
            elif _is_contrib(node):
                shape = _contrib_shape(node)
                if shape is not None and node.outputs[0].shape is None:
                    node.outputs[0].shape = shape
                    # SimplifiedLayerNormalization's Y has its scale's type (V), not X's
                    typed_by = node.inputs[1] if node.op_type == "SimplifiedLayerNormalization" else node.inputs[0]
                    if node.outputs[0].type is None and typed_by is not None:
                        node.outputs[0].type = typed_by.type
                    modified = True
            elif node.op_type == "Reshape" and (reshaped := shape_of_shape_input(node)) is not None:
                node.outputs[0].shape = reshaped
                if node.outputs[0].type is None and node.inputs[0] is not None:
                    node.outputs[0].type = node.inputs[0].type
                modified = True
            elif node.domain in ("", "ai.onnx") and all(v.shape is not None for v in node.inputs if v is not None):
                before = [v.shape for v in node.outputs]
                _infer_one(node, opsets)
                modified |= [v.shape for v in node.outputs] != before
        return PassResult(model, modified)
