"""Data-parallel throughput: 1 process against N ranks on this machine (torch.distributed, gloo).

    python tools/bench_distributed.py [--model bert] [--ranks 1,2] [--reps 10] [--warmup 2]
                                      [--threads 2] [--rounds 3]

The peer's BERT-like model (../shared/peer/models_def.py: 4 layers, hidden 256, seq 128,
batch 8 per rank, dropout active), AdamW, exported once. Each configuration runs as its own
processes (N ranks on loopback, ``--threads`` cores shared: each rank gets threads / N
onnxruntime threads); the configurations alternate in ``--rounds`` rounds. Printed per world
size: the median step time (rank 0), the throughput in samples/s (N x batch / step), its
ratio to one process, the all-reduce share of the step (time in collectives, waiting
for the slowest rank included, over the step time) and rank 0's optimizer-state memory
(``--zero 1``: its partition only).

On one machine the ranks share its cores: N ranks of threads / N each cannot beat one
process of ``threads`` threads on compute-bound steps. The figure shows the overhead of the
data-parallel step (all-reduce, vote, broadcast of running statistics), the part that stays
when the ranks run on separate machines.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_training import EPS, LR, _trainable, child_export  # noqa: E402 - tools/ is not a package


def rank_main(args: argparse.Namespace) -> None:
    import numpy as np
    import onnx
    import onnxruntime as ort

    from gradgraph import TrainingConfig, TrainingSession
    from gradgraph.training.distributed import DistributedConfig
    from passes.optimizer import AdamWConfig

    world = int(os.environ["WORLD_SIZE"])
    path = os.path.join(args.dir, f"{args.model}.onnx")
    feeds = dict(np.load(os.path.join(args.dir, f"{args.model}_inputs.npz")))
    config = TrainingConfig(loss="loss", optimizer=AdamWConfig(eps=EPS, weight_decay=0.0),
                            weights_to_train=tuple(_trainable(onnx.load(path, load_external_data=False))))
    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, args.threads // world)
    distributed = DistributedConfig.from_env(timeout_s=300.0, zero_stage=args.zero) if world > 1 else None
    session = TrainingSession(path, config, options, providers=["CPUExecutionProvider"],
                              distributed=distributed)
    for _ in range(args.warmup):
        session.train_step(feeds, lr=LR)
    runner = session.data_parallel
    times, shares = [], []
    for _ in range(args.reps):
        before = runner.coll.seconds if runner is not None else 0.0
        start = time.perf_counter()
        session.train_step(feeds, lr=LR)
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        shares.append(((runner.coll.seconds if runner is not None else 0.0) - before) / elapsed)
    if int(os.environ.get("RANK", "0")) == 0:
        batch = next(iter(feeds.values())).shape[0]
        state = runner.optimizer_state_bytes() if runner is not None else sum(
            int(np.prod(v.shape)) * v.dtype.itemsize for w in session.get_optimizer_state().values()
            for k, v in w.items() if k != "step")
        print(json.dumps({"step_s": statistics.median(times), "share": statistics.median(shares),
                          "batch": batch, "state_mb": state / 2**20}))


def _launch(world: int, args: argparse.Namespace) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(max(1, args.threads // world))}
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-child", "--dir", args.dir,
                                       "--model", args.model, "--reps", str(args.reps), "--warmup",
                                       str(args.warmup), "--threads", str(args.threads),
                                       "--zero", str(args.zero)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=1800)
            if proc.returncode != 0:
                raise SystemExit(f"rank failed (world {world}):\n{err[-2000:]}")
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return json.loads(outputs[0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert", choices=["mlp", "bert", "gpt2"])
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1],
                        help="ZeRO stage of the multi-rank runs (1: optimizer state partitioned)")
    parser.add_argument("--rank-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_child:
        rank_main(args)
        return
    worlds = [int(w) for w in args.ranks.split(",")]
    with tempfile.TemporaryDirectory(prefix="gradgraph_dp_bench_") as tmp:
        args.dir = tmp
        child_export(args.model, tmp)
        results: dict[int, list[dict]] = {w: [] for w in worlds}
        for r in range(args.rounds):
            for world in worlds:
                results[world].append(_launch(world, args))
                last = results[world][-1]
                print(f"round {r + 1}: {world} rank(s): step {last['step_s'] * 1000:.1f} ms, "
                      f"all-reduce share {last['share']:.1%}", file=sys.stderr)
    base = None
    print(f"\n{args.model}, {args.threads} cores shared, batch per rank "
          f"{results[worlds[0]][0]['batch']}, median of {args.rounds} rounds x {args.reps} steps\n")
    print("| ranks | step ms (rank 0) | samples/s | x one process | all-reduce share | optimizer state MB (rank 0) |")
    print("|---|---|---|---|---|---|")
    for world in worlds:
        step = statistics.median(x["step_s"] for x in results[world])
        share = statistics.median(x["share"] for x in results[world])
        rate = world * results[world][0]["batch"] / step
        base = base or rate
        state = results[world][0]["state_mb"]
        print(f"| {world} | {step * 1000:.1f} | {rate:.1f} | {rate / base:.2f} | {share:.1%} | {state:.1f} |")


if __name__ == "__main__":
    main()
