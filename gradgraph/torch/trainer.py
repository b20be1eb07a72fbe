"""``ORTTrainer``: onnxruntime-training's ORTTrainer API on gradgraph's training session.

``ORTTrainer(model, model_desc, optim_config, loss_fn=None, options=None)``:

- ``model``: a ``torch.nn.Module`` (exported on the first ``train_step`` / ``eval_step``, with
  ``loss_fn`` combined as ``loss_fn(model(*inputs[:-1]), inputs[-1])``: the label is the last
  input, the outputs are the loss then the model's outputs), or an ``onnx.ModelProto`` whose
  loss output is flagged in ``model_desc`` (built at once);
- ``model_desc``: ``{'inputs': [(name, shape)], 'outputs': [(name, shape[, is_loss])]}``; a
  string dimension is symbolic (exported as a dynamic axis), an int is fixed; exactly one
  output has ``is_loss=True``;
- ``optim_config``: :class:`gradgraph.torch.optim.SGDConfig` / ``AdamConfig`` / ``LambConfig``;
- ``options``: :class:`ORTTrainerOptions` (or its dict).

The exported model's trained weights are the module's parameters under their own names
(``fc1.weight``); ``utils.frozen_weights`` and parameter groups name them that way. The
training graph (forward, gradient, optimizer) is built by :func:`gradgraph.build_training_artifacts`
and run by :class:`gradgraph.TrainingSession`: its options come from ORTTrainerOptions
(``batch.gradient_accumulation_steps``, ``utils.grad_norm_clip`` with the config's
``max_norm_clip``, ``mixed_precision``, ``graph_transformer`` recompute and cast propagation,
``debug.graph_save_paths``, ``_internal_use.enable_internal_postprocess`` (gradgraph's
clean-up passes) and ``extra_postprocess``, ``session_options``, ``provider_options`` (CUDA's;
the CPU provider's are refused: onnxruntime drops them unread)). ``model_desc``'s outputs are
checked against what the model returns on the first step (or an ONNX model declares).

Not implemented, refused with ``NotImplementedError`` naming the option: distributed and
pipeline training (``distributed.*`` other than its defaults), ``utils.memory_efficient_gradient``.
Accepted without effect (nothing to do in gradgraph): ``utils.run_symbolic_shape_infer`` (ONNX
shape inference always runs); ``graph_transformer.allow_layer_norm_mod_precision`` warns (LayerNorm
statistics stay fp32). ``_internal_use.enable_onnx_contrib_ops=False``: standard ONNX ops only
(``GraphTransformerOptions.contrib_ops``).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch

from gradgraph.torch.export import ExportedCall, export_call
from gradgraph.torch.model_desc import IODescription, ModelDescription
from gradgraph.torch.optim import TrainStepInfo, _OptimizerConfig
from gradgraph.torch.trainer_options import ORTTrainerOptions
from gradgraph.torch.trainer_state import TrainerState, _names_by_tensor
from gradgraph.training.options import (
    CastPropagationConfig,
    DebugOptions,
    GraphSavePaths,
    GraphTransformerOptions,
    MixedPrecisionConfig,
    TrainingConfig,
)
from gradgraph.training.session import TrainingSession
from gradgraph.validate import close_matches
from passes.optimizer.optimizer_pass import UpdateOptions

# options that ask for something not implemented: their "off" values
_UNSUPPORTED = {
    "distributed.horizontal_parallel_size": 1, "distributed.enable_adasum": False,
    "distributed.pipeline_parallel.pipeline_parallel_size": 1,
    "distributed.pipeline_parallel.num_pipeline_micro_batches": 1,
    "distributed.pipeline_parallel.pipeline_cut_info_string": "",
    "utils.memory_efficient_gradient": False,
}


class _WithLoss(torch.nn.Module):
    """The reference's combination: ``(loss_fn(model(*inputs[:-1]), inputs[-1]), model outputs)``."""

    def __init__(self, model: torch.nn.Module, loss_fn: Any) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs: torch.Tensor) -> Any:
        preds = self.model(*inputs[:-1])
        return self.loss_fn(preds, inputs[-1]), preds


def _get(options: ORTTrainerOptions, path: str) -> Any:
    value: Any = options
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _dtype_name(dtype: Any) -> str:
    """A torch or numpy dtype (or its name) as numpy's name: ``float32``, ``int64``."""
    if isinstance(dtype, torch.dtype):
        return str(torch.empty((), dtype=dtype).numpy().dtype) if dtype != torch.bfloat16 else "bfloat16"
    return str(np.dtype(dtype))


class ORTTrainer(TrainerState):
    """``ORTTrainer(model, model_desc, optim_config, loss_fn=None, options=None)`` (see the module)."""

    def __init__(self, model: torch.nn.Module | onnx.ModelProto, model_desc: Any,
                 optim_config: _OptimizerConfig, loss_fn: Any = None,
                 options: ORTTrainerOptions | Mapping[str, Any] | None = None) -> None:
        if not isinstance(optim_config, _OptimizerConfig):
            raise ValueError("optim_config must be gradgraph.torch.optim.SGDConfig, AdamConfig or "
                             f"LambConfig; got {type(optim_config).__name__}")
        if options is None or isinstance(options, Mapping):
            options = ORTTrainerOptions(options)
        if not isinstance(options, ORTTrainerOptions):
            raise ValueError(f"options must be an ORTTrainerOptions (or its dict); got {type(options).__name__}")
        for path, off in _UNSUPPORTED.items():
            if _get(options, path) != off:
                what = ("the memory-efficient gradient builder is not implemented"
                        if path.startswith("utils") else "only data parallelism is implemented "
                        "(no horizontal or pipeline parallelism, no Adasum)")
                raise NotImplementedError(f"ORTTrainerOptions {path!r}={_get(options, path)!r}: {what}; "
                                          f"leave it at {off!r}")
        dist = options.distributed
        if dist.world_size > 1 and dist.data_parallel_size != dist.world_size and \
                options.was_set("distributed.data_parallel_size"):
            raise NotImplementedError(f"ORTTrainerOptions 'distributed.data_parallel_size'="
                                      f"{dist.data_parallel_size} with world_size {dist.world_size}: "
                                      "only data parallelism is implemented (set them equal)")
        if dist.world_rank >= dist.world_size:
            raise ValueError(f"ORTTrainerOptions 'distributed.world_rank'={dist.world_rank} must be < "
                             f"'distributed.world_size'={dist.world_size}")
        self.model_desc = ModelDescription.parse(model_desc)
        self.optim_config = optim_config
        self.options = options
        self.loss_fn = loss_fn
        self._train_step_info = TrainStepInfo(optim_config)
        self._session: TrainingSession | None = None
        self._onnx_model: onnx.ModelProto | None = None
        self._pending: Callable[[], None] | None = None  # a state load waiting for the session
        self._static_dims: dict[str, dict[int, int]] = {}
        self._input_sizes: dict[str, int] = {}  # symbolic dimension -> its size in the last feeds
        self._torch_names: dict[str, str] = {}  # ONNX weight name -> torch state_dict name
        # the norms whose num_batches_tracked a training step counts, for the session built
        self._counted: tuple[TrainingSession, list[Any]] | None = None
        self._providers, self._provider_options = self._device()
        if isinstance(model, onnx.ModelProto):
            if loss_fn is not None:
                raise ValueError("loss_fn applies to a torch.nn.Module; an ONNX model must compute "
                                 "its loss (flag that output is_loss=True in model_desc)")
            self._torch_model: torch.nn.Module | None = None
            self._build(self._check_onnx(model))
        elif isinstance(model, torch.nn.Module):
            self._torch_model = model
        else:
            raise ValueError(f"model must be a torch.nn.Module or an onnx.ModelProto; got {type(model).__name__}")

    # ---- building ---------------------------------------------------------------------------
    def _device(self) -> tuple[list[Any], list[dict[str, Any]] | None]:
        device = self.options.device.id
        available = ort.get_available_providers()
        if device == "cpu" or (not self.options.was_set("device.id") and
                               "CUDAExecutionProvider" not in available):
            self._check_provider_options("CPUExecutionProvider")
            return ["CPUExecutionProvider"], None
        if device == "cuda" or device.startswith("cuda:"):
            index = device.partition(":")[2] or "0"
            if not index.isdigit():
                raise ValueError(f"ORTTrainerOptions 'device.id'={device!r}: write 'cpu', 'cuda' or 'cuda:N'")
            local_rank = self.options.distributed.local_rank if self.options.was_set(
                "distributed.local_rank") else int(os.environ.get("LOCAL_RANK", "0"))
            several = self.options.distributed.world_size > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1
            opts: dict[str, Any] = {"device_id": local_rank if device == "cuda" and several else int(index)}
            if self.options.device.mem_limit:
                opts["gpu_mem_limit"] = self.options.device.mem_limit
            opts.update(self.options.provider_options.get("CUDAExecutionProvider", {}))
            self._check_provider_options("CUDAExecutionProvider")
            return ["CUDAExecutionProvider", "CPUExecutionProvider"], [opts, {}]
        raise ValueError(f"ORTTrainerOptions 'device.id'={device!r}: write 'cpu', 'cuda' or 'cuda:N'")

    def _check_provider_options(self, used: str) -> None:
        """``provider_options`` apply to the provider the device uses (CUDA's are passed on);
        onnxruntime's CPU provider takes none (it drops them unread), another provider's would
        never be read: refused, named."""
        for provider, values in self.options.provider_options.items():
            where = f"ORTTrainerOptions 'provider_options.{provider}'"
            if provider == "CPUExecutionProvider" and values:
                raise ValueError(f"{where}={values!r}: onnxruntime's CPU provider takes no provider "
                                 "options (it ignores them); set threads and the memory arena through "
                                 "'session_options' (an onnxruntime.SessionOptions)")
            if provider not in (used, "CPUExecutionProvider"):
                raise ValueError(f"{where}: device.id={self.options.device.id!r} runs on {used}; "
                                 f"options of {provider} would not be used (remove them, or set device.id)")

    def _check_onnx(self, model: onnx.ModelProto) -> onnx.ModelProto:
        inits = {i.name for i in model.graph.initializer}
        graph_inputs = [i.name for i in model.graph.input if i.name not in inits]
        wanted = [i.name for i in self.model_desc.inputs]
        if graph_inputs != wanted:
            raise ValueError(f"model_desc inputs {wanted} must match the ONNX model's inputs in name "
                             f"and order: {graph_inputs}")
        outputs = [o.name for o in model.graph.output]
        missing = [o.name for o in self.model_desc.outputs if o.name not in outputs]
        if missing:
            raise ValueError(f"model_desc outputs {missing} are not outputs of the ONNX model "
                             f"(it has {outputs})")
        order = sorted(self.model_desc.outputs, key=lambda o: outputs.index(o.name))
        if order != self.model_desc.outputs:
            raise ValueError(f"model_desc outputs {[o.name for o in self.model_desc.outputs]} must be in "
                             f"the ONNX model's order: {[o.name for o in order]}")
        declared = {o.name: o.type.tensor_type for o in model.graph.output}
        self._check_output_shapes([
            [d.dim_value if d.HasField("dim_value") else None for d in declared[o.name].shape.dim]
            if declared[o.name].HasField("shape") else None for o in self.model_desc.outputs],
            "the ONNX model declares", {})
        self._torch_names = {n: n for n in inits}
        return model

    def _check_output_shapes(self, shapes: Sequence[Sequence[int | None] | None], source: str,
                             sizes: Mapping[str, int]) -> None:
        """Each model_desc output against the shape ``source`` gives (None: unknown): its rank,
        its fixed dimensions, and a symbolic one against the size the inputs give that name."""
        for desc, shape in zip(self.model_desc.outputs, shapes):
            if shape is None:
                continue
            problem = f"rank {len(shape)}" if len(shape) != len(desc.shape) else next((
                f"axis {axis} is {got}" + (f" where the inputs give {want!r} = {sizes[want]}"
                                           if isinstance(want, str) else "")
                for axis, (got, want) in enumerate(zip(shape, desc.shape))
                if got is not None and (got != want if isinstance(want, int) else
                                        want in sizes and sizes[want] != got)), None)
            if problem:
                shown = [d if d is not None else "?" for d in shape]
                raise ValueError(f"model_desc output {desc.name!r} has shape {desc.shape}, but {source} "
                                 f"{shown} ({problem}); describe the output as the model computes it")

    def _check_output_names(self, exported: ExportedCall) -> None:
        """A model that returns named outputs (a dict, a HuggingFace ModelOutput): a model_desc
        output named after one of them must sit at its position."""
        if not exported.reference_outputs:
            return
        paths = torch.utils._pytree.tree_flatten_with_path(exported.rebuild(exported.reference_outputs))[0]
        keys = [getattr(path[-1], "key", None) if path else None for path, _ in paths]
        for i, desc in enumerate(self.model_desc.outputs):
            if desc.name in keys and keys.index(desc.name) != i:
                raise ValueError(f"model_desc output {desc.name!r} is listed at position {i}, but the "
                                 f"model returns {desc.name!r} at position {keys.index(desc.name)} (its "
                                 f"outputs in order: {keys}); list model_desc's outputs in that order")

    def _export(self, tensors: list[torch.Tensor]) -> onnx.ModelProto:
        assert self._torch_model is not None
        module = self._torch_model if self.loss_fn is None else _WithLoss(self._torch_model, self.loss_fn)
        dynamic = [{axis: d for axis, d in enumerate(desc.shape) if isinstance(d, str)}
                   for desc in self.model_desc.inputs]
        cumulative = [path for path, m in self._torch_model.named_modules()
                      if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training
                      and m.track_running_stats and m.momentum is None]
        if cumulative:  # the exporter freezes 1 / num_batches_tracked (a data-dependent value)
            raise NotImplementedError(f"ORTTrainer: BatchNorm {cumulative[0]!r} has momentum=None (a "
                                      "cumulative average over num_batches_tracked), which the training "
                                      "graph cannot follow; give it a momentum (torch's default is 0.1)")
        opset = self.options._internal_use.onnx_opset_version
        # torch's dynamo exporter writes opset 18 and above (below, its conversion may keep 18):
        # an older opset is the TorchScript exporter's, which writes it as asked
        exported = export_call(module, tuple(tensors), {}, training=True, opset=opset, dynamic=dynamic,
                               stop_gradients=True, exporter="legacy" if opset < 18 else "auto")
        wrote = next((o.version for o in exported.model.opset_import if o.domain in ("", "ai.onnx")), opset)
        if wrote != opset:
            warnings.warn(f"ORTTrainerOptions '_internal_use.onnx_opset_version'={opset}: the {exported.exporter} "
                          f"exporter wrote opset {wrote}; the training graph uses opset {wrote}",
                          UserWarning, stacklevel=4)
        return self._rename(exported)

    def _rename(self, exported: ExportedCall) -> onnx.ModelProto:
        """Inputs and outputs under model_desc's names, weights under the module's own names."""
        descs = self.model_desc
        if len(exported.output_names) != len(descs.outputs):
            combined = " (with loss_fn: the loss, then the model's outputs)" if self.loss_fn else ""
            raise ValueError(f"model_desc lists {len(descs.outputs)} outputs but the model returns "
                             f"{len(exported.output_names)} tensors{combined}; list one per tensor, in order")
        self._check_output_names(exported)
        self._check_output_shapes([list(t.shape) for t in exported.reference_outputs], "the model returns",
                                  self._input_sizes)
        model = ir.from_proto(exported.model)
        values = {v.name: v for v in model.graph.inputs}
        values.update({v.name: v for v in model.graph.outputs})
        renames = dict(zip(exported.input_names, (d.name for d in descs.inputs)))
        renames.update(zip(exported.output_names, (d.name for d in descs.outputs)))
        prefix = "module." + ("model." if self.loss_fn is not None else "")
        torch_names: dict[str, str] = {}
        inits = list(model.graph.initializers.values())
        paths = {**exported.parameters, **exported.buffers}
        for init in inits:
            old = init.name or ""
            path = paths.get(old)
            if path is None:
                continue
            new = old[len(prefix):] if old.startswith(prefix) else old.removeprefix("module.")
            renames[old] = new
            torch_names[new] = path[len("model."):] if prefix.endswith("model.") and \
                path.startswith("model.") else path
            values[old] = init
        model.graph.initializers.clear()
        for old, new in renames.items():
            values[old].name = new
        for init in inits:
            model.graph.register_initializer(init)
        for value, desc in zip(model.graph.inputs, descs.inputs):
            self._name_dims(value, desc)
        self._torch_names = torch_names
        return ir.to_proto(model)

    def _name_dims(self, value: ir.Value, desc: IODescription) -> None:
        """Symbolic input dimensions under model_desc's names; record those the export fixed."""
        if value.shape is None:
            return
        dims = list(value.shape)
        fixed = {}
        for axis, want in enumerate(desc.shape):
            if axis >= len(dims):
                break
            dim = dims[axis]
            if isinstance(want, str) and isinstance(dim, int):
                fixed[axis] = dim
            elif isinstance(want, str):
                dims[axis] = ir.SymbolicDim(want)
        value.shape = ir.Shape(dims)
        if fixed:
            self._static_dims[desc.name] = fixed

    def _optimizer_for(self, weights: Sequence[str]) -> _OptimizerConfig:
        """The optimizer config of the trained ``weights`` (the legacy trainer's per-weight
        attribute map makes its own, see :mod:`gradgraph.torch.ort_trainer`)."""
        return self.optim_config

    def _config(self) -> TrainingConfig:
        opts = self.options
        trained = [n for n in self._torch_names if n in self._parameter_names()]
        aliases = self._aliases(trained)
        known = [*trained, *aliases]
        self._check_names("utils.frozen_weights", list(opts.utils.frozen_weights), known)
        frozen = [aliases.get(n, n) for n in opts.utils.frozen_weights]
        cfg = self.optim_config = self._optimizer_for([n for n in trained if n not in frozen])
        for i, group in enumerate(cfg.params):
            self._check_names(f"optim_config params[{i}]['params']", group["params"], known)
        gt = opts.graph_transformer
        recompute = None
        if gt.attn_dropout_recompute or gt.gelu_recompute or gt.transformer_layer_recompute:
            from passes.recompute import RecomputeOptions

            recompute = RecomputeOptions(gelu=gt.gelu_recompute, attn_dropout=gt.attn_dropout_recompute,
                                         transformer_layers=gt.transformer_layer_recompute,
                                         number_recompute_layers=gt.number_recompute_layers)
        cast = gt.propagate_cast_ops_config
        mp = MixedPrecisionConfig()
        if opts.mixed_precision.enabled:
            scaler = opts.mixed_precision.loss_scaler
            mp = MixedPrecisionConfig(dtype="float16", **({"loss_scaler": scaler.settings()} if scaler else {}))
        clip = opts.utils.grad_norm_clip and cfg.clips
        paths = opts.debug.graph_save_paths
        return TrainingConfig(
            loss=self.model_desc.loss,
            optimizer=cfg.to_pass_config(),
            weights_to_train=tuple(n for n in trained if n not in frozen),
            weights_not_to_train=tuple(frozen),
            update=UpdateOptions(groups=cfg.param_groups(aliases),
                                 accumulation_steps=opts.batch.gradient_accumulation_steps,
                                 max_grad_norm=float(cfg.max_norm_clip) if clip else None),  # type: ignore[attr-defined]
            graph_transformer=GraphTransformerOptions(
                cleanup=opts._internal_use.enable_internal_postprocess,
                contrib_ops=opts._internal_use.enable_onnx_contrib_ops,
                # the schema's default level 1 applies with mixed precision (a float32 graph has no
                # casts to move); a level the user gives applies as given
                propagate_cast_ops=CastPropagationConfig(cast.strategy, cast.level if (
                    opts.mixed_precision.enabled or opts.was_set("graph_transformer.propagate_cast_ops_config"))
                    else -1, tuple(cast.allow)),
                recompute=recompute),
            mixed_precision=mp,
            debug=DebugOptions(GraphSavePaths(
                paths.model_after_graph_transforms_path, paths.model_with_gradient_graph_path,
                paths.model_with_training_graph_path,
                paths.model_with_training_graph_after_optimization_path)))

    def _distributed(self) -> Any:
        """The data-parallel config: the options' ``distributed`` group, or torchrun's
        environment (``WORLD_SIZE``, ``RANK``) when the options leave world_size unset."""
        from gradgraph.training.distributed import DistributedConfig

        dist, opts = self.options.distributed, self.options
        common = {"zero_stage": dist.deepspeed_zero_optimization.stage,
                  "allreduce_post_accumulation": dist.allreduce_post_accumulation}
        if opts.was_set("distributed.world_size"):
            config = DistributedConfig(world_size=dist.world_size, rank=dist.world_rank, **common)
        else:
            config = DistributedConfig.from_env(**common)
        if not config.active and (config.zero_stage or opts.was_set("distributed.allreduce_post_accumulation")):
            warnings.warn("ORTTrainerOptions 'distributed.deepspeed_zero_optimization.stage' / "
                          "'distributed.allreduce_post_accumulation' change nothing in a single "
                          "process (world size 1)", UserWarning, stacklevel=3)
        return config if config.active else None

    def _frozen_graph_names(self) -> set[str]:
        """``utils.frozen_weights`` under the graph's names (a tied weight's other name mapped)."""
        frozen = list(self.options.utils.frozen_weights)
        if self._torch_model is None:
            return set(frozen)
        aliases = self._aliases(list(self._torch_names))
        return {aliases.get(n, n) for n in frozen}

    def _aliases(self, trained: Sequence[str]) -> dict[str, str]:
        """The other names of a tied weight (``out.weight = emb.weight``: torch's
        ``named_parameters`` says ``emb.weight``, the graph may hold ``out.weight``) -> the
        name the graph trains it under."""
        if self._torch_model is None:
            return {}
        names_of = _names_by_tensor(self._torch_model.named_parameters(remove_duplicate=False))
        graph_names = set(trained)
        aliases = {}
        for names in names_of.values():
            held = [n for n in names if n in graph_names]
            if len(held) == 1:
                aliases.update({n: held[0] for n in names if n != held[0]})
        return aliases

    def _parameter_names(self) -> set[str]:
        if self._torch_model is None:  # an ONNX model: every float initializer
            assert self._onnx_model is not None
            return {i.name for i in self._onnx_model.graph.initializer
                    if i.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                                       onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)}
        return {n for n, _ in self._torch_model.named_parameters(remove_duplicate=False)} | {
            f"loss_fn.{n}" for n, _ in getattr(self.loss_fn, "named_parameters", lambda: [])()}

    @staticmethod
    def _check_names(what: str, names: Sequence[str], known: Sequence[str]) -> None:
        for name in names:
            if name not in known:
                raise ValueError(f"{what}: {name!r} is not a trained weight of the model"
                                 f"{close_matches(name, known)}; its weights: {sorted(known)[:8]}"
                                 f"{' ...' if len(known) > 8 else ''}")

    def _build(self, model: onnx.ModelProto) -> None:
        extra = self.options._internal_use.extra_postprocess
        if extra is not None:
            model = extra(model)
            if not isinstance(model, onnx.ModelProto):
                raise ValueError("ORTTrainerOptions '_internal_use.extra_postprocess' must return an "
                                 f"onnx.ModelProto; it returned {type(model).__name__}")
        self._onnx_model = model
        sess_options = self.options.session_options
        if self.options.debug.deterministic_compute:
            from gradgraph.training.ort_state import copy_session_options

            sess_options = copy_session_options(sess_options)
            sess_options.use_deterministic_compute = True
        distributed = self._distributed()
        self._session = TrainingSession(model, self._config(), sess_options, self._providers,
                                        self._provider_options, distributed=distributed)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending()

    def _ensure(self, feeds: dict[str, np.ndarray], tensors: list[torch.Tensor]) -> TrainingSession:
        if self._session is None:
            self._build(self._export(tensors))
            if self.options.debug.check_model_export:
                self._check_export(feeds, tensors)
        else:
            self._check_static_dims(feeds)
        assert self._session is not None
        return self._session

    def _check_static_dims(self, feeds: Mapping[str, np.ndarray]) -> None:
        for name, fixed in self._static_dims.items():
            for axis, size in fixed.items():
                if feeds[name].shape[axis] != size:
                    raise ValueError(f"input {name!r} axis {axis} is symbolic in model_desc but the "
                                     f"exporter fixed it to {size} (the model's code specializes "
                                     f"it); feed size {size}, or make the model's code shape-generic")

    def _check_export(self, feeds: dict[str, np.ndarray], tensors: list[torch.Tensor]) -> None:
        """``debug.check_model_export``: torch (eval, no grad) against the ONNX eval graph."""
        assert self._torch_model is not None and self._session is not None
        module = self._torch_model if self.loss_fn is None else _WithLoss(self._torch_model, self.loss_fn)
        modes = [(m, m.training) for m in module.modules()]  # each submodule's, not one for all
        module.eval()
        try:
            with torch.no_grad():
                expected = torch.utils._pytree.tree_leaves(module(*tensors))
        finally:
            for m, mode in modes:
                m.training = mode
        got = self._session.eval_step(feeds, [o.name for o in self.model_desc.outputs])
        for desc, want in zip(self.model_desc.outputs, expected):
            mine = got[desc.name]
            ref = want.detach().cpu().numpy()
            if mine.shape != ref.shape or not np.allclose(mine, ref, rtol=1e-3, atol=1e-5):
                diff = float(np.max(np.abs(mine - ref))) if mine.shape == ref.shape else math.nan
                raise RuntimeError(f"debug.check_model_export: output {desc.name!r} of the exported "
                                   f"model differs from PyTorch's (max abs diff {diff:g}, shapes "
                                   f"{list(mine.shape)} vs {list(ref.shape)})")

    # ---- steps ------------------------------------------------------------------------------
    def _feeds(self, args: tuple, kwargs: dict) -> tuple[dict[str, np.ndarray], list[torch.Tensor]]:
        names = [d.name for d in self.model_desc.inputs]
        if len(args) > len(names):
            raise ValueError(f"{len(args)} inputs given; model_desc has {len(names)}: {names}")
        given = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names:
                raise ValueError(f"input {key!r} is not in model_desc{close_matches(key, names)}; inputs: {names}")
            if key in given:
                raise ValueError(f"input {key!r} given twice (by position and by name)")
            given[key] = value
        missing = [n for n in names if n not in given]
        if missing:
            raise ValueError(f"inputs {missing} are missing (model_desc inputs: {names})")
        tensors = [given[n] if isinstance(given[n], torch.Tensor) else torch.as_tensor(np.asarray(given[n]))
                   for n in names]
        sizes: dict[str, tuple[str, int]] = {}  # a symbolic dimension's size, and who set it
        for desc, t in zip(self.model_desc.inputs, tensors):
            got = list(t.shape)
            if len(got) != len(desc.shape):
                raise ValueError(f"input {desc.name!r} has shape {got} (rank {len(got)}); model_desc "
                                 f"says {desc.shape} (rank {len(desc.shape)})")
            for axis, (n, dim) in enumerate(zip(got, desc.shape)):
                if isinstance(dim, str):
                    first = sizes.setdefault(dim, (desc.name, n))
                    if first[1] != n:
                        raise ValueError(f"input {desc.name!r} has {dim!r} = {n} (axis {axis}) but input "
                                         f"{first[0]!r} has {dim!r} = {first[1]}: model_desc names one size")
                elif n != dim:
                    raise ValueError(f"input {desc.name!r} has shape {got}; model_desc says {desc.shape} "
                                     f"(axis {axis} must be {dim})")
            if desc.dtype is not None and _dtype_name(t.dtype) != _dtype_name(desc.dtype):
                raise ValueError(f"input {desc.name!r} has dtype {_dtype_name(t.dtype)}; model_desc says "
                                 f"{_dtype_name(desc.dtype)}")
        self._input_sizes = {dim: n for dim, (_, n) in sizes.items()}
        feeds = {n: t.detach().cpu().numpy() for n, t in zip(names, tensors)}
        return feeds, tensors

    def _results(self, out: Mapping[str, np.ndarray]) -> Any:
        results = [torch.from_numpy(np.array(out[o.name])) for o in self.model_desc.outputs]
        return results[0] if len(results) == 1 else results

    def train_step(self, *args: Any, **kwargs: Any) -> Any:
        """One step (a micro-step with accumulation); returns model_desc's outputs (one: itself)."""
        return self._results(self._train(args, kwargs))

    def _train(self, args: tuple, kwargs: dict, lr: float | None = None,
               before: Callable[[TrainingSession], None] | None = None) -> dict[str, np.ndarray]:
        """One micro-step at ``lr`` (None: the scheduler's, else the config's); ``before`` sees
        the session first. Returns every model_desc output by name."""
        feeds, tensors = self._feeds(args, kwargs)
        session = self._ensure(feeds, tensors)
        info = self._train_step_info
        if lr is None:
            scheduler = self.options.lr_scheduler
            lr = scheduler._step(info)[0] if scheduler is not None else self.optim_config.lr
        if before is not None:
            before(session)
        loss = self.model_desc.loss
        _, out = session.train_step(feeds, lr, fetches=[o.name for o in self.model_desc.outputs])
        self._count_batches()
        info.step += 1
        if session.micro_step == 0:
            info.optimization_step += 1
            info.all_finite = session.last_step_finite
            if not info.all_finite and not self.options.mixed_precision.enabled:
                warnings.warn(f"ORTTrainer: step {info.step}: the loss, gradients or updated weights "
                              f"are not finite (loss {float(np.asarray(out[loss]).reshape(-1)[0])}); "
                              "the update was skipped", RuntimeWarning, stacklevel=3)
        return out

    def _count_batches(self) -> None:
        """``num_batches_tracked`` of the module's BatchNorms, one more per training forward as
        torch counts it: the graph updates the running statistics, this integer it does not hold
        (``state_dict(pytorch_format=True)`` reads it from the module). Counted: the norms whose
        running mean the training graph updates (a frozen eval-mode BatchNorm, or one the
        forward never calls, is not, as in torch)."""
        if self._torch_model is None or self._session is None:
            return
        if self._counted is None or self._counted[0] is not self._session:  # once per built session
            updated = {self._torch_names.get(n, n) for n in self._session.artifacts.buffers}
            self._counted = (self._session, [m for path, m in self._norms().items() if m.track_running_stats
                                             and (f"{path}.running_mean" if path else "running_mean") in updated])
        for module in self._counted[1]:
            module.num_batches_tracked.add_(1)

    def _norms(self) -> dict[str, Any]:
        if self._torch_model is None:
            return {}
        return {name: m for name, m in self._torch_model.named_modules()
                if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.num_batches_tracked is not None}

    def _batches_tracked(self) -> dict[str, int]:
        return {name: int(m.num_batches_tracked) for name, m in self._norms().items()}

    def _set_batches_tracked(self, counts: Mapping[str, Any]) -> None:
        norms = self._norms()
        for name, count in counts.items() if isinstance(counts, Mapping) else ():
            if name in norms and isinstance(count, int):
                norms[name].num_batches_tracked.fill_(count)

    def eval_step(self, *args: Any, **kwargs: Any) -> Any:
        """The eval graph (dropout off, BatchNorm inference) on the current weights."""
        return self._results(self._eval(args, kwargs))

    def _eval(self, args: tuple, kwargs: dict) -> dict[str, np.ndarray]:
        feeds, tensors = self._feeds(args, kwargs)
        session = self._ensure(feeds, tensors)
        return session.eval_step(feeds, [o.name for o in self.model_desc.outputs])
