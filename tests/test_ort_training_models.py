"""Real models: our gradient graphs on onnxruntime-training 1.19.2, and against its own builder.

Check (e) of ``test_ort_training.py`` on the ``model_zoo`` models, with the legacy exporter in
``train_p0`` mode and the dynamo exporter in ``eval`` mode. Needs the reference venv made by
``tools/setup_ort_training.sh`` (default ``.venv-ort-training``, or
``$GRADGRAPH_ORT_TRAINING_VENV``); skipped, with the reason, when it does not exist. The training
build ships a module named ``onnxruntime`` too, so it runs in ``tools/ort_training_worker.py``
under that venv's python.

For each model:
1. build our gradient graph for every mapped parameter, targeted at ORT 1.19 (IR <= 10,
   opset <= 21); a model that cannot be lowered is skipped with the op that stops it;
2. run it on stock onnxruntime in-process and on the training build via the worker, on the
   model's fixed batch: the gradients must agree to rtol 1e-5, atol 1e-6 (same graph, same
   options -- one thread, no graph optimizations -- on two onnxruntime versions);
3. run the training build's own GradientGraphBuilder on the same forward model (lowered exactly
   as our builder saw it): where it succeeds, its gradients must agree with ours to rtol 1e-4,
   atol 1e-5 (different graphs and kernels in float32); where it fails, the reason is recorded;
4. where it fails, run it again after the pre-gradient rewrites that ORT's training pipelines
   run before it and its pybind entry point does not (optional outputs its builders read added,
   BatchNormalization -> BatchNormInternal, LSTM -> LSTMTraining; the values computed do not
   change), and hold its gradients to the same tolerance where it then succeeds.
A summary table (model/exporter/mode -> these results) is printed at the end of the module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import model_zoo as zoo  # noqa: E402 - imports torch
import ort_reference as ortref  # noqa: E402

from gradgraph import build_gradient_graph  # noqa: E402
from gradgraph.runtime.compat import (  # noqa: E402
    ORT_1_19_MAX_IR_VERSION,
    ORT_1_19_MAX_OPSET,
    for_runtime,
)
from passes.autodiff import GradientError  # noqa: E402

# The shared fixture, bound here so that pytest finds it for this module.
venv_ok = ortref.venv_ok

pytestmark = [*ortref.MARKS, pytest.mark.slow]

CASES = ([(m, "legacy", "train_p0") for m in zoo.MODELS]
         + [(m, "dynamo", "eval") for m in zoo.MODELS])
IDS = [f"{m}-{e}-{mode}" for m, e, mode in CASES]


@dataclass(frozen=True)
class Exported:
    forward: onnx.ModelProto
    loss: str
    weights: tuple[str, ...]          # ONNX initializers mapped to torch parameters
    feeds: dict[str, np.ndarray]      # the model's fixed batch


class _Exports:
    """One export per (model, exporter, mode), shared by the tests of a session."""

    def __init__(self, root: Path):
        self.root = root
        self.done: dict[tuple[str, str, str], Exported] = {}

    def get(self, model: str, exporter: str, mode: str) -> Exported:
        key = (model, exporter, mode)
        if key not in self.done:
            import torch

            torch.set_num_threads(2)
            path, loss, mapping = zoo.export(model, exporter, mode,
                                             str(self.root / f"{model}_{exporter}_{mode}.onnx"))
            forward = onnx.load(path)
            _, batch, names = zoo.build(model, mode)
            known = {i.name for i in forward.graph.input}
            feeds = {n: t.numpy() for n, t in zip(names, batch) if n in known}
            self.done[key] = Exported(forward, loss, tuple(sorted(mapping)), feeds)
        return self.done[key]


@pytest.fixture(scope="session")
def zoo_exports(tmp_path_factory) -> _Exports:
    return _Exports(tmp_path_factory.mktemp("ort_training_zoo"))


def _ort_pre_gradient_rewrites(forward: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """``forward`` as ORT's pre-gradient rewrites leave it (same values computed), and their names.

    1. the optional outputs of ``ortref.OPTIONAL_OUTPUTS_READ`` are added (InsertMaxPoolOutput,
       InsertSoftmaxCrossEntropyLossOutput; LayerNormalization's and Dropout's likewise);
    2. training-mode BatchNormalization becomes ``com.microsoft`` BatchNormInternal, with its
       saved mean/inv-std outputs (BatchNormReplacement); inference-mode ones are kept, as
       BatchNormalizationGrad differentiates the batch-statistics form only;
    3. LSTM becomes ``com.microsoft`` LSTMTraining with 5 outputs (LSTMReplacement); the
       default-valued ``layout``/``input_forget`` attributes it does not know are dropped.
    """
    model = onnx.ModelProto()
    model.CopyFrom(forward)
    taken = {v for n in model.graph.node for v in (*n.input, *n.output)}
    applied: set[str] = set()

    def pad(node: onnx.NodeProto, count: int) -> None:
        while node.output and node.output[-1] == "":
            del node.output[-1]
        while len(node.output) < count:
            name = f"{node.output[0]}_ort_output_{len(node.output)}"
            assert name not in taken, name
            node.output.append(name)

    for node in model.graph.node:
        want = ortref.OPTIONAL_OUTPUTS_READ.get(node.op_type, (0, ""))[0]
        if len([o for o in node.output if o]) < want:
            pad(node, want)
            applied.add(f"{node.op_type} {ortref.OPTIONAL_OUTPUTS_READ[node.op_type][1]} added")
        training = next((a.i for a in node.attribute if a.name == "training_mode"), 0)
        if node.op_type == "BatchNormalization" and training:
            node.op_type, node.domain = "BatchNormInternal", "com.microsoft"
            pad(node, 5)
            applied.add("BatchNormalization -> BatchNormInternal")
        if node.op_type == "LSTM":
            attrs = [a for a in node.attribute
                     if not (a.name in ("layout", "input_forget") and a.i == 0)]
            del node.attribute[:]
            node.attribute.extend(attrs)
            node.op_type, node.domain = "LSTMTraining", "com.microsoft"
            pad(node, 5)
            applied.add("LSTM -> LSTMTraining")
    if any(n.domain == "com.microsoft" for n in model.graph.node) and not any(
            o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return model, sorted(applied)


def _reference(tmp: Path, name: str, forward: onnx.ModelProto, exp: Exported, names: list[str],
               stock: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray] | None, str]:
    """Run the reference builder on ``forward``: (its outputs or None where it fails, result)."""
    fwd_path = tmp / f"{name}.onnx"
    onnx.save(forward, fwd_path)
    report, ref = ortref.run_worker(tmp, "reference-grad", "--model", str(fwd_path),
                                    "--inputs", str(tmp / "inputs.npz"), "--loss", exp.loss,
                                    "--x", ",".join(exp.weights))
    if not report["ok"]:
        # Without the C++ source location and signature the worker leaves on pybind errors.
        summary = re.sub(r"^.*\[ONNXRuntimeError\] : \d+ : ", "",
                         report.get("summary") or report["error"])
        why = ortref.why_reference_fails(forward, summary)
        return None, f"fails ({report['stage']}): {summary}" + (f" -- {why}" if why else "")
    used = ortref.tolerance_used(ref, stock, names, ortref.REFERENCE_RTOL, ortref.REFERENCE_ATOL)
    MS_KERNELS.update(op.split("::")[1] for op in report.get("ops", []) if "::" in op)
    return ref, f"{'ok, agrees' if used <= 1 else 'DISAGREES'} ({used:.0%} of tol)"


# (model, exporter, mode) -> (ours on the reference runtime, reference builder, reference builder
# after ORT's pre-gradient rewrites); printed at the end.
RESULTS: dict[tuple[str, str, str], tuple[str, str, str]] = {}
MS_KERNELS: set[str] = set()  # com.microsoft ops in the reference graphs that built


@pytest.mark.parametrize(("model", "exporter", "mode"), CASES, ids=IDS)
def test_real_model_on_training_build(zoo_exports, venv_ok, tmp_path, model, exporter, mode):
    key = (model, exporter, mode)
    exp = zoo_exports.get(*key)
    try:
        ours = build_gradient_graph(exp.forward, exp.loss, exp.weights, allow_unused=True,
                                    target_ir_version=ORT_1_19_MAX_IR_VERSION,
                                    max_opset=ORT_1_19_MAX_OPSET)
    except GradientError as exc:
        if "cannot lower" not in str(exc):
            raise
        RESULTS[key] = (f"skipped: {exc}", "not run", "not run")
        pytest.skip(f"our gradient graph cannot be lowered to ORT 1.19: {exc}")
    ortref.assert_for_ort_1_19(ours)

    names = [exp.loss, *[f"{w}_grad" for w in exp.weights]]
    # (1) Our graph on the onnxruntime-training build == our graph on stock onnxruntime.
    stock, train_build = ortref.run_on_both_runtimes(ours, names, exp.feeds, tmp_path)
    used = ortref.tolerance_used(train_build, stock, names, ortref.RUNTIME_RTOL,
                                 ortref.RUNTIME_ATOL)
    ours_result = f"{'ok' if used <= 1 else 'DIFFERS'}, {len(names) - 1} grads ({used:.0%} of tol)"
    RESULTS[key] = (ours_result, "not run", "not run")
    ortref.assert_close(train_build, stock, names, ortref.RUNTIME_RTOL, ortref.RUNTIME_ATOL,
                        "ours on onnxruntime-training 1.19.2 vs ours on stock onnxruntime")

    # (2) The training build's own GradientGraphBuilder on the same forward model, lowered to
    #     what ORT 1.19 reads exactly as our builder saw it, for the same weights.
    forward = for_runtime(exp.forward)
    ref, plain = _reference(tmp_path, "forward", forward, exp, names, stock)
    RESULTS[key] = (ours_result, plain, "-")
    if ref is not None:
        ortref.assert_close(ref, stock, names, ortref.REFERENCE_RTOL, ortref.REFERENCE_ATOL,
                            "reference GradientGraphBuilder vs ours")
        return
    # (3) Again after ORT's own pre-gradient rewrites, which its pybind builder does not run
    #     (the forward values do not change: the loss is compared too).
    prepared, applied = _ort_pre_gradient_rewrites(forward)
    if not applied:
        return
    ref, after = _reference(tmp_path, "forward_ort_rewritten", prepared, exp, names, stock)
    RESULTS[key] = (ours_result, plain, f"{after} [{'; '.join(applied)}]")
    if ref is not None:
        ortref.assert_close(ref, stock, names, ortref.REFERENCE_RTOL, ortref.REFERENCE_ATOL,
                            f"reference GradientGraphBuilder after {applied} vs ours")


def test_summary_table(venv_ok, capsys):
    """Print the per-model results (runs after the parametrized test; shown without -s too)."""
    header = ("model/exporter/mode", "ours on ORT-training 1.19.2", "reference builder",
              "reference builder after ORT's pre-gradient rewrites")
    rows = [header, *[("/".join(key), *RESULTS[key]) for key in CASES if key in RESULTS]]
    short = [(r[0], r[1], _short(r[2]), _short(r[3])) for r in rows]
    widths = [max(len(r[i]) for r in short) for i in range(3)]
    lines = [" | ".join(f"{c:<{w}}" for c, w in zip(r, widths)) + f" | {r[3]}" for r in short]
    lines.insert(1, "-" * max(len(line) for line in lines))
    # One line per distinct reason: without the rewrites applied and the x it names.
    reasons = sorted({re.sub(r"'[^']*'", "'<x>'", re.sub(r" \[[^\]]*\]$", "", r))
                      for row in rows[1:] for r in row[2:] if r.startswith("fails")})
    notes = [f"  [{_short(r)}] {r}" for r in reasons]
    with capsys.disabled():
        print("\n\nReal models on onnxruntime-training 1.19.2:\n" + "\n".join(lines)
              + ("\nReference builder failures:\n" + "\n".join(notes) if notes else "")
              + (f"\nMS kernels in the reference graphs compared: {', '.join(sorted(MS_KERNELS))}"
                 if MS_KERNELS else ""))
    if len(rows) == 1:
        pytest.skip("no model was run (run the whole file)")


def _short(result: str) -> str:
    """A result line without its failure detail (listed once under the table)."""
    if not result.startswith("fails"):
        return result
    for key, label in (("GradientBuilderBase::O", "optional outputs absent"),
                       ("has not been registered", "no builder: "),
                       ("sequence values", "sequence values on the path"),
                       ("unreachable", "x unreachable")):
        if key in result:
            if label.endswith(": "):
                found = re.search(r"has not been registered: (\w+)", result)
                label += found.group(1) if found else "?"
            return f"fails: {label}"
    return f"fails: {result[6:60]}"
