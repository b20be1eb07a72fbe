"""ORTTrainer's optimizer configs, learning-rate schedulers and loss scalers.

Names, signatures and defaults follow onnxruntime-training's ``optim`` and ``amp`` modules
(``SGDConfig``, ``AdamConfig``, ``LambConfig``; ``ConstantWarmupLRScheduler``,
``CosineWarmupLRScheduler``, ``LinearWarmupLRScheduler``, ``PolyWarmupLRScheduler``;
``DynamicLossScaler``); each config turns into one of gradgraph's optimizer passes
(:mod:`passes.optimizer`) with per-group overrides:

- ``alpha`` / ``beta`` -> ``beta1`` / ``beta2``, ``lambda_coef`` -> ``weight_decay``,
  ``epsilon`` -> ``eps``, ``do_bias_correction`` -> ``bias_correction``;
- Adam's ``weight_decay_mode``: ``BEFORE_WEIGHT_UPDATE`` (0) is onnxruntime's decoupled decay
  in the same step as the update, that is ``torch.optim.AdamW``; ``AFTER_WEIGHT_UPDATE`` (1)
  decays the updated weight (HuggingFace's AdamW);
- ``max_norm_clip``: the global gradient-norm threshold, applied when
  ``utils.grad_norm_clip`` is on (Adam and LAMB; the reference never clips SGD).

Parameter groups are ``[{'params': [names], <hyper-parameter>: value, ...}]``; ``lr`` is not
allowed inside a group (as in the reference).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from passes.autodiff import GradientError
from passes.optimizer import AdamConfig as _Adam
from passes.optimizer import AdamWConfig as _AdamW
from passes.optimizer import LambConfig as _Lamb
from passes.optimizer import ParamGroup
from passes.optimizer import SGDConfig as _SGD
from passes.optimizer.optimizer_pass import LossScaleSettings

# reference hyper-parameter -> gradgraph config field
_FIELDS = {"alpha": "beta1", "beta": "beta2", "lambda_coef": "weight_decay", "lambda": "weight_decay",
           "epsilon": "eps", "do_bias_correction": "bias_correction", "ratio_min": "ratio_min",
           "ratio_max": "ratio_max"}


def _literal(name: str) -> str:
    """An fnmatch pattern matching exactly ``name`` (groups list names, not patterns)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _number(owner: str, name: str, value: Any, low: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < low:
        raise ValueError(f"{owner}: {name!r} must be a number >= {low:g}; got {value!r}")
    return float(value)


class _OptimizerConfig:
    """Common part: the name, ``lr``, the defaults and the parameter groups."""

    name = ""
    _hyper: tuple[str, ...] = ()

    def __init__(self, params: Sequence[Mapping[str, Any]], defaults: dict[str, Any]) -> None:
        owner = type(self).__name__
        self.lr = _number(owner, "lr", defaults["lr"])
        self.defaults = defaults
        if not isinstance(params, (list, tuple)):
            raise ValueError(f"{owner}: 'params' must be a list of parameter groups (dicts), got "
                             f"{type(params).__name__}")
        self.params: list[dict[str, Any]] = []
        for i, group in enumerate(params):
            where = f"{owner}: params[{i}]"
            if not isinstance(group, Mapping) or "params" not in group:
                raise ValueError(f"{where} must be a dict with a 'params' list of parameter names")
            names = group["params"]
            if isinstance(names, str) or not isinstance(names, (list, tuple)) or \
                    not all(isinstance(n, str) for n in names):
                raise ValueError(f"{where}['params'] must be a list of parameter names, got {names!r}")
            if "lr" in group:
                raise ValueError(f"{where}: 'lr' is not supported inside a parameter group (as in "
                                 "onnxruntime-training); use one lr, or a scheduler")
            if "max_norm_clip" in group:  # one threshold on the global norm: not per group
                raise ValueError(f"{where}: 'max_norm_clip' is the threshold of the global gradient "
                                 f"norm, one for all weights; set it as {owner}(max_norm_clip=...)")
            unknown = [k for k in group if k != "params" and k not in self._hyper]
            if unknown:
                raise ValueError(f"{where} has {unknown} which {owner} does not have; its "
                                 f"hyper-parameters: {list(self._hyper)}")
            if len(group) < 2:
                raise ValueError(f"{where} overrides nothing: add hyper-parameters next to 'params'")
            self.params.append({**{k: v for k, v in defaults.items() if k != "lr"}, **dict(group)})

    def to_pass_config(self) -> Any:
        """The gradgraph optimizer config (the defaults)."""
        return self._pass_config({k: v for k, v in self.defaults.items() if k != "lr"})

    def _pass_config(self, hyper: Mapping[str, Any]) -> Any:
        """The gradgraph optimizer config of reference hyper-parameters ``hyper``."""
        raise NotImplementedError

    def _check_ranges(self) -> None:
        """Range checks of the defaults and of every group's values (gradgraph's config checks
        them), said with the reference's names: ``AdamConfig: params[0]: 'alpha' must be ...``."""
        owner = type(self).__name__
        tables = [("", {k: v for k, v in self.defaults.items() if k != "lr"})]
        tables += [(f" params[{i}]:", {k: v for k, v in g.items() if k != "params"}) for i, g in enumerate(self.params)]
        reverse = {field: key for key, field in _FIELDS.items() if key != "lambda"}
        for where, hyper in tables:
            try:
                self._pass_config(hyper)
            except GradientError as exc:
                text = re.sub(r"\b\w*Config\.(\w+)", lambda m: repr(reverse.get(m.group(1), m.group(1))), str(exc))
                raise ValueError(f"{owner}:{where} {text}") from exc

    def param_groups(self, aliases: Mapping[str, str] | None = None) -> tuple[ParamGroup, ...]:
        """One exact-name :class:`ParamGroup` per reference group (the first match wins);
        ``aliases``: another name of a weight -> the graph's (a tied weight's names)."""
        groups = []
        base = self.to_pass_config()
        rename = aliases or {}
        for group in self.params:
            over = self._translate({k: v for k, v in group.items() if k != "params"})
            changed = {k: v for k, v in over.items() if getattr(base, k) != v}
            groups.append(ParamGroup(tuple(_literal(rename.get(n, n)) for n in group["params"]), changed))
        return tuple(groups)

    def _translate(self, hyper: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in hyper.items():
            if key in _FIELDS:
                out[_FIELDS[key]] = value
        return out

    @property
    def clips(self) -> bool:
        """Whether ``utils.grad_norm_clip`` applies (Adam and LAMB, as in the reference)."""
        return self.name != "SGDOptimizer"


class SGDConfig(_OptimizerConfig):
    """``SGDConfig(params=[], lr=0.001)``: plain SGD (no groups, as in the reference)."""

    name = "SGDOptimizer"

    def __init__(self, params: Sequence[Mapping[str, Any]] = (), lr: float = 0.001) -> None:
        if params:
            raise ValueError("SGDConfig: 'params' must be an empty list (SGD has no per-group "
                             "hyper-parameters besides lr, which groups may not set)")
        super().__init__([], {"lr": lr})

    def _pass_config(self, hyper: Mapping[str, Any]) -> _SGD:
        return _SGD()


class AdamConfig(_OptimizerConfig):
    """``AdamConfig(params=[], lr=0.001, alpha=0.9, beta=0.999, lambda_coef=0.0, epsilon=1e-8,
    max_norm_clip=1.0, do_bias_correction=True, weight_decay_mode=BEFORE_WEIGHT_UPDATE)``."""

    name = "AdamOptimizer"
    _hyper = ("alpha", "beta", "lambda_coef", "lambda", "epsilon", "do_bias_correction")

    class DecayMode(enum.IntEnum):
        BEFORE_WEIGHT_UPDATE = 0
        AFTER_WEIGHT_UPDATE = 1

    def __init__(self, params: Sequence[Mapping[str, Any]] = (), lr: float = 0.001, alpha: float = 0.9,
                 beta: float = 0.999, lambda_coef: float = 0.0, epsilon: float = 1e-8,
                 max_norm_clip: float = 1.0, do_bias_correction: bool = True,
                 weight_decay_mode: AdamConfig.DecayMode = DecayMode.BEFORE_WEIGHT_UPDATE) -> None:
        if not isinstance(do_bias_correction, bool):
            raise ValueError(f"AdamConfig: 'do_bias_correction' must be a bool; got {do_bias_correction!r}")
        if weight_decay_mode not in tuple(AdamConfig.DecayMode):
            raise ValueError(f"AdamConfig: 'weight_decay_mode' must be an AdamConfig.DecayMode; got "
                             f"{weight_decay_mode!r}")
        self.alpha, self.beta, self.lambda_coef, self.epsilon = alpha, beta, lambda_coef, epsilon
        self.max_norm_clip = _number("AdamConfig", "max_norm_clip", max_norm_clip)
        self.do_bias_correction = do_bias_correction
        self.weight_decay_mode = AdamConfig.DecayMode(weight_decay_mode)
        super().__init__(params, {"lr": lr, "alpha": alpha, "beta": beta, "lambda_coef": lambda_coef,
                                  "epsilon": epsilon, "do_bias_correction": do_bias_correction})
        self._check_ranges()  # every field, the groups' too, named

    def to_pass_config(self) -> _Adam:
        return super().to_pass_config()  # type: ignore[no-any-return]

    def _pass_config(self, hyper: Mapping[str, Any]) -> _Adam:
        return _AdamW(decay_after_update=self.weight_decay_mode == AdamConfig.DecayMode.AFTER_WEIGHT_UPDATE,
                      **self._translate(hyper))


class LambConfig(_OptimizerConfig):
    """``LambConfig(params=[], lr=0.001, alpha=0.9, beta=0.999, lambda_coef=0.0,
    ratio_min=-inf, ratio_max=inf, epsilon=1e-6, max_norm_clip=1.0, do_bias_correction=False)``."""

    name = "LambOptimizer"
    _hyper = ("alpha", "beta", "lambda_coef", "lambda", "ratio_min", "ratio_max", "epsilon",
              "do_bias_correction")

    def __init__(self, params: Sequence[Mapping[str, Any]] = (), lr: float = 0.001, alpha: float = 0.9,
                 beta: float = 0.999, lambda_coef: float = 0.0, ratio_min: float = float("-inf"),
                 ratio_max: float = float("inf"), epsilon: float = 1e-6, max_norm_clip: float = 1.0,
                 do_bias_correction: bool = False) -> None:
        if not isinstance(do_bias_correction, bool):
            raise ValueError(f"LambConfig: 'do_bias_correction' must be a bool; got {do_bias_correction!r}")
        self.alpha, self.beta, self.lambda_coef, self.epsilon = alpha, beta, lambda_coef, epsilon
        self.ratio_min, self.ratio_max = ratio_min, ratio_max
        self.max_norm_clip = _number("LambConfig", "max_norm_clip", max_norm_clip)
        self.do_bias_correction = do_bias_correction
        super().__init__(params, {"lr": lr, "alpha": alpha, "beta": beta, "lambda_coef": lambda_coef,
                                  "ratio_min": ratio_min, "ratio_max": ratio_max, "epsilon": epsilon,
                                  "do_bias_correction": do_bias_correction})
        self._check_ranges()

    def _translate(self, hyper: Mapping[str, Any]) -> dict[str, Any]:
        out = super()._translate(hyper)
        if "ratio_min" in out and out["ratio_min"] == float("-inf"):
            out["ratio_min"] = 0.0  # the trust ratio is a ratio of norms: never below 0
        return out

    def to_pass_config(self) -> _Lamb:
        return super().to_pass_config()  # type: ignore[no-any-return]

    def _pass_config(self, hyper: Mapping[str, Any]) -> _Lamb:
        return _Lamb(**self._translate(hyper))


# ---- learning-rate schedulers ----------------------------------------------------------------
@dataclasses.dataclass
class TrainStepInfo:
    """What a scheduler sees: ``optimization_step`` (optimizer updates so far), ``step``
    (train_step calls so far), ``all_finite`` (the last step's update was applied), ``fetches``."""

    optimizer_config: _OptimizerConfig
    all_finite: bool = True
    fetches: list[str] = dataclasses.field(default_factory=list)
    optimization_step: int = 0
    step: int = 0


class _LRScheduler:
    """``get_lr(train_step_info)`` -> ``[lr]`` at ``train_step_info.optimization_step``."""

    def __init__(self, total_steps: int, warmup: float) -> None:
        owner = type(self).__name__
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"{owner}: total_steps must be an integer >= 1; got {total_steps!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not 0 <= warmup < 1:
            raise ValueError(f"{owner}: warmup is the fraction of total_steps spent warming up, in "
                             f"[0, 1); got {warmup!r}")
        self.total_steps = total_steps
        self.warmup = float(warmup)
        self._num_warmup_steps = self.warmup * total_steps
        self._last_lr: list[float] = []

    def _factor(self, step: int, base_lr: float) -> float:
        raise NotImplementedError

    def _warming(self, step: int) -> float | None:
        if step < self._num_warmup_steps:
            return step / max(1.0, self._num_warmup_steps)
        return None

    def get_lr(self, train_step_info: TrainStepInfo) -> list[float]:
        base = train_step_info.optimizer_config.lr
        step = train_step_info.optimization_step
        warm = self._warming(step)
        return [base * (warm if warm is not None else self._factor(step, base))]

    def _step(self, train_step_info: TrainStepInfo) -> list[float]:
        self._last_lr = self.get_lr(train_step_info)
        return self._last_lr

    def get_last_lr(self) -> list[float]:
        return self._last_lr


class ConstantWarmupLRScheduler(_LRScheduler):
    """Linear warm-up from 0, then the config's lr."""

    def __init__(self, total_steps: int, warmup: float = 0.002) -> None:
        super().__init__(total_steps, warmup)

    def _factor(self, step: int, base_lr: float) -> float:
        return 1.0


class CosineWarmupLRScheduler(_LRScheduler):
    """Linear warm-up, then ``max(0, 0.5 * (1 + cos(pi * cycles * 2 * progress)))``."""

    def __init__(self, total_steps: int, cycles: float = 0.5, warmup: float = 0.002) -> None:
        super().__init__(total_steps, warmup)
        self.cycles = _number(type(self).__name__, "cycles", cycles)

    def _factor(self, step: int, base_lr: float) -> float:
        progress = (step - self._num_warmup_steps) / max(1.0, self.total_steps - self._num_warmup_steps)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * self.cycles * 2.0 * progress)))


class LinearWarmupLRScheduler(_LRScheduler):
    """Linear warm-up, then linear decay to 0 at ``total_steps``."""

    def __init__(self, total_steps: int, warmup: float = 0.002) -> None:
        super().__init__(total_steps, warmup)

    def _factor(self, step: int, base_lr: float) -> float:
        return max(0.0, (self.total_steps - step) / max(1.0, self.total_steps - self._num_warmup_steps))


class PolyWarmupLRScheduler(_LRScheduler):
    """Linear warm-up, then ``(lr - lr_end) * (1 - progress) ** power + lr_end``; ``lr_end`` after."""

    def __init__(self, total_steps: int, lr_end: float = 1e-7, power: float = 1.0,
                 warmup: float = 0.002) -> None:
        super().__init__(total_steps, warmup)
        self.lr_end = _number(type(self).__name__, "lr_end", lr_end)
        self.power = _number(type(self).__name__, "power", power)

    def _factor(self, step: int, base_lr: float) -> float:
        if base_lr <= self.lr_end:
            raise ValueError(f"PolyWarmupLRScheduler: lr_end ({self.lr_end}) must be smaller than the "
                             f"optimizer's lr ({base_lr})")
        if step > self.total_steps:
            return self.lr_end / base_lr
        remaining = 1.0 - (step - self._num_warmup_steps) / (self.total_steps - self._num_warmup_steps)
        return ((base_lr - self.lr_end) * remaining ** self.power + self.lr_end) / base_lr


# ---- loss scalers (amp) ----------------------------------------------------------------------
class LossScaler:
    """A loss scale for fp16 mixed precision: fixed unless ``automatic_update``."""

    def __init__(self, loss_scale: float = float(1 << 16), automatic_update: bool = False) -> None:
        self.loss_scale = _number(type(self).__name__, "loss_scale", loss_scale, low=1e-30)
        self.automatic_update = bool(automatic_update)

    def settings(self) -> LossScaleSettings:
        """The loss-scale state the training graph keeps (it updates the scale itself)."""
        return LossScaleSettings(init_scale=self.loss_scale, dynamic=self.automatic_update,
                                 min_loss_scale=min(1.0, self.loss_scale),
                                 max_loss_scale=max(float(1 << 24), self.loss_scale))


class DynamicLossScaler(LossScaler):
    """``DynamicLossScaler(automatic_update=True, loss_scale=2**16, up_scale_window=2000,
    min_loss_scale=1.0, max_loss_scale=2**24)``: halves on overflow, doubles after
    ``up_scale_window`` finite steps."""

    def __init__(self, automatic_update: bool = True, loss_scale: float = float(1 << 16),
                 up_scale_window: int = 2000, min_loss_scale: float = 1.0,
                 max_loss_scale: float = float(1 << 24)) -> None:
        super().__init__(loss_scale, automatic_update)
        self.up_scale_window = up_scale_window
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self.settings()  # range checks

    def settings(self) -> LossScaleSettings:
        return LossScaleSettings(init_scale=self.loss_scale, up_scale_window=self.up_scale_window,
                                 min_loss_scale=self.min_loss_scale, max_loss_scale=self.max_loss_scale,
                                 dynamic=self.automatic_update)
