"""LAMB: Adam moments with a per-tensor trust ratio (You et al., 2019), as gradgraph defines it.

Reference semantics (what the float64 NumPy reference in the tests computes), per weight ``w``
with gradient ``g``, learning rate ``lr`` and 1-based step ``t``:

1. ``m = beta1 * m + (1 - beta1) * g``; ``v = beta2 * v + (1 - beta2) * g * g``;
2. with ``bias_correction``: ``m_hat = m / (1 - beta1 ** t)``, ``v_hat = v / (1 - beta2 ** t)``
   (else ``m_hat = m``, ``v_hat = v``);
3. ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w``;
4. ``r = ||w|| / ||u||`` when both norms are > 0, else 1; clipped to ``[ratio_min, ratio_max]``;
5. ``w = w - lr * r * u``.

Norms are L2 over the whole tensor; the state is ``exp_avg`` and ``exp_avg_sq``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np

from passes.autodiff.builder import OpBuilder, Var
from passes.autodiff.errors import GradientError
from passes.optimizer.base import StepScalars, check_number, optimizer_rule, split_flat


@dataclasses.dataclass(frozen=True)
class LambConfig:
    name: ClassVar[str] = "lamb"
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.0
    bias_correction: bool = True
    ratio_min: float = 0.0
    ratio_max: float = math.inf

    def __post_init__(self) -> None:
        check_number(self, "beta1", self.beta1, low=0.0, high=1.0, high_open=True)
        check_number(self, "beta2", self.beta2, low=0.0, high=1.0, high_open=True)
        check_number(self, "eps", self.eps, low=0.0, low_open=True)
        check_number(self, "weight_decay", self.weight_decay, low=0.0)
        check_number(self, "ratio_min", self.ratio_min, low=0.0)
        check_number(self, "ratio_max", self.ratio_max, low=0.0, finite=False)  # inf: no clip
        if self.ratio_min > self.ratio_max:
            raise GradientError(f"LambConfig needs ratio_min <= ratio_max (got {self.ratio_min!r}, "
                                f"{self.ratio_max!r})")

    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")


def _norm(b: OpBuilder, x: Var) -> Var:
    return b.Sqrt(b.reduce("ReduceSumSquare", x, None, keepdims=0))


def _segment_norms(b: OpBuilder, x: Var, segments: tuple[int, ...]) -> Var:
    """The L2 norm of each segment of the flat ``x``, as a vector of ``len(segments)``."""
    parts = split_flat(b, x, segments)
    squares = [b.reduce("ReduceSumSquare", p, None, keepdims=1) for p in parts]
    return b.Sqrt(squares[0] if len(squares) == 1 else b.Concat(*squares, axis=0))


def _per_element(b: OpBuilder, values: Var, segments: tuple[int, ...]) -> Var:
    """The vector ``values`` (one per segment) repeated over each segment's elements."""
    parts = split_flat(b, values, (1,) * len(segments))
    expanded = [b.Expand(p, b.const(np.array([n], np.int64))) for p, n in zip(parts, segments)]
    return expanded[0] if len(expanded) == 1 else b.Concat(*expanded, axis=0)


@optimizer_rule(LambConfig, fusable="segments")
def lamb_update(b: OpBuilder, cfg: LambConfig, w: Var, g: Var, state: dict[str, Var],
                sc: StepScalars, lr_scale: float,
                segments: tuple[int, ...] | None = None) -> tuple[Var, dict[str, Var]]:
    """``segments``: ``w`` is several weights concatenated (their element counts); each gets
    its own trust ratio, as when updated alone."""
    dt = w.known_dtype
    m = state["exp_avg"] * cfg.beta1 + g * (1.0 - cfg.beta1)
    v = state["exp_avg_sq"] * cfg.beta2 + g * g * (1.0 - cfg.beta2)
    m_hat, v_hat = m, v
    if cfg.bias_correction:
        m_hat = m / sc.cast(sc.bias_correction(cfg.beta1), dt)
        v_hat = v / sc.cast(sc.bias_correction(cfg.beta2), dt)
    u = m_hat / (b.Sqrt(v_hat) + cfg.eps)
    if cfg.weight_decay:
        u = u + w * cfg.weight_decay
    if segments is None:
        w_norm, u_norm = _norm(b, w), _norm(b, u)
    else:
        w_norm, u_norm = _segment_norms(b, w, segments), _segment_norms(b, u, segments)
    zero = b.const(0.0, dt)
    both = b.And(b.Greater(w_norm, zero), b.Greater(u_norm, zero))
    ratio = b.Where(both, w_norm / u_norm, b.const(1.0, dt))
    if cfg.ratio_min > 0:
        ratio = b.Max(ratio, b.const(cfg.ratio_min, dt))
    if math.isfinite(cfg.ratio_max):
        ratio = b.Min(ratio, b.const(cfg.ratio_max, dt))
    if segments is not None:
        ratio = _per_element(b, ratio, segments)
    lr = sc.cast(sc.lr64(lr_scale), dt)
    return w - lr * ratio * u, {"exp_avg": m, "exp_avg_sq": v}
