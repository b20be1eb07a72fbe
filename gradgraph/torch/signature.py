"""What a built ORTModule graph depends on: the call signature (the call's structure, its
tensors' shapes, dtypes and devices, every submodule's plain and tensor attributes, weights,
hooks, autocast) and the attributes a forward changed (:func:`_attr_state`)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch


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

