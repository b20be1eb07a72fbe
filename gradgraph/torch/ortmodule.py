"""ORTModule: run a ``torch.nn.Module``'s forward and backward as two onnxruntime graphs.

The first call with a new signature (input shapes, dtypes, which inputs need grad, train/eval)
exports the module (:mod:`gradgraph.torch.export`) and builds, with the pass layer:

1. parameters and buffers made graph inputs (``ParamsToInputsPass``): onnxruntime reads the
   torch tensors themselves each call, so a torch optimizer's in-place updates are seen; then
   onnxscript's optimizer (``optimize=True``, the default: what the exporter's own
   ``optimize=True`` runs, which can no longer fold parameters once they are inputs);
2. in train mode, :class:`passes.autodiff.vjp.VjpSeedPass` (one seed input per float output, the
   gradient torch hands to the backward) and the gradient w.r.t. every parameter and input that
   requires grad (``GradientPass``);
3. the graph split where its node marks say (:mod:`passes.split`): a forward session returns
   the outputs and the stash, a backward session takes the stash and the output gradients and
   returns the gradients.

A ``torch.autograd.Function`` runs the two sessions; tensors cross by DLPack (no copies on
CPU), the stash stays an onnxruntime value between the two. Parameters stay torch
Parameters: any torch optimizer, scheduler, ``clip_grad_norm_`` works unchanged. In eval mode
(or under ``torch.no_grad()``) only a forward graph is built and run.

A training-mode Dropout multiplies by noise fed as an input (``DropoutNoisePass``), drawn for
each call by :mod:`gradgraph.dropout_noise` on the CPU (onnxruntime's CPU kernel draws on one
thread) or by torch on a GPU, from a seed torch's default generator gives.

A train-mode BatchNorm computes with batch statistics and its running statistics are written
back to the module's buffers after each forward (torch's unbiased running variance, and
``num_batches_tracked``); a train-mode BatchNorm with ``momentum=None`` falls back to PyTorch.
In eval mode with grad enabled the graphs are built from the eval-mode export, so outputs
still carry gradients, as in torch. An input or parameter that no output's gradient reaches
keeps torch's ``None`` gradient (``GradientOptions(omit_unused=True)``). Attributes ORTModule
lacks are read from the wrapped module, and set there after construction. When the export or
the graph build fails, the signature runs in PyTorch with one warning naming the reason
(``fallback="raise"`` raises instead).

CUDA: a module and inputs on a CUDA device run on onnxruntime's CUDAExecutionProvider (the
``onnxruntime-gpu`` package; without it the signature falls back to PyTorch with a warning that
says so) on the same device; tensors cross by DLPack without copies, torch's current stream is
synchronized before each onnxruntime run (onnxruntime synchronizes its own at the end of each
run), and TF32 is used by onnxruntime's kernels exactly when
``torch.backends.cuda.matmul.allow_tf32`` allows it for torch's matrix products (off by default).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import onnxscript.optimizer
import torch
from torch.utils import _pytree as pytree

from gradgraph.compat import inference_session
from gradgraph.dropout_noise import DropoutNoise
from gradgraph.io import save_model
from gradgraph.torch.export import (
    ExportedCall,
    ExportFailed,
    export_call,
    restore_buffers,
    snapshot_buffers,
)
from gradgraph.training.ort_state import release_free_memory
from passes.autodiff import GradientOptions
from passes.autodiff.engine import FLOAT_TYPES
from passes.autodiff.gradient_pass import GradientPass
from passes.autodiff.vjp import VjpSeedPass
from passes.cleanup import RANDOM_OPS
from passes.forward.distinct_outputs import DistinctOutputsPass
from passes.forward.params_to_inputs import ParamsToInputsPass
from passes.forward.prepare import PrepareForGradientPass
from passes.forward.random_seeds import SeedRandomOpsPass
from passes.kernels import (
    DecomposeTrainingBatchNormPass,
    DropoutNoisePass,
    GeluFusionPass,
    ValidRowsLossPass,
    WholeScoresLossPass,
    kernel_passes,
    noise_inputs,
)
from passes.marks import gradient_outputs
from passes.recompute.recompute_pass import SESSION_DISABLED_OPTIMIZERS
from passes.split import split_forward_backward

logger = logging.getLogger("gradgraph.torch")
_TORCH_FLOATS: dict[type, torch.dtype] = {np.float32: torch.float32, np.float64: torch.float64}


# a warning when a module has been built for this many call signatures
MANY_SIGNATURES = 16
# the most signatures whose graphs (and sessions) a module keeps; older ones are built again
MAX_ENGINES = 32


class OutputMismatch(RuntimeError):
    """The graph's first outputs differ from the module's in PyTorch."""


class ORTModuleTorchModelException(Exception):
    """Raised for a change to ORTModule that it does not support (``add_module``)."""


class LogLevel(enum.IntEnum):
    """onnxruntime's ORTModule log levels (``DebugOptions(log_level=LogLevel.INFO)``)."""

    VERBOSE = 0
    INFO = 1
    WARNING = 2
    ERROR = 3
    FATAL = 4


# the Python logging level of ``gradgraph.torch`` for each LogLevel
_PY_LEVEL = {LogLevel.VERBOSE: logging.DEBUG, LogLevel.INFO: logging.INFO, LogLevel.WARNING: logging.WARNING,
             LogLevel.ERROR: logging.ERROR, LogLevel.FATAL: logging.CRITICAL}


@dataclasses.dataclass
class DebugOptions:
    """onnxruntime ORTModule's debug options.

    ``save_onnx``: write each signature's graphs under ``onnx_prefix`` with onnxruntime's names,
    ``<prefix>_<stage>_<training|inference>.onnx``: ``torch_exported`` (the exporter's model),
    ``optimized_pre_grad`` (weights as inputs, optimized, ready for the gradient),
    ``optimized`` (with the gradient; training only) and what onnxruntime runs
    (``execution_model`` for inference; for training ``execution_model_forward`` and
    ``execution_model_backward``). ``log_level`` (a :class:`LogLevel` or its name): ``INFO``
    reports each build with its time, ``VERBOSE`` adds onnxruntime's own session log.
    """

    save_onnx: bool = False
    onnx_prefix: str = ""
    log_level: LogLevel | str = LogLevel.WARNING

    def __post_init__(self) -> None:
        if self.save_onnx and not self.onnx_prefix:
            raise ValueError("DebugOptions: save_onnx=True needs an onnx_prefix (the path prefix of "
                             "the saved graphs)")
        level = self.log_level
        if isinstance(level, str):
            name = "VERBOSE" if level.upper() == "DEBUG" else level.upper()
            if name not in LogLevel.__members__:
                raise ValueError(f"DebugOptions: log_level {level!r} is not one of "
                                 f"{', '.join(LogLevel.__members__)}")
            level = LogLevel[name]
        elif not isinstance(level, int) or isinstance(level, bool) or level not in tuple(LogLevel):
            raise ValueError(f"DebugOptions: log_level {level!r} is not a LogLevel")
        self.log_level = LogLevel(level)

    @property
    def level(self) -> LogLevel:
        """``log_level`` as a :class:`LogLevel` (``__post_init__`` checked it)."""
        assert isinstance(self.log_level, LogLevel)
        return self.log_level

    @property
    def ort_severity(self) -> int:
        """onnxruntime's session log severity: its warnings (mostly unused initializers) only
        from INFO down."""
        level = self.level
        return int(level) if level <= LogLevel.INFO else max(int(level), int(LogLevel.ERROR))

    def save(self, model: ir.Model | onnx.ModelProto, stage: str, training: bool) -> None:
        """Write ``model`` as ``<prefix>_<stage>_<training|inference>.onnx`` (atomically)."""
        if self.save_onnx:
            path = f"{self.onnx_prefix}_{stage}_{'training' if training else 'inference'}.onnx"
            save_model(model, path)


def cuda_providers(device: torch.device) -> list:
    """onnxruntime's providers for a CUDA ``device``; raises when onnxruntime has no CUDA provider."""
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise RuntimeError(f"the tensors are on {device} but this onnxruntime has no CUDAExecutionProvider "
                           f"(it has {', '.join(available)}): install onnxruntime-gpu in place of "
                           "onnxruntime, or move the module and its inputs to the CPU")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return [("CUDAExecutionProvider", {"device_id": str(index), "use_tf32": tf32_option()}),
            "CPUExecutionProvider"]


def tf32_option() -> str:
    """The CUDA provider's ``use_tf32``: as torch's float32 matrix products, TF32 only where
    ``torch.backends.cuda.matmul.allow_tf32`` allows it (off by default; onnxruntime's is on)."""
    return "1" if torch.backends.cuda.matmul.allow_tf32 else "0"


def _session(model: ir.Model, threads: int | None, severity: int = 3,
             device: torch.device | None = None) -> ort.InferenceSession:
    providers = cuda_providers(device) if device is not None and device.type == "cuda" else ["CPUExecutionProvider"]
    opts = ort.SessionOptions()
    opts.log_severity_level = severity
    if threads:
        opts.intra_op_num_threads = threads
    # forward and backward sessions run one after the other: a spinning pool would hold the
    # cores the other needs, and torch's (README, ORTModule: spinning on made the BERT-like
    # step 449-584 ms against 357-421 ms, the optimizer step 30-63 instead of 13-16 ms)
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    # No memory pattern: see gradgraph.training.ort_state.GraphRunner (peak RSS, same speed).
    opts.enable_mem_pattern = False
    return inference_session(ir.to_proto(model), opts, providers=providers,
                             disabled_optimizers=list(SESSION_DISABLED_OPTIMIZERS))


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


def _to_ort(t: torch.Tensor) -> ort.OrtValue:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bool:  # DLPack bools are not read as ONNX bool by every runtime
        # (a host copy; onnxruntime copies it to the device where a CUDA kernel reads it)
        return ort.OrtValue.ortvalue_from_numpy(t.cpu().numpy())
    return ort.OrtValue.from_dlpack(t)


class _OrtValues:
    """OrtValues of the tensors a runner is fed on every call (a module's weights and buffers):
    each made once and reused while its feed is the same tensor over the same memory (an
    optimizer updates it in place, and onnxruntime reads that memory). A tensor replaced, its
    data reassigned, moved or cast gets a new one; other feeds are converted on every call.

    An entry holds its tensor weakly and goes when the tensor does (replicas made per call,
    weights of a deleted model); its OrtValue holds the memory it was made from until then, or
    until the next call of this runner replaces it, or :meth:`clear` (ORTModule clears the
    runner it stops using, so a module moved to another device frees the old copy)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)
        self._made: dict[str, tuple[weakref.ref, tuple, ort.OrtValue]] = {}

    def get(self, name: str, t: torch.Tensor) -> ort.OrtValue:
        if name not in self.names:
            return _to_ort(t)
        key = (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
        made = self._made.get(name)
        if made is not None and made[0]() is t and made[1] == key:
            return made[2]
        value = _to_ort(t)
        if t.is_contiguous() and t.dtype != torch.bool:  # else _to_ort made a copy
            made_now: list[Any] = []

            def gone(_: weakref.ref, name: str = name) -> None:
                if made_now and self._made.get(name) is made_now[0]:
                    del self._made[name]

            entry = (weakref.ref(t, gone), key, value)
            made_now.append(entry)
            self._made[name] = entry
        else:
            self._made.pop(name, None)
        return value

    def clear(self) -> None:
        self._made.clear()


def _saved_tensor_hooks() -> bool:
    """Are torch's saved-tensor hooks on (``save_on_cpu``, non-reentrant checkpointing)? True
    where this torch cannot say."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except Exception:  # noqa: BLE001 - a private function of torch: assume hooks
        return True


def _same_memory(value: ort.OrtValue, t: torch.Tensor) -> bool:
    """Is ``t`` (a saved tensor, unpacked) the memory ``value`` reads, with its shape?"""
    return (value.data_ptr() == t.data_ptr() and list(value.shape()) == list(t.shape)
            and t.is_contiguous() and (value.device_name() == "cpu") == (t.device.type == "cpu"))


def _to_torch(v: ort.OrtValue, device: torch.device | None = None) -> torch.Tensor:
    """``v`` as a torch tensor (sharing its memory), on ``device`` when given: an output that
    a CUDA session computed on the host (a shape, a node without a CUDA kernel) is copied there."""
    if v.data_type() == "tensor(bool)":
        t = torch.from_numpy(np.array(v.numpy()))
    else:
        t = torch.from_dlpack(v)
    return t if device is None or t.device == device else t.to(device)


def _sync(device: torch.device) -> None:
    """Wait for the work torch queued on ``device``'s current stream (it produces the tensors
    onnxruntime is about to read on its own stream)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _input_bytes(model: ir.Model) -> int:
    """Bytes of the graph inputs of static shape (the weights, the example's inputs)."""
    total = 0
    for v in model.graph.inputs:
        if v.shape is None or v.dtype is None or not all(isinstance(d, int) for d in v.shape):
            continue
        total += int(np.prod([int(d) for d in v.shape if isinstance(d, int)]) * v.dtype.itemsize)
    return total


class _SessionRun:
    """Runs one onnxruntime session on OrtValues. On a CUDA session the outputs stay on its
    device (bound there; ``run_with_ort_values`` would copy each to the host, and torch back
    again), except bool outputs, which come to the host (see :func:`_to_torch`)."""

    def __init__(self, session: ort.InferenceSession, run_options: ort.RunOptions | None) -> None:
        self.session, self.run_options = session, run_options
        self.cuda_device: int | None = None
        if session.get_providers()[:1] == ["CUDAExecutionProvider"]:
            options = session.get_provider_options().get("CUDAExecutionProvider", {})
            self.cuda_device = int(options.get("device_id", 0))
        self.bools = {o.name for o in session.get_outputs() if o.type == "tensor(bool)"}

    def __call__(self, outputs: list[str], feeds: dict[str, ort.OrtValue]) -> list[ort.OrtValue]:
        if self.cuda_device is None:
            return self.session.run_with_ort_values(outputs, feeds, self.run_options)
        binding = self.session.io_binding()
        for name, value in feeds.items():
            binding.bind_ortvalue_input(name, value)
        for name in outputs:
            if name in self.bools:
                binding.bind_output(name, "cpu")
            else:
                binding.bind_output(name, "cuda", self.cuda_device)
        self.session.run_with_iobinding(binding, self.run_options)
        binding.synchronize_outputs()
        return binding.get_outputs()


class GraphRunner:
    """Forward and backward onnxruntime sessions of one model whose inputs are all fed by the caller.

    ``feed_names``: the graph inputs, in the order the caller passes tensors (user inputs, then
    weights); ``differentiable``: those to differentiate; ``outputs``: the model's own outputs;
    ``state_names``: the feeds that are the same tensors on every call (weights, buffers: their
    OrtValues are kept, see :class:`_OrtValues`). With ``training=False`` one forward session
    is built.
    """

    def __init__(self, model: ir.Model, feed_names: list[str], differentiable: list[str],
                 outputs: list[str], *, training: bool, make_session: Any,
                 save: Any = None, run_options: ort.RunOptions | None = None,
                 state_names: Iterable[str] = ()) -> None:
        self.feed_names = feed_names
        # feeds that are the same tensors on every call (weights, buffers): converted once
        self.feeds = _OrtValues(state_names)
        # outputs that get no gradient whatever the graph says (torch's did not require grad)
        self.detached: frozenset[str] = frozenset()
        self.run_options = run_options  # passed to every run of both sessions
        self.user_outputs = outputs
        self.seeds: dict[str, str] = {}
        self.grad_names: dict[str, str] = {}
        wanted = set(outputs)
        if not any(o.name in wanted and o.dtype in FLOAT_TYPES for o in model.graph.outputs):
            training = False  # no float output (argmax, masks): nothing has a gradient, as in torch
        if not training:
            if save is not None:
                save(model, "execution_model")
            self.forward = make_session(model)
            self._run_forward = _SessionRun(self.forward, run_options)
            self.backward: ort.InferenceSession | None = None
            self._run_backward: _SessionRun | None = None
            self.fwd_inputs = {i.name for i in self.forward.get_inputs()}
            self.fwd_outputs = [o.name for o in self.forward.get_outputs()]
            return
        vjp = VjpSeedPass(outputs)
        vjp(model)
        self.seeds = vjp.seeds
        # a differentiable value that does not reach an output (an unused input, one read only
        # by its shape or through ops without a gradient) gets torch's None gradient
        gradient = GradientPass(vjp.loss, differentiable, GradientOptions(omit_unused=True))
        gradient(model)
        for rewrite in kernel_passes():  # faster kernels for the same values (passes.kernels)
            rewrite(model)
        grads = gradient_outputs(model.graph)
        self.grad_names = {x: grads[x].name or "" for x in grads}
        if save is not None:
            save(model, "optimized")
        split = split_forward_backward(model)
        if save is not None:
            save(split.forward, "execution_model_forward")
            save(split.backward, "execution_model_backward")
        # the export's and the build's garbage, before the sessions are laid out
        release_free_memory(_input_bytes(model))
        self.forward = make_session(split.forward)
        self._run_forward = _SessionRun(self.forward, run_options)
        self.fwd_inputs = {i.name for i in self.forward.get_inputs()}
        self.fwd_outputs = [o.name for o in self.forward.get_outputs()]
        self.backward = None
        self._run_backward = None
        self.bwd_inputs, self.bwd_outputs = [], []
        if self.grad_names:  # else no differentiable value reaches an output: nothing to run backward
            self.backward = make_session(split.backward)
            self._run_backward = _SessionRun(self.backward, run_options)
            self.bwd_inputs = [i.name for i in self.backward.get_inputs()]
            self.bwd_outputs = [o.name for o in self.backward.get_outputs()]
        self._seed_outputs = {seed: name for name, seed in self.seeds.items()}

    def run_forward(self, values: dict[str, ort.OrtValue]) -> dict[str, ort.OrtValue]:
        outs = self._run_forward(self.fwd_outputs, {k: v for k, v in values.items() if k in self.fwd_inputs})
        return dict(zip(self.fwd_outputs, outs))

    def backward_reads(self) -> list[str]:
        """The backward session's inputs other than the output gradients (seeds)."""
        seeds = set(self.seeds.values())
        return [n for n in self.bwd_inputs if n not in seeds] if self.backward is not None else []

    def run_backward(self, kept: dict[str, ort.OrtValue], values: dict[str, ort.OrtValue],
                     grad_outputs: dict[str, ort.OrtValue]) -> dict[str, ort.OrtValue]:
        """Gradients by differentiated name; ``grad_outputs`` by user output name."""
        if self.backward is None:  # no differentiable value reaches an output: torch's None gradients
            return {}
        # the backward reads the gradient of the outputs that depend on a differentiated value
        # only (an output computed from inputs that need no gradient leaves its seed unread)
        feeds = {}
        for name in self.bwd_inputs:
            seed_of = self._seed_outputs.get(name)
            if seed_of is not None:
                feeds[name] = grad_outputs[seed_of]
            else:
                feeds[name] = kept[name] if name in kept else values[name]
        assert self._run_backward is not None  # built with the backward session
        outs = dict(zip(self.bwd_outputs, self._run_backward(self.bwd_outputs, feeds)))
        return {x: outs[g] for x, g in self.grad_names.items()}


def apply_runner(runner: GraphRunner, tensors: tuple[torch.Tensor, ...],
                 after_forward: Any = None) -> tuple[torch.Tensor, ...]:
    """Run ``runner`` on ``tensors`` (aligned with ``runner.feed_names``) through autograd."""
    return _Function.apply(runner, after_forward, *tensors)


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


def _named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers by path, every alias of a shared one included."""
    named: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    named.update(dict(module.named_buffers(remove_duplicate=False)))
    return named


_PLAIN = frozenset({bool, int, float, str, type(None)})


# a module's hook dictionaries (a hook added or removed after a build changes the signature)
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_NOT_HELD = object()


def _attr_key(value: Any) -> Any:
    """What the signature holds of an attribute's value: a plain value (bool/int/float/str/None,
    a short tuple or list of them, lists as tuples); a tensor attribute that is no parameter or
    buffer (the export bakes it in as a constant) by its identity and version; else
    ``_NOT_HELD``."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if (kind is tuple or kind is list) and len(value) <= 16 and all(type(v) in _PLAIN for v in value):
        return ("sequence", tuple(value))
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    return _NOT_HELD


def _is_plain(value: Any) -> bool:
    """Is ``value`` a plain value (:func:`_attr_key`)?"""
    return _attr_key(value) is not _NOT_HELD and not isinstance(value, torch.Tensor)


def _plain_attrs(module: torch.nn.Module, skip: dict[int, frozenset[str]]) -> tuple:
    """Every submodule's attributes as :func:`_attr_key` holds them, less ``skip``'s (by ``id``
    of the submodule), the handles of its hooks, its class and identity and a forward set on
    it. Run on every call: kept fast."""
    held = []
    for m in module.modules():
        skipped = skip.get(id(m))
        items: list[Any] = []
        for k, v in vars(m).items():
            kind = type(v)
            if kind in _PLAIN:
                key = v
            elif kind is dict or kind is OrderedDict:  # _parameters, _modules, hook dicts, ...
                continue
            else:
                key = _attr_key(v)
                if key is _NOT_HELD:
                    continue
            if skipped is None or k not in skipped:
                items.append((k, key))
        items.append(tuple(tuple(getattr(m, h, {}).keys()) for h in _HOOK_DICTS))
        # which module is there (a submodule replaced on the wrapped module: model.module.block[0]
        # = nn.Sigmoid()), and a forward set on the instance
        items.append((type(m), id(m), id(vars(m).get("forward"))))
        held.append(tuple(items))
    return tuple(held)


def _global_hooks() -> tuple:
    """The handles of torch's global module hooks."""
    from torch.nn.modules import module as torch_module

    return tuple(tuple(getattr(torch_module, f"_global{h}", {}).keys()) for h in _HOOK_DICTS)


def _signature(training: bool, in_spec: Any, leaves: list, module: torch.nn.Module,
               named: dict[str, torch.Tensor], skip: dict[int, frozenset[str]] | None = None) -> tuple:
    """What a built graph depends on: the call's structure (which argument, keyword or dict key
    holds which tensor, where the non-tensor values are and what they are), each tensor's shape,
    dtype, requires_grad and device, every submodule's plain and tensor attributes (train/eval
    among them; less ``skip``'s, those only the forward changes), the module's parameters and
    buffers (their paths, shapes, dtypes, devices, and which parameters require grad), its
    hooks, torch.autocast's state and whether torch allows TF32 products."""
    call = tuple((tuple(x.shape), x.dtype, x.requires_grad, x.device) if isinstance(x, torch.Tensor)
                 else ("const", type(x).__name__, repr(x)) for x in leaves)
    # each submodule's plain Python attributes (train/eval, Dropout's p, a flag its forward
    # reads) and tensor attributes: the export bakes them into the graph; and its hooks
    modes = _plain_attrs(module, skip or {})
    weights = tuple((n, tuple(t.shape), t.dtype, isinstance(t, torch.nn.Parameter) and t.requires_grad,
                     t.device) for n, t in named.items())
    # torch.autocast changes the exported dtypes; TF32 the CUDA sessions' options
    autocast = (tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")),
                torch.backends.cuda.matmul.allow_tf32)
    return (training, in_spec, call, modes, weights, autocast, _global_hooks())


# an attribute: (id of its submodule, name) -> (dotted path, key (:func:`_attr_key`), submodule)
_AttrState = dict[tuple[int, str], tuple[str, Any, torch.nn.Module]]


def _shown(key: Any) -> str:
    """An attribute's :func:`_attr_key` for a message."""
    if isinstance(key, tuple) and key[:1] == ("tensor",):
        return "a tensor"
    if isinstance(key, tuple) and key[:1] == ("sequence",):
        return repr(key[1])
    return repr(key)


def _attr_state(module: torch.nn.Module) -> _AttrState:
    """Every attribute the signature holds, with its path and key."""
    return {(id(m), k): (f"{path}.{k}" if path else k, key, m) for path, m in module.named_modules()
            for k, v in vars(m).items() if (key := _attr_key(v)) is not _NOT_HELD}


def _changed_attrs(module: torch.nn.Module, before: _AttrState) -> _AttrState:
    """The attributes whose key differs from ``before``'s (or that are new), as they are now."""
    return {k: entry for k, entry in _attr_state(module).items() if k not in before or before[k][1] != entry[1]}


def device_rewrites(device: torch.device | str) -> list:
    """Passes a graph for ``device`` needs before its gradient: onnxruntime's CUDA provider has
    no training-mode BatchNormalization kernel at opset 14 and later, so it is decomposed."""
    kind = device.type if isinstance(device, torch.device) else device
    return [DecomposeTrainingBatchNormPass()] if kind == "cuda" else []


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
        named = _named_tensors(module)
        self.weights = {**exported.parameters, **exported.buffers}  # onnx name -> torch path
        model = ir.from_proto(exported.model)
        n_user = exported.n_outputs
        # after the module's own outputs: the new values of the buffers its forward updates in
        # place (export.py, trap 4), written back after each call
        del model.graph.outputs[n_user + len(exported.mutations):]
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
        random = _draws_random_numbers(model)
        # training Dropouts read their noise, drawn here faster than onnxruntime's CPU kernel
        # draws it (passes/kernels/dropout_noise.py), from a seed torch's generator gives
        DropoutNoisePass()(model)
        self.noise = DropoutNoise(noise_inputs(model.graph), owner._threads or torch.get_num_threads())
        self.reference: list[torch.Tensor] | None = None if random else exported.reference_outputs
        # and the buffers it updated: an exporter may drop an update (InstanceNorm's running
        # statistics: torch 2.13's InstanceNormalization has none)
        self.reference_buffers: dict[str, torch.Tensor] = (
            {} if random else dict(zip(exported.mutations, exported.reference_mutations)))
        exported.reference_outputs, exported.reference_mutations = [], []  # until the first run only
        self.mutation_outputs = {o.name or "": path for o, path in
                                 zip(model.graph.outputs[n_user:], exported.mutations)}
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
        # plain attributes the forward set while exporting (warned about after the first run)
        self.changed_attrs: dict[tuple[int, str], tuple[str, Any, Any]] = {}
        try:
            self.runner = GraphRunner(model, self.input_names + list(self.weights) + list(self.noise.inputs),
                                      grad_inputs + grad_weights,
                                      self.user_outputs, training=training,
                                      make_session=lambda m: _session(m, owner._threads, debug.ort_severity,
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

    def write_back(self, outputs: dict[str, ort.OrtValue], named: dict[str, torch.Tensor]) -> None:
        """Buffers the forward updated (training BatchNorm's running statistics, exposed as
        ``<buffer>.out`` by PrepareForGradientPass, and the buffers the module's forward updates
        in place) are copied into the module's buffers, and each training BatchNorm counts the
        batch (``num_batches_tracked``) as torch does."""
        if not self.stat_outputs and not self.mutation_outputs:
            return
        with torch.no_grad():
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
        return (*inputs, *(named[path] for path in self.weights.values()), *self.dropout_noise())

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


class _Function(torch.autograd.Function):
    """Forward and backward sessions under autograd. What the backward session reads (the
    forward's stash, and those feeds it needs) is saved with ``save_for_backward`` as torch
    tensors sharing the memory: torch frees it after the backward unless ``retain_graph``, and
    raises its usual error when a saved input was modified in place before the backward."""

    @staticmethod
    def forward(ctx, runner: GraphRunner, after_forward: Any,  # type: ignore[override]
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        devices = [t.device for t in tensors]  # each gradient goes where its input is
        device = devices[0] if devices else torch.device("cpu")
        values = {n: runner.feeds.get(n, t) for n, t in zip(runner.feed_names, tensors)}
        _sync(device)
        kept = runner.run_forward(values)
        if after_forward is not None:
            after_forward(kept)
        results = tuple(_to_torch(kept[n], device) for n in runner.user_outputs)
        read = runner.backward_reads()
        as_output = {n: r for n, r in zip(runner.user_outputs, results)}
        saved_names, saved = [], []
        for name, t in zip(runner.feed_names, tensors):
            if name in read and name not in kept:
                saved_names.append(name)
                saved.append(t)
        for name in read:
            if name in kept:
                saved_names.append(name)
                saved.append(as_output[name] if name in as_output else _to_torch(kept[name]))
        ctx.save_for_backward(*saved)
        # What onnxruntime computed, as OrtValues, for the first backward (no conversion back);
        # dropped there, so that what torch frees after the backward is freed (a retained
        # graph's next backward converts the saved tensors). Not under saved-tensor hooks
        # (offloading, checkpointing): those move or free the saved memory, which these would
        # hold. The feeds go through the runner's kept OrtValues again.
        ctx.ort_values = None if _saved_tensor_hooks() else {n: kept[n] for n in saved_names if n in kept}
        ctx.runner, ctx.saved_names = runner, saved_names
        ctx.devices = devices
        ctx.shapes = [(r.shape, r.dtype) for r in results]
        # one call: each call of mark_non_differentiable replaces the previous one's tensors
        ctx.mark_non_differentiable(*(r for name, r in zip(runner.user_outputs, results)
                                      if not r.is_floating_point() or name in runner.detached))
        return results

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor | None):  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError("ORTModule: a backward with create_graph=True (double backward, "
                               "torch.autograd.grad(..., create_graph=True)) is not supported: its "
                               "backward runs in onnxruntime and has no gradient of its own")
        runner: GraphRunner = ctx.runner
        saved = ctx.saved_tensors  # torch's error if one was modified in place since the forward
        ort_values, ctx.ort_values = ctx.ort_values or {}, None
        stash = {}
        for name, t in zip(ctx.saved_names, saved):
            value = ort_values.get(name)
            # the forward's OrtValue where the saved tensor is still that memory
            stash[name] = value if value is not None and _same_memory(value, t) else runner.feeds.get(name, t)
        device = ctx.devices[0] if ctx.devices else torch.device("cpu")
        seeds = {}
        for name, g, (shape, dtype) in zip(runner.user_outputs, grad_outputs, ctx.shapes):
            if name in runner.seeds:
                seeds[name] = _to_ort(torch.zeros(shape, dtype=dtype, device=device) if g is None
                                      else g.to(dtype))
        _sync(device)
        grads = runner.run_backward(stash, {}, seeds)
        return (None, None, *(_to_torch(grads[n], d) if n in grads else None
                              for n, d in zip(runner.feed_names, ctx.devices)))


def _set_log_level(level: LogLevel) -> None:
    """The ``gradgraph.torch`` logger at ``level``, printing to stderr when no handler is set."""
    logger.setLevel(_PY_LEVEL[level])
    if level <= LogLevel.INFO and not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)


def _keys_of_wrapped_module(state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """An ORTModule inside another module: its ``state_dict`` names the wrapped module's tensors
    without ``_original_module.`` (as ``ORTModule.state_dict`` does), and torch's recursive load
    reaches them through that child: the keys under ``prefix`` move there, so a model holding an
    ORTModule loads its own state_dict, and a plain torch checkpoint of the same model."""
    inner = prefix + "_original_module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


class ORTModule(torch.nn.Module):
    """Wraps ``module``; forward and backward run in onnxruntime (module docstring)."""

    def __init__(self, module: torch.nn.Module, debug_options: DebugOptions | None = None, *,
                 fallback: str = "warn", optimize: bool = True, threads: int | None = None) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"ORTModule wraps a torch.nn.Module, not {type(module).__name__}")
        if fallback not in ("warn", "raise"):
            raise ValueError(f"ORTModule: fallback must be 'warn' (run the module in PyTorch, with "
                             f"one warning) or 'raise', not {fallback!r}")
        super().__init__()
        self._modules["_original_module"] = module
        self._debug = debug_options or DebugOptions()
        if debug_options is not None:  # as onnxruntime's ORTModule: its log level is global
            _set_log_level(self._debug.level)
        self._fallback = fallback
        self._optimize = optimize
        self._threads = threads
        self._engines: dict[Any, _Engine | None] = {}  # None: this signature runs in PyTorch
        self._builds = 0  # signatures built so far (a warning when they keep coming)
        # attributes our forward runs changed and that still hold the value they left (a call
        # counter, a cache length): left out of the signature, (id of the submodule) -> names
        self._owned: _AttrState = {}
        self._skip: dict[int, frozenset[str]] = {}
        self._tick = 0  # calls so far; _used: the last call of each engine (by id), for eviction
        self._used: dict[int, int] = {}
        self._hook_warned: set[str] = set()  # submodules whose forward hooks were warned about
        self._attr_warned: set[str] = set()  # attributes set by the forward, warned about
        self._register_load_state_dict_pre_hook(_keys_of_wrapped_module)
        self._initialized = True  # from here on, new attributes go to the wrapped module

    def __getattr__(self, name: str) -> Any:
        # what ORTModule does not have, the wrapped module may (``model.config`` of HF models)
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "_original_module" not in modules:
                raise
        return getattr(modules["_original_module"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        # After construction an attribute ORTModule does not own is set on the wrapped module
        # (as onnxruntime's ORTModule did); its graphs are rebuilt on the next call.
        own = (name in self.__dict__ or name.startswith("__") or hasattr(type(self), name)
               or any(name in self.__dict__.get(d, {}) for d in ("_modules", "_parameters", "_buffers")))
        if not self.__dict__.get("_initialized") or own:  # ORTModule's own (forward, module, __class__)
            super().__setattr__(name, value)
            return
        setattr(self.module, name, value)
        if not (_is_plain(value) or isinstance(value, torch.Tensor)):
            # a plain value is in the signature and a tensor is read on every call; a module or
            # anything else may change what the forward computes
            self._engines.clear()

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped module."""
        return self._modules["_original_module"]  # type: ignore[return-value]

    # ---- the call -------------------------------------------------------------------------
    def _warn_sparse(self) -> None:
        """Once per submodule: an ``Embedding`` / ``EmbeddingBag(sparse=True)`` gets a dense
        gradient here (onnxruntime's tensors are dense), which torch's sparse optimizers refuse."""
        for path, sub in self.module.named_modules():
            if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse \
                    and f"sparse:{path}" not in self._hook_warned:
                self._hook_warned.add(f"sparse:{path}")
                warnings.warn(f"ORTModule: {path or type(sub).__name__} has sparse=True; its weight's "
                              "gradient comes back as a dense tensor (onnxruntime computes dense "
                              "tensors), which torch.optim.SparseAdam refuses: use a dense optimizer "
                              "(Adam, SGD), or run the module without ORTModule", stacklevel=3)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, in_spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        named = _named_tensors(self.module)
        # a gradient graph whenever autograd will want one (torch's eval mode still gives grads)
        training = torch.is_grad_enabled() and (
            any(t.requires_grad for t in named.values() if isinstance(t, torch.nn.Parameter))
            or any(t.requires_grad for t in tensors))
        self._release_changed_by_user()
        key = _signature(training, in_spec, leaves, self.module, named, self._skip)
        if key not in self._engines:
            state = _attr_state(self.module)
            engine = self._build(key, args, kwargs, tensors, training)
            self._engines[key] = engine
            self._builds += 1
            # attributes the forward set while exporting (a lazily built cache's length, a
            # counter) leave the signature while they keep the value a forward of ours left
            # (a user's change brings them back); the graph was exported in that state
            changed = _changed_attrs(self.module, state)
            self._own(changed)
            self._engines.setdefault(_signature(training, in_spec, leaves, self.module,
                                                _named_tensors(self.module), self._skip), engine)
            if engine is not None:
                engine.changed_attrs = {k: (path, state[k][1] if k in state else None, new)
                                        for k, (path, new, _) in changed.items()}
                if training:
                    self._warn_sparse()
            self._evict()
            if self._builds == MANY_SIGNATURES:
                warnings.warn(
                    f"ORTModule: {type(self.module).__name__} has been exported for {self._builds} "
                    "call signatures; each new input shape or dtype, train/eval switch or change of a "
                    "submodule's plain attribute exports and builds again (slow): pad inputs to a "
                    "few shapes", RuntimeWarning, stacklevel=4)
        engine = self._engines[key]
        if engine is None:  # this signature falls back to PyTorch
            return self._run_in_torch(args, kwargs)
        self._tick += 1
        self._used[id(engine)] = self._tick
        last = self.__dict__.get("_last_engine")
        last = last() if last is not None else None
        if last is not None and last is not engine:  # its kept OrtValues may hold memory the
            last.runner.feeds.clear()                # module no longer uses (moved, cast, replaced)
        self.__dict__["_last_engine"] = weakref.ref(engine)
        if engine.first_run:
            return self._first_run(engine, args, kwargs, tensors, named, training)
        return self._run(engine, tensors, named, training)

    def _own(self, changed: _AttrState) -> None:
        """Attributes a forward of ours (an export, a call run in PyTorch) changed: left out of
        the signature while they hold the value it left."""
        if changed:
            self._set_owned({**self._owned, **changed})

    def _set_owned(self, owned: _AttrState) -> None:
        """``owned``, and the signature's ``skip`` derived from it."""
        self._owned = owned
        self._skip = {}
        for module_id, name in owned:
            self._skip[module_id] = self._skip.get(module_id, frozenset()) | {name}

    def _release_changed_by_user(self) -> None:
        """An owned attribute whose value is not the one our forward left was set by the user:
        it is part of the signature again."""
        if not self._owned:
            return
        changed = [k for k, (_, key, m) in self._owned.items()
                   if _attr_key(vars(m).get(k[1], _NOT_HELD)) != key]
        if changed:
            self._set_owned({k: v for k, v in self._owned.items() if k not in changed})

    def _run_in_torch(self, args: tuple, kwargs: dict) -> Any:
        """A signature that falls back: the module in PyTorch; what its forward changes stays
        out of the signature (a counter does not make each call export again)."""
        state = _attr_state(self.module)
        result = self.module(*args, **kwargs)
        self._own(_changed_attrs(self.module, state))
        return result

    def _evict(self) -> None:
        """At most MAX_ENGINES signatures' graphs are kept: the least recently used go."""
        live = list(dict.fromkeys(id(e) for e in self._engines.values() if e is not None))
        if len(live) <= MAX_ENGINES:
            return
        live.sort(key=lambda i: self._used.get(i, 0))
        for gone in live[:len(live) - MAX_ENGINES]:
            for k in [k for k, e in self._engines.items() if e is not None and id(e) == gone]:
                del self._engines[k]
            self._used.pop(gone, None)

    def _run(self, engine: _Engine, tensors: list[torch.Tensor], named: dict[str, torch.Tensor],
             training: bool) -> Any:
        feeds = engine.tensors(tensors, named)
        if training and engine.runner.backward is not None:
            outs = apply_runner(engine.runner, feeds, lambda kept: engine.write_back(kept, named))
        else:
            runner = engine.runner
            values = {n: runner.feeds.get(n, t) for n, t in zip(runner.feed_names, feeds)}
            _sync(engine.device)
            kept = runner.run_forward(values)
            engine.write_back(kept, named)  # a train-mode BatchNorm under no_grad updates its statistics
            outs = tuple(_to_torch(kept[n], engine.device) for n in runner.user_outputs)
        return engine.exported.rebuild(list(outs))

    def _first_run(self, engine: _Engine, args: tuple, kwargs: dict, tensors: list[torch.Tensor],
                   named: dict[str, torch.Tensor], training: bool) -> Any:
        """A signature's first run: a failure, or outputs unlike PyTorch's (the export lost part
        of the forward), make the signature fall back (or raise) like a failed build."""
        saved = snapshot_buffers(self.module)
        try:
            result = self._run(engine, tensors, named, training)
            reference, engine.reference = engine.reference, None
            buffers, engine.reference_buffers = engine.reference_buffers, {}
            if reference is not None:
                where = _mismatch(tuple(x for x in pytree.tree_leaves(result) if x is not None), reference)
                if where is None and buffers:
                    where = _mismatch(tuple(named[path] for path in buffers), list(buffers.values()),
                                      [f"buffer {path!r} after the call" for path in buffers])
                if where is not None:
                    raise OutputMismatch(
                        f"the onnxruntime graph ({engine.exported.exporter} exporter) computes other "
                        f"values than the module in PyTorch ({where}): the export lost part of "
                        "the forward")
        except Exception as exc:  # noqa: BLE001 - as a failed build
            restore_buffers(self.module, saved)  # as they were before this call
            if not isinstance(exc, OutputMismatch):
                explained = engine.explain(exc, tensors)
                if explained is not exc:
                    explained.__cause__ = exc
                exc = explained
            self._fail(exc)
            for k in [k for k, e in self._engines.items() if e is engine]:
                self._engines[k] = None  # under its signatures before and after the build
            return self._run_in_torch(args, kwargs)
        engine.first_run = False
        self._warn_changed_attrs(engine.changed_attrs)
        return result

    def _warn_changed_attrs(self, changed: dict[tuple[int, str], tuple[str, Any, Any]]) -> None:
        """Once per attribute: the forward changed it while exporting, and the graph's calls
        do not run the forward's Python code."""
        new = [(path, old, value) for path, old, value in changed.values() if path not in self._attr_warned]
        if not new:
            return
        self._attr_warned.update(path for path, _, _ in new)
        shown = ", ".join(f"{path!r} ({_shown(old)} -> {_shown(value)})" for path, old, value in new[:5])
        warnings.warn(f"ORTModule: the forward of {type(self.module).__name__} set {shown} while "
                      "exporting; the graph was exported in that state, and its calls run the graph, "
                      "not the forward's Python code, so they do not change these attributes (a counter "
                      "stops counting)", UserWarning, stacklevel=6)

    def __getstate__(self) -> dict:
        # onnxruntime sessions do not pickle: a copy (copy.deepcopy, torch.save) rebuilds its
        # graphs on its first call
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        state = dict(state)
        state["_engines"] = {}
        state.pop("_last_engine", None)
        return state

    def _build(self, key: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor],
               training: bool) -> _Engine | None:
        start = time.perf_counter()
        logger.info("ORTModule: exporting %s for a new call signature (%s)", type(self.module).__name__,
                    ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in tensors))
        try:
            device = _one_device(tensors, _named_tensors(self.module))
            if device.type == "cuda":
                cuda_providers(device)  # no CUDA provider: say so before exporting
            norms = _training_batch_norms(self.module)  # refuses what is unsupported before exporting
            _check_hooks(self.module, training, self._hook_warned)
            # the export's run of the module (its dropouts) and the build draw from torch's
            # generators on a copy of their state: torch.manual_seed repeats a signature's first
            # call as it repeats the later ones
            cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
                if device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):
                exported = export_call(self.module, args, kwargs, training=self.module.training,
                                       stop_gradients=training)
                exported_at = time.perf_counter()
                engine = _Engine(self, exported, tensors, training, norms, device)
        except Exception as exc:  # noqa: BLE001 - any failure falls back (or is raised) with its reason
            self._fail(exc)
            return None
        logger.info("ORTModule: built the %s graphs in %.1f s (export %.1f s, %s exporter; graphs and "
                    "sessions %.1f s)", "training" if training else "inference",
                    time.perf_counter() - start, exported_at - start, exported.exporter,
                    time.perf_counter() - exported_at)
        return engine

    def _fail(self, exc: Exception) -> None:
        """A signature that cannot run in onnxruntime: raise, or warn once and use PyTorch."""
        if self._fallback == "raise":
            raise exc
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:600] if str(exc) else ''}"
        if "Could not find an implementation" in reason:
            reason += (" - onnxruntime's CPU kernels lack this op for this element type"
                       + (" (torch.autocast is on: its float16 / bfloat16 casts are in the graph)"
                          if torch.is_autocast_enabled("cpu") else ""))
        warnings.warn(f"ORTModule: {type(self.module).__name__} runs in PyTorch for this input "
                      f"signature, because building or running its onnxruntime graphs failed ({reason}); "
                      "pass fallback='raise' to see the error", RuntimeWarning, stacklevel=6)

    # ---- nn.Module behaviour reflects the wrapped module ----------------------------------
    def add_module(self, name: str, module: torch.nn.Module | None) -> None:
        raise ORTModuleTorchModelException("ORTModule does not support adding modules to it")

    def train(self, mode: bool = True) -> ORTModule:
        self.training = mode
        self.module.train(mode)
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def _apply(self, fn: Any, recurse: bool = True) -> ORTModule:
        # to(), double(), half(), cpu(): the tensors change, the graphs are rebuilt on next call
        self._engines.clear()
        self.module._apply(fn, recurse)  # not super(): children() is the wrapped module's
        return self

    def apply(self, fn: Any) -> ORTModule:
        self._engines.clear()
        self.module.apply(fn)
        return self

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        self._engines.clear()
        self.module.register_buffer(name, tensor, persistent)

    def register_parameter(self, name: str, param: torch.nn.Parameter | None) -> None:
        self._engines.clear()
        self.module.register_parameter(name, param)

    def get_parameter(self, target: str) -> torch.nn.Parameter:
        return self.module.get_parameter(target)

    def get_buffer(self, target: str) -> torch.Tensor:
        return self.module.get_buffer(target)

    def get_submodule(self, target: str) -> torch.nn.Module:
        return self.module.get_submodule(target)

    def children(self) -> Iterator[torch.nn.Module]:
        return self.module.children()

    def named_children(self) -> Iterator[tuple[str, torch.nn.Module]]:
        return self.module.named_children()

    def modules(self) -> Iterator[torch.nn.Module]:  # type: ignore[override]
        return self.module.modules()

    def named_modules(self, memo: set | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Module]]:
        return self.module.named_modules(memo, prefix, remove_duplicate)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.module.buffers(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse, remove_duplicate)
