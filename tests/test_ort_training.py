"""Our gradient graphs on the onnxruntime-training build, and against its own GradientGraphBuilder.

Needs the reference venv made by ``tools/setup_ort_training.sh`` (default ``.venv-ort-training``
in the repo root, or ``$GRADGRAPH_ORT_TRAINING_VENV``); every test here is skipped, with the
reason, when it does not exist. The training build ships a module named ``onnxruntime`` too, so
it runs in a subprocess: ``tools/ort_training_worker.py`` under that venv's python.

For each model:
1. build our gradient graph targeted at ORT 1.19 (IR <= 10, opset <= 21);
2. run it on stock onnxruntime in-process and on the training build via the worker: the
   gradients must match to rtol 1e-5, atol 1e-6 (same graph, two runtimes);
3. run the training build's own GradientGraphBuilder on the same forward model; where it
   succeeds its gradients must agree with ours to rtol 1e-4, atol 1e-5 (different graphs:
   fused MS kernels such as SoftmaxGrad/GeluGrad vs. our standard-op expressions, so
   float32 rounding differs); where it fails the failure is recorded and printed.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import ort_reference as ortref
import pytest

from gradgraph import build_gradient_graph
from gradgraph.runtime.compat import (
    ORT_1_19_MAX_IR_VERSION,
    ORT_1_19_MAX_OPSET,
    default_opset,
    for_runtime,
)
from passes.autodiff.registry import lookup

# The shared fixture, bound here so that pytest finds it for this module.
venv_ok = ortref.venv_ok

pytestmark = ortref.MARKS


# ---------------------------------------------------------------------------- fixtures
@dataclass(frozen=True)
class Case:
    name: str
    text: str                  # ONNX text; the trained weights are declared as graph inputs
    weights: tuple[str, ...]   # become random initializers, trained
    frozen: dict               # name -> numpy array: become initializers, not trained
    extra_x: tuple[str, ...] = ()   # graph inputs also differentiated for
    needs_rules: tuple[str, ...] = ()
    loss: str = "loss"
    reference_builds: bool = False  # written so that the reference builder must take it


def _bn_stats(c: int) -> dict:
    rng = np.random.default_rng(7)
    return {"bn_mean": rng.standard_normal(c).astype(np.float32) * 0.1,
            "bn_var": (rng.random(c).astype(np.float32) + 0.5)}


_MLP_BODY = """
  h1 = Gemm<transB=1>(x, W1, b1)
  r1 = Relu(h1)
  h2 = MatMul(r1, W2)
  logits = Add(h2, b2)
"""

_BLOCK_BODY = """
  {ln1}
  q = MatMul(n1, Wq)
  k = MatMul(n1, Wk)
  v = MatMul(n1, Wv)
  kt = Transpose<perm=[0,2,1]>(k)
  s = MatMul(q, kt)
  scale = Constant<value=float {0.35355339}>()
  ss = Mul(s, scale)
  p = Softmax<axis=-1>(ss)
  a = MatMul(p, v)
  o = MatMul(a, Wo)
  res = Add(x, o)
  {ln2}
  f1 = MatMul(n2, W1)
  f1b = Add(f1, b1)
  g = Gelu(f1b)
  f2 = MatMul(g, W2)
  out = Add(res, f2)
  sq = Mul(out, out)
  loss = ReduceMean<keepdims=0>(sq)
"""

def _block_body(ln1: str, ln2: str) -> str:
    return _BLOCK_BODY.replace("{ln1}", ln1).replace("{ln2}", ln2)


_BLOCK_SIG = """(float[2,4,8] x, float[8] ln1_g, float[8] ln1_b, float[8] ln2_g, float[8] ln2_b,
       float[8,8] Wq, float[8,8] Wk, float[8,8] Wv, float[8,8] Wo,
       float[8,16] W1, float[16] b1, float[16,8] W2) => (float loss)"""
_BLOCK_W = ("ln1_g", "ln1_b", "ln2_g", "ln2_b", "Wq", "Wk", "Wv", "Wo", "W1", "b1", "W2")

_CNN_SIG = """(float[2,3,8,8] x, int64[2] labels, float[4,3,3,3] Wc, float[4] bc, float[4] bn_g,
       float[4] bn_b, float[64,5] Wf, float[5] bf) => (float loss)"""
_CNN_BODY = """
  c = Conv<pads=[1,1,1,1], kernel_shape=[3,3]>(x, Wc, bc)
  bn = BatchNormalization<epsilon=0.00001>(c, bn_g, bn_b, bn_mean, bn_var)
  r = Relu(bn)
  mp = MaxPool<kernel_shape=[2,2], strides=[2,2]>(r)
  fl = Flatten<axis=1>(mp)
  logits = Gemm(fl, Wf, bf)
  loss = SoftmaxCrossEntropyLoss<reduction="mean">(logits, labels)
"""

CASES = [
    # MLP, written at opset 23 / IR 11: the builder lowers it to opset 21 / IR 10 for ORT 1.19.
    Case("mlp", f"""<ir_version: 11, opset_import: ["" : 23]>
mlp (float[4,6] x, int64[4] labels, float[8,6] W1, float[8] b1, float[8,5] W2, float[5] b2)
    => (float loss) {{{_MLP_BODY}
  loss = SoftmaxCrossEntropyLoss<reduction="mean">(logits, labels)
}}""", ("W1", "b1", "W2", "b2"), {}),
    # The same MLP with the loss's optional log_prob output present (the reference builder's
    # SoftmaxCrossEntropyLoss gradient reads it), and the input x differentiated too.
    Case("mlp_logprob", f"""<ir_version: 10, opset_import: ["" : 21]>
mlp (float[4,6] x, int64[4] labels, float[8,6] W1, float[8] b1, float[8,5] W2, float[5] b2)
    => (float loss) {{{_MLP_BODY}
  loss, log_prob = SoftmaxCrossEntropyLoss<reduction="mean">(logits, labels)
}}""", ("W1", "b1", "W2", "b2"), {}, extra_x=("x",), reference_builds=True),
    # The MLP with the cross-entropy spelled out: Softmax, Log, one-hot weights, ReduceSum/Mean.
    Case("mlp_softmax_log", f"""<ir_version: 8, opset_import: ["" : 17]>
mlp (float[4,6] x, float[4,5] onehot, float[8,6] W1, float[8] b1, float[8,5] W2, float[5] b2)
    => (float loss) {{{_MLP_BODY}
  p = Softmax<axis=1>(logits)
  lp = Log(p)
  t = Mul(lp, onehot)
  ax = Constant<value=int64[1] {{1}}>()
  s = ReduceSum<keepdims=0>(t, ax)
  ns = Neg(s)
  loss = ReduceMean<keepdims=0>(ns)
}}""", ("W1", "b1", "W2", "b2"), {}, reference_builds=True),
    # Pre-LN transformer block: LayerNormalization (single output, as exporters write it),
    # single-head attention with Softmax, Gelu MLP, residuals, mean-square loss.
    Case("transformer_block", f"""<ir_version: 10, opset_import: ["" : 21]>
block {_BLOCK_SIG} {{{_block_body(
    "n1 = LayerNormalization<axis=-1, epsilon=0.00001>(x, ln1_g, ln1_b)",
    "n2 = LayerNormalization<axis=-1, epsilon=0.00001>(res, ln2_g, ln2_b)")}}}""", _BLOCK_W, {}, extra_x=("x",)),
    # The same block with LayerNormalization's optional Mean/InvStdDev outputs present.
    Case("transformer_block_ln_stats", f"""<ir_version: 10, opset_import: ["" : 21]>
block {_BLOCK_SIG} {{{_block_body(
    "n1, m1, is1 = LayerNormalization<axis=-1, epsilon=0.00001>(x, ln1_g, ln1_b)",
    "n2, m2, is2 = LayerNormalization<axis=-1, epsilon=0.00001>(res, ln2_g, ln2_b)")}}}""", _BLOCK_W, {},
         extra_x=("x",), reference_builds=True),
    # Small CNN: Conv, BatchNormalization (inference form, running stats frozen), MaxPool.
    Case("cnn", f"""<ir_version: 10, opset_import: ["" : 21]>
cnn {_CNN_SIG} {{{_CNN_BODY}}}""", ("Wc", "bc", "bn_g", "bn_b", "Wf", "bf"), _bn_stats(4),
         needs_rules=("Conv", "MaxPool", "BatchNormalization")),
    # A CNN the reference builder can take: no BatchNormalization (it only has a builder for its
    # internal BatchNormInternal), MaxPool's Indices and the loss's log_prob present.
    Case("cnn_indices", """<ir_version: 10, opset_import: ["" : 21]>
cnn (float[2,3,8,8] x, int64[2] labels, float[4,3,3,3] Wc, float[4] bc, float[64,5] Wf,
     float[5] bf) => (float loss) {
  c = Conv<pads=[1,1,1,1], kernel_shape=[3,3]>(x, Wc, bc)
  r = Relu(c)
  mp, idx = MaxPool<kernel_shape=[2,2], strides=[2,2]>(r)
  fl = Flatten<axis=1>(mp)
  logits = Gemm(fl, Wf, bf)
  loss, log_prob = SoftmaxCrossEntropyLoss<reduction="mean">(logits, labels)
}""", ("Wc", "bc", "Wf", "bf"), {}, extra_x=("x",), needs_rules=("Conv", "MaxPool"),
         reference_builds=True),
]

def _make_model(case: Case) -> onnx.ModelProto:
    """Parse the text; the declared weights become random initializers (fixed seed)."""
    model = onnx.parser.parse_model(case.text)
    rng = np.random.default_rng(1234)
    graph = model.graph
    inputs = list(graph.input)
    del graph.input[:]
    for inp in inputs:
        if inp.name in case.weights:
            shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
            scale = 1.0 if len(shape) == 1 else 1.0 / np.sqrt(shape[-1])
            value = (rng.standard_normal(shape) * scale).astype(np.float32)
            if inp.name.endswith("_g"):
                value = 1.0 + 0.1 * value
            graph.initializer.append(onnx.numpy_helper.from_array(value, inp.name))
        else:
            graph.input.append(inp)
    for name, value in case.frozen.items():
        graph.initializer.append(onnx.numpy_helper.from_array(value, name))
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for inp in model.graph.input:
        shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
        if inp.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            feeds[inp.name] = rng.integers(0, 5, size=shape).astype(np.int64)
        elif inp.name == "onehot":
            feeds[inp.name] = np.eye(shape[1], dtype=np.float32)[rng.integers(0, shape[1], shape[0])]
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


# Filled by the tests, printed at the end of the session (and asserted on in the last test).
REFERENCE_RESULTS: dict[str, str] = {}


def _missing_rules(case: Case, opset: int) -> list[str]:
    return [op for op in case.needs_rules if lookup("", op, opset) is None]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gradients_on_training_build(case: Case, tmp_path: Path, venv_ok):
    forward = _make_model(case)
    missing = _missing_rules(case, min(default_opset(forward), ORT_1_19_MAX_OPSET))
    if missing:
        REFERENCE_RESULTS[case.name] = f"not run: gradgraph has no rule for {missing} yet"
        pytest.skip(f"gradgraph has no gradient rule registered for {missing} yet")
    xs = [*case.weights, *case.extra_x]
    ours = build_gradient_graph(forward, case.loss, xs, target_ir_version=ORT_1_19_MAX_IR_VERSION,
                                max_opset=ORT_1_19_MAX_OPSET)
    ortref.assert_for_ort_1_19(ours)

    feeds = _feeds(forward)
    names = [case.loss, *[f"{x}_grad" for x in xs]]
    # (1) Our graph on the onnxruntime-training build == our graph on stock onnxruntime.
    stock, train_build = ortref.run_on_both_runtimes(ours, names, feeds, tmp_path,
                                                     drop_unknown_feeds=True)
    ortref.assert_close(train_build, stock, names, ortref.RUNTIME_RTOL, ortref.RUNTIME_ATOL,
                        "ours on onnxruntime-training 1.19.2 vs ours on stock onnxruntime")

    # (2) The training build's own GradientGraphBuilder on the same forward model (lowered to
    #     what ORT 1.19 reads, exactly as our builder saw it).
    fwd_path = tmp_path / "forward.onnx"
    onnx.save(for_runtime(forward), fwd_path)
    report, ref = ortref.run_worker(tmp_path, "reference-grad", "--model", str(fwd_path),
                                    "--inputs", str(tmp_path / "inputs.npz"), "--loss", case.loss,
                                    "--x", ",".join(xs),
                                    "--save-model", str(tmp_path / "reference_grad.onnx"))
    if not report["ok"]:
        why = ortref.why_reference_fails(forward, report.get("summary", ""))
        REFERENCE_RESULTS[case.name] = (f"reference builder fails ({report['stage']}): "
                                        f"{report.get('summary') or report['error']}"
                                        + (f" -- {why}" if why else ""))
        print(f"\n[{case.name}] {REFERENCE_RESULTS[case.name]}")
        assert not case.reference_builds, REFERENCE_RESULTS[case.name]
        return
    ortref.assert_close(ref, stock, names, ortref.REFERENCE_RTOL, ortref.REFERENCE_ATOL,
                        "reference GradientGraphBuilder vs ours")
    ms_ops = [op for op in report.get("ops", []) if "::" in op]
    used = ortref.tolerance_used(ref, stock, names, ortref.REFERENCE_RTOL, ortref.REFERENCE_ATOL)
    REFERENCE_RESULTS[case.name] = (f"reference builder succeeds, gradients agree "
                                    f"(using {used:.0%} of the tolerance; "
                                    f"it uses {', '.join(ms_ops) or 'standard ops only'})")
    print(f"\n[{case.name}] {REFERENCE_RESULTS[case.name]}")


def test_reference_builder_summary(venv_ok):
    """Print which models the reference builder handles (runs after the parametrized test)."""
    print("\nonnxruntime-training 1.19.2 GradientGraphBuilder, per model:")
    for name, result in REFERENCE_RESULTS.items():
        print(f"  {name}: {result}")
    ran = [n for n, r in REFERENCE_RESULTS.items() if not r.startswith("not run")]
    if not ran:
        pytest.skip("no model was compared (run the whole file)")
    # At least one model must actually be compared against the reference builder.
    assert any("succeeds" in REFERENCE_RESULTS[n] for n in ran), REFERENCE_RESULTS


def test_worker_imports_only_runtime_packages():
    """The worker runs in the reference venv: it must not import gradgraph (or passes)."""
    tree = ast.parse(ortref.WORKER.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    third_party = imported - set(sys.stdlib_module_names)
    assert third_party <= {"numpy", "onnx", "onnxruntime"}, third_party


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-s"]))
