"""One rank of a data-parallel test run (launched by tests/test_distributed.py, or alone).

    python tests/dp_worker.py OUT STEPS BATCH ACCUMULATE ZERO POST [DIE_AT]
                              [--save-at N --save PREFIX] [--load P1,P2,...] [--skip MICRO]

Trains an MLP exported with a symbolic batch axis, AdamW with gradient clipping. RANK and
WORLD_SIZE come from the environment (torchrun's variables): each rank feeds rows
[rank * BATCH, (rank + 1) * BATCH) of every global micro-batch of WORLD_SIZE * BATCH rows, so
one process with BATCH * WORLD_SIZE is the same training. Rank 0 writes the weights and a
JSON summary to OUT (.npz / .json). DIE_AT: rank 1 exits abruptly before that micro-step.
--save-at/--save: after N optimizer steps each rank saves PREFIX.rank<r>; --load: start from
those checkpoints (merged); --skip: the data stream starts at that micro-batch.
"""

from __future__ import annotations

import io
import json
import os
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
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("numbers", type=int, nargs="+")
    parser.add_argument("--save-at", type=int, default=-1)
    parser.add_argument("--save", default="")
    parser.add_argument("--load", default="")
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--api", choices=["session", "trainer", "ortmodule"], default="session")
    args = parser.parse_args()
    out = args.out
    steps, batch, accumulate, zero, post = args.numbers[:5]
    die_at = args.numbers[5] if len(args.numbers) > 5 else -1
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    config = TrainingConfig(loss="loss", optimizer=AdamWConfig(weight_decay=0.01),
                            update=UpdateOptions(accumulation_steps=accumulate, max_grad_norm=0.5))
    distributed = DistributedConfig.from_env(zero_stage=zero, allreduce_post_accumulation=bool(post),
                                             timeout_s=20.0) if world > 1 else None
    if args.api == "trainer":
        return trainer_main(out, steps, batch, accumulate, zero, post, world, rank)
    if args.api == "ortmodule":
        return ortmodule_main(out, steps, batch, world, rank)
    session = TrainingSession(export(), config, providers=["CPUExecutionProvider"], distributed=distributed)
    if args.load:
        session.load_checkpoint(args.load.split(","))
    rng = np.random.default_rng(1)
    global_rows = batch * world
    losses = []
    for micro in range(args.skip + steps * accumulate):
        x = rng.standard_normal((global_rows, N_IN)).astype(np.float32)
        y = rng.integers(0, N_OUT, global_rows).astype(np.int64)
        if micro < args.skip:
            continue
        if session.step == args.save_at and session.micro_step == 0 and args.save:
            session.save_checkpoint(f"{args.save}.rank{rank}")
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


def trainer_main(out: str, steps: int, batch: int, accumulate: int, zero: int, post: int,
                 world: int, rank: int) -> None:
    """The same training through ORTTrainer (LAMB; the distributed options of ORTTrainerOptions)."""
    from gradgraph.torch import ORTTrainer, ORTTrainerOptions, optim

    torch.manual_seed(0)
    desc = {"inputs": [("x", ["batch", N_IN]), ("y", ["batch"])], "outputs": [("loss", [], True)]}
    options = ORTTrainerOptions({
        "device": {"id": "cpu"}, "batch": {"gradient_accumulation_steps": accumulate},
        "distributed": {"world_size": world, "world_rank": rank, "data_parallel_size": world,
                        "allreduce_post_accumulation": bool(post),
                        "deepspeed_zero_optimization": {"stage": zero}}})
    trainer = ORTTrainer(MLP(), desc, optim.LambConfig(lr=1e-2, lambda_coef=0.01), options=options)
    rng = np.random.default_rng(1)
    rows = slice(rank * batch, (rank + 1) * batch)
    for _ in range(steps * accumulate):
        x = rng.standard_normal((batch * world, N_IN)).astype(np.float32)
        y = rng.integers(0, N_OUT, batch * world).astype(np.int64)
        trainer.train_step(torch.from_numpy(x[rows]), torch.from_numpy(y[rows]))
    if rank == 0:
        state = trainer.state_dict(pytorch_format=True)
        np.savez(out + ".npz", **{k: v.numpy() for k, v in state.items()})
        with open(out + ".json", "w") as fh:
            json.dump({"step": trainer._train_step_info.optimization_step}, fh)


def ortmodule_main(out: str, steps: int, batch: int, world: int, rank: int) -> None:
    """ORTModule under torch's DistributedDataParallel (its gradients are torch .grad tensors)."""
    from gradgraph.torch import ORTModule

    torch.manual_seed(0)
    model: torch.nn.Module = ORTModule(MLP())
    if world > 1:
        torch.distributed.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rng = np.random.default_rng(1)
    rows = slice(rank * batch, (rank + 1) * batch)
    for _ in range(steps):
        x = rng.standard_normal((batch * world, N_IN)).astype(np.float32)
        y = rng.integers(0, N_OUT, batch * world).astype(np.int64)
        opt.zero_grad()
        model(torch.from_numpy(x[rows]), torch.from_numpy(y[rows])).backward()
        opt.step()
    if rank == 0:
        inner = model.module if world > 1 else model
        np.savez(out + ".npz", **{k: v.detach().numpy() for k, v in inner.state_dict().items()})
        with open(out + ".json", "w") as fh:
            json.dump({"step": steps}, fh)


if __name__ == "__main__":
    main()
