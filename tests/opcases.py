"""One-node op cases for gradient tests: a spec, the model it builds, and the check it runs.

A :class:`Spec` names an op, its inputs (arrays, in node-input order), attributes, the
opset and which inputs to differentiate. :func:`check_spec` builds the one-node model,
adds ``loss = sum_k ReduceSum(y_k * W_k)`` over the float outputs, and compares the
gradient graph (onnxruntime) with float64 central differences (see ``fdcheck``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import fdcheck
import numpy as np
import onnx
from onnx import helper, numpy_helper

IR_VERSION = 10
DEFAULT_OPSET = 21
FLOAT_NP = (np.float32, np.float64)


@dataclasses.dataclass
class Spec:
    op: str
    # (name, value) in node-input order; None marks an absent optional input.
    inputs: list[tuple[str, np.ndarray | None]]
    wrt: tuple[str, ...]
    attrs: dict = dataclasses.field(default_factory=dict)
    opset: int = DEFAULT_OPSET
    outputs: int = 1
    # Output indices that enter the loss (None: every float output).
    loss_outputs: tuple[int, ...] | None = None
    # Non-trained inputs fed at run time (graph inputs) instead of initializers.
    dynamic: tuple[str, ...] = ()
    # "grad": compare with central differences; "stop": check a clean stop-gradient.
    kind: str = "grad"
    # The op's domain ("" is ONNX's; e.g. "com.microsoft" for onnxruntime's contrib ops, opset 1).
    domain: str = ""
    # A check of its own (for ops central differences cannot see, e.g. random masks).
    custom: Callable[[Spec], None] | None = None
    # Nodes after the op (reading y0..yk) and the graph outputs, for ops that need company
    # (sequence ops); None: the op's outputs are the graph outputs.
    extra_nodes: tuple[onnx.NodeProto, ...] = ()
    graph_outputs: tuple[str, ...] | None = None
    # Values the graph holds that are not inputs of the op's node (read by subgraphs or
    # by ``extra_nodes``).
    side_inputs: list[tuple[str, np.ndarray]] = dataclasses.field(default_factory=list)
    # Declare the fed inputs with symbolic dims only (rules then see ranks, not sizes),
    # except the (input name, axis) pairs in ``static_dims``.
    symbolic: bool = False
    static_dims: tuple[tuple[str, int], ...] = ()

    @property
    def op_types(self) -> set[str]:
        return {self.op} | {n.op_type for n in self.extra_nodes}

    def all_inputs(self) -> list[tuple[str, np.ndarray | None]]:
        return list(self.inputs) + list(self.side_inputs)

    def array(self, name: str) -> np.ndarray:
        return dict(self.all_inputs())[name]

    @property
    def dtype(self) -> np.dtype:
        floats = [v.dtype for k, v in self.all_inputs() if v is not None and k in self.wrt]
        return np.dtype(floats[0]) if floats else np.dtype(np.float32)

    def with_dtype(self, dtype: np.dtype) -> Spec:
        """The same spec with every input of the spec's float dtype converted to ``dtype``."""
        old = self.dtype

        def convert(pairs):
            return [(k, v.astype(dtype) if v is not None and v.dtype == old else v) for k, v in pairs]

        return dataclasses.replace(self, inputs=convert(self.inputs), side_inputs=convert(self.side_inputs))

    def describe(self) -> str:
        shapes = ", ".join(f"{k}{list(v.shape)}:{v.dtype}" if v is not None else "-"
                           for k, v in self.inputs)
        dims = " symbolic dims" if self.symbolic else ""
        return f"{self.op}(opset {self.opset}{dims}) [{shapes}] {self.attrs} wrt={self.wrt}"


def _value_info(name: str, arr: np.ndarray, spec: Spec | None = None) -> onnx.ValueInfoProto:
    shape = list(arr.shape)
    if spec is not None and spec.symbolic:
        shape = [d if (name, i) in spec.static_dims else f"{name}_d{i}" for i, d in enumerate(shape)]
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), shape)


def forward_model(spec: Spec) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The one-node model (outputs y0..yk typed by inference) and its feeds."""
    names, graph_inputs, inits, feeds = [], [], [], {}
    for name, arr in spec.inputs:
        names.append("" if arr is None else name)
    for name, arr in spec.all_inputs():
        if arr is None:
            continue
        if name in spec.wrt or name in spec.dynamic:
            graph_inputs.append(_value_info(name, arr, spec))
            feeds[name] = arr
        else:
            inits.append(numpy_helper.from_array(arr, name))
    while names and names[-1] == "":
        names.pop()
    outs = [f"y{i}" for i in range(spec.outputs)]
    node = helper.make_node(spec.op, names, outs, domain=spec.domain or None, **spec.attrs)
    graph_outs = list(spec.graph_outputs or outs)
    graph = helper.make_graph([node, *spec.extra_nodes], "case", graph_inputs,
                              [onnx.ValueInfoProto(name=o) for o in graph_outs], inits)
    opsets = [helper.make_opsetid("", spec.opset)] + ([helper.make_opsetid(spec.domain, 1)] if spec.domain else [])
    model = helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    for out in model.graph.output:
        if not out.type.HasField("tensor_type"):  # ops without inference (function ops)
            out.type.tensor_type.elem_type = helper.np_dtype_to_tensor_dtype(spec.dtype)
    return model, feeds


def float_outputs(model: onnx.ModelProto, wanted: Sequence[int] | None) -> list[str]:
    outs = [o.name for o in model.graph.output]
    picked = outs if wanted is None else [outs[i] for i in wanted]
    return [o for o in picked if fdcheck.elem_type(model, o) in fdcheck.LOSS_FLOAT_TYPES]


def loss_model(spec: Spec, seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The forward model plus the weighted loss; raises KernelMissing if ORT cannot run it.

    Stop cases put every output in the loss (cast to float); others the float outputs.
    """
    model, feeds = forward_model(spec)
    if spec.kind == "stop":
        names = [o.name for o in model.graph.output]
    else:
        names = float_outputs(model, spec.loss_outputs)
    try:
        values = fdcheck.ort_runner(model)(names, feeds)
    except fdcheck.KernelMissing:
        raise
    except Exception as exc:  # noqa: BLE001 - e.g. "LSTM operator does not support double yet"
        raise fdcheck.KernelMissing(f"{type(exc).__name__}: {exc}") from exc
    shapes = {n: tuple(np.shape(v)) for n, v in zip(names, values)}
    return fdcheck.with_weighted_loss(model, shapes, seed), feeds


def runnable(spec: Spec) -> Spec:
    """``spec`` itself, or its float32 version when onnxruntime has no float64 kernel for it."""
    try:
        loss_model(spec)
        return spec
    except fdcheck.KernelMissing:
        if spec.dtype != np.float64:
            raise
    return spec.with_dtype(np.dtype(np.float32))


def check_spec(spec: Spec, seed: int = 0) -> None:
    spec = runnable(spec)
    if spec.custom is not None:
        spec.custom(spec)
    elif spec.kind == "stop":
        check_stop(spec, seed)
    else:
        check_grad(spec, seed)


def check_grad(spec: Spec, seed: int = 0) -> None:
    model, feeds = loss_model(spec, seed)
    tol = fdcheck.tolerance_for(spec.dtype)
    reports = fdcheck.compare_gradients(model, spec.wrt, feeds, tol, seed=seed)
    text = fdcheck.describe(reports)
    assert all(r.kinks == 0 for r in reports), \
        f"case generator put inputs at a non-differentiable point: {spec.describe()}\n{text}"
    assert all(r.ok for r in reports), f"gradient mismatch for {spec.describe()}\n{text}"


def check_stop(spec: Spec, seed: int = 0) -> None:
    """The op passes no gradient: with ``loss += sum_t ReduceSum(t * V_t)`` the grads are V_t."""
    model, feeds = loss_model(spec, seed)
    model, probes = _with_passthrough(model, spec, feeds, seed)
    grads = fdcheck.analytic_gradients(model, list(probes), feeds)
    tol = fdcheck.tolerance_for(spec.dtype)
    for name, expected in probes.items():
        np.testing.assert_allclose(grads[name], expected, rtol=tol.rtol, atol=tol.atol,
                                   err_msg=f"{name} of {spec.describe()}")


PROBE = "stop_probe"


def _with_passthrough(model: onnx.ModelProto, spec: Spec, feeds: dict[str, np.ndarray],
                      seed: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Add a direct term for each trained input (a scalar probe when the op has no float input)."""
    rng = np.random.default_rng(seed + 1)
    trained = [n for n in spec.wrt if n in feeds]
    m = onnx.ModelProto()
    m.CopyFrom(model)
    if not trained:
        feeds[PROBE] = np.asarray(rng.standard_normal(), np.float32)
        m.graph.input.append(_value_info(PROBE, feeds[PROBE]))
        trained = [PROBE]
    loss_type = fdcheck.elem_type(m, fdcheck.LOSS)
    expected, terms = {}, []
    for k, name in enumerate(trained):
        v = rng.standard_normal(feeds[name].shape).astype(feeds[name].dtype)
        expected[name] = v
        m.graph.initializer.append(numpy_helper.from_array(v, f"stop_v_{k}"))
        m.graph.node.extend([
            helper.make_node("Mul", [name, f"stop_v_{k}"], [f"stop_tv_{k}"]),
            helper.make_node("ReduceSum", [f"stop_tv_{k}"], [f"stop_s_{k}"], keepdims=0),
            helper.make_node("Cast", [f"stop_s_{k}"], [f"stop_c_{k}"], to=loss_type),
        ])
        terms.append(f"stop_c_{k}")
    _rename_loss(m, "stop_inner_loss")
    m.graph.node.append(helper.make_node("Sum", ["stop_inner_loss", *terms], [fdcheck.LOSS]))
    return m, expected


def _rename_loss(m: onnx.ModelProto, new: str) -> None:
    for node in m.graph.node:
        for i, o in enumerate(node.output):
            if o == fdcheck.LOSS:
                node.output[i] = new


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def run_gradient_model(model: onnx.ModelProto, wrt: Sequence[str], feeds: Mapping[str, np.ndarray],
                       extra: Sequence[str]) -> list[np.ndarray]:
    """Run the gradient graph; returns ``extra`` forward values then the gradients."""
    from gradgraph.api import build_gradient_graph

    grad_model = build_gradient_graph(model, fdcheck.LOSS, list(wrt))
    names = list(extra) + [f"{w}{fdcheck.GRAD_SUFFIX}" for w in wrt]
    return fdcheck.session(grad_model).run(names, dict(feeds))

