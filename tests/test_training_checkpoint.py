"""Checkpoints, state dicts, the reference-compatible API and the inference export."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from _training_models import MLP, export_training, mlp_batches, run_torch

from gradgraph import TrainingConfig, TrainingParameters, TrainingSession, UpdateOptions
from gradgraph.training.checkpoint import CheckpointError
from passes.optimizer import AdamWConfig, SGDConfig

LR = 0.05
CPU = ["CPUExecutionProvider"]
REPO = Path(__file__).resolve().parents[1]
KILL_WAIT_S = 120


@pytest.fixture(scope="module")
def mlp_model() -> bytes:
    torch.manual_seed(0)
    feeds = mlp_batches(1)[0]
    return export_training(MLP(), (torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["y"])), ["x", "y"])


def _session(model: bytes, accumulate: int = 2) -> TrainingSession:
    return TrainingSession(model, TrainingConfig("loss", AdamWConfig(), update=UpdateOptions(
        accumulation_steps=accumulate, max_grad_norm=1.0)), providers=CPU)


def _assert_same_state(a: TrainingSession, b: TrainingSession) -> None:
    sa, sb = a.get_state(), b.get_state()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert np.array_equal(sa[name], sb[name]), name


def test_resume_is_bit_identical(mlp_model: bytes, tmp_path: Path) -> None:
    batches = mlp_batches(12)
    full = _session(mlp_model)
    for f in batches:
        full.train_step(f, lr=LR)
    first = _session(mlp_model)
    for f in batches[:7]:  # mid-accumulation: 3 updates and one buffered micro-step
        first.train_step(f, lr=LR)
    first.save_checkpoint(tmp_path / "ckpt.safetensors", {"epoch": 3})
    resumed = _session(mlp_model)
    assert resumed.load_checkpoint(tmp_path / "ckpt.safetensors") == {"epoch": 3}
    assert (resumed.step, resumed.micro_step) == (3, 1)
    for f in batches[7:]:
        resumed.train_step(f, lr=LR)
    _assert_same_state(full, resumed)


def test_strict_load_errors(mlp_model: bytes) -> None:
    session = _session(mlp_model)
    state = session.get_state()
    missing = dict(state)
    del missing["fc1.weight.exp_avg"]
    with pytest.raises(CheckpointError, match="fc1.weight.exp_avg"):
        session.load_state(missing, strict=True)
    session.load_state(missing, strict=False)
    bad = dict(state)
    bad["fc2.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(CheckpointError, match=r"fc2.weight.*shape \[3, 3\]"):
        session.load_state(bad, strict=False)
    with pytest.raises(CheckpointError, match="unexpected"):
        session.load_state({**state, "nope": np.zeros(1)}, strict=True)


def test_missing_checkpoint_file(mlp_model: bytes, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        _session(mlp_model).load_checkpoint(tmp_path / "none.safetensors")
    (tmp_path / "junk").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a gradgraph checkpoint"):
        _session(mlp_model).load_checkpoint(tmp_path / "junk")


_CHILD = """
import os, sys, time
sys.path[:0] = [{repo!r}, {tests!r}]
from _training_models import mlp_batches
from gradgraph import TrainingConfig, TrainingSession, UpdateOptions
from passes.optimizer import AdamWConfig
s = TrainingSession({model!r}, TrainingConfig("loss", AdamWConfig(), update=UpdateOptions(
                    accumulation_steps=2, max_grad_norm=1.0)), providers=["CPUExecutionProvider"])
batches = mlp_batches(12)
for f in batches[:7]:
    s.train_step(f, lr={lr!r})
s.save_checkpoint({ckpt!r})
for f in batches[7:10]:
    s.train_step(f, lr={lr!r})
def hang(fd):
    open({marker!r}, "w").close()
    time.sleep(600)
os.fsync = hang
s.save_checkpoint({ckpt!r})
"""


def test_sigkill_while_writing_keeps_previous_checkpoint(mlp_model: bytes, tmp_path: Path) -> None:
    model_path, ckpt, marker = tmp_path / "mlp.onnx", tmp_path / "ckpt.safetensors", tmp_path / "marker"
    model_path.write_bytes(mlp_model)
    code = _CHILD.format(repo=str(REPO), tests=str(REPO / "tests"), model=str(model_path),
                         ckpt=str(ckpt), marker=str(marker), lr=LR)
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + KILL_WAIT_S
        while not marker.exists():
            assert child.poll() is None, "the child exited before writing its second checkpoint"
            assert time.monotonic() < deadline, "the child never reached the second write"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert any(p.name.startswith(".ckpt.safetensors.") for p in tmp_path.iterdir())  # torn temp file
    batches = mlp_batches(12)
    resumed = _session(mlp_model)
    resumed.load_checkpoint(ckpt)
    assert (resumed.step, resumed.micro_step) == (3, 1)
    for f in batches[7:]:
        resumed.train_step(f, lr=LR)
    full = _session(mlp_model)
    for f in batches:
        full.train_step(f, lr=LR)
    _assert_same_state(full, resumed)


def test_inference_model_matches_eval(mlp_model: bytes, tmp_path: Path) -> None:
    session = _session(mlp_model, accumulate=1)
    for f in mlp_batches(4):
        session.train_step(f, lr=LR)
    feeds = mlp_batches(1, seed=7)[0]
    session.export_inference_model(tmp_path / "trained.onnx")
    infer = ort.InferenceSession(str(tmp_path / "trained.onnx"), providers=CPU)
    assert [i.name for i in infer.get_inputs()] == ["x", "y"]
    np.testing.assert_array_equal(infer.run(["loss"], feeds)[0], session.eval_step(feeds)["loss"])


def test_reference_compatible_api(mlp_model: bytes) -> None:
    params = TrainingParameters()
    params.loss_output_name = "loss"
    params.training_optimizer_name = "AdamOptimizer"
    params.enable_grad_norm_clip = False
    names = ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    params.optimizer_attributes_map = {n: {"alpha": 0.8, "beta": 0.99, "lambda": 0.0, "epsilon": 1e-7}
                                       for n in names}
    session = TrainingSession(mlp_model, params, None, CPU)
    initial = session.get_model_state()["full_precision"]
    batches = mlp_batches(10)
    ours = [float(session.run(["loss"], {**f, "Learning_Rate": np.array([LR], np.float32)})[0])
            for f in batches]
    module = MLP()
    module.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
    ref = run_torch(module, torch.optim.Adam(module.parameters(), lr=LR, betas=(0.8, 0.99), eps=1e-7), batches)
    np.testing.assert_allclose(ours, ref, rtol=1e-5)
    opt = session.get_optimizer_state()
    assert set(opt) == set(names) | {"shared_optimizer_state"}
    assert int(opt["shared_optimizer_state"]["step"]) == 10
    assert set(opt["fc1.weight"]) == {"exp_avg", "exp_avg_sq"}


def test_unsupported_parameters_raise(mlp_model: bytes) -> None:
    params = TrainingParameters()
    params.loss_output_name = "loss"
    params.use_fp16_moments = True
    with pytest.raises(NotImplementedError, match="use_fp16_moments"):
        TrainingSession(mlp_model, params)
    params.use_fp16_moments = False
    params.world_size = 2
    with pytest.raises(NotImplementedError, match="world_size"):
        TrainingSession(mlp_model, params)


def test_missing_learning_rate(mlp_model: bytes) -> None:
    session = TrainingSession(mlp_model, TrainingConfig("loss", SGDConfig()), providers=CPU)
    with pytest.raises(ValueError, match="no learning rate"):
        session.train_step(mlp_batches(1)[0])
    session.learning_rate = LR
    assert np.isfinite(session.train_step(mlp_batches(1)[0]))


def test_kept_bindings_follow_the_state_and_the_fetches(mlp_model: bytes) -> None:
    """The runner keeps its IOBindings between steps (ort_state.GraphRunner._binding): an array
    returned by one step is not overwritten by the next, a state loaded between steps is the one
    trained, and a change of fetches gets what it asks for."""
    batches = mlp_batches(6)
    config = TrainingConfig("loss", AdamWConfig(), update=UpdateOptions(max_grad_norm=1.0))
    session = TrainingSession(mlp_model, config, providers=CPU)
    fresh = TrainingSession(mlp_model, config, providers=CPU)
    start = fresh.get_state()
    kept = []
    for f in batches[:3]:
        loss, out = session.train_step(f, lr=LR, fetches=["loss"])
        kept.append((loss, out["loss"]))
    assert len({loss for loss, _ in kept}) == 3
    for loss, array in kept:  # each step's array still holds its own loss
        assert float(array.reshape(-1)[0]) == loss
    session.load_state(start)  # back to the start: the same trajectory as a fresh session
    for f in batches[3:]:
        ours, theirs = session.train_step(f, lr=LR), fresh.train_step(f, lr=LR)
        assert ours == theirs
    fetched = session.train_step(batches[0], lr=LR, fetches=["step_finite", "loss"])[1]
    assert sorted(fetched) == ["loss", "step_finite"] and bool(fetched["step_finite"])
    loss, out = session.train_step(batches[1], lr=LR, fetches=["loss"])
    assert float(out["loss"].reshape(-1)[0]) == loss
    fresh.train_step(batches[0], lr=LR)
    fresh.train_step(batches[1], lr=LR)
    ours = session.get_state()
    for name, value in fresh.get_state().items():
        assert np.array_equal(ours[name], value), name


def _rss_mb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc")
@pytest.mark.parametrize("mode", ["swap", "set"])
def test_kept_bindings_hold_no_replaced_state(mode: str) -> None:
    """A weight replaced between runs (StateStore.set: a loaded state, ZeRO-1's gathered weights
    every step) or swapped (an optimizer step) is not kept alive by a kept binding, nor is a
    fetched output once the caller dropped it: resident memory stays that of one state (it was
    one more state per kept binding)."""
    import gc

    from onnx import TensorProto as T
    from onnx import helper as h

    from gradgraph.training.ort_state import GraphRunner, StateStore
    from passes.optimizer.optimizer_pass import TrainingNames
    n = 4096  # 64 MB
    graph = h.make_graph([h.make_node("Mul", ["W", "x"], ["G"])], "g",
                         [h.make_tensor_value_info("W", T.FLOAT, [n, n]), h.make_tensor_value_info("x", T.FLOAT, [1])],
                         [h.make_tensor_value_info("G", T.FLOAT, [n, n])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=9)
    store = StateStore()
    store.set("W", np.ones((n, n), np.float32))
    runner = GraphRunner(model, {"W"}, TrainingNames(), None, CPU, None)
    store.spare("W")
    base = _rss_mb()
    for step in range(5):
        out = runner.run(store, {"x": np.array([2.0], np.float32)}, ["G"])
        if mode == "set":  # W holds step - 1 from the second run on (the spare is never written)
            assert out["G"][0, 0] == out["G"][-1, -1] == 2.0 * (max(step - 1, 0) if step else 1.0)
        del out
        gc.collect()
        if mode == "swap":
            store.swap("W")
        else:
            store.set("W", np.full((n, n), step, np.float32))
        growth = _rss_mb() - base
    assert growth < 100, f"{growth:.0f} MB above the start: a replaced 64 MB state is kept alive"


def test_concurrent_runs_of_one_graph(mlp_model: bytes) -> None:
    """Two threads evaluating at once each get their own batch's outputs (a kept binding serves
    one run at a time; the other makes its own)."""
    import concurrent.futures

    session = TrainingSession(mlp_model, TrainingConfig("loss", SGDConfig()), providers=CPU)
    batches = mlp_batches(8)
    expected = [session.eval_step(f)["loss"] for f in batches]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(lambda f: session.eval_step(f)["loss"], batches))
            for ours, want in zip(got, expected, strict=True):
                np.testing.assert_array_equal(ours, want)


def test_a_checkpoint_whose_tensors_fit_loads_whatever_settings_differ(mlp_model: bytes, tmp_path: Path) -> None:
    """Stateless SGD over every weight, then resumed with some frozen: the state is the same
    tensors, so it loads (the recorded trained set only explains a load whose tensors differ)."""
    everything = TrainingSession(mlp_model, TrainingConfig("loss", SGDConfig()), providers=CPU)
    everything.train_step(mlp_batches(1)[0], lr=LR)
    everything.save_checkpoint(tmp_path / "all.safetensors")
    trained = everything.artifacts.trained
    part = TrainingSession(mlp_model, TrainingConfig("loss", SGDConfig(), weights_to_train=tuple(trained[:2])),
                           providers=CPU)
    part.load_checkpoint(tmp_path / "all.safetensors")
    adam = TrainingSession(mlp_model, TrainingConfig("loss", AdamWConfig(), weights_to_train=tuple(trained[:2])),
                           providers=CPU)
    everything_adam = TrainingSession(mlp_model, TrainingConfig("loss", AdamWConfig()), providers=CPU)
    everything_adam.save_checkpoint(tmp_path / "adam.safetensors")
    with pytest.raises(CheckpointError, match=r"written training other weights \(frozen now"):
        adam.load_checkpoint(tmp_path / "adam.safetensors")



def test_another_models_checkpoint_is_named_as_such(mlp_model: bytes, tmp_path: Path) -> None:
    """A checkpoint of another model (its trained weights are not this model's) is said to be
    one, not 'written training other weights (frozen now [...])' about names the model lacks."""
    example = Path(__file__).resolve().parent.parent / "gradgraph" / "examples" / "mlp.onnx"
    other = TrainingSession(str(example), TrainingConfig("loss", AdamWConfig()), providers=CPU)
    other.save_checkpoint(tmp_path / "other.safetensors")
    ours = TrainingSession(mlp_model, TrainingConfig("loss", AdamWConfig()), providers=CPU)
    assert not set(other.artifacts.params) & set(ours.artifacts.params)  # the case of this test
    with pytest.raises(CheckpointError, match=r"was written for another model: it trained"):
        ours.load_checkpoint(tmp_path / "other.safetensors")
