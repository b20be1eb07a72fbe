"""Checks of user-given names and options at the API boundary: one clear error, nothing guessed."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

import onnx_ir as ir

from passes.autodiff import GradientError
from passes.forward.reduce_loss import ReduceLossPass


def check_names(what: str, names: object) -> None:
    """``names`` must be a list/tuple of strings (a single string is a common slip)."""
    if isinstance(names, (str, bytes)):
        raise GradientError(f"{what} must be a list of names, not the single string {names!r} "
                            f"(write [{names!r}])")
    if not isinstance(names, Iterable) or not all(isinstance(n, str) for n in names):
        raise GradientError(f"{what} must be a list of names (strings), got {names!r}")


def close_matches(name: str, known: Iterable[str]) -> str:
    matches = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(repr(m) for m in matches)}?)" if matches else ""


def unknown_names(what: str, names: Iterable[str], known: Iterable[str]) -> None:
    """Raise naming the first of ``names`` that is not in ``known``, with close matches."""
    known = set(known)
    for name in names:
        if name not in known:
            raise GradientError(f"{what}: {name!r} is neither an initializer nor a graph input of the model"
                                f"{close_matches(name, known)}; `gradgraph grad MODEL --list-weights` "
                                "lists the weights")


def require_scalar_loss(model: ir.Model, loss: str, reduction: str | None) -> None:
    """Reduce a non-scalar loss with ``reduction``, or refuse it (see ``ReduceLossPass``)."""
    ReduceLossPass(loss, reduction)(model)
