"""One rank of a data-parallel test run (launched by tests/test_distributed.py, or alone).

    python tests/dp_worker.py OUT STEPS BATCH ACCUMULATE ZERO POST [DIE_AT]

Trains an MLP exported with a symbolic batch axis, AdamW with gradient clipping. RANK and
WORLD_SIZE come from the environment (torchrun's variables): each rank feeds rows
[rank * BATCH, (rank + 1) * BATCH) of every global micro-batch of WORLD_SIZE * BATCH rows, so
one process with BATCH * WORLD_SIZE is the same training. Rank 0 writes the weights and a
JSON summary to OUT (.npz / .json). DIE_AT: rank 1 exits abruptly before that micro-step.
"""

from __future__ import annotations

import io
import json
import os
import sys
import warnings

import numpy as np
import torch

from gradgraph import TrainingConfig, TrainingSession, UpdateOptions
from gradgraph.training.distributed import DistributedConfig
from passes.optimizer import AdamWConfig

N_IN, HIDDEN, N_OUT = 6, 16, 4


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(N_IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, N_OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.fc2(torch.tanh(self.fc1(x))), y)


def export() -> bytes:
    torch.manual_seed(0)
    module = MLP()
    f = io.BytesIO()
    args = (torch.zeros(4, N_IN), torch.zeros(4, dtype=torch.int64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, f, dynamo=False, input_names=["x", "y"], output_names=["loss"],
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, opset_version=17)
    return f.getvalue()


def main() -> None:
    out, steps, batch, accumulate, zero, post = sys.argv[1], *map(int, sys.argv[2:7])
    die_at = int(sys.argv[7]) if len(sys.argv) > 7 else -1
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    config = TrainingConfig(loss="loss", optimizer=AdamWConfig(weight_decay=0.01),
                            update=UpdateOptions(accumulation_steps=accumulate, max_grad_norm=0.5))
    distributed = DistributedConfig.from_env(zero_stage=zero, allreduce_post_accumulation=bool(post),
                                             timeout_s=20.0) if world > 1 else None
    session = TrainingSession(export(), config, providers=["CPUExecutionProvider"], distributed=distributed)
    rng = np.random.default_rng(1)
    global_rows = batch * world
    losses = []
    for micro in range(steps * accumulate):
        x = rng.standard_normal((global_rows, N_IN)).astype(np.float32)
        y = rng.integers(0, N_OUT, global_rows).astype(np.int64)
        if micro == die_at and rank == 1:
            os._exit(3)
        rows = slice(rank * batch, (rank + 1) * batch)
        losses.append(session.train_step({"x": x[rows], "y": y[rows]}, lr=1e-2))
    if rank == 0:
        weights = session.get_model_state()["full_precision"]
        np.savez(out + ".npz", **weights)
        state_bytes = session._dp.optimizer_state_bytes() if session._dp is not None else None
        with open(out + ".json", "w") as fh:
            json.dump({"losses": losses, "step": session.step, "state_bytes": state_bytes}, fh)


if __name__ == "__main__":
    main()
