"""Reusable checks that a pass keeps what a model computes; any onnx_ir pass, any model.

API (keep stable: other tests import it)
----------------------------------------
``assert_pass_preserves(model_proto, make_pass, *, feeds, rtol=1e-6, atol=1e-6,
check_gradients=True, weights=None, on_gradient_graph=False, loss="loss",
ort_optimize=False) -> PassCheck``

1. ``make_pass`` is a zero-argument factory returning a fresh onnx_ir pass. The pass runs on a
   copy (``ir.from_proto`` of a copy of ``model_proto``); the input proto is never changed.
2. The result passes ``onnx.checker.check_model(full_check=True)``, keeps the graph output
   names in order, and, run in onnxruntime (CPU) on ``feeds``, gives every output equal to the
   original's within ``rtol`` / ``atol`` (same shape and dtype).
3. ``check_gradients``: ``gradgraph.build_gradient_graph(original, loss, weights)`` and the same
   of the transformed model give the same set of ``*_grad`` outputs, equal within tolerance.
   ``on_gradient_graph=True`` instead applies the pass AFTER ``build_gradient_graph`` (passes
   that clean gradient graphs): then 2. compares every output of the gradient graph, gradients
   included, and 3. is not repeated.
4. The pass runs a second time on its own result: it must report ``modified=False`` and leave
   the model unchanged (serialized bytes equal).

Random ops: an output that depends on a random node is compared in shape and dtype only (its
values differ between two runs of the same model). Random nodes are RandomNormal(Like),
RandomUniform(Like), Bernoulli, Multinomial, and Dropout unless its ratio is a constant 0 or
its ``training_mode`` is absent, a constant false, or a graph input fed false in ``feeds``
(feed ``training_mode=False``, or use ratio 0, to compare Dropout outputs too). Nodes with
subgraphs holding a random op count as random. The check is done on the original and the
transformed graph and the skipped names are the union; ``PassCheck.skipped`` lists them.

onnxruntime runs with its graph optimizations off by default (``ort_optimize=False``): its
fusions (Gelu, LayerNormalization, MatMul+Add, ...) match one graph's shape and not the other's
and change the last bits of results for reasons that have nothing to do with the pass under
test; with them off both models run node by node. One intra-op thread, for the same reason.

``run_model(proto, feeds, *, ort_optimize=False) -> dict[str, np.ndarray]``: outputs by name.
``apply_pass(proto, make_pass) -> tuple[onnx.ModelProto, bool]``: the pass on a copy, and its
``modified`` flag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import numpy_helper
from onnx_ir.passes import PassBase

import gradgraph

PassFactory = Callable[[], PassBase]

RANDOM_OPS = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                        "Bernoulli", "Multinomial"})


@dataclasses.dataclass(frozen=True)
class PassCheck:
    """What :func:`assert_pass_preserves` saw: the transformed model(s) and what it compared."""

    transformed: onnx.ModelProto  # the pass's result (on the gradient graph if on_gradient_graph)
    modified: bool  # the first run's flag
    compared: tuple[str, ...]  # outputs compared by value (gradient outputs included)
    skipped: tuple[str, ...]  # outputs depending on random nodes: shape and dtype only


def run_model(proto: onnx.ModelProto, feeds: Mapping[str, np.ndarray], *,
              ort_optimize: bool = False) -> dict[str, np.ndarray]:
    """Run ``proto`` on onnxruntime CPU; {output name: array}. Extra feeds are ignored."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only: kept unused initializers are not news
    if not ort_optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {k: v for k, v in feeds.items() if k in wanted})))


def apply_pass(proto: onnx.ModelProto, make_pass: PassFactory) -> tuple[onnx.ModelProto, bool]:
    """Run a fresh pass on a copy of ``proto``; the result and the pass's ``modified``."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    result = make_pass()(ir.from_proto(copy))
    return ir.to_proto(result.model), result.modified


def assert_pass_preserves(
    model_proto: onnx.ModelProto,
    make_pass: PassFactory,
    *,
    feeds: Mapping[str, np.ndarray],
    rtol: float = 1e-6,
    atol: float = 1e-6,
    check_gradients: bool = True,
    weights: Iterable[str] | None = None,
    on_gradient_graph: bool = False,
    loss: str = "loss",
    ort_optimize: bool = False,
) -> PassCheck:
    """Assert the pass keeps outputs (and gradients), the checker's approval, and is idempotent."""
    weight_list = None if weights is None else list(weights)
    base = model_proto
    if on_gradient_graph:
        base = gradgraph.build_gradient_graph(model_proto, loss, weight_list)
    transformed, modified = apply_pass(base, make_pass)
    onnx.checker.check_model(transformed, full_check=True)
    assert [o.name for o in transformed.graph.output] == [o.name for o in base.graph.output], \
        "the pass changed the graph outputs"
    compared, skipped = _compare(base, transformed, feeds, rtol, atol, ort_optimize, "output")
    if check_gradients and not on_gradient_graph:
        grads = gradgraph.build_gradient_graph(base, loss, weight_list)
        grads_after = gradgraph.build_gradient_graph(transformed, loss, weight_list)
        names = _grad_names(grads)
        assert names == _grad_names(grads_after), \
            f"gradient outputs differ: {sorted(names)} vs {sorted(_grad_names(grads_after))}"
        more, more_skipped = _compare(grads, grads_after, feeds, rtol, atol, ort_optimize,
                                      "gradient", only=names)
        compared, skipped = compared + more, skipped + more_skipped
    again, modified_again = apply_pass(transformed, make_pass)
    assert not modified_again, "a second run of the pass reported modified=True"
    assert again.SerializeToString() == transformed.SerializeToString(), \
        "a second run of the pass changed the model"
    return PassCheck(transformed, modified, compared, skipped)


def _grad_names(proto: onnx.ModelProto) -> set[str]:
    return {o.name for o in proto.graph.output if o.name.endswith("_grad")}


def _compare(before: onnx.ModelProto, after: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
             rtol: float, atol: float, ort_optimize: bool, what: str,
             only: set[str] | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    expected = run_model(before, feeds, ort_optimize=ort_optimize)
    actual = run_model(after, feeds, ort_optimize=ort_optimize)
    random = random_outputs(before, feeds) | random_outputs(after, feeds)
    compared, skipped = [], []
    for name, want in expected.items():
        if only is not None and name not in only:
            continue
        got = actual[name]
        assert got.dtype == want.dtype and got.shape == want.shape, \
            f"{what} {name!r}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
        if name in random:
            skipped.append(name)
            continue
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"{what} {name!r}")
        compared.append(name)
    return tuple(compared), tuple(skipped)


def random_outputs(proto: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> set[str]:
    """Names of the graph outputs whose values depend on a random node (see the docstring)."""
    constants = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    constants.update({k: np.asarray(v) for k, v in feeds.items()
                      if k in {i.name for i in proto.graph.input}})
    tainted: set[str] = set()
    for node in proto.graph.node:  # ONNX graphs list nodes in topological order
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.attribute:
            if node.attribute[0].name == "value":
                constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
        if _is_random(node, constants) or any(i in tainted for i in node.input if i):
            tainted.update(o for o in node.output if o)
    return {o.name for o in proto.graph.output if o.name in tainted}


def _is_random(node: onnx.NodeProto, constants: Mapping[str, np.ndarray]) -> bool:
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type in RANDOM_OPS:
        return True
    if node.op_type == "Dropout":
        ratio = _known(node, 1, constants)
        training = _known(node, 2, constants)
        absent_training = len(node.input) < 3 or not node.input[2]
        deterministic = (absent_training or (training is not None and not training.any())
                         or (ratio is not None and not ratio.any()))
        return not deterministic
    return any(_graph_has_random(g) for g in _subgraphs(node))


def _known(node: onnx.NodeProto, index: int, constants: Mapping[str, np.ndarray]) -> np.ndarray | None:
    if len(node.input) <= index or not node.input[index]:
        return None
    return constants.get(node.input[index])


def _graph_has_random(graph: onnx.GraphProto) -> bool:
    return any(n.op_type in RANDOM_OPS or n.op_type == "Dropout"
               or any(_graph_has_random(g) for g in _subgraphs(n)) for n in graph.node)


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    graphs: list[onnx.GraphProto] = []
    for attr in node.attribute:
        if attr.HasField("g"):
            graphs.append(attr.g)
        graphs.extend(attr.graphs)
    return graphs
