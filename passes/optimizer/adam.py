"""Adam and AdamW (torch.optim.Adam / AdamW semantics, bias-corrected, eps outside the sqrt).

Per weight ``w`` with gradient ``g``, learning rate ``lr`` and 1-based step ``t``:

1. Adam: ``g = g + weight_decay * w`` (coupled); AdamW: ``w = w * (1 - lr * weight_decay)``;
2. ``m = m + (1 - beta1) * (g - m)``; ``v = beta2 * v + (1 - beta2) * g * g``;
3. ``denom = sqrt(v) / sqrt(1 - beta2 ** t) + eps``;
4. ``w = w - lr / (1 - beta1 ** t) * m / denom``, computed as ``w - s * m / (sqrt(v) + e)`` with
   the scalars ``s = lr * sqrt(1 - beta2 ** t) / (1 - beta1 ** t)`` and ``e = eps * sqrt(1 - beta2 ** t)``
   (float32/float64 weights; the same value up to rounding, one pass over the tensors less).

``bias_correction=False`` drops both corrections. ``decay_after_update=True`` (AdamW only) is
onnxruntime's ``weight_decay_mode=1``, HuggingFace's AdamW: ``w' = w - lr * sqrt(1 - beta2 ** t) /
(1 - beta1 ** t) * m / (sqrt(v) + eps)``, then ``w = w' - lr * weight_decay * w'``.

Step scalars (bias corrections, ``lr / bc1``) are computed in float64 like torch's Python floats.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from passes.autodiff.builder import OpBuilder, Var
from passes.autodiff.errors import GradientError
from passes.optimizer.base import StepScalars, check_number, optimizer_rule


@dataclasses.dataclass(frozen=True)
class AdamConfig:
    name: ClassVar[str] = "adam"
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    bias_correction: bool = True
    # AdamW only: decay the updated weight (HuggingFace AdamW, onnxruntime weight_decay_mode=1).
    decay_after_update: bool = False

    def __post_init__(self) -> None:
        if self.decay_after_update and not self.decoupled:
            raise GradientError(f"{type(self).__name__}.decay_after_update=True needs decoupled weight "
                                "decay (use AdamWConfig)")
        check_number(self, "beta1", self.beta1, low=0.0, high=1.0, high_open=True)
        check_number(self, "beta2", self.beta2, low=0.0, high=1.0, high_open=True)
        check_number(self, "eps", self.eps, low=0.0, low_open=True)
        check_number(self, "weight_decay", self.weight_decay, low=0.0)

    @property
    def decoupled(self) -> bool:
        return False

    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class AdamWConfig(AdamConfig):
    name: ClassVar[str] = "adamw"
    weight_decay: float = 1e-2

    @property
    def decoupled(self) -> bool:
        return True


def _warn_if_eps_vanishes(cfg: AdamConfig, dt: ir.DataType) -> None:
    """eps that rounds to 0 in the weights' type: an entry whose gradient has always been 0 has
    m = v = 0, and 0 / (0 + 0) is NaN (as in torch): the step is non-finite, so skipped."""
    if dt in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16) and float(np.asarray(cfg.eps, dt.numpy())) == 0.0:
        warnings.warn(f"{type(cfg).__name__}(eps={cfg.eps}) is 0 in {dt.name.lower()}: an entry whose gradient "
                      "is 0 makes the update 0 / 0 = NaN and the step is skipped as non-finite; use eps >= "
                      "1e-7 in float16 (1e-4 is common; CLI --adam-eps), or float32 weights with mixed precision",
                      stacklevel=2)


def adam_update(b: OpBuilder, cfg: AdamConfig, w: Var, g: Var, state: dict[str, Var],
                sc: StepScalars, lr_scale: float) -> tuple[Var, dict[str, Var]]:
    dt = w.known_dtype
    _warn_if_eps_vanishes(cfg, dt)
    lr64 = sc.lr64(lr_scale)
    if cfg.decay_after_update:
        return _adam_hf_update(b, cfg, w, g, state, sc, lr64)
    if cfg.weight_decay and cfg.decoupled:
        w = w * sc.cast(b.Sub(b.const(1.0, lr64.dtype), lr64 * cfg.weight_decay), dt)
    elif cfg.weight_decay:
        g = g + w * cfg.weight_decay
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m = m + (g - m) * (1.0 - cfg.beta1)
    v = v * cfg.beta2 + g * g * (1.0 - cfg.beta2)
    if not cfg.bias_correction:
        return w - sc.cast(lr64, dt) * (m / (b.Sqrt(v) + cfg.eps)), {"exp_avg": m, "exp_avg_sq": v}
    if dt not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
        # float16/bfloat16 weights: eps * sqrt(bc2) can round to 0 where eps does not.
        bc2 = sc.cast(b.Sqrt(sc.bias_correction(cfg.beta2)), dt)
        denom = b.Sqrt(v) / bc2 + cfg.eps
        return w - sc.cast(lr64 / sc.bias_correction(cfg.beta1), dt) * (m / denom), {"exp_avg": m, "exp_avg_sq": v}
    # lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps), with sqrt(bc2) moved into the two scalars (float64):
    # one pass over memory less than dividing sqrt(v) by it.
    # The scalars are made once per graph for each (betas, eps, lr scale, dtype).
    key = (cfg.beta1, cfg.beta2, cfg.eps, lr_scale, dt)
    bc2_sqrt = sc.scalar(("adam_bc2_sqrt", cfg.beta2), lambda: b.Sqrt(sc.bias_correction(cfg.beta2)))
    step_size = sc.scalar(("adam_step", *key), lambda: sc.cast(
        lr64 * bc2_sqrt / sc.bias_correction(cfg.beta1), dt))
    eps = sc.scalar(("adam_eps", *key), lambda: sc.cast(bc2_sqrt * cfg.eps, dt))
    denom = b.Sqrt(v) + eps
    return w - step_size * (m / denom), {"exp_avg": m, "exp_avg_sq": v}


def _adam_hf_update(b: OpBuilder, cfg: AdamConfig, w: Var, g: Var, state: dict[str, Var],
                    sc: StepScalars, lr64: Var) -> tuple[Var, dict[str, Var]]:
    """``decay_after_update``: the moments as Adam's, eps outside the corrected sqrt, then decay."""
    dt = w.known_dtype
    m = state["exp_avg"] + (g - state["exp_avg"]) * (1.0 - cfg.beta1)
    v = state["exp_avg_sq"] * cfg.beta2 + g * g * (1.0 - cfg.beta2)
    step64 = lr64
    if cfg.bias_correction:
        step64 = lr64 * b.Sqrt(sc.bias_correction(cfg.beta2)) / sc.bias_correction(cfg.beta1)
    w = w - sc.cast(step64, dt) * (m / (b.Sqrt(v) + cfg.eps))
    if cfg.weight_decay:
        w = w * sc.cast(b.Sub(b.const(1.0, lr64.dtype), lr64 * cfg.weight_decay), dt)
    return w, {"exp_avg": m, "exp_avg_sq": v}


# exp_avg_sq is NaN/inf whenever the gradient or its square is (g * g); a finite gradient keeps
# exp_avg (its running average) finite. The new weight is checked too (a huge learning rate).
optimizer_rule(AdamConfig, fusable="elementwise", finite_witness="exp_avg_sq")(adam_update)
optimizer_rule(AdamWConfig, fusable="elementwise", finite_witness="exp_avg_sq")(adam_update)
