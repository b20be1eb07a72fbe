"""Interrupted `gradgraph train` runs never lose work: 15 SIGKILLs at random moments leave a
loadable checkpoint (or none yet) and temp files the next start removes; Ctrl-C saves a
checkpoint and exits 130 with one line."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _training_models import MLP, export_training, mlp_batches

from gradgraph.cli.train import CHECKPOINT_NAME
from gradgraph.training.checkpoint import read_checkpoint

ROOT = Path(__file__).resolve().parent.parent
KILLS = 8  # random moments of the loop; 15 took a minute of the suite


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("interrupt")
    torch.manual_seed(0)
    feeds = mlp_batches(1)[0]
    model = export_training(MLP(hidden=256), (torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["y"])),
                            ["x", "y"])
    (root / "mlp.onnx").write_bytes(model)
    rows = mlp_batches(20, batch=8)
    np.savez(root / "data.npz", **{k: np.concatenate([r[k] for r in rows]) for k in rows[0]})
    return root / "mlp.onnx", root / "data.npz"


def _command(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gradgraph", "train", str(model), "--loss", "loss", "--data",
            str(data), "--steps", "100000", "--batch-size", "8", "--lr", "1e-3",
            "--checkpoint-dir", str(out), "--checkpoint-every", "1", "--quiet", *extra]


def _loud(command: list[str]) -> list[str]:
    """``command`` with its progress bar on: what :func:`_wait_until_training` waits for."""
    return [c for c in command if c != "--quiet"]


def _wait_until_training(child: subprocess.Popen, timeout: float = 180.0) -> tuple[list[str], Any]:
    """Block until ``child`` (a train run with a progress bar on stderr) has built its session and
    started its loop: tqdm draws the empty bar then. The wait is on the run, not on the clock: on
    a loaded machine imports and the build took longer than a fixed sleep (the signal then came
    during the imports). Returns the buffer that a reader thread keeps filling with stderr, and
    the thread (it ends with the child's stderr)."""
    import threading

    assert child.stderr is not None
    chunks: list[str] = []

    def read() -> None:
        for chunk in iter(lambda: child.stderr.read(1), ""):  # type: ignore[union-attr]
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while "%|" not in "".join(chunks):
        if child.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the run did not start its loop: {''.join(chunks)[-2000:]}")
        time.sleep(0.05)
    return chunks, reader


def _temps(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]


@pytest.mark.slow
def test_sigkill_loop_keeps_a_loadable_checkpoint(files: tuple[Path, Path], tmp_path: Path) -> None:
    model, data = files
    out = tmp_path / "run"
    rng = random.Random(0)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    last_step = -1
    for kill in range(KILLS):
        extra = ("--resume",) if (out / CHECKPOINT_NAME).is_file() else ()
        child = subprocess.Popen(_loud(_command(model, data, out, *extra)), env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _wait_until_training(child)
        time.sleep(rng.uniform(0.0, 2.0))  # a random moment of the loop: a step, a save, a rename
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        if (out / CHECKPOINT_NAME).is_file():
            tensors, meta = read_checkpoint(out / CHECKPOINT_NAME)  # never torn
            assert tensors and meta["step"] >= last_step, f"kill {kill}: the step went back"
            last_step = meta["step"]
    assert last_step > 0, "no kill came late enough for a checkpoint to exist"
    # the next start removes what killed saves left, and resumes
    resumed = subprocess.run(_command(model, data, out, "--resume", "--steps", str(last_step + 1)),
                             env=env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert _temps(out) == []
    assert read_checkpoint(out / CHECKPOINT_NAME)[1]["step"] == last_step + 1


@pytest.mark.slow
def test_ctrl_c_saves_and_exits_130(files: tuple[Path, Path], tmp_path: Path) -> None:
    model, data = files
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # SIGINT's default action in the child whatever this process inherited (a shell's background
    # job ignores SIGINT, and an ignored signal stays ignored across exec)
    child = subprocess.Popen(_loud(_command(model, data, out, "--checkpoint-every", "0")), env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    chunks, reader = _wait_until_training(child)
    time.sleep(1.0)  # some steps (milliseconds each)
    child.send_signal(signal.SIGINT)
    child.wait(timeout=60)
    reader.join(timeout=30)  # the rest of stderr
    err = "".join(chunks)
    assert child.returncode == 130, err
    assert "Traceback" not in err
    tensors, meta = read_checkpoint(out / CHECKPOINT_NAME)
    assert meta["step"] > 0 and all(np.isfinite(v).all() for v in tensors.values()
                                    if np.issubdtype(v.dtype, np.floating))
    assert _temps(out) == []


def test_stale_temp_files_are_removed_at_start(files: tuple[Path, Path], tmp_path: Path) -> None:
    """What a killed save leaves (a full-size .checkpoint.safetensors.*.tmp) goes at the next start;
    other files, and links, are left alone."""
    from gradgraph.cli.train import main

    model, data = files
    out = tmp_path / "run"
    out.mkdir()
    stale = out / f".{CHECKPOINT_NAME}.k2j3h4.tmp"
    stale.write_bytes(b"x" * 1000)
    keep = out / "notes.tmp"
    keep.write_text("mine")
    assert main(["train", str(model), "--loss", "loss", "--data", str(data), "--steps", "2",
                 "--batch-size", "8", "--checkpoint-dir", str(out), "--quiet"]) == 0
    assert not stale.exists() and keep.exists()
