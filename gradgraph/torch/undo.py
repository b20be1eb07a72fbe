"""Undo what exporting a forward did to the module, so that a call runs its forward once.

Exporting runs the forward more than once (the probe run in PyTorch, the exporter's tracing).
Each run's Python side effects on the module's attributes (``self.calls += 1``, a cache grown,
``self.scale = ...``) would otherwise count as several calls. :class:`AttrSnapshot` records
every submodule's attributes (one level: the attribute's object, not what is inside it) and
puts them back; :meth:`AttrSnapshot.changes` says what a run changed, to be applied once where
the call's result is the graph's (the graph itself runs no Python code).
"""

from __future__ import annotations

from typing import Any

import torch

# an attribute deleted by the forward
DELETED = object()
# nn.Module's own tables: their contents are restored by their owners (buffers by
# gradgraph.torch.export.restore_buffers), their identity never changes
_TABLES = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


class AttrSnapshot:
    """The attributes of every submodule of ``module`` as they are now."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.modules = list(module.modules())
        self.saved = [{k: v for k, v in vars(m).items() if k not in _TABLES} for m in self.modules]

    def changes(self) -> list[tuple[torch.nn.Module, str, Any]]:
        """What differs from the snapshot: (submodule, name, new value or :data:`DELETED`)."""
        out: list[tuple[torch.nn.Module, str, Any]] = []
        for m, saved in zip(self.modules, self.saved):
            now = vars(m)
            for k, v in now.items():
                if k not in _TABLES and (k not in saved or saved[k] is not v):
                    out.append((m, k, v))
            out.extend((m, k, DELETED) for k in saved if k not in now)
        return out

    def restore(self) -> None:
        """Every submodule's attributes back to the snapshot (set, or removed where new)."""
        for m, saved in zip(self.modules, self.saved):
            now = vars(m)
            for k in [k for k in now if k not in _TABLES and k not in saved]:
                del now[k]
            for k, v in saved.items():
                if now.get(k, DELETED) is not v:
                    now[k] = v


def apply_changes(changes: list[tuple[torch.nn.Module, str, Any]]) -> None:
    """Set what :meth:`AttrSnapshot.changes` recorded (one run's side effects, once)."""
    for m, k, v in changes:
        if v is DELETED:
            vars(m).pop(k, None)
        else:
            vars(m)[k] = v
