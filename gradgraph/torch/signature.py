"""What a built ORTModule graph depends on: the call signature (the call's structure, its
tensors' shapes, dtypes and devices, every submodule's plain and tensor attributes, weights,
hooks, autocast) and the attributes a forward changed (:func:`_attr_state`)."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import types
from typing import Any

import numpy as np
import torch


def _named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers by path, every alias of a shared one included."""
    named: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    named.update(dict(module.named_buffers(remove_duplicate=False)))
    return named


_PLAIN = frozenset({bool, int, float, str, type(None)})


# a module's hook dictionaries (a hook added or removed after a build changes the signature)
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_NOT_HELD = object()  # an attribute that is not there


class _Same:
    """An object in a signature, equal only to itself (and held, so its ``id`` is not reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


# values held as they are (hashable, immutable, compared by value)
_ATOMS = (torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum, type, range, slice)
# how many elements of a tensor attribute are read for its content (all of a smaller one)
TENSOR_SAMPLE = 256
# how deep and how wide an attribute's object, dict or sequence is held by value; beyond,
# by identity
VALUE_DEPTH = 3
VALUE_WIDTH = 256
# nn.Module's own attributes that are tables (parameters, submodules, hooks: held elsewhere)
_MODULE_TABLES = frozenset(k for k, v in vars(torch.nn.Module()).items() if isinstance(v, (dict, set)))


class HoldsTensors(Exception):
    """A non-tensor argument holds tensors that torch's pytree does not flatten."""


def _tensor_key(t: torch.Tensor) -> tuple:
    """A tensor the export bakes in: identity, version counter, memory and a sample of its
    values (a change through ``.data`` or a numpy view bumps no version)."""
    try:  # on the CPU only: reading a device's memory would wait for its stream
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // TENSOR_SAMPLE)
        sample = flat[::step][:TENSOR_SAMPLE] if flat.device.type == "cpu" else flat[:0]
        content = hashlib.blake2b(sample.contiguous().view(torch.uint8).numpy().tobytes()
                                  if sample.numel() else b"", digest_size=16).digest()
    except (RuntimeError, TypeError):  # sparse, quantized, ...: identity, version and memory
        content = b""
    return ("tensor", _Same(t), t._version, t.data_ptr() if t.numel() else 0, tuple(t.shape), content)


def value_key(value: Any, depth: int = 0, memo: dict[int, Any] | None = None,
              tensors: bool = True) -> Any:
    """A Python value as a signature holds it, compared by value, never by its printed form:
    plain values as they are; tuples, lists, sets and dicts element by element; numpy arrays
    by shape, dtype and a hash of their bytes; dataclasses and other objects by their type,
    identity and fields; functions and modules by identity; tensors by :func:`_tensor_key`
    (``tensors=False``: a tensor raises :class:`HoldsTensors`, for call arguments). Deeper
    than VALUE_DEPTH or wider than VALUE_WIDTH: by identity."""
    kind = type(value)
    if kind in _PLAIN or isinstance(value, _ATOMS):
        return value
    if isinstance(value, torch.Tensor):
        if not tensors:
            raise HoldsTensors(kind.__name__)
        return _tensor_key(value)
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value)
        digest = hashlib.blake2b(data.view(np.uint8).reshape(-1).data if data.size else b"",
                                 digest_size=16).digest() if data.dtype != object else _Same(value)
        return ("array", data.shape, str(data.dtype), digest)
    if isinstance(value, np.generic):
        return ("scalar", str(value.dtype), value.item())
    if memo is None:
        memo = {}
    if id(value) in memo:
        return memo[id(value)]
    if depth >= VALUE_DEPTH or isinstance(value, torch.nn.Module) or callable(value) and not hasattr(
            value, "__dict__") or isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        key: Any = ("same", _Same(value))
    elif isinstance(value, types.MethodType):
        key = ("method", _Same(value.__func__), value_key(value.__self__, depth + 1, memo, tensors))
    elif kind in (tuple, list, set, frozenset) and len(value) <= VALUE_WIDTH:
        items = sorted(value, key=repr) if kind in (set, frozenset) else value
        key = (kind.__name__, tuple(value_key(v, depth + 1, memo, tensors) for v in items))
    elif isinstance(value, dict) and len(value) <= VALUE_WIDTH:
        key = (kind.__name__, tuple((value_key(k, depth + 1, memo, tensors), value_key(v, depth + 1, memo, tensors))
                                    for k, v in value.items()))
    elif dataclasses.is_dataclass(value):
        key = (kind, tuple((f.name, value_key(getattr(value, f.name, None), depth + 1, memo, tensors))
                           for f in dataclasses.fields(value)))
    elif hasattr(value, "__dict__") and len(vars(value)) <= VALUE_WIDTH:
        # an object the forward reads fields of (a config): its fields, and which object it is
        key = (kind, _Same(value), tuple((k, value_key(v, depth + 1, memo, tensors))
                                         for k, v in vars(value).items()))
    elif not tensors and isinstance(value, (tuple, list, set, frozenset, dict)):
        key = (kind.__name__, _Same(value))  # too wide to read on every call: by identity
    else:
        key = ("same", _Same(value))
    memo[id(value)] = key
    return key


def _attr_key(value: Any, memo: dict[int, Any] | None = None) -> Any:
    """What the signature holds of an attribute's value (:func:`value_key`): plain values,
    tensors the export bakes in, functions, objects and their fields, dicts, by value or
    identity."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    return value_key(value, 0, memo)


def _is_plain(value: Any) -> bool:
    """Is ``value`` a plain value (:func:`_attr_key`)?"""
    kind = type(value)
    return kind in _PLAIN or (kind is tuple or kind is list) and all(type(v) in _PLAIN for v in value)


def _plain_attrs(module: torch.nn.Module, skip: dict[int, frozenset[str]]) -> tuple:
    """Every submodule's attributes as :func:`_attr_key` holds them, less ``skip``'s (by ``id``
    of the submodule), the handles of its hooks, its class and identity and a forward set on
    it. Run on every call: kept fast."""
    held = []
    memo: dict[int, Any] = {}  # an object many submodules hold (a config) is read once
    for m in module.modules():
        skipped = skip.get(id(m))
        items: list[Any] = []
        for k, v in vars(m).items():
            if k in _MODULE_TABLES or (skipped is not None and k in skipped):
                continue
            items.append((k, v if type(v) in _PLAIN else _attr_key(v, memo)))
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
                 else ("const", _call_key(x)) for x in leaves)
    # each submodule's plain Python attributes (train/eval, Dropout's p, a flag its forward
    # reads) and tensor attributes: the export bakes them into the graph; and its hooks
    modes = _plain_attrs(module, skip or {})
    weights = tuple((n, tuple(t.shape), t.dtype, isinstance(t, torch.nn.Parameter) and t.requires_grad,
                     t.device) for n, t in named.items())
    # torch.autocast changes the exported dtypes; TF32 the CUDA sessions' options
    autocast = (tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")),
                torch.backends.cuda.matmul.allow_tf32)
    return (training, in_spec, call, modes, weights, autocast, _global_hooks())


def _call_key(value: Any) -> Any:
    """A non-tensor argument by value (:func:`value_key`); one that holds tensors pytree does
    not flatten (a dataclass batch) by its type only: such a call runs in PyTorch."""
    try:
        return value_key(value, 0, None, tensors=False)
    except HoldsTensors:
        return ("holds tensors", type(value))


def holds_tensors(leaves: list) -> str | None:
    """The type of the first non-tensor argument that holds tensors (pytree does not flatten
    it: the export would bake them in as constants, with no gradient), else None."""
    for x in leaves:
        if not isinstance(x, torch.Tensor):
            key = _call_key(x)
            if isinstance(key, tuple) and key[:1] == ("holds tensors",):
                return type(x).__name__
    return None


# an attribute: (id of its submodule, name) -> (dotted path, key (:func:`_attr_key`), submodule)
_AttrState = dict[tuple[int, str], tuple[str, Any, torch.nn.Module]]


def _shown(key: Any) -> str:
    """An attribute's :func:`_attr_key` for a message."""
    if not isinstance(key, tuple) or not key:
        return repr(key)
    head = key[0]
    if head == "tensor":
        return "a tensor"
    if head in ("tuple", "list") and all(type(v) in _PLAIN for v in key[1]):
        return repr(key[1] if head == "tuple" else list(key[1]))
    if head == "same":
        return getattr(key[1].obj, "__qualname__", None) or f"a {type(key[1].obj).__name__}"
    if isinstance(head, type):
        return f"a {head.__name__}"
    return f"a {head}"


def _attr_state(module: torch.nn.Module) -> _AttrState:
    """Every attribute the signature holds, with its path and key."""
    memo: dict[int, Any] = {}
    return {(id(m), k): (f"{path}.{k}" if path else k, _attr_key(v, memo), m)
            for path, m in module.named_modules() for k, v in vars(m).items() if k not in _MODULE_TABLES}


def _changed_attrs(module: torch.nn.Module, before: _AttrState) -> _AttrState:
    """The attributes whose key differs from ``before``'s (or that are new), as they are now."""
    return {k: entry for k, entry in _attr_state(module).items() if k not in before or before[k][1] != entry[1]}

