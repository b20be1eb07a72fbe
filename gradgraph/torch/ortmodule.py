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

Layout: :mod:`gradgraph.torch.runner` (the sessions under autograd, shared with TorchOrtFactory),
:mod:`gradgraph.torch.engine` (one signature's export and graphs), :mod:`gradgraph.torch.signature`
(what a built graph depends on), :mod:`gradgraph.torch.debug` (DebugOptions); this module holds
the ``nn.Module`` that picks and runs them.
"""

from __future__ import annotations

import inspect
import os
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from gradgraph.torch.capture import NotCapturable
from gradgraph.torch.debug import DebugOptions, LogLevel, logger, set_log_level
from gradgraph.torch.engine import (
    OutputMismatch,
    _check_hooks,
    _Engine,
    _mismatch,
    _one_device,
    _training_batch_norms,
)
from gradgraph.torch.export import export_call, restore_buffers, snapshot_buffers
from gradgraph.torch.index_guard import input_describer, run_checked_in_torch
from gradgraph.torch.runner import (
    GraphRunner,
    _sync,
    _to_ort,
    _to_torch,
    apply_runner,
    cuda_providers,
    device_rewrites,
    tf32_option,
)
from gradgraph.torch.signature import (
    _NOT_HELD,
    _attr_key,
    _attr_state,
    _AttrState,
    _changed_attrs,
    _is_plain,
    _named_tensors,
    _shown,
    _signature,
    holds_tensors,
)
from gradgraph.torch.undo import apply_changes

# the public names this module had before the runner, engine and signature moved out
__all__ = ["DebugOptions", "GraphRunner", "LogLevel", "ORTModule", "ORTModuleTorchModelException",
           "OutputMismatch", "apply_runner", "cuda_providers", "device_rewrites", "tf32_option",
           "_to_ort", "_to_torch"]

# a warning when a module has been built for this many call signatures
MANY_SIGNATURES = 16
# the most signatures whose graphs (and sessions) a module keeps; older ones are built again
MAX_ENGINES = 32


class ORTModuleTorchModelException(Exception):
    """Raised for a change to ORTModule that it does not support (``add_module``)."""



def _keys_of_wrapped_module(state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """An ORTModule inside another module: its ``state_dict`` names the wrapped module's tensors
    without ``_original_module.`` (as ``ORTModule.state_dict`` does), and torch's recursive load
    reaches them through that child: the keys under ``prefix`` move there, so a model holding an
    ORTModule loads its own state_dict, and a plain torch checkpoint of the same model."""
    inner = prefix + "_original_module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


def _check_threads(threads: Any, force: bool) -> None:
    """``threads``: None (onnxruntime's default) or an int from 1 to the machine's core count
    (more only with ``force_threads=True``: each session would start that many threads)."""
    if not isinstance(force, bool):
        raise TypeError(f"ORTModule: force_threads must be True or False, not {force!r}")
    if threads is None:
        return
    if not isinstance(threads, int) or isinstance(threads, bool):
        raise TypeError(f"ORTModule: threads must be an int (onnxruntime's intra-op threads) or None, "
                        f"not {type(threads).__name__} {threads!r}")
    cores = os.cpu_count() or 1
    if threads < 1:
        raise ValueError(f"ORTModule: threads must be at least 1 (or None for onnxruntime's default), "
                         f"not {threads}")
    if threads > cores and not force:
        raise ValueError(f"ORTModule: threads={threads} is more than this machine's {cores} cores "
                         "(each onnxruntime session would start that many threads); pass "
                         "force_threads=True to use it anyway")


def _refuse_nested(module: torch.nn.Module) -> None:
    """An ORTModule inside the wrapped module (or wrapped itself) runs its own graphs, which an
    export cannot trace: the outer one falls back to PyTorch, and the inner one still runs in
    onnxruntime."""
    todo: list[tuple[str, torch.nn.Module]] = [("", module)]
    while todo:  # through _modules: ORTModule.named_modules() skips the ORTModule itself
        path, sub = todo.pop()
        todo.extend((f"{path}.{name}" if path else name, child) for name, child in sub._modules.items()
                    if child is not None)
        if isinstance(sub, ORTModule):
            where = f"at {path!r} inside {type(module).__name__}" if path else "wrapped in another ORTModule"
            raise NotCapturable(f"its forward calls an ORTModule ({where}; defined at {user_line_of(sub)}), "
                                "whose own onnxruntime graphs an export cannot trace: the outer module "
                                "runs in PyTorch and the inner ORTModule in onnxruntime; wrap only the "
                                "outer or only the inner module")


def user_line_of(sub: ORTModule) -> str:
    """Where the wrapped module's class of ``sub`` is defined."""
    cls = type(sub.module)
    try:
        return f"{os.path.basename(inspect.getsourcefile(cls) or '?')}:{inspect.getsourcelines(cls)[1]}"
    except (OSError, TypeError):
        return cls.__qualname__


class ORTModule(torch.nn.Module):
    """Wraps ``module``; forward and backward run in onnxruntime (module docstring)."""

    def __init__(self, module: torch.nn.Module, debug_options: DebugOptions | None = None, *,
                 fallback: str = "warn", optimize: bool = True, threads: int | None = None,
                 force_threads: bool = False) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"ORTModule wraps a torch.nn.Module, not {type(module).__name__}")
        if debug_options is not None and not isinstance(debug_options, DebugOptions):
            raise TypeError(f"ORTModule: debug_options must be a DebugOptions, not "
                            f"{type(debug_options).__name__}")
        if not isinstance(fallback, str) or fallback not in ("warn", "raise"):
            raise ValueError(f"ORTModule: fallback must be 'warn' (run the module in PyTorch, with "
                             f"one warning) or 'raise', not {fallback!r}")
        if not isinstance(optimize, bool):
            raise TypeError(f"ORTModule: optimize must be True or False, not {optimize!r}")
        _check_threads(threads, force_threads)
        super().__init__()
        self._modules["_original_module"] = module
        self._debug = debug_options or DebugOptions()
        if debug_options is not None:  # as onnxruntime's ORTModule: its log level is global
            set_log_level(self._debug.level)
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
            built = self._build(key, args, kwargs, tensors, training)  # the module as it was
            self._builds += 1
            if self._builds == MANY_SIGNATURES:
                warnings.warn(
                    f"ORTModule: {type(self.module).__name__} has been exported for {self._builds} "
                    "call signatures; each new input shape or dtype, train/eval switch or change of a "
                    "submodule's plain attribute exports and builds again (slow): pad inputs to a "
                    "few shapes", RuntimeWarning, stacklevel=4)
            # the signature the module has once a forward's side effects are applied (after
            # the first run, or a run in PyTorch)
            def resign() -> Any:
                return _signature(training, in_spec, leaves, self.module, _named_tensors(self.module),
                                  self._skip)

            if isinstance(built, Exception):
                return self._instead(built, [key], resign, args, kwargs, depth=0)
            self._engines[key] = built
            built.resign = resign
            if training:
                self._warn_sparse()
            self._evict()
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
        bad = engine.index_guard.find(tensors, input_describer(self.module.forward, args, kwargs)) \
            if engine.index_guard else None
        if bad is not None:  # torch's exception for these indices, or its result where it takes them
            return run_checked_in_torch(lambda: self._run_in_torch(args, kwargs), bad)
        if engine.first_run:
            return self._first_run(engine, args, kwargs, tensors, named, training)
        try:
            return self._run(engine, tensors, named, training)
        except Exception as exc:
            if not type(exc).__module__.startswith("onnxruntime"):
                raise
            # onnxruntime's own error (an index out of range, a shape): torch's exception for
            # the same call, or the call's result from PyTorch where torch has none
            return self._instead(exc, [k for k, e in self._engines.items() if e is engine], None, args,
                                 kwargs, depth=0)

    def _instead(self, exc: Exception, keys: list[Any], resign: Any, args: tuple, kwargs: dict,
                 depth: int) -> Any:
        """The call in PyTorch after building or running its graphs failed with ``exc``: torch's
        own exception for these inputs is raised as torch raises it (an index out of range, a
        wrong shape: the signature is kept); else the signature ``keys`` falls back (one warning,
        or ``exc`` raised with ``fallback='raise'``) and this call's result is PyTorch's (its
        forward run once)."""
        result = self._run_in_torch(args, kwargs)
        for k in keys:
            self._engines[k] = None
        if resign is not None:  # and under the signature the forward's side effects leave
            self._engines.setdefault(resign(), None)
        self._fail(exc, stacklevel=6 + depth)
        return result

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
            outs = apply_runner(engine.runner, feeds, lambda kept: engine.write_back(kept, named, tensors))
        else:
            runner = engine.runner
            values = {n: runner.feeds.get(n, t) for n, t in zip(runner.feed_names, feeds)}
            _sync(engine.device)
            kept = runner.run_forward(values)
            engine.write_back(kept, named, tensors)  # a train-mode BatchNorm under no_grad updates its statistics
            outs = tuple(_to_torch(kept[n], engine.device) for n in runner.user_outputs)
        return engine.exported.rebuild(list(outs))

    def _first_run(self, engine: _Engine, args: tuple, kwargs: dict, tensors: list[torch.Tensor],
                   named: dict[str, torch.Tensor], training: bool) -> Any:
        """A signature's first run: a failure, or outputs unlike PyTorch's (the export lost part
        of the forward), make the signature fall back (or raise) like a failed build, and the
        forward then runs once in PyTorch. Else the attributes the forward set in the probe run
        (export.py, trap 12) are set once, as one call of the forward sets them; those keep out
        of the signature while they keep that value (a counter does not rebuild on every call;
        a user's change brings them back), and they are warned about once."""
        saved = snapshot_buffers(self.module)
        inputs = {k: tensors[k].detach().clone() for k in engine.changed_inputs}
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
            with torch.no_grad():
                for k, value in inputs.items():
                    tensors[k].copy_(value)
            if not isinstance(exc, OutputMismatch):
                explained = engine.explain(exc, tensors)
                if explained is not exc:
                    explained.__cause__ = exc
                exc = explained
            resign, engine.resign = engine.resign, None
            return self._instead(exc, [k for k, e in self._engines.items() if e is engine], resign, args,
                                 kwargs, depth=1)
        engine.first_run = False
        engine.exported.release_weights()  # the export's copy of the weights: no longer needed
        state = _attr_state(self.module)
        apply_changes(engine.exported.attr_changes)
        engine.exported.attr_changes = []
        changed = _changed_attrs(self.module, state)
        self._own(changed)
        self._engines.setdefault(engine.resign(), engine)
        engine.resign = None
        self._warn_changed_attrs({k: (path, state[k][1] if k in state else None, new)
                                  for k, (path, new, _) in changed.items()})
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
               training: bool) -> _Engine | Exception:
        start = time.perf_counter()
        logger.info("ORTModule: exporting %s for a new call signature (%s)", type(self.module).__name__,
                    ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in tensors))
        try:
            device = _one_device(tensors, _named_tensors(self.module))
            if device.type == "cuda":
                cuda_providers(device)  # no CUDA provider: say so before exporting
            norms = _training_batch_norms(self.module)  # refuses what is unsupported before exporting
            _check_hooks(self.module, training, self._hook_warned)
            _refuse_nested(self.module)
            held = holds_tensors(pytree.tree_leaves((tuple(args), dict(kwargs))))
            if held is not None:
                raise NotCapturable(
                    f"an argument of type {held} holds tensors that torch's pytree does not flatten "
                    "(the export would bake them in as constants, without gradients): pass the "
                    "tensors as arguments, or register the type with "
                    "torch.utils._pytree.register_dataclass")
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
            return exc
        logger.info("ORTModule: built the %s graphs in %.1f s (export %.1f s, %s exporter; graphs and "
                    "sessions %.1f s)", "training" if training else "inference",
                    time.perf_counter() - start, exported_at - start, exported.exporter,
                    time.perf_counter() - exported_at)
        return engine

    def _fail(self, exc: Exception, stacklevel: int = 6) -> None:
        """A signature that cannot run in onnxruntime: raise, or warn once and use PyTorch."""
        if self._fallback == "raise":
            raise exc
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:600] if str(exc) else ''}"
        if "Could not find an implementation" in reason:
            reason += (" - onnxruntime's CPU kernels lack this op for this element type"
                       + (" (torch.autocast is on: its float16 / bfloat16 casts are in the graph)"
                          if torch.is_autocast_enabled("cpu") else ""))
        if isinstance(exc, NotCapturable):  # the construct and its line, said as they are
            because = f"because {str(exc).strip()}"
        else:
            because = f"because building or running its onnxruntime graphs failed ({reason})"
        warnings.warn(f"ORTModule: {type(self.module).__name__} runs in PyTorch for this input "
                      f"signature, {because}; pass fallback='raise' to see the error", RuntimeWarning,
                      stacklevel=stacklevel)

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
