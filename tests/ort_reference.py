"""Shared helpers of the onnxruntime-training reference tests (``test_ort_training*.py``).

The training build ships a module named ``onnxruntime`` too, so it runs in a subprocess:
``tools/ort_training_worker.py`` under the python of the reference venv made by
``tools/setup_ort_training.sh`` (default ``.venv-ort-training`` in the repo root, or
``$GRADGRAPH_ORT_TRAINING_VENV``). The tests are skipped, with the reason, when it does not exist.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from gradgraph.runtime.compat import ORT_1_19_MAX_IR_VERSION, ORT_1_19_MAX_OPSET, default_opset

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tools" / "ort_training_worker.py"
VENV = Path(os.environ.get("GRADGRAPH_ORT_TRAINING_VENV") or REPO / ".venv-ort-training")
VENV_PYTHON = VENV / "bin" / "python"

# Same graph, two onnxruntime versions (1.19.2 training build vs. stock), same session options.
RUNTIME_RTOL, RUNTIME_ATOL = 1e-5, 1e-6
# Our graph vs. the reference builder's graph (fused MS kernels such as SoftmaxGrad/GeluGrad vs.
# our standard-op expressions, different op order; float32).
REFERENCE_RTOL, REFERENCE_ATOL = 1e-4, 1e-5

# A test module's ``pytestmark``: skipped, with the reason, without the reference venv.
MARKS = [
    pytest.mark.ort_training,
    pytest.mark.skipif(
        not VENV_PYTHON.is_file(),
        reason=f"onnxruntime-training reference venv {VENV} does not exist "
               "(create it with tools/setup_ort_training.sh)"),
]


@pytest.fixture(scope="module")
def venv_ok():
    """The reference venv (which exists: see ``needs_venv``) has the training build's builder."""
    proc = subprocess.run([str(VENV_PYTHON), "-c", "import sys; sys.modules['torch'] = None; "
                           "import onnxruntime; "
                           "from onnxruntime.capi import _pybind_state as C; "
                           "sys.exit(0 if hasattr(C, 'GradientGraphBuilder') else 3)"],
                          capture_output=True, text=True, timeout=300)
    # The venv exists, so it must work: a broken one is an error, not a skip.
    assert proc.returncode == 0, (
        f"{VENV} exists but is not a working onnxruntime-training venv "
        f"(re-run tools/setup_ort_training.sh):\n{proc.stderr[-2000:]}")
    return True


def stock_run(model: onnx.ModelProto, names: list[str], feeds: dict, *,
              drop_unknown_feeds: bool = False) -> dict[str, np.ndarray]:
    """``names`` computed by stock onnxruntime (with ``drop_unknown_feeds``, the feeds that are
    not inputs of ``model`` are left out rather than refused)."""
    opts = ort.SessionOptions()  # the worker's options: one thread, no graph optimizations
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    if drop_unknown_feeds:
        known = {i.name for i in sess.get_inputs()}
        feeds = {k: v for k, v in feeds.items() if k in known}
    return dict(zip(names, sess.run(names, feeds)))


def run_worker(tmp: Path, *args: str) -> tuple[dict, dict[str, np.ndarray]]:
    """Run ``tools/ort_training_worker.py *args`` in the reference venv: (its report, arrays)."""
    out = tmp / f"out_{args[0]}.npz"
    proc = subprocess.run([str(VENV_PYTHON), str(WORKER), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, f"worker crashed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    arrays = {}
    if report.get("ok"):
        with np.load(out) as data:
            arrays = {k: data[k] for k in data.files}
    return report, arrays


def assert_for_ort_1_19(ours: onnx.ModelProto) -> None:
    """Our gradient graph is one that ORT 1.19 reads: IR <= 10, opset <= 21, standard ops only."""
    assert ours.ir_version <= ORT_1_19_MAX_IR_VERSION
    assert default_opset(ours) <= ORT_1_19_MAX_OPSET
    assert all(n.domain in ("", "ai.onnx") for n in ours.graph.node), "non-standard op emitted"


def run_on_both_runtimes(ours: onnx.ModelProto, names: list[str], feeds: dict, tmp: Path, *,
                         drop_unknown_feeds: bool = False
                         ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``names`` of ``ours`` on stock onnxruntime (all finite) and on the training build 1.19.2.

    ``ours`` and ``feeds`` are left in ``tmp`` as ``ours.onnx`` and ``inputs.npz``.
    """
    stock = stock_run(ours, names, feeds, drop_unknown_feeds=drop_unknown_feeds)
    for name in names:
        assert np.all(np.isfinite(stock[name])), name

    model_path, inputs_path = tmp / "ours.onnx", tmp / "inputs.npz"
    onnx.save(ours, model_path)
    np.savez(inputs_path, **feeds)

    report, train_build = run_worker(tmp, "run", "--model", str(model_path),
                                     "--inputs", str(inputs_path), "--outputs", ",".join(names))
    assert report["ok"], f"the training build cannot run our gradient graph: {report}"
    assert report["onnxruntime"] == "1.19.2"
    return stock, train_build


def tolerance_used(got: dict, want: dict, names: list[str], rtol: float, atol: float) -> float:
    """max |got - want| / (atol + rtol |want|) over all names: <= 1 means within tolerance."""
    return max(float(np.max(np.abs(got[n].astype(np.float64) - want[n])
                            / (atol + rtol * np.abs(want[n].astype(np.float64))), initial=0.0))
               for n in names)


def assert_close(got: dict, want: dict, names: list[str], rtol: float, atol: float, what: str):
    for name in names:
        assert got[name].shape == want[name].shape, (what, name, got[name].shape, want[name].shape)
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol,
                                   err_msg=f"{what}: {name}")


# Optional outputs that the reference gradient builders read (GradientBuilderBase::O(i)); ORT
# adds them in pre-gradient rewrites that its pybind GradientGraphBuilder does not run.
OPTIONAL_OUTPUTS_READ = {"LayerNormalization": (3, "Mean/InvStdDev"),
                         "SoftmaxCrossEntropyLoss": (2, "log_prob"),
                         "MaxPool": (2, "Indices"),
                         "Dropout": (2, "mask")}


def why_reference_fails(forward: onnx.ModelProto, summary: str) -> str:
    """Why the reference builder refused ``forward`` (empty when no known cause applies)."""
    if "GradientBuilderBase::O" in summary:
        absent = sorted({f"{n.op_type} {OPTIONAL_OUTPUTS_READ[n.op_type][1]}"
                         for n in forward.graph.node if n.op_type in OPTIONAL_OUTPUTS_READ
                         and len([o for o in n.output if o]) < OPTIONAL_OUTPUTS_READ[n.op_type][0]})
        return (f"its builders read optional outputs the export leaves out ({', '.join(absent)}); "
                "ORT adds them in pre-gradient rewrites the pybind builder does not run "
                "(cf. onnxruntime#19038)")
    if "unreachable from the output" in summary:
        seq_ops = sorted({n.op_type for n in forward.graph.node if "Sequence" in n.op_type})
        if seq_ops:
            return (f"the path to the loss goes through sequence values ({', '.join(seq_ops)}), "
                    "which ORT does not differentiate (non-tensor args are blocked)")
    found = re.search(r"has not been registered: (\w+)", summary)
    if found and found.group(1) == "BatchNormalization":
        if not any(a.name == "training_mode" and a.i for n in forward.graph.node
                   if n.op_type == "BatchNormalization" for a in n.attribute):
            return ("inference-mode BatchNormalization (running statistics): ORT's "
                    "BatchNormalizationGrad differentiates the batch-statistics form only")
        return ("ORT only differentiates its internal BatchNormInternal, which its "
                "BatchNormReplacement rewrite (not run by the pybind builder) substitutes")
    if found and found.group(1) == "LSTM":
        return ("ORT only differentiates its internal LSTMTraining, which its LSTMReplacement "
                "rewrite (not run by the pybind builder) substitutes")
    if found:
        return f"onnxruntime-training has no gradient builder for {found.group(1)}"
    return ""
