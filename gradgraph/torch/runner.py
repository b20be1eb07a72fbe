"""The front ends' graph runner: forward and backward onnxruntime sessions of one model, run
under torch autograd (:class:`GraphRunner`, :func:`apply_runner`), shared by ORTModule and
TorchOrtFactory.

Tensors cross by DLPack (no copies on CPU); the stash stays an onnxruntime value between the
forward and the backward. CUDA: a session on onnxruntime's CUDAExecutionProvider on the tensors'
device; torch's current stream is synchronized before each onnxruntime run (onnxruntime
synchronizes its own at the end of each run), and TF32 is used by onnxruntime's kernels exactly
when ``torch.backends.cuda.matmul.allow_tf32`` allows it for torch's products (off by default).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch

from gradgraph.runtime.compat import inference_session
from gradgraph.training.ort_state import no_spinning, release_free_memory
from passes.autodiff import GradientOptions
from passes.autodiff.engine import FLOAT_TYPES
from passes.autodiff.gradient_pass import GradientPass
from passes.autodiff.vjp import VjpSeedPass
from passes.kernels import DecomposeTrainingBatchNormPass, kernel_passes
from passes.marks import gradient_outputs
from passes.recompute.recompute_pass import SESSION_DISABLED_OPTIMIZERS
from passes.split import split_forward_backward


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


def make_session(model: ir.Model, threads: int | None, severity: int = 3,
             device: torch.device | None = None) -> ort.InferenceSession:
    providers = cuda_providers(device) if device is not None and device.type == "cuda" else ["CPUExecutionProvider"]
    opts = ort.SessionOptions()
    opts.log_severity_level = severity
    if threads:
        opts.intra_op_num_threads = threads
    # forward and backward sessions run one after the other: a spinning pool would hold the
    # cores the other needs, and torch's (README, ORTModule: spinning on made the BERT-like
    # step 449-584 ms against 357-421 ms, the optimizer step 30-63 instead of 13-16 ms)
    no_spinning(opts)
    opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    # No memory pattern: see gradgraph.training.ort_state.GraphRunner (peak RSS, same speed).
    opts.enable_mem_pattern = False
    return inference_session(ir.to_proto(model), opts, providers=providers,
                             disabled_optimizers=list(SESSION_DISABLED_OPTIMIZERS))



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


def device_rewrites(device: torch.device | str) -> list:
    """Passes a graph for ``device`` needs before its gradient: onnxruntime's CUDA provider has
    no training-mode BatchNormalization kernel at opset 14 and later, so it is decomposed."""
    kind = device.type if isinstance(device, torch.device) else device
    return [DecomposeTrainingBatchNormPass()] if kind == "cuda" else []
