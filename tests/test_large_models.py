"""Models over protobuf's 2 GB limit, end to end: grad, check, build --save-stages, train
(checkpoint, --resume, inference.onnx) and TrainingSession, each output loaded in onnxruntime, gradients
against a float64 numpy reference on a slice.

The model is built here from two large MatMul weights in external data (``x @ w1 -> tanh ->
@ w2 -> pred``; ``loss = mean((pred - y)**2)``). ``test_over_2gb_end_to_end`` (slow) uses two
1.1 GB weights (2.2 GB); ``test_external_data_paths_small`` takes the same paths on a small
model with ``GRADGRAPH_EXTERNAL_DATA_THRESHOLD`` lowered, so every run of the suite covers them.
Each command's peak RSS is measured (its VmHWM, Linux) and printed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

REPO = Path(__file__).resolve().parents[1]
BATCH = 2
LR = 0.5
# float32 gradients (sums of k and n products) against float64: relative to the slice's largest
RTOL = 2e-3


def _write_weight(f, rng: np.random.Generator, rows: int, cols: int, block: int = 512) -> None:
    """A (rows, cols) float32 weight, scaled 1/sqrt(rows), written block by block."""
    for start in range(0, rows, block):
        take = min(block, rows - start)
        w = rng.standard_normal((take, cols), dtype=np.float32) * np.float32(1 / np.sqrt(rows))
        f.write(w.tobytes())


def make_model(folder: Path, k: int, n: int, seed: int = 0, batch: str = "B", stem: str = "model") -> Path:
    """STEM.onnx + STEM.onnx.data: w1 [k, n] then w2 [n, k], float32; ``batch`` the batch dim."""
    b = batch
    text = f"""
    <ir_version: 10, opset_import: ["" : 18]>
    big (float[{b}, {k}] x, float[{b}, {k}] y) => (float[{b}, {k}] pred, float loss) {{
      h = MatMul(x, w1)
      a = Tanh(h)
      pred = MatMul(a, w2)
      d = Sub(pred, y)
      sq = Mul(d, d)
      loss = ReduceMean<keepdims=0>(sq)
    }}"""
    proto = onnx.parser.parse_model(text)
    rng = np.random.default_rng(seed)
    data = folder / f"{stem}.onnx.data"
    offset = 0
    with open(data, "wb") as f:
        for name, shape in (("w1", (k, n)), ("w2", (n, k))):
            _write_weight(f, rng, *shape)
            t = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=list(shape),
                                 data_location=onnx.TensorProto.EXTERNAL)
            nbytes = shape[0] * shape[1] * 4
            for key, value in (("location", data.name), ("offset", str(offset)), ("length", str(nbytes))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            offset += nbytes
            proto.graph.initializer.append(t)
    path = folder / f"{stem}.onnx"
    path.write_bytes(proto.SerializeToString())
    return path


def _weights(path: Path, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Memory maps of w1 and w2 in ``path``'s data file (a model file of make_model's layout)."""
    data = Path(str(path) + ".data")
    w1 = np.memmap(data, np.float32, "r", 0, (k, n))
    w2 = np.memmap(data, np.float32, "r", k * n * 4, (n, k))
    return w1, w2


def reference_gradients(w1: np.ndarray, w2: np.ndarray, x: np.ndarray, y: np.ndarray,
                        rows: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 numpy: d loss / d w1[:rows] and d loss / d w2[:rows], read in row blocks."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    block = 1024
    h = np.zeros((x.shape[0], w1.shape[1]))
    for s in range(0, w1.shape[0], block):
        h += x64[:, s:s + block] @ np.asarray(w1[s:s + block], np.float64)
    a = np.tanh(h)
    pred = np.zeros((x.shape[0], w2.shape[1]))
    for s in range(0, w2.shape[0], block):
        pred += a[:, s:s + block] @ np.asarray(w2[s:s + block], np.float64)
    dpred = 2 * (pred - y64) / pred.size
    da = np.zeros_like(a)
    for s in range(0, w2.shape[0], block):
        da[:, s:s + block] = dpred @ np.asarray(w2[s:s + block], np.float64).T
    dh = da * (1 - a * a)
    return x64[:, :rows].T @ dh, a[:, :rows].T @ dpred


def _close(got: np.ndarray, want: np.ndarray) -> None:
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale)


def _run(args: list[str], env: dict[str, str], cwd: Path) -> tuple[str, int]:
    """``python -m gradgraph ARGS``: its stderr+stdout and its peak RSS in bytes (must exit 0)."""
    return _run_process([sys.executable, "-m", "gradgraph", *args], env, cwd)


# Runs ``-m module args`` or ``script args`` and prints the process's own peak RSS at exit
# (VmHWM: a forked child's ru_maxrss also counts the parent's memory at the fork).
PEAK_WRAPPER = """
import atexit, runpy, sys
def report():
    with open("/proc/self/status") as f:
        kb = next(line.split()[1] for line in f if line.startswith("VmHWM"))
    sys.stderr.write(f"\\nPEAK_RSS_KB {kb}\\n")
atexit.register(report)
args = sys.argv[1:]
if args[0] == "-m":
    sys.argv = [args[1], *args[2:]]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")
"""


def _run_process(command: list[str], env: dict[str, str], cwd: Path) -> tuple[str, int]:
    args = command[1:]
    proc = subprocess.run([command[0], "-c", PEAK_WRAPPER, *args], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{out[-3000:]}"
    peaks = [int(line.split()[1]) for line in out.splitlines() if line.startswith("PEAK_RSS_KB ")]
    assert peaks, out[-2000:]
    return out, peaks[-1] * 1024


def _run_script(script: Path, args: list[str], env: dict[str, str], cwd: Path) -> tuple[str, int]:
    return _run_process([sys.executable, str(script), *args], env, cwd)


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def end_to_end(tmp: Path, k: int, n: int, env: dict[str, str]) -> dict[str, int]:
    """Every command on a model of make_model's layout; returns each one's peak RSS."""
    model = make_model(tmp, k, n)
    w1, w2 = _weights(model, k, n)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, k)).astype(np.float32)
    y = rng.standard_normal((BATCH, k)).astype(np.float32)
    np.savez(tmp / "data.npz", x=x, y=y)
    rows = 16
    ref1, ref2 = reference_gradients(w1, w2, x, y, rows)
    peaks = {}

    # grad: the gradient model with external data; its gradients against the reference
    _, peaks["grad"] = _run(["grad", str(model), "--loss", "loss", "-o", str(tmp / "grad.onnx")], env, tmp)
    assert (tmp / "grad.onnx.data").is_file()
    session = _session(tmp / "grad.onnx")
    names = [o.name for o in session.get_outputs() if o.name.endswith("_grad")]
    got = dict(zip(names, session.run(names, {"x": x, "y": y})))
    _close(got["w1_grad"][:rows], ref1)
    _close(got["w2_grad"][:rows], ref2)
    del session, got
    _remove(tmp / "grad.onnx", tmp / "grad.onnx.data")  # checked: its disk back

    # --list-weights
    listed, peaks["train --list-weights"] = _run(["train", str(model), "--loss", "loss", "--list-weights"],
                                                  env, tmp)
    assert "2 trained" in listed

    # check: the float64 oracle without a float64 copy of the weights (gradgraph.check.large)
    out, peaks["check"] = _run(["check", str(model), "--loss", "loss", "--max-elements", "4"], env, tmp)
    assert "oracle: float64 central differences in onnxruntime" in out, out
    assert "2 passed, 0 failed" in out, out  # w1 and w2, 4 entries each: gradients matched
    for name in ("w1", "w2"):
        row = next(line.split() for line in out.splitlines() if line.startswith(name + " "))
        assert row[1] == "4" and row[-1] == "ok", out

    # build --save-stages: every stage file loads in onnxruntime (those holding the weights
    # with external data)
    _, peaks["build"] = _run(["build", str(model), "--loss", "loss", "--optimizer", "sgd",
                              "--save-stages", str(tmp / "stages")], env, tmp)
    stages = sorted((tmp / "stages").glob("*.onnx"))
    assert len(stages) >= 5 and (tmp / "stages" / "00_forward.onnx.data").is_file()
    for stage in stages:
        _session(stage)
    _remove(tmp / "stages")  # checked: their disk back

    # train: 2 SGD steps, checkpoint, inference.onnx; then --resume to step 3
    ck = tmp / "ck"
    common = ["train", str(model), "--loss", "loss", "--data", str(tmp / "data.npz"), "--optimizer",
              "sgd", "--lr", str(LR), "--batch-size", str(BATCH), "--checkpoint-dir", str(ck), "--quiet"]
    _, peaks["train"] = _run([*common, "--steps", "1"], env, tmp)
    from safetensors.numpy import load_file

    first = load_file(str(ck / "checkpoint.safetensors"))
    _close(first["w1"][:rows], np.asarray(w1[:rows], np.float64) - LR * ref1)
    _close(first["w2"][:rows], np.asarray(w2[:rows], np.float64) - LR * ref2)
    del first
    _, peaks["train --resume"] = _run([*common, "--steps", "2", "--resume"], env, tmp)
    meta = json.loads(_safetensors_metadata(ck / "checkpoint.safetensors")["gradgraph"])
    assert meta["step"] == 2 and len(meta["user"]["losses"]) == 2
    infer = _session(ck / "inference.onnx")
    assert [i.name for i in infer.get_inputs()] == ["x"]  # the labels went with the loss
    assert [o.name for o in infer.get_outputs()] == ["pred"]
    assert (ck / "inference.onnx.data").is_file()
    assert np.isfinite(infer.run(None, {"x": x})[0]).all()
    del infer
    _remove(ck)

    # TrainingSession on the file (its own process, to measure it): one step's update
    script = tmp / "session.py"
    script.write_text(SESSION_SCRIPT)
    _, peaks["TrainingSession"] = _run_script(script, [str(model), str(tmp / "data.npz"),
                                                       str(tmp / "updated.npz"), str(rows)], env, tmp)
    updated = np.load(tmp / "updated.npz")
    _close(updated["w1"], np.asarray(w1[:rows], np.float64) - LR * ref1)
    _close(updated["w2"], np.asarray(w2[:rows], np.float64) - LR * ref2)
    return peaks


SESSION_SCRIPT = f"""
import sys
import numpy as np
from gradgraph import TrainingConfig, TrainingSession
from passes.optimizer import SGDConfig

model, data, out, rows = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
feeds = dict(np.load(data))
session = TrainingSession(model, TrainingConfig("loss", SGDConfig()), providers=["CPUExecutionProvider"])
session.train_step(feeds, lr={LR})
state = session.get_state_views()  # no copy of the state: the peak is the session's
np.savez(out, w1=state["w1"][:rows], w2=state["w2"][:rows])
"""


def _remove(*paths: Path) -> None:
    """Deletes outputs already checked (files, folders): the test's disk peak is then about five
    copies of the weights (the model and four stage files), not six."""
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _safetensors_metadata(path: Path) -> dict[str, str]:
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(length))["__metadata__"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def test_external_data_paths_small(tmp_path: Path) -> None:
    """The paths of a model over the threshold, on a small model (threshold lowered)."""
    env = _env(GRADGRAPH_EXTERNAL_DATA_THRESHOLD="10000")
    peaks = end_to_end(tmp_path, 96, 112, env)
    assert set(peaks) >= {"grad", "check", "build", "train", "train --resume"}
    # a fixed batch made dynamic for another --batch-size (make_batch_dynamic's IR path)
    fixed = make_model(tmp_path, 96, 112, batch="2", stem="fixed")
    out, _ = _run(["train", str(fixed), "--loss", "loss", "--data", str(tmp_path / "data.npz"), "--optimizer",
                   "sgd", "--steps", "1", "--batch-size", "1", "--checkpoint-dir", str(tmp_path / "fixed_ck"),
                   "--quiet"], env, tmp_path)
    assert "making its batch dimension dynamic" in out
    assert (tmp_path / "fixed_ck" / "inference.onnx.data").is_file()


@pytest.mark.slow
def test_over_2gb_end_to_end(tmp_path: Path) -> None:
    """Two 1.1 GB weights (2.2 GB, over protobuf's limit) through every command."""
    k, n = 16384, 17000
    weights = 2 * k * n * 4
    assert weights > 2**31
    # the model, and at most about four copies of its weights written beside it at a time
    # (build --save-stages' stage files; each output is deleted once checked), plus a margin
    need = 6 * weights
    free = shutil.disk_usage(tmp_path).free
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB free under {tmp_path} for a 2.2 GB model and its "
                    f"outputs; {free / 2**30:.1f} GiB free")
    peaks = end_to_end(tmp_path, k, n, _env())
    report = ", ".join(f"{name} {rss / 2**30:.2f} GiB ({rss / weights:.2f} W)" for name, rss in peaks.items())
    print(f"peak RSS for W = {weights / 2**30:.2f} GiB of weights: {report}")


def test_check_of_a_large_model_takes_its_own_float64_oracle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``gradcheck`` on a model over the threshold (lowered here): the oracle of
    gradgraph.check.large (the weights fed as they are, cast to float64 inside the graph, the
    moved entry set by an input) gives the report of the ModelProto oracle, and finds a wrong
    gradient."""
    from gradgraph.check import compare, gradcheck
    from gradgraph.check.large import large_float64_oracle
    from gradgraph.io import load_model
    from gradgraph.runtime import external

    model = make_model(tmp_path, 24, 20)
    small = gradcheck(model, "loss", max_elements=6)
    used = []

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        oracle = large_float64_oracle(*args, **kwargs)
        used.append(oracle)
        return oracle

    monkeypatch.setattr(external, "EXTERNAL_DATA_THRESHOLD", 0)
    monkeypatch.setattr(compare, "large_float64_oracle", spy)
    large = gradcheck(model, "loss", max_elements=6)
    assert len(used) == 1 and large.oracle == small.oracle and large.ok and small.ok
    for a, b in zip(large, small, strict=True):
        assert (a.name, a.checked, a.result) == (b.name, b.checked, b.result) == (a.name, 6, "ok")
        np.testing.assert_allclose(a.max_abs_err, b.max_abs_err, rtol=1e-3, atol=1e-12)
    # no float64 copy of a weight: the oracle feeds the file's float32 arrays themselves
    for name in ("w1", "w2"):
        fed = used[0].base[name]
        assert fed.dtype == np.float32 and _maps_a_file(fed), name
    forward = load_model(model)
    weights = {name: forward.graph.initializers[name].const_value.numpy() for name in ("w1", "w2")}
    # a gradient 1.5 times too large fails, entry by entry
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((BATCH, 24)).astype(np.float32),
             "y": rng.standard_normal((BATCH, 24)).astype(np.float32)}
    ref1, ref2 = reference_gradients(weights["w1"], weights["w2"], feeds["x"], feeds["y"], 24)
    good = compare.compare_with_central_differences(forward, "loss", {"w1": ref1, "w2": ref2[:20]}, feeds,
                                                    max_elements=4)
    assert good.ok, good
    bad = compare.compare_with_central_differences(forward, "loss", {"w1": 1.5 * ref1, "w2": ref2[:20]}, feeds,
                                                   max_elements=4)
    assert [r.result for r in bad] == ["FAIL", "ok"], bad
    # the analytic gradients are let go before the oracle runs (W bytes less at its peak)
    import weakref

    grads = {"w1": ref1.copy(), "w2": ref2.copy()}
    alive = [weakref.ref(a) for a in grads.values()]
    seen: list[list[bool]] = []

    def when_built(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append([ref() is not None for ref in alive])
        return large_float64_oracle(*args, **kwargs)

    monkeypatch.setattr(compare, "large_float64_oracle", when_built)
    again = compare.compare_with_central_differences(forward, "loss", grads, feeds, max_elements=4)
    assert seen == [[False, False]] and again.ok and not grads
    assert [(r.max_abs_err, r.checked) for r in again] == [(r.max_abs_err, r.checked) for r in good]


def _maps_a_file(array: np.ndarray) -> bool:
    """Whether ``array`` views a memory map (of the model's data file), not memory of its own."""
    import mmap

    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return base is not None


def test_check_of_a_large_model_without_float64_kernels_stops_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxruntime has no float64 Conv: the check of a large model stops naming it (the
    reference evaluator and the float32 oracle, which small models fall back to, would copy
    the weights)."""
    from gradgraph.check import gradcheck
    from gradgraph.runtime import external
    from passes.autodiff import GradientError

    proto = onnx.parser.parse_model("""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[1, 2, 6, 6] x) => (float loss) {
      h = Conv(x, w)
      loss = ReduceSum<keepdims=0>(h)
    }""")
    weight = np.random.default_rng(0).standard_normal((16, 2, 3, 3)).astype(np.float32)
    proto.graph.initializer.append(onnx.numpy_helper.from_array(weight, "w"))
    path = tmp_path / "conv.onnx"
    onnx.save(proto, str(path), save_as_external_data=True, location="conv.onnx.data", size_threshold=0)
    assert gradcheck(path, "loss", max_elements=2).ok  # small: the reference evaluator's float64
    monkeypatch.setattr(external, "EXTERNAL_DATA_THRESHOLD", 0)
    with pytest.raises(GradientError, match="no float64 kernel for Conv.*checked in float64 in onnxruntime only"):
        gradcheck(path, "loss", max_elements=2)
