"""OptimizerPass: turn a model with gradient outputs into one training step (or micro-step).

The trained weights must already be graph inputs (see ``ParamsToInputsPass``). Given the
gradient values from ``GradientPass``:

1. the gradient outputs are removed from the graph outputs (unless ``keep_gradient_outputs``);
2. with ``accumulation_steps = N > 1``: inputs ``<w>_grad.accumulation.buffer`` and the bool
   scalar ``lazy_reset_grad`` are added, ``acc = reset ? g : buffer + g``.
   An *accumulate* graph (``apply=False``) outputs ``acc`` as ``<w>_grad.accumulation.out``
   and stops; an *apply* graph uses ``g = acc / N`` (mean over the micro-batches);
3. with ``max_grad_norm``: global L2 norm clipping with torch.nn.utils.clip_grad_norm_
   semantics, ``g *= min(1, max_norm / (norm + clip_eps))``; the norm is output as
   ``global_gradient_norm``;
4. inputs ``learning_rate`` (float scalar; double where a double weight is trained) and ``step`` (int64 scalar, updates done so far),
   and per trained weight its optimizer state ``<w>.<state>``; the optimizer rule emits the
   new weight ``<w>.out``, new state ``<w>.<state>.out`` and ``step.out = step + 1``;
5. with ``skip_non_finite`` (the default): the bool scalar output ``step_finite`` is true when
   the loss, the learning rate and every new weight and state are finite (a NaN/inf gradient,
   learning rate or hyper-parameter makes them non-finite; for a rule with a
   ``finite_witness``, Adam's ``exp_avg_sq``, the new weight and that state are read for all of
   its outputs; with ``guard_before_update`` the gradients the update takes are read instead
   of its results); when it is false every ``X.out`` is ``X`` itself,
   bit for bit (``Where(finite, new, old)``), the step counter included: the step is skipped.
   With ``select_in_graph=False`` the graph leaves that selection to its runtime: the
   ``X.out`` outputs carry ``gradgraph.valid_if = step_finite`` (:data:`VALID_IF_KEY`);
6. with ``loss_scale`` (mixed precision; the loss was multiplied by the ``loss_scale`` input
   before differentiation, see ``LossScalePass``): the gradients are divided by it before
   clipping, ``all_gradients_finite`` is output, a step with a non-finite gradient is skipped
   (whatever ``skip_non_finite`` says), and the scale and its ``stable_steps`` counter are
   updated (see :class:`LossScaleSettings`).

Weights below ``fuse_below`` elements that share a config, learning-rate scale and dtype are
updated together (one flat vector per group, Concat in and Split out; the state keeps its
per-weight inputs and outputs).

Scalar outputs carry their role in ``metadata_props`` (:class:`passes.marks.OutputRole`). The
graph records that it has an optimizer part (graph metadata ``gradgraph.optimizer``); a second
run leaves such a graph alone.

Every state input ``X`` that changes has the output ``X.out``; runtimes bind one to the other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff.builder import OpBuilder, Var, scope_taken_names
from passes.autodiff.errors import GradientError
from passes.marks import OUTPUT_KEY, STAGE_KEY, OutputRole, Role
from passes.optimizer import ParamGroup, StepScalars, resolve, rule_for
from passes.optimizer.base import (
    check_count,
    check_groups,
    check_number,
    finite_witness,
    flatten_join,
    fusable_kind,
    is_number,
    split_flat,
)

# Graph metadata: the graph has its optimizer part ("apply") or accumulation part ("accumulate").
OPTIMIZER_KEY = "gradgraph.optimizer"
# Output metadata (``UpdateOptions.select_in_graph=False``): this ``X.out`` holds the next value
# of ``X`` only when the bool output named here is true; otherwise ``X`` keeps its value.
VALID_IF_KEY = "gradgraph.valid_if"


@dataclasses.dataclass(frozen=True)
class TrainingNames:
    """Names of the inputs and outputs a training graph adds (ORT suffixes where ORT has one)."""

    learning_rate: str = "learning_rate"
    step: str = "step"
    out_suffix: str = ".out"
    buffer_suffix: str = "_grad.accumulation.buffer"
    buffer_out_suffix: str = "_grad.accumulation.out"
    reset: str = "lazy_reset_grad"
    grad_norm: str = "global_gradient_norm"
    finite: str = "step_finite"
    gradients_finite: str = "all_gradients_finite"
    loss_scale: str = "loss_scale"
    stable_steps: str = "loss_scale.stable_steps"
    scaled_loss: str = "scaled_loss"

    def out(self, name: str) -> str:
        return name + self.out_suffix

    def state(self, weight: str, state: str) -> str:
        return f"{weight}.{state}"

    def buffer(self, weight: str) -> str:
        return weight + self.buffer_suffix

    def updated(self, name: str) -> str:
        """The output that holds the next value of state input ``name``."""
        if name.endswith(self.buffer_suffix):
            return name[: -len(self.buffer_suffix)] + self.buffer_out_suffix
        return self.out(name)


FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class LossScaleSettings:
    """Dynamic loss scaling (the reference's ``amp.DynamicLossScaler`` defaults).

    The scale is state: input ``loss_scale`` (float scalar) and ``loss_scale.stable_steps``
    (int64 scalar), with ``.out`` outputs. After each step: finite -> stable + 1, and when it
    reaches ``up_scale_window`` the scale doubles (at most ``max_loss_scale``) and stable
    restarts at 0; not finite -> the scale halves (at least ``min_loss_scale``), stable = 0,
    and the update is skipped.
    """

    init_scale: float = float(1 << 16)
    up_scale_window: int = 2000
    min_loss_scale: float = 1.0
    # inf (or anything above float32's largest value): no cap, kept as float32's largest value
    max_loss_scale: float = float(1 << 24)
    # False: a fixed scale (overflowing steps are still skipped).
    dynamic: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.min_loss_scale <= self.init_scale <= self.max_loss_scale:
            raise ValueError("loss scaler: need 0 < min_loss_scale <= init_scale <= max_loss_scale "
                             f"(got {self.min_loss_scale}, {self.init_scale}, {self.max_loss_scale})")
        check_count(self, "up_scale_window", self.up_scale_window, "finite steps before the scale grows")
        if self.init_scale > FLOAT32_MAX:
            raise ValueError(f"loss scaler: init_scale must be a finite float32 (at most "
                             f"{FLOAT32_MAX:.4g}); got {self.init_scale}")
        if self.max_loss_scale > FLOAT32_MAX:  # inf: no cap. The scale is a float32: doubled to
            # inf, every step would overflow and inf / 2 stays inf (training stops, silently)
            object.__setattr__(self, "max_loss_scale", FLOAT32_MAX)


@dataclasses.dataclass(frozen=True)
class UpdateOptions:
    """How gradients become an update, whatever the optimizer algorithm."""

    groups: tuple[ParamGroup, ...] = ()
    accumulation_steps: int = 1
    # Global L2 gradient-norm clipping threshold; None disables clipping.
    max_grad_norm: float | None = None
    # torch.nn.utils.clip_grad_norm_ divides by (total_norm + clip_eps).
    clip_eps: float = 1e-6
    keep_gradient_outputs: bool = False
    # Leave weights and state untouched when the step is not finite (see the module docstring).
    skip_non_finite: bool = True
    # Gradients arrive scaled by the ``loss_scale`` input (mixed precision): unscale, update it.
    loss_scale: LossScaleSettings | None = None
    names: TrainingNames = TrainingNames()
    # Where a skipped step keeps the previous values. True: in the graph (``Where(finite, new,
    # old)`` on every updated value; the graph is self-contained). False: by whoever runs the
    # graph: each conditional ``X.out`` is marked ``gradgraph.valid_if = <flag output>`` and the
    # runtime keeps ``X`` when the flag is false (TrainingSession does: it does not swap its
    # buffers), which saves the selection's passes over every weight and state.
    select_in_graph: bool = True
    # What the finite check (``skip_non_finite``) reads. False: the loss, the learning rate and
    # every new weight and state (a finite gradient whose update overflows is skipped too). True:
    # the loss, the learning rate and the gradients as the update takes them (unscaled, averaged,
    # clipped): the flag is known before any update runs, so a runtime can run the update only
    # on a finite step and write it over the old values in place (TrainingSession does, see
    # :mod:`gradgraph.training.step_split`); an update that overflows on finite gradients is
    # then applied, as in torch.
    guard_before_update: bool = False
    # Weights with fewer elements than this that share an optimizer config, learning-rate scale
    # and dtype are updated together: their gradients, weights and state concatenated into one
    # flat vector per group, the update rule run once on it, the results cut back (Split). Many
    # small tensors (biases, norms) then cost a few large ops instead of a dozen small ones each.
    # 0: every weight alone. Rules registered without ``fusable`` always run per tensor.
    fuse_below: int = 65536

    def __post_init__(self) -> None:
        check_count(self, "accumulation_steps", self.accumulation_steps,
                    "micro-batches per optimizer step")
        clip = self.max_grad_norm
        if clip is not None and not (is_number(clip) and math.isfinite(clip) and clip > 0):
            raise GradientError(f"UpdateOptions.max_grad_norm must be a finite number > 0, or None "
                                f"for no clipping; got {clip!r}")
        check_number(self, "clip_eps", self.clip_eps, low=0.0)
        if isinstance(self.fuse_below, bool) or not isinstance(self.fuse_below, int) or self.fuse_below < 0:
            raise GradientError(f"UpdateOptions.fuse_below must be an integer >= 0 (0: no fused "
                                f"updates); got {self.fuse_below!r}")


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """Everything the optimizer part of a training graph depends on: the algorithm's config
    (``SGDConfig``, ``AdamWConfig``, ...) and the update options."""

    optimizer: Any
    update: UpdateOptions = UpdateOptions()


class OptimizerPass(InPlacePass):
    def __init__(self, settings: OptimizerSettings, gradients: Mapping[str, ir.Value],
                 apply: bool = True, loss: ir.Value | None = None) -> None:
        super().__init__()
        check_groups(settings.optimizer, settings.update.groups)
        self.settings = settings
        self.gradients = dict(gradients)
        self.apply = apply
        self.loss = loss

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        if OPTIMIZER_KEY in graph.metadata_props:
            return PassResult(model, False)
        graph.metadata_props[OPTIMIZER_KEY] = "apply" if self.apply else "accumulate"
        opset = model.opset_imports.get("", None) or model.opset_imports.get("ai.onnx", 13)
        b = OpBuilder(opset, dict(model.opset_imports))
        b.prefix = "optimizer"
        b.marks = {STAGE_KEY: Role.OPTIMIZER.value}
        s = self.settings.update
        names = s.names
        inputs = {v.name: v for v in graph.inputs}
        weights = sorted(self.gradients)
        missing = [w for w in weights if w not in inputs]
        if missing:
            raise ValueError(f"trained weights {missing} must be graph inputs before OptimizerPass")
        grads: dict[str, Var] = {}
        for w in weights:
            value = self.gradients[w]
            if not s.keep_gradient_outputs and value in graph.outputs:
                graph.outputs.remove(value)
            grads[w] = b.wrap(value)
        outputs: list[ir.Value] = []

        def add_input(name: str, like: ir.Value | None, dtype: ir.DataType | None = None) -> Var:
            """A new graph input: a scalar of ``dtype`` if given, else typed and shaped like ``like``."""
            if dtype:
                value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape([]))
            else:
                assert like is not None, f"input {name!r}: give a dtype or a value to copy"
                value = ir.Value(name=name, type=like.type, shape=like.shape)
            graph.inputs.append(value)
            return b.wrap(value)

        def add_output(var: Var, name: str, like: ir.Value | None = None,
                       scalar: ir.DataType = ir.DataType.FLOAT, role: OutputRole | None = None,
                       valid_if: str | None = None) -> None:
            value = var.value
            owned = b.owns(value)
            if not owned or value.is_graph_input() or value.is_graph_output():
                value = b.Identity(var).value
            value.name = name
            if like is not None:
                value.type, value.shape = like.type, like.shape
            else:  # unlike outputs are scalars: the gradient norm, the finite flag
                value.type, value.shape = ir.TensorType(scalar), ir.Shape([])
            if role is not None:
                value.metadata_props[OUTPUT_KEY] = role.value
            if valid_if is not None:
                value.metadata_props[VALID_IF_KEY] = valid_if
            outputs.append(value)

        if s.accumulation_steps > 1:
            reset = add_input(names.reset, None, ir.DataType.BOOL)
            for w in weights:
                buf = add_input(names.buffer(w), inputs[w])
                grads[w] = b.Where(reset, grads[w], buf + grads[w])
                if not self.apply:
                    add_output(grads[w], w + names.buffer_out_suffix, inputs[w])
                else:
                    grads[w] = grads[w] * (1.0 / s.accumulation_steps)
        if self.apply:
            self._apply(b, graph, inputs, weights, grads, add_input, add_output)
        scope_taken_names(graph, b.nodes, b.prefix)
        graph.extend(b.nodes)
        graph.outputs.extend(outputs)
        return PassResult(model, True)

    def _apply(self, b: OpBuilder, graph: ir.Graph, inputs: Mapping[Any, ir.Value], weights: list[str],
               grads: dict[str, Var], add_input: Any, add_output: Any) -> None:
        """Unscale, clip, update every weight (fused where it can), skip a non-finite step."""
        s = self.settings.update
        names = s.names
        units = _units(self.settings, weights, inputs)
        # One gradient per unit: a fused unit's gradients concatenated.
        unit_grads = {i: flatten_join(b, [grads[w] for w in u.weights]) if u.fused else grads[u.weights[0]]
                      for i, u in enumerate(units)}
        scaler = None
        if s.loss_scale is not None:
            scaler = self._unscale(b, graph, unit_grads, add_input, add_output)
        if s.max_grad_norm is not None:
            # The norm from each weight's own gradient, in one order, whatever the fusing (a
            # fused unit's sum of squares would add in another order): fused and per-tensor
            # updates then clip by the same factor. Under a loss scale, from the unscaled units.
            parts = list(unit_grads.values()) if scaler is not None else [grads[w] for w in weights]
            self._clip(b, unit_grads, parts, add_output)
        # float64 where a float64 weight is trained: a float32 rate (1e-3 -> 1.00000005e-3) would
        # move float64 weights off torch's trajectory by ~5e-8 relative a step
        double = any(inputs[w].dtype == ir.DataType.DOUBLE for w in weights)
        lr = add_input(names.learning_rate, None, ir.DataType.DOUBLE if double else ir.DataType.FLOAT)
        step = add_input(names.step, None, ir.DataType.INT64)
        sc = StepScalars(b, lr, step)
        updates: list[_Update] = []
        checked: list[Var] = [lr]  # what the finite check reads (see optimizer_rule's finite_witness)
        for i, unit in enumerate(units):
            cfg = unit.config
            state_in = {k: [add_input(names.state(w, k), inputs[w]) for w in unit.weights]
                        for k in cfg.state_names()}
            old_w = [b.wrap(inputs[w]) for w in unit.weights]
            if unit.fused:
                w_var = flatten_join(b, old_w)
                state = {k: flatten_join(b, vs) for k, vs in state_in.items()}
            else:
                w_var, state = old_w[0], {k: vs[0] for k, vs in state_in.items()}
            extra = {"segments": unit.sizes} if unit.fused and fusable_kind(cfg) == "segments" else {}
            new_w, new_state = rule_for(cfg)(b, cfg, w_var, unit_grads[i], state, sc, unit.lr_scale, **extra)
            updates.append(_Update(new_w, w_var, [(names.out(w), inputs[w]) for w in unit.weights], unit))
            witness = finite_witness(cfg)
            if s.guard_before_update:
                checked += [unit_grads[i]] if scaler is None else []  # the scaler read them
            else:
                checked += [new_w, new_state[witness]] if witness in new_state else [new_w, *new_state.values()]
            for k, v in new_state.items():
                old = state[k]
                updates.append(_Update(v, old, [(names.out(names.state(w, k)), inputs[w])
                                                 for w in unit.weights], unit))
        counter = _Update(b.Add(step, 1), step, [(names.out(names.step), step.value)], None)
        flag = None  # the output that says whether the step is taken
        if s.skip_non_finite:
            if self.loss is not None:
                checked.append(b.wrap(self.loss))
            finite = _all_finite(b, checked)
            if scaler is not None:
                finite = b.And(finite, scaler)
            add_output(finite, names.finite, None, ir.DataType.BOOL, OutputRole.STEP_FINITE)
            flag = (finite, names.finite)
        elif scaler is not None:
            flag = (scaler, names.gradients_finite)
        updates.append(counter)
        for u in updates:
            new, valid_if = u.new, None
            if flag is not None and s.select_in_graph:
                new = b.Where(flag[0], u.new, u.old)
            elif flag is not None:
                valid_if = flag[1]
            parts = [new] if u.unit is None or not u.unit.fused else u.unit.split(b, new)
            for part, (name, like) in zip(parts, u.outputs, strict=True):
                add_output(part, name, like, valid_if=valid_if)
        if scaler is not None:
            self._update_scale(b, scaler, add_output)

    def _unscale(self, b: OpBuilder, graph: ir.Graph, grads: dict[Any, Var], add_input: Any,
                 add_output: Any) -> Var:
        """Divide the gradients by the ``loss_scale`` input; returns ``all_gradients_finite``."""
        names = self.settings.update.names
        f32 = ir.DataType.FLOAT
        scale = next((b.wrap(v) for v in graph.inputs if v.name == names.loss_scale), None)
        if scale is None:  # LossScalePass made it; a graph without it gets it here
            scale = add_input(names.loss_scale, None, f32)
        scale.value.metadata_props[OUTPUT_KEY] = OutputRole.LOSS_SCALE.value
        self._scale = scale
        self._stable = add_input(names.stable_steps, None, ir.DataType.INT64)
        inverse = b.Reciprocal(scale)
        for w, g in grads.items():
            grads[w] = g * b.cast_to(inverse, g.dtype)
        finite = _all_finite(b, list(grads.values()))
        add_output(finite, names.gradients_finite, None, ir.DataType.BOOL,
                   OutputRole.ALL_GRADIENTS_FINITE)
        return finite

    def _update_scale(self, b: OpBuilder, finite: Var, add_output: Any) -> None:
        """The dynamic loss scaler's step (see :class:`LossScaleSettings`)."""
        s = self.settings.update
        cfg, names = s.loss_scale, s.names
        assert cfg is not None
        f32 = ir.DataType.FLOAT
        stable = b.Where(finite, self._stable + 1, b.const(0, ir.DataType.INT64))
        grow = b.GreaterOrEqual(stable, b.const(cfg.up_scale_window, ir.DataType.INT64))
        up = b.Min(self._scale * 2.0, b.const(cfg.max_loss_scale, f32))
        down = b.Max(self._scale * 0.5, b.const(cfg.min_loss_scale, f32))
        new_scale = b.Where(finite, b.Where(grow, up, self._scale), down)
        stable = b.Where(grow, b.const(0, ir.DataType.INT64), stable)
        if not cfg.dynamic:
            new_scale, stable = self._scale, self._stable
        add_output(new_scale, names.out(names.loss_scale), None, f32)
        add_output(stable, names.out(names.stable_steps), None, ir.DataType.INT64)

    def _clip(self, b: OpBuilder, grads: dict[Any, Var], parts: list[Var], add_output: Any) -> None:
        """Scale ``grads`` by ``min(1, max_norm / (norm + eps))``, the norm that of ``parts``."""
        s = self.settings.update
        f32 = ir.DataType.FLOAT
        squares = [b.cast_to(b.reduce("ReduceSumSquare", g, None, keepdims=0), f32) for g in parts]
        total = b.Sqrt(squares[0] if len(squares) == 1 else b.Sum(*squares))
        coef = b.Min(b.const(s.max_grad_norm, f32) / (total + s.clip_eps), b.const(1.0, f32))
        for w, g in grads.items():
            grads[w] = g * b.cast_to(coef, g.dtype)
        add_output(total, s.names.grad_norm, role=OutputRole.GRAD_NORM)


def _all_finite(b: OpBuilder, values: list[Var]) -> Var:
    """Bool scalar: every element of every value is finite.

    float32/float64 values: the sum of a value is NaN or inf exactly when one of its elements
    is, or when the sum of its finite elements overflows (|sum| > 3.4e38 in float32: counted
    as not finite). One read of each value. Other types (float16's range is easily exceeded by
    a sum): ``x * 0`` is 0 for finite x and NaN for NaN/inf, and so is the sum of those. Each
    value's verdict is a scalar ``s * 0`` (0 or NaN), so combining them cannot overflow.
    """
    f32 = ir.DataType.FLOAT
    verdicts = []
    for v in values:
        exact = v.known_dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE)
        total = b.reduce("ReduceSum", v * 0.0 if exact else v, None, keepdims=0)
        verdicts.append(b.cast_to(total * 0.0, f32))
    combined = verdicts[0] if len(verdicts) == 1 else b.Sum(*verdicts)
    return b.Not(b.IsNaN(combined))


@dataclasses.dataclass
class _Unit:
    """Weights updated together: one (``fused=False``) or several concatenated."""

    weights: list[str]
    config: Any
    lr_scale: float
    sizes: tuple[int, ...]
    shapes: list[list[int]]

    @property
    def fused(self) -> bool:
        return len(self.weights) > 1

    def split(self, b: OpBuilder, flat: Var) -> list[Var]:
        """``flat`` (this unit's concatenation) cut back into tensors of the weights' shapes."""
        parts = split_flat(b, flat, self.sizes)
        return [b.Reshape(p, b.const(np.array(shape, np.int64))) for p, shape in zip(parts, self.shapes)]


@dataclasses.dataclass
class _Update:
    new: Var
    old: Var
    outputs: list[tuple[str, ir.Value]]  # (output name, the value it is shaped like)
    unit: _Unit | None


def _units(settings: OptimizerSettings, weights: list[str], inputs: Mapping[Any, ir.Value]) -> list[_Unit]:
    """The weights grouped for the update: those below ``fuse_below`` elements, of a fusable
    rule and static shape, with the same config, lr scale and dtype, share one unit."""
    limit = settings.update.fuse_below
    units: list[_Unit] = []
    groups: dict[tuple[Any, ...], _Unit] = {}
    for w in weights:
        cfg, lr_scale = resolve(settings.optimizer, settings.update.groups, w)
        value = inputs[w]
        static = value.shape is not None and all(isinstance(d, int) for d in value.shape)
        dims = [d for d in value.shape if isinstance(d, int)] if static and value.shape is not None else []
        size = int(np.prod(dims)) if static else 0
        if static and fusable_kind(cfg) is not None and 0 < size < limit:
            key = (cfg, lr_scale, value.dtype)
            unit = groups.get(key)
            if unit is None:
                unit = groups[key] = _Unit([], cfg, lr_scale, (), [])
                units.append(unit)
            unit.weights.append(w)
            unit.sizes += (size,)
            unit.shapes.append(dims)
            continue
        units.append(_Unit([w], cfg, lr_scale, (size,), [dims]))
    return units
