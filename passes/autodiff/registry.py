"""Gradient rule registry keyed by (domain, op_type) and an opset range.

A rule is a function ``rule(b, node, grads) -> list[grad | None]``:

- ``b`` is the :class:`~passes.autodiff.builder.OpBuilder` (methods mirror ONNX ops),
- ``node`` a :class:`~passes.autodiff.builder.NodeView` of the forward node,
- ``grads`` the gradient of each forward output (``None`` where none flows back).

It returns one gradient per forward input (``None`` where there is none). The
engine does the cross-cutting work: pruning, stop-gradients, un-broadcasting
(for rules registered with ``broadcast=True``), dtype matching and fan-out sums.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

RuleFn = Callable[[Any, Any, list[Any]], Any]

ALL_INPUTS = None


@dataclasses.dataclass(frozen=True)
class GradRule:
    domain: str
    op_type: str
    fn: RuleFn
    since: int = 1
    until: int | None = None
    # Input indices that can carry a gradient; ``None`` means every float input.
    diff_inputs: tuple[int, ...] | None = ALL_INPUTS
    # The engine reduces each input gradient from output 0's shape to the input's.
    broadcast: bool = False

    def covers(self, opset: int) -> bool:
        return self.since <= opset and (self.until is None or opset <= self.until)

    def is_diff_input(self, index: int) -> bool:
        return self.diff_inputs is None or index in self.diff_inputs


_RULES: dict[tuple[str, str], list[GradRule]] = {}


def _normalize_domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def register(rule: GradRule) -> GradRule:
    key = (_normalize_domain(rule.domain), rule.op_type)
    for other in _RULES.get(key, []):
        lo = max(other.since, rule.since)
        hi = min(other.until or 10**6, rule.until or 10**6)
        if lo <= hi:
            raise ValueError(f"gradient rule for {key} overlaps opsets {lo}..{hi}")
    _RULES.setdefault(key, []).append(rule)
    return rule


def grad_rule(
    *op_types: str,
    domain: str = "",
    since: int = 1,
    until: int | None = None,
    diff_inputs: Iterable[int] | None = ALL_INPUTS,
    broadcast: bool = False,
) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the gradient of ``op_types`` for opsets ``since..until``."""
    diff = None if diff_inputs is None else tuple(diff_inputs)

    def decorate(fn: RuleFn) -> RuleFn:
        for op_type in op_types:
            register(GradRule(domain, op_type, fn, since, until, diff, broadcast))
        return fn

    return decorate


def _no_gradient(b: Any, node: Any, grads: list[Any]) -> list[Any]:
    return [None] * len(node.inputs)


def non_differentiable(*op_types: str, domain: str = "") -> None:
    """Register ops whose outputs carry no gradient to any input (stop-gradient)."""
    for op_type in op_types:
        register(GradRule(domain, op_type, _no_gradient, diff_inputs=()))


def lookup(domain: str, op_type: str, opset: int) -> GradRule | None:
    for rule in _RULES.get((_normalize_domain(domain), op_type), []):
        if rule.covers(opset):
            return rule
    return None


def registered_rules() -> list[GradRule]:
    return [rule for rules in _RULES.values() for rule in rules]
