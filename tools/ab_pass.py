"""One pass's effect on the training step, measured in one process: with it and without it.

    python tools/ab_pass.py PASS [--models bert,gpt2,mlp] [--pairs 30] [--warmup 3] [--threads 2]

PASS names a pass class of the training build by module path, e.g.
``passes.kernels.gelu.GeluFusionPass``. For each model of the training benchmark
(tools/bench_training.py: the peer models of ../shared/peer, exported by the legacy exporter in
training mode; AdamW lr 1e-3, eps 1e-6, no weight decay) two TrainingSessions are built: one as
the build makes it, one with the pass's ``call`` patched to change nothing. Their steps then
alternate (A B, B A, ... so that neither always runs second), --pairs pairs after --warmup
steps each; the report is each session's median step and the median of the per-pair ratios
with / without (below 1: the pass makes the step faster) with their min-max. The two sessions
share the process and the machine minute, so a slow minute lands on both. onnxruntime's threads
do not spin between runs here (``session.intra_op.allow_spinning`` 0): two sessions spinning
for each other's cores would time each other, not themselves. Steps are therefore a little
slower than the benchmark's.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_training  # noqa: E402 - tools/ is not a package
from timing import run_child  # noqa: E402

MODELS = bench_training.MODELS  # the training benchmark's


def _pass_class(path: str) -> type:
    module_name, _, class_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise SystemExit(f"cannot import the pass {path!r} ({exc}); name it as module.Class, "
                         "e.g. passes.kernels.gelu.GeluFusionPass") from None
    if not hasattr(cls, "call"):
        raise SystemExit(f"{path!r} is not a pass (no call method)")
    return cls


def interleave(name: str, with_session, without, feeds, args) -> None:
    """Warm both sessions, time ``args.pairs`` steps of each in alternating order, and print the
    medians and the median of the per-pair ratios (shared with tools/ab_rule.py)."""
    times: dict[str, list[float]] = {"with": [], "without": []}
    sessions = {"with": with_session, "without": without}
    for session in sessions.values():
        for _ in range(args.warmup):
            session.train_step(feeds, lr=bench_training.LR)
    for i in range(args.pairs):
        order = ("with", "without") if i % 2 == 0 else ("without", "with")
        for key in order:
            start = time.perf_counter()
            sessions[key].train_step(feeds, lr=bench_training.LR)
            times[key].append(time.perf_counter() - start)
    ratios = [a / b for a, b in zip(times["with"], times["without"], strict=True)]
    print(f"{name}: with {1e3 * statistics.median(times['with']):.1f} ms, without "
          f"{1e3 * statistics.median(times['without']):.1f} ms; ratio with / without "
          f"{statistics.median(ratios):.3f} (min-max {min(ratios):.3f}-{max(ratios):.3f}, "
          f"{args.pairs} pairs)", flush=True)


def measure(name: str, out_dir: str, cls: type, args) -> None:
    import onnxruntime as ort
    from onnx_ir.passes import PassResult

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = args.threads, 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    original = cls.call
    runs: list[bool] = []

    def counted(self, model):  # type: ignore[no-untyped-def]
        result = original(self, model)
        runs.append(result.modified)
        return result

    cls.call = counted  # type: ignore[method-assign]
    try:
        with_pass, feeds, _, _ = bench_training._gradgraph_session(name, out_dir, args, opts)
    finally:
        cls.call = original  # type: ignore[method-assign]
    if not any(runs):
        print(f"WARNING: {name}: {cls.__name__} " + ("changed nothing in" if runs else "did not run in")
              + " the training build: the two sessions are the same graph", flush=True)
    cls.call = lambda self, model: PassResult(model, False)  # type: ignore[method-assign]
    try:
        without, _, _, _ = bench_training._gradgraph_session(name, out_dir, args, opts)
    finally:
        cls.call = original  # type: ignore[method-assign]
    interleave(name, with_pass, without, feeds, args)


def run_ab(doc: str | None, metavar: str, default_models: str, resolve, measure_one) -> None:
    """The command line both A/B tools share: ``resolve(TARGET)``, then per model an export in a
    child process and ``measure_one(model, out_dir, resolved, args)`` (also tools/ab_rule.py)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", metavar=metavar)
    parser.add_argument("--models", default=default_models)
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.provider = "cpu"
    if args.pairs < 1 or args.warmup < 0 or args.threads < 1:
        raise SystemExit("--pairs and --threads must be >= 1, --warmup >= 0")
    resolved = resolve(args.target)
    with tempfile.TemporaryDirectory(prefix="gradgraph_ab_") as out_dir:
        for name in args.models.split(","):
            if name not in MODELS:
                raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}")
            print(f"{name}: export ...", file=sys.stderr, flush=True)
            export = run_child([sys.executable, str(Path(__file__).resolve().parent / "bench_training.py"),
                                "--child", "export", "--model", name, "--dir", out_dir])
            if not export.get("ok"):
                raise SystemExit(f"{name}: export failed: {export.get('error')}")
            measure_one(name, out_dir, resolved, args)


def main() -> None:
    run_ab(__doc__, "PASS", "bert,gpt2,mlp", _pass_class, measure)


if __name__ == "__main__":
    main()
