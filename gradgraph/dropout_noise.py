"""New dropout noise for the graph inputs :class:`passes.kernels.DropoutNoisePass` makes.

``noise = (U >= ratio) / (1 - ratio)`` (torch's CPU dropout multiplies by the same), U uniform
on [0, 1) in float32. One seed gives every input's noise: each input is cut into chunks of
``CHUNK`` elements, chunk ``j`` of input ``i`` drawn by numpy's SFC64 generator seeded with
``(seed, i, j)``, so the values depend on the seed alone (not on the thread count), and the
chunks are filled on ``threads`` threads (numpy releases the GIL while it fills and compares).
Measured on the 2-core CPU machine for the GPT-2-like benchmark model's 13 inputs (4.2 M
elements): 7.4 ms on two threads, 10.2 on one; torch's CPU ``uniform_`` alone took 14-16 ms and
its ``bernoulli_`` + ``div_`` 41 ms (which is why torch does not draw them on the CPU).
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from passes.kernels.dropout_noise import NoiseInput

CHUNK = 1 << 18
_pools: dict[int, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def _forget_pools() -> None:
    """In a forked child: the parent's pool threads do not exist there (a pool kept would wait
    for them forever), so the child makes its own."""
    global _lock
    _pools.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def _pool(threads: int) -> ThreadPoolExecutor:
    with _lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="gradgraph-noise")
        return pool


class DropoutNoise:
    """Draws the noise of ``inputs`` (name -> :class:`NoiseInput`) from a seed."""

    def __init__(self, inputs: dict[str, NoiseInput], threads: int = 1) -> None:
        self.inputs = dict(inputs)
        self.threads = max(1, int(threads))
        # (input index, chunk index, start, stop) of every chunk
        self._chunks = [(i, j, start, min(start + CHUNK, size))
                        for i, spec in enumerate(self.inputs.values())
                        for size in (math.prod(spec.shape),)
                        for j, start in enumerate(range(0, size, CHUNK))]

    def __bool__(self) -> bool:
        return bool(self.inputs)

    def draw(self, seed: int) -> list[np.ndarray]:
        """One new array per input, in the order of ``inputs``."""
        specs = list(self.inputs.values())
        flats: list[np.ndarray] = [np.empty(math.prod(s.shape), s.dtype) for s in specs]

        def fill(chunk: tuple[int, int, int, int]) -> None:
            i, j, start, stop = chunk
            spec, out = specs[i], flats[i][start:stop]
            uniform = out if spec.dtype == np.float32 else np.empty(stop - start, np.float32)
            np.random.Generator(np.random.SFC64([seed, i, j])).random(out=uniform, dtype=np.float32)
            keep = np.greater_equal(uniform, np.float32(spec.ratio))
            np.multiply(keep, spec.dtype(1.0 / (1.0 - spec.ratio)), out=out)

        if self.threads > 1 and len(self._chunks) > 1:
            list(_pool(min(self.threads, len(self._chunks))).map(fill, self._chunks))
        else:
            for chunk in self._chunks:
                fill(chunk)
        return [flat.reshape(spec.shape) for flat, spec in zip(flats, specs)]
