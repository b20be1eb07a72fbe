"""One time step of the LSTM, GRU and RNN cells (default activations): forward and backward.

Conventions (one direction, batch ``B``, hidden ``H``, ``G`` gates):

- ``ax`` is the input projection of the step, ``x_t @ W^T + Wb`` (``[B, G*H]``);
- a cell's recurrent projection is ``h_prev @ R^T + Rb``, except the GRU hidden gate
  without ``linear_before_reset``, which projects ``r * h_prev`` (a second block);
- ``forward`` returns the new (unmasked) hidden / cell state and the activations that
  ``backward`` reuses; ``backward`` gets the gradients of those new states and returns
  the gradients of ``ax``, of each recurrent block's pre-activation (with the block's
  recurrent input, for dR), of the previous states and of the peepholes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from passes.autodiff.builder import OpBuilder, Var

LSTM_GATES = 4  # i, o, f, c
GRU_GATES = 3  # z, r, h
RNN_GATES = 1
PEEPHOLES = 3  # i, o, f


@dataclasses.dataclass
class DirectionParams:
    """The weights of one direction, pre-split for the cell."""

    hidden: int
    w: Var  # [G*H, I]
    r: Var  # [G*H, H]
    wb: Var | None  # [G*H]
    rb: Var | None  # [G*H]
    peep: list[Var] | None  # LSTM peepholes [H] each: i, o, f
    clip: float | None
    linear_before_reset: bool = False
    extra: dict[str, Var] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class StepGrad:
    """The gradients a cell step sends back."""

    d_ax: Var  # [B, G*H]
    rec: list[tuple[Var, Var]]  # (d pre-activation block [B, k*H], its recurrent input [B, H])
    dh_prev: Var
    dc_prev: Var | None = None
    d_peep: Var | None = None  # [B, 3H] (i, o, f)


def activate(b: OpBuilder, op: str, pre: Var, p: DirectionParams) -> tuple[Var, Var | None]:
    """``op(clip(pre))`` and the 0/1 mask where the clip lets the gradient through."""
    if p.clip is None:
        return b.op(op, pre), None
    y = b.op(op, b.Clip(pre, -p.clip, p.clip, _like=p.w))
    return y, b.Cast(b.LessOrEqual(b.Abs(pre), b.const(p.clip, p.w.dtype)), to=int(p.w.known_dtype))


def d_sigmoid(dy: Var, y: Var, mask: Var | None) -> Var:
    d = dy * y * (1.0 - y)
    return d if mask is None else d * mask


def d_tanh(dy: Var, y: Var, mask: Var | None) -> Var:
    d = dy * (1.0 - y * y)
    return d if mask is None else d * mask


def _project(b: OpBuilder, h: Var, r_t: Var, rb: Var | None) -> Var:
    out = b.MatMul(h, r_t)
    return out if rb is None else out + rb


def split(b: OpBuilder, x: Var, sizes: list[int], axis: int = -1) -> list[Var]:
    """Split ``x``; every part gets ``x``'s dtype (the builder types the first output only)."""
    parts = b.Split(x, sizes, axis=axis, _outputs=len(sizes))
    for part in parts:
        part.value.type = x.value.type
    return parts


# ---- LSTM ------------------------------------------------------------------------------------
def lstm_prepare(b: OpBuilder, p: DirectionParams) -> None:
    p.extra["r_t"] = b.Transpose(p.r, perm=[1, 0])


def lstm_forward(b: OpBuilder, p: DirectionParams, ax: Var, h: Var, c: Var) -> dict[str, Any]:
    """i, f, o = sigmoid, g = tanh; C' = f*C + i*g; H' = o * tanh(C') (peepholes optional)."""
    pre_i, pre_o, pre_f, pre_g = split(b, ax + _project(b, h, p.extra["r_t"], p.rb), [p.hidden] * LSTM_GATES)
    if p.peep is not None:
        pre_i = pre_i + p.peep[0] * c
        pre_f = pre_f + p.peep[2] * c
    i, mi = activate(b, "Sigmoid", pre_i, p)
    f, mf = activate(b, "Sigmoid", pre_f, p)
    g, mg = activate(b, "Tanh", pre_g, p)
    c_new = f * c + i * g
    if p.peep is not None:
        pre_o = pre_o + p.peep[1] * c_new
    o, mo = activate(b, "Sigmoid", pre_o, p)
    tc = b.Tanh(c_new)
    return {"h": o * tc, "c": c_new, "i": i, "f": f, "g": g, "o": o, "tc": tc,
            "masks": (mi, mo, mf, mg)}


def lstm_backward(b: OpBuilder, p: DirectionParams, s: dict[str, Any], h: Var, c: Var,
                  dh: Var, dc: Var) -> StepGrad:
    mi, mo, mf, mg = s["masks"]
    i, f, g, o, tc = s["i"], s["f"], s["g"], s["o"], s["tc"]
    do_pre = d_sigmoid(dh * tc, o, mo)
    dc_new = dc + d_tanh(dh * o, tc, None)
    if p.peep is not None:
        dc_new = dc_new + do_pre * p.peep[1]
    di_pre = d_sigmoid(dc_new * g, i, mi)
    df_pre = d_sigmoid(dc_new * c, f, mf)
    dg_pre = d_tanh(dc_new * i, g, mg)
    dc_prev = dc_new * f
    d_peep = None
    if p.peep is not None:
        dc_prev = dc_prev + di_pre * p.peep[0] + df_pre * p.peep[2]
        d_peep = b.Concat(di_pre * c, do_pre * s["c"], df_pre * c, axis=-1)
    d_pre = b.Concat(di_pre, do_pre, df_pre, dg_pre, axis=-1)
    return StepGrad(d_pre, [(d_pre, h)], b.MatMul(d_pre, p.r), dc_prev, d_peep)


# ---- GRU -------------------------------------------------------------------------------------
def gru_prepare(b: OpBuilder, p: DirectionParams) -> None:
    hid = p.hidden
    if p.linear_before_reset:
        p.extra["r_t"] = b.Transpose(p.r, perm=[1, 0])
        return
    r_zr, r_h = split(b, p.r, [2 * hid, hid], axis=0)
    p.extra.update(r_zr=r_zr, r_h=r_h, r_zr_t=b.Transpose(r_zr, perm=[1, 0]),
                   r_h_t=b.Transpose(r_h, perm=[1, 0]))
    if p.rb is not None:
        p.extra["rb_zr"], p.extra["rb_h"] = split(b, p.rb, [2 * hid, hid], axis=0)


def gru_forward(b: OpBuilder, p: DirectionParams, ax: Var, h: Var, c: Var | None) -> dict[str, Any]:
    """z, r = sigmoid, h~ = tanh(.. r ..); H' = (1 - z) * h~ + z * H."""
    hid, e = p.hidden, p.extra
    ax_z, ax_r, ax_h = split(b, ax, [hid] * GRU_GATES)
    s: dict[str, Any] = {}
    if p.linear_before_reset:
        ar_z, ar_r, ar_h = split(b, _project(b, h, e["r_t"], p.rb), [hid] * GRU_GATES)
    else:
        ar_z, ar_r = split(b, _project(b, h, e["r_zr_t"], e.get("rb_zr")), [hid, hid])
    z, mz = activate(b, "Sigmoid", ax_z + ar_z, p)
    r, mr = activate(b, "Sigmoid", ax_r + ar_r, p)
    if p.linear_before_reset:
        s["ar_h"] = ar_h
        pre_h = ax_h + r * ar_h
    else:
        s["rh"] = r * h
        pre_h = ax_h + _project(b, s["rh"], e["r_h_t"], e.get("rb_h"))
    ht, mh = activate(b, "Tanh", pre_h, p)
    s.update(h=ht + z * (h - ht), c=None, z=z, r=r, ht=ht, masks=(mz, mr, mh))
    return s


def gru_backward(b: OpBuilder, p: DirectionParams, s: dict[str, Any], h: Var, c: Var | None,
                 dh: Var, dc: Var | None) -> StepGrad:
    mz, mr, mh = s["masks"]
    z, r, ht = s["z"], s["r"], s["ht"]
    dz_pre = d_sigmoid(dh * (h - ht), z, mz)
    dh_pre = d_tanh(dh * (1.0 - z), ht, mh)
    dh_prev = dh * z
    if p.linear_before_reset:
        dar_h = dh_pre * r
        dr_pre = d_sigmoid(dh_pre * s["ar_h"], r, mr)
        d_rec = b.Concat(dz_pre, dr_pre, dar_h, axis=-1)
        rec = [(d_rec, h)]
        dh_prev = dh_prev + b.MatMul(d_rec, p.r)
    else:
        d_rh = b.MatMul(dh_pre, p.extra["r_h"])
        dr_pre = d_sigmoid(d_rh * h, r, mr)
        d_zr = b.Concat(dz_pre, dr_pre, axis=-1)
        rec = [(d_zr, h), (dh_pre, s["rh"])]
        dh_prev = dh_prev + d_rh * r + b.MatMul(d_zr, p.extra["r_zr"])
    return StepGrad(b.Concat(dz_pre, dr_pre, dh_pre, axis=-1), rec, dh_prev)


# ---- RNN -------------------------------------------------------------------------------------
def rnn_prepare(b: OpBuilder, p: DirectionParams) -> None:
    p.extra["r_t"] = b.Transpose(p.r, perm=[1, 0])


def rnn_forward(b: OpBuilder, p: DirectionParams, ax: Var, h: Var, c: Var | None) -> dict[str, Any]:
    """H' = tanh(ax + H @ R^T + Rb)."""
    h_new, mask = activate(b, "Tanh", ax + _project(b, h, p.extra["r_t"], p.rb), p)
    return {"h": h_new, "c": None, "mask": mask}


def rnn_backward(b: OpBuilder, p: DirectionParams, s: dict[str, Any], h: Var, c: Var | None,
                 dh: Var, dc: Var | None) -> StepGrad:
    d_pre = d_tanh(dh, s["h"], s["mask"])
    return StepGrad(d_pre, [(d_pre, h)], b.MatMul(d_pre, p.r))


@dataclasses.dataclass(frozen=True)
class Cell:
    """How one op's cell is prepared, run and differentiated."""

    gates: int
    activations: tuple[str, ...]  # the default activations of one direction
    has_cell_state: bool
    prepare: Any
    forward: Any
    backward: Any


CELLS = {
    "LSTM": Cell(LSTM_GATES, ("Sigmoid", "Tanh", "Tanh"), True, lstm_prepare, lstm_forward, lstm_backward),
    "GRU": Cell(GRU_GATES, ("Sigmoid", "Tanh"), False, gru_prepare, gru_forward, gru_backward),
    "RNN": Cell(RNN_GATES, ("Tanh",), False, rnn_prepare, rnn_forward, rnn_backward),
}
