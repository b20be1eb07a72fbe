"""What data-parallel ranks must agree on, and the one line that names where they do not.

Ranks started with another optimizer, learning rate or trained set finished with exit 0 and
different weights, died in gloo (a broadcast of weights the other rank does not hold) or waited
for the collective timeout (another step count). :class:`gradgraph.training.distributed.
DataParallelRunner` therefore gathers every rank's configuration before its first collective
(:func:`session_configuration`: a hash of the training graph, the training options, the
trained set), the shapes of the first step's feeds at that step, and what a front end adds
(``gradgraph train``: its options and the data's shapes), and stops every rank with one line
naming the first part that differs (:func:`first_difference`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx

# Longest value shown in the line; a longer one is shown around its first difference.
SHOWN_CHARS = 80


def graph_hash(model: onnx.ModelProto) -> str:
    """sha256 (16 hex digits) of the graph's structure: nodes, inputs, outputs, the names,
    types and shapes of the initializers (not their values: rank 0's are broadcast, as DDP
    does). Large initializers are not serialized."""
    digest = hashlib.sha256()
    graph = model.graph
    for node in graph.node:
        digest.update(node.SerializeToString())
    for value in [*graph.input, *graph.output]:
        digest.update(value.SerializeToString())
    for tensor in graph.initializer:
        digest.update(f"{tensor.name}:{tensor.data_type}:{list(tensor.dims)}".encode())
    return digest.hexdigest()[:16]


def session_configuration(session: Any, world_size: int, zero_stage: int,
                          allreduce_post_accumulation: bool) -> dict[str, str]:
    """The parts of a :class:`gradgraph.TrainingSession` every rank must share (the debug
    options, which name per-rank files, are left out)."""
    config, art = session.config, session.artifacts
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "debug"}
    parts = {f"TrainingConfig.{name}": repr(value) for name, value in options.items()}
    parts.update({"the trained weights": ", ".join(art.trained),
                  "the frozen weights": ", ".join(art.frozen),
                  "the world size": str(world_size),
                  "the ZeRO stage": str(zero_stage),
                  "allreduce_post_accumulation": str(allreduce_post_accumulation),
                  "the training graph (hash)": graph_hash(art.train)})
    return parts


def feed_shapes(feeds: Mapping[str, Any]) -> dict[str, str]:
    """{"the shape of feed NAME": "[4, 6] float32"} for each feed."""
    out = {}
    for name in sorted(feeds):
        array = np.asarray(feeds[name]) if not hasattr(feeds[name], "shape") else feeds[name]
        out[f"the shape of feed {name!r}"] = f"{list(array.shape)} {getattr(array, 'dtype', '')}"
    return out


def command_configuration(options: Mapping[str, object], data: Mapping[str, Any],
                          per_rank: Sequence[str] = ()) -> dict[str, str]:
    """A command line's options (``--name``: value; those in ``per_rank``, such as file paths
    and output switches, left out) and the shapes of its data arrays."""
    parts = {f"--{name.replace('_', '-')}": repr(value) for name, value in sorted(options.items())
             if name not in per_rank and not callable(value)}
    for name in sorted(data):
        array = data[name]
        parts[f"the shape of data array {name!r}"] = f"{list(array.shape)} {array.dtype}"
    return parts


def _shown(value: str, at: int) -> str:
    if len(value) <= SHOWN_CHARS:
        return repr(value)
    start = max(0, at - SHOWN_CHARS // 2)
    return ("..." if start else "") + repr(value[start:start + SHOWN_CHARS]) + \
        ("..." if start + SHOWN_CHARS < len(value) else "")


def first_difference(gathered: Sequence[Mapping[str, str]]) -> str | None:
    """One line naming the first part in which a rank differs from rank 0, else None."""
    base = gathered[0]
    for rank, parts in enumerate(gathered[1:], start=1):
        for key in [*base, *(k for k in parts if k not in base)]:
            mine, theirs = base.get(key), parts.get(key)
            if mine == theirs:
                continue
            mine, theirs = mine or "(none)", theirs or "(none)"
            at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            return (f"data-parallel ranks differ in {key}: rank 0 has {_shown(mine, at)}, rank "
                    f"{rank} has {_shown(theirs, at)}; start every rank with the same model, "
                    "options and data shapes")
    return None
