"""RestoreDroppedBiasesPass: give back the zero biases onnxscript's optimizer removed.

``torch.onnx.export`` (dynamo, ``optimize=True``) runs onnxscript's rewrite rules
``RemoveOptionalBiasFrom{Gemm,Conv,ConvTranspose}``: a bias input that is all zeros is dropped.
A fresh model's Linear and Conv biases are often zero (HF GPT-2, BERT and T5 initialise them
so; ``nn.MultiheadAttention``'s ``out_proj`` too), so its biases vanish from the export and
would never be trained. The rewritten node keeps the rule's name
(``pkg.onnxscript.rewriter.rule_name``) and the torch call it came from (``fx_call``):

1. a ``Gemm``, ``Conv`` or ``ConvTranspose`` rewritten by that rule whose torch call
   (``aten.addmm(b, x, w)``, ``aten.linear(x, w, b)``, ``aten.conv*(x, w, b, ...)``) names a
   torch parameter that is no longer an initializer gets it back as its bias input (zeros,
   the only value the rule removes; shape from the weight: ``Gemm`` ``N``, ``Conv``
   ``W.shape[0]``, ``ConvTranspose`` ``W.shape[1] * group``);
2. a parameter two such nodes read (a shared module) is restored once and read by both.

A node whose weight shape is unknown is left alone: its parameter stays missing, and
``RecoverParametersPass`` refuses it by name.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.exports.signature import RECOVERED_KEY, RULE_NAME_KEY, TorchSignature, fx_call

_RULES = {"RemoveOptionalBiasFromGemm": "Gemm", "RemoveOptionalBiasFromConv": "Conv",
          "RemoveOptionalBiasFromConvTranspose": "ConvTranspose"}
# Where the bias is among the positional args of the torch call (default: the third).
_BIAS_ARG = {"aten.addmm.default": 0}


def _bias_size(node: ir.Node) -> int | None:
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    dims = list(weight.shape)[:2] if weight is not None and weight.shape is not None else []
    if len(dims) < 2 or not isinstance(dims[0], int) or not isinstance(dims[1], int):
        return None
    rows, cols = dims[0], dims[1]
    if node.op_type == "Gemm":
        return rows if node.attributes.get_int("transB", 0) else cols
    if node.op_type == "Conv":
        return rows
    return cols * node.attributes.get_int("group", 1)


class RestoreDroppedBiasesPass(InPlacePass):
    def __init__(self) -> None:
        super().__init__()
        self.recovered: dict[str, str] = {}  # parameter -> how

    def call(self, model: ir.Model) -> PassResult:
        signature = TorchSignature.read(model)
        if signature is None:
            return PassResult(model, False)
        graph = model.graph
        placeholders = signature.targets("PARAMETER")
        modified = False
        for node in ir.traversal.RecursiveGraphIterator(graph):
            rule = node.metadata_props.get(RULE_NAME_KEY)
            call = fx_call(node)
            if (_RULES.get(rule or "") != node.op_type or node.domain not in ("", "ai.onnx") or call is None
                    or (len(node.inputs) > 2 and node.inputs[2] is not None)):
                continue
            index = _BIAS_ARG.get(call.target, 2)
            arg = call.args[index].lstrip("%") if index < len(call.args) else ""
            fqn = placeholders.get(arg)
            size = _bias_size(node)
            if fqn is None or size is None:
                continue
            bias = graph.initializers.get(fqn)
            if bias is None:
                if fqn in {v.name for v in graph.inputs}:
                    continue  # a graph input of that name: not dropped
                dtype = node.inputs[1].dtype if node.inputs[1] is not None else None
                if dtype is None:
                    continue
                data = np.zeros(size, dtype=dtype.numpy())
                bias = ir.Value(name=fqn, shape=ir.Shape([size]), type=ir.TensorType(dtype),
                                const_value=ir.tensor(data, name=fqn))
                bias.metadata_props[RECOVERED_KEY] = f"zero bias dropped by onnxscript's {rule}"
                graph.register_initializer(bias)
                self.recovered[fqn] = f"zero bias restored on {node.name or node.op_type} ({rule})"
            elif bias.shape is not None and list(bias.shape) != [size]:
                continue
            node.resize_inputs(3)
            node.replace_input_with(2, bias)
            modified = True
        return PassResult(model, modified)
