"""TrainingSession: train an ONNX model in stock onnxruntime.

Weights, running statistics, optimizer state, the step counter and accumulation buffers are
OrtValues on the session's device (see :mod:`gradgraph.training.ort_state`); each step binds them
through IOBinding and swaps them with the updated outputs. With ``accumulation_steps = N``,
micro-steps 1..N-1 run the accumulate graph and micro-step N the training graph, which also
applies the optimizer.

A step whose loss, learning rate, gradients, new weights or new optimizer state are not
finite is skipped (nothing changes, the step counter included); ``last_step_finite`` and
``skipped_steps`` report it. The step runs as graphs of its own
(:mod:`gradgraph.training.step_split`): forward and backward with the check of the loss,
learning rate and gradients; then, only on a finite step, the update proven finite from
bounds (:mod:`gradgraph.training.update_bounds`) or, where no proof holds, computed without
writing anything and its results checked (a learning rate of 1e30 overflows them); then, only
when they are finite, the update written over the weights and state in place (no spare
buffer per held tensor). Data-parallel ranks (and a graph that cannot be split) run the step
as one graph that writes into spare buffers.

Dropout is real in training (onnxruntime's EliminateDropout is disabled) and off in eval.
Its random stream is onnxruntime's and is not part of checkpoints: resuming is bit-identical
for models without active dropout.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, overload

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

from gradgraph.feeds import InputError
from gradgraph.index_inputs import IndexCheck
from gradgraph.io import atomic_output_path, save_model
from gradgraph.runtime.external import drop_resident
from gradgraph.training.build import (
    TrainingArtifacts,
    TrainingConfig,
    build_training_artifacts,
    inference_ir,
    inference_model,
)
from gradgraph.training.checkpoint import (  # MICRO_STEP_KEY re-exported: its public path
    MICRO_STEP_KEY,
    CheckpointError,
    read_checkpoints,
    write_checkpoint,
)
from gradgraph.training.distributed import DataParallelRunner, DistributedConfig
from gradgraph.training.guarded_update import GuardedUpdate
from gradgraph.training.ort_state import (
    GraphRunner,
    StateStore,
    copy_session_options,
    release_free_memory,
    type_proto,
)
from gradgraph.training.parameters import TrainingParameters
from gradgraph.training.precision_warning import warn_if_emulated
from gradgraph.training.step_split import (
    StepSplit,
    split_at_guard,
    typed_inputs,
    writable_in_place,
)
from passes.autodiff import GradientError

logger = logging.getLogger("gradgraph.training")
_DEFAULT_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
# What onnxruntime raises when a graph fails on the values fed (an index out of range...).
_RUN_ERRORS = (RuntimeError, ort_errors.Fail, ort_errors.InvalidArgument, ort_errors.RuntimeException)
# Names listed in messages about a checkpoint's tensors.
_LISTED = 4


def _provider_names(providers: Sequence[Any] | None) -> list[Any]:
    available = ort.get_available_providers()
    if not providers:
        return [p for p in _DEFAULT_PROVIDERS if p in available]
    for provider in providers:
        name = provider if isinstance(provider, str) else provider[0]
        if name not in available:
            hint = " (install onnxruntime-gpu instead of onnxruntime)" if name == "CUDAExecutionProvider" else ""
            raise GradientError(f"execution provider {name!r} is not available in this onnxruntime "
                                f"build{hint}; available: {available}")
    return list(providers)


def _device_of(providers: Sequence[Any]) -> tuple[str, int]:
    first = providers[0]
    name, opts = (first, {}) if isinstance(first, str) else (first[0], first[1])
    if name == "CUDAExecutionProvider":
        return "cuda", int(opts.get("device_id", 0))
    if name != "CPUExecutionProvider":
        raise GradientError(f"provider {name!r} is not supported (use CUDAExecutionProvider or "
                            "CPUExecutionProvider)")
    return "cpu", 0


# onnxruntime's words for a kernel it lacks (a type or attribute its provider does not run):
# the graph's limit on this runtime, not the feeds'.
_NOT_IMPLEMENTED = re.compile(r"not supported|NOT_IMPLEMENTED|not implemented|Could not find an implementation",
                              re.IGNORECASE)


def _run_error(exc: BaseException, what: str) -> GradientError:
    """onnxruntime's failure on the values fed, as one line (its source location dropped): an
    :class:`InputError` (the feeds), or a :class:`GradientError` where onnxruntime lacks a kernel."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    message = re.sub(r"\S*onnxruntime_src\S*:\d+ .*?\] ", "", message)[:400]
    if _NOT_IMPLEMENTED.search(message):
        return GradientError(f"onnxruntime cannot run {what}: {message} (its provider has no kernel "
                             "for this op and type; run the model in another type or on another "
                             "provider)")
    return InputError(f"onnxruntime could not run {what} on these feeds: {message} (is a value "
                      "outside what the model accepts, such as a class label or an index out of "
                      "range?)")


def _learning_rate(lr: Any) -> np.ndarray:
    """``lr`` as the float64 scalar the graph takes (its dtype at binding): a real number (a
    string such as "0.1", which numpy would convert, or a bool is a mistake said at once; a NaN
    is a number: the step is skipped as non-finite, see passes.optimizer); not negative."""
    if isinstance(lr, numbers.Real) and not isinstance(lr, (bool, np.bool_)):
        value = np.asarray(float(lr), np.float64).reshape(())  # Decimal and Fraction too
    else:
        array = np.asarray(lr) if not isinstance(lr, (str, bytes)) else None
        if array is None or array.size != 1 or array.dtype.kind not in "iuf":
            raise InputError(f"the learning rate must be a number, not {lr!r}")
        value = array.astype(np.float64).reshape(())
    if value < 0:  # a step up the gradient (torch's optimizers refuse it too)
        raise InputError(f"the learning rate must be >= 0, not {float(value)}")
    return value


def _zeros(like: np.ndarray) -> np.ndarray:
    """Zeros of ``like``'s shape and dtype from calloc: the pages are the kernel's zero pages
    until written (np.zeros_like writes every byte: 22 s of GPT-2 small's AdamW setup on the
    loaded test machine)."""
    return np.zeros(like.shape, like.dtype)


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_LISTED])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _LISTED else "")


def _with_optimized_path(args: tuple[Any, ...], path: str) -> tuple[Any, ...]:
    """``args`` of a GraphRunner whose session writes onnxruntime's optimized graph to ``path``."""
    if not path:
        return args
    held, names, sess_options, providers, provider_options = args
    options = copy_session_options(sess_options)
    options.optimized_model_filepath = str(path)
    return held, names, options, providers, provider_options


class TrainingSession:
    """``TrainingSession(path_or_bytes, parameters, sess_options=None, providers=None, provider_options=None)``.

    ``parameters`` is a :class:`TrainingParameters` (reference-compatible) or a
    :class:`TrainingConfig`. ``train_step`` / ``run`` do one micro-step, ``eval_step`` runs the
    eval graph on the current weights.
    """

    def __init__(self, path_or_bytes: str | os.PathLike | bytes | onnx.ModelProto | ir.Model,
                 parameters: TrainingParameters | TrainingConfig,
                 sess_options: ort.SessionOptions | None = None,
                 providers: Sequence[Any] | None = None,
                 provider_options: Sequence[dict[str, Any]] | None = None, *,
                 save_stages: str | os.PathLike | None = None,
                 distributed: DistributedConfig | None = None) -> None:
        if isinstance(parameters, TrainingParameters):
            config = parameters.to_config()
            initial_optimizer_state = parameters.optimizer_initial_state
        elif isinstance(parameters, TrainingConfig):
            config, initial_optimizer_state = parameters, {}
        else:
            raise InputError(f"TrainingSession's second argument is a TrainingConfig (or the reference's "
                             f"TrainingParameters), not {type(parameters).__name__}: "
                             f"TrainingSession(model, TrainingConfig(loss='loss', ...))")
        # The session keeps the previous weights and state of a skipped step itself (it does not
        # run the update, or does not swap its buffers), so its graphs leave out the selection
        # (see ort_state.GraphRunner). One process checks the gradients before the update (see
        # step_split); data-parallel ranks vote on the update's result, taken back from spares.
        local = distributed is None or not distributed.active
        config = dataclasses.replace(config, update=dataclasses.replace(
            config.update, select_in_graph=False, guard_before_update=local))
        self.config = config
        self.names = config.names
        self.providers = _provider_names(providers)
        self.artifacts: TrainingArtifacts = build_training_artifacts(
            path_or_bytes, config, save_stages=save_stages, providers=self.providers)
        warn_if_emulated(self.artifacts.train, config.mixed_precision.dtype, self.providers)
        # The build's garbage goes back to the system before the state and the sessions are made
        # (else they are laid out around its holes: 20 MB more resident on the GPT-2-like model).
        weight_bytes = sum(int(np.asarray(a).nbytes) for a in self.artifacts.initial.values())
        release_free_memory(weight_bytes)
        device, device_id = _device_of(self.providers)
        self.store = StateStore(device, device_id)
        self._init_state()
        held = set(self.store.names())
        args = (held, self.names, sess_options, self.providers, provider_options)
        art = self.artifacts
        optimized = config.debug.graph_save_paths.model_with_training_graph_after_optimization_path
        # One process: the gradient run, then the update run in place when the step is finite
        # (step_split); the whole graph in one run (spare buffers) where it cannot be split, or
        # where onnxruntime's optimized graph of the training graph is asked for (one file).
        split = split_at_guard(art.train, held, [self.names.learning_rate]) if local and not optimized \
            else "data parallel, or the optimized training graph is saved"
        self._split = split if isinstance(split, StepSplit) else None
        if isinstance(split, str):
            logger.info("the training step runs as one graph with spare buffers: %s", split)
        train = self._split.gradients if self._split is not None else art.train
        # onnxruntime writes that file itself: into a unique temp file renamed over it once done.
        with atomic_output_path(optimized) as written_by_ort:
            self._train = GraphRunner(train, *_with_optimized_path(args, written_by_ort),
                                      inplace=self._in_place(train, held, "training step"),
                                      carried=self._split.carried if self._split is not None else ())
        # The update, run only when it keeps every weight and state finite (guarded_update).
        self._update: GuardedUpdate | None = None
        if self._split is not None:
            typed_inputs(self._split.update, {o.name: type_proto(o) for o in self._train.session.get_outputs()})
            self._update = GuardedUpdate(self._split, self.store, held, self.names, sess_options,
                                         self.providers, provider_options,
                                         self._in_place(self._split.update, held, "update"))
        self._accumulate = None if art.accumulate is None else GraphRunner(
            art.accumulate, *args, inplace=self._in_place(art.accumulate, held, "accumulation"))
        # The eval graph's session is made at the first eval_step: a training run that never
        # evaluates skips its onnxruntime session (half of the sessions' setup time).
        self._eval_args = args
        self._eval_runner: GraphRunner | None = None
        self._indices = IndexCheck(art.train, art.eval)  # torch's IndexError, before onnxruntime runs
        self.micro_step = 0
        self.learning_rate: float | None = None
        # Optimizer steps skipped because the loss, weights or state would turn NaN/inf.
        self.skipped_steps = 0
        self.last_step_finite = True
        self._finite_output = self.names.finite if self.names.finite in self._train.fetchable else None
        if initial_optimizer_state:
            self._load_optimizer_state(initial_optimizer_state)
        # Data parallel (see gradgraph.training.distributed): world size > 1.
        self.distributed = distributed
        self._dp: DataParallelRunner | None = None
        if distributed is not None and distributed.active:
            self._dp = DataParallelRunner(self, distributed, sess_options, provider_options)
        # The gradient-stage model (with a copy of the weights) served the graph variants above;
        # what the build freed goes back to the system before the steps' arena grows.
        self.artifacts = dataclasses.replace(self.artifacts, gradient_ir=None)
        release_free_memory(weight_bytes)

    def _in_place(self, model: onnx.ModelProto, held: set[str], what: str) -> set[str]:
        return writable_in_place(model, held, self.names.updated, self.store.device, what)

    # ---- state --------------------------------------------------------------------------
    def _init_state(self) -> None:
        art, names = self.artifacts, self.names
        for name in art.params:  # one copy each, into the store; a memory-mapped source's pages
            # are dropped from this process once copied (they stay in the file)
            self.store.set(name, art.initial[name])
            drop_resident(art.initial[name])
        # From here on only the shapes and dtypes of the initial values are read (the data
        # parallel split, accumulation buffers): zero-stride stand-ins free the source arrays.
        art.initial = {n: np.broadcast_to(np.zeros((), a.dtype), a.shape) for n, a in art.initial.items()}
        for w, states in art.optimizer_state.items():
            for s in states:
                self.store.set(names.state(w, s), _zeros(art.initial[w]), owned=True)
        self.store.set(names.step, np.zeros((), np.int64), owned=True)
        if self.config.mixed_precision.scales_loss:
            scaler = self.config.mixed_precision.loss_scaler
            self.store.set(names.loss_scale, np.asarray(scaler.init_scale, np.float32))
            self.store.set(names.stable_steps, np.zeros((), np.int64), owned=True)
        if art.accumulate is not None:
            for w in art.trained:
                self.store.set(names.buffer(w), _zeros(art.initial[w]), owned=True)

    @property
    def data_parallel(self) -> DataParallelRunner | None:
        """The data-parallel runner (world size > 1), else None."""
        return self._dp

    @property
    def loss_scale(self) -> float | None:
        """The dynamic loss scale (mixed precision with a scaled loss), else None."""
        if self.names.loss_scale not in self.store.names():
            return None
        return float(self.store.get(self.names.loss_scale))

    @property
    def step(self) -> int:
        """Optimizer updates applied so far."""
        return int(self.store.get(self.names.step))

    def get_model_state(self, include_mixed_precision_weights: bool = False) -> dict[str, dict[str, np.ndarray]]:
        return {"full_precision": {n: self.store.get(n) for n in self.artifacts.params}}

    def get_optimizer_state(self) -> dict[str, dict[str, np.ndarray]]:
        names = self.names
        state: dict[str, dict[str, np.ndarray]] = {  # ZeRO-1: this rank's partition
            w: {s: self.store.get(names.state(w, s)) for s in states}
            for w, states in self.artifacts.optimizer_state.items()
            if all(names.state(w, s) in self.store for s in states)}
        state["shared_optimizer_state"] = {"step": self.store.get(names.step)}
        return state

    def _load_optimizer_state(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        flat = {}
        for w, entries in state.items():
            for s, value in entries.items():
                flat[self.names.step if w == "shared_optimizer_state" else self.names.state(w, s)] = value
        self.load_state(flat, strict=False)

    def get_state(self) -> dict[str, np.ndarray]:
        """Every held tensor by its graph input name, plus ``micro_step`` (data parallel: the
        state at the last optimizer step, see ``DataParallelRunner.checkpoint_state``)."""
        state = {n: self.store.get(n) for n in self.store.names()}
        state[MICRO_STEP_KEY] = np.array(self.micro_step, np.int64)
        if self._dp is not None:
            state.update(self._dp.checkpoint_state())
        return state

    def get_state_views(self) -> dict[str, np.ndarray]:
        """``get_state()`` without copies: read-only views of the held buffers (CPU; a device's
        are copied to the host), valid until the next step (save them before it)."""
        views = self.store.view if self.store.device == "cpu" else self.store.get
        state = {n: views(n) for n in self.store.names()}
        for array in state.values():  # a write into the session's buffers would bypass its
            array.flags.writeable = False  # bookkeeping (the update's bounds): load_state instead
        state[MICRO_STEP_KEY] = np.array(self.micro_step, np.int64)
        if self._dp is not None:
            state.update(self._dp.checkpoint_state())
        return state

    def load_state(self, state: Mapping[str, Any], strict: bool = True, *, _owned: bool = False) -> None:
        """Load tensors by name; ``strict`` requires exactly the names of ``get_state()``."""
        known = set(self.store.names()) | {MICRO_STEP_KEY}
        unknown = sorted(set(state) - known)
        missing = sorted(known - set(state))
        if strict and (unknown or missing):
            raise CheckpointError(f"state does not match the session: missing {missing}, "
                                  f"unexpected {unknown}")
        checked: dict[str, np.ndarray] = {}
        for name, value in state.items():
            if name not in known:
                continue
            array = np.asarray(value)
            if name == MICRO_STEP_KEY:
                steps = self.config.update.accumulation_steps
                if array.shape != () or not 0 <= int(array) < steps:
                    raise CheckpointError(f"{MICRO_STEP_KEY} must be a scalar in [0, {steps}); got {array}")
                continue
            shape, dtype = self.store.get_spec(name)
            if array.shape != shape or array.dtype != dtype:
                raise CheckpointError(f"tensor {name!r} has shape {list(array.shape)} and dtype "
                                      f"{array.dtype}; the session holds {list(shape)} {dtype}")
            if name in (self.names.step, self.names.stable_steps) and int(array) < 0:
                raise CheckpointError(f"the step counter {name!r} must be >= 0; got {int(array)}")
            checked[name] = array
        for name, array in checked.items():  # arrays read from a checkpoint are the store's own
            self.store.set(name, array, owned=_owned)
        if MICRO_STEP_KEY in state:
            self.micro_step = int(np.asarray(state[MICRO_STEP_KEY]))

    # ---- steps --------------------------------------------------------------------------
    @overload
    def train_step(self, feeds: Mapping[str, Any], lr: float | None = None) -> float: ...

    @overload
    def train_step(self, feeds: Mapping[str, Any], lr: float | None = None, *,
                   fetches: Sequence[str]) -> tuple[float, dict[str, np.ndarray]]: ...

    def train_step(self, feeds: Mapping[str, Any], lr: float | None = None,
                   fetches: Sequence[str] = ()) -> float | tuple[float, dict[str, np.ndarray]]:
        """One micro-step; returns the loss, or ``(loss, {name: array})`` when ``fetches`` is given."""
        names = self.names
        feeds = dict(feeds)
        self._indices(feeds, "train_step")
        steps = self.config.update.accumulation_steps
        applying = self.micro_step + 1 == steps
        if steps > 1:
            feeds[names.reset] = np.array(self.micro_step == 0)
        runner = self._train if applying else self._accumulate
        assert runner is not None  # accumulation_steps > 1 builds the accumulate graph
        extra = sorted(set(feeds) - set(runner.feed_names) - {names.reset, names.learning_rate})
        if extra:  # the CLI refuses such arrays too; onnxruntime's binding would ignore them
            held = [n for n in extra if n in runner.held_inputs]
            raise InputError(f"train_step got feeds {extra} that the training graph does not take "
                             f"(its inputs: {list(runner.feed_names)})"
                             + (f"; {held} are held by the session (weights, optimizer state): set "
                                "them with load_state_dict or load_checkpoint" if held else ""))
        if applying:
            lr = lr if lr is not None else feeds.get(names.learning_rate, self.learning_rate)
            if lr is None:
                raise ValueError(f"no learning rate: pass lr=, feed {names.learning_rate!r} or "
                                 "set session.learning_rate")
            feeds[names.learning_rate] = _learning_rate(lr)
        else:
            feeds.pop(names.learning_rate, None)
        loss = self.config.loss
        wanted = [loss] + [f for f in fetches if f != loss]
        if self._dp is not None:
            feeds.pop(names.reset, None)
            rate = feeds.pop(names.learning_rate, None)
            try:
                out = self._dp.train_step(feeds, float(rate) if rate is not None else 0.0, wanted)
            except _RUN_ERRORS as exc:
                raise _run_error(exc, "the training step") from exc
            return self._loss_value(out, loss, fetches)
        finite = self._finite_output if applying else None
        flag = self._split.flag if applying and self._split is not None else None
        extra_fetches = [f for f in dict.fromkeys([finite, flag]) if f and f not in wanted]
        try:
            out = runner.run(self.store, feeds, wanted + extra_fetches)
            if flag is not None:  # the update runs (in place) only on a finite step
                assert self._split is not None and self._update is not None
                carried = {n: out.pop(n) for n in self._split.carried}
                update_feeds = {names.learning_rate: feeds[names.learning_rate], **carried}
                if bool(out[flag]) and not self._update.apply(update_feeds, self.step):
                    out[flag] = np.asarray(False)  # the update would overflow: skipped
                del carried, update_feeds  # the gradients go back to onnxruntime's arena
        except _RUN_ERRORS as exc:
            raise _run_error(exc, "the training step") from exc
        self.micro_step = 0 if applying else self.micro_step + 1
        if finite is not None:
            self.last_step_finite = bool(out[finite])
            self.skipped_steps += not self.last_step_finite
        return self._loss_value(out, loss, fetches)

    @property
    def proven_updates(self) -> int:
        """Applied steps whose update was proven finite from bounds (no check run)."""
        return self._update.proven if self._update is not None else 0

    @staticmethod
    def _loss_value(out: dict[str, np.ndarray], loss: str,
                    fetches: Sequence[str]) -> float | tuple[float, dict[str, np.ndarray]]:
        if out[loss].size != 1:
            raise GradientError(f"loss {loss!r} has shape {list(out[loss].shape)}, not a scalar; "
                                "reduce it in the model or set loss_reduction='sum' or 'mean'")
        value = float(np.asarray(out[loss]).reshape(-1)[0])
        return (value, out) if fetches else value

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: ort.RunOptions | None = None) -> list[np.ndarray]:
        """Reference-compatible: one training micro-step returning ``output_names``."""
        names = list(output_names or [self.config.loss])
        _, out = self.train_step(input_feed, fetches=names)
        return [out[n] for n in names]

    @property
    def _eval(self) -> GraphRunner:
        if self._eval_runner is None:
            self._eval_runner = GraphRunner(self.artifacts.eval, *self._eval_args)
        return self._eval_runner

    def eval_step(self, feeds: Mapping[str, Any], fetches: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run the eval graph (Dropout off, BatchNorm inference) on the current weights."""
        wanted = list(fetches) if fetches is not None else list(self.artifacts.outputs)
        self._indices(feeds, "eval_step")
        try:
            return self._eval.run(self.store, feeds, wanted)
        except _RUN_ERRORS as exc:
            raise _run_error(exc, "the eval graph") from exc

    # ---- files --------------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike, user_dict: Mapping[str, Any] | None = None) -> None:
        """Write every held tensor (safetensors) and metadata (JSON) atomically to ``path``,
        streamed from the session's buffers (no copy of the weights in memory)."""
        state = self.get_state_views()
        meta = {"step": self.step, "micro_step": int(state[MICRO_STEP_KEY]),
                "optimizer": self.config.optimizer.name,
                "accumulation_steps": self.config.update.accumulation_steps,
                "skipped_steps": self.skipped_steps,
                "model": self.artifacts.params, "trained": list(self.artifacts.trained),
                "user": dict(user_dict or {})}
        write_checkpoint(path, state, meta)

    def load_checkpoint(self, path: str | os.PathLike | Sequence[str | os.PathLike],
                        strict: bool = True) -> dict[str, Any]:
        """Load a checkpoint written by ``save_checkpoint``; returns its ``user_dict``.

        ``path`` may be a list: the checkpoints of the ranks of one data-parallel run (ZeRO-1
        partitions included), merged (:func:`gradgraph.training.checkpoint.read_checkpoints`),
        loadable into any world size.

        ``strict``: the checkpoint must hold exactly this session's tensors (and optimizer).
        ``strict=False`` loads the tensors the session has and warns about the rest (tensors it
        lacks are skipped, its own missing from the file keep their values); a checkpoint
        sharing none of the model's weights and optimizer state (another model's) is refused.
        A refused checkpoint changes nothing in the session.
        """
        paths: list[str | os.PathLike] = list(path) if isinstance(path, (list, tuple)) else [path]  # type: ignore[list-item]
        tensors, meta = read_checkpoints(paths)
        where = f"checkpoint {str(paths[0]) if len(paths) == 1 else [str(p) for p in paths]!r}"
        if self._dp is not None:
            tensors = self._dp.take_checkpoint(tensors)
        if strict and meta.get("optimizer") != self.config.optimizer.name:
            raise CheckpointError(f"{where} was written with optimizer "
                                  f"{meta.get('optimizer')!r}, the session uses {self.config.optimizer.name!r}")
        step = tensors.get(self.names.step)
        if step is not None and np.asarray(step).size == 1 and "step" in meta \
                and int(np.asarray(step).reshape(-1)[0]) != meta["step"]:
            raise CheckpointError(f"{where}: its metadata says step {meta['step']} but its step "
                                  f"tensor holds {int(np.asarray(step).reshape(-1)[0])}; the file "
                                  "is damaged or was edited (save a new checkpoint)")
        partial = None if strict else self._check_overlap(tensors, where)
        try:
            self.load_state(tensors, strict=strict, _owned=True)
        except CheckpointError as exc:
            setting = self._setting_that_differs(meta) if strict else None
            raise CheckpointError(f"{where} {setting}" if setting else f"{where}: {exc}") from exc
        if partial:
            warnings.warn(partial, stacklevel=2)
        skipped = meta.get("skipped_steps", 0)
        self.skipped_steps = skipped if isinstance(skipped, int) and skipped >= 0 else 0
        return dict(meta.get("user", {}))

    def _setting_that_differs(self, meta: Mapping[str, Any]) -> str | None:
        """Where a strict load found other tensors than the session's: the setting recorded in
        the checkpoint that explains it (accumulation on / off, the trained set), said instead
        of the tensor names; None when neither differs. Settings that differ while the tensors
        match (accumulation 2 vs 4, a weight frozen under stateless SGD) load as before."""
        steps = meta.get("accumulation_steps")
        ours = self.config.update.accumulation_steps
        if isinstance(steps, int) and steps != ours:
            return (f"was written with accumulation_steps {steps} (CLI --accumulate), the session "
                    f"uses {ours}, whose state differs: train with the same")
        trained = meta.get("trained")
        if isinstance(trained, list) and sorted(trained) != sorted(self.artifacts.trained):
            now, then = set(self.artifacts.trained), set(trained)
            foreign = sorted(then - set(self.artifacts.params))
            if foreign:
                return (f"was written for another model: it trained {_listed(foreign)}, which this "
                        f"model does not have (its weights: {_listed(self.artifacts.params)}); load a "
                        "checkpoint saved for this model")
            parts = [f"{label} {sorted(names)[:5]}{' ...' if len(names) > 5 else ''}"
                     for label, names in (("frozen now", then - now), ("trained now, not then", now - then))
                     if names]
            return (f"was written training other weights ({'; '.join(parts)}), whose optimizer state "
                    "differs: train the same set (CLI --freeze, weights_to_train)")
        return None

    def _check_overlap(self, tensors: Mapping[str, Any], where: str) -> str | None:
        """strict=False: refuse a checkpoint sharing no weight or optimizer state with the
        session (only counters would load); else what a partial load skips, or None."""
        names = self.names
        counters = {names.step, names.loss_scale, names.stable_steps, MICRO_STEP_KEY}
        ours = [n for n in self.store.names() if n not in counters]
        theirs = [n for n in tensors if n not in counters]
        matched = [n for n in theirs if n in self.store]
        if not matched:
            raise CheckpointError(
                f"{where} does not fit this model: none of its {len(theirs)} weight and state "
                f"tensors matches the model's {len(ours)} (it holds {_listed(sorted(theirs)) or 'none'}; "
                f"the model has {_listed(self.artifacts.params)}); it was written for another "
                "model: load a checkpoint saved by a session of this model, or rename its tensors "
                "and pass them to load_state()")
        unexpected = sorted(set(theirs) - set(matched))
        missing = sorted(set(ours) - set(matched))
        if not unexpected and not missing:
            return None
        parts = []
        if unexpected:
            parts.append(f"skipped {len(unexpected)} tensor(s) the model does not have "
                         f"({_listed(unexpected)})")
        if missing:
            parts.append(f"{len(missing)} of the model's kept their current values, absent "
                         f"from the file ({_listed(missing)})")
        return (f"{where} loaded with strict=False: {len(matched)} of its {len(theirs)} weight "
                "and state tensors loaded; " + "; ".join(parts))

    def inference_model(self) -> onnx.ModelProto:
        """The eval model with the current weights as initializers."""
        return inference_model(self.artifacts, self.get_model_state()["full_precision"])

    def export_inference_model(self, path: str | os.PathLike, keep_loss: bool = True) -> None:
        """Save the eval model with the current weights, written from the session's buffers
        (with external data, ``<path>.data``, for weights of 1 GiB or more; see
        :func:`gradgraph.io.save_model`). ``keep_loss=False`` (``gradgraph train``'s
        ``inference.onnx``): the loss and the inputs only it reads are left out when the model
        has other outputs (see :func:`gradgraph.training.build.inference_ir`)."""
        views = self.get_state_views()
        save_model(inference_ir(self.artifacts, {n: views[n] for n in self.artifacts.params}, keep_loss),
                   path)

    def get_providers(self) -> list[str]:
        return self._train.session.get_providers()
