"""RecomputePass on small ONNX-text graphs and tiny BERT / GPT-2 exports.

Every case checks: the ``*_grad`` outputs equal those without recompute (run in onnxruntime),
``onnx.checker`` (full check) passes, a second run reports ``modified=False``, the stashed
bytes go down, and clones are marked and placed after the forward, before their consumers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import gradgraph
from passes.marks import RECOMPUTE_OF_KEY, Role, role_of
from passes.recompute import (
    AttentionDropoutRecomputePass,
    GeluRecomputePass,
    RecomputeOptions,
    RecomputePass,
    TransformerLayerRecomputePass,
    stashed_values,
    total_stash_bytes,
)
from passes.recompute.patterns import layer_scope, match_erf_gelu

HEAD = '<ir_version: 9, opset_import: ["" : 20]>'
MLP_GELU = HEAD + """
g (float[4,8] x, float[8,16] w1, float[16,8] w2) => (float loss) {
  h = MatMul(x, w1)
  a = Gelu(h)
  o = MatMul(a, w2)
  loss = ReduceSum<keepdims = 0>(o)
}"""
MLP_ERF = HEAD + """
g (float[4,8] x, float[8,16] w1, float[16,8] w2) => (float loss) {
  h = MatMul(x, w1)
  s = Constant<value = float {1.4142135}>()
  d = Div(h, s)
  e = Erf(d)
  one = Constant<value = float {1.0}>()
  p = Add(e, one)
  m = Mul(h, p)
  half = Constant<value = float {0.5}>()
  a = Mul(m, half)
  o = MatMul(a, w2)
  loss = ReduceSum<keepdims = 0>(o)
}"""
ATTENTION = HEAD + """
g (float[2,6,8] q, float[2,8,6] k, float[2,6,8] v, float[8,8] w) => (float loss) {
  sc = MatMul(q, k)
  p = Softmax<axis = -1>(sc)
  ratio = Constant<value = float {0.3}>()
  train = Constant<value = bool {1}>()
  dp, mask = Dropout<seed = 7>(p, ratio, train)
  ctx = MatMul(dp, v)
  o = MatMul(ctx, w)
  sq = Mul(o, o)
  loss = ReduceSum<keepdims = 0>(sq)
}"""
# Two "layers" told apart by their node names (as legacy exports name nodes).
TWO_LAYERS = HEAD + """
g (float[4,8] x, float[8,8] w0, float[8,8] w1, float[8,8] w2) => (float loss) {
  a0 = MatMul(x, w0)
  t0 = Tanh(a0)
  l0 = Mul(t0, t0)
  a1 = MatMul(l0, w1)
  t1 = Tanh(a1)
  l1 = Mul(t1, t1)
  a2 = MatMul(l1, w2)
  t2 = Tanh(a2)
  loss = ReduceSum<keepdims = 0>(t2)
}"""
LAYER_OF = {"a0": 0, "t0": 0, "l0": 0, "a1": 1, "t1": 1, "l1": 1, "a2": 2, "t2": 2}


def gradient_model(text: str, weights: list[str], rename=None) -> ir.Model:
    proto = onnx.parser.parse_model(text)
    if rename:
        for node in proto.graph.node:
            rename(node)
    return ir.from_proto(gradgraph.build_gradient_graph(proto, "loss", weights))


def feeds_of(model: ir.Model, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.inputs:
        shape = [d if isinstance(d, int) else 2 for d in value.shape]
        feeds[value.name] = rng.standard_normal(shape).astype(value.dtype.numpy())
    return feeds


def run(model: ir.Model, feeds: dict[str, np.ndarray], **session) -> dict[str, np.ndarray]:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for key, value in session.items():
        setattr(opts, key, value)
    sess = ort.InferenceSession(ir.to_proto(model).SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    outputs = [o.name for o in sess.get_outputs()]
    return dict(zip(outputs, sess.run(None, {k: v for k, v in feeds.items() if k in names})))


def check_recompute(model: ir.Model, pass_, feeds, exact: bool = True) -> ir.Model:
    """Apply ``pass_`` to a copy of ``model`` and check everything the module docstring says."""
    before = run(model, feeds)
    stash_before, _ = total_stash_bytes(model)
    changed = ir.from_proto(ir.to_proto(model))
    assert pass_(changed).modified
    assert not pass_(changed).modified, "a second run changed the model"
    proto = ir.to_proto(changed)
    onnx.checker.check_model(proto, full_check=True)
    after = run(changed, feeds)
    grads = [k for k in before if k.endswith("_grad")]
    assert grads
    for name in grads:
        if exact:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
        else:
            np.testing.assert_allclose(after[name], before[name], rtol=1e-6, atol=1e-7, err_msg=name)
    stash_after, _ = total_stash_bytes(changed)
    assert stash_after < stash_before
    check_clones(changed)
    return changed


def check_clones(model: ir.Model) -> None:
    nodes = list(model.graph)
    position = {id(n): i for i, n in enumerate(nodes)}
    names = {n.name for n in nodes}
    last_forward = max(i for i, n in enumerate(nodes) if role_of(n) == Role.FORWARD)
    clones = [n for n in nodes if role_of(n) == Role.RECOMPUTE]
    assert clones
    for clone in clones:
        assert clone.metadata_props[RECOMPUTE_OF_KEY] in names
        assert position[id(clone)] > last_forward, f"{clone.name} runs in the forward"
        # every clone is read; an optional output may not be (LayerNormalization's statistics)
        assert any(out.uses() for out in clone.outputs), f"{clone.name} is read by nothing"
        for out in clone.outputs:
            assert out.name.endswith("_recompute")
            users = [u.node for u in out.uses()]
            assert all(role_of(u) in (Role.BACKWARD, Role.RECOMPUTE) for u in users)
            assert all(position[id(u)] > position[id(clone)] for u in users)


# ---- patterns on ONNX text -------------------------------------------------------------------


def test_gelu_recompute():
    model = gradient_model(MLP_GELU, ["w1", "w2"])
    changed = check_recompute(model, GeluRecomputePass(), feeds_of(model))
    assert [n.op_type for n in changed.graph if role_of(n) == Role.RECOMPUTE] == ["Gelu"]
    assert "a" not in {s.name for s in stashed_values(changed)}


def test_erf_gelu_recompute_clones_the_whole_formula():
    model = gradient_model(MLP_ERF, ["w1", "w2"])
    erf = next(n for n in model.graph if n.op_type == "Erf")
    assert match_erf_gelu(erf) is not None
    changed = check_recompute(model, GeluRecomputePass(), feeds_of(model))
    stashed = {s.name for s in stashed_values(changed)}
    assert stashed.isdisjoint({"d", "e", "p", "m", "a"}) and "h" in stashed


def _tanh_gelu(cube: str, tail: str) -> str:
    """GPT-2's gelu_new written out: the cube as Pow or x*x*x, the 0.5 before or after."""
    cube_nodes = ("c3 = Constant<value = float {3.0}>()\n  p = Pow(h, c3)" if cube == "pow"
                  else "hh2 = Mul(h, h)\n  p = Mul(hh2, h)")
    tail_nodes = ("hh = Mul(h, half)\n  a = Mul(hh, pl)" if tail == "half_first"
                  else "xa = Mul(h, pl)\n  a = Mul(xa, half)")
    return HEAD + f"""
g (float[4,8] x, float[8,16] w1, float[16,8] w2) => (float loss) {{
  h = MatMul(x, w1)
  {cube_nodes}
  k = Constant<value = float {{0.044715}}>()
  q = Mul(k, p)
  u = Add(h, q)
  s = Constant<value = float {{0.7978845608}}>()
  v = Mul(u, s)
  t = Tanh(v)
  one = Constant<value = float {{1.0}}>()
  pl = Add(t, one)
  half = Constant<value = float {{0.5}}>()
  {tail_nodes}
  o = MatMul(a, w2)
  loss = ReduceSum<keepdims = 0>(o)
}}"""


@pytest.mark.parametrize("cube", ["pow", "muls"])
@pytest.mark.parametrize("tail", ["half_first", "half_last"])
def test_tanh_gelu_recompute_clones_the_whole_formula(cube, tail):
    model = gradient_model(_tanh_gelu(cube, tail), ["w1", "w2"])
    changed = check_recompute(model, GeluRecomputePass(), feeds_of(model), exact=False)
    recomputed = {n.metadata_props[RECOMPUTE_OF_KEY] for n in changed.graph if role_of(n) == Role.RECOMPUTE}
    ops = {n.name: n.op_type for n in model.graph}
    assert sorted(ops[name] for name in recomputed if name in ops).count("Tanh") == 1
    assert {s.name for s in stashed_values(changed)} & {"t", "pl", "v", "u", "p", "q"} == set()


def test_gelu_not_feeding_matmul_is_left_alone():
    text = MLP_GELU.replace("o = MatMul(a, w2)", "o = Mul(a, a)").replace("float[16,8] w2", "float[16] w2")
    model = gradient_model(text, ["w1"])
    with pytest.warns(UserWarning, match=r"RecomputeOptions\.gelu=True .* recomputed nothing"):
        assert not GeluRecomputePass()(model).modified


def test_attention_dropout_recompute_reuses_the_mask():
    model = gradient_model(ATTENTION, ["q", "k", "v", "w"])
    changed = check_recompute(model, AttentionDropoutRecomputePass(), feeds_of(model))
    where = next(n for n in changed.graph if role_of(n) == Role.RECOMPUTE and n.op_type == "Where")
    assert where.inputs[0].name == "mask"
    assert "dp" not in {s.name for s in stashed_values(changed)}
    assert sum(n.op_type == "Dropout" for n in changed.graph) == 1, "Dropout must not be re-run"


def test_transformer_layers_by_node_name_scopes():
    def rename(node):
        node.name = f"/model/layers.{LAYER_OF[node.output[0]]}/{node.output[0]}" \
            if node.output[0] in LAYER_OF else node.name

    model = gradient_model(TWO_LAYERS, ["w0", "w1", "w2"], rename)
    changed = check_recompute(model, TransformerLayerRecomputePass(), feeds_of(model))
    recomputed = {n.metadata_props[RECOMPUTE_OF_KEY] for n in changed.graph if role_of(n) == Role.RECOMPUTE}
    assert all("layers.2" not in name for name in recomputed), "the last layer is never recomputed"
    assert any("layers.0" in name for name in recomputed) and any("layers.1" in name for name in recomputed)
    stashed = {s.name for s in stashed_values(changed)}
    assert {"l0", "l1"} <= stashed, "layer outputs (inputs of later layers) stay saved"
    one = ir.from_proto(ir.to_proto(model))
    TransformerLayerRecomputePass(RecomputeOptions(number_recompute_layers=1))(one)
    recomputed = {n.metadata_props[RECOMPUTE_OF_KEY] for n in one.graph if role_of(n) == Role.RECOMPUTE}
    assert recomputed and all("layers.0" in name for name in recomputed)


def test_layer_scope_reads_dynamo_metadata():
    import re

    node = ir.node("Add", [])
    node.metadata_props["pkg.torch.onnx.name_scopes"] = "['', 'model', 'model.bert.encoder.layer.3', 'x']"
    pattern = re.compile(RecomputeOptions().layer_scope_pattern)
    assert layer_scope(node, pattern) == "model.bert.encoder.layer.3"
    node.metadata_props.clear()
    node.metadata_props["namespace"] = ": M/model.transformer.h.1: Block/add: aten.add"
    assert layer_scope(node, pattern) == "model.transformer.h.1"


@pytest.mark.parametrize("text,weights", [(MLP_ERF, ["w1", "w2"]), (ATTENTION, ["q", "k", "v", "w"]),
                                          (TWO_LAYERS, ["w0", "w1", "w2"])])
def test_planner_meets_half_the_stash(text, weights):
    model = gradient_model(text, weights)
    budget = total_stash_bytes(model)[0] // 2
    options = RecomputeOptions(memory_budget=budget, recompute_compute_intensive=True)
    changed = check_recompute(model, RecomputePass(options), feeds_of(model))
    assert total_stash_bytes(changed)[0] <= budget


def test_planner_warns_when_the_budget_is_infeasible():
    model = gradient_model(ATTENTION, ["q", "k", "v", "w"])
    with pytest.warns(UserWarning, match="infeasible"):
        RecomputePass(RecomputeOptions(memory_budget=0))(model)


def test_no_marks_no_change():
    model = ir.from_proto(onnx.parser.parse_model(MLP_GELU))
    assert not RecomputePass(RecomputeOptions(gelu=True, memory_budget=0))(model).modified


def test_stash_sizes_use_dims():
    text = MLP_GELU.replace("float[4,8] x", "float[N,8] x")
    model = gradient_model(text, ["w1", "w2"])
    stashes = stashed_values(model)
    assert any(s.nbytes is None for s in stashes)
    sized = stashed_values(model, {"N": 4})
    assert all(s.nbytes is not None for s in sized)
    assert {s.name: s.nbytes for s in sized}["a"] == 4 * 16 * 4
    assert all(s.producer is not None and s.consumers for s in sized)


# ---- tiny BERT / GPT-2 -----------------------------------------------------------------------

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    import model_zoo

    cache: dict[tuple[str, str], tuple[ir.Model, dict[str, np.ndarray]]] = {}

    def get(name: str, exporter: str):
        if (name, exporter) not in cache:
            path = os.fspath(tmp_path_factory.mktemp("zoo") / f"{name}_{exporter}.onnx")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                path, loss, params = model_zoo.export(name, exporter, "train_p0", path)
            model = ir.from_proto(gradgraph.build_gradient_graph(path, loss, list(params)))
            _, batch, names = model_zoo.build(name, "train_p0")
            cache[name, exporter] = model, {n: t.numpy() for n, t in zip(names, batch)}
        return cache[name, exporter]

    return get


ZOO_CASES = [
    ("bert", "legacy", RecomputeOptions(transformer_layers=True)),
    ("bert", "legacy", RecomputeOptions(gelu=True, attn_dropout=True)),
    ("bert", "dynamo", RecomputeOptions(transformer_layers=True, gelu=True)),
    ("gpt2", "dynamo", RecomputeOptions(transformer_layers=True)),
    ("gpt2", "legacy", RecomputeOptions(memory_budget=0)),
]


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch and transformers")
@pytest.mark.parametrize("name,exporter,options", ZOO_CASES)
def test_tiny_transformers(zoo, name, exporter, options):
    model, feeds = zoo(name, exporter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # memory_budget=0 is infeasible: the minimum is used
        check_recompute(model, RecomputePass(options), feeds, exact=False)


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch and transformers")
def test_tiny_bert_layers_found_by_the_reference_edges(zoo):
    from passes.recompute.patterns import reference_layers, scope_layers

    model, _ = zoo("bert", "legacy")
    options = RecomputeOptions()
    assert len(reference_layers(model.graph, options)) == 2
    dynamo, _ = zoo("bert", "dynamo")
    assert len(scope_layers(dynamo.graph, options)) == 2


# ---- property test over random trainable models ---------------------------------------------

HAS_STRATEGIES = importlib.util.find_spec("graph_strategies") is not None


@pytest.mark.skipif(not HAS_STRATEGIES, reason="tests/graph_strategies.py not present")
def test_random_models_keep_their_gradients():
    import graph_strategies as gs
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    all_on = RecomputeOptions(gelu=True, attn_dropout=True, transformer_layers=True)

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(gs.random_training_models(opset=20), st.sampled_from(["all", "planner", "planner0"]))
    def check(proto, mode):
        model = ir.from_proto(gradgraph.build_gradient_graph(proto, "loss", gs.trainable_names(proto)))
        feeds = gs.feeds(proto)
        stash, _ = total_stash_bytes(model)
        budget = {"all": None, "planner": stash // 2, "planner0": 0}[mode]
        options = dataclasses.replace(all_on, memory_budget=budget, recompute_compute_intensive=True)
        before = run(model, feeds)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            RecomputePass(options)(model)
            assert not RecomputePass(options)(model).modified
        onnx.checker.check_model(ir.to_proto(model), full_check=True)
        after = run(model, feeds)
        for name in (k for k in before if k.endswith("_grad")):
            np.testing.assert_allclose(after[name], before[name], rtol=1e-6, atol=1e-6, err_msg=name)
        assert total_stash_bytes(model)[0] <= stash

    check()
