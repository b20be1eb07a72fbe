"""Timing shared by the benchmarks: the peer's procedure when ../shared/peer is present.

The peer's ``common.time_steps`` waits for a quiet machine and re-measures when other
processes used more than a quarter core during the timed loop, so gradgraph and its peers
are timed the same way. Without the peer folder, a plain median of timed runs is used.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

PEER = Path(os.environ.get("GRADGRAPH_PEER_DIR", Path(__file__).resolve().parents[2] / "shared" / "peer"))


def time_steps(step: Callable[[], object], warmup: int, reps: int) -> dict:
    """Median (and min) milliseconds of ``reps`` calls after ``warmup`` calls."""
    if (PEER / "common.py").exists():
        sys.path.insert(0, str(PEER))
        import common  # noqa: PLC0415 - the peer's module, found at run time

        timing, _ = common.time_steps(step, warmup=warmup, repeat=reps)
        return {k: timing[k] for k in ("median_ms", "min_ms", "other_cores", "attempts")}
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


def run_child(argv: list[str], env: dict[str, str] | None = None, timeout: int = 1800) -> dict:
    """Run a benchmark child process; its last ``RESULT {json}`` line, or ``ok: False`` with the
    tail of its output."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])
    return {"ok": False, "error": f"rc={proc.returncode}: {tail[:600]}"}
