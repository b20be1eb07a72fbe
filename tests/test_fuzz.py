"""Damaged model files (1,000) and random command lines (500): every model ends in a gradient
graph or a GradientError, every command line in exit status 0-3 without a traceback, never a
crash or a hang (tools/fuzz.py; seeds fixed, so a finding reproduces)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from fuzz import fuzz, fuzz_arguments, write_example_data  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1])
def test_damaged_models_give_clear_errors(seed: int) -> None:
    logging.disable(logging.WARNING)
    try:
        model = (ROOT / "gradgraph" / "examples" / "mlp.onnx").read_bytes()
        counts, findings = fuzz(model, "loss", cases=500, seed=seed, timeout=30)
    finally:
        logging.disable(logging.NOTSET)
    assert not findings, "\n".join(findings)
    assert counts["GradientError"] > 0 and counts["ok"] > 0  # both outcomes were exercised


def test_random_command_lines_end_cleanly(tmp_path: Path) -> None:
    logging.disable(logging.WARNING)
    try:
        data = write_example_data(tmp_path / "data.npz")
        model = str(ROOT / "gradgraph" / "examples" / "mlp.onnx")
        counts, findings = fuzz_arguments(model, data, cases=500, seed=0)
    finally:
        logging.disable(logging.NOTSET)
    assert not findings, "\n".join(findings)
    assert counts["exit 0"] > 0 and counts["exit 2"] > 0
