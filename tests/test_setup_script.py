"""tools/setup.sh is quiet: one line per step and the ready line; pip's output goes to a log file
whose path is printed only when a step fails. Run against a stand-in venv whose ``python``
prints pip-like noise (the real install takes minutes and the network's packages)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOISE = "WARNING: Location 'file:///opt/x' is ignored: it is neither a file nor a directory."

FAKE_PYTHON = """#!/usr/bin/env bash
# a stand-in venv python: imports fail until "installed", pip prints noise
state="$(dirname "$0")/../installed"
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "{noise}"
  echo "{noise}" >&2
  case "$*" in *{fail}*) echo "ERROR: no matching distribution" >&2; exit 1;; esac
  case "$*" in *-e*) touch "$state";; esac
  exit 0
fi
if [ "$1" = "-c" ]; then
  case "$2" in
    *print*) echo "onnx 1.0 onnxruntime 1.0"; exit 0;;
    *) [ -f "$state" ] && exit 0 || exit 1;;
  esac
fi
exit 0
"""


def _venv(tmp_path: Path, fail: str = "no-such-step") -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON.format(noise=NOISE, fail=fail))
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return venv


def _setup(venv: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, GRADGRAPH_VENV=str(venv), TMPDIR=str(tmp_path))
    return subprocess.run(["bash", str(ROOT / "tools" / "setup.sh")], capture_output=True, text=True,
                          env=env, timeout=60)


def test_setup_prints_one_line_per_step_and_no_pip_output(tmp_path: Path) -> None:
    venv = _venv(tmp_path)
    proc = _setup(venv, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and NOISE not in proc.stdout
    lines = proc.stdout.splitlines()
    assert all(line.startswith("[setup] ") for line in lines), lines
    assert lines[-1] == f"[setup] ready: {venv} (onnx 1.0 onnxruntime 1.0)"
    assert any("installing gradgraph" in line for line in lines)
    assert not list(tmp_path.glob("gradgraph-setup.*.log"))  # the log is removed after success
    again = _setup(venv, tmp_path)  # set up for this pyproject.toml already: nothing installed
    assert again.returncode == 0 and again.stdout.splitlines() == [lines[-1]]


@pytest.mark.parametrize("step", ["torch==", "-e"])
def test_a_failing_step_names_the_log_with_pip_output(tmp_path: Path, step: str) -> None:
    proc = _setup(_venv(tmp_path, fail=step), tmp_path)
    assert proc.returncode == 1
    logs = list(tmp_path.glob("gradgraph-setup.*.log"))
    assert len(logs) == 1 and str(logs[0]) in proc.stderr
    assert "no matching distribution" in logs[0].read_text() and NOISE in logs[0].read_text()
    assert NOISE not in proc.stdout
