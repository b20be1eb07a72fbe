"""passes.split: the forward and backward halves of a gradient graph give what the whole graph gives.

Oracle: the unsplit graph run in one onnxruntime session (optimizations off, so both runs do
the same arithmetic); the split must be bit-exact. Graphs: hypothesis-drawn training graphs
(with and without recompute clones) and the tiny BERT / GPT-2 exports (dropout p=0).
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import gradgraph
from passes.marks import Role, role_of
from passes.recompute import RecomputeOptions, RecomputePass, total_stash_bytes
from passes.split import SPLIT_KEY, SplitError, split_forward_backward
from passes.split.forward_backward import VIEW_OPS

REPLAYED = VIEW_OPS | {"Transpose"}  # views and the Transposes matrix products fold

HAS_STRATEGIES = importlib.util.find_spec("graph_strategies") is not None


def _session(model: ir.Model) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


def _run(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})))


def assert_split_exact(model: ir.Model, feeds: dict[str, np.ndarray]) -> None:
    whole = _run(_session(model), feeds)
    split = split_forward_backward(model)
    for part in (split.forward, split.backward):
        onnx.checker.check_model(ir.to_proto(part), full_check=True)
    forward = _run(_session(split.forward), feeds)
    assert set(split.user_outputs) | set(split.stashed) == set(forward)
    backward = _run(_session(split.backward), {**feeds, **forward})
    assert set(forward) & set(backward) == set()
    for name, expected in whole.items():
        got = forward[name] if name in forward else backward[name]
        np.testing.assert_array_equal(got, expected, err_msg=name)
    # the forward holds no backward-side node, the backward no forward node but copied Constants
    # and views run again on their stashed input
    assert all(role_of(n) in (Role.FORWARD, Role.PRECISION) or n.op_type in ("Shape", "Size")
               for n in split.forward.graph)
    assert all(role_of(n) != Role.FORWARD or n.op_type == "Constant" or n.op_type in REPLAYED
               for n in split.backward.graph)
    # no view's output is stashed: onnxruntime copies a view that is a graph output
    producers = {v.name: n for n in split.forward.graph for v in n.outputs}
    # and no view is left in the forward that nothing there reads (one read by a replayed view)
    forward_outputs = {v.name for v in split.forward.graph.outputs}
    assert all(v.uses() or v.name in forward_outputs
               for n in split.forward.graph if n.op_type in VIEW_OPS for v in n.outputs)
    assert not any(producers[name].op_type in VIEW_OPS for name in split.stashed if name in producers)
    # nor a Transpose that only matrix products read (onnxruntime folds it into them)
    assert not any(producers[name].op_type == "Transpose"
                   and {u.node.op_type for u in producers[name].outputs[0].uses()} <= {"MatMul", "Gemm"}
                   and list(producers[name].attributes.get_ints("perm") or [])[-2:]
                   == [len(producers[name].attributes.get_ints("perm") or []) - 1,
                       len(producers[name].attributes.get_ints("perm") or []) - 2]
                   for name in split.stashed if name in producers)
    assert split.forward.graph.metadata_props[SPLIT_KEY] == "forward"
    # the stash is at most what the analysis counts (a Shape-only read stashes the shape)
    stash_bytes, unknown = total_stash_bytes(model)
    if not unknown:
        shapes = {v.name for n in split.forward.graph if n.op_type in ("Shape", "Size") for v in n.outputs}
        assert sum(forward[n].nbytes for n in split.stashed if n not in shapes) <= stash_bytes


def _mlp() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((8, 1)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Tanh", ["h"], ["a"]),
             helper.make_node("MatMul", ["a", "w2"], ["y"]), helper.make_node("Sub", ["y", "t"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["loss"],
                                                                           keepdims=0)]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4]),
                                             helper.make_tensor_value_info("t", TensorProto.FLOAT, [3, 1])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, 8])], [w1, w2])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    feeds = {"x": rng.standard_normal((3, 4)).astype(np.float32),
             "t": rng.standard_normal((3, 1)).astype(np.float32)}
    return proto, feeds


def test_mlp_split_is_exact_and_keeps_user_outputs_in_the_forward():
    proto, feeds = _mlp()
    model = ir.from_proto(gradgraph.build_gradient_graph(proto, "loss", ["w1", "w2"]))
    assert_split_exact(model, feeds)
    split = split_forward_backward(model)
    assert split.user_outputs == ("loss", "a")
    assert "t" in split.from_caller or "x" in split.from_caller  # the backward reads graph inputs
    assert {v.name for v in split.backward.graph.outputs} == {"w1_grad", "w2_grad"}


def test_weights_made_inputs_are_shared_not_copied():
    from passes.forward.params_to_inputs import ParamsToInputsPass

    proto, feeds = _mlp()
    model = ir.from_proto(gradgraph.build_gradient_graph(proto, "loss", ["w1", "w2"]))
    to_inputs = ParamsToInputsPass(["w1", "w2"])
    to_inputs(model)
    split = split_forward_backward(model)
    assert not split.forward.graph.initializers and not split.backward.graph.initializers
    assert_split_exact(model, {**feeds, **to_inputs.values})


def test_a_shape_only_read_stashes_the_shape_not_the_tensor():
    proto, _ = _mlp()
    model = ir.from_proto(gradgraph.build_gradient_graph(proto, "loss", ["w1", "w2"]))
    readers = {v.name: [u.node.op_type for u in v.uses()] for n in model.graph for v in n.outputs}
    shape_only = [name for name, ops in readers.items()
                  if "Shape" in ops and name not in {"loss", "a"}]
    split = split_forward_backward(model)
    for name in shape_only:
        read_by_backward_otherwise = any(
            op != "Shape" for op in readers[name]) and name in split.stashed
        assert name not in split.stashed or read_by_backward_otherwise


def test_nodes_that_reach_no_output_are_on_neither_side():
    """A VJP graph (VjpSeedPass) holds ``vjp = ReduceSum(y * seed)``, of which only the gradient is
    used: the backward must not recompute it, so it must not read the output ``y`` itself."""
    from onnx import TensorProto, helper, numpy_helper

    from passes.autodiff.gradient_pass import GradientPass
    from passes.autodiff.vjp import VjpSeedPass

    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((4, 5)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "linear",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])], [w])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    vjp = VjpSeedPass()
    vjp(model)
    GradientPass(vjp.loss, ["w"])(model)
    assert any(n.name == "y_vjp_mul" for n in model.graph)  # there before the split
    feeds = {"x": rng.standard_normal((3, 4)).astype(np.float32),
             "y_grad_output": rng.standard_normal((3, 5)).astype(np.float32)}
    assert_split_exact(model, feeds)
    split = split_forward_backward(model)
    assert not any("vjp" in (n.name or "") for part in (split.forward, split.backward) for n in part.graph)
    assert "y" not in {v.name for v in split.backward.graph.inputs}
    assert split.stashed == ()
    # the gradient is the VJP: x^T @ seed
    grad = _run(_session(split.backward), feeds)["w_grad"]
    np.testing.assert_allclose(grad, feeds["x"].T @ feeds["y_grad_output"], rtol=1e-5, atol=1e-6)


def test_a_graph_without_backward_is_refused():
    proto, _ = _mlp()
    with pytest.raises(SplitError, match="no backward node"):
        split_forward_backward(ir.from_proto(proto))


def test_the_input_model_is_not_modified():
    proto, _ = _mlp()
    model = ir.from_proto(gradgraph.build_gradient_graph(proto, "loss", ["w1", "w2"]))
    before = ir.to_proto(model).SerializeToString()
    split_forward_backward(model)
    assert ir.to_proto(model).SerializeToString() == before


@pytest.mark.skipif(not HAS_STRATEGIES, reason="tests/graph_strategies.py not present")
def test_random_training_graphs_split_exactly():
    import graph_strategies as gs
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(gs.random_training_models(opset=20, dropout=False), st.booleans())
    def check(proto, recompute):
        model = ir.from_proto(gradgraph.build_gradient_graph(proto, "loss", gs.trainable_names(proto)))
        if recompute:
            RecomputePass(RecomputeOptions(gelu=True, transformer_layers=True, memory_budget=0,
                                           recompute_compute_intensive=True))(model)
        assert_split_exact(model, gs.feeds(proto))

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # memory_budget=0 is infeasible: the minimum is used
        check()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "gpt2"])
@pytest.mark.parametrize("recompute", [None, "layers", "planner"])
def test_tiny_transformers_split_exactly(tmp_path, name, recompute):
    model_zoo = pytest.importorskip("model_zoo")
    path = str(tmp_path / f"{name}.onnx")
    feeds = model_zoo.export_with_feeds(name, "legacy", "train_p0", path)
    proto = onnx.load(path)
    trained = [t.name for t in proto.graph.initializer
               if t.data_type == onnx.TensorProto.FLOAT and int(np.prod(t.dims)) >= 2]
    model = ir.from_proto(gradgraph.build_gradient_graph(proto, "loss", trained))
    if recompute == "layers":
        RecomputePass(RecomputeOptions(transformer_layers=True))(model)
    elif recompute == "planner":
        stash, _ = total_stash_bytes(model)
        RecomputePass(RecomputeOptions(memory_budget=stash // 2))(model)
    assert_split_exact(model, feeds)


LOOP = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2, 3] x, int64 trips) => (float loss) <float[3, 3] W = {0.1, -0.2, 0.3, 0.4, 0.5, -0.6, 0.7, 0.8, 0.9}> {
  cond = Constant <value = bool {1}> ()
  h = Loop (trips, cond, x) <body = step (int64 i, bool c, float[2, 3] h_in) => (bool c_out, float[2, 3] h_out) {
    c_out = Identity (c)
    p = MatMul (h_in, W)
    h_out = Tanh (p)
  }>
  loss = ReduceSum <keepdims = 0> (h)
}
"""


def test_a_loop_whose_gradient_body_reads_forward_values_splits_exactly():
    # the Loop's gradient sweeps a body that reads values of the forward (the recorded
    # per-iteration states): the split saw no reader of them (subgraph reads were not
    # resolved to their node) and failed removing them ("still being used")
    from onnx import parser

    grad = gradgraph.build_gradient_graph(parser.parse_model(LOOP), "loss", ["W"])
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32),
             "trips": np.array(3, np.int64)}
    assert_split_exact(ir.from_proto(grad), feeds)


def _tied_head(extra_reader: str | None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``logits = h @ Transpose(E)`` with ``h = Gather(E, ids)``: a tied embedding, as GPT-2's
    LM head; ``extra_reader`` adds another op reading the transposed weight."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Gather", ["E", "ids"], ["h"]),
             helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "Et"], ["logits"]),
             helper.make_node("ReduceSumSquare", ["logits"], ["loss"], keepdims=0)]
    if extra_reader:
        nodes += [helper.make_node(extra_reader, ["Et"], ["et2"]),
                  helper.make_node("ReduceSum", ["et2"], ["r"], keepdims=0),
                  helper.make_node("Add", ["loss", "r"], ["total"])]
    loss = "total" if extra_reader else "loss"
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3]),
                                              helper.make_tensor_value_info("E", TensorProto.FLOAT, [7, 4])],
                              [helper.make_tensor_value_info(loss, TensorProto.FLOAT, [])])
    feeds = {"ids": rng.integers(0, 7, (2, 3)).astype(np.int64),
             "E": rng.standard_normal((7, 4)).astype(np.float32)}
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), feeds


@pytest.mark.parametrize("extra_reader", [None, "Sigmoid"])
def test_a_transpose_only_products_read_is_run_again_not_stashed(extra_reader):
    proto, feeds = _tied_head(extra_reader)
    model = ir.from_proto(gradgraph.build_gradient_graph(proto, "total" if extra_reader else "loss", ["E"]))
    assert_split_exact(model, feeds)
    split = split_forward_backward(model)
    # read by a Sigmoid too, the transposed weight is stashed as before
    assert ("Et" in split.stashed) == (extra_reader is not None)
    if extra_reader is None:  # and then onnxruntime folds it into the products on both sides
        # (the Transpose left in the backward is the gradient's, of dEt into dE)
        for part in (split.forward, split.backward):
            opts = ort.SessionOptions()
            opts.optimized_model_filepath = str(Path(tempfile.mkdtemp()) / "opt.onnx")
            ort.InferenceSession(ir.to_proto(part).SerializeToString(), opts, providers=["CPUExecutionProvider"])
            optimized = onnx.load(opts.optimized_model_filepath)
            assert not [n for n in optimized.graph.node if n.op_type == "Transpose" and set(n.input) & {"E", "Et"}]
            assert any(n.op_type in ("MatMul", "FusedMatMul") and "E" in n.input for n in optimized.graph.node)
