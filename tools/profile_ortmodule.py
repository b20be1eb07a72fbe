"""Where ORTModule's training step goes, against PyTorch eager in the same process.

    python tools/profile_ortmodule.py [--models bert,gpt2] [--device cpu|cuda] [--steps 20] [--top-nodes N]

For each model of the training benchmark (tools/bench_training.py: the peer's set in ../shared/peer, set
GRADGRAPH_PEER_DIR elsewhere): the median forward / backward / optimizer milliseconds of
PyTorch eager and of ``ORTModule`` (each phase timed to its end: ``torch.cuda.synchronize()``
on a GPU), then for each onnxruntime session ORTModule built: its node count, the median of
its runs (onnxruntime's profiler), its nodes per provider and the op types that take the most
time per run (on CUDA this is the host's launch time: kernels run asynchronously), the ops the
CPU provider runs. On CUDA, torch's profiler adds the GPU time of all kernels per step
(onnxruntime's and torch's) and the largest of them (host <-> device copies show there).

The ratios of one run compare peers measured in one process, one after the other: quote them
with the machine, and rerun for the spread.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import PEER  # noqa: E402 - tools/ is not a package


def _phases(model: Any, opt: Any, batch: tuple, steps: int, warmup: int, sync: Any) -> list[float]:
    """Median milliseconds of forward, backward and optimizer step over ``steps`` steps."""
    times = []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        loss = model(*batch)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= warmup:
            times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    return [statistics.median(t[k] for t in times) * 1e3 for k in range(3)]


def _session_report(index: int, path: str, model: Any, device_type: str, top_nodes: int = 0) -> None:
    with open(path) as f:
        events = json.load(f)
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    runs = [e["dur"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    n = max(len(runs), 1)
    per_provider = collections.Counter(e["args"].get("provider", "?") for e in nodes)
    per_op: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in nodes:
        key = (e["args"].get("provider", "?").replace("ExecutionProvider", ""), e["args"].get("op_name", "?"))
        per_op[key][0] += 1
        per_op[key][1] += e["dur"]
    ops = collections.Counter(node.op_type for node in model.graph.node)
    print(f"  session {index}: {len(model.graph.node)} nodes, {len(runs)} runs, median run "
          f"{statistics.median(runs) / 1e3 if runs else float('nan'):.2f} ms; kernels per run by provider "
          f"{ {p: c // n for p, c in per_provider.items()} }")
    print(f"    most frequent ops: {ops.most_common(10)}")
    top = sorted(per_op.items(), key=lambda kv: -kv[1][1])[:12]
    print("    time per run by provider:op (count): " + "; ".join(
        f"{p}:{o} ({int(c) // n}) {t / n / 1e3:.2f} ms" for (p, o), (c, t) in top))
    if top_nodes:
        per_node: dict[tuple[str, str], float] = collections.defaultdict(float)
        for e in nodes:
            per_node[(e["args"].get("op_name", "?"), e["name"][: -len("_kernel_time")])] += e["dur"]
        print(f"    the {top_nodes} slowest nodes, ms per run:")
        for (op, name), t in sorted(per_node.items(), key=lambda kv: -kv[1])[:top_nodes]:
            print(f"      {t / n / 1e3:7.2f}  {op:<14} {name}")
    on_cpu = sorted({o for (p, o) in per_op if p == "CPU"})
    if on_cpu and device_type != "cpu":
        print(f"    ops on the CPU provider: {on_cpu}")


@contextlib.contextmanager
def profiled_sessions(runner: Any, prefix: str) -> Iterator[list[tuple[Any, Any]]]:
    """While on, every session the front ends' ``runner`` makes is profiled (onnxruntime's files
    ``<prefix>_<n>_*.json``); yields the (session, model proto) pairs made, in order, and puts
    ``runner.inference_session`` back after."""
    made: list[tuple[Any, Any]] = []
    make = runner.inference_session

    def profiled(model: Any, opts: Any, *rest: Any, **kw: Any) -> Any:
        opts.enable_profiling = True
        opts.profile_file_prefix = f"{prefix}_{len(made)}"
        session = make(model, opts, *rest, **kw)
        made.append((session, model))
        return session

    runner.inference_session = profiled
    try:
        yield made
    finally:
        runner.inference_session = make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert,gpt2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top-nodes", type=int, default=0, help="also list each session's N slowest nodes")
    args = parser.parse_args()
    if args.top_nodes < 0:
        parser.error("--top-nodes must be >= 0")
    import torch

    from gradgraph.torch import ORTModule, runner

    if not (PEER / "models_def.py").exists():
        sys.exit(f"peer material not found at {PEER} (set GRADGRAPH_PEER_DIR)")
    sys.path.insert(0, str(PEER))
    import bench_training  # noqa: PLC0415 - tools/ is not a package

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    folder = tempfile.mkdtemp(prefix="gradgraph_profile_")
    for name in args.models.split(","):
        with profiled_sessions(runner, f"{folder}/{name}_session") as sessions:  # ORTModule's, profiled
            torch.manual_seed(0)
            module, batch, _ = bench_training.build_model(name)  # the peer's models and the CNNs
            module.to(device).train()
            batch = tuple(t.to(device) for t in batch)
            medians = {}
            for peer in ("torch", "ortmodule"):
                model = module if peer == "torch" else ORTModule(module, fallback="raise", threads=args.threads)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                medians[peer] = _phases(model, opt, batch, args.steps, args.warmup, sync)
            ratio = sum(medians["ortmodule"]) / sum(medians["torch"])
            print(f"{name} on {device} ({args.steps} steps after {args.warmup}): forward / backward / optimizer "
                  f"ms, medians: torch " + " / ".join(f"{m:.2f}" for m in medians["torch"])
                  + "; ortmodule " + " / ".join(f"{m:.2f}" for m in medians["ortmodule"])
                  + f"; step ratio ortmodule / torch {ratio:.2f}")
            if cuda:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        loss = model(*batch)
                        loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    sync()
                averages = prof.key_averages()
                gpu_ms = sum(e.self_device_time_total for e in averages) / 3 / 1e3
                print(f"  GPU time of all kernels per ORTModule step (torch's profiler): {gpu_ms:.2f} ms")
                print(averages.table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=60))
            for index, (session, model) in enumerate(sessions):
                _session_report(index, session.end_profiling(), model, device.type, args.top_nodes)


if __name__ == "__main__":
    main()
