"""Held tensors as OrtValues, and graphs run against them through IOBinding.

A :class:`StateStore` keeps one OrtValue per held tensor on the session's device, plus a
spare of the same shape for each tensor a graph updates. A :class:`GraphRunner` binds the
current values as inputs and the spares as the ``X.out`` outputs, runs, then swaps them:
weights and optimizer state never travel through host memory between steps. An output the
runner is told it may write in place (``inplace``, see :func:`gradgraph.training.step_split.aliasing`)
is bound to its input's own OrtValue instead: no spare, no swap. Outputs marked
``gradgraph.valid_if`` (a training graph built with ``UpdateOptions.select_in_graph=False``)
are swapped in only when their flag output is true: a skipped step keeps the previous values.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import threading
import weakref
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from gradgraph.feeds import NP_OF_ORT, check_feeds, unshaped_inputs
from gradgraph.runtime.compat import inference_session
from passes.marks import STAGE_KEY, Role
from passes.optimizer.optimizer_pass import VALID_IF_KEY, TrainingNames
from passes.recompute.recompute_pass import SESSION_DISABLED_OPTIMIZERS

# onnxruntime optimizers that must not run on training graphs (real dropout must stay).
DISABLED_OPTIMIZERS = ("EliminateDropout",)

# SessionOptions.log_severity_level: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal; -1 (the
# default) takes the default logger's, warning. A failing run makes onnxruntime log an
# "[E:onnxruntime:...]" line (level 3 still prints it) before it raises; the exception is
# reported as a typed error (the CLI's one line), so sessions log fatal messages only, unless
# the user's sess_options set a level of their own.
QUIET_LOG_LEVEL = 4


class StateStore:
    """Named OrtValues on one device, each with a lazily created spare for double buffering."""

    def __init__(self, device: str = "cpu", device_id: int = 0) -> None:
        self.device = device
        self.device_id = device_id
        self.values: dict[str, ort.OrtValue] = {}
        self.versions: dict[str, int] = {}  # times each value was set from outside the runs
        self._spares: dict[str, ort.OrtValue] = {}
        # Runners whose kept IOBindings hold this store's OrtValues: told when one is replaced.
        self._runners: weakref.WeakSet[GraphRunner] = weakref.WeakSet()

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def names(self) -> list[str]:
        return list(self.values)

    def set(self, name: str, array: np.ndarray, owned: bool = False) -> None:
        """Hold ``array`` as ``name``: a copy (onnxruntime writes into held buffers), or the
        array itself when ``owned`` (a new, writable array no one else uses)."""
        own = owned and array.flags.writeable and array.flags.c_contiguous
        array = array if own else np.array(array, order="C", copy=True)
        self.values[name] = ort.OrtValue.ortvalue_from_numpy(array, self.device, self.device_id)
        self.versions[name] = self.versions.get(name, 0) + 1
        self._spares.pop(name, None)
        for runner in self._runners:  # their bindings would keep the replaced value alive
            runner.forget_bindings()

    def watch(self, runner: GraphRunner) -> None:
        self._runners.add(runner)

    def get(self, name: str) -> np.ndarray:
        return np.array(self.values[name].numpy(), copy=True)

    def view(self, name: str) -> np.ndarray:
        """The held array itself (CPU: no copy; valid until the next step swaps the buffers)."""
        return self.values[name].numpy()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.values[name].shape())

    def dtype(self, name: str) -> np.dtype:
        return self.get_spec(name)[1]

    def get_spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        value = self.values[name]
        return tuple(value.shape()), np.dtype(NP_OF_ORT[value.data_type()])

    def spare(self, name: str) -> ort.OrtValue:
        spare = self._spares.get(name)
        if spare is None:
            shape, dtype = self.get_spec(name)
            spare = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device,
                                                              self.device_id)
            self._spares[name] = spare
        return spare

    def swap(self, name: str) -> None:
        self.values[name], self._spares[name] = self._spares[name], self.values[name]




def type_proto(arg: ort.NodeArg) -> onnx.TypeProto:
    """onnxruntime's type of a graph output (``tensor(float)``, its shape) as an ONNX type."""
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(NP_OF_ORT[arg.type]))
    shape = [d if isinstance(d, (int, str)) else None for d in arg.shape] if arg.shape is not None else None
    return onnx.helper.make_tensor_type_proto(elem, shape)


_SHARED_ARENA: list[bool] = []


def share_arena(options: ort.SessionOptions) -> None:
    """Sessions given these options allocate from one CPU arena of the process (registered once):
    the update and its finite check, run one after the other, reuse the same memory."""
    if not _SHARED_ARENA:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
        _SHARED_ARENA.append(True)
    options.add_session_config_entry("session.use_env_allocators", "1")


def no_spinning(options: ort.SessionOptions) -> None:
    """The session's intra-op threads sleep as soon as a run ends instead of spinning: the
    update and its check run between two gradient runs, and their spinning threads took the
    cores from the next gradient run (the plain CNN's step 1.9x slower on 2 cores)."""
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")


_COPIED_OPTIONS = ("intra_op_num_threads", "inter_op_num_threads", "graph_optimization_level",
                   "execution_mode", "execution_order", "enable_cpu_mem_arena", "enable_mem_pattern",
                   "log_severity_level", "log_verbosity_level", "optimized_model_filepath",
                   "use_deterministic_compute", "enable_mem_reuse", "enable_profiling",
                   "profile_file_prefix")


def copy_session_options(options: ort.SessionOptions | None) -> ort.SessionOptions:
    """A new SessionOptions with what a user may have set on ``options`` (never edited)."""
    copy = ort.SessionOptions()
    if options is not None:
        for attr in _COPIED_OPTIONS:
            setattr(copy, attr, getattr(options, attr))
    return copy


def side_session_options(options: ort.SessionOptions | None) -> ort.SessionOptions:
    """Options of a session that runs between two gradient runs (the update, its check): the
    user's (:func:`copy_session_options`), the process's shared arena, no spinning threads."""
    copy = copy_session_options(options)
    share_arena(copy)
    no_spinning(copy)
    return copy


def has_recompute(model: onnx.ModelProto) -> bool:
    return any(p.key == STAGE_KEY and p.value == Role.RECOMPUTE.value
               for node in model.graph.node for p in node.metadata_props)


class GraphRunner:
    """One onnxruntime session whose held inputs come from, and return to, a StateStore.

    A graph holding recompute clones runs without onnxruntime's common-subexpression
    elimination, which merges the clones back into their originals; its execution order is the
    user's (default: onnxruntime's), see :mod:`passes.recompute.recompute_pass` for the
    measurements behind that choice.
    """

    def __init__(self, model: onnx.ModelProto, held: set[str], names: TrainingNames,
                 sess_options: ort.SessionOptions | None, providers: Sequence[Any] | None,
                 provider_options: Sequence[dict[str, Any]] | None, *,
                 inplace: Collection[str] = (), carried: Sequence[str] = (),
                 reuse: Mapping[str, str] | None = None) -> None:
        """``inplace``: held inputs whose (unconditional) update is written over them;
        ``carried``: outputs a run returns as OrtValues left on the store's device (the
        gradients a split step hands to its update run); ``reuse``: {output: input} outputs
        written over an input fed as an OrtValue (see step_split.reusable_inputs)."""
        disabled = list(DISABLED_OPTIMIZERS)
        if has_recompute(model):
            disabled += list(SESSION_DISABLED_OPTIMIZERS)
        options = sess_options if sess_options is not None else ort.SessionOptions()
        level, pattern = options.log_severity_level, options.enable_mem_pattern
        if level < 0:  # not set by the user; the session keeps the level it is created with
            options.log_severity_level = QUIET_LOG_LEVEL
        # onnxruntime's memory pattern asks the arena for one block of the whole step's
        # intermediates from the second run on; the arena, grown piecemeal by the first run,
        # then adds that block beside what it has: the BERT-like benchmark's peak RSS was 164
        # MB higher with it, its step time the same (tools/profile_training.py). Off here.
        options.enable_mem_pattern = False
        try:
            self.session = inference_session(model, options, providers=providers,
                                             provider_options=provider_options, disabled_optimizers=disabled)
        finally:  # the user's sess_options are never changed
            options.log_severity_level, options.enable_mem_pattern = level, pattern
        inputs = [i.name for i in self.session.get_inputs()]
        outputs = [o.name for o in self.session.get_outputs()]
        self.input_types = {i.name: i.type for i in self.session.get_inputs()}
        self.held_inputs = [n for n in inputs if n in held]
        self.feed_names = [n for n in inputs if n not in held]
        self.internal = [n for n in (names.learning_rate, names.reset) if n in inputs]
        self.updates = {n: names.updated(n) for n in self.held_inputs
                        if names.updated(n) in outputs}
        updated = set(self.updates.values())
        self.carried = list(carried)
        self.reuse = {i: o for o, i in (reuse or {}).items()}  # input -> the output written over it
        hidden = set(self.carried) | set(self.reuse.values())
        self.fetchable = [n for n in outputs if n not in updated and n not in hidden]
        # Runtime selection (UpdateOptions.select_in_graph=False): the outputs marked valid_if
        # replace their inputs only when that flag output is true.
        valid_if = {o.name: p.value for o in model.graph.output for p in o.metadata_props
                    if p.key == VALID_IF_KEY}
        flags = sorted(set(valid_if.values()))
        if len(flags) > 1 or any(f not in self.fetchable for f in flags):
            raise ValueError(f"graph outputs marked {VALID_IF_KEY!r} must name one bool output of "
                             f"the graph; got {flags}")
        self.select_on = flags[0] if flags else None
        self.conditional = {n for n, out in self.updates.items() if out in valid_if}
        self.inplace = {n for n in inplace if n in self.updates and n not in self.conditional}
        self.swapped = [n for n in self.updates if n not in self.inplace]
        self._inputs = self.session.get_inputs()
        self._unshaped = unshaped_inputs(model)
        self._not_fed = set(self.held_inputs + self.internal)
        # IOBindings with the held inputs and the update outputs bound, by the identity of the
        # OrtValues bound and the fetches (see _kept_binding); the lock keeps them to one run at
        # a time (a concurrent run makes a binding of its own).
        self._bindings: dict[tuple[Any, ...], tuple[tuple[ort.OrtValue, ...], ort.IOBinding]] = {}
        self._device = ("cpu", 0)
        self._lock = threading.Lock()
        # What a kept binding holds for each feed between runs instead of the user's array.
        self._placeholders: dict[str, np.ndarray] = {
            name: np.empty((0,), NP_OF_ORT.get(self.input_types[name], np.float32)) for name in self.feed_names}

    def forget_bindings(self) -> None:
        with self._lock:
            self._bindings.clear()

    def _bound_state(self, store: StateStore) -> tuple[tuple[ort.OrtValue, ...], tuple[ort.OrtValue, ...]]:
        """The store's OrtValues a run binds: the held inputs' values, the updates' outputs
        (their spares, or the values themselves where written in place)."""
        return (tuple(store.values[n] for n in self.held_inputs),
                tuple(store.values[n] if n in self.inplace else store.spare(n) for n in self.updates))

    def _new_binding(self, values: Sequence[ort.OrtValue], spares: Sequence[ort.OrtValue],
                     bound: Sequence[str]) -> ort.IOBinding:
        binding = self.session.io_binding()
        for name, value in zip(self.held_inputs, values, strict=True):
            binding.bind_ortvalue_input(name, value)
        for out, value in zip(self.updates.values(), spares, strict=True):
            binding.bind_ortvalue_output(out, value)
        for name in bound:
            binding.bind_output(name, "cpu")
        self._bind_carried(binding)
        return binding

    def _bind_carried(self, binding: ort.IOBinding) -> None:
        """The carried outputs: made by onnxruntime on the device of the store's values."""
        device, device_id = self._device
        for name in self.carried:
            binding.bind_output(name, device, device_id)

    def _kept_binding(self, store: StateStore, bound: Sequence[str]) -> ort.IOBinding:
        """An IOBinding with the store's current values bound as the held inputs, its spares as
        the update outputs and ``bound`` as outputs: made once per state of the store and kept.

        Binding ~20-40 OrtValues and wrapping them back as outputs cost ~0.1 ms a step on the
        MLP benchmark: the store alternates between two states (values and spares swapped), so
        two bindings serve every step. The key holds the bound OrtValues themselves, so no freed
        value's id can be taken by a new one while its binding is kept; the store drops them all
        when it replaces a value (``StateStore.set``: a loaded state, ZeRO-1's gathered weights
        or a buffer replaced every step), so they never keep a replaced value alive. Between
        runs a kept binding holds neither the feeds nor the fetched outputs (see _run)."""
        self._device = (store.device, store.device_id)
        values, spares = self._bound_state(store)
        key = (tuple(map(id, values)), tuple(map(id, spares)), tuple(bound))
        entry = self._bindings.get(key)
        if entry is not None:
            return entry[1]
        if len(self._bindings) >= 2:  # a third state of the same values (other fetches)
            self._bindings.clear()
        store.watch(self)
        binding = self._new_binding(values, spares, bound)
        self._bindings[key] = (values + spares, binding)
        return binding

    def run(self, store: StateStore, feeds: Mapping[str, Any], fetches: Sequence[str]) -> dict[str, Any]:
        # The session feeds the learning rate and the accumulation reset itself: a user's data
        # is checked against the model's own inputs only.
        check_feeds(self._inputs, feeds, skip=self._not_fed, unshaped=self._unshaped)
        unknown = [n for n in fetches if n not in self.fetchable]
        if unknown:
            raise ValueError(f"cannot fetch {unknown}; this graph outputs {self.fetchable}")
        bound = list(fetches)
        if self.select_on is not None and self.select_on not in bound:
            bound.append(self.select_on)
        if not self._lock.acquire(blocking=False):  # another thread is running this graph
            self._device = (store.device, store.device_id)
            binding = self._new_binding(*self._bound_state(store), bound)
            return self._run(store, feeds, fetches, bound, binding, False)
        try:
            return self._run(store, feeds, fetches, bound, self._kept_binding(store, bound), True)
        finally:
            self._lock.release()

    def _run(self, store: StateStore, feeds: Mapping[str, Any], fetches: Sequence[str],
             bound: Sequence[str], binding: ort.IOBinding, kept_binding: bool) -> dict[str, Any]:
        kept = []  # host arrays must outlive the run
        for name in self.feed_names:
            value = feeds[name]
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
                if name in self.reuse:  # a value of its own, dead once read: written over
                    binding.bind_ortvalue_output(self.reuse[name], value)
                continue
            array = np.array(value, dtype=NP_OF_ORT.get(self.input_types[name]), order="C", copy=None)
            kept.append(array)
            binding.bind_cpu_input(name, array)
        try:
            self.session.run_with_iobinding(binding)
            # The C++ binding's outputs, not IOBinding.get_outputs(), which wraps every output
            # (the updated weights and state too) in a Python OrtValue.
            native = getattr(binding, "_iobinding", None)
            results = native.get_outputs() if native is not None else binding.get_outputs()
            first = len(self.updates)
            arrays: dict[str, Any] = {name: results[first + i].numpy() for i, name in enumerate(bound)}
            first += len(bound)
            for i, name in enumerate(self.carried):  # left where they are, for the next run
                value = results[first + i]
                arrays[name] = value if isinstance(value, ort.OrtValue) else ort.OrtValue(value)
        finally:
            if kept_binding:  # let go of this run's feeds and outputs (the arrays share memory
                # with the outputs: onnxruntime would write the next run into them)
                for name, placeholder in self._placeholders.items():
                    binding.bind_cpu_input(name, placeholder)
                for name in bound:
                    binding.bind_output(name, "cpu")
                self._bind_carried(binding)
                for name in self.reuse.values():
                    binding.bind_output(name, *self._device)
        taken = self.select_on is None or bool(arrays[self.select_on])
        for name in self.swapped:
            if taken or name not in self.conditional:
                store.swap(name)
        return {name: arrays[name] for name in [*fetches, *self.carried]}


# Models whose weights take at least this many bytes get a full garbage collection before the
# trim (it costs ~50 ms in a process that imported torch: worth it only where the memory is).
COLLECT_ABOVE_BYTES = 16 << 20


def release_free_memory(weight_bytes: int | None = None) -> None:
    """Give memory the C heap holds freed back to the system: Python's cyclic garbage is
    collected (the IR's nodes and values refer to each other, so a finished build is freed only
    by the collector; skipped when ``weight_bytes``, the model's, is below
    :data:`COLLECT_ABOVE_BYTES`), then glibc's ``malloc_trim`` (nothing elsewhere). A training
    build frees tens of MB of protobuf and IR objects that glibc keeps, and onnxruntime's arena,
    allocating large blocks, never reuses them (the BERT-like benchmark's peak RSS: 64 MB lower
    with the trim and the gradient-stage model dropped, 42 MB more with the collection)."""
    if weight_bytes is None or weight_bytes >= COLLECT_ABOVE_BYTES:
        gc.collect()
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return
