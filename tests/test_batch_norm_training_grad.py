"""BatchNormalization's training-mode gradient (issue 37 §4) against torch float64 autograd.

One training-mode BatchNormalization (opset 15: Y, running_mean, running_var) on shapes drawn by
hypothesis (rank 2-5, channels 1-5, means away from 0 so the recomputed statistics matter), the
loss ``sum(Y * R) + sum(running_mean * Rm) + sum(running_var * Rv)`` over the outputs a draw
picks. Oracle: torch float64, ``F.batch_norm(training=True)`` for Y and its gradients, and the
running statistics as the ONNX operator defines them (population variance; the exporter turns
torch's unbiased convention into this one, see gradgraph/torch/translations.py), whose values
are also checked against torch's own update of its buffers for the mean. Tolerance 1e-4
(float32 rounding of sums over up to a few hundred elements); in double, 1e-9.
"""

from __future__ import annotations

import fdcheck
import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from gradgraph.api import build_gradient_graph

torch = pytest.importorskip("torch")
F = torch.nn.functional

ATOL = RTOL = 1e-4
SETTINGS = settings(max_examples=10, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
OUTPUTS = ("y", "rm", "rv")


def _model(shape: tuple[int, ...], momentum: float, epsilon: float,
           used: tuple[str, ...] | None, dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """The node and, unless ``used`` is None, the weighted loss over the ``used`` outputs."""
    c = shape[1]
    names = ["x", "scale", "bias", "mean", "var"]
    node = helper.make_node("BatchNormalization", names, list(OUTPUTS), "bn", training_mode=1,
                            momentum=momentum, epsilon=epsilon)
    graph = helper.make_graph(
        [node], "bn", [helper.make_tensor_value_info(n, dtype, shape if n == "x" else (c,)) for n in names],
        [helper.make_tensor_value_info(o, dtype, None) for o in OUTPUTS])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=9)
    if used is None:
        return model
    return fdcheck.with_weighted_loss(model, {o: shape if o == "y" else (c,) for o in used})


def _weights(model: onnx.ModelProto, used: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The loss's fixed random weight of each output it reads (fdcheck numbers them in order)."""
    init = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    return {o: init[f"fdcheck_w_{k}"] for k, o in enumerate(used)}


@SETTINGS
@given(data=st.data(), rank=st.integers(2, 5), momentum=st.sampled_from([0.9, 0.5, 0.0]),
       epsilon=st.sampled_from([1e-5, 1e-2]))
def test_training_batch_norm_gradient_matches_torch(data, rank, momentum, epsilon):
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank), label="shape"))
    shape = (max(shape[0], 2), data.draw(st.integers(1, 5), label="channels"), *shape[2:])
    used = data.draw(st.sampled_from([("y",), ("y", "rm", "rv"), ("y", "rv"), ("rm",)]), label="used")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    c = shape[1]
    feeds = {"x": (rng.standard_normal(shape) * 1.5 + rng.uniform(-3, 3, (1, c) + (1,) * (rank - 2))
                   ).astype(np.float32),
             "scale": rng.uniform(0.5, 1.5, c).astype(np.float32), "bias": rng.uniform(-1, 1, c).astype(np.float32),
             "mean": rng.uniform(-1, 1, c).astype(np.float32), "var": rng.uniform(0.5, 1.5, c).astype(np.float32)}
    wrt = ["x", "scale", "bias"]
    model = _model(shape, momentum, epsilon, used)
    grad = build_gradient_graph(model, fdcheck.LOSS, wrt)
    session = fdcheck.session(grad)
    ours = dict(zip(wrt, session.run([f"{n}{fdcheck.GRAD_SUFFIX}" for n in wrt], feeds)))
    rm_out, rv_out = fdcheck.session(_model(shape, momentum, epsilon, None)).run(["rm", "rv"], feeds)

    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k in wrt) for k, v in feeds.items()}
    buffers = {k: t[k].detach().clone() for k in ("mean", "var")}
    y = F.batch_norm(t["x"], buffers["mean"], buffers["var"], t["scale"], t["bias"], training=True,
                     momentum=1.0 - momentum, eps=epsilon)
    axes = [0, *range(2, rank)]
    batch_mean = t["x"].mean(axes)
    batch_var = t["x"].var(axes, unbiased=False)
    running = {"y": y, "rm": t["mean"] * momentum + batch_mean * (1 - momentum),
               "rv": t["var"] * momentum + batch_var * (1 - momentum)}
    weights = _weights(model, used)
    loss = sum((running[o] * torch.tensor(weights[o])).sum() for o in used)
    loss.backward()
    np.testing.assert_allclose(rm_out, running["rm"].detach().numpy(), atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(rv_out, running["rv"].detach().numpy(), atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(rm_out, buffers["mean"].numpy(), atol=ATOL, rtol=RTOL)  # torch's own buffer
    for name in wrt:
        want = t[name].grad.numpy() if t[name].grad is not None else np.zeros_like(feeds[name], np.float64)
        np.testing.assert_allclose(ours[name], want, atol=ATOL, rtol=RTOL, err_msg=f"d{name}, {shape}, {used}")


def test_backward_reads_the_activation_ten_times():
    """Passes over the activation (nodes reading an [N, C, H, W] tensor) in the backward of Y:
    the statistics (ReduceMean x, Sub, Mul, ReduceSum), dbias (ReduceSum dY), dscale (Mul dY *
    centered, ReduceSum), dX (BatchNormalization of dY, Mul centered * k, Sub): 10. The
    textbook form (xhat, then dY * scale, its two means, ...) read it 18 times."""
    shape = (4, 3, 5, 5)
    model = _model(shape, 0.9, 1e-5, ("y",))
    grad = build_gradient_graph(model, fdcheck.LOSS, ["x", "scale", "bias"])
    grad = onnx.shape_inference.infer_shapes(grad)
    full = {vi.name for vi in [*grad.graph.value_info, *grad.graph.input]
            if [d.dim_value for d in vi.type.tensor_type.shape.dim] == list(shape)}
    readers = [n.op_type for n in grad.graph.node if n.name.startswith("bn_grad/")
               and n.op_type not in ("Shape", "Size") and any(i in full for i in n.input)]
    assert len(readers) == 10, readers


@pytest.mark.parametrize("used", [("y",), ("y", "rv"), ("y", "rm", "rv"), ("rv",)])
def test_float64_gradients_match_torch_tightly(used):
    """The rule in double against torch float64 to 1e-9: its algebra, free of float32 rounding
    (the hypothesis test allows 1e-4); the running variance's gradient reads the centered x too
    (the ``rv`` cases), and the input statistics get theirs (momentum times the running ones'). momentum and epsilon are exact in float32 (ONNX's attributes are float32:
    0.9 would be 0.899999976 there, not torch's 0.9)."""
    shape, momentum, epsilon = (3, 4, 5, 2), 0.75, 2.0**-7
    rng = np.random.default_rng(7)
    c = shape[1]
    feeds = {"x": rng.standard_normal(shape) * 1.5 + rng.uniform(-3, 3, (1, c, 1, 1)),
             "scale": rng.uniform(0.5, 1.5, c), "bias": rng.uniform(-1, 1, c),
             "mean": rng.uniform(-1, 1, c), "var": rng.uniform(0.5, 1.5, c)}
    wrt = ["x", "scale", "bias", "mean", "var"]
    model = _model(shape, momentum, epsilon, used, dtype=TensorProto.DOUBLE)
    grad = build_gradient_graph(model, fdcheck.LOSS, wrt, allow_unused=True)
    names = [o.name for o in grad.graph.output]
    got = dict(zip(names, fdcheck.session(grad).run(names, feeds)))
    t = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in feeds.items()}
    y = F.batch_norm(t["x"], t["mean"].detach().clone(), t["var"].detach().clone(), t["scale"], t["bias"],
                     training=True, momentum=1.0 - momentum, eps=epsilon)
    batch_var = t["x"].var([0, 2, 3], unbiased=False)
    outs = {"y": y, "rm": t["mean"] * momentum + t["x"].mean([0, 2, 3]) * (1 - momentum),
            "rv": t["var"] * momentum + batch_var * (1 - momentum)}
    weights = {o: torch.tensor(w) for o, w in _weights(model, used).items()}
    sum((outs[o] * weights[o]).sum() for o in used).backward()
    for name in wrt:
        key = f"{name}{fdcheck.GRAD_SUFFIX}"
        want = t[name].grad.numpy() if t[name].grad is not None else np.zeros_like(feeds[name])
        np.testing.assert_allclose(got[key] if key in got else 0.0, want, atol=1e-9, rtol=1e-9,
                                   err_msg=f"d{name}, {used}")
