"""Gradient of DeformConv (opset 19): bilinear samples of X at offset kernel taps, as gathers
and scatter-adds over the sampled corners (split from conv.py, whose window geometry it reads)."""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir

from passes.autodiff.registry import grad_rule
from passes.autodiff.rules.conv import _LEAD, _TO_END, _bias_grad, _ints, _spatial, _spatial_rank


class _DeformSampler:
    """Where DeformConv samples X, in the layout (N, OG, 1, K*O) (offset group, kernel tap, output
    position), and the bilinear corners of each sample.

    Sample point of tap k at output o along spatial axis a (pixel units, zero padding outside):
    ``p_a = o_a * stride_a - pad_a + k_a * dilation_a + offset[n, og, k, a, o]``. Each of the 2^d
    corners (``bits``: floor or floor + 1 per axis) has an int64 flat index into X's spatial
    axes (0 where out of bounds), per-axis weights ``(1 - t) * valid`` or ``t * valid`` and
    per-axis derivatives ``-valid`` or ``+valid`` of those weights with respect to ``p_a``.
    """

    def __init__(self, b, n, x, offset, dims: int, kernel: list[int]):
        self.b = b
        groups = n.attr("offset_group", 1)
        strides = _ints(n, "strides", dims, 1)
        dilations = _ints(n, "dilations", dims, 1)
        pads = _ints(n, "pads", 2 * dims, 0)
        taps = np.stack(np.meshgrid(*[np.arange(k) for k in kernel], indexing="ij"), -1).reshape(-1, dims)
        count = len(taps)
        # offset (N, OG*K*d, *out) -> (N, OG, K, d, O)
        parts = b.Reshape(offset, [0, groups, count, dims, -1])
        out_sp = _spatial(b, offset)
        sizes = [b.Reshape(b.dim(x, _LEAD + a), []) for a in range(dims)]
        self.bits = list(itertools.product((0, 1), repeat=dims))
        corner_axes = []  # per axis: (index, weight, dweight) for bit 0 and bit 1
        for a in range(dims):
            along = b.Range(b.const(np.array(0, np.int64)), b.Reshape(b.Gather(out_sp, [a], axis=0), []),
                            b.const(np.array(1, np.int64)))
            along = b.Reshape(along, [1] * a + [-1] + [1] * (dims - a - 1))
            base = b.Reshape(b.Expand(along, out_sp), [1, -1]) * strides[a] - pads[a]  # (1, O) int64
            kpos = b.const((taps[:, a] * dilations[a]).reshape(-1, 1).astype(np.int64))  # (K, 1)
            shift = b.CastLike(base + kpos, x)  # (K, O)
            coord = b.Gather(parts, b.const(np.array(a, np.int64)), axis=3) + shift  # (N, OG, K, O)
            coord = b.Reshape(coord, [0, groups, 1, -1])
            floor = b.Floor(coord)
            frac = coord - floor
            length = b.CastLike(sizes[a], x)
            per_bit = []
            for bit in (0, 1):
                index = floor + float(bit) if bit else floor
                valid = b.And(b.GreaterOrEqual(index, 0.0), b.Less(index, length))
                mask = b.CastLike(valid, x)
                weight = (frac if bit else 1.0 - frac) * mask
                dweight = mask if bit else -mask
                index = b.Cast(b.Where(valid, index, 0.0, _like=x), to=int(ir.DataType.INT64))
                per_bit.append((index, weight, dweight))
            corner_axes.append(per_bit)
        self.corner_axes = corner_axes
        self.sizes = sizes

    def corner_index(self, bits):
        index = None
        for a, bit in enumerate(bits):
            idx = self.corner_axes[a][bit][0]
            index = idx if index is None else index * self.sizes[a] + idx
        return index

    def corner_weight(self, bits, d_axis: int | None = None):
        """Product of the per-axis weights (with axis ``d_axis`` differentiated)."""
        out = None
        for a, bit in enumerate(bits):
            _, weight, dweight = self.corner_axes[a][bit]
            f = dweight if a == d_axis else weight
            out = f if out is None else out * f
        return out

    def stacked(self, parts):
        """(N, OG, 1, K*O) per corner -> (N, OG, 1, 2^d, K*O)."""
        return self.b.Concat(*[self.b.Unsqueeze(p, [3]) for p in parts], axis=3)


def _deform_kernel(n, w) -> list[int]:
    kernel = n.attr("kernel_shape")
    if kernel:
        return list(kernel)
    dims = w.shape[_LEAD:] if w.shape is not None else None
    if dims is None or not all(isinstance(d, int) for d in dims):
        raise ValueError("DeformConv gradient needs a static kernel shape (kernel_shape or W's shape)")
    return list(dims)


@grad_rule("DeformConv", since=19, diff_inputs=(0, 1, 2, 3, 4))
def _deform_conv(b, n, g):
    """Y[n, m, o] = B[m] + sum_{c in group(m), k} W[m, c, k] * mask[n, og(c), k, o] * S[n, c, k, o],
    S the bilinear (zero padding) sample of X[n, c] at p(n, og(c), k, o) (see _DeformSampler).

    The samples are gathered as the forward does (2^d corners at once); then dS' = W^T dY per
    group, dW = dY S'^T summed over the batch, dmask = sum over the offset group's channels of
    dS' * S, dX scatter-adds dS' * mask * corner weight at the corners, and d offset sums
    dS' * mask * X[corner] * d corner weight / dp over the group's channels and the corners.
    """
    x, w, offset, go = n.inputs[0], n.inputs[1], n.inputs[2], g[0]
    dims = _spatial_rank(n, n.attr("kernel_shape"), w, x)
    kernel = _deform_kernel(n, w)
    if len(kernel) != dims:
        raise ValueError(f"DeformConv kernel_shape {kernel} does not match {dims} spatial axes")
    groups, og = n.attr("group", 1), n.attr("offset_group", 1)
    count = int(np.prod(kernel))
    grads = [None] * len(n.inputs)
    if n.needs_grad(3):
        grads[3] = _bias_grad(b, go, dims)
    if not any(n.needs_grad(i) for i in (0, 1, 2, 4)):
        return grads
    sampler = _DeformSampler(b, n, x, offset, dims, kernel)
    corners = len(sampler.bits)
    # X as (N, OG, C/OG, P); the corners' indices expanded over its channels: (N, OG, C/OG, 2^d * K*O)
    per_group = b.Div(b.dim(x, 1), b.const(np.array([og], np.int64)))
    x_flat = b.Reshape(x, b.Concat([0, og], per_group, [-1], axis=0))
    lead = b.Slice(b.Shape(x_flat), [0], [3])
    index = b.Concat(*[sampler.corner_index(bits) for bits in sampler.bits], axis=3)  # (N, OG, 1, 2^d*KO)
    index = b.Expand(index, b.Concat(lead, b.Slice(b.Shape(index), [3], [4]), axis=0))
    weights = sampler.stacked([sampler.corner_weight(bits) for bits in sampler.bits])
    has_mask = n.has_input(4)
    mask = b.Reshape(n.inputs[4], [0, og, 1, -1]) if has_mask else None
    picked = samples = None
    if n.needs_grad(1) or n.needs_grad(2) or has_mask and n.needs_grad(4):
        picked = b.Reshape(b.GatherElements(x_flat, index, axis=3), [0, 0, 0, corners, -1])  # (.., 2^d, KO)
        samples = b.reduce("ReduceSum", picked * weights, [3], keepdims=0)  # S: (N, OG, C/OG, KO)
    # grouped products: S' as (N, G, C/G*K, O), W as (G, M/G, C/G*K), dY as (N, G, M/G, O)
    out_count = b.reduce("ReduceProd", _spatial(b, offset), None, keepdims=1)
    g_grouped = b.Reshape(go, b.Concat([0, groups, -1], out_count, axis=0))
    if n.needs_grad(1):
        masked = samples * mask if has_mask else samples
        s_grouped = b.Reshape(masked, b.Concat([0, groups, -1], out_count, axis=0))
        dw = b.reduce("ReduceSum", b.MatMul(g_grouped, b.Transpose(s_grouped, perm=[0, 1, 3, 2])), [0], keepdims=0)
        grads[1] = b.Reshape(dw, b.Shape(w))
    if not any(n.needs_grad(i) for i in (0, 2, 4)):
        return grads
    w_size = b.reduce("ReduceProd", b.Slice(b.Shape(w), [1], [_TO_END]), None, keepdims=1)
    w_grouped = b.Reshape(w, b.Concat([groups, -1], w_size, axis=0))
    d_masked = b.MatMul(b.Transpose(w_grouped, perm=[0, 2, 1]), g_grouped)  # (N, G, C/G*K, O)
    d_masked = b.Reshape(d_masked, b.Concat(lead, [-1], axis=0))  # (N, OG, C/OG, KO)
    if has_mask and n.needs_grad(4):
        grads[4] = b.Reshape(b.reduce("ReduceSum", d_masked * samples, [2], keepdims=1), b.Shape(n.inputs[4]))
    d_samples = d_masked * mask if has_mask else d_masked
    spread = b.Unsqueeze(d_samples, [3])  # (N, OG, C/OG, 1, KO)
    if n.needs_grad(0):
        updates = b.Reshape(spread * weights, [0, 0, 0, -1])
        scattered = b.ScatterElements(b.zeros_like(x_flat), index, updates, axis=3, reduction="add")
        grads[0] = b.Reshape(scattered, b.Shape(x))
    if n.needs_grad(2):
        seen = b.reduce("ReduceSum", spread * picked, [2], keepdims=1)  # (N, OG, 1, 2^d, KO)
        comps = []
        for a in range(dims):
            dweights = sampler.stacked([sampler.corner_weight(bits, a) for bits in sampler.bits])
            comps.append(b.Reshape(b.reduce("ReduceSum", seen * dweights, [3], keepdims=0), [0, og, count, 1, -1]))
        stacked = comps[0] if dims == 1 else b.Concat(*comps, axis=3)  # (N, OG, K, d, O)
        grads[2] = b.Reshape(stacked, b.Shape(offset))
    return grads
