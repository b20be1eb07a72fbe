"""Recompute benchmark: stashed bytes, peak RSS and step time with and without recompute.

    python tools/bench_recompute.py [--models bert,gpt2] [--quick] [--reps 10] [--threads 2]
                                    [--ort-venv .venv-ort-training]

Models: the BERT-like and GPT-2-like models of ../shared/peer/models_def.py (4 layers, hidden
256, seq 128, batch 8, dropout 0.1 active), exported with the legacy exporter as in
tools/bench_training.py. For each, the forward+backward graph of
``gradgraph.build_gradient_graph`` (every float parameter trained) runs in a stock onnxruntime
InferenceSession, one configuration per child process (so peak RSS is per configuration):

1. ``none``: no recompute;
2. ``layers``: ``RecomputeOptions(transformer_layers=True)``;
3. ``planner50``: ``RecomputeOptions(memory_budget=50% of the no-recompute stash bytes)``;

each with onnxruntime's default execution order and with ``ExecutionOrder.PRIORITY_BASED``,
CommonSubexpressionElimination disabled (it merges the clones back), CPU arena and memory
pattern off unless --arena (they make RSS grow in chunks).
Printed: static stash bytes (passes.recompute.analysis), peak RSS of the child (ru_maxrss),
the RSS growth during the runs (peak minus RSS after session creation: the activations),
the median step time (plain median of --reps runs after warm-ups), and ratios to ``none``
under the same execution order.
onnxruntime-training's own figures come from the peer's script (../shared/peer/
ort_train_bench.py) when the reference venv exists (not with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_training import _run_child  # noqa: E402 - tools/ is not a package
from timing import PEER  # noqa: E402

CONFIGS = ("none", "layers", "planner50")
ORDERS = ("default", "priority")
PLANNER_FRACTION = 0.5


def _rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def child_export(name: str, out_dir: str) -> dict:
    sys.argv = [sys.argv[0]]
    import bench_training  # the same export as the training benchmark

    rec = bench_training.child_export(name, out_dir)
    import onnx

    import gradgraph

    path = rec["path"]
    trained = bench_training._trainable(onnx.load(path, load_external_data=False))
    start = time.perf_counter()
    grad = gradgraph.build_gradient_graph(path, "loss", trained)
    onnx.save(grad, os.path.join(out_dir, f"{name}_grad.onnx"))
    return {"ok": True, "build_s": time.perf_counter() - start, "trained": len(trained)}


def child_run(name: str, out_dir: str, config: str, order: str, args) -> dict:
    import numpy as np
    import onnx_ir as ir
    import onnxruntime as ort

    from passes.recompute import RecomputeOptions, RecomputePass, total_stash_bytes
    from passes.recompute.recompute_pass import SESSION_DISABLED_OPTIMIZERS

    model = ir.load(os.path.join(out_dir, f"{name}_grad.onnx"))
    base, _ = total_stash_bytes(model)
    options = {"none": None, "layers": RecomputeOptions(transformer_layers=True),
               "planner50": RecomputeOptions(memory_budget=int(base * PLANNER_FRACTION))}[config]
    clones = 0
    if options is not None:
        RecomputePass(options)(model)
        clones = sum(1 for n in model.graph if n.metadata_props.get("gradgraph.stage") == "recompute")
    stash, unknown = total_stash_bytes(model)
    roles = {n.name: n.metadata_props.get("gradgraph.stage", "forward") for n in model.graph}
    data = ir.to_proto(model).SerializeToString()
    del model
    feeds = dict(np.load(os.path.join(out_dir, f"{name}_inputs.npz")))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, args.opt_level)
    if order == "priority":
        opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    opts.enable_cpu_mem_arena = args.arena
    opts.enable_mem_pattern = args.arena
    if args.profile:
        opts.enable_profiling = True
        opts.profile_file_prefix = os.path.join(out_dir, f"profile_{name}_{config}_{order}")
    # CSE would merge every clone back into its original (passes/recompute/recompute_pass.py)
    session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"],
                                   disabled_optimizers=list(SESSION_DISABLED_OPTIMIZERS))
    del data
    names = {i.name for i in session.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in names}
    before = _rss_mb()
    peak_before = _rss_mb("VmHWM")
    times = []
    for i in range(args.warmup + args.reps):
        start = time.perf_counter()
        session.run(None, feeds)
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    peak = _rss_mb("VmHWM")
    early = _clones_in_forward(session.end_profiling(), roles) if args.profile else None
    return {"clones_before_backward": early,"ok": True, "stash_bytes": stash, "unknown": unknown, "clones": clones,
            "median_ms": statistics.median(times), "rss_session_mb": before,
            "run_growth_mb": peak - before, "peak_before_run_mb": peak_before}


def _clones_in_forward(profile: str, roles: dict[str, str]) -> int:
    """How many recompute clones onnxruntime ran before its first backward node (1st run)."""
    with open(profile) as f:
        events = json.load(f)
    seen: set[str] = set()
    early = 0
    for event in events:
        name = event.get("name", "")
        if event.get("cat") != "Node" or not name.endswith("_kernel_time"):
            continue
        node = name[: -len("_kernel_time")]
        if node in seen:
            break  # the second run starts
        seen.add(node)
        role = roles.get(node)
        if role == "backward":
            break
        early += role == "recompute"
    return early


def _ort_training(name: str, out_dir: str, venv: Path) -> dict:
    sys.argv = [sys.argv[0]]
    import bench_training

    return bench_training._ort_training(name, out_dir, venv)


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert,gpt2")
    parser.add_argument("--quick", action="store_true", help="2 reps, 1 warm-up, no onnxruntime-training")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--opt-level", default="ORT_ENABLE_ALL",
                        choices=["ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL"])
    parser.add_argument("--arena", action=argparse.BooleanOptionalAction, default=False,
                        help="onnxruntime's CPU arena and memory pattern (off by default: with them "
                             "RSS grows in arena chunks and hides what the graph keeps alive)")
    parser.add_argument("--profile", action="store_true",
                        help="count the clones onnxruntime runs before the first backward node")
    parser.add_argument("--ort-venv", default=os.environ.get("GRADGRAPH_ORT_TRAINING_VENV",
                                                             str(ROOT / ".venv-ort-training")))
    parser.add_argument("--child", choices=["export", "run"])
    parser.add_argument("--model")
    parser.add_argument("--dir")
    parser.add_argument("--config", choices=CONFIGS)
    parser.add_argument("--order", choices=ORDERS, default="default")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.warmup = 2, 1
    if args.child:
        try:
            rec = (child_export(args.model, args.dir) if args.child == "export"
                   else child_run(args.model, args.dir, args.config, args.order, args))
        except Exception as exc:  # noqa: BLE001 - reported by the parent
            rec = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:800]}
        rec["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        print("RESULT " + json.dumps(rec), flush=True)
        return
    if not (PEER / "models_def.py").exists():
        sys.exit(f"peer material not found at {PEER} (set GRADGRAPH_PEER_DIR)")
    common = [f"--threads={args.threads}", f"--reps={args.reps}", f"--warmup={args.warmup}",
              f"--opt-level={args.opt_level}", "--arena" if args.arena else "--no-arena",
              *(["--profile"] if args.profile else [])]
    print(f"forward+backward graph run (InferenceSession, {args.opt_level}, {args.threads} threads); "
          f"median of {args.reps} runs after {args.warmup} warm-ups")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            me = [sys.executable, __file__, "--model", name, "--dir", tmp]
            export = _run_child(me + ["--child", "export"])
            if not export.get("ok"):
                print(f"{name}: export failed: {export.get('error')}")
                continue
            for config in CONFIGS:
                for order in ORDERS:
                    rec = _run_child(me + ["--child", "run", "--config", config, "--order", order, *common])
                    if not rec.get("ok"):
                        print(f"{name} {config} {order}: failed: {rec.get('error')}")
                    rows.append((name, f"{config}/{order}", rec))
            if args.quick:
                print(f"{name}: onnxruntime-training skipped (--quick)")
            else:
                ort_rec = _ort_training(name, tmp, Path(args.ort_venv))
                print(f"{name}: onnxruntime-training (no recompute: the on-device training API has "
                      "no recompute switch, and its memory optimizer needs a YieldOp): "
                      + (f"step {_fmt(ort_rec.get('median_ms'))} ms (fwd+bwd+AdamW), peak RSS "
                         f"{_fmt(ort_rec.get('peak_rss_mb'), '.0f')} MB" if ort_rec.get("ok")
                         else f"skipped: {ort_rec.get('error')}"))
    header = (f"{'model':<5} {'config/order':<20} {'clones':>6} {'stash MB':>9} {'x none':>6} "
              f"{'peak RSS MB':>11} {'run growth MB':>13} {'x none':>6} {'median ms':>9} {'x none':>6}")
    print(header)
    base: dict[str, dict] = {}
    for name, label, rec in rows:
        if not rec.get("ok"):
            continue
        order = label.split("/")[1]  # ratios against no recompute under the same order
        ref = base.setdefault(f"{name}/{order}", rec) if label.startswith("none/") \
            else base.get(f"{name}/{order}", rec)

        def ratio(key: str, rec=rec, ref=ref) -> str:
            return _fmt(rec[key] / ref[key] if ref.get(key) else None, ".2f")

        print(f"{name:<5} {label:<20} {rec['clones']:>6} {rec['stash_bytes'] / 2**20:>9.1f} "
              f"{ratio('stash_bytes'):>6} {rec['peak_rss_mb']:>11.0f} {rec['run_growth_mb']:>13.0f} "
              f"{ratio('run_growth_mb'):>6} {rec['median_ms']:>9.1f} {ratio('median_ms'):>6}")


if __name__ == "__main__":
    main()
