"""Gradient rule of Resize: exact linear finite differences in onnxruntime, and torch autograd.

Resize is linear in X, so ``assert_linear_fd`` (single_op.py) is exact; the fixtures cover
nearest/linear/cubic, every coordinate transform, scales and sizes, the opset 18 ``axes``
attribute and antialiasing, at opsets 13, 18 and 19.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch.nn.functional as F
from single_op import assert_linear_fd, assert_matches_torch, make_model, onnx_grads

X_SHAPE = (2, 3, 5, 4)
NO_ROI = ""


def resize_model(attrs: dict, *, scales=None, sizes=None, roi=None, opset: int = 19,
                 x_shape=X_SHAPE, runtime_scales: bool = False):
    """Resize of x by constant (or graph-input) scales or sizes."""
    consts = {}
    if roi is not None:
        consts["roi"] = np.array(roi, np.float32)
    if scales is not None and not runtime_scales:
        consts["scales"] = np.array(scales, np.float32)
    if sizes is not None:
        consts["sizes"] = np.array(sizes, np.int64)
    order = ["x", "roi" if roi is not None else NO_ROI]
    order += ["scales"] if scales is not None else ([NO_ROI] if sizes is not None else [])
    order += ["sizes"] if sizes is not None else []
    inputs, fixed = {"x": x_shape}, {}
    if runtime_scales:
        inputs["scales"] = (len(scales),)
        fixed["scales"] = np.array(scales, np.float32)
    return make_model("Resize", inputs, attrs, opset=opset, consts=consts, node_inputs=order, fixed=fixed)


SPATIAL_UP = [1.0, 1.0, 2.0, 1.5]
SPATIAL_DOWN = [1.0, 1.0, 0.6, 0.5]

MODE_CASES = [
    ("nearest", "asymmetric", dict(nearest_mode="floor")),
    ("nearest", "half_pixel", dict(nearest_mode="round_prefer_floor")),
    ("nearest", "half_pixel", dict(nearest_mode="round_prefer_ceil")),
    ("nearest", "align_corners", dict(nearest_mode="ceil")),
    ("linear", "half_pixel", {}),
    ("linear", "asymmetric", {}),
    ("linear", "align_corners", {}),
    ("linear", "pytorch_half_pixel", {}),
    ("linear", "half_pixel_symmetric", {}),
    ("cubic", "half_pixel", {}),
    ("cubic", "asymmetric", dict(cubic_coeff_a=-0.5, exclude_outside=1)),
]


@pytest.mark.parametrize("scales", [SPATIAL_UP, SPATIAL_DOWN], ids=["up", "down"])
@pytest.mark.parametrize("mode,transform,extra", MODE_CASES)
def test_resize_scales(mode, transform, extra, scales):
    attrs = dict(mode=mode, coordinate_transformation_mode=transform, **extra)
    model, feeds = resize_model(attrs, scales=scales)
    assert_linear_fd(model, feeds)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("opset", [13, 18])
def test_resize_sizes(mode, opset):
    attrs = dict(mode=mode, coordinate_transformation_mode="half_pixel")
    model, feeds = resize_model(attrs, sizes=[2, 3, 8, 3], opset=opset)
    assert_linear_fd(model, feeds)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_opset13_scales_and_tf_half_pixel(mode):
    transform = "tf_half_pixel_for_nn" if mode == "nearest" else "half_pixel"
    model, feeds = resize_model(dict(mode=mode, coordinate_transformation_mode=transform),
                                scales=[1.0, 1.0, 1.7, 0.75], roi=[], opset=13)
    assert_linear_fd(model, feeds)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_tf_crop_and_resize(mode):
    attrs = dict(mode=mode, coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=2.0)
    roi = [0, 0, 0.2, -0.1, 1, 1, 0.9, 1.2]  # the last box leaves the input: extrapolated outputs
    model, feeds = resize_model(attrs, sizes=[2, 3, 6, 5], roi=roi, opset=18)
    assert_linear_fd(model, feeds)


@pytest.mark.parametrize("axes,scales", [([2, 3], [2.0, 0.5]), ([-1], [1.75])])
def test_resize_axes_attribute(axes, scales):
    model, feeds = resize_model(dict(mode="linear", axes=axes), scales=scales, opset=18)
    assert_linear_fd(model, feeds)


def test_resize_antialias_downsampling():
    attrs = dict(mode="linear", antialias=1)
    model, feeds = resize_model(attrs, scales=[1.0, 1.0, 0.4, 0.5], opset=18, x_shape=(1, 2, 9, 8))
    assert_linear_fd(model, feeds)


def test_resize_runtime_scales_every_axis():
    """Scales from a graph input: no axis is known to be the identity, all get a matrix."""
    model, feeds = resize_model(dict(mode="nearest"), scales=[1.0, 2.0, 1.5, 0.5], runtime_scales=True)
    assert_linear_fd(model, feeds, wrt=["x"])


@pytest.mark.parametrize("opset", [13, 18, 19])
@pytest.mark.parametrize("mode,x_shape,target", [
    ("cubic", (1, 1, 2, 2), dict(sizes=[1, 1, 1, 1])),
    ("cubic", (1, 2, 3, 4), dict(sizes=[1, 2, 1, 3])),
    ("cubic", (1, 1, 3, 3), dict(scales=[1.0, 1.0, 0.5, 0.5])),
    ("linear", (1, 1, 3), dict(scales=[1.0, 1.0, 0.5])),
    ("nearest", (1, 1, 3, 2), dict(sizes=[1, 1, 1, 4])),
])
def test_resize_pytorch_half_pixel_to_one(mode, x_shape, target, opset):
    """pytorch_half_pixel onto an axis of length 1 samples x at 0 in onnxruntime (the ONNX
    reference evaluator does not: -0.5, or 0.5 / scale - 0.5 when in * scale is not 1)."""
    attrs = dict(mode=mode, coordinate_transformation_mode="pytorch_half_pixel")
    model, feeds = resize_model(attrs, opset=opset, x_shape=x_shape, **target)
    assert_linear_fd(model, feeds)


@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize("transform", ["align_corners", "half_pixel_symmetric"])
def test_resize_fractional_output_length(mode, transform):
    """in * scale not an integer (3 * 1.5, 5 * 0.7): onnxruntime divides by the truncated
    output length (the reference evaluator by the unrounded one)."""
    attrs = dict(mode=mode, coordinate_transformation_mode=transform)
    model, feeds = resize_model(attrs, scales=[1.0, 1.0, 1.5, 0.7], x_shape=(1, 2, 3, 5))
    assert_linear_fd(model, feeds)


def test_resize_keep_aspect_ratio_is_rejected():
    attrs = dict(mode="nearest", keep_aspect_ratio_policy="not_larger", axes=[2, 3])
    model, feeds = resize_model(attrs, sizes=[10, 10], opset=18)
    with pytest.raises(Exception, match="keep_aspect_ratio_policy"):
        onnx_grads(model, feeds)


@pytest.mark.parametrize("transform,align", [("half_pixel", False), ("align_corners", True)])
def test_resize_linear_matches_torch(transform, align):
    model, feeds = resize_model(dict(mode="linear", coordinate_transformation_mode=transform),
                                sizes=[2, 3, 9, 7])
    assert_matches_torch(model, feeds, lambda x: F.interpolate(
        x, size=(9, 7), mode="bilinear", align_corners=align))


def test_resize_nearest_matches_torch():
    attrs = dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    model, feeds = resize_model(attrs, scales=[1.0, 1.0, 2.0, 0.5])
    assert_matches_torch(model, feeds, lambda x: F.interpolate(x, scale_factor=(2.0, 0.5), mode="nearest"))


@pytest.mark.parametrize("opset", [13, 19])
def test_resize_symbolic_dims(opset):
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 4)).astype(np.float32)
    model, feeds = make_model("Resize", {"x": ("N", 3, "H", "W")}, dict(mode="linear"), opset=opset,
                              consts={"scales": np.array([1.0, 1.0, 2.0, 1.5], np.float32)},
                              node_inputs=["x", NO_ROI, "scales"], fixed={"x": x})
    assert_linear_fd(model, feeds)
