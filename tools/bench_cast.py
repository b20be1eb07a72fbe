"""Cast-propagation and mixed-precision benchmark: Cast counts and training-step time.

    python tools/bench_cast.py [--models bert,gpt2] [--reps 5] [--threads 2]

Models: the BERT-like and GPT-2-like models of ../shared/peer/models_def.py, exported as in
tools/bench_training.py (legacy exporter, training mode, dropout 0.1 active). For each model
and each configuration, a ``gradgraph.TrainingSession`` (AdamW, CPU) is built in one child
process; printed: Cast nodes in the forward graph after the graph transforms and in the whole
training graph, and the median time of --reps training steps after 2 warm-ups, with its ratio
to fp32 without cast propagation. Configurations: fp32 with PropagateCastOps at each strategy
(INSERT_AND_REDUCE, FLOOD_FILL) and level (0 with the allow list [Transpose, Reshape], 1, 2),
and fp16 mixed precision alone and with each strategy at level 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = ["fp32"] + [f"fp32-{s}-{lvl}" for s in ("INSERT_AND_REDUCE", "FLOOD_FILL")
                      for lvl in (0, 1, 2)] + \
          ["fp16"] + [f"fp16-{s}-1" for s in ("INSERT_AND_REDUCE", "FLOOD_FILL")]


def _config(name: str):
    from gradgraph import (
        AdamWConfig,
        CastPropagationConfig,
        CastStrategy,
        GraphTransformerOptions,
        MixedPrecisionConfig,
        TrainingConfig,
    )

    parts = name.split("-")
    dtype = "float16" if parts[0] == "fp16" else None
    cast = CastPropagationConfig()
    if len(parts) == 3:
        level = int(parts[2])
        cast = CastPropagationConfig(CastStrategy[parts[1]], level,
                                     ("Transpose", "Reshape") if level == 0 else ())
    return TrainingConfig("loss", AdamWConfig(eps=1e-6, weight_decay=0.0),
                          graph_transformer=GraphTransformerOptions(propagate_cast_ops=cast),
                          mixed_precision=MixedPrecisionConfig(dtype=dtype))


def child(name: str, out_dir: str, config: str, args) -> dict:
    import numpy as np
    import onnx
    import onnxruntime as ort

    from gradgraph import TrainingSession

    path = os.path.join(out_dir, f"{name}.onnx")
    feeds = dict(np.load(os.path.join(out_dir, f"{name}_inputs.npz")))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.inter_op_num_threads = 1
    transformed = os.path.join(out_dir, f"{name}_{config}_transformed.onnx")
    cfg = _config(config)
    import dataclasses

    from gradgraph import DebugOptions, GraphSavePaths

    cfg = dataclasses.replace(cfg, debug=DebugOptions(GraphSavePaths(
        model_after_graph_transforms_path=transformed)))
    session = TrainingSession(path, cfg, sess_options=opts, providers=["CPUExecutionProvider"])
    forward_casts = sum(n.op_type == "Cast" for n in onnx.load(transformed).graph.node)
    train_casts = sum(n.op_type == "Cast" for n in session.artifacts.train.graph.node)
    times, losses = [], []
    for i in range(2 + args.reps):
        start = time.perf_counter()
        losses.append(session.train_step(feeds, lr=1e-3))
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return {"forward_casts": forward_casts, "train_casts": train_casts,
            "median_ms": statistics.median(times), "loss_first": losses[0], "loss_last": losses[-1]}


def _run(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert,gpt2")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--model")
    parser.add_argument("--dir")
    parser.add_argument("--config")
    parser.add_argument("--export", action="store_true")
    args = parser.parse_args()
    if args.child:
        if args.export:
            sys.argv = [sys.argv[0]]
            import bench_training

            print(json.dumps(bench_training.child_export(args.model, args.dir)))
        else:
            print(json.dumps(child(args.model, args.dir, args.config, args)))
        return
    print(f"{'model':<6} {'config':<28} {'fwd casts':>9} {'train casts':>11} {'median ms':>10} "
          f"{'x fp32':>7} {'loss first -> last':>22}")
    with tempfile.TemporaryDirectory() as out_dir:
        for name in args.models.split(","):
            _run(["--child", "--export", "--model", name, "--dir", out_dir])
            base = None
            for config in CONFIGS:
                started = time.perf_counter()
                rec = _run(["--child", "--model", name, "--dir", out_dir, "--config", config,
                            "--reps", str(args.reps), "--threads", str(args.threads)])
                if "error" in rec:
                    print(f"{name:<6} {config:<28} error: {rec['error']}")
                    continue
                base = rec["median_ms"] if config == "fp32" else base
                ratio = rec["median_ms"] / base if base else float("nan")
                print(f"{name:<6} {config:<28} {rec['forward_casts']:>9} {rec['train_casts']:>11} "
                      f"{rec['median_ms']:>10.1f} {ratio:>7.2f} "
                      f"{rec['loss_first']:>10.4f} -> {rec['loss_last']:<9.4f}"
                      f"  ({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
