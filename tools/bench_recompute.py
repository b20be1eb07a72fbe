"""Recompute benchmark: the activations kept, peak memory and step time, gradgraph vs onnxruntime-training.

    python tools/bench_recompute.py [--models bert,gpt2] [--quick] [--reps 10] [--threads 2]
                                    [--ort-venv .venv-ort-training]

Models: the BERT-like and GPT-2-like models of ../shared/peer/models_def.py (4 layers, hidden
256, seq 128, batch 8, dropout 0.1 active), exported with the legacy exporter as in
tools/bench_training.py; every float weight trained. Each configuration runs forward +
backward (no optimizer) split at the forward/backward boundary, in its own processes:

- gradgraph (stock onnxruntime): the graph of ``gradgraph.build_gradient_graph`` with
  ``none`` (no recompute), ``layers`` (``RecomputeOptions(transformer_layers=True)``) or
  ``planner50`` (``RecomputeOptions(memory_budget=50% of the no-recompute stash bytes)``),
  weights made inputs, split by ``passes.split.split_forward_backward`` into a forward and a
  backward session (the stash passed as OrtValues, no copies);
- onnxruntime-training 1.19.2 (its venv, ``tools/ort_recompute_worker.py``): ORTModule's own
  graph builder and TrainingAgent, with ``none``, ``transformer_layer``
  (TransformerLayerRecompute), ``gelu_attn`` (Gelu + attention-dropout recompute) or
  ``memopt_level1`` (the memory optimizer as ORTMODULE_MEMORY_OPT_LEVEL=1 configures it).

Printed per configuration: the static stash bytes (gradgraph: passes.recompute.analysis); the
*boundary*: RSS the forward adds, i.e. the activations alive when the backward starts
(measured); the step's RSS growth (peak minus RSS before the first step: activations plus the
backward's transients); the median step time of the split run; for gradgraph, also the whole
graph in one session (as TrainingSession runs it). Memory runs fix glibc's mmap threshold
(see ``_run``); time runs do not (page faults would slow both peers). CPU arena and memory
pattern are off unless --arena (they make RSS grow in chunks). Ratios are to ``none`` of the
same peer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import PEER, report_child, rss_mb, run_child, timed_runs  # noqa: E402

CONFIGS = ("none", "layers", "planner50")
# onnxruntime-training's own recompute options (tools/ort_recompute_worker.py)
ORT_CONFIGS = ("none", "transformer_layer", "gelu_attn", "memopt_level1")
PLANNER_FRACTION = 0.5


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
    with open(os.path.join(out_dir, f"{name}_trained.json"), "w") as f:
        json.dump(trained, f)
    return {"ok": True, "build_s": time.perf_counter() - start, "trained": len(trained)}


def _sessions_options(args, ort):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, args.opt_level)
    opts.enable_cpu_mem_arena = args.arena
    opts.enable_mem_pattern = args.arena
    # Two sessions run one after the other: a pool that spins after its run would hold the
    # cores the other session needs. The backward follows the graph order, where the recompute
    # pass placed each clone just before its first reader.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    return opts


def child_run(name: str, out_dir: str, config: str, args) -> dict:
    """One configuration: the graph split at the forward/backward boundary, run as two sessions.

    ``--measure memory`` (run with MALLOC_MMAP_THRESHOLD_ fixed, so that RSS follows what is
    allocated): the RSS the forward adds (the stash, alive until the backward) and the step's
    RSS growth; ``--measure time``: median step time of the split run and of the whole graph
    in one session (how ``TrainingSession`` runs it).
    """
    import numpy as np
    import onnx_ir as ir
    import onnxruntime as ort

    from passes.forward.params_to_inputs import ParamsToInputsPass
    from passes.recompute import RecomputeOptions, RecomputePass, total_stash_bytes
    from passes.recompute.recompute_pass import SESSION_DISABLED_OPTIMIZERS
    from passes.split import split_forward_backward

    model = ir.load(os.path.join(out_dir, f"{name}_grad.onnx"))
    base, _ = total_stash_bytes(model)
    options = {"none": None, "layers": RecomputeOptions(transformer_layers=True),
               "planner50": RecomputeOptions(memory_budget=int(base * PLANNER_FRACTION))}[config]
    clones = 0
    if options is not None:
        RecomputePass(options)(model)
        clones = sum(1 for n in model.graph if n.metadata_props.get("gradgraph.stage") == "recompute")
    stash, unknown = total_stash_bytes(model)
    # Weights become inputs, fed to both halves (as onnxruntime-training's TrainingAgent feeds them).
    with open(os.path.join(out_dir, f"{name}_trained.json")) as f:
        trained = json.load(f)
    to_inputs = ParamsToInputsPass(trained)
    to_inputs(model)
    feeds = {**{k: np.ascontiguousarray(v) for k, v in to_inputs.values.items()},
             **dict(np.load(os.path.join(out_dir, f"{name}_inputs.npz")))}
    split = split_forward_backward(model)
    disabled = list(SESSION_DISABLED_OPTIMIZERS)  # CSE would merge every clone back
    opts = _sessions_options(args, ort)
    cpu = ["CPUExecutionProvider"]
    fwd = ort.InferenceSession(ir.to_proto(split.forward).SerializeToString(), opts, providers=cpu,
                               disabled_optimizers=disabled)
    bwd = ort.InferenceSession(ir.to_proto(split.backward).SerializeToString(), opts, providers=cpu,
                               disabled_optimizers=disabled)
    whole = None
    if args.measure == "time":
        whole = ort.InferenceSession(ir.to_proto(model).SerializeToString(), opts, providers=cpu,
                                     disabled_optimizers=disabled)
    del model
    values = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in feeds.items()}
    fwd_in = {i.name: values[i.name] for i in fwd.get_inputs()}
    fwd_out = [o.name for o in fwd.get_outputs()]
    bwd_caller = {i.name: values[i.name] for i in bwd.get_inputs() if i.name in values}
    bwd_out = [o.name for o in bwd.get_outputs()]
    boundary: list[float] = []

    def step() -> None:
        before = rss_mb()
        outs = dict(zip(fwd_out, fwd.run_with_ort_values(fwd_out, fwd_in)))
        boundary.append(rss_mb() - before)
        bwd.run_with_ort_values(bwd_out, {**bwd_caller, **{k: outs[k] for k in split.from_forward}})
        del outs

    start_rss = rss_mb()
    times = timed_runs(step, args.warmup, args.reps)
    rec = {"ok": True, "stash_bytes": stash, "unknown": unknown, "clones": clones,
           "stashed_values": len(split.stashed)}
    if args.measure == "memory":
        rec.update(boundary_mb=statistics.median(boundary), run_growth_mb=rss_mb("VmHWM") - start_rss)
    else:
        whole_feeds = {i.name: values[i.name] for i in whole.get_inputs()}
        whole_times = timed_runs(lambda: whole.run_with_ort_values(None, whole_feeds), args.warmup, args.reps)
        rec.update(median_ms=statistics.median(times), whole_ms=statistics.median(whole_times))
    return rec


def _run(argv: list[str], memory: bool) -> dict:
    """A child process; a memory run fixes glibc's mmap threshold so that RSS follows allocation.

    glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed, after which
    freed activations stay in the heap and RSS no longer drops: RSS differences would then
    measure the allocator, not the graph. 64 KiB fixed sends every tensor to its own mapping.
    """
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"} if memory else None
    return run_child(argv, env)


def _measured(argv: list[str]) -> dict:
    """Memory and time of one configuration, from two child processes."""
    memory = _run(argv + ["--measure", "memory"], memory=True)
    if not memory.get("ok"):
        return memory
    timing = _run(argv + ["--measure", "time"], memory=False)
    if not timing.get("ok"):
        return timing
    return {**memory, **{k: v for k, v in timing.items() if k not in ("peak_rss_mb",)},
            "peak_rss_mb": memory.get("peak_rss_mb")}


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
    parser.add_argument("--ort-venv", default=os.environ.get("GRADGRAPH_ORT_TRAINING_VENV",
                                                             str(ROOT / ".venv-ort-training")))
    parser.add_argument("--child", choices=["export", "run"])
    parser.add_argument("--model")
    parser.add_argument("--dir")
    parser.add_argument("--config", choices=CONFIGS)
    parser.add_argument("--measure", choices=["memory", "time"], default="time")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.warmup = 2, 1
    if args.child:
        report_child(lambda: child_export(args.model, args.dir) if args.child == "export"
                     else child_run(args.model, args.dir, args.config, args))
        return
    if not (PEER / "models_def.py").exists():
        sys.exit(f"peer material not found at {PEER} (set GRADGRAPH_PEER_DIR)")
    common = [f"--threads={args.threads}", f"--reps={args.reps}", f"--warmup={args.warmup}"]
    ort_python = Path(args.ort_venv) / "bin" / "python"
    print(f"forward + backward (no optimizer) of every float weight; {args.threads} threads; median of "
          f"{args.reps} steps after {args.warmup} warm-ups; each configuration in its own processes "
          f"(memory and time measured apart). gradgraph: the gradient graph split where its node marks "
          f"say, forward and backward sessions (stock onnxruntime, {args.opt_level}); "
          f"onnxruntime-training 1.19.2: ORTModule's graph builder and TrainingAgent (YieldOp split)")
    rows: list[tuple[str, str, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            me = [sys.executable, __file__, "--model", name, "--dir", tmp]
            export = _run(me + ["--child", "export"], memory=False)
            if not export.get("ok"):
                print(f"{name}: export failed: {export.get('error')}")
                continue
            for config in CONFIGS:
                rec = _measured(me + ["--child", "run", "--config", config, f"--opt-level={args.opt_level}",
                                      "--arena" if args.arena else "--no-arena", *common])
                if not rec.get("ok"):
                    print(f"{name} gradgraph {config}: failed: {rec.get('error')}")
                rows.append((name, f"gradgraph {config}", rec))
            if args.quick:
                print(f"{name}: onnxruntime-training skipped (--quick)")
                continue
            if not ort_python.exists():
                print(f"{name}: onnxruntime-training skipped: no venv at {args.ort_venv} "
                      "(bash tools/setup_ort_training.sh)")
                continue
            worker = [str(ort_python), str(ROOT / "tools" / "ort_recompute_worker.py"),
                      os.path.join(tmp, f"{name}.onnx"), os.path.join(tmp, f"{name}_inputs.npz")]
            for config in ORT_CONFIGS:
                rec = _measured(worker + [config, *common, "--arena" if args.arena else "--no-arena"])
                if not rec.get("ok"):
                    print(f"{name} ort-training {config}: failed: {rec.get('error')}")
                rows.append((name, f"ort-training {config}", rec))
    _print_table(rows)


def _print_table(rows: list[tuple[str, str, dict]]) -> None:
    header = (f"{'model':<5} {'configuration':<32} {'stash MB':>8} {'boundary MB':>11} {'x none':>6} "
              f"{'step growth MB':>14} {'x none':>6} {'step ms':>8} {'x none':>6} {'one graph ms':>12}")
    print(header)
    base: dict[str, dict] = {}
    for name, label, rec in rows:
        if not rec.get("ok"):
            continue
        peer = label.split()[0]
        ref = base.setdefault(f"{name}/{peer}", rec)

        def ratio(key: str, rec=rec, ref=ref) -> str:
            return _fmt(rec[key] / ref[key] if ref.get(key) and rec.get(key) is not None else None, ".2f")

        stash = rec.get("stash_bytes")
        print(f"{name:<5} {label:<32} {_fmt(stash / 2**20 if stash else None):>8} "
              f"{_fmt(rec.get('boundary_mb')):>11} {ratio('boundary_mb'):>6} "
              f"{_fmt(rec.get('run_growth_mb')):>14} {ratio('run_growth_mb'):>6} "
              f"{_fmt(rec.get('median_ms')):>8} {ratio('median_ms'):>6} {_fmt(rec.get('whole_ms')):>12}")


if __name__ == "__main__":
    main()
