"""Where a gradgraph training step spends its time and memory: onnxruntime's profiler by op type.

    python tools/profile_training.py [--models bert,gpt2,mlp] [--steps 10] [--threads 2] [--top 15]
                                     [--keep DIR] [--json out.json]

The models are the benchmark's (tools/bench_training.py's MODELS: the peer definitions in
../shared/peer and the CNNs of tools/cnn_models.py, exported with the legacy exporter in
training mode; AdamW lr 1e-3, eps 1e-6, no weight decay).
Each model runs in its own child process: the training session is built, --warmup steps run,
then --steps steps run with onnxruntime's profiler on. Printed per model:

* the memory timeline of the child (resident MB after imports, after the build, after the first
  step, and the peak before the profiled session is made), so a change that lowers the peak
  can say where it did;
* the total kernel time per step and the share of the forward, backward and optimizer nodes (by
  the node marks gradgraph puts on every node it adds; the exporter's nodes are the forward;
  a node onnxruntime fused counts in the stage of the node it is named after), with each
  stage's top five op types;
* the top --top op types by kernel time per step: milliseconds, share, node count.

--keep DIR keeps onnxruntime's profile files and the training graph there.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_training  # noqa: E402 - tools/ is not a package
from timing import report_child, rss_mb, run_child  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _stage_of(node_name: str, stages: dict[str, str]) -> str:
    """The stage mark of the graph node that ``node_name`` (onnxruntime's) came from: onnxruntime
    names a fused node after the first node it fused, plus ``/<Fusion>/`` suffixes."""
    name = node_name
    while name:
        if name in stages:
            return stages[name]
        name = name.rstrip("/")
        if "/" not in name:
            break
        name = name.rsplit("/", 1)[0]
    return "forward"


def child_profile(name: str, out_dir: str, args) -> dict:
    import numpy as np
    import onnx
    import onnxruntime as ort

    from gradgraph import TrainingSession
    from gradgraph.training.build import TrainingConfig
    from passes.marks import STAGE_KEY
    from passes.optimizer import AdamWConfig

    memory = {"after_imports": rss_mb()}
    path = os.path.join(out_dir, f"{name}.onnx")
    feeds = dict(np.load(os.path.join(out_dir, f"{name}_inputs.npz")))
    trained = bench_training._trainable(onnx.load(path, load_external_data=False))
    config = TrainingConfig(loss="loss", optimizer=AdamWConfig(eps=bench_training.EPS, weight_decay=0.0),
                            weights_to_train=tuple(trained))
    opts = bench_training._session_options(args)
    start = time.perf_counter()
    session = TrainingSession(path, config, sess_options=opts, providers=["CPUExecutionProvider"])
    build_s = time.perf_counter() - start
    memory["after_build"] = rss_mb()
    session.train_step(feeds, lr=bench_training.LR)
    memory["after_first_step"] = rss_mb()
    for _ in range(args.warmup):
        session.train_step(feeds, lr=bench_training.LR)
    memory["peak"] = rss_mb("VmHWM")
    # A second session over the same training graph, profiled (the first stays unprofiled so the
    # timeline above is the plain session's).
    model = session.artifacts.train
    stages = {n.name: p.value for n in model.graph.node for p in n.metadata_props if p.key == STAGE_KEY}
    popts = bench_training._session_options(args)
    popts.enable_profiling = True
    popts.profile_file_prefix = os.path.join(out_dir, f"{name}_profile")
    profiled = TrainingSession(path, config, sess_options=popts, providers=["CPUExecutionProvider"])
    for _ in range(args.warmup):
        profiled.train_step(feeds, lr=bench_training.LR)
    start = time.perf_counter()
    for _ in range(args.steps):
        profiled.train_step(feeds, lr=bench_training.LR)
    wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    files = [profiled._train.session.end_profiling()]  # the train graph's session
    steps_profiled = args.steps + args.warmup  # onnxruntime profiles every run of the session
    by_type: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    by_stage: dict[str, float] = collections.Counter()
    by_stage_op: dict[str, float] = collections.Counter()
    nodes_seen: dict[str, set[str]] = collections.defaultdict(set)
    for file in files:
        with open(file) as f:
            events = json.load(f)
        for ev in events:
            if ev.get("cat") != "Node" or not ev.get("name", "").endswith("_kernel_time"):
                continue
            node = ev["name"][: -len("_kernel_time")]
            op = ev.get("args", {}).get("op_name", "?")
            by_type[op][0] += ev["dur"] / 1e3
            nodes_seen[op].add(node)
            stage = _stage_of(node, stages)
            by_stage[stage] += ev["dur"] / 1e3
            by_stage_op[f"{stage}:{op}"] += ev["dur"] / 1e3
    total = sum(v[0] for v in by_type.values())
    per_step = {op: (ms / steps_profiled, len(nodes_seen[op])) for op, (ms, _) in by_type.items()}
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        onnx.save(model, os.path.join(args.keep, f"{name}_training.onnx"), save_as_external_data=True,
                  location=f"{name}_training.onnx.data")
        for file in files:
            os.replace(file, os.path.join(args.keep, os.path.basename(file)))
    return {"ok": True, "build_s": build_s, "memory_mb": memory, "wall_ms": wall_ms,
            "kernel_ms": total / steps_profiled, "by_stage_ms": {k: v / steps_profiled for k, v in by_stage.items()},
            "by_type": per_step,
            "by_stage_op_ms": {k: v / steps_profiled for k, v in by_stage_op.items()}, "nodes": len(model.graph.node), "onnxruntime": ort.__version__}


def _report(name: str, rec: dict, top: int) -> None:
    mem = rec["memory_mb"]
    print(f"## {name}: {rec['nodes']} nodes in the training graph, build {rec['build_s']:.1f} s, "
          f"profiled step {rec['wall_ms']:.1f} ms wall, {rec['kernel_ms']:.1f} ms in kernels")
    print()
    print("Resident MB: after imports {:.0f}, after build {:.0f}, after the first step {:.0f}, peak {:.0f}"
          .format(mem["after_imports"], mem["after_build"], mem["after_first_step"], mem["peak"]))
    print()
    stages = rec["by_stage_ms"]
    print("Kernel time by stage: " + ", ".join(
        f"{k} {v:.1f} ms ({100 * v / rec['kernel_ms']:.0f}%)" for k, v in sorted(stages.items(), key=lambda kv: -kv[1])))
    print()
    for stage in sorted(stages, key=lambda k: -stages[k]):
        top_ops = sorted(((k.split(":", 1)[1], v) for k, v in rec["by_stage_op_ms"].items()
                          if k.split(":", 1)[0] == stage), key=lambda kv: -kv[1])[:5]
        print(f"- {stage}: " + ", ".join(f"{op} {ms:.1f}" for op, ms in top_ops))
    print()
    print("| op type | ms / step | share | nodes |")
    print("|---|---|---|---|")
    rows = sorted(rec["by_type"].items(), key=lambda kv: -kv[1][0])
    for op, (ms, count) in rows[:top]:
        print(f"| {op} | {ms:.2f} | {100 * ms / rec['kernel_ms']:.1f}% | {count} |")
    rest = rows[top:]
    if rest:
        ms = sum(v[0] for _, v in rest)
        print(f"| {len(rest)} other types | {ms:.2f} | {100 * ms / rec['kernel_ms']:.1f}% | "
              f"{sum(v[1] for _, v in rest)} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert,gpt2,mlp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--keep", help="keep the profiles and training graphs in this folder")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--child", choices=["export", "profile"])
    parser.add_argument("--model")
    parser.add_argument("--dir")
    args = parser.parse_args()
    if args.child == "export":
        report_child(lambda: bench_training.child_export(args.model, args.dir))
        return
    if args.child == "profile":
        report_child(lambda: child_profile(args.model, args.dir, args))
        return
    if args.steps < 1 or args.warmup < 0:
        sys.exit("--steps must be >= 1 and --warmup >= 0")
    base = [sys.executable, __file__, f"--steps={args.steps}", f"--warmup={args.warmup}",
            f"--threads={args.threads}"]
    if args.keep:
        base.append(f"--keep={os.path.abspath(args.keep)}")
    records = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            print(f"{name}: export ...", file=sys.stderr, flush=True)
            export = run_child([*base, "--child", "export", "--model", name, "--dir", tmp])
            if not export.get("ok"):
                print(f"WARNING: {name}: export failed: {export.get('error')}")
                continue
            print(f"{name}: build and profile ...", file=sys.stderr, flush=True)
            rec = run_child([*base, "--child", "profile", "--model", name, "--dir", tmp])
            if not rec.get("ok"):
                print(f"WARNING: {name}: profile failed: {rec.get('error')}")
                continue
            records[name] = rec
            _report(name, rec, args.top)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if not records:
        sys.exit("no model was profiled")


if __name__ == "__main__":
    main()
