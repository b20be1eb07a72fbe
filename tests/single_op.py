"""One-op fixtures and gradient oracles shared by test_rules_conv.py and test_rules_resize.py.

A fixture is one op followed by ``loss = sum(y * R)`` with a fixed random ``R``
(``fdcheck.with_weighted_loss``), so every element of the output gradient differs.

Oracles: ``fdcheck`` (float64 central differences; onnxruntime, or the ONNX reference
evaluator where onnxruntime has no float64 kernel), :func:`assert_linear_fd` for ops that
are linear in each input (a unit-step central difference in onnxruntime float32 itself is
exact up to rounding and follows onnxruntime's conventions where the reference evaluator
differs), and torch float64 autograd (:func:`assert_matches_torch`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import fdcheck
import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

OPSET = 19
# Gradient graph (float32, onnxruntime) vs torch float64 autograd.
TORCH_ATOL, TORCH_RTOL = 1e-4, 1e-4
# assert_linear_fd: exact for linear ops with a unit step; float32 rounding only.
LINEAR_STEP = 1.0
LINEAR_ELEMENTS = 32
LINEAR_ATOL, LINEAR_RTOL = 1e-4, 1e-4


def make_model(op: str, inputs: Mapping[str, tuple[int | str, ...]], attrs: Mapping, *, opset: int = OPSET,
               outputs: Sequence[str] = ("y",), consts: Mapping[str, np.ndarray] | None = None,
               node_inputs: Sequence[str] | None = None,
               fixed: Mapping[str, np.ndarray] | None = None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``op`` on float32 graph ``inputs`` and initializers ``consts``, plus the loss.

    Feeds are random except the ``fixed`` ones (required for inputs with symbolic dims). ``node_inputs`` orders the op's inputs
    ("" for an absent optional one); by default the graph inputs, then the constants.
    """
    consts = dict(consts or {})
    rng = np.random.default_rng(len(inputs) + sum(map(len, inputs.values())))
    fixed = dict(fixed or {})
    feeds = {k: fixed[k] if k in fixed else rng.standard_normal(s).astype(np.float32)
             for k, s in inputs.items()}
    order = list(node_inputs) if node_inputs is not None else list(inputs) + list(consts)
    node = helper.make_node(op, order, list(outputs), **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, s) for k, s in inputs.items()],
        [helper.make_tensor_value_info(outputs[0], TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    y_shape = fdcheck.session(model).run([outputs[0]], feeds)[0].shape
    return fdcheck.with_weighted_loss(model, {outputs[0]: y_shape}), feeds


def loss_weight(model: onnx.ModelProto) -> np.ndarray:
    init = next(t for t in model.graph.initializer if t.name.startswith("fdcheck_w_"))
    return numpy_helper.to_array(init)


def onnx_grads(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], wrt=None) -> dict[str, np.ndarray]:
    return fdcheck.analytic_gradients(model, list(wrt or feeds), feeds)


def assert_fd(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], wrt=None) -> None:
    reports = fdcheck.compare_gradients(model, list(wrt or feeds), feeds, fdcheck.FLOAT32_TOL)
    assert all(r.ok and r.checked for r in reports), fdcheck.describe(reports)


def assert_linear_fd(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], wrt=None, *,
                     step: float = LINEAR_STEP) -> None:
    """Gradient graph vs ``sum((y(x + step e_k) - y(x - step e_k)) * R) / (2 step)``, y in float32."""
    weight = loss_weight(model).astype(np.float64)
    run = fdcheck.session(model).run
    rng = np.random.default_rng(0)
    for name, got in onnx_grads(model, feeds, wrt).items():
        x = feeds[name]
        assert got.shape == x.shape, name
        for k in rng.choice(x.size, size=min(LINEAR_ELEMENTS, x.size), replace=False):
            ys = []
            for sign in (1, -1):
                bumped = x.copy().reshape(-1)
                bumped[k] += sign * step
                ys.append(run(["y"], {**feeds, name: bumped.reshape(x.shape)})[0].astype(np.float64))
            numeric = float(np.sum((ys[0] - ys[1]) * weight)) / (2 * step)
            assert abs(got.reshape(-1)[k] - numeric) <= LINEAR_ATOL + LINEAR_RTOL * abs(numeric), (
                f"{name}[{k}]: analytic {got.reshape(-1)[k]:.7g} vs numeric {numeric:.7g}")


def torch_grads(fn: Callable, feeds: Mapping[str, np.ndarray], weight: np.ndarray) -> dict[str, np.ndarray]:
    """Gradients of sum(fn(**inputs) * weight) in float64."""
    ts = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in feeds.items()}
    (fn(**ts) * torch.tensor(weight, dtype=torch.float64)).sum().backward()
    return {k: t.grad.numpy() for k, t in ts.items()}


def assert_matches_torch(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], fn: Callable) -> None:
    ours, theirs = onnx_grads(model, feeds), torch_grads(fn, feeds, loss_weight(model))
    for name in feeds:
        np.testing.assert_allclose(ours[name], theirs[name], atol=TORCH_ATOL, rtol=TORCH_RTOL,
                                   err_msg=name)


def max_roi_pool_reference(x: np.ndarray, rois: np.ndarray, pooled: Sequence[int], scale: float,
                           dy: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """onnxruntime's MaxRoiPool forward (float32 rounding of the RoI corners and bin sizes; the
    output in float64, exact: each element is one of ``x``'s), and the gradient of ``x`` for the
    output gradient ``dy`` (zeros when None)."""
    height, width = x.shape[2:]
    y, dx = np.zeros((len(rois), x.shape[1], *pooled)), np.zeros_like(x)
    dy = np.zeros_like(y) if dy is None else dy
    for r, roi in enumerate(rois):
        x1, y1, x2, y2 = (int(np.sign(v) * np.floor(abs(v) + 0.5)) for v in roi[1:] * np.float32(scale))
        cell_h = np.float32(max(y2 - y1 + 1, 1)) / np.float32(pooled[0])
        cell_w = np.float32(max(x2 - x1 + 1, 1)) / np.float32(pooled[1])
        for ph in range(pooled[0]):
            hs = min(max(int(np.floor(ph * cell_h)) + y1, 0), height)
            he = min(max(int(np.ceil((ph + 1) * cell_h)) + y1, 0), height)
            for pw in range(pooled[1]):
                ws = min(max(int(np.floor(pw * cell_w)) + x1, 0), width)
                we = min(max(int(np.ceil((pw + 1) * cell_w)) + x1, 0), width)
                if he <= hs or we <= ws:
                    continue
                window = x[int(roi[0]), :, hs:he, ws:we].reshape(x.shape[1], -1)
                best = window.argmax(axis=1)
                y[r, :, ph, pw] = window.max(axis=1)
                for ch, k in enumerate(best):
                    dx[int(roi[0]), ch, hs + k // (we - ws), ws + k % (we - ws)] += dy[r, ch, ph, pw]
    return y, dx


def linear_attention_reference(q_heads: int, kv_heads: int, scale: float, query, key, value,
                               past=None, decay=None, beta=None) -> list:
    """LinearAttention's recurrence as onnx's reference implementation defines it, in torch (any
    float dtype; autograd through it is the gradient oracle): ``[y, final state]``. The update
    rule shows in which of ``decay`` (gated) and ``beta`` (delta) are given; ``scale`` 0 means
    ``1 / sqrt(d_k)``."""

    def heads(x, count):  # [B, T, H*D] -> [B, H, T, D]
        return x.reshape(*x.shape[:2], count, -1).transpose(1, 2)

    q, k, v = heads(query, q_heads), heads(key, kv_heads), heads(value, kv_heads)
    batch, _, steps, d_k = k.shape
    state = past if past is not None else torch.zeros(batch, kv_heads, d_k, v.shape[-1], dtype=q.dtype)
    scale = scale or 1.0 / d_k**0.5
    a = heads(decay, kv_heads).exp() if decay is not None else None  # [B, Hkv, T, dk or 1]
    rate = beta.reshape(batch, steps, -1, 1).transpose(1, 2) if beta is not None else None
    outs = []
    for t in range(steps):
        if a is not None:
            state = state * a[:, :, t, :, None]
        u = v[:, :, t]
        if rate is not None:
            u = rate[:, :, t] * (u - torch.einsum("bhdm,bhd->bhm", state, k[:, :, t]))
        state = state + k[:, :, t, :, None] * u[:, :, None, :]
        outs.append(scale * torch.einsum("bhd,bhdm->bhm", q[:, :, t], state.repeat_interleave(q_heads // kv_heads, 1)))
    return [torch.stack(outs, 2).transpose(1, 2).reshape(batch, steps, -1), state]
