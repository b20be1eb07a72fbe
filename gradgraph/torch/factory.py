"""TorchOrtFactory: an ONNX graph as a ``torch.autograd.Function`` (deeponnxcustom's API).

``TorchOrtFactory(onnx_model, weights_to_train, ...).create_class()`` returns a subclass of
:class:`TorchOrtFunction`; ``cls.apply(*inputs, *weights)`` runs the graph in onnxruntime with
the inputs in ``input_names`` order and the weights as torch tensors in ``weights_to_train``
order (any order: the original required alphabetical order, this one does not), returning the
graph's outputs in ``output_names`` order; its backward gives the gradients of the inputs and
weights. Built on the front ends' runner (:class:`gradgraph.torch.ortmodule.GraphRunner`):
the weights become graph inputs, the gradient of every output is built (one seed per float
output) and the graph is split into a forward and a backward session.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from typing import Any

import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch

from gradgraph.io import load_model
from gradgraph.runtime.compat import inference_session, provider_names
from gradgraph.torch.feed_check import FeedCheck
from gradgraph.torch.ortmodule import (
    GraphRunner,
    _to_ort,
    _to_torch,
    apply_runner,
    device_rewrites,
    tf32_option,
)
from gradgraph.validate import check_names
from passes.exports.recover import RecoverParametersPass
from passes.forward.distinct_outputs import DistinctOutputsPass
from passes.forward.params_to_inputs import ParamsToInputsPass
from passes.forward.prepare import PrepareForGradientPass
from passes.kernels import GeluFusionPass, ValidRowsLossPass, WholeScoresLossPass
from passes.recompute.recompute_pass import SESSION_DISABLED_OPTIMIZERS

logger = logging.getLogger("gradgraph.torch")


_TORCH_OF_IR = {
    ir.DataType.FLOAT: torch.float32, ir.DataType.DOUBLE: torch.float64, ir.DataType.FLOAT16: torch.float16,
    ir.DataType.BFLOAT16: torch.bfloat16, ir.DataType.INT64: torch.int64, ir.DataType.INT32: torch.int32,
    ir.DataType.INT16: torch.int16, ir.DataType.INT8: torch.int8, ir.DataType.UINT8: torch.uint8,
    ir.DataType.BOOL: torch.bool,
}


class TorchOrtFunction(torch.autograd.Function):
    """Ancestor of the classes :meth:`TorchOrtFactory.create_class` makes."""

    _runner: GraphRunner

    @staticmethod
    def from_torch_to_ort(tensors: Sequence[torch.Tensor]) -> list[ort.OrtValue]:
        """Torch tensors -> onnxruntime values (DLPack, no copy on CPU)."""
        return [_to_ort(t) for t in tensors]

    @staticmethod
    def from_ort_to_torch(ort_values: Sequence[ort.OrtValue]) -> tuple[torch.Tensor, ...]:
        """onnxruntime values -> torch tensors (DLPack, no copy on CPU)."""
        return tuple(_to_torch(v) for v in ort_values)


GPU_PROVIDERS = ("CUDAExecutionProvider", "ROCMExecutionProvider")


class TorchOrtFactory:
    def __init__(self, onnx_model: onnx.ModelProto | str | os.PathLike | bytes,
                 weights_to_train: Sequence[str], input_names: Sequence[str] | None = None,
                 output_names: Sequence[str] | None = None, class_name: str | None = None,
                 sess_options: ort.SessionOptions | None = None, providers: Sequence[Any] | None = None,
                 provider_options: Sequence[dict] | None = None, run_options: ort.RunOptions | None = None,
                 graph_builder_config: Any = None, device_index: int = 0) -> None:
        check_names("weights_to_train", weights_to_train)
        proto = onnx_model if isinstance(onnx_model, onnx.ModelProto) else ir.to_proto(load_model(onnx_model))
        initializers = {t.name for t in proto.graph.initializer}
        graph_inputs = [i.name for i in proto.graph.input if i.name not in initializers]
        outputs = [o.name for o in proto.graph.output]
        missing = [w for w in weights_to_train if w not in initializers and w not in graph_inputs]
        if missing:  # a dynamo export's optimizer may have folded them: recover what it can
            recovered = ir.from_proto(proto)
            RecoverParametersPass(strict=False)(recovered)
            names = {v.name for v in recovered.graph.initializers.values()}
            if all(w in names or w in graph_inputs for w in missing):
                proto, initializers = ir.to_proto(recovered), names
                missing = []
        if missing:
            raise ValueError(f"TorchOrtFactory: weights_to_train {missing} are neither initializers nor "
                             f"inputs of the model; its initializers are {sorted(initializers)[:10]}")
        if len(set(weights_to_train)) != len(weights_to_train):
            raise ValueError(f"TorchOrtFactory: weights_to_train lists a name twice: {list(weights_to_train)}")
        self.input_names = [n for n in (input_names or graph_inputs) if n not in set(weights_to_train)]
        unknown = [n for n in self.input_names if n not in graph_inputs]
        if unknown:
            raise ValueError(f"TorchOrtFactory: input_names {unknown} are not graph inputs of the model "
                             f"(graph inputs: {graph_inputs})")
        self.output_names = list(output_names or outputs)
        unknown = [n for n in self.output_names if n not in outputs]
        if unknown:
            raise ValueError(f"TorchOrtFactory: output_names {unknown} are not graph outputs (outputs: {outputs})")
        if graph_builder_config is not None:
            warnings.warn("TorchOrtFactory: graph_builder_config is onnxruntime-training's "
                          "OrtModuleGraphBuilderConfiguration and is ignored: gradgraph builds "
                          "the gradient of every float input and weights_to_train", UserWarning,
                          stacklevel=2)
        self.onnx_model = proto
        self.weights_to_train = list(weights_to_train)
        self.class_name = class_name or f"TorchOrtFunction_{id(self)}"
        self.sess_options = sess_options
        self.providers = list(providers) if providers else ["CPUExecutionProvider"]
        self.provider_options = provider_options
        if run_options is not None and not isinstance(run_options, ort.RunOptions):
            raise TypeError(f"TorchOrtFactory: run_options must be an onnxruntime.RunOptions, "
                            f"not {type(run_options).__name__}")
        if isinstance(device_index, bool) or not isinstance(device_index, int) or device_index < 0:
            raise ValueError(f"TorchOrtFactory: device_index must be an integer >= 0 (the CUDA "
                             f"device); got {device_index!r}")
        self.run_options = run_options
        # The device of the GPU providers (their provider options' device_id when not given).
        self.device_index = device_index
        self._check_device_index()

    def __repr__(self) -> str:
        return (f"TorchOrtFactory(weights_to_train={self.weights_to_train!r}, input_names="
                f"{self.input_names!r}, output_names={self.output_names!r}, class_name={self.class_name!r})")

    def _check_device_index(self) -> None:
        """A device_index that would select nothing is refused: no GPU provider, or GPU provider
        options that name another device_id."""
        if self.device_index == 0:
            return
        names = provider_names(self.providers)
        if not any(n in GPU_PROVIDERS for n in names):
            raise ValueError(f"TorchOrtFactory: device_index={self.device_index} selects the device of "
                             f"a GPU provider ({', '.join(GPU_PROVIDERS)}); the providers {names} have "
                             "none: leave device_index at 0 or add the GPU provider")
        for name, opts in zip(names, self.provider_options or []):
            given = (opts or {}).get("device_id")
            if name in GPU_PROVIDERS and given is not None and str(given) != str(self.device_index):
                raise ValueError(f"TorchOrtFactory: device_index={self.device_index} and {name}'s "
                                 f"provider_options device_id={given!r} name different devices; give one")

    def _provider_options(self) -> Sequence[dict] | None:
        """The given provider options (GPU providers get ``device_id = device_index`` where they
        do not name one), else ``device_id = device_index`` for GPU providers, and
        for CUDA TF32 exactly when torch allows it for its float32 matrix products
        (``torch.backends.cuda.matmul.allow_tf32``, off by default; onnxruntime's default is on)."""
        names = provider_names(self.providers)
        if self.provider_options is not None:
            return [{"device_id": str(self.device_index), **(opts or {})}
                    if n in GPU_PROVIDERS and self.device_index != 0 else opts
                    for n, opts in zip(names, self.provider_options)]
        if not any(n in GPU_PROVIDERS for n in names):
            return None
        return [{"device_id": str(self.device_index),
                 **({"use_tf32": tf32_option()} if n == "CUDAExecutionProvider" else {})}
                if n in GPU_PROVIDERS else {} for n in names]

    def _session(self, model: ir.Model) -> ort.InferenceSession:
        opts = self.sess_options or ort.SessionOptions()
        return inference_session(ir.to_proto(model), opts, providers=self.providers,
                                 provider_options=self._provider_options(),
                                 disabled_optimizers=list(SESSION_DISABLED_OPTIMIZERS))

    def create_class(self, enable_logging: bool = False, keep_models: bool = False,
                     debug: bool = False) -> type[TorchOrtFunction]:
        """A ``torch.autograd.Function`` subclass running the graph (module docstring).

        ``enable_logging``: log the build (logger ``gradgraph.torch``, INFO); ``keep_models``:
        the graph with the weights as inputs, before the gradient, as ``_optimized_pre_grad_model``;
        ``debug``: both."""
        if debug:
            enable_logging = keep_models = True
        model = ir.from_proto(self.onnx_model)
        # the graph's outputs become the user's, in output_names order (a name may repeat)
        by_name = {o.name: o for o in model.graph.outputs}
        model.graph.outputs.clear()
        model.graph.outputs.extend(by_name[n] for n in self.output_names)
        n_user = len(self.output_names)
        PrepareForGradientPass(strict_parameters=False)(model)
        WholeScoresLossPass()(model)  # a loss over sliced scores: no copy of them, no Pad
        ValidRowsLossPass()(model)  # the rows the loss ignores are not computed
        cuda = "CUDAExecutionProvider" in provider_names(self.providers)
        for rewrite in device_rewrites("cuda" if cuda else "cpu"):
            rewrite(model)
        # outputs the preparation exposed (Dropout masks, running statistics) are not the user's
        ParamsToInputsPass(self.weights_to_train)(model)
        # an exported GELU formula as one Gelu node (after the weights became inputs: a trained
        # scalar is never taken for one of its constants)
        GeluFusionPass()(model)
        # an output repeated, or a weight or input returned as it is: each its own value (a seed
        # each, their gradients summed), named anew
        DistinctOutputsPass()(model)
        runner_outputs = [o.name or "" for o in model.graph.outputs[:n_user]]
        feed_names = self.input_names + self.weights_to_train
        float_inputs = [n for n in self.input_names
                        if any(v.name == n and v.dtype is not None and v.dtype.is_floating_point()
                               for v in model.graph.inputs)]
        pre_grad = ir.to_proto(model) if keep_models else None
        runner = GraphRunner(model, feed_names, float_inputs + self.weights_to_train, runner_outputs,
                             training=True, make_session=self._session, run_options=self.run_options,
                             state_names=self.weights_to_train)
        if enable_logging:
            logger.info("TorchOrtFactory: %s built; forward outputs %d, backward inputs %d",
                        self.class_name, len(runner.fwd_outputs), len(runner.bwd_inputs))
        n_outputs = len(self.output_names)
        # the dtype each feed must have (onnxruntime's own error names neither input nor dtype)
        types = {v.name: v.dtype for v in model.graph.inputs if v.dtype is not None}
        expected = [_TORCH_OF_IR.get(types[n]) if n in types else None for n in feed_names]
        # shapes, the labels' batch and index values, before onnxruntime runs
        check = FeedCheck(ir.from_proto(self.onnx_model), feed_names, self.class_name)

        def forward(ctx, *tensors: torch.Tensor) -> Any:
            if len(tensors) != len(feed_names):
                raise TypeError(f"{self.class_name}.apply takes {len(feed_names)} tensors "
                                f"({', '.join(feed_names)}), got {len(tensors)}")
            for name, tensor, dtype in zip(feed_names, tensors, expected, strict=True):
                if dtype is not None and isinstance(tensor, torch.Tensor) and tensor.dtype != dtype:
                    raise TypeError(f"{self.class_name}.apply: {name!r} is a {tensor.dtype} tensor; the "
                                    f"graph takes {dtype} (convert it, e.g. .to({dtype}))")
            check(tensors)
            outs = apply_runner(runner, tensors)
            return outs[0] if n_outputs == 1 else outs

        attributes: dict[str, Any] = {
            "__doc__": f"The ONNX graph with inputs {self.input_names} and weights {self.weights_to_train}, "
                       f"run by onnxruntime (forward and backward).",
            "__module__": __name__,
            "_runner": runner, "_run_options": self.run_options, "_sess": runner.forward,
            "_sess_eval": runner.forward, "_input_names": self.input_names,
            "_grad_input_names": [n for n in feed_names if n in runner.grad_names],
            "_output_names": self.output_names, "_weights_to_train": self.weights_to_train,
            "_bw_fetches_names": list(runner.bwd_outputs), "_debug": debug,
            "_logger": logger if enable_logging else None,
            "apply": classmethod(lambda cls, *tensors: forward(None, *tensors)),
        }
        if keep_models:  # the graph with weights as inputs, before the gradient was added
            attributes["_optimized_pre_grad_model"] = pre_grad
        return type(self.class_name, (TorchOrtFunction,), attributes)
