"""Timing shared by the benchmarks: the peer's procedure when ../shared/peer is present.

The peer's ``common.time_steps`` waits for a quiet machine and re-measures when other
processes used more than a quarter core during the timed loop, so gradgraph and its peers
are timed the same way. Without the peer folder, a plain median of timed runs is used.
"""

from __future__ import annotations

import os
import statistics
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
