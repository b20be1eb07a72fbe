"""Export a ``torch.nn.Module`` call to ONNX for training: flat tensors in, flat tensors out.

The module's forward may take and return nested tuples / lists / dicts (and HF ``ModelOutput``s)
of tensors; the export sees a wrapper whose forward takes the flat tensor leaves of the call and
returns the flat tensor leaves of the result (``torch.utils._pytree``), so every ONNX input and
output is a tensor and the structure is rebuilt on the torch side.

Exporter traps (torch 2.13), handled here:

1. the dynamo exporter's default ``optimize=True`` folds parameters into derived constants:
   ``optimize=False``, and every parameter and buffer is then an initializer under its module
   path (``module.<fqn>``), mapped back to the torch tensor by that name;
2. its torchlib writes BatchNorm in inference mode even for a module in train mode: a custom
   translation keeps ``training_mode=1`` (batch statistics);
3. when the dynamo exporter fails, the TorchScript exporter is tried (``training=TRAINING``,
   no constant folding); its initializer names are the parameters' paths as well;
4. a forward that updates a buffer in place (``self.mean.mul_(0.9).add_(...)``, a step counter)
   or reassigns it (``self.count = self.count + 1``) is exported without the update: the dynamo exporter lists it as a BUFFER_MUTATION of the
   program and leaves it out of the ONNX graph. The call is run once before exporting to find
   such buffers (reassigned, or their version counter or value changed; BatchNorm's own statistics are handled
   by trap 2), and the wrapper then returns each one's new value after the module's outputs
   (``ExportedCall.mutations`` names them, in that order), for the caller to write back.
5. the ONNX graph has no stop-gradient: a value the forward computes under ``torch.no_grad()``
   or takes ``.detach()`` / ``.data`` of, from tensors that require grad, and then uses in a
   differentiable computation, would be differentiated through. With ``stop_gradients=True``
   the probe run (with grad enabled) watches for that (:class:`gradgraph.torch.capture.CaptureWatch`) and the
   export is refused (:class:`StopsGradient`) naming the call; a no_grad update of a buffer
   that the forward does not read afterwards is fine. The probe's outputs are kept
   (``ExportedCall.reference_outputs``) so that the caller can compare the graph's first run
   with PyTorch (exporters lose some semantics silently: a fully masked attention row).
6. torchlib writes ``cross_entropy`` as SoftmaxCrossEntropyLoss for every call: it drops
   ``label_smoothing`` and makes an invalid model for probability targets. A custom
   translation (:func:`cross_entropy_translation`) writes torch's formulas for those two.
7. torchlib's attention with a boolean mask gives a query that sees no key the average of the
   values (torch: zeros; left-padded batches have such rows): :func:`attention_translation`.
8. torchlib writes EmbeddingBag as a Loop over a sequence, which has no gradient here:
   :func:`embedding_bag_translation` writes it with scatters; it writes no cdist / pdist at all
   (the TorchScript exporter's cdist ignores ``p``): :func:`distance_translation`; its
   multinomial is drawn in onnxruntime, with replacement always: :func:`multinomial_translation`.
9. options that only change torch's gradient have no ONNX form, and both exporters drop them
   silently: ``embedding`` / ``embedding_bag`` with ``scale_grad_by_freq=True`` (each row's
   gradient divided by its index's count in the batch). With ``stop_gradients=True`` the probe
   run sees such a call and the export is refused, naming it.
10. torchlib writes ``scaled_dot_product_attention``'s dropout as an inference Dropout (no
   ``training_mode``: the identity): :func:`_attention_dropout_in_training`.
11. a forward that changes an input in place (``x.mul_(2)``) is exported without the change
   (a USER_INPUT_MUTATION of the program): the probe and the exporters run on copies of the
   inputs, the probe finds the changed ones (their version counters), and the wrapper returns
   their new values last (``ExportedCall.input_mutations``), for the caller to copy back.
12. exporting runs the forward's Python code more than once: what the probe and the exporters
   did to the module's attributes is undone (:mod:`gradgraph.torch.undo`); what the probe did
   is kept in ``ExportedCall.attr_changes``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import torch
from torch.utils import _pytree as pytree

from gradgraph.torch.capture import CaptureWatch, NotCapturable, functions_in_graph
from gradgraph.torch.translations import (
    attention_translation,
    bn_train_translation,
    cross_entropy_translation,
    distance_translation,
    embedding_bag_translation,
    multinomial_translation,
)
from gradgraph.torch.undo import AttrSnapshot
from passes.exports.conventions import is_attention_dropout, train_dropouts

PREFIX = "module."
# the translations moved to gradgraph.torch.translations; imported from here as before
__all__ = ["ExportFailed", "ExportedCall", "StopsGradient", "attention_translation", "bn_train_translation",
           "cross_entropy_translation", "embedding_bag_translation", "export_call", "restore_buffers",
           "snapshot_buffers"]


class ExportFailed(RuntimeError):
    """Neither exporter produced a usable model; the message has both reasons."""


@dataclasses.dataclass
class ExportedCall:
    model: onnx.ModelProto
    input_names: list[str]  # one per flat tensor input, in order
    output_names: list[str]  # one per flat tensor output, in order
    output_spec: Any  # pytree spec of the result, tensors as leaves
    parameters: dict[str, str]  # ONNX initializer -> torch parameter path
    buffers: dict[str, str]  # ONNX initializer -> torch buffer path
    exporter: str
    # torch paths of the buffers the call updates in place (trap 4): their new values are the
    # graph outputs after the module's own, in this order
    mutations: list[str] = dataclasses.field(default_factory=list)
    # the module's own flat outputs as PyTorch computed them in the probe run (trap 5), and
    # the values the probe left in the buffers of ``mutations``
    reference_outputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    reference_mutations: list[torch.Tensor] = dataclasses.field(default_factory=list)
    # positions among output_spec's leaves that are None (``return out, None``): not graph outputs
    output_nones: list[int] = dataclasses.field(default_factory=list)
    # per module output, whether it required grad in the probe run (with stop_gradients): one
    # that did not (a reentrant checkpoint of inputs that need no grad) gets none in the graph
    output_requires_grad: list[bool] = dataclasses.field(default_factory=list)
    # flat tensor inputs the forward changes in place (trap 11): their new values are the graph
    # outputs after the buffers', in this order
    input_mutations: list[int] = dataclasses.field(default_factory=list)
    # what the probe run did to the module's attributes (trap 12), undone after exporting: one
    # call's side effects, for the caller to apply where it runs the graph
    attr_changes: list[tuple[torch.nn.Module, str, Any]] = dataclasses.field(default_factory=list)

    def release_weights(self) -> None:
        """Drop the parameters' and buffers' data from ``model`` (a new ModelProto without
        those initializers: protobuf frees a message's memory with the whole message only).
        Called once the signature's graphs ran: the sessions read the module's tensors, and
        the exporter's copy of every weight would stay beside torch's (1x the weights more)."""
        held = set(self.parameters) | set(self.buffers)
        if not any(t.name in held for t in self.model.graph.initializer):
            return
        old, slim = self.model, onnx.ModelProto()
        slim.ir_version, slim.producer_name, slim.producer_version = \
            old.ir_version, old.producer_name, old.producer_version
        slim.domain, slim.model_version, slim.doc_string = old.domain, old.model_version, old.doc_string
        slim.opset_import.extend(old.opset_import)
        slim.metadata_props.extend(old.metadata_props)
        slim.functions.extend(old.functions)
        graph = old.graph
        slim.graph.name, slim.graph.doc_string = graph.name, graph.doc_string
        slim.graph.node.extend(graph.node)
        slim.graph.input.extend(graph.input)
        slim.graph.output.extend(graph.output)
        slim.graph.value_info.extend(graph.value_info)
        slim.graph.initializer.extend(t for t in graph.initializer if t.name not in held)
        slim.graph.sparse_initializer.extend(graph.sparse_initializer)
        self.model = slim

    @property
    def n_outputs(self) -> int:
        """The module's own tensor outputs (graph outputs before the buffer updates)."""
        return self.output_spec.num_leaves - len(self.output_nones)

    def rebuild(self, tensors: list) -> Any:
        """The module's result: ``tensors`` (its tensor outputs in order) with the Nones put back."""
        leaves, it = [], iter(tensors)
        nones = set(self.output_nones)
        for i in range(self.output_spec.num_leaves):
            leaves.append(None if i in nones else next(it))
        return pytree.tree_unflatten(leaves, self.output_spec)


class StopsGradient(ExportFailed):
    """The forward stops gradients where the ONNX graph cannot (trap 5)."""


class _Flat(torch.nn.Module):
    """``forward(*flat tensors)`` -> flat tensor leaves of ``module(*args, **kwargs)``."""

    def __init__(self, module: torch.nn.Module, in_spec: Any, constants: dict[int, Any]) -> None:
        super().__init__()
        self.module = module
        # the wrapper's own flag as the module's (not ``train()``: that would set every submodule),
        # so that the TorchScript exporter's PRESERVE mode exports the modules as they are
        self.training = module.training
        self._in_spec = in_spec
        self._constants = constants  # leaves that are not tensors, by position
        self.out_spec: Any = None
        self.out_nones: list[int] = []
        self.mutations: list[str] = []  # buffers whose new values follow the outputs (trap 4)
        self.input_mutations: list[int] = []  # inputs changed in place, after those (trap 11)

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves, it = [], iter(tensors)
        for i in range(self._in_spec.num_leaves):
            leaves.append(self._constants[i] if i in self._constants else next(it))
        args, kwargs = pytree.tree_unflatten(leaves, self._in_spec)
        out = self.module(*args, **kwargs)
        flat, self.out_spec = pytree.tree_flatten(_plain(out))
        if _register_caches([x for x in flat if x is not None and not isinstance(x, torch.Tensor)]):
            flat, self.out_spec = pytree.tree_flatten(_plain(out))  # their tensors are outputs now
        self.out_nones = [i for i, x in enumerate(flat) if x is None]  # given back as None
        flat = [x for x in flat if x is not None]
        bad = [type(x).__name__ for x in flat if not isinstance(x, torch.Tensor)]
        if bad:
            hint = (" (a transformers key/value cache: pass use_cache=False to the call or set "
                    "config.use_cache = False)" if any("Cache" in b for b in bad) else "")
            raise TypeError(f"ORTModule: the module returned non-tensor values ({', '.join(bad)}){hint}; "
                            "return tensors, or tuples/lists/dicts of tensors")
        return (*flat, *(self.module.get_buffer(path).clone() for path in self.mutations),
                *(tensors[k].clone() for k in self.input_mutations))


def _register_caches(values: list) -> bool:
    """transformers' key/value caches among ``values`` (a decoder's default ``use_cache=True``
    returns a ``DynamicCache``) registered with torch's pytree as transformers registers them
    for torch.export (``register_cache_pytrees_for_model``): their tensors become graph outputs
    and the cache is rebuilt around them on return. True where one was registered."""
    caches = [type(v) for v in values if type(v).__name__.endswith("Cache") and type(v) not in pytree.SUPPORTED_NODES
              and "<locals>" not in type(v).__qualname__]  # rebuilt by their import path
    if not caches:
        return False
    try:
        from transformers.exporters.exporter_dynamo import register_pytree_node
    except ImportError:  # an older transformers: the non-tensor output is refused below
        return False
    try:
        for cls in caches:
            register_pytree_node(cls)
    except Exception:  # noqa: BLE001 - a class transformers cannot name (a local one): refused below
        return False
    return True


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


# the exporters' boilerplate lines, never the reason; and where a line's reason ends
_BOILERPLATE = ("The error above occurred", "Create an issue", "If you would like to view", "draft_export",
                "Create an error report", "- If there is", "Refer to the full stack trace",
                "Torch IR graph at exception", "This is step", "For more information")
_TAILS = ("Please feel free", "Please report", " [Caused by", "See the stack trace")
# a line with one of these says what is not supported: the most useful line of a message
_KEYS = ("Unsupported", "not supported", "No ONNX function", "No decompositions", "unsupported")


# torch.export's summary line: "<class 'torch.fx....GuardOnDataDependentSymNode'>: Could not ..."
_CLASS_LINE = re.compile(r"^<class '(?:[\w.]+\.)?(\w+)'>:\s*")
_CLASS_NAME = re.compile(r"^\w+(Error|Exception|Node|Failure): ")


def _reason(exc: BaseException) -> str:
    """One readable line of an exporter's error: no colour codes or boilerplate, the line that
    says what is unsupported, else torch.export's exception summary, else the last that names
    an error; a heading (a line ending in ':') or a stack line is not a reason."""
    lines = []
    for line in str(exc).splitlines():
        line = _ANSI.sub("", line).strip()
        if not line or any(b in line for b in _BOILERPLATE) or line.endswith(":") or line.startswith("File \""):
            continue
        for tail in _TAILS:
            line = line.split(tail)[0].strip()
        if line:
            lines.append(_CLASS_LINE.sub(lambda m: f"{m.group(1)}: ", line))
    keyed = [line for line in lines if any(k in line for k in _KEYS)]
    summary = [line for line in lines if _CLASS_NAME.match(line)]
    named = [line for line in lines if "Error" in line or "error" in line]
    best = keyed[0] if keyed else summary[0] if summary else named[-1] if named else lines[0] if lines else ""
    return best if len(best) <= 400 else best[:397] + "..."


def _plain(out: Any) -> Any:
    """A dict subclass that torch's pytree does not know -> a plain dict of its non-None fields.

    HF ``ModelOutput``s are registered pytree nodes (transformers does it), so they come back
    as the same class (``out.loss`` works); other ``OrderedDict``-like outputs come back as dicts.
    """
    if isinstance(out, dict) and type(out) is not dict and type(out) not in pytree.SUPPORTED_NODES:
        return {k: v for k, v in out.items() if v is not None}
    return out


def export_call(module: torch.nn.Module, args: tuple, kwargs: dict, *, training: bool,
                exporter: str = "auto", opset: int = 18,
                dynamic: list[dict[int, str]] | None = None, stop_gradients: bool = False) -> ExportedCall:
    """Export ``module(*args, **kwargs)`` (see the module docstring).

    ``stop_gradients``: the call's gradient will be built: refuse a forward that stops
    gradients (trap 5) with :class:`StopsGradient`.

    ``dynamic``: per flat tensor input, the axes to export as symbolic dimensions, named (the
    exporter may still specialize an axis the module's code fixes; the result's input shapes
    say which stayed symbolic).
    """
    leaves, in_spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    constants = {i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)}
    # copies: a forward that changes an input in place (trap 11) changes them, not the caller's
    tensors = tuple(x.detach().clone() for x in leaves if isinstance(x, torch.Tensor))
    flat = _Flat(module, in_spec, constants)
    input_names = [f"input_{i}" for i in range(len(tensors))]
    order = ["dynamo", "legacy"] if exporter == "auto" else [exporter]
    # Exporting runs the module (tracing, and once here for the output structure): a train-mode
    # BatchNorm would update its running statistics, a counter would count. The buffers and
    # the attributes are put back afterwards (trap 12).
    saved = snapshot_buffers(module)
    attrs = AttrSnapshot(module)
    modes = [(m, m.training) for m in module.modules()]  # as they are, whatever an exporter does
    try:
        # the probe sees which inputs require grad (trap 5)
        probe_inputs = tuple(t.detach().clone().requires_grad_(t.requires_grad and t.is_floating_point())
                             for t in leaves if isinstance(t, torch.Tensor))
        versions = [t._version for t in probe_inputs]
        flat.mutations, reference, updated, requires = _probe(module, flat, probe_inputs, stop_gradients)
        changes = attrs.changes()
        flat.input_mutations = [k for k, (t, v) in enumerate(zip(probe_inputs, versions)) if t._version != v]
        restore_buffers(module, saved)  # the export stores the buffers' values as they are now
        attrs.restore()
        exported = _export_first(module, flat, tensors, input_names, order, training, opset, dynamic)
        exported.reference_outputs, exported.reference_mutations = reference, updated
        exported.output_requires_grad = requires
        exported.attr_changes = changes
        return exported
    finally:
        restore_buffers(module, saved)
        attrs.restore()
        for m, mode in modes:
            m.training = mode


def snapshot_buffers(module: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each buffer of ``module`` by path: the tensor and a copy of its value."""
    return {n: (b, b.detach().clone()) for n, b in module.named_buffers()}


def restore_buffers(module: torch.nn.Module, saved: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every buffer back to its tensor (a forward may have reassigned it) and that tensor's value."""
    with torch.no_grad():
        for name, (buffer, value) in saved.items():
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path)
            if owner._buffers.get(leaf) is not buffer:
                owner._buffers[leaf] = buffer
            buffer.copy_(value)


def _probe(module: torch.nn.Module, flat: _Flat, tensors: tuple,
           stop_gradients: bool) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor], list[bool]]:
    """One run of ``flat(*tensors)`` in PyTorch: the buffers it updates in place, BatchNorm's
    own statistics left out (trap 4), its outputs and those buffers' new values; with
    ``stop_gradients`` it runs with grad enabled and raises :class:`StopsGradient` where trap 5 applies. The caller restores
    the buffers afterwards."""
    norm_stats = {f"{path}.{name}" if path else name
                  for path, m in module.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                  for name in ("running_mean", "running_var", "num_batches_tracked")}
    buffers = [(n, b) for n, b in module.named_buffers() if n not in norm_stats]
    before = [(b._version, b.detach().clone()) for _, b in buffers]
    params = [(n, p, p._version) for n, p in module.named_parameters()]
    watch = CaptureWatch()
    with torch.enable_grad() if stop_gradients else torch.no_grad():
        with watch if stop_gradients else contextlib.nullcontext():
            outputs = flat(*tensors)
    updated = [n for n, p, version in params if p._version != version]
    if updated:  # the graph would compute with the update, never store it (nor stop its gradient)
        raise ExportFailed(
            f"the forward updates the parameter {updated[0]!r} in place (e.g. Embedding(max_norm=...) "
            "renormalizes its weight): the ONNX graph cannot write a parameter; this call ran once "
            "in PyTorch to find it")
    found = watch.found + (functions_in_graph(list(outputs)) if stop_gradients else [])
    if found:
        raise NotCapturable(f"its forward uses {found[0]}" + (f"; also {'; '.join(found[1:3])}" if found[1:] else ""))
    if watch.gradient_only:
        raise ExportFailed(
            f"the forward calls {watch.gradient_only[0]}: torch divides each row's weight gradient "
            "by how often its index occurs in the batch, which an ONNX graph cannot express (both "
            "exporters drop the option); this signature cannot be exported for training")
    if watch.reads:
        raise StopsGradient(
            f"the forward stops a gradient (.detach(), .data or torch.no_grad()) of a value that "
            f"it then uses in a differentiable call ({watch.reads[0]}): the ONNX graph would "
            "differentiate through it, unlike PyTorch; this signature cannot be exported for "
            "training")
    requires = [bool(o.requires_grad) for o in outputs] if stop_gradients else []
    outputs = [o.detach() for o in outputs]  # flat.mutations is still empty: all are the module's
    changed = []
    for (name, b), (version, value) in zip(buffers, before):
        now = module.get_buffer(name)  # ``self.count = self.count + 1`` reassigns the buffer
        if now is not b or b._version != version or not torch.equal(b, value):
            changed.append(name)
    return changed, outputs, [module.get_buffer(name).detach().clone() for name in changed], requires


def _export_first(module: torch.nn.Module, flat: _Flat, tensors: tuple, input_names: list[str],
                  order: list[str], training: bool, opset: int,
                  dynamic: list[dict[int, str]] | None) -> ExportedCall:
    errors = []
    first: BaseException | None = None  # the first exporter's exception: the raised one's cause
    for which in order:
        if which == "legacy" and flat.mutations:
            errors.append(f"legacy: the forward updates the buffers {flat.mutations} in place, which the "
                          "TorchScript exporter bakes into constants")
            continue
        try:
            model = _export(flat, tensors, input_names, which, training, opset, dynamic)
        except Exception as exc:  # noqa: BLE001 - each exporter's reason is reported
            errors.append(f"{which}: {type(exc).__name__}: {_reason(exc)}")
            first = first or exc
            continue
        # every alias of a tied parameter (the exporter may name it by any of them)
        names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        buffer_names = {n for n, _ in module.named_buffers(remove_duplicate=False)}
        params, buffers = {}, {}
        for init in model.graph.initializer:
            path = init.name[len(PREFIX):] if init.name.startswith(PREFIX) else init.name
            if path in names:
                params[init.name] = path
            elif path in buffer_names:
                buffers[init.name] = path
        return ExportedCall(model, [i.name for i in model.graph.input if i.name in set(input_names)],
                            [o.name for o in model.graph.output], flat.out_spec, params, buffers, which,
                            list(flat.mutations), output_nones=list(flat.out_nones),
                            input_mutations=list(flat.input_mutations))
    raise ExportFailed("torch.onnx.export failed: " + "; ".join(errors)) from first


@contextlib.contextmanager
def _quiet_fds() -> Iterator[None]:
    """File descriptors 1 and 2 into a temporary file while the block runs: the TorchScript
    exporter's C++ code prints its whole graph to them when it fails ("Torch IR graph at
    exception"), past ``contextlib.redirect_stdout``; the exception says what failed. Only
    around that exporter (what other threads write meanwhile is lost too); not thread-safe."""
    saved: list[tuple[int, int]] = []
    with tempfile.TemporaryFile() as sink:
        for fd, stream in ((1, sys.__stdout__), (2, sys.__stderr__)):
            try:
                if stream is not None:
                    stream.flush()  # what was written before goes where it was going
                saved.append((fd, os.dup(fd)))
                os.dup2(sink.fileno(), fd)
            except (OSError, ValueError):  # no such descriptor (an embedded interpreter): left as is
                continue
        try:
            yield
        finally:
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)


# the exporters' loggers: their warnings ("torchvision is not installed", "Unable to find user
# code corresponding to ...") are facts about torch's tracing, printed on every export
EXPORTER_LOGGERS = ("torch.onnx", "torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export",
                    "torch._export", "onnxscript")


@contextlib.contextmanager
def _quiet_exporter_logs() -> Iterator[None]:
    """The exporters' loggers at ERROR while exporting, unless ``gradgraph.torch`` logs at INFO
    or below (``DebugOptions(log_level="INFO")``): then they print as they would."""
    if logging.getLogger("gradgraph.torch").isEnabledFor(logging.INFO):
        yield
        return
    loggers = [logging.getLogger(name) for name in EXPORTER_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


_TORCHLIB_REGISTRIES: dict[Any, Any] = {}  # opset version -> torch's registry of torchlib's translations


@contextlib.contextmanager
def _torchlib_registry_once() -> Iterator[None]:
    """torch.onnx.export builds its registry of torchlib's translations on every call (~4,000
    onnxscript functions parsed from their source: 1-2 s, half of a small module's export).
    While the block runs, each call gets a copy of one registry built once per opset (its own
    dict and lists: the call then adds its custom translations to that copy only)."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:  # another torch layout: every call builds its own, as torch does
        yield
        return
    cls = _registration.ONNXRegistry
    original = cls.__dict__.get("from_torchlib")
    if not isinstance(original, classmethod):
        yield
        return
    build = original.__func__

    def from_torchlib(klass: Any, *args: Any, **kwargs: Any) -> Any:
        key = (klass, args, tuple(sorted(kwargs.items())))
        if key not in _TORCHLIB_REGISTRIES:
            _TORCHLIB_REGISTRIES[key] = build(klass, *args, **kwargs)
        base = _TORCHLIB_REGISTRIES[key]
        copy = klass.__new__(klass)
        copy.__dict__.update(base.__dict__)
        copy.functions = {target: list(metas) for target, metas in base.functions.items()}
        return copy

    cls.from_torchlib = classmethod(from_torchlib)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        cls.from_torchlib = original  # type: ignore[method-assign,assignment]


def _export(flat: _Flat, tensors: tuple, names: list[str], which: str, training: bool,
            opset: int, dynamic: list[dict[int, str]] | None) -> onnx.ModelProto:
    sink = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught, \
            contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), _quiet_exporter_logs():
        warnings.simplefilter("always")
        path = os.path.join(tmp, "model.onnx")
        if which == "dynamo":
            has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in flat.modules())
            table = {**cross_entropy_translation(), **attention_translation(), **embedding_bag_translation(),
                     **distance_translation(), **multinomial_translation(),
                     **(bn_train_translation() if training and has_bn else {})}
            shapes = None
            if dynamic:  # the wrapper takes *tensors: one tuple of per-input specs
                shapes = (tuple({axis: torch.export.Dim.AUTO for axis in axes} for axes in dynamic),)
            with _torchlib_registry_once():
                program = torch.onnx.export(flat, tensors, None, input_names=names, dynamo=True,
                                            optimize=False, custom_translation_table=table,
                                            opset_version=opset, dynamic_shapes=shapes)
            if program is None:
                raise ExportFailed("torch.onnx.export(dynamo=True) returned no program")
            # the program's own onnx_ir model (its weights the module's tensors, not copies):
            # one copy into the ModelProto, where saving and loading a file made three
            graph = common_passes.RemoveUnusedNodesPass()(program.model).model  # embedding_bag's extras
            _attention_dropout_in_training(graph, legacy=False)
            return ir.to_proto(graph)
        elif which == "legacy":
            # PRESERVE: TRAINING / EVAL would set every submodule to one mode (a frozen BatchNorm
            # in eval mode inside a training model exported in training mode), and afterwards set
            # them all to the wrapper's mode
            mode = torch.onnx.TrainingMode.PRESERVE
            axes = {n: dict(d) for n, d in zip(names, dynamic or []) if d} or None
            with _quiet_fds():
                torch.onnx.export(flat, tensors, path, input_names=names, dynamo=False, training=mode,
                                  do_constant_folding=False, opset_version=opset, dynamic_axes=axes)
            # The tracer records one path through the code: a Python branch or value taken from
            # a tensor's data is frozen into the graph (it warns "might cause the trace to be
            # incorrect"); such a graph is wrong for other inputs, so it is refused.
            frozen = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)
                      and "might cause the trace to be incorrect" in str(w.message)]
            if frozen:
                first = str(frozen[0].message).splitlines()[0].split(". ")[0]
                raise ExportFailed(f"the TorchScript tracer froze a data-dependent value or branch "
                                   f"into the graph at {os.path.basename(frozen[0].filename)}:"
                                   f"{frozen[0].lineno} ({first})")
        else:
            raise ValueError(f"exporter must be 'auto', 'dynamo' or 'legacy', not {which!r}")
        graph = ir.from_proto(onnx.load(path))
        _attention_dropout_in_training(graph, legacy=True)
        return ir.to_proto(graph)


def _attention_dropout_in_training(model: ir.Model, legacy: bool) -> None:
    """Trap 10: torchlib (and the TorchScript exporter's opset-14 symbolic) writes
    scaled_dot_product_attention's ``dropout_p`` as an inference Dropout (the identity: the
    optimizer removes it, and attention dropout silently vanished from HF models' default
    "sdpa" attention and nn.TransformerEncoderLayer), while torch applies it whenever
    ``dropout_p > 0``: those Dropouts get ``training_mode`` true (convention 5 of
    :mod:`passes.exports.conventions`, here before ORTModule's optimizer). In a dynamo export
    they are the nodes written for the aten op; in a TorchScript export every Dropout without
    one (its ``dropout`` symbolic writes ``training_mode`` when training and no node otherwise)."""
    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    train_dropouts(model, nodes if legacy else [n for n in nodes if is_attention_dropout(n)])
