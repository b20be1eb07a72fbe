"""One call signature's graphs: export, the pass pipeline to a forward and a backward
onnxruntime session (:class:`_Engine`), and the checks around it (hooks, training BatchNorms,
one device, the first run against PyTorch)."""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import onnxscript.optimizer
import torch

from gradgraph.dropout_noise import DropoutNoise
from gradgraph.runtime.compat import inference_session
from gradgraph.torch.export import ExportedCall, ExportFailed
from gradgraph.torch.index_guard import IndexGuard
from gradgraph.torch.runner import GraphRunner, _to_torch, device_rewrites, make_session
from gradgraph.torch.signature import _named_tensors
from passes.cleanup import RANDOM_OPS
from passes.forward.distinct_outputs import DistinctOutputsPass
from passes.forward.params_to_inputs import ParamsToInputsPass
from passes.forward.prepare import PrepareForGradientPass
from passes.forward.random_seeds import SeedRandomOpsPass
from passes.kernels import (
    DropoutNoisePass,
    GeluFusionPass,
    ValidRowsLossPass,
    WholeScoresLossPass,
    noise_inputs,
)
from passes.kernels.random_inputs import RandomInputsPass, random_inputs

if TYPE_CHECKING:
    from gradgraph.torch.ortmodule import ORTModule

logger = logging.getLogger("gradgraph.torch")
_TORCH_FLOATS: dict[type, torch.dtype] = {np.float32: torch.float32, np.float64: torch.float64}


class OutputMismatch(RuntimeError):
    """The graph's first outputs differ from the module's in PyTorch."""



def _torch_seed() -> int:
    """A seed from torch's default generator (``torch.manual_seed`` repeats it)."""
    return int(torch.randint(0, 2**62, (1,)).item())


def _draws_random_numbers(model: ir.Model) -> bool:
    """Does the graph draw random numbers (a training Dropout, a random op)?"""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type in RANDOM_OPS or (node.op_type == "Dropout" and len(node.inputs) >= 3
                                          and node.inputs[2] is not None):
            return True
    return False


def _optimized(model: ir.Model) -> ir.Model:
    """onnxscript's optimizer on ``model``, or ``model`` as it was where the result is not a
    valid ONNX model (seen on TorchScript exports of T5: a Reshape reading a shape no node makes)."""
    before = ir.to_proto(model)
    # onnx_ir's passes log warnings through the logging module (the initializer deduplication:
    # "Skipped deduplication of initializer ... as it is a graph input or output", for a
    # constant the module returns): facts about a graph the user never wrote, not printed
    quiet = logging.getLogger("onnx_ir")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with np.errstate(all="ignore"):  # constant folding of log(0) and the like (T5's buckets)
            result = onnxscript.optimizer.optimize(model)
        onnx.checker.check_model(ir.to_proto(result))
        return result
    except Exception as exc:  # noqa: BLE001 - the unoptimized graph is still right
        logger.info("ORTModule: onnxscript's optimizer gave an invalid graph (%s); its input is used",
                    str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return ir.from_proto(before)
    finally:
        quiet.setLevel(level)


def _tf32(device: torch.device) -> bool:
    """May torch's or onnxruntime's float32 products on ``device`` round to TF32?"""
    return device.type == "cuda" and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)


def _mismatch(outs: tuple, reference: list[torch.Tensor], names: list[str] | None = None) -> str | None:
    """Where the graph's first outputs differ from PyTorch's beyond float32 reassociation, else None."""
    for k, (got, want) in enumerate(zip(outs, reference)):
        what = names[k] if names else f"output {k}"
        if tuple(got.shape) != tuple(want.shape):
            return f"{what}: shape {tuple(got.shape)} against PyTorch's {tuple(want.shape)}"
        if not want.is_floating_point() or not want.numel():
            continue
        tol = 1e-2 if want.dtype in (torch.float16, torch.bfloat16) or _tf32(want.device) else 1e-3
        a, b = got.detach().double(), want.double()
        scale = max(1.0, float(b[torch.isfinite(b)].abs().max()) if torch.isfinite(b).any() else 1.0)
        if not torch.allclose(a, b, rtol=tol, atol=tol * 0.1 * scale, equal_nan=True):
            diff = (a - b).abs().nan_to_num(float("inf"))
            return f"{what}: max abs difference {float(diff.max()):.3g} (PyTorch's max |value| {scale:.3g})"
    return None



def _training_batch_norms(module: torch.nn.Module) -> list[torch.nn.modules.batchnorm._BatchNorm]:
    """The BatchNorms that update running statistics in this call; refuses ``momentum=None``."""
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             and m.training and m.track_running_stats]
    cumulative = [type(m).__name__ for m in norms if m.momentum is None]
    if cumulative:
        raise NotImplementedError(f"{cumulative[0]} with momentum=None (a cumulative average of the "
                                  "batch statistics) is not supported; set a momentum")
    return norms


class BackwardHooks(RuntimeError):
    """The module has backward hooks, which onnxruntime's backward cannot call."""


def _hooked(module: torch.nn.Module, kinds: tuple[str, ...]) -> list[str]:
    """Paths of the submodules (``.`` the module itself) with hooks of ``kinds``, and
    ``(global)`` for torch's global module hooks of those kinds."""
    found = [path or "." for path, m in module.named_modules() if any(getattr(m, k, None) for k in kinds)]
    from torch.nn.modules import module as torch_module
    if any(getattr(torch_module, f"_global{k}", None) for k in kinds):
        found.append("(global)")
    return found


def _check_hooks(module: torch.nn.Module, training: bool, warned: set[str]) -> None:
    """Backward hooks refuse a training build (raise :class:`BackwardHooks`); forward hooks
    warn once: they run while exporting (their effect on values is in the graph) and not after."""
    if training:
        backward = _hooked(module, ("_backward_hooks", "_backward_pre_hooks"))
        if backward:
            raise BackwardHooks(f"backward hooks (register_full_backward_hook) on {', '.join(backward[:5])}: "
                                "the backward runs in onnxruntime and cannot call them")
    forward = [p for p in _hooked(module, ("_forward_hooks", "_forward_pre_hooks")) if p not in warned]
    if forward:
        warned.update(forward)
        warnings.warn(f"ORTModule: forward hooks on {', '.join(forward[:5])} of {type(module).__name__} ran "
                      "while exporting (what they change in the values is part of the graph) and are "
                      "not called on later calls; register hooks on the ORTModule itself to have them "
                      "called on every call", UserWarning, stacklevel=6)



def _one_device(inputs: list[torch.Tensor], named: dict[str, torch.Tensor]) -> torch.device:
    """The one device of the call's tensors and the module's parameters and buffers; raises
    naming them where they are on several."""
    where: dict[torch.device, str] = {}
    for k, t in enumerate(inputs):
        where.setdefault(t.device, f"input tensor {k}")
    for path, t in named.items():
        where.setdefault(t.device, f"{'parameter' if isinstance(t, torch.nn.Parameter) else 'buffer'} {path!r}")
    if len(where) > 1:
        raise RuntimeError("the call's tensors and the module's weights are on several devices ("
                           + ", ".join(f"{what} on {d}" for d, what in where.items())
                           + "): onnxruntime computes a call on one device; move them to one")
    return next(iter(where), torch.device("cpu"))


class _Engine:
    """The sessions of one call signature (module docstring)."""

    def __init__(self, owner: ORTModule, exported: ExportedCall, tensor_inputs: list[torch.Tensor],
                 training: bool, train_norms: list[torch.nn.modules.batchnorm._BatchNorm],
                 device: torch.device) -> None:
        module = owner.module
        self.device = device  # where the call's tensors are and the sessions compute
        self.exported = exported
        # the call's index inputs, checked before onnxruntime runs (index_guard.py)
        self.index_guard = IndexGuard(exported.model)
        named = _named_tensors(module)
        self.weights = {**exported.parameters, **exported.buffers}  # onnx name -> torch path
        model = ir.from_proto(exported.model)
        n_user = exported.n_outputs
        # after the module's own outputs: the new values of the buffers its forward updates in
        # place (export.py, trap 4), written back after each call
        n_changed = len(exported.mutations) + len(exported.input_mutations)
        del model.graph.outputs[n_user + n_changed:]
        # Parameters and buffers become inputs first: then onnxscript's optimizer (constant
        # folding, rewrite rules; what the exporter's optimize=True runs) cannot fold them.
        ParamsToInputsPass(list(self.weights))(model)
        # a tensor returned twice, or an input or parameter returned as is: each output its own
        # value (a seed each; torch sums their gradients). Before the optimizer, which would
        # otherwise rename such an input (``input_0_orig``) to keep the output's name.
        DistinctOutputsPass()(model)
        # each random node its own seed, from torch's generator: the optimizer's common-
        # subexpression elimination merged two Dropouts of one tensor (SimCSE's two views)
        SeedRandomOpsPass(_torch_seed())(model)
        # random ops read draws torch makes on every call (passes/kernels/random_inputs.py):
        # torch.manual_seed repeats them, as it repeats torch's own; before the optimizer,
        # which would fold a random op of a constant (bernoulli(full_like(x, p))) into one draw
        draws_inputs = RandomInputsPass()(model).modified
        if owner._optimize:
            model = _optimized(model)
        # inline functions, fold shape constants, expose Dropout masks, infer types and shapes
        PrepareForGradientPass(strict_parameters=False)(model)
        GeluFusionPass()(model)  # an exported GELU formula as one Gelu node
        WholeScoresLossPass()(model)  # a loss over sliced logits: no copy of them, no Pad
        ValidRowsLossPass()(model)  # the rows the loss ignores are not computed
        for rewrite in device_rewrites(device):  # what the device's kernels lack
            rewrite(model)
        DistinctOutputsPass()(model)  # again: the optimizer may merge equal outputs
        self.user_outputs = [o.name or "" for o in model.graph.outputs[:n_user]]
        # PyTorch's outputs of the probe run, compared with the graph's first run (trap 5 of
        # export.py); not where the graph draws random numbers (Dropout masks differ)
        random = draws_inputs or _draws_random_numbers(model)
        # training Dropouts read their noise, drawn here faster than onnxruntime's CPU kernel
        # draws it (passes/kernels/dropout_noise.py), from a seed torch's generator gives
        DropoutNoisePass()(model)
        self.noise = DropoutNoise(noise_inputs(model.graph), owner._threads or torch.get_num_threads())
        RandomInputsPass()(model)  # those whose shapes are known only now
        self.draws = random_inputs(model.graph)
        self.reference: list[torch.Tensor] | None = None if random else exported.reference_outputs
        # and the buffers it updated: an exporter may drop an update (InstanceNorm's running
        # statistics: torch 2.13's InstanceNormalization has none)
        self.reference_buffers: dict[str, torch.Tensor] = (
            {} if random else dict(zip(exported.mutations, exported.reference_mutations)))
        exported.reference_outputs, exported.reference_mutations = [], []  # until the first run only
        self.mutation_outputs = {o.name or "": path for o, path in
                                 zip(model.graph.outputs[n_user:], exported.mutations)}
        # the new values of the inputs the forward changes in place (export.py, trap 11): copied
        # into the caller's tensors after each call, as torch leaves them
        self.input_outputs = {o.name or "": k for o, k in zip(
            model.graph.outputs[n_user + len(exported.mutations):], exported.input_mutations)}
        self.changed_inputs = frozenset(exported.input_mutations)
        debug = owner._debug
        debug.save(exported.model, "torch_exported", training)
        debug.save(model, "optimized_pre_grad", training)
        graph_outputs = {o.name for o in model.graph.outputs}
        self.stat_outputs = {n: f"{n}.out" for n in exported.buffers if f"{n}.out" in graph_outputs}
        self.batch_norms = train_norms if self.stat_outputs else []
        self.input_names = list(exported.input_names)
        grad_weights = [n for n, path in exported.parameters.items() if named[path].requires_grad]
        grad_inputs = [n for n, t in zip(self.input_names, tensor_inputs)
                       if t.requires_grad and t.is_floating_point()]
        self.first_run = True  # ORTModule._first_run checks it against PyTorch
        # the signature once the forward's side effects are applied (ORTModule._first_run)
        self.resign: Any = None
        try:
            self.runner = GraphRunner(model, self.input_names + list(self.weights) + list(self.draws)
                                      + list(self.noise.inputs),
                                      grad_inputs + grad_weights,
                                      self.user_outputs, training=training,
                                      make_session=lambda m: make_session(m, owner._threads, debug.ort_severity,
                                                                      device),
                                      save=lambda m, stage: debug.save(m, stage, training),
                                      state_names=self.weights)
        except Exception as exc:
            explained = self.explain(exc, tensor_inputs)
            if explained is exc:
                raise
            raise explained from exc
        self.runner.detached = frozenset(
            name for name, requires in zip(self.user_outputs, exported.output_requires_grad) if not requires)

    def explain(self, exc: Exception, tensor_inputs: list[torch.Tensor]) -> Exception:
        """``exc`` (building or first running the graphs failed), or, where the exporter's own
        graph already fails in onnxruntime's CPU provider on these inputs, an
        :class:`ExportFailed` saying so: the cause is the export (a dropped parameter, a wrong
        shape), not the gradient. Inputs numpy cannot hold (bfloat16), and a kernel the CPU
        provider lacks (float16 ops), say nothing about the export: ``exc`` stays."""
        try:
            feeds = {n: t.detach().cpu().numpy() for n, t in zip(self.input_names, tensor_inputs)}
        except (TypeError, RuntimeError):
            return exc
        try:
            quiet = ort.SessionOptions()
            quiet.log_severity_level = 4  # its failure is reported here, not logged
            session = inference_session(self.exported.model, quiet, providers=["CPUExecutionProvider"])
            names = {i.name for i in session.get_inputs()}
            session.run(None, {n: a for n, a in feeds.items() if n in names})
        except Exception as broken:  # noqa: BLE001 - onnxruntime raises several types
            first = str(broken).strip().splitlines()[0] if str(broken).strip() else type(broken).__name__
            if "Could not find an implementation" in first or "NOT_IMPLEMENTED" in first:
                return exc
            return ExportFailed(f"the {self.exported.exporter} exporter's graph of this call already fails "
                                f"in onnxruntime, before any gradient ({first[:300]}): torch.onnx.export "
                                f"does not translate this module correctly")
        return exc

    def write_back(self, outputs: dict[str, ort.OrtValue], named: dict[str, torch.Tensor],
                   inputs: list[torch.Tensor]) -> None:
        """Buffers the forward updated (training BatchNorm's running statistics, exposed as
        ``<buffer>.out`` by PrepareForGradientPass, and the buffers the module's forward updates
        in place) are copied into the module's buffers, and each training BatchNorm counts the
        batch (``num_batches_tracked``) as torch does; the inputs the forward changes in place
        get their new values."""
        if not self.stat_outputs and not self.mutation_outputs and not self.input_outputs:
            return
        with torch.no_grad():
            for out, k in self.input_outputs.items():
                inputs[k].copy_(_to_torch(outputs[out], self.device))
            for out, path in self.mutation_outputs.items():
                named[path].copy_(_to_torch(outputs[out]))
            for onnx_name, out in self.stat_outputs.items():
                buffer = named[self.weights[onnx_name]]
                # torch's unbiased running variance: computed in the graph (TorchConventionsPass
                # marks torch's BatchNorms, ExposeRunningStatsPass corrects their update)
                buffer.copy_(_to_torch(outputs[out]))
            for bn in self.batch_norms:
                if bn.num_batches_tracked is not None:
                    bn.num_batches_tracked.add_(1)

    def tensors(self, inputs: list[torch.Tensor], named: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The runner's feeds: the call's tensors, then the module's weights as they are now
        (a parameter replaced since the build, by ``load_state_dict(assign=True)`` or an
        assignment, is the one read)."""
        # an input the forward changes in place is fed as a copy: the caller's tensor gets its
        # new value, the backward reads the one the forward read
        fed = [t.detach().clone() if k in self.changed_inputs else t for k, t in enumerate(inputs)]
        return (*fed, *(named[path] for path in self.weights.values()), *self.random_draws(),
                *self.dropout_noise())

    def random_draws(self) -> list[torch.Tensor]:
        """New draws for the graph's random ops, from torch's default generator (on the device)."""
        return [(torch.randn if d.kind == "normal" else torch.rand)(d.shape, dtype=_TORCH_FLOATS[d.dtype],
                                                                   device=self.device)
                for d in self.draws.values()]

    def dropout_noise(self) -> list[torch.Tensor]:
        """New noise for the graph's Dropouts (:mod:`gradgraph.dropout_noise`), from a seed
        torch's default generator gives, so that ``torch.manual_seed`` repeats it; on a GPU
        torch draws it there as its CPU dropout does (``bernoulli_(1 - p).div_(1 - p)``)."""
        if not self.noise:
            return []
        if self.device.type != "cpu":
            return [torch.empty(s.shape, dtype=_TORCH_FLOATS[s.dtype], device=self.device)
                    .bernoulli_(1.0 - s.ratio).div_(1.0 - s.ratio) for s in self.noise.inputs.values()]
        return [torch.from_numpy(a) for a in self.noise.draw(_torch_seed())]

