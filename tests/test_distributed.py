"""Data-parallel TrainingSession on torch.distributed (gloo, 2 ranks on loopback).

Oracle: the same training in one process on the concatenated shards (batch 2B). Tolerance:
rel 1e-5 on the weights after 10 optimizer steps (float32; the all-reduce sums in another
order). Every launch is bounded in time and its processes are killed on failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.ranks import launch

pytest.importorskip("torch")

WORKER = Path(__file__).with_name("dp_worker.py")
ROOT = Path(__file__).resolve().parent.parent
STEPS, BATCH = 10, 4


def _launch(world: int, out: Path, args: list[str], timeout: float = 180.0) -> list[subprocess.CompletedProcess]:
    """Run ``world`` ranks of the worker; kill them all if any exceeds ``timeout``."""
    return launch([[sys.executable, str(WORKER), str(out), *args]] * world, timeout)


def _train(tmp: Path, world: int, accumulate: int, zero: int, post: int) -> tuple[dict, dict]:
    out = tmp / f"w{world}_a{accumulate}_z{zero}_p{post}"
    batch = BATCH * (2 // world)  # one process: the concatenated batch
    results = _launch(world, out, [str(STEPS), str(batch), str(accumulate), str(zero), str(post)])
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    return dict(np.load(str(out) + ".npz")), json.loads(Path(str(out) + ".json").read_text())


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The oracle run, computed once (accumulation 1 is covered by the front-end and CLI tests)."""
    cache: dict[int, tuple[dict, dict]] = {}

    def run(accumulate: int) -> tuple[dict, dict]:
        if accumulate not in cache:
            cache[accumulate] = _train(tmp_path_factory.mktemp("single"), 1, accumulate, 0, 1)
        return cache[accumulate]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("accumulate,zero,post", [(2, 0, 0), (2, 1, 1)])
def test_two_ranks_train_like_one_process_on_the_whole_batch(tmp_path, single_process, accumulate, zero, post):
    single, single_info = single_process(accumulate)
    double, info = _train(tmp_path, 2, accumulate, zero, post)
    assert info["step"] == single_info["step"] == STEPS
    for name, value in single.items():
        np.testing.assert_allclose(double[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    if zero == 1:  # rank 0 keeps about half of the AdamW moments
        full = sum(2 * v.nbytes for v in single.values())
        assert 0 < info["state_bytes"] < full


@pytest.mark.slow
@pytest.mark.parametrize("api", ["trainer", "ortmodule"])
def test_front_ends_train_like_one_process(tmp_path, api):
    """ORTTrainerOptions' distributed group (world_size 2, ZeRO stage 1, per-micro-step
    all-reduce, accumulation 2); ORTModule under torch's DistributedDataParallel."""
    runs = {}
    for world in (1, 2):
        out = tmp_path / f"{api}{world}"
        results = _launch(world, out, [str(STEPS), str(BATCH * (2 // world)), "2", str(world - 1), "0",
                                       "--api", api])
        for r in results:
            assert r.returncode == 0, r.stderr[-3000:]
        runs[world] = np.load(str(out) + ".npz")
    for name in runs[1].files:
        np.testing.assert_allclose(runs[2][name], runs[1][name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.slow
def test_a_zero1_checkpoint_of_two_ranks_continues_in_one_process(tmp_path):
    """Ranks save their partitions at step 5 (accumulating 2 micro-batches); one process loads
    both files and trains steps 6-10 on the same global batches as the two ranks."""
    prefix = tmp_path / "ckpt"
    two = _launch(2, tmp_path / "two", [str(STEPS), str(BATCH), "2", "1", "1", "--save-at", "5",
                                        "--save", str(prefix)])
    for r in two:
        assert r.returncode == 0, r.stderr[-3000:]
    files = ",".join(f"{prefix}.rank{r}" for r in range(2))
    one = _launch(1, tmp_path / "one", [str(STEPS - 5), str(2 * BATCH), "2", "0", "1", "--load", files,
                                        "--skip", "10"])
    assert one[0].returncode == 0, one[0].stderr[-3000:]
    expected = np.load(str(tmp_path / "two") + ".npz")
    got = np.load(str(tmp_path / "one") + ".npz")
    for name in expected.files:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert json.loads(Path(str(tmp_path / "one") + ".json").read_text())["step"] == STEPS


@pytest.mark.slow
def test_a_rank_that_dies_makes_the_others_fail_with_a_clear_error(tmp_path):
    start = time.monotonic()
    results = _launch(2, tmp_path / "dead", [str(STEPS), str(BATCH), "1", "0", "1", "3"], timeout=120)
    assert results[1].returncode == 3
    assert results[0].returncode != 0
    assert time.monotonic() - start < 90
    assert "DistributedError" in results[0].stderr and "another rank stopped" in results[0].stderr, \
        results[0].stderr[-2000:]


# ---- the command line: gradgraph train --nproc N ------------------------------------------
EXAMPLES = ROOT / "gradgraph" / "examples"


def _cli(out: Path, nproc: int, batch: int, steps: int = 10) -> list[str]:
    return [sys.executable, "-m", "gradgraph", "train", str(EXAMPLES / "mlp.onnx"), "--loss", "loss",
            "--data", str(EXAMPLES / "mlp_data.npz"), "--optimizer", "sgd", "--lr", "0.05",
            "--momentum", "0.9", "--clip", "1.0", "--steps", str(steps), "--batch-size", str(batch),
            "--nproc", str(nproc), "--checkpoint-dir", str(out), "--quiet"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
def test_cli_nproc_2_is_one_process_with_twice_the_batch(tmp_path):
    from gradgraph.training.checkpoint import read_checkpoint

    for nproc, batch in ((2, 16), (1, 32)):
        done = subprocess.run(_cli(tmp_path / f"p{nproc}", nproc, batch), env=_env(), capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    two, meta2 = read_checkpoint(tmp_path / "p2" / "checkpoint.safetensors")
    one, meta1 = read_checkpoint(tmp_path / "p1" / "checkpoint.safetensors")
    assert meta2["step"] == meta1["step"] == 10
    for name, value in one.items():
        np.testing.assert_allclose(two[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(meta2["user"]["losses"], meta1["user"]["losses"], rtol=1e-5)


def _descendants(root: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, parent in parents.items() if parent == pid]
        found += kids
        frontier += kids
    return found


def _rank_process(root: int, rank: int) -> int | None:
    for pid in _descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
    return None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the rank's process through /proc")
def test_cli_exits_non_zero_soon_after_a_rank_is_killed(tmp_path):
    proc = subprocess.Popen(_cli(tmp_path / "run", 2, 16, steps=1_000_000), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        victim = None
        while victim is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            victim = _rank_process(proc.pid, 1)
        assert victim is not None, "rank 1 never started"
        time.sleep(5)  # let the ranks train a while
        os.kill(victim, 9)
        killed = time.monotonic()
        proc.wait(timeout=90)
        assert time.monotonic() - killed < 60
        assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            for pid in _descendants(proc.pid):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            proc.kill()
        proc.communicate()


@pytest.mark.slow
def test_cli_nproc_user_errors_and_divergence_exit_like_one_process(tmp_path):
    """A bad --loss is reported once, before any rank starts (exit 2); a run whose updates turn
    non-finite on every step stops after --max-skipped with exit 3 (the ranks skip together)."""
    bad = subprocess.run([*_cli(tmp_path / "bad", 2, 16)[:6], "nope", *_cli(tmp_path / "bad", 2, 16)[7:]],
                         env=_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.count("is not an output") == 1, bad.stderr[-2000:]
    diverge = _cli(tmp_path / "div", 2, 16)
    diverge[diverge.index("--lr") + 1] = "1e38"
    done = subprocess.run([*diverge, "--max-skipped", "2"], env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "steps in a row" in done.stderr
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_cli_nproc_errors_of_a_rank_are_one_line_each(tmp_path):
    """fp16 with data parallelism is refused before any rank starts; so is a label out of range
    in rank 1's rows (the data file's check at load), once, no traceback (torchrun's
    ChildFailedError report came after the ranks' lines)."""
    fp16 = subprocess.run([*_cli(tmp_path / "fp16", 2, 16), "--mixed-precision", "float16"], env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert fp16.returncode == 2 and fp16.stderr.count("not implemented yet") == 1, fp16.stderr[-2000:]
    assert "Traceback" not in fp16.stderr
    data = dict(np.load(EXAMPLES / "mlp_data.npz"))
    labels = next(k for k, v in data.items() if v.dtype.kind == "i")
    data[labels] = data[labels].copy()
    data[labels][1] = 10**6  # global micro-batch 0 with batch 1 per rank: rank 1's row
    np.savez(tmp_path / "bad.npz", **data)
    command = _cli(tmp_path / "bad", 2, 1)  # --batch-size is per rank: rank r reads row r first
    command[command.index("--data") + 1] = str(tmp_path / "bad.npz")
    bad = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=180)
    assert bad.returncode == 2, bad.stderr[-3000:]
    # refused when the data file is loaded, before any rank starts (gradgraph.index_inputs)
    assert bad.stderr.count("holds 1000000 at position [1]") == 1, bad.stderr[-3000:]
    assert "Traceback" not in bad.stderr and "ChildFailedError" not in bad.stderr, bad.stderr[-3000:]
