"""Audit: every audited rule at its singular points follows torch's conventions (issue 35 §4).

At a point where the derivative does not exist or a formula divides 0 by 0 (0 for pow, sqrt,
log, norms, div, atan2; ties for max/min, pooling, sort/topk; the bounds of clip/relu6;
kinks of the ReLU family), torch picks a value: a subgradient, the selected index, a share.
Central differences cannot say which, so the oracle is torch float64 autograd: the gradient
graph (float32, onnxruntime) of ``sum(op(inputs) * R)`` for a fixed random ``R`` against
torch's gradient of the same sum. A hypothesis strategy draws every input element from the
op's singular points mixed with ordinary values, so zeros, ties and bounds meet in every
combination. Tolerance: 1e-4 absolute and relative (float32 rounding); an infinity must be
the same infinity, a NaN a NaN (``equal_nan``): torch's own NaN/inf are conventions too.

Two families: single ONNX ops (the rule alone, with the node marks an export sets), and torch
functions exported with ``torch.onnx.export(dynamo=True)`` once (the rules as the exporter's
decomposition and marks reach them: ``max(dim)``, ``atan2``, ``relu6``, ``clamp``, norms (``p``
other than 1, 2, inf: ``Pow(ReduceSum(Pow(Abs(x), p)), 1 / p)`` marked ``NORM_KEY``), adaptive
max pooling; MaxPool's rule itself lives in conv.py and sends a tie to the first
maximum, as torch does).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping

import fdcheck
import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from gradgraph.api import build_gradient_graph
from passes.autodiff.rules.elementwise import CLIP_BOUNDS_KEY, NORM_KEY
from passes.autodiff.rules.reduce import EXTREME_TIES_KEY

torch = pytest.importorskip("torch")
F = torch.nn.functional

ATOL = RTOL = 1e-4
SETTINGS = settings(max_examples=25, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SHAPE = (2, 4)


@dataclasses.dataclass(frozen=True)
class Edge:
    """One ONNX op at its singular points: ``points`` per input (elements drawn from them)."""

    op: str
    torch_fn: Callable
    points: Mapping[str, tuple[float, ...]]
    attrs: Mapping[str, object] = dataclasses.field(default_factory=dict)
    consts: Mapping[str, tuple] = dataclasses.field(default_factory=dict)  # name -> (array, after inputs)
    shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    marks: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # TopK: torch's order of tied elements is unspecified, ONNX's is the lower index first; the
    # oracle is torch's gradient of gathering the indices the forward selected (no share)
    selects: bool = False

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes.get(name, SHAPE)


_ORDINARY = (0.7, -1.3, 2.5)
_EDGES = {
    # zero: subgradients, 0 * inf, 0 / 0
    "Abs": Edge("Abs", torch.abs, {"x": (0.0, 1.0, -1.0)}),
    "Sqrt": Edge("Sqrt", torch.sqrt, {"x": (0.0, 1.0, 4.0)}),
    "Log": Edge("Log", torch.log, {"x": (0.0, 1.0, 2.0)}),
    "Reciprocal": Edge("Reciprocal", torch.reciprocal, {"x": (0.0, 1.0, -2.0)}),
    "Pow": Edge("Pow", torch.pow, {"a": (0.0, 1.0, 2.0, -1.0), "b": (0.0, 1.0, 2.0, 0.5, -1.0)}),
    "Div": Edge("Div", torch.div, {"a": (0.0, 1.0, -1.0), "b": (0.0, 1.0, -2.0)}),
    "ReduceL2": Edge("ReduceL2", lambda x: torch.linalg.vector_norm(x, 2, 1), {"x": (0.0, 0.0, 1.0)},
                     {"keepdims": 0}, {"axes": (np.array([1], np.int64),)}),
    "ReduceL1": Edge("ReduceL1", lambda x: torch.linalg.vector_norm(x, 1, 1), {"x": (0.0, 1.0, -1.0)},
                     {"keepdims": 0}, {"axes": (np.array([1], np.int64),)}),
    "ReduceProd": Edge("ReduceProd", lambda x: torch.prod(x, 1), {"x": (0.0, 1.0, 2.0)},
                       {"keepdims": 0}, {"axes": (np.array([1], np.int64),)}),
    # kinks of the ReLU family and the bounds of Clip / relu6 / hardsigmoid / shrink
    "Relu": Edge("Relu", torch.relu, {"x": (0.0, 1.0, -1.0)}),
    "LeakyRelu": Edge("LeakyRelu", lambda x: F.leaky_relu(x, 0.1), {"x": (0.0, 1.0, -1.0)}, {"alpha": 0.1}),
    "Elu": Edge("Elu", F.elu, {"x": (0.0, 1.0, -1.0)}),
    "Celu": Edge("Celu", F.celu, {"x": (0.0, 1.0, -1.0)}),
    "Selu": Edge("Selu", F.selu, {"x": (0.0, 1.0, -1.0)},
                 {"alpha": 1.6732632423543772, "gamma": 1.0507009873554805}),
    "ThresholdedRelu": Edge("ThresholdedRelu", lambda x: F.threshold(x, 1.0, 0.0), {"x": (1.0, 0.0, 2.0)},
                            {"alpha": 1.0}),
    "HardSigmoid": Edge("HardSigmoid", F.hardsigmoid, {"x": (-3.0, 3.0, 0.0)}, {"alpha": 1 / 6, "beta": 0.5}),
    "Shrink": Edge("Shrink", lambda x: F.hardshrink(x, 0.5), {"x": (0.5, -0.5, 0.0, 1.0)}, {"lambd": 0.5}),
    "Shrink(soft)": Edge("Shrink", lambda x: F.softshrink(x, 0.5), {"x": (0.5, -0.5, 0.0, 1.0)},
                         {"lambd": 0.5, "bias": 0.5}),
    "Clip(hardtanh)": Edge("Clip", lambda x: F.hardtanh(x, -1.0, 1.0), {"x": (-1.0, 1.0, 0.0, 2.0)}, {},
                           {"lo": (np.array(-1.0, np.float32),), "hi": (np.array(1.0, np.float32),)}),
    "Clip(clamp)": Edge("Clip", lambda x: torch.clamp(x, -1.0, 1.0), {"x": (-1.0, 1.0, 0.0, 2.0)}, {},
                        {"lo": (np.array(-1.0, np.float32),), "hi": (np.array(1.0, np.float32),)},
                        marks={CLIP_BOUNDS_KEY: "closed"}),
    "PRelu": Edge("PRelu", F.prelu, {"x": (0.0, 1.0, -1.0), "w": (0.25, -0.5)}, shapes={"w": (4,)}),
    # ties
    "Max": Edge("Max", torch.maximum, {"a": (0.0, 1.0), "b": (0.0, 1.0)}),
    "Min": Edge("Min", torch.minimum, {"a": (0.0, 1.0), "b": (0.0, 1.0)}),
    "ReduceMax(amax)": Edge("ReduceMax", lambda x: torch.amax(x, 1), {"x": (0.0, 1.0, 2.0)},
                            {"keepdims": 0}, {"axes": (np.array([1], np.int64),)}),
    "ReduceMin(amin)": Edge("ReduceMin", lambda x: torch.amin(x, 1), {"x": (0.0, 1.0, 2.0)},
                            {"keepdims": 0}, {"axes": (np.array([1], np.int64),)}),
    "ReduceMax(all)": Edge("ReduceMax", torch.max, {"x": (0.0, 1.0)}, {"keepdims": 0}),
    "ReduceMax(max dim)": Edge("ReduceMax", lambda x: torch.max(x, 1).values, {"x": (0.0, 1.0, 2.0)},
                               {"keepdims": 0}, {"axes": (np.array([1], np.int64),)},
                               marks={EXTREME_TIES_KEY: "first"}),
    "ReduceMin(min dim)": Edge("ReduceMin", lambda x: torch.min(x, 1, keepdim=True).values,
                               {"x": (0.0, 1.0, 2.0)}, {"keepdims": 1}, {"axes": (np.array([1], np.int64),)},
                               marks={EXTREME_TIES_KEY: "first"}),
    "TopK": Edge("TopK", torch.gather, {"x": (0.0, 1.0)}, {"axis": 1},
                 {"k": (np.array([2], np.int64),)}, selects=True),
    "TopK(smallest)": Edge("TopK", torch.gather, {"x": (0.0, 1.0)}, {"axis": 1, "largest": 0},
                           {"k": (np.array([2], np.int64),)}, selects=True),
    "TopK(sort)": Edge("TopK", torch.gather, {"x": (0.0, 1.0, 2.0)}, {"axis": 1},
                       {"k": (np.array([4], np.int64),)}, selects=True),
}


@functools.cache
def _single_op(key: str) -> tuple[object, object, np.ndarray, list[str]]:
    """The forward and gradient sessions of ``sum(op(inputs) * R)``, R, the input names."""
    edge = _EDGES[key]
    names = list(edge.points)
    consts = {k: v[0] for k, v in edge.consts.items()}
    node = helper.make_node(edge.op, names + list(consts), ["y"] + (["idx"] if edge.op == "TopK" else []),
                            **edge.attrs)
    for key_, value in edge.marks.items():
        node.metadata_props.add(key=key_, value=value)
    graph = helper.make_graph(
        [node], "edge", [helper.make_tensor_value_info(n, TensorProto.FLOAT, edge.shape(n)) for n in names],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
        + ([helper.make_tensor_value_info("idx", TensorProto.INT64, None)] if edge.op == "TopK" else []),
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    feeds = {n: np.ones(edge.shape(n), np.float32) for n in names}
    forward = fdcheck.session(model)
    y_shape = forward.run(["y"], feeds)[0].shape
    model = fdcheck.with_weighted_loss(model, {"y": y_shape})
    weight = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name.startswith("fdcheck_w_")))
    grad = build_gradient_graph(model, fdcheck.LOSS, names)
    return forward, fdcheck.session(grad), weight, names


def _torch_grads(fn: Callable, feeds: Mapping[str, np.ndarray], weight: np.ndarray) -> dict[str, np.ndarray]:
    ts = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in feeds.items()}
    (fn(*ts.values()) * torch.tensor(weight, dtype=torch.float64)).sum().backward()
    return {k: t.grad.numpy() for k, t in ts.items()}


def _compare(ours: Mapping[str, np.ndarray], theirs: Mapping[str, np.ndarray], feeds: Mapping) -> None:
    for name, want in theirs.items():
        np.testing.assert_allclose(ours[name], want, atol=ATOL, rtol=RTOL, equal_nan=True,
                                   err_msg=f"gradient of {name} at {feeds}")


def _points(points: tuple[float, ...], shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    """Arrays of ``shape`` whose elements are singular points, now and then an ordinary value."""
    element = st.one_of(st.sampled_from(points), st.sampled_from(points), st.sampled_from(_ORDINARY))
    size = int(np.prod(shape))
    return st.lists(element, min_size=size, max_size=size).map(
        lambda v: np.array(v, np.float32).reshape(shape))


@pytest.mark.parametrize("key", list(_EDGES))
@SETTINGS
@given(data=st.data())
def test_single_op_at_singular_points_matches_torch(key, data):
    edge = _EDGES[key]
    forward, session, weight, names = _single_op(key)
    feeds = {n: data.draw(_points(edge.points[n], edge.shape(n)), label=n) for n in names}
    ours = dict(zip(names, session.run([f"{n}{fdcheck.GRAD_SUFFIX}" for n in names], feeds)))
    fn = edge.torch_fn
    if edge.selects:
        index = torch.from_numpy(forward.run(["idx"], feeds)[0])
        fn = functools.partial(torch.gather, dim=edge.attrs.get("axis", -1), index=index)
    _compare(ours, _torch_grads(fn, feeds, weight), feeds)


def test_max_dim_with_its_indices_sends_ties_to_the_index():
    """ReduceMax and ArgMax over one axis of one tensor (torch.max(x, dim)'s two outputs, as the
    TorchScript exporter writes them, no mark): the tie's gradient goes to ArgMax's index."""
    model = onnx.parser.parse_model("""
<ir_version: 9, opset_import: ["" : 18]>
g (float[2, 4] x) => (float[2] y, int64[2] i) {
    axes = Constant<value = int64[1] {1}>()
    y = ReduceMax<keepdims = 0>(x, axes)
    i = ArgMax<axis = 1, keepdims = 0>(x)
}
""")
    model = fdcheck.with_weighted_loss(model, {"y": (2,)})
    weight = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name.startswith("fdcheck_w_")))
    x = np.array([[1, 3, 3, 0], [2, 2, 2, 2]], np.float32)
    ours = fdcheck.session(build_gradient_graph(model, fdcheck.LOSS, ["x"])).run(["x_grad"], {"x": x})[0]
    _compare({"x": ours}, _torch_grads(lambda t: torch.max(t, 1).values, {"x": x}, weight), {"x": x})


# ---- torch functions as the exporter writes them ------------------------------------------------

_EXPORTED = {
    "max(dim)": (lambda x: torch.max(x, 1).values, (0.0, 1.0, 2.0)),
    "min(dim)": (lambda x: torch.min(x, 1).values, (0.0, 1.0, 2.0)),
    "amax": (lambda x: torch.amax(x, 1), (0.0, 1.0, 2.0)),
    "relu6": (F.relu6, (0.0, 6.0, 3.0, -1.0)),
    "clamp": (lambda x: torch.clamp(x, -1.0, 1.0), (-1.0, 1.0, 0.0)),
    "vector_norm": (lambda x: torch.linalg.vector_norm(x, 2, 1), (0.0, 0.0, 1.0)),
    # (sum |x|^p)^(1/p): torch's 0 at a zero norm and at a zero element for p < 1 (the NORM_KEY marks)
    "vector_norm(3)": (lambda x: torch.linalg.vector_norm(x, 3, 1), (0.0, 0.0, 1.0, -2.0)),
    "vector_norm(0.5)": (lambda x: torch.linalg.vector_norm(x, 0.5, 1), (0.0, 0.0, 1.0, -2.0)),
    "norm(3, keepdim)": (lambda x: torch.norm(x, 3, 1, keepdim=True), (0.0, 0.0, 1.0)),
    "dist(3)": (lambda x: torch.dist(x[0], x[1], 3), (0.0, 1.0)),
    "sqrt(sum(x ** 2))": (lambda x: torch.sqrt((x ** 2).sum(1)), (0.0, 0.0, 1.0)),  # torch: NaN at 0
    "pow": (lambda x: torch.pow(x, 2.0), (0.0, 1.0, -1.0)),
    "atan2": (lambda x: torch.atan2(x[0], x[1]), (0.0, 1.0, -1.0)),
    "adaptive_max_pool1d": (lambda x: F.adaptive_max_pool1d(x.unsqueeze(0), 2).squeeze(0), (0.0, 1.0)),
}


class _Weighted(torch.nn.Module):
    def __init__(self, fn: Callable, weight: torch.Tensor) -> None:
        super().__init__()
        self.fn = fn
        self.register_buffer("weight", weight)

    def forward(self, x):
        return (self.fn(x) * self.weight).sum()


@functools.cache
def _exported(key: str) -> tuple[object, np.ndarray]:
    fn = _EXPORTED[key][0]
    weight = torch.tensor(np.random.default_rng(0).standard_normal(tuple(fn(torch.zeros(SHAPE)).shape)),
                          dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(_Weighted(fn, weight), (torch.zeros(SHAPE),), dynamo=True,
                                    input_names=["x"], output_names=["loss"], verbose=False)
    grad = build_gradient_graph(program.model_proto, "loss", ["x"])
    out = next(o.name for o in grad.graph.output if o.name != "loss")
    return (fdcheck.session(grad), out), weight.numpy().astype(np.float64)


@pytest.mark.parametrize("key", list(_EXPORTED))
@settings(max_examples=15, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_exported_torch_function_at_singular_points_matches_torch(key, data):
    (session, out), weight = _exported(key)
    x = data.draw(_points(_EXPORTED[key][1], SHAPE), label="x")
    ours = session.run([out], {"x": x})[0]
    _compare({"x": ours}, _torch_grads(_EXPORTED[key][0], {"x": x}, weight), {"x": x})


# ---- the marked rules away from their edge points: float64 central differences ---------------

_MARKED = {
    "Pow(norm)": ("""
<ir_version: 9, opset_import: ["" : 18]>
g (double[2, 3] x) => (double[2] y) {
    p = Constant<value = double {3.0}>()
    r = Constant<value = double {0.3333333333333333}>()
    axes = Constant<value = int64[1] {1}>()
    a = Abs(x)
    s = ReduceSum<keepdims = 0>(a3, axes)
    a3 = Pow(a, p)
    y = Pow(s, r)
}
""", {"a3": NORM_KEY, "y": NORM_KEY}),
    "Sqrt(norm)": ("""
<ir_version: 9, opset_import: ["" : 18]>
g (double[2, 3] x) => (double[2, 3] y) {
    y = Sqrt(x)
}
""", {"y": NORM_KEY}),
    "ReduceMax(all ties)": ("""
<ir_version: 9, opset_import: ["" : 18]>
g (double[2, 3] x) => (double[2] y) {
    axes = Constant<value = int64[1] {1}>()
    y = ReduceMax<keepdims = 0>(x, axes)
}
""", {"y": EXTREME_TIES_KEY}),
}


@pytest.mark.parametrize("key", list(_MARKED))
def test_marked_norm_rules_away_from_zero_match_central_differences(key):
    """A node marked as a norm's (zero at zero) or as cdist's inf-norm (ties all) keeps the
    plain derivative where it exists: positive, distinct, nonzero inputs."""
    text, marks = _MARKED[key]
    model = onnx.parser.parse_model(text)
    for node in model.graph.node:
        if node.output[0] in marks:
            mark = marks[node.output[0]]
            node.metadata_props.add(key=mark, value="all" if mark == EXTREME_TIES_KEY else "zero")
    y_shape = tuple(d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim)
    model = fdcheck.with_weighted_loss(model, {"y": y_shape})
    x = np.array([[0.7, -1.3, 2.5], [1.9, 0.4, -0.8]])
    if key == "Sqrt(norm)":
        x = np.abs(x)
    reports = fdcheck.compare_gradients(model, ["x"], {"x": x}, fdcheck.FLOAT64_TOL)
    assert all(r.checked and not r.mismatches for r in reports), fdcheck.describe(reports)


def test_marked_norm_rules_at_zero_give_zero_and_unmarked_ones_torchs_inf():
    """At a zero base the marked Pow / Sqrt give 0 (torch's norm subgradient); the same nodes
    unmarked keep torch's sqrt / pow value there (inf)."""
    for key in ("Pow(norm)", "Sqrt(norm)"):
        text, marks = _MARKED[key]
        for marked in (True, False):
            model = onnx.parser.parse_model(text)
            for node in model.graph.node:
                if marked and node.output[0] in marks:
                    node.metadata_props.add(key=NORM_KEY, value="zero")
            model = fdcheck.with_weighted_loss(model, {"y": (2,) if key == "Pow(norm)" else (2, 3)})
            x = np.array([[0.0, 0.0, 0.0], [1.9, 0.0, 0.8]])
            grad = fdcheck.analytic_gradients(model, ["x"], {"x": x})["x"]
            if marked:
                assert np.isfinite(grad).all() and (grad[x == 0] == 0).all(), (key, grad)
            else:
                assert not np.isfinite(grad[0]).any(), (key, grad)
