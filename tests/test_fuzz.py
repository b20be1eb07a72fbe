"""Damaged model files: every one ends in a gradient graph or a GradientError, never another
exception or a hang (tools/fuzz.py; seeds fixed, so a finding reproduces)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from fuzz import fuzz  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1])
def test_damaged_models_give_clear_errors(seed: int) -> None:
    logging.disable(logging.WARNING)
    try:
        model = (ROOT / "gradgraph" / "examples" / "mlp.onnx").read_bytes()
        counts, findings = fuzz(model, "loss", cases=150, seed=seed, timeout=30)
    finally:
        logging.disable(logging.NOTSET)
    assert not findings, "\n".join(findings)
    assert counts["GradientError"] > 0 and counts["ok"] > 0  # both outcomes were exercised
