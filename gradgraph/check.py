"""Finite-difference gradient check: the analytic gradient graph against float64 central differences.

For each trained name, up to ``max_elements`` entries are perturbed by +/- eps in a
float64 copy of the forward model; the difference quotient of the loss is compared
with the entry of the gradient that the gradient graph computes in onnxruntime.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from gradgraph.api import build_gradient_graph
from gradgraph.feeds import check_feeds
from gradgraph.io import load_model
from passes.autodiff import GradientError
from passes.prepare import PrepareForGradientPass
from passes.to_double import ToDoublePass

_NP_OF = {1: np.float32, 10: np.float16, 11: np.float64, 16: np.float32, 6: np.int32, 7: np.int64,
          9: np.bool_, 2: np.uint8, 3: np.int8}


@dataclasses.dataclass(frozen=True)
class CheckRow:
    name: str
    checked: int
    max_abs_err: float
    max_rel_err: float
    ok: bool


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 2
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def random_inputs(model: onnx.ModelProto, seed: int = 0, dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Random feeds for the graph inputs that are not initializers (symbolic dims -> 2)."""
    rng = np.random.default_rng(seed)
    init = {i.name for i in model.graph.initializer}
    feeds = {}
    for inp in model.graph.input:
        if inp.name in init:
            continue
        t = inp.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (dims or {}).get(d.dim_param, 2)
                 for d in t.shape.dim]
        dtype = _NP_OF.get(t.elem_type)
        if dtype is None:
            raise GradientError(f"cannot make random data for input {inp.name!r} of type {t.elem_type}")
        if np.issubdtype(dtype, np.floating):
            feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[inp.name] = rng.random(shape) > 0.5
        else:
            feeds[inp.name] = rng.integers(0, 2, size=shape).astype(dtype)
    return feeds


def _as_double(model: onnx.ModelProto) -> onnx.ModelProto:
    m = ir.from_proto(model)
    ToDoublePass()(m)
    return ir.to_proto(m)


def gradcheck(
    model: onnx.ModelProto | str | os.PathLike,
    loss: str,
    weights: Sequence[str] | None = None,
    inputs: Mapping[str, np.ndarray] | None = None,
    *,
    eps: float = 1e-6,
    rtol: float = 1e-3,
    atol: float = 1e-5,
    max_elements: int = 16,
    seed: int = 0,
) -> list[CheckRow]:
    """Check the gradient of ``loss`` w.r.t. ``weights`` at ``inputs`` (random if None)."""
    forward = ir.to_proto(PrepareForGradientPass()(load_model(model)).model)
    grad_model = build_gradient_graph(forward, loss, weights)
    forward_outputs = {o.name for o in forward.graph.output}
    grad_names = [o.name for o in grad_model.graph.output if o.name not in forward_outputs]
    trained = [n[: -len("_grad")] for n in grad_names]
    feeds = dict(inputs) if inputs is not None else random_inputs(forward, seed)
    grad_session = _session(grad_model)
    check_feeds(grad_session.get_inputs(), feeds, "the inputs given")
    feeds = {i.name: feeds[i.name] for i in grad_session.get_inputs()}
    analytic = dict(zip(grad_names, grad_session.run(grad_names, feeds)))

    f64 = _as_double(forward)
    f64_out = onnx.helper.make_tensor_value_info(loss, onnx.TensorProto.DOUBLE, None)
    if loss not in [o.name for o in f64.graph.output]:
        f64.graph.output.append(f64_out)
    init = {t.name: onnx.numpy_helper.to_array(t) for t in f64.graph.initializer}
    feed_names = {i.name for i in f64.graph.input}
    # Trained initializers become inputs so they can be perturbed.
    for name in trained:
        if name in init and name not in feed_names:
            t = next(t for t in f64.graph.initializer if t.name == name)
            f64.graph.input.append(onnx.helper.make_tensor_value_info(name, t.data_type, list(t.dims)))
    sess = _session(f64)
    base = {k: (v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v) for k, v in feeds.items()}
    for name in trained:
        if name in init:
            base[name] = init[name]
    rng = np.random.default_rng(seed)
    rows = []
    for name, gname in zip(trained, grad_names):
        x = base[name]
        flat_count = x.size
        picks = rng.choice(flat_count, size=min(max_elements, flat_count), replace=False) if flat_count else []
        got = analytic[gname].astype(np.float64).reshape(-1)
        max_abs = max_rel = 0.0
        ok = True
        for k in picks:
            fd = []
            for sign in (1, -1):
                xp = x.copy().reshape(-1)
                xp[k] += sign * eps
                f = dict(base)
                f[name] = xp.reshape(x.shape)
                fd.append(float(np.sum(sess.run([loss], f)[0])))
            numeric = (fd[0] - fd[1]) / (2 * eps)
            err = abs(numeric - got[k])
            rel = err / max(abs(numeric), 1e-12)
            max_abs, max_rel = max(max_abs, err), max(max_rel, rel)
            ok &= err <= atol + rtol * abs(numeric)
        rows.append(CheckRow(name, len(picks), max_abs, max_rel, ok))
    return rows
