"""Shared pieces of the optimizer rules: the rule registry, parameter groups and step scalars.

An optimizer rule is one function ``update(b, config, w, g, state, scalars, lr)`` that
appends the update of one weight to the builder ``b`` (a ``OpBuilder``) and returns
``(new_weight, {state name: new value})``. Scalars that depend only on the step
(bias corrections) are computed once per graph in float64 and cast to each weight's dtype.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol

import numpy as np
import onnx_ir as ir

from passes.autodiff.builder import OpBuilder, Var
from passes.autodiff.errors import GradientError

F64 = ir.DataType.DOUBLE


class OptimizerConfig(Protocol):
    """A frozen dataclass of hyper-parameters with a registered update rule."""

    name: ClassVar[str]

    def state_names(self) -> tuple[str, ...]: ...


UpdateFn = Callable[..., tuple[Var, dict[str, Var]]]
_RULES: dict[type, UpdateFn] = {}
_CONFIGS: dict[str, type] = {}
_FUSABLE: dict[type, str] = {}
_WITNESS: dict[type, str] = {}

# How a rule may run on several weights at once, concatenated into one flat vector (see
# ``UpdateOptions.fuse_below``): "elementwise" rules compute each element from the same element
# of the weight, gradient and state and from scalars; "segments" rules also take the keyword
# ``segments`` (the element counts of the concatenated tensors, in order) for per-tensor
# reductions (LAMB's norms). Rules registered without either always run per tensor.
FUSABLE_KINDS = ("elementwise", "segments")


def optimizer_rule(config_type: type[OptimizerConfig], fusable: str | None = None,
                   finite_witness: str | None = None) -> Callable[[UpdateFn], UpdateFn]:
    """Register ``fn`` as the update rule of ``config_type`` (keyed by type and by its name);
    ``fusable``: one of :data:`FUSABLE_KINDS`, or None (the rule runs per tensor).

    ``finite_witness``: the name of a new state whose being finite, with the new weight's,
    implies that every other new state is finite, given finite inputs and hyper-parameters
    (Adam's ``exp_avg_sq``: it is non-finite whenever the gradient or its square is, and a
    finite gradient keeps ``exp_avg``, a running average of it, finite). The step's finite
    check (``skip_non_finite``) then reads the new weight and that state only. None: every
    output is checked."""
    if fusable is not None and fusable not in FUSABLE_KINDS:
        raise ValueError(f"optimizer_rule(fusable=...) must be one of {FUSABLE_KINDS} or None; "
                         f"got {fusable!r}")

    def register(fn: UpdateFn) -> UpdateFn:
        _RULES[config_type] = fn
        _CONFIGS[config_type.name] = config_type
        for table, value in ((_FUSABLE, fusable), (_WITNESS, finite_witness)):
            if value is None:
                table.pop(config_type, None)
            else:
                table[config_type] = value
        return fn

    return register


def finite_witness(config: Any) -> str | None:
    """The state whose finiteness stands for the whole update of ``config`` (see optimizer_rule)."""
    return _WITNESS.get(type(config))


def fusable_kind(config: Any) -> str | None:
    """How the rule of ``config`` may run on concatenated weights (see :data:`FUSABLE_KINDS`)."""
    return _FUSABLE.get(type(config))


def rule_for(config: Any) -> UpdateFn:
    fn = _RULES.get(type(config))
    if fn is None:
        raise ValueError(f"no optimizer rule for {type(config).__name__}; known: {sorted(_CONFIGS)}")
    return fn


def config_type(name: str) -> type:
    """The config class registered under ``name`` ('sgd', 'adam', 'adamw', 'lamb')."""
    try:
        return _CONFIGS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; known: {sorted(_CONFIGS)}") from None


# ---- range checks of hyper-parameters (each config's __post_init__) ---------------------------
def is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def check_number(owner: object, field: str, value: Any, *, low: float, high: float = math.inf,
                 low_open: bool = False, high_open: bool = False, finite: bool = True) -> None:
    """Raise a :class:`GradientError` (a ``ValueError``) naming ``owner``'s class, ``field`` and
    the accepted range unless ``value`` is a real number in it (NaN never is; neither is a bool)."""
    ok = is_number(value) and not math.isnan(value) and (not finite or math.isfinite(value))
    ok = ok and (value > low if low_open else value >= low)
    ok = ok and (value < high if high_open else value <= high)
    if not ok:
        kind = "a finite number" if finite else "a number"
        if high == math.inf:
            what = f"{kind} {'>' if low_open else '>='} {low:g}"
        else:
            what = (f"{kind} in {'(' if low_open else '['}{low:g}, "
                    f"{high:g}{')' if high_open else ']'}")
        raise GradientError(f"{type(owner).__name__}.{field} must be {what}; got {value!r}")


def check_count(owner: object, field: str, value: Any, what: str) -> None:
    """``value`` must be an integer >= 1 (not a bool, not 2.5): else a named GradientError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise GradientError(f"{type(owner).__name__}.{field} must be a positive integer ({what}); "
                            f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """Hyper-parameter overrides for the weights whose names match any of ``patterns``.

    Patterns are shell-style (``fnmatch``), e.g. ``("*.bias", "*LayerNorm*")``; the first
    matching group wins. ``overrides`` names fields of the optimizer config
    (``{"weight_decay": 0.0}``); ``lr_scale`` multiplies the learning rate input.
    """

    patterns: tuple[str, ...]
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    lr_scale: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.patterns, (str, bytes)):
            raise GradientError(f"ParamGroup.patterns must be a tuple of name patterns, not the "
                                f"single string {self.patterns!r} (write ({self.patterns!r},))")
        if not isinstance(self.patterns, (tuple, list)) or not all(isinstance(p, str) for p in self.patterns):
            raise GradientError(f"ParamGroup.patterns must be a tuple of name patterns (strings), "
                                f"got {self.patterns!r}")
        check_number(self, "lr_scale", self.lr_scale, low=0.0)

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)


def check_groups(config: Any, groups: tuple[ParamGroup, ...]) -> None:
    """Every override of every group names a field of ``config`` and gives it a valid value
    (checked whether or not the group matches a weight): a :class:`GradientError` naming the
    group and the field otherwise."""
    if not groups or not dataclasses.is_dataclass(config) or isinstance(config, type):
        return
    fields = [f.name for f in dataclasses.fields(config) if f.init]
    for index, group in enumerate(groups):
        unknown = [k for k in group.overrides if k not in fields]
        if unknown:
            hint = (f"; a group's learning rate is ParamGroup({tuple(group.patterns)!r}, lr_scale=...), a "
                    "factor of the step's lr" if any(k in ("lr", "learning_rate") for k in unknown) else "")
            raise GradientError(f"ParamGroup {index} {tuple(group.patterns)!r} overrides {unknown}, which "
                                f"{type(config).__name__} does not have; its fields are {fields}{hint}")
        try:
            dataclasses.replace(config, **dict(group.overrides))
        except (GradientError, TypeError, ValueError) as exc:
            raise GradientError(f"ParamGroup {index} {tuple(group.patterns)!r}: {exc}") from exc


def resolve(config: Any, groups: tuple[ParamGroup, ...], name: str) -> tuple[Any, float]:
    """The config and learning-rate scale that apply to weight ``name``."""
    for group in groups:
        if group.matches(name):
            return dataclasses.replace(config, **dict(group.overrides)), group.lr_scale
    return config, 1.0


class StepScalars:
    """Scalars shared by every weight's update, built once per graph.

    ``step`` is the int64 count of updates already applied; ``t = step + 1`` is the
    1-based step that torch.optim uses for bias correction.
    """

    def __init__(self, b: OpBuilder, lr: Var, step: Var) -> None:
        self.b = b
        self.lr = lr
        self.step = step
        self._cache: dict[Any, Var] = {}

    def _cached(self, key: Any, make: Callable[[], Var]) -> Var:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def t64(self) -> Var:
        return self._cached("t64", lambda: self.b.Cast(self.b.Add(self.step, 1), to=int(F64)))

    @property
    def first_step(self) -> Var:
        return self._cached("first", lambda: self.b.Equal(self.step, 0))

    def lr64(self, scale: float = 1.0) -> Var:
        def make() -> Var:
            lr = self.b.Cast(self.lr, to=int(F64))
            return lr if scale == 1.0 else lr * self.b.const(np.float64(scale))
        return self._cached(("lr64", scale), make)

    def bias_correction(self, beta: float) -> Var:
        """``1 - beta ** t`` in float64."""
        b = self.b
        return self._cached(("bc", beta),
                            lambda: b.Sub(b.const(np.float64(1.0)),
                                          b.Pow(b.const(np.float64(beta)), self.t64)))

    def scalar(self, key: Any, make: Callable[[], Var]) -> Var:
        """A rule's own step scalar, made by ``make`` once per graph for each ``key``."""
        return self._cached(("rule", key), make)

    def cast(self, value: Var, dtype: ir.DataType) -> Var:
        """``value`` (a float64 scalar) in ``dtype``, cast once."""
        return self._cached(("cast", id(value), dtype), lambda: self.b.Cast(value, to=int(dtype)))


# ---- several weights as one flat vector (fused updates) -----------------------------------------
def flatten_join(b: OpBuilder, parts: list[Var]) -> Var:
    """The tensors ``parts`` flattened and concatenated, in order, into one 1-D vector."""
    minus_one = b.const(np.array([-1], np.int64))
    flat = [b.Reshape(p, minus_one) for p in parts]
    return flat[0] if len(flat) == 1 else b.Concat(*flat, axis=0)


def split_flat(b: OpBuilder, flat: Var, sizes: tuple[int, ...]) -> list[Var]:
    """The 1-D ``flat`` cut into consecutive pieces of ``sizes`` elements (1-D each)."""
    if len(sizes) == 1:
        return [flat]
    if b.opset >= 13:
        parts = b.op("Split", flat, b.const(np.array(sizes, np.int64)), axis=0, _outputs=len(sizes))
    else:
        parts = b.op("Split", flat, axis=0, split=list(sizes), _outputs=len(sizes))
    for part, n in zip(parts, sizes):
        part.value.type = flat.value.type
        part.value.shape = ir.Shape([n])
    return list(parts)
