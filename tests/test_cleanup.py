"""CleanupPass: each trap as an ONNX-text fixture, then a property test over drawn models."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx_ir.passes import InPlacePass, PassResult

from passes.cleanup import CleanupOptions, CleanupPass
from passes.marks import GRAD_OF_KEY, STAGE_KEY, Role
from tests.graph_strategies import feeds, has_random_ops, random_models
from tests.pass_harness import apply_pass, assert_pass_preserves, run_model

HEADER = '<ir_version: 9, opset_import: ["" : 18]>\n'
X = {"x": np.linspace(-2.0, 2.0, 6, dtype=np.float32).reshape(2, 3)}


def _proto(text: str) -> onnx.ModelProto:
    return ir.to_proto(ir.from_onnx_text(HEADER + text))


def _ops(proto: onnx.ModelProto) -> collections.Counter[str]:
    return collections.Counter(n.op_type for n in proto.graph.node)


def _cleanup(**options: object) -> CleanupPass:
    return CleanupPass(CleanupOptions(**options))  # type: ignore[arg-type]


def test_merges_twins_removes_identities_and_dead_nodes() -> None:
    model = _proto("""
g (float[2, 3] x) => (float loss) <float[3] w = {0.5, -1., 2.}> {
  a = Mul(x, w)
  t1 = Tanh(a)
  t2 = Tanh(a)
  i = Identity(t2)
  dead = Sigmoid(t1)
  s = Add(t1, i)
  loss = ReduceSum<keepdims=0>(s)
}""")
    check = assert_pass_preserves(model, CleanupPass, feeds=X)
    assert check.modified
    assert _ops(check.transformed) == {"Mul": 1, "Tanh": 1, "Add": 1, "ReduceSum": 1}
    assert "loss" in check.compared and "w_grad" in check.compared


def test_clean_model_is_not_modified() -> None:
    model = _proto("""
g (float[2, 3] x) => (float loss) <float[3] w = {0.5, -1., 2.}> {
  a = Mul(x, w)
  loss = ReduceSum<keepdims=0>(a)
}""")
    transformed, modified = apply_pass(model, CleanupPass)
    assert not modified
    assert transformed.SerializeToString() == ir.to_proto(ir.from_proto(model)).SerializeToString()


RANDOM_TWINS = """
g (float[2, 3] x, bool training_mode) => (float[2, 3] y) {
  r = Constant<value = float {0.5}>()
  d1 = Dropout(x, r, training_mode)
  d2 = Dropout(x, r, training_mode)
  n1 = RandomNormalLike(x)
  n2 = RandomNormalLike(x)
  u1 = RandomUniformLike<low = 0.2, high = 0.8>(x)
  b1 = Bernoulli(u1)
  b2 = Bernoulli(u1)
  m1 = RandomUniform<shape = [2, 3]>()
  m2 = RandomUniform<shape = [2, 3]>()
  s = Sum(d1, d2, n1, n2, b1, b2, m1, m2)
  y = Identity(s)
}"""


def test_random_ops_are_never_merged() -> None:
    model = _proto(RANDOM_TWINS)
    check = assert_pass_preserves(model, CleanupPass, check_gradients=False,
                                  feeds={**X, "training_mode": np.array(True)})
    ops = _ops(check.transformed)
    assert ops["Dropout"] == ops["RandomNormalLike"] == ops["Bernoulli"] == ops["RandomUniform"] == 2
    assert check.skipped == ("y",) and check.compared == ()


@pytest.mark.parametrize("training, ratio", [("0", "0.5"), ("1", "0.0")])
def test_deterministic_dropouts_are_merged(training: str, ratio: str) -> None:
    model = _proto(f"""
g (float[2, 3] x) => (float[2, 3] y) {{
  r = Constant<value = float {{{ratio}}}>()
  t = Constant<value = bool {{{training}}}>()
  d1 = Dropout(x, r, t)
  d2 = Dropout(x, r, t)
  y = Add(d1, d2)
}}""")
    check = assert_pass_preserves(model, CleanupPass, check_gradients=False, feeds=X)
    assert _ops(check.transformed)["Dropout"] == 1
    assert check.compared == ("y",)


def _marked(text: str, marks: dict[str, dict[str, str]]) -> onnx.ModelProto:
    """The model with ``marks`` ({node name: metadata}) on its nodes."""
    model = ir.from_onnx_text(HEADER + text)
    for node in model.graph:
        node.metadata_props.update(marks.get(node.name or "", {}))
    return ir.to_proto(model)


RECOMPUTE = """
g (float[2, 3] x) => (float loss) <float[3] w = {0.5, -1., 2.}> {
  [fwd] a = Tanh(x)
  [clone] b = Tanh(x)
  [copy] c = Identity(b)
  [mul] m = Mul(a, w)
  [mul2] m2 = Mul(c, m)
  [sum] loss = ReduceSum<keepdims=0>(m2)
}"""


def test_recompute_clones_are_kept_and_marks_survive() -> None:
    recompute = {STAGE_KEY: Role.RECOMPUTE.value, "gradgraph.recompute_of": "fwd"}
    marks = {"clone": recompute, "copy": recompute,
             "mul": {STAGE_KEY: Role.BACKWARD.value, GRAD_OF_KEY: "fwd"}}
    model = _marked(RECOMPUTE, marks)
    check = assert_pass_preserves(model, CleanupPass, feeds=X)
    assert not check.modified
    kept = {n.name: {p.key: p.value for p in n.metadata_props} for n in check.transformed.graph.node}
    assert kept["clone"] == kept["copy"] == recompute and kept["mul"] == marks["mul"]
    merged = assert_pass_preserves(model, lambda: _cleanup(keep_roles=()), feeds=X)
    assert _ops(merged.transformed) == {"Tanh": 1, "Mul": 2, "ReduceSum": 1}
    names = {n.name: n for n in merged.transformed.graph.node}
    assert "clone" not in names and "copy" not in names
    assert {p.key: p.value for p in names["mul"].metadata_props} == marks["mul"]


def test_identity_removal_keeps_output_names() -> None:
    model = _proto("""
g (float[2, 3] x) => (float[2, 3] a, float[2, 3] b, float[2, 3] c, float[2, 3] d) {
  a = Tanh(x)
  b = Identity(a)
  t = Sigmoid(x)
  c = Identity(t)
  d = Identity(x)
}""")
    check = assert_pass_preserves(model, CleanupPass, check_gradients=False, feeds=X)
    assert [o.name for o in check.transformed.graph.output] == ["a", "b", "c", "d"]
    assert _ops(check.transformed) == {"Tanh": 1, "Identity": 2, "Sigmoid": 1}
    sigmoid = next(n for n in check.transformed.graph.node if n.op_type == "Sigmoid")
    assert list(sigmoid.output) == ["c"]


def test_equal_graph_outputs_stay_apart() -> None:
    model = _proto("""
g (float[2, 3] x) => (float[2, 3] a, float[2, 3] b, float[2, 3] c) {
  a = Tanh(x)
  b = Tanh(x)
  t = Sigmoid(x)
  c = Sigmoid(x)
  s = Add(t, c)
}""")
    check = assert_pass_preserves(model, CleanupPass, check_gradients=False, feeds=X)
    assert _ops(check.transformed) == {"Tanh": 2, "Sigmoid": 1}
    assert [o.name for o in check.transformed.graph.output] == ["a", "b", "c"]


FOLDING = """
g (float[2, 3] x) => (float loss) <float[3, 3] w = {1., 2., 3., 4., 5., 6., 7., 8., 9.}> {
  wt = Transpose(w)
  y = MatMul(x, wt)
  c0 = Constant<value = int64[1] {0}>()
  c1 = Constant<value = int64[1] {-1}>()
  shape = Concat<axis = 0>(c0, c1)
  r = Reshape(y, shape)
  k = Constant<value = float[3] {1., 2., 3.}>()
  k2 = Mul(k, k)
  p = Mul(r, k2)
  loss = ReduceSum<keepdims=0>(p)
}"""


def test_folds_constant_nodes_never_initializers() -> None:
    check = assert_pass_preserves(_proto(FOLDING), CleanupPass, feeds=X)
    ops = _ops(check.transformed)
    assert ops["Transpose"] == 1 and ops["Concat"] == 0 and ops["Mul"] == 1
    assert [t.name for t in check.transformed.graph.initializer] == ["w"]
    assert "w_grad" in check.compared


def test_fold_size_cap() -> None:
    check = assert_pass_preserves(_proto(FOLDING), lambda: _cleanup(fold_max_elements=2), feeds=X)
    ops = _ops(check.transformed)
    assert ops["Concat"] == 0 and ops["Mul"] == 2  # the shape (2 elements) folds, k*k (3) stays


def test_folded_node_keeps_its_marks() -> None:
    marks = {"sq": {STAGE_KEY: Role.OPTIMIZER.value}}
    model = _marked("""
g (float[2, 3] x) => (float[2, 3] y) {
  k = Constant<value = float[3] {1., 2., 3.}>()
  [sq] k2 = Mul(k, k)
  y = Mul(x, k2)
}""", marks)
    check = assert_pass_preserves(model, CleanupPass, check_gradients=False, feeds=X)
    const = next(n for n in check.transformed.graph.node if n.op_type == "Constant")
    assert {p.key: p.value for p in const.metadata_props} == marks["sq"]


UNUSED_WEIGHT = """
g (float[2, 3] x) => (float loss) <float[3] w = {0.5, -1., 2.}, float[3] v = {1., 2., 3.}> {
  a = Mul(x, w)
  dead = Mul(x, v)
  loss = ReduceSum<keepdims=0>(a)
}"""


def test_unused_initializers_are_kept_unless_asked() -> None:
    check = assert_pass_preserves(_proto(UNUSED_WEIGHT), CleanupPass, feeds=X)
    assert check.modified and _ops(check.transformed)["Mul"] == 1
    assert [t.name for t in check.transformed.graph.initializer] == ["w", "v"]
    dropped = assert_pass_preserves(_proto(UNUSED_WEIGHT),
                                    lambda: _cleanup(remove_unused_initializers=True), feeds=X)
    assert [t.name for t in dropped.transformed.graph.initializer] == ["w"]


def test_disabled_steps_do_nothing() -> None:
    off = {"fold_constants": False, "remove_identities": False,
           "merge_common_subexpressions": False, "remove_dead_code": False}
    transformed, modified = apply_pass(_proto(FOLDING), lambda: _cleanup(**off))
    assert not modified and _ops(transformed) == _ops(_proto(FOLDING))


_SETTINGS = settings(max_examples=25, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(random_models(), st.integers(0, 2**16))
def test_cleanup_preserves_drawn_models(model: onnx.ModelProto, seed: int) -> None:
    assert_pass_preserves(model, CleanupPass, feeds=feeds(model, seed), rtol=1e-6, atol=1e-6)


@_SETTINGS
@given(random_models(opset=20))
def test_cleanup_preserves_drawn_models_in_training_mode(model: onnx.ModelProto) -> None:
    check = assert_pass_preserves(model, CleanupPass, feeds=feeds(model, 1, training=True))
    if has_random_ops(model):  # live training-mode Dropouts are random: none merged or removed
        assert _live_ops(check.transformed)["Dropout"] == _live_ops(model)["Dropout"]


def _live_ops(proto: onnx.ModelProto) -> collections.Counter[str]:
    """Op counts of the nodes some graph output depends on."""
    live = {o.name for o in proto.graph.output}
    ops: collections.Counter[str] = collections.Counter()
    for node in reversed(proto.graph.node):
        if any(o in live for o in node.output):
            ops[node.op_type] += 1
            live.update(node.input)
    return ops


@_SETTINGS
@given(random_models())
def test_cleanup_preserves_drawn_gradient_graphs(model: onnx.ModelProto) -> None:
    check = assert_pass_preserves(model, CleanupPass, feeds=feeds(model, 2),
                                  on_gradient_graph=True)
    assert any(name.endswith("_grad") for name in check.compared)
    run_model(check.transformed, feeds(model, 2))


class _AddToSub(InPlacePass):
    """A wrong pass (turns Add into Sub), and one that always claims a change: the harness must
    reject both."""

    def __init__(self, always_modified: bool = False) -> None:
        super().__init__()
        self.always_modified = always_modified

    def call(self, model: ir.Model) -> PassResult:
        changed = False
        for node in model.graph:
            if node.op_type == "Add" and not self.always_modified:
                node.op_type, changed = "Sub", True
        return PassResult(model, changed or self.always_modified)


def test_the_harness_rejects_wrong_and_untruthful_passes() -> None:
    model = _proto("""
g (float[2, 3] x) => (float loss) <float[3] w = {0.5, -1., 2.}> {
  a = Add(x, w)
  loss = ReduceSum<keepdims=0>(a)
}""")
    with pytest.raises(AssertionError, match="loss"):
        assert_pass_preserves(model, _AddToSub, feeds=X)
    with pytest.raises(AssertionError, match="second run"):
        assert_pass_preserves(model, lambda: _AddToSub(always_modified=True), feeds=X)


def test_dropout_mask_outputs_survive_dead_code_removal() -> None:
    """The mask of a training Dropout is read by its gradient, not by the forward: kept."""
    model = ir.from_onnx_text("""<ir_version: 9, opset_import: ["" : 18]>
g (float[4] x, bool t) => (float[4] y) {
 r = Constant <value = float {0.5}> ()
 y, m = Dropout (x, r, t)
}""")
    assert not CleanupPass()(model).modified
    dropout = next(n for n in model.graph if n.op_type == "Dropout")
    assert len(dropout.outputs) == 2 and dropout.outputs[1].name == "m"
