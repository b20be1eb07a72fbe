"""Where ORTModule's CPU training step differs from PyTorch eager's, measured in one process.

    python tools/ortmodule_gap.py [--models cnn,resnet18,mobilenetv2] [--steps 10] [--rounds 30]

For each model of the training benchmark (tools/bench_training.py; the layer kinds are those of
convolutional nets: other models' nodes fall in "other" or the nearest kind, ``--detail`` names
them):

1. **Backward by layer kind.** The kernel milliseconds per step of ORTModule's backward session
   (onnxruntime's profiler, its first 2 steps left out), each node counted for the forward node
   whose gradient it computes (gradgraph names a gradient node ``<forward node>_grad/...``;
   onnxruntime's layout nodes, ``ReorderInput``/``ReorderOutput``, count as "layout"; the sums
   of a value's gradients where several nodes read it, as "gradient sums"). Beside it, PyTorch
   eager's backward in the same process: the CPU time of each autograd function
   (``ConvolutionBackward0``..., torch's profiler), by the same kinds. Kernel time, not wall time.
2. **What splitting costs.** ORTModule runs the forward and the backward as two onnxruntime
   sessions whose threads sleep between parallel sections (its options). The two graphs it built,
   fed what one of its steps fed them, run here in four forms, sessions made by ORTModule's own
   ``make_session``: ORTModule's (two sessions, no spinning), one session of both graphs, and each
   of those with threads that spin within a run and stop after it. One session of both graphs is
   not something a module under torch autograd can run (the backward is called later, by torch):
   it measures what the split costs.
3. **Whole steps.** ORTModule with its options, ORTModule whose threads spin within runs (and
   stop after each), and PyTorch eager, each on its own copy of the model with its own AdamW.

Parts 2 and 3 run each form once per round for ``--rounds`` rounds, in an order rotated every
round, and print medians and the median of the round-by-round ratios to ORTModule's form: those
ratios resist the machine's drift better than medians of separate processes do. The models run
one after the other in one process. Quote the figures with the machine.
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

# forward op types and torch autograd functions, by the kind of layer they belong to
GRAPH_KINDS = {
    "conv": ("Conv", "ConvTranspose"),
    "norm": ("BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization"),
    "pool": ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool", "ReduceMean"),
    "activation": ("Relu", "Clip", "HardSigmoid", "HardSwish", "Sigmoid", "Tanh", "Gelu", "LeakyRelu"),
    "linear": ("Gemm", "MatMul"),
    "loss": ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss", "LogSoftmax"),
    "residual add": ("Add", "Sum"),
    "reshape": ("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze"),
}
TORCH_KINDS = {
    "conv": ("Convolution", "MkldnnConvolution"),
    "norm": ("NativeBatchNorm", "CudnnBatchNorm", "NativeLayerNorm", "NativeGroupNorm"),
    "pool": ("MaxPool2DWithIndices", "MaxPool3DWithIndices", "AvgPool2D", "AvgPool3D", "AdaptiveAvgPool2D",
             "AdaptiveMaxPool2D", "Mean"),
    "activation": ("Relu", "Hardtanh", "Threshold", "Silu", "Gelu", "Hardswish", "Sigmoid", "Tanh", "LeakyRelu"),
    "linear": ("Addmm", "Mm", "T", "Bmm"),
    "loss": ("LogSoftmax", "NllLoss"),
    "residual add": ("Add",),
    "reshape": ("View", "Reshape", "UnsafeView", "Permute", "Squeeze", "Unsqueeze", "Flatten"),
    "gradient accumulation": ("AccumulateGrad",),
}


WARMUP = 2  # ORTModule's steps before the profiled ones (its profile leaves them out)


def _kind(name: str, kinds: dict[str, tuple[str, ...]], detail: bool) -> str:
    """The kind whose names hold ``name``; else "other" (with ``detail``, naming it)."""
    for kind, names in kinds.items():
        if name in names:
            return kind
    return f"other: {name}" if detail else "other"


def graph_backward_by_kind(profile: str, ops: dict[str, str], skip: int, detail: bool) -> dict[str, float]:
    """Kernel ms per run of the backward session's profile ``profile``, by layer kind, its first
    ``skip`` runs (the warm-up) left out; ``ops``: the op type of each node of the graph the
    gradient was built from."""
    with open(profile) as f:
        events = json.load(f)
    starts = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
    if len(starts) <= skip:
        raise SystemExit(f"the backward session's profile holds {len(starts)} runs, not more than {skip}")
    first, runs = starts[skip], len(starts) - skip
    out: dict[str, float] = collections.Counter()
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time") or e["ts"] < first:
            continue
        node = e["name"][: -len("_kernel_time")]
        op = e.get("args", {}).get("op_name", "")
        if op in ("ReorderInput", "ReorderOutput"):
            kind = "layout"
        elif "_grad_sum/" in node:  # the gradients of a value read by several nodes, summed
            kind = "gradient sums (fan-out)"
        elif "_grad/" in node or node.endswith("_grad"):
            source = node.split("_grad/")[0] if "_grad/" in node else node[: -len("_grad")]
            kind = _kind(ops.get(source, ""), GRAPH_KINDS, detail)
        else:
            kind = f"other: {op}" if detail else "other"
        out[kind] += e["dur"] / 1e3 / runs
    return dict(out)


def torch_backward_by_kind(module: Any, batch: tuple, steps: int, detail: bool) -> dict[str, float]:
    """CPU ms per step of each autograd function of torch eager's backward, by layer kind."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        module(*batch).backward()
        module.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # only the backward's events are read
        for _ in range(steps):
            module(*batch).backward()
            module.zero_grad(set_to_none=True)
    out: dict[str, float] = collections.Counter()
    prefix = "autograd::engine::evaluate_function: "
    for e in prof.key_averages():
        if not e.key.startswith(prefix):
            continue
        fn = e.key[len(prefix):].split("::")[-1].rstrip("0123456789")
        fn = fn[: -len("Backward")] if fn.endswith("Backward") else fn
        out[_kind(fn, TORCH_KINDS, detail)] += e.cpu_time_total / 1e3 / steps
    return dict(out)


def merged_graph(forward: Any, backward: Any) -> Any:
    """One graph of the forward and the backward graph: the backward reads the forward's values."""
    import onnx

    produced = {o for n in forward.graph.node for o in n.output}
    fwd_inputs = {i.name for i in forward.graph.input}
    fwd_inits = {i.name for i in forward.graph.initializer}
    graph = onnx.helper.make_graph(
        list(forward.graph.node) + [n for n in backward.graph.node if not set(n.output) <= produced],
        "forward_and_backward",
        list(forward.graph.input) + [i for i in backward.graph.input
                                     if i.name not in produced and i.name not in fwd_inputs],
        list(backward.graph.output),
        list(forward.graph.initializer) + [i for i in backward.graph.initializer if i.name not in fwd_inits])
    return onnx.helper.make_model(graph, opset_imports=forward.opset_import, ir_version=forward.ir_version)


def split_cost(forward: Any, backward: Any, fwd_feeds: dict, bwd_feeds: dict, threads: int,
               rounds: int) -> dict[str, tuple[float, float]]:
    """{form: (median ms, median round-by-round ratio to ORTModule's form)}. The sessions are made
    by ORTModule's own ``runner.make_session``; "spinning within runs" patches its ``no_spinning``."""
    import onnx_ir as ir
    import onnxruntime as ort

    from gradgraph.torch import runner

    def session(model: Any, spin: bool) -> Any:
        with _spinning(runner, spin):
            return runner.make_session(ir.from_proto(model), threads)

    fwd_out = [o.name for o in forward.graph.output]
    bwd_out = [o.name for o in backward.graph.output]
    bwd_in = [i.name for i in backward.graph.input]
    merged = merged_graph(forward, backward)
    merged_in = [i.name for i in merged.graph.input]
    fvals = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in fwd_feeds.items()}
    bvals = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in bwd_feeds.items()}

    def two(spin: bool) -> Any:
        fs, bs = session(forward, spin), session(backward, spin)

        def run() -> None:
            got = dict(zip(fwd_out, fs.run_with_ort_values(fwd_out, fvals)))
            bs.run_with_ort_values(bwd_out, {n: got[n] if n in got else bvals[n] for n in bwd_in})
        return run

    def one(spin: bool) -> Any:
        ms = session(merged, spin)
        return lambda: ms.run_with_ort_values(bwd_out, {n: fvals[n] if n in fvals else bvals[n] for n in merged_in})

    forms = {"two sessions, no spinning (ORTModule)": two(False), "one session, no spinning": one(False),
             "two sessions, spinning within runs": two(True), "one session, spinning within runs": one(True)}
    for run in forms.values():
        for _ in range(3):
            run()
    return _paired(forms, rounds, "two sessions, no spinning (ORTModule)")


def _paired(runs: dict[str, Any], rounds: int, base: str) -> dict[str, tuple[float, float]]:
    """{name: (median ms, median round-by-round ratio to ``base``)} of ``runs`` called once each
    per round, in an order rotated every round (no one always follows the same other)."""
    names = list(runs)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            runs[k]()
            times[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(v) * 1e3, statistics.median(a / b for a, b in zip(v, times[base])))
            for k, v in times.items()}


@contextlib.contextmanager
def _spinning(runner: Any, spin: bool) -> Iterator[None]:
    """While on, sessions ``runner.make_session`` makes spin within runs and stop after each
    (``session.force_spinning_stop``) instead of ORTModule's sleeping threads."""
    plain = runner.no_spinning
    if spin:
        runner.no_spinning = lambda options: options.add_session_config_entry("session.force_spinning_stop", "1")
    try:
        yield
    finally:
        runner.no_spinning = plain


def whole_steps(module: Any, batch: tuple, threads: int, rounds: int) -> dict[str, tuple[float, float]]:
    """{peer: (median step ms, median round-by-round ratio to ORTModule's)} (part 3)."""
    import copy

    import torch

    from gradgraph.torch import ORTModule, runner

    steps = {}
    for peer in ("ORTModule", "ORTModule, spinning within runs", "torch eager"):
        model = copy.deepcopy(module)
        if peer != "torch eager":
            model = ORTModule(model, fallback="raise", threads=threads)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(model: Any = model, opt: Any = opt) -> None:
            model(*batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        with _spinning(runner, "spinning" in peer):  # its sessions are made by the first call
            for _ in range(3):
                step()
        steps[peer] = step
    return _paired(steps, rounds, "ORTModule")


def measure(name: str, args: argparse.Namespace, folder: str) -> None:
    import bench_training  # noqa: PLC0415 - tools/ is on sys.path
    import torch
    from profile_ortmodule import profiled_sessions  # noqa: PLC0415 - tools/ is on sys.path

    from gradgraph.torch import ORTModule, runner

    torch.manual_seed(0)
    module, batch, _ = bench_training.build_model(name)
    module.train()
    torch_kinds = torch_backward_by_kind(module, batch, args.steps, args.detail)

    fed: dict[str, dict] = {}
    ops: dict[str, str] = {}
    gradient_pass = runner.GradientPass

    class Recorded(gradient_pass):  # type: ignore[misc, valid-type]
        def __call__(self, model: Any) -> Any:  # the graph's node types before the gradient
            ops.update({n.name: n.op_type for n in model.graph.all_nodes()})
            return super().__call__(model)
    run_forward, run_backward = runner.GraphRunner.run_forward, runner.GraphRunner.run_backward

    def record_forward(self: Any, values: dict) -> Any:
        fed["forward"] = {k: v.numpy().copy() for k, v in values.items() if k in self.fwd_inputs}
        return run_forward(self, values)

    def record_backward(self: Any, kept: dict, values: dict, grad_outputs: dict) -> Any:
        feeds = {}
        for n in self.bwd_inputs:
            seed = self._seed_outputs.get(n)
            feeds[n] = (grad_outputs[seed] if seed is not None else kept.get(n, values.get(n))).numpy().copy()
        fed["backward"] = feeds
        return run_backward(self, kept, values, grad_outputs)

    runner.GradientPass = Recorded  # type: ignore[misc]
    runner.GraphRunner.run_forward, runner.GraphRunner.run_backward = record_forward, record_backward  # type: ignore[method-assign]
    try:
        with profiled_sessions(runner, f"{folder}/{name}_session") as made:
            model = ORTModule(module, fallback="raise", threads=args.threads)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for _ in range(WARMUP + args.steps):
                model(*batch).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        runner.GradientPass = gradient_pass  # type: ignore[misc]
        runner.GraphRunner.run_forward, runner.GraphRunner.run_backward = run_forward, run_backward  # type: ignore[method-assign]
    if len(made) != 2:
        print(f"## {name}: ORTModule built {len(made)} sessions, not a forward and a backward; skipped")
        return
    (fwd_session, forward), (bwd_session, backward) = made
    fwd_session.end_profiling()
    graph_kinds = graph_backward_by_kind(bwd_session.end_profiling(), ops, WARMUP, args.detail)
    print(f"## {name}: backward, ms per step by layer kind ({args.steps} steps; ORTModule's backward "
          "session's kernels, torch eager's autograd functions)")
    kinds = sorted(set(graph_kinds) | set(torch_kinds), key=lambda k: -graph_kinds.get(k, 0.0))
    _table(("kind", "ORTModule backward", "torch eager backward"),
           [(k, f"{graph_kinds.get(k, 0.0):.2f}", f"{torch_kinds.get(k, 0.0):.2f}") for k in kinds]
           + [("total", f"{sum(graph_kinds.values()):.2f}", f"{sum(torch_kinds.values()):.2f}")])
    cost = split_cost(forward, backward, fed["forward"], fed["backward"], args.threads, args.rounds)
    print(f"What splitting costs ({args.rounds} rounds, forward and backward of one step):")
    _table(("form", "median ms", "ratio to ORTModule's form (median of rounds)"),
           [(form, f"{ms:.2f}", f"{ratio:.3f}") for form, (ms, ratio) in cost.items()])
    print(f"Whole training steps ({args.rounds} rounds):")
    steps = whole_steps(module, batch, args.threads, args.rounds)
    _table(("peer", "median step ms", "ratio to ORTModule (median of rounds)"),
           [(peer, f"{ms:.2f}", f"{ratio:.3f}") for peer, (ms, ratio) in steps.items()])


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A Markdown table, with a blank line before and after."""
    print()
    for row in (header, tuple("---" for _ in header), *rows):
        print("| " + " | ".join(row) + " |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="cnn,resnet18,mobilenetv2")
    parser.add_argument("--steps", type=int, default=10, help="profiled steps (default 10)")
    parser.add_argument("--rounds", type=int, default=30, help="rounds of the split-cost A/B (default 30)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--detail", action="store_true", help="name the op types and functions counted as other")
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1 or args.threads < 1:
        parser.error("--steps, --rounds and --threads must be >= 1")
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="gradgraph_gap_") as folder:
        for name in args.models.split(","):
            measure(name, args, folder)


if __name__ == "__main__":
    main()
