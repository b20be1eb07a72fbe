"""Gradients of LSTM, GRU and RNN by back-propagation through time.

The rule unrolls the recurrence over the (static) sequence length: per direction it
recomputes the forward steps (the cell code lives in :mod:`recurrent_cells`), then walks
the steps backwards, and finally turns the per-step pre-activation gradients into the
gradients of X, W, R, B, P, initial_h and initial_c with a few batched MatMuls.

``sequence_lens``: a step ``t`` with ``t >= sequence_lens[b]`` does not change the state
of batch entry ``b`` and outputs zeros, which a 0/1 mask per step expresses (for both
directions). Supported: all directions, optional inputs, ``clip``, GRU
``linear_before_reset``, layout 0 and 1, default activations. Unsupported attribute values
raise ValueError.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from passes.autodiff.builder import OpBuilder, Var
from passes.autodiff.registry import grad_rule
from passes.autodiff.rules.recurrent_cells import (
    CELLS,
    PEEPHOLES,
    Cell,
    DirectionParams,
    StepGrad,
    split,
)

IN_X, IN_W, IN_R, IN_B, IN_LENS, IN_H0, IN_C0, IN_P = range(8)
OUT_Y, OUT_YH, OUT_YC = range(3)
# layout 1 <-> layout 0 permutations
_SWAP01 = [1, 0, 2]
_Y_TO_LAYOUT0 = [1, 2, 0, 3]


@dataclasses.dataclass
class Step:
    """What the backward walk needs from one forward step."""

    t: int
    h_prev: Var
    c_prev: Var | None
    state: dict
    mask: Var | None  # [B, 1], 1 where t < sequence_lens


@dataclasses.dataclass
class DirectionGrads:
    """Per-step gradients of one direction, in processing order."""

    steps: list[tuple[int, StepGrad]]
    dh0: Var
    dc0: Var | None


def _check_attributes(n, cell: Cell, directions: int) -> None:
    acts = n.attr("activations")
    if acts is not None and [a.lower() for a in acts] != [a.lower() for a in cell.activations] * directions:
        raise ValueError(f"{n.op_type} gradient supports the default activations "
                         f"{list(cell.activations)} only, got {acts}")
    if n.attr("input_forget", 0):
        raise ValueError("LSTM gradient does not support input_forget=1")


def _seq_length(x: Var, layout: int, op_type: str) -> int:
    """The number of time steps, which the unrolled backward needs statically."""
    t = x.shape[layout] if x.shape is not None else None
    if not isinstance(t, int):
        raise ValueError(f"{op_type} gradient needs a static sequence length (dim {layout} of X "
                         f"is {t!r}); give X a fixed time dimension")
    return t


def _scalar(b: OpBuilder, k: int) -> Var:
    return b.const(np.array(k, np.int64))


def _zeros_state(b: OpBuilder, x: Var, hidden: int) -> Var:
    shape = b.Concat(b.dim(x, 1), [hidden], axis=0)
    return b.ConstantOfShape(shape, value=ir.tensor(np.zeros(1, x.known_dtype.numpy())))


def _params(b: OpBuilder, n, cell: Cell, d: int, hidden: int) -> DirectionParams:
    """Direction ``d``'s weights, biases and peepholes."""
    k = _scalar(b, d)
    gh = cell.gates * hidden
    wb = rb = peep = None
    if n.has_input(IN_B):
        wb, rb = split(b, b.Gather(n.inputs[IN_B], k, axis=0), [gh, gh], axis=0)
    if n.has_input(IN_P):
        peep = split(b, b.Gather(n.inputs[IN_P], k, axis=0), [hidden] * PEEPHOLES, axis=0)
    params = DirectionParams(hidden, b.Gather(n.inputs[IN_W], k, axis=0),
                             b.Gather(n.inputs[IN_R], k, axis=0), wb, rb, peep,
                             n.attr("clip"), bool(n.attr("linear_before_reset", 0)))
    cell.prepare(b, params)
    return params


def _initial(b: OpBuilder, state: Var | None, x: Var, d: int, hidden: int) -> Var:
    return _zeros_state(b, x, hidden) if state is None else b.Gather(state, _scalar(b, d), axis=0)


def _forward(b, cell: Cell, p: DirectionParams, x: Var, h0: Var, c0: Var | None,
             lens: Var | None, order: list[int]) -> list[Step]:
    """Recompute the steps of one direction, in processing order."""
    xw = b.MatMul(x, b.Transpose(p.w, perm=[1, 0]))
    if p.wb is not None:
        xw = xw + p.wb
    h, c = h0, c0
    steps = []
    for t in order:
        state = cell.forward(b, p, b.Gather(xw, _scalar(b, t), axis=0), h, c)
        mask = None
        if lens is not None:
            mask = b.Unsqueeze(b.Cast(b.Less(_scalar(b, t), lens), to=int(x.known_dtype)), [1])
        steps.append(Step(t, h, c, state, mask))
        h = _blend(state["h"], h, mask)
        c = _blend(state["c"], c, mask) if c is not None else None
    return steps


def _blend(new: Var, old: Var, mask: Var | None) -> Var:
    """The carried state: ``new`` where the step is inside the sequence, ``old`` after it."""
    return new if mask is None else mask * new + (1.0 - mask) * old


def _masked(v: Var, mask: Var | None) -> Var:
    return v if mask is None else v * mask


def _backward(b, cell: Cell, p: DirectionParams, steps: list[Step], gy: Var | None,
              dh: Var, dc: Var | None) -> DirectionGrads:
    """Walk the steps backwards; ``gy`` is dY of this direction ([T, B, H]) or None."""
    grads = []
    for step in reversed(steps):
        dh_new = dh if gy is None else dh + b.Gather(gy, _scalar(b, step.t), axis=0)
        sg = cell.backward(b, p, step.state, step.h_prev, step.c_prev,
                           _masked(dh_new, step.mask), None if dc is None else _masked(dc, step.mask))
        grads.append((step.t, sg))
        carried = None if step.mask is None else 1.0 - step.mask
        dh = sg.dh_prev if carried is None else sg.dh_prev + carried * dh
        if dc is not None:
            dc = sg.dc_prev if carried is None else sg.dc_prev + carried * dc
    return DirectionGrads(grads, dh, dc)


def _stack(b: OpBuilder, parts: list[Var]) -> Var:
    """Stack per-direction tensors on a new axis 0."""
    parts = [b.Unsqueeze(v, [0]) for v in parts]
    return parts[0] if len(parts) == 1 else b.Concat(*parts, axis=0)


def _sum_rows(b: OpBuilder, v: Var) -> Var:
    return b.ReduceSum(v, [0], keepdims=0)


def _weight_grads(b, n, p: DirectionParams, x2d: Var, dg: DirectionGrads) -> dict[int, Var]:
    """dX (this direction's share), dW, dR, dB and dP of one direction."""
    by_time = sorted(dg.steps, key=lambda item: item[0])
    d_ax = b.Concat(*[sg.d_ax for _, sg in by_time], axis=0)  # [T*B, G*H], rows like x2d
    out: dict[int, Var] = {}
    if n.needs_grad(IN_X):
        out[IN_X] = b.MatMul(d_ax, p.w)
    if n.needs_grad(IN_W):
        out[IN_W] = b.MatMul(b.Transpose(d_ax, perm=[1, 0]), x2d)
    blocks = len(by_time[0][1].rec)
    d_rec = [b.Concat(*[sg.rec[k][0] for _, sg in by_time], axis=0) for k in range(blocks)]
    if n.needs_grad(IN_R):
        parts = [b.MatMul(b.Transpose(d_rec[k], perm=[1, 0]),
                          b.Concat(*[sg.rec[k][1] for _, sg in by_time], axis=0))
                 for k in range(blocks)]
        out[IN_R] = parts[0] if blocks == 1 else b.Concat(*parts, axis=0)
    if n.needs_grad(IN_B):
        out[IN_B] = b.Concat(_sum_rows(b, d_ax), *[_sum_rows(b, v) for v in d_rec], axis=0)
    if n.needs_grad(IN_P):
        out[IN_P] = _sum_rows(b, b.Concat(*[sg.d_peep for _, sg in by_time], axis=0))
    return out


def _output_grads(b, n, g, layout: int) -> tuple[Var | None, Var | None, Var | None]:
    """dY ([T, D, B, H]), dY_h and dY_c ([D, B, H]) in layout 0."""
    gy, gyh = g[OUT_Y], g[OUT_YH] if len(g) > OUT_YH else None
    gyc = g[OUT_YC] if len(g) > OUT_YC else None
    if layout:
        gy = None if gy is None else b.Transpose(gy, perm=_Y_TO_LAYOUT0)
        gyh = None if gyh is None else b.Transpose(gyh, perm=_SWAP01)
        gyc = None if gyc is None else b.Transpose(gyc, perm=_SWAP01)
    return gy, gyh, gyc


def _layout0(b, v: Var | None, layout: int) -> Var | None:
    return v if v is None or not layout else b.Transpose(v, perm=_SWAP01)


@grad_rule("RNN", "GRU", "LSTM", since=7)
def _recurrent(b, n, g):
    cell = CELLS[n.op_type]
    direction = n.attr("direction", "forward")
    num_dir = 2 if direction == "bidirectional" else 1
    _check_attributes(n, cell, num_dir)
    layout = n.attr("layout", 0)
    hidden = n.attr("hidden_size") or n.inputs[IN_R].shape[-1]
    steps_count = _seq_length(n.inputs[IN_X], layout, n.op_type)
    x = _layout0(b, n.inputs[IN_X], layout)
    h0 = _layout0(b, n.inputs[IN_H0] if n.has_input(IN_H0) else None, layout)
    c0 = _layout0(b, n.inputs[IN_C0] if n.has_input(IN_C0) else None, layout)
    lens = b.Cast(n.inputs[IN_LENS], to=int(ir.DataType.INT64)) if n.has_input(IN_LENS) else None
    gy, gyh, gyc = _output_grads(b, n, g, layout)
    x2d = b.Reshape(x, b.Concat([-1], b.dim(x, 2), axis=0))
    results: dict[int, list[Var]] = {}
    for d in range(num_dir):
        reverse = direction == "reverse" or d == 1
        p = _params(b, n, cell, d, hidden)
        order = list(range(steps_count))[::-1] if reverse else list(range(steps_count))
        hd = _initial(b, h0, x, d, hidden)
        cd = _initial(b, c0, x, d, hidden) if cell.has_cell_state else None
        steps = _forward(b, cell, p, x, hd, cd, lens, order)
        dh = b.zeros_like(hd) if gyh is None else b.Gather(gyh, _scalar(b, d), axis=0)
        dc = None
        if cell.has_cell_state:
            dc = b.zeros_like(cd) if gyc is None else b.Gather(gyc, _scalar(b, d), axis=0)
        gy_d = None if gy is None else b.Gather(gy, _scalar(b, d), axis=1)
        dg = _backward(b, cell, p, steps, gy_d, dh, dc)
        for k, v in _weight_grads(b, n, p, x2d, dg).items():
            results.setdefault(k, []).append(v)
        results.setdefault(IN_H0, []).append(dg.dh0)
        if dc is not None:
            results.setdefault(IN_C0, []).append(dg.dc0)
    return _assemble(b, n, x, results, layout)


def _assemble(b, n, x: Var, results: dict[int, list[Var]], layout: int) -> list[Var | None]:
    """One gradient per input, directions stacked, layouts restored."""
    grads: list[Var | None] = [None] * len(n.inputs)
    for k in range(len(n.inputs)):
        if not n.needs_grad(k) or k not in results:
            continue
        if k == IN_X:
            dx = results[k][0] if len(results[k]) == 1 else b.Sum(*results[k])
            grads[k] = _layout0(b, b.Reshape(dx, b.Shape(x)), layout)
        elif k in (IN_H0, IN_C0):
            grads[k] = _layout0(b, _stack(b, results[k]), layout)
        else:
            grads[k] = _stack(b, results[k])
    return grads
