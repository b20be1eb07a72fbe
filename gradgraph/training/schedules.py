"""Learning-rate schedules for the training loop (the graph takes the learning rate as an input)."""

from __future__ import annotations

import dataclasses
import math

KINDS = ("constant", "linear-warmup", "cosine")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """``lr_at(step)`` for 0-based optimizer steps.

    1. ``constant``: ``base_lr`` (after an optional linear warmup);
    2. ``linear-warmup``: linear warmup over ``warmup_steps``, then linear decay to ``min_lr``
       at ``total_steps`` (onnxruntime's LinearWarmupLRScheduler shape);
    3. ``cosine``: linear warmup, then half-cosine decay to ``min_lr`` at ``total_steps``.
    """

    kind: str
    base_lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown schedule {self.kind!r}; choose one of {KINDS}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"warmup_steps must lie in [0, total_steps] (got {self.warmup_steps})")

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.base_lr
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        if self.kind == "linear-warmup":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.base_lr - self.min_lr) * factor
