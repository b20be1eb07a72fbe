"""Starting data-parallel ranks by hand, as torchrun would, for the tests that need several."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def launch(commands: Sequence[list[str]], timeout: float) -> list[subprocess.CompletedProcess]:
    """Run ``commands[r]`` as rank ``r`` of ``len(commands)`` on a free local port; kill every
    rank still running once ``timeout`` seconds have passed in all."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    world = len(commands)
    procs = []
    for rank, command in enumerate(commands):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    deadline, results = time.monotonic() + timeout, []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results
