"""Timing shared by the benchmarks: the peer's procedure when ../shared/peer is present.

The peer's ``common.time_steps`` waits for a quiet machine and re-measures when other
processes used more than a quarter core during the timed loop, so gradgraph and its peers
are timed the same way. Without the peer folder, a plain median of timed runs is used.
"""

from __future__ import annotations

import json
import os
import resource
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
    times = timed_runs(step, warmup, reps)
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


def timed_runs(step: Callable[[], object], warmup: int, reps: int) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``step`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident memory (``VmRSS``) or its peak (``VmHWM``) in MiB, from /proc."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def report_child(work: Callable[[], dict]) -> dict:
    """A benchmark child's side of :func:`run_child`: run ``work``, print its ``RESULT {json}``
    line (an exception becomes ``ok: False`` with its message) with the peak RSS; the record."""
    try:
        rec = work()
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        rec = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:800]}
    rec["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print("RESULT " + json.dumps(rec), flush=True)
    return rec


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


def time_steps_no_wait(step: Callable[[], object], warmup: int, reps: int) -> dict:
    """:func:`time_steps` without the peer's wait for a quiet machine and without its re-measuring
    on foreign load: one timed loop, its load (``other_cores``) still recorded. For quick checks on
    a busy machine, whose figures then include that load."""
    if (PEER / "common.py").exists():
        sys.path.insert(0, str(PEER))
        import common  # noqa: PLC0415 - the peer's module, found at run time

        timing, _ = common.time_steps(step, warmup=warmup, repeat=reps, quiet=False, attempts=1)
        return {k: timing[k] for k in ("median_ms", "min_ms", "other_cores", "attempts")}
    times = timed_runs(step, warmup, reps)
    return {"median_ms": statistics.median(times), "min_ms": min(times)}
