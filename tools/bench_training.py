"""Training-step benchmark: gradgraph.TrainingSession vs PyTorch eager vs onnxruntime-training.

    python tools/bench_training.py [--models mlp,bert,gpt2] [--rounds 5] [--reps 20] [--warmup 3]
                                   [--threads 2] [--provider cpu|cuda] [--repeat 1] [--no-wait]
                                   [--ort-venv .venv-ort-training] [--json out.json]

Same models, batches and optimizer settings for every peer: the peer definitions in ../shared/peer/
models_def.py (MLP 784-512-512-10 batch 64; BERT-like 4 layers hidden 256 seq 128 batch 8;
GPT-2-like 4 layers n_embd 256 seq 128 batch 8; dropout active; ``cnn``: 3 x [Conv3x3 no bias,
BatchNorm, ReLU, MaxPool2] + Linear, batch 32 x 3 x 32 x 32) and, for the CNNs the peer lacks,
tools/cnn_models.py (``resnet18``: a ResNet-18-style net at 32 x 32, ``mobilenetv2``: a
MobileNetV2-style net with depthwise convs; batch 32 x 3 x 32 x 32), exported once per model with
the legacy exporter in training mode, AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-6, weight decay 0),
--threads threads (intra-op; inter-op 1). A step is forward + backward + optimizer update.

Rounds. For each model, round r = 1..--rounds runs gradgraph, then torch, then
onnxruntime-training, each peer in its own child process (so peak RSS is per peer, and a slow
minute of the machine lands on all peers, not on one). A round's figure for a peer is that
child's median of --reps timed steps after --warmup warm-ups, timed with the peer's procedure
(../shared/peer/common.py: wait for a quiet machine, re-measure up to 3 times when other
processes used more than a quarter core; --no-wait skips both, for quick checks).
onnxruntime-training 1.19.2 runs the peer's own script (../shared/peer/ort_train_bench.py) in
the reference venv made by tools/setup_ort_training.sh: its artifacts are generated once per
model, its training child runs in every round, with the peer's thread count, warm-ups and
repetitions set to --threads, --warmup and --reps (the peer's defaults are 2, 3 and 20, this
script's too). Its AdamW has the same hyperparameters but is onnxruntime-training's fused kernel
in its Hugging Face form (adam_mode 1), so its losses drift slightly from the other two peers'
after the first step. It is skipped when that venv is missing, and with --provider cuda (CPU
build).

Reported per model, as a Markdown table: each peer's median step time over the rounds; the
median over rounds of the per-round ratios gradgraph / torch and gradgraph /
onnxruntime-training (below 1: gradgraph is faster) with their min-max; each peer's peak RSS
(max over rounds); the step's FLOPs (forward + backward, counted once per model by torch's
torch.utils.flop_counter.FlopCounterMode on the peer module in a child; matmuls, convolutions
and attention only; the optimizer's FLOPs are negligible); the FLOPs gradgraph's training graph
executes (its MatMul / Gemm / FusedMatMul nodes, from the shapes onnxruntime's profiler
records in one profiled step in a child of its own: fewer than torch's where the graph skips
work, e.g. the rows a loss ignores, passes/kernels/valid_rows_loss.py); gradgraph's achieved
GFLOP/s (executed FLOPs / its median step time) and that as a percentage of the GEMM peak, and
in parentheses the effective percentage (torch's FLOPs / the step time, which a graph that
skips work can push past 100): the GEMM peak is a 2048x2048 float32 MatMul
(2 * 2048^3 FLOPs, both operands graph inputs, output preallocated) in the same onnxruntime, with
the same threads and provider, timed in a child (median of 10 runs after 3 warm-ups) at the start
of every measurement run and printed above its table.

Stability. With --rounds >= 2, a ratio whose per-round spread (max - min) exceeds --max-spread
(0.2) gets a WARNING line: the machine was busy and the ratio is not reliable. --repeat N runs
the whole measurement (GEMM peak, every model's rounds) N times in one invocation, then prints
each ratio's median per run and a WARNING where two consecutive runs differ by more than
--max-drift (0.1), the criterion for a ratio that holds from run to run. Progress (each round's
figures and the other processes' load during it, in cores) goes to stderr, the report to stdout;
--json writes every child's record.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import (  # noqa: E402 - tools/ is not a package
    PEER,
    report_child,
    run_child,
    time_steps,
    time_steps_no_wait,
)

ROOT = Path(__file__).resolve().parent.parent
BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")
LR, EPS = 1e-3, 1e-6
PEERS = ("gradgraph", "torch", "onnxruntime-training")
# The peer's models (../shared/peer/models_def.py) and the CNNs of tools/cnn_models.py.
MODELS = ("mlp", "bert", "gpt2", "cnn", "resnet18", "mobilenetv2")
RATIOS = (("torch", "gradgraph / torch"), ("onnxruntime-training", "gradgraph / ort-training"))
GEMM_N, GEMM_WARMUP, GEMM_REPS = 2048, 3, 10


def _peer_models():
    sys.path.insert(0, str(PEER))
    import models_def  # noqa: PLC0415 - the peer's module, found at run time

    return models_def


def build_model(name: str) -> tuple:
    """(module, inputs, input names) of a benchmark model: the peer's builder, or one of
    tools/cnn_models.py (the CNNs the peer lacks)."""
    import cnn_models  # noqa: PLC0415 - tools/ is on sys.path

    if name in cnn_models.BUILDERS:
        return cnn_models.BUILDERS[name]()
    builder = getattr(_peer_models(), f"build_{name}", None)
    if builder is None:
        raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return builder()


def _trainable(model) -> list[str]:
    """Every FLOAT initializer with >= 2 elements that is not a BatchNorm statistic (as the peer)."""
    import numpy as np
    import onnx

    names = []
    for init in model.graph.initializer:
        if init.data_type != onnx.TensorProto.FLOAT or int(np.prod(init.dims)) < 2:
            continue
        if init.name.endswith(BUFFER_SUFFIXES):
            continue
        names.append(init.name)
    return names


def _time(step: Callable[[], object], warmup: int, reps: int, args) -> dict:
    """The peer's timing procedure, or one plain timed loop with --no-wait."""
    return (time_steps_no_wait if getattr(args, "no_wait", False) else time_steps)(step, warmup, reps)


def _providers(args) -> list[str]:
    if args.provider == "cuda":
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _session_options(args):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.inter_op_num_threads = 1
    return opts


# ---- children ------------------------------------------------------------------------------


def child_export(name: str, out_dir: str) -> dict:
    import numpy as np
    import torch

    module, inputs, input_names = build_model(name)
    with torch.no_grad():  # keep bit-identical fresh parameters from being merged by the exporter
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 1e-4)
    path = os.path.join(out_dir, f"{name}.onnx")
    module.train()
    torch.onnx.export(module, inputs, path, dynamo=False, input_names=input_names, output_names=["loss"],
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                      opset_version=17)
    torch.save(module.state_dict(), os.path.join(out_dir, f"{name}.pt"))
    np.savez(os.path.join(out_dir, f"{name}_inputs.npz"), **{k: v.numpy() for k, v in zip(input_names, inputs)})
    return {"ok": True, "path": path}


def child_flops(name: str, args) -> dict:
    """FLOPs of one forward + backward of the peer module, by torch's FlopCounterMode."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    torch.set_num_threads(args.threads)
    module, inputs, _ = build_model(name)
    module.train()
    with FlopCounterMode(display=False) as counter:
        module(*inputs).backward()
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    return {"ok": True, "flops": int(counter.get_total_flops()), "by_op": by_op}


def _matmul_flops(shapes: list, out: list) -> int:
    """FLOPs of a MatMul / Gemm / FusedMatMul run from its input and output shapes: 2 x the
    output's elements x the inner dim K. The profile has no attributes: A is [.., M, K], or
    [.., K, M] transposed, so K is A's last dim unless that is M (then its other dim: the same
    number when K == M)."""
    import math

    a = shapes[0] if shapes else []
    if len(a) < 2 or len(out) < 2:
        return 2 * math.prod(out) * (a[-1] if a else 1)
    inner = a[-1] if a[-1] != out[-2] else a[-2]
    return 2 * math.prod(out) * inner


def child_executed(name: str, out_dir: str, args) -> dict:
    """The FLOPs gradgraph's training graph runs in one step (matmul-family nodes), from the
    shapes in onnxruntime's profile of two steps (the same feeds), halved."""
    import json

    opts = _session_options(args)
    opts.enable_profiling = True
    opts.profile_file_prefix = os.path.join(out_dir, f"{name}_flops")
    session, feeds, _, _ = _gradgraph_session(name, out_dir, args, opts)
    steps = 2
    for _ in range(steps):
        session.train_step(feeds, lr=LR)
    profile = session._train.session.end_profiling()
    with open(profile) as f:
        events = json.load(f)
    os.remove(profile)
    total = 0
    for ev in events:
        op = ev.get("args", {}).get("op_name")
        if ev.get("cat") != "Node" or not ev.get("name", "").endswith("_kernel_time") or op not in (
                "MatMul", "Gemm", "FusedMatMul"):
            continue
        shapes = [list(next(iter(d.values()))) for d in ev["args"].get("input_type_shape", [])]
        out = [list(next(iter(d.values()))) for d in ev["args"].get("output_type_shape", [])]
        if out:
            total += _matmul_flops(shapes, out[0])
    return {"ok": True, "flops": total // steps}


def child_gemm(args) -> dict:
    """GEMM peak: a GEMM_N x GEMM_N float32 MatMul in onnxruntime, same threads and provider."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    n = GEMM_N
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["Y"])], "gemm",
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [n, n]) for x in "AB"],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [n, n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), _session_options(args), providers=_providers(args))
    device = "cuda" if args.provider == "cuda" else "cpu"
    rng = np.random.default_rng(0)
    binding = session.io_binding()
    for x in "AB":
        value = rng.standard_normal((n, n), dtype=np.float32)
        binding.bind_ortvalue_input(x, ort.OrtValue.ortvalue_from_numpy(value, device, 0))
    binding.bind_ortvalue_output("Y", ort.OrtValue.ortvalue_from_shape_and_type([n, n], np.float32, device, 0))
    timing = _time(lambda: session.run_with_iobinding(binding), GEMM_WARMUP, GEMM_REPS, args)
    flops = 2 * n**3
    return {"ok": True, "flops": flops, "gflops": flops / (timing["median_ms"] * 1e-3) / 1e9,
            "onnxruntime": ort.__version__, "providers": session.get_providers(), **timing}


def _gradgraph_session(name: str, out_dir: str, args, sess_options) -> tuple:
    """gradgraph's TrainingSession on the exported model (AdamW as the peers), its feeds, the
    number of trained weights and the seconds the session took to build."""
    import numpy as np
    import onnx

    from gradgraph import TrainingSession
    from gradgraph.training.build import TrainingConfig
    from passes.optimizer import AdamWConfig

    path = os.path.join(out_dir, f"{name}.onnx")
    feeds = dict(np.load(os.path.join(out_dir, f"{name}_inputs.npz")))
    trained = _trainable(onnx.load(path, load_external_data=False))
    config = TrainingConfig(loss="loss", optimizer=AdamWConfig(eps=EPS, weight_decay=0.0),
                            weights_to_train=tuple(trained))
    start = time.perf_counter()
    session = TrainingSession(path, config, sess_options=sess_options, providers=_providers(args))
    return session, feeds, len(trained), time.perf_counter() - start


def child_gradgraph(name: str, out_dir: str, args) -> dict:
    session, feeds, trained, setup = _gradgraph_session(name, out_dir, args, _session_options(args))
    losses = []
    timing = _time(lambda: losses.append(session.train_step(feeds, lr=LR)), args.warmup, args.reps, args)
    return {"ok": True, "setup_s": setup, "trained": trained, "loss_first": losses[0],
            "loss_last": losses[-1], **timing}


def child_torch(name: str, out_dir: str, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    module, inputs, _ = build_model(name)
    module.load_state_dict(torch.load(os.path.join(out_dir, f"{name}.pt")))
    device = "cuda" if args.provider == "cuda" else "cpu"
    module.to(device).train()
    inputs = tuple(t.to(device) for t in inputs)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = module(*inputs)
        loss.backward()
        opt.step()
        losses.append(float(loss))

    timing = _time(step, args.warmup, args.reps, args)
    return {"ok": True, "loss_first": losses[0], "loss_last": losses[-1], **timing}


# ---- onnxruntime-training: the peer's script, run in the reference venv ---------------------

# Runs ../shared/peer/ort_train_bench.py's own main() with the peer's thread count and its
# timing's warm-ups / repetitions (and, with --no-wait, its quiet wait) set from this script's
# options; the peer's child_train reads both from its `common` module at call time.
_ORT_SHIM = """
import functools, os, sys
sys.path.insert(0, os.environ["GRADGRAPH_BENCH_PEER"])
import ort_train_bench as bench
common = bench.C
common.THREADS = int(os.environ["GRADGRAPH_BENCH_THREADS"])
kw = {"warmup": int(os.environ["GRADGRAPH_BENCH_WARMUP"]), "repeat": int(os.environ["GRADGRAPH_BENCH_REPS"])}
if os.environ["GRADGRAPH_BENCH_NO_WAIT"] == "1":
    kw.update(quiet=False, attempts=1)
common.time_steps = functools.partial(common.time_steps, **kw)
sys.argv = [bench.__file__, *sys.argv[1:]]
bench.main()
"""


def _ort_env(out_dir: str, args) -> dict[str, str]:
    return {"PEER_RESULTS_DIR": out_dir, "GRADGRAPH_BENCH_PEER": str(PEER),
            "GRADGRAPH_BENCH_THREADS": str(args.threads), "GRADGRAPH_BENCH_WARMUP": str(args.warmup),
            "GRADGRAPH_BENCH_REPS": str(args.reps), "GRADGRAPH_BENCH_NO_WAIT": "1" if args.no_wait else "0"}


def _ort_python(args) -> Path:
    return Path(args.ort_venv) / "bin" / "python"


def _ort_key(name: str) -> str:
    return f"gradgraph_bench_{name}_{os.getpid()}"  # the peer's artifact folder; one per invocation


def _ort_gen(name: str, out_dir: str, args) -> dict:
    """The peer's artifact generation (once per model); ``ok: False`` when it cannot run."""
    if args.provider != "cpu":
        return {"ok": False, "skipped": True, "error": "onnxruntime-training CPU build only"}
    if not _ort_python(args).exists():
        return {"ok": False, "skipped": True,
                "error": f"no reference venv at {args.ort_venv} (run tools/setup_ort_training.sh)"}
    return run_child([str(_ort_python(args)), "-c", _ORT_SHIM, "--child", "gen", "--key", _ort_key(name),
                      "--path", os.path.join(out_dir, f"{name}.onnx")], env=_ort_env(out_dir, args))


def _ort_train(name: str, out_dir: str, args) -> dict:
    return run_child([str(_ort_python(args)), "-c", _ORT_SHIM, "--child", "train", "--key", _ort_key(name),
                      "--path", os.path.join(out_dir, f"{name}_inputs.npz")], env=_ort_env(out_dir, args))


# ---- parent --------------------------------------------------------------------------------


def _me(args, child: str, name: str | None = None, out_dir: str | None = None) -> list[str]:
    argv = [sys.executable, __file__, "--child", child, f"--threads={args.threads}", f"--reps={args.reps}",
            f"--warmup={args.warmup}", f"--provider={args.provider}"]
    if args.no_wait:
        argv.append("--no-wait")
    if name is not None:
        argv += ["--model", name]
    if out_dir is not None:
        argv += ["--dir", out_dir]
    return argv


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _setup(name: str, out_dir: str, args) -> dict | None:
    """Export, FLOP count and onnxruntime-training artifacts of one model, once per invocation."""
    _log(f"{name}: export, FLOP count, onnxruntime-training artifacts")
    export = run_child(_me(args, "export", name, out_dir))
    if not export.get("ok"):
        print(f"WARNING: {name}: export failed, model skipped: {export.get('error')}")
        return None
    flops = run_child(_me(args, "flops", name))
    if not flops.get("ok"):
        print(f"WARNING: {name}: FLOP count failed: {flops.get('error')}")
    executed = run_child(_me(args, "executed", name, out_dir))
    if not executed.get("ok"):
        print(f"WARNING: {name}: gradgraph's executed FLOPs not counted: {executed.get('error')}")
    flops["executed"] = executed.get("flops")
    gen = _ort_gen(name, out_dir, args)
    if not gen.get("ok"):
        print(f"NOTE: {name}: onnxruntime-training not measured: {gen.get('error')}")
    return {"export": export, "flops": flops, "ort_gen": gen}


def _measure(names: list[str], setups: dict[str, dict], out_dir: str, args, run: int) -> dict:
    """One measurement run: the GEMM peak, then every model's rounds."""
    tag = f"run {run}/{args.repeat}: " if args.repeat > 1 else ""
    gemm = run_child(_me(args, "gemm"))
    if gemm.get("ok"):
        _log(f"{tag}GEMM peak {gemm['gflops']:.1f} GFLOP/s ({gemm['median_ms']:.1f} ms)")
    models = {}
    for name in names:
        rounds = []
        for r in range(1, args.rounds + 1):
            one = {"gradgraph": run_child(_me(args, "gradgraph", name, out_dir)),
                   "torch": run_child(_me(args, "torch", name, out_dir))}
            gen = setups[name]["ort_gen"]
            one["onnxruntime-training"] = _ort_train(name, out_dir, args) if gen.get("ok") else gen
            for peer, rec in one.items():
                if not rec.get("ok") and not rec.get("skipped"):
                    print(f"WARNING: {tag}{name} round {r}: {peer} failed: {rec.get('error')}")
            _log(f"{tag}{name} round {r}/{args.rounds}: " + ", ".join(
                f"{peer} {_fmt(rec.get('median_ms') if rec.get('ok') else None)} ms "
                f"(other load {_fmt(rec.get('other_cores'), '.2f')})" for peer, rec in one.items()))
            rounds.append(one)
        models[name] = _summary(rounds, setups[name]["flops"].get("flops"), gemm.get("gflops"),
                                setups[name]["flops"].get("executed"))
    return {"gemm": gemm, "models": models}


def _summary(rounds: list[dict], flops: int | None, gemm_gflops: float | None,
             executed: int | None = None) -> dict:
    ok = {p: [r[p] for r in rounds if r[p].get("ok")] for p in PEERS}
    med = {p: statistics.median(rec["median_ms"] for rec in ok[p]) if ok[p] else None for p in PEERS}
    rss = {p: max(rec["peak_rss_mb"] for rec in ok[p]) if ok[p] else None for p in PEERS}
    ratios = {}
    for peer, label in RATIOS:
        per_round = [r["gradgraph"]["median_ms"] / r[peer]["median_ms"] for r in rounds
                     if r["gradgraph"].get("ok") and r[peer].get("ok")]
        if per_round:
            ratios[label] = {"median": statistics.median(per_round), "min": min(per_round),
                             "max": max(per_round), "per_round": per_round}
    gg = med["gradgraph"]
    effective = flops / (gg * 1e-3) / 1e9 if flops and gg else None
    gflops = executed / (gg * 1e-3) / 1e9 if executed and gg else None
    peak = 100.0 * gflops / gemm_gflops if gflops and gemm_gflops else None
    effective_peak = 100.0 * effective / gemm_gflops if effective and gemm_gflops else None
    return {"median_ms": med, "peak_rss_mb": rss, "ratios": ratios, "flops": flops, "executed_flops": executed,
            "gflops": gflops, "pct_gemm_peak": peak, "effective_gflops": effective,
            "effective_pct_gemm_peak": effective_peak, "rounds": rounds}


def _report(result: dict, args, run: int) -> None:
    gemm = result["gemm"]
    title = f"Run {run} of {args.repeat}. " if args.repeat > 1 else ""
    if gemm.get("ok"):
        print(f"{title}GEMM peak: MatMul {GEMM_N}x{GEMM_N} float32 (2*{GEMM_N}^3 FLOPs), onnxruntime "
              f"{gemm['onnxruntime']} {args.provider}, {args.threads} threads: {gemm['median_ms']:.1f} ms "
              f"(median of {GEMM_REPS}) = **{gemm['gflops']:.1f} GFLOP/s**")
    else:
        print(f"{title}WARNING: GEMM peak not measured: {gemm.get('error')}")
    print()
    print("| model | gradgraph ms | torch ms | ort-training ms | gradgraph / torch (min-max) "
          "| gradgraph / ort-training (min-max) | peak RSS MB gradgraph / torch / ort-training "
          "| step GFLOP (fwd+bwd, torch) | gradgraph executed GFLOP | gradgraph GFLOP/s (executed) "
          "| % of GEMM peak (effective) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    warnings = []
    for name, s in result["models"].items():
        cells = [name, *(_fmt(s["median_ms"][p]) for p in PEERS)]
        for _, label in RATIOS:
            ratio = s["ratios"].get(label)
            cells.append("-" if ratio is None else
                         f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})")
            if ratio is not None and len(ratio["per_round"]) >= 2 and ratio["max"] - ratio["min"] > args.max_spread:
                warnings.append(
                    f"WARNING: {name} {label}: the per-round ratios spread {ratio['max'] - ratio['min']:.2f} "
                    f"({ratio['min']:.2f}-{ratio['max']:.2f}), more than {args.max_spread}: the machine was "
                    f"busy during the measurement and this ratio is not reliable.")
        cells.append(" / ".join(_fmt(s["peak_rss_mb"][p], ".0f") for p in PEERS))
        cells += [_fmt(s["flops"] / 1e9 if s["flops"] else None, ".2f"),
                  _fmt(s["executed_flops"] / 1e9 if s.get("executed_flops") else None, ".2f"), _fmt(s["gflops"]),
                  f"{_fmt(s['pct_gemm_peak'], '.0f')} ({_fmt(s.get('effective_pct_gemm_peak'), '.0f')})"]
        print("| " + " | ".join(cells) + " |")
    print()
    for line in warnings:
        print(line)
    if args.rounds < 2:
        print("NOTE: one round: the ratios' spread is not checked (use --rounds >= 2).")
    if warnings or args.rounds < 2:
        print()


def _report_repeats(results: list[dict], args) -> None:
    """Each ratio's median per run, and a WARNING where consecutive runs differ by > --max-drift."""
    runs = len(results)
    print(f"Ratio medians per run ({runs} runs; consecutive runs must agree within ±{args.max_drift}):")
    print()
    print("| model | ratio | " + " | ".join(f"run {k}" for k in range(1, runs + 1)) + " | max step between runs |")
    print("|---|---|" + "---|" * runs + "---|")
    gemm = [r["gemm"].get("gflops") for r in results]
    print("| - | GEMM peak GFLOP/s | " + " | ".join(_fmt(g) for g in gemm) + " | - |")
    warnings = []
    for name in results[0]["models"]:
        for _, label in RATIOS:
            values = [r["models"][name]["ratios"].get(label, {}).get("median") for r in results]
            if all(v is None for v in values):
                continue
            steps = [(k, abs(b - a)) for k, (a, b) in enumerate(zip(values, values[1:]), start=1)
                     if a is not None and b is not None]
            print(f"| {name} | {label} | " + " | ".join(_fmt(v, ".2f") for v in values) + " | "
                  + _fmt(max((d for _, d in steps), default=None), ".2f") + " |")
            for k, d in steps:
                if d > args.max_drift:
                    warnings.append(
                        f"WARNING: {name} {label}: runs {k} and {k + 1} differ by {d:.2f} "
                        f"({values[k - 1]:.2f} -> {values[k]:.2f}), more than {args.max_drift}: the ratio "
                        f"does not hold from run to run (machine busy?) and is not reliable.")
    print()
    for line in warnings:
        print(line)
    if not warnings:
        print(f"All ratios agree within ±{args.max_drift} between consecutive runs.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,bert,gpt2")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the three peers per model")
    parser.add_argument("--reps", type=int, default=20, help="timed steps per child")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per child first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeat", type=int, default=1, help="run the whole measurement N times")
    parser.add_argument("--max-spread", type=float, default=0.2,
                        help="warn when a ratio's per-round max - min exceeds this")
    parser.add_argument("--max-drift", type=float, default=0.1,
                        help="with --repeat: warn when consecutive runs' ratios differ by more")
    parser.add_argument("--no-wait", action="store_true",
                        help="no wait for a quiet machine nor re-measuring (quick checks)")
    parser.add_argument("--ort-venv", default=os.environ.get("GRADGRAPH_ORT_TRAINING_VENV",
                                                             str(ROOT / ".venv-ort-training")))
    parser.add_argument("--json", help="write every child's record and the summaries here")
    parser.add_argument("--child", choices=["export", "flops", "executed", "gemm", "gradgraph", "torch"])
    parser.add_argument("--model")
    parser.add_argument("--dir")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # the report and the progress on stderr interleave
    if args.child:
        fn = {"export": lambda: child_export(args.model, args.dir),
              "flops": lambda: child_flops(args.model, args),
              "executed": lambda: child_executed(args.model, args.dir, args),
              "gemm": lambda: child_gemm(args),
              "gradgraph": lambda: child_gradgraph(args.model, args.dir, args),
              "torch": lambda: child_torch(args.model, args.dir, args)}[args.child]
        report_child(fn)
        return
    if not (PEER / "models_def.py").exists():
        sys.exit(f"peer material not found at {PEER} (set GRADGRAPH_PEER_DIR)")
    if args.rounds < 1 or args.repeat < 1 or args.reps < 1 or args.warmup < 0:
        sys.exit("--rounds, --repeat and --reps must be >= 1, --warmup >= 0")
    print(f"Training step = forward + backward + AdamW. Per model, {args.rounds} rounds of gradgraph, "
          f"torch, onnxruntime-training, each in its own process; a round's figure is the median of "
          f"{args.reps} steps after {args.warmup} warm-ups"
          f"{' (no wait for a quiet machine)' if args.no_wait else ''}; {args.threads} threads; "
          f"provider {args.provider}.")
    print()
    names = args.models.split(",")
    results = []
    setups: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name in names:
                setup = _setup(name, tmp, args)
                if setup is not None:
                    setups[name] = setup
            names = [n for n in names if n in setups]
            for run in range(1, args.repeat + 1):
                results.append(_measure(names, setups, tmp, args, run))
                _report(results[-1], args, run)
        finally:
            for setup in setups.values():
                artifacts = setup["ort_gen"].get("artifact_dir")
                if artifacts and Path(artifacts).name.startswith("gradgraph_bench_"):
                    shutil.rmtree(artifacts, ignore_errors=True)
    if args.repeat > 1 and names:
        _report_repeats(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("child", "model", "dir")},
                       "setup": setups, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
