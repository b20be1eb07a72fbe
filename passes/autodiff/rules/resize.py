"""Gradient of Resize (nearest, linear, cubic; scales or sizes; every coordinate transform).

Resize is separable and linear in X: along each resized axis k, ``Y = M_k X`` for an
interpolation matrix ``M_k`` of shape (out_k, in_k). The rule builds ``M_k^T`` in the
gradient graph by resizing an identity matrix ``eye(in_k)`` along its second axis with
the forward node's own attributes (so every mode and coordinate transform is exactly the
forward one), then contracts the output gradient with it along axis k (``MatMul``).
Only X is differentiable; roi, scales and sizes carry no gradient.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.autodiff.registry import grad_rule

# Attributes of the forward node that do not apply to the 2-D resize of eye(in_k).
_PER_NODE_ATTRS = ("axes", "keep_aspect_ratio_policy")
# Opset where Resize gained the ``axes`` attribute.
_AXES_OPSET = 18
_CROP_MODE = "tf_crop_and_resize"


def _resized_axes(n, rank: int) -> list[int]:
    axes = n.attr("axes")
    if axes is None:
        return list(range(rank))
    return [a + rank if a < 0 else a for a in axes]


def _is_identity_axis(n, x, pos: int, axis: int, use_sizes: bool) -> bool:
    """True when axis ``axis`` is statically known not to be resized."""
    if n.attr("coordinate_transformation_mode", "half_pixel") == _CROP_MODE:
        return False
    if use_sizes:
        sizes, dim = n.const_input(3), (x.shape or [None] * (axis + 1))[axis]
        return sizes is not None and isinstance(dim, int) and int(sizes[pos]) == dim
    scales = n.const_input(2)
    return scales is not None and scales.size > pos and float(scales[pos]) == 1.0


def _pick(b, v, index: int):
    return b.Gather(v, b.const(np.array([index], np.int64)), axis=0)


def _crop_roi(b, n, pos: int, count: int, lead: bool):
    """roi of the resize of eye(in_k): the forward box on axis 1 (and [0, 1] on axis 0 if ``lead``)."""
    roi = n.inputs[1]
    start, end = _pick(b, roi, pos), _pick(b, roi, pos + count)
    if not lead:
        return b.Concat(start, end, axis=0)
    zero = b.CastLike(b.const(np.array([0.0], np.float32)), roi)
    one = b.CastLike(b.const(np.array([1.0], np.float32)), roi)
    return b.Concat(zero, start, one, end, axis=0)


def _interpolation_matrix(b, n, x, pos: int, axis: int, count: int, use_sizes: bool):
    """``M_k^T`` (in_k, out_k): the forward Resize applied along axis 1 of eye(in_k).

    From opset 18 the ``axes`` attribute leaves axis 0 alone; before, axis 0 gets scale
    1 (or its own size), which every coordinate transform maps to itself.
    """
    n_in = b.dim(x, axis)
    zeros = b.ConstantOfShape(b.Concat(n_in, n_in, axis=0),
                              value=ir.tensor(np.zeros(1, x.dtype.numpy())))
    eye = b.EyeLike(zeros)
    attrs = {k: n.attr(k) for k in n.node.attributes if k not in _PER_NODE_ATTRS}
    attrs["extrapolation_value"] = 0.0  # keep out-of-box outputs linear (zero) in X
    lead = b.opset < _AXES_OPSET
    if not lead:
        attrs["axes"] = [1]
    roi = None
    if attrs.get("coordinate_transformation_mode") == _CROP_MODE:
        roi = _crop_roi(b, n, pos, count, lead)
    if use_sizes:
        lead_size = [n_in] if lead else []
        sizes = b.Concat(*lead_size, _pick(b, n.inputs[3], pos), axis=0)
        return b.Resize(eye, roi, None, sizes, **attrs)
    lead_scale = [b.const(np.array([1.0], np.float32))] if lead else []
    scales = b.Concat(*lead_scale, _pick(b, n.inputs[2], pos), axis=0)
    return b.Resize(eye, roi, scales, **attrs)


def _contract(b, go, matrix_t, axis: int, rank: int):
    """Sum ``go`` (axis ``axis`` of size out_k) against ``M_k`` (out_k, in_k) along that axis."""
    matrix = b.Transpose(matrix_t, perm=[1, 0])
    if axis == rank - 1:
        return b.MatMul(go, matrix)
    perm = [a for a in range(rank) if a != axis] + [axis]
    inverse = [perm.index(a) for a in range(rank)]
    return b.Transpose(b.MatMul(b.Transpose(go, perm=perm), matrix), perm=inverse)


@grad_rule("Resize", since=13, diff_inputs=(0,))
def _resize(b, n, g):
    """dX = dY contracted with each axis' interpolation matrix."""
    x = n.inputs[0]
    if x.rank is None:
        raise ValueError("Resize gradient needs the input rank (run shape inference)")
    if n.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise ValueError("Resize gradient supports keep_aspect_ratio_policy='stretch' only")
    use_sizes = n.has_input(3)
    if not use_sizes and not n.has_input(2):
        raise ValueError("Resize gradient needs scales or sizes")
    axes = _resized_axes(n, x.rank)
    grad = g[0]
    for pos, axis in enumerate(axes):
        if _is_identity_axis(n, x, pos, axis, use_sizes):
            continue
        matrix_t = _interpolation_matrix(b, n, x, pos, axis, len(axes), use_sizes)
        grad = _contract(b, grad, matrix_t, axis, x.rank)
    return [grad, None, None, None][: len(n.inputs)]
