"""One rank of the legacy ORTTrainer's data-parallel test (tests/test_legacy_ort_trainer.py).

    torchrun --nproc_per_node 2 tests/legacy_trainer_worker.py OUT STEPS BATCH ZERO [CKPT_DIR]
    python tests/legacy_trainer_worker.py OUT STEPS BATCH ZERO [CKPT_DIR]        (one process)

Adam with a per-name attribute map (decay on weights, none on biases), gradient clipping,
accumulation 2, ``allreduce_post_accumulation=True`` and ``deepspeed_zero_stage=ZERO``. Each of
the WORLD_SIZE ranks (torchrun's variables) feeds rows [rank * BATCH, (rank + 1) * BATCH) of every
global micro-batch of WORLD_SIZE * BATCH rows: one process with BATCH * WORLD_SIZE is the same
training. Rank 0 writes the weights to OUT.npz and the final global_step to OUT.json; with
CKPT_DIR, every rank then calls the legacy save_checkpoint into it (ZeRO: one file per rank).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

from gradgraph.torch.ort_trainer import IODescription, ModelDescription, ORTTrainer, save_checkpoint

N_IN, HIDDEN, N_OUT, ACCUMULATE = 6, 16, 4, 2


def attributes(name: str) -> dict[str, float]:
    return {"alpha": 0.9, "beta": 0.999, "lambda": 0.0 if name.endswith("bias") else 0.01, "epsilon": 1e-6}


def make_trainer(world: int = 1, rank: int = 0, zero: int = 0) -> ORTTrainer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(N_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, N_OUT))
    desc = ModelDescription([IODescription("x", ["batch", N_IN], torch.float32),
                             IODescription("y", ["batch"], torch.int64, num_classes=N_OUT)],
                            [IODescription("loss", [], torch.float32), IODescription("logits", ["batch", N_OUT])])
    return ORTTrainer(model, torch.nn.CrossEntropyLoss(), desc, "AdamOptimizer", attributes,
                      IODescription("Learning_Rate", [1], torch.float32), "cpu",
                      gradient_accumulation_steps=ACCUMULATE, world_rank=rank, world_size=world,
                      allreduce_post_accumulation=world > 1, deepspeed_zero_stage=zero)


def main() -> None:
    out, steps, batch, zero = sys.argv[1], *map(int, sys.argv[2:5])
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    trainer = make_trainer(world, rank, zero)
    rng = np.random.default_rng(1)
    rows = slice(rank * batch, (rank + 1) * batch)
    for _ in range(steps * ACCUMULATE):
        x = torch.from_numpy(rng.standard_normal((batch * world, N_IN)).astype(np.float32))
        y = torch.from_numpy(rng.integers(0, N_OUT, batch * world).astype(np.int64))
        trainer.train_step(x[rows], y[rows], torch.tensor([0.01]))
    if rank == 0:
        np.savez(out + ".npz", **{k: v.numpy() for k, v in trainer.state_dict(include_optimizer_state=False).items()})
        with open(out + ".json", "w") as fh:
            json.dump({"global_step": trainer.global_step_}, fh)
    if len(sys.argv) > 5:
        save_checkpoint(trainer, sys.argv[5], checkpoint_state_dict={"epoch": 3})


if __name__ == "__main__":
    main()
