"""ORTModule against PyTorch eager: training-step time, first-call overhead, peak RSS.

    python tools/bench_ortmodule.py [--models bert,gpt2] [--rounds 5] [--reps 10] [--threads 2]
                                    [--device cpu|cuda] [--no-wait]

Models: the peer's BERT-like and GPT-2-like modules (../shared/peer/models_def.py: 4 layers,
hidden 256, seq 128, batch 8, dropout 0.1 active), each returning its loss; also any model of
the training benchmark (tools/bench_training.py's MODELS: the peer's ``mlp`` and ``cnn``, and
tools/cnn_models.py's ``resnet18`` and ``mobilenetv2``, batch 32 x 3 x 32 x 32). One step =
``loss = model(*batch); loss.backward(); AdamW step; zero_grad`` with the same torch optimizer
for both peers: plain module (``torch``) and ``gradgraph.torch.ORTModule(module)``
(``ortmodule``). The peers alternate in rounds, each run in its own process (so a slow minute
of the machine does not land on one peer only); printed per model: each peer's median step
time over the rounds, the median of the per-round ratios ortmodule / torch with their min-max,
ORTModule's first call (export + graph build + first step) and peak RSS, then each peer's
median forward / backward / optimizer milliseconds (medians over the rounds of per-round
medians: they need not add up to the step's median).

The bound: the step's FLOPs (forward + backward, torch's FlopCounterMode) and the GEMM peak of
onnxruntime on this machine (a 2048x2048 float32 MatMul, same threads), both measured by
``bench_training.py``'s children in this run; printed are ORTModule's achieved GFLOP/s, its
share of the peak, and the floor ratio: the step's FLOPs at the GEMM peak against torch's step,
i.e. the ratio ORTModule would reach if every FLOP ran at the peak and nothing else took time.
With ``--device cuda`` both peers run on the GPU (onnxruntime-gpu's CUDAExecutionProvider for
ORTModule), each step ends with ``torch.cuda.synchronize()``, and no GEMM bound is printed; peak
RSS is then host memory only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import (  # noqa: E402 - tools/ is not a package
    PEER,
    report_child,
    run_child,
    time_steps,
    time_steps_no_wait,
)

PEERS = ("torch", "ortmodule")


def child(name: str, peer: str, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import bench_training  # noqa: PLC0415 - tools/ is on sys.path

    module, batch, _ = bench_training.build_model(name)
    module.train()
    device = torch.device(args.device)
    module.to(device).train()
    batch = tuple(t.to(device) for t in batch)
    model = module
    if peer == "ortmodule":
        from gradgraph.torch import ORTModule

        model = ORTModule(module, fallback="raise", threads=args.threads)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0)

    phases: list[tuple[float, float, float]] = []  # forward, backward, optimizer seconds

    def step() -> float:
        t0 = time.perf_counter()
        loss = model(*batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":  # the step's kernels done (the phases below are launch times)
            torch.cuda.synchronize(device)
        phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        return float(loss.detach())

    start = time.perf_counter()
    first_loss = step()
    first = time.perf_counter() - start
    timing = (time_steps_no_wait if args.no_wait else time_steps)(step, args.warmup, args.reps)
    timed = phases[-args.reps:]  # the last attempt's timed calls (a busy machine may be re-measured)
    split = {f"{name}_ms": statistics.median(p[i] for p in timed) * 1e3
             for i, name in enumerate(("forward", "backward", "optimizer"))}
    return {"ok": True, "first_s": first, "first_loss": first_loss, **timing, **split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert,gpt2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda / cuda:N (needs a CUDA torch and onnxruntime-gpu)")
    parser.add_argument("--no-wait", action="store_true",
                        help="no wait for a quiet machine nor re-measuring (quick checks on a busy machine)")
    parser.add_argument("--child", choices=PEERS)
    parser.add_argument("--model")
    args = parser.parse_args()
    if args.child:
        report_child(lambda: child(args.model, args.child, args))
        return
    if not (PEER / "models_def.py").exists():
        sys.exit(f"peer material not found at {PEER} (set GRADGRAPH_PEER_DIR)")
    bench_training = str(Path(__file__).resolve().parent / "bench_training.py")
    common = [f"--threads={args.threads}", "--provider=cpu", *(["--no-wait"] if args.no_wait else [])]
    on_cpu = args.device == "cpu"
    # the GEMM bound is measured for the CPU only
    gemm = run_child([sys.executable, bench_training, "--child", "gemm", *common]) if on_cpu else {}
    if not on_cpu:
        print(f"device {args.device}: no GEMM bound (it is measured for the CPU only)")
    elif gemm.get("ok"):
        print(f"GEMM peak: {gemm['gflops']:.1f} GFLOP/s (2048x2048 float32 MatMul in onnxruntime "
              f"{gemm.get('onnxruntime')}, {args.threads} threads)")
    else:
        print(f"WARNING: GEMM peak not measured: {gemm.get('error')}")
    env_note = f"{args.device}, {args.threads} threads, {args.rounds} rounds, median of {args.reps} steps after {args.warmup} warm-ups"
    print(f"training step (forward + backward + torch AdamW), {env_note}")
    print(f"{'model':<11} {'torch ms':>9} {'ortmodule ms':>12} {'ratio (min-max)':>22} "
          f"{'first call s':>12} {'peak RSS MB torch / ortmodule':>30}")
    for name in args.models.split(","):
        rounds: list[dict[str, dict]] = []
        for _ in range(args.rounds):
            one = {}
            for peer in PEERS:
                one[peer] = run_child([sys.executable, __file__, "--child", peer, "--model", name,
                                  f"--threads={args.threads}", f"--reps={args.reps}", f"--warmup={args.warmup}",
                                  f"--device={args.device}", *(["--no-wait"] if args.no_wait else [])])
                if not one[peer].get("ok"):
                    print(f"{name} {peer}: failed: {one[peer].get('error')}")
            rounds.append(one)
        good = [r for r in rounds if all(r[p].get("ok") for p in PEERS)]
        if not good:
            continue
        ratios = [r["ortmodule"]["median_ms"] / r["torch"]["median_ms"] for r in good]
        med = {p: statistics.median(r[p]["median_ms"] for r in good) for p in PEERS}
        first = statistics.median(r["ortmodule"]["first_s"] for r in good)
        rss = {p: max(r[p]["peak_rss_mb"] for r in good) for p in PEERS}
        print(f"{name:<11} {med['torch']:>9.1f} {med['ortmodule']:>12.1f} "
              f"{statistics.median(ratios):>8.2f} ({min(ratios):.2f}-{max(ratios):.2f})      "
              f"{first:>12.1f} {rss['torch']:>14.0f} / {rss['ortmodule']:.0f}")
        for peer in PEERS:
            parts = " / ".join(f"{statistics.median(r[peer][f'{k}_ms'] for r in good):.1f}"
                               for k in ("forward", "backward", "optimizer"))
            print(f"       {peer}: forward / backward / optimizer ms {parts}")
        if not on_cpu:
            continue
        flops = run_child([sys.executable, bench_training, "--child", "flops", "--model", name, *common])
        if flops.get("ok") and gemm.get("ok"):
            gflop = flops["flops"] / 1e9
            achieved = gflop / (med["ortmodule"] * 1e-3)
            floor_ms = gflop / gemm["gflops"] * 1e3
            print(f"       step {gflop:.2f} GFLOP: ortmodule {achieved:.1f} GFLOP/s = "
                  f"{100 * achieved / gemm['gflops']:.0f}% of the GEMM peak; at the peak the step "
                  f"would take {floor_ms:.1f} ms = {floor_ms / med['torch']:.2f} of torch's")
        elif not flops.get("ok"):
            print(f"       FLOP count failed: {flops.get('error')}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
