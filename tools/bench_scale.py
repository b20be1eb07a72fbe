"""Scale benchmark (issue 34 §5): gradgraph against torch eager on a real-size model, each
worker in its own process.

    python tools/bench_scale.py --model gpt2 --optimizer adamw    # HF GPT-2 small, 124 M params
    python tools/bench_scale.py --model big --optimizer sgd       # 2 x 1.1 GB MatMul weights
    python tools/bench_scale.py --model mid --optimizer adamw     # 2 x 268 MB, the same layout

Workers (--workers): torch (eager loop), gradgraph (TrainingSession from the exported file),
cli (`gradgraph train` on the same batches, with --checkpoint-dir: the whole command timed),
ortmodule (the torch loop with the module in gradgraph.torch.ORTModule; its first step, the
export and build, reported apart).

Columns: setup (gradgraph: TrainingSession from the file; torch and ORTModule: the module and
optimizer), the median step and its ratio to torch's, peak RSS (the process's VmHWM) and its
ratio, checkpoint save (gradgraph: save_checkpoint; torch, ORTModule: safetensors.torch.save_file
of the parameters and the optimizer's state), inference.onnx (export_inference_model), and the
export time (torch.onnx.export dynamo=True, optimize=False; GPT-2 only). No GPU column.
Files go to --out (default: a temp folder); the export is reused when it exists there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BATCH, SEQ = 2, 64
# (k, n) of the two-weight model (tests/test_large_models.py's layout): w1 [k, n], w2 [n, k].
SIZES = {"big": (16384, 17000), "mid": (8192, 8192)}


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        return 1024 * int(next(line.split()[1] for line in f if line.startswith("VmHWM")))


def _gpt2_module():  # type: ignore[no-untyped-def]
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, ids, labels):  # type: ignore[no-untyped-def]
            return self.m(input_ids=ids, labels=labels).loss

    return WithLoss()


def _feeds(kind: str, steps: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    if kind == "gpt2":
        out = []
        for _ in range(steps):
            ids = rng.integers(0, 50257, (BATCH, SEQ)).astype(np.int64)
            out.append({"ids": ids, "labels": ids})
        return out
    k = SIZES[kind][0]
    return [{"x": rng.standard_normal((BATCH, k)).astype(np.float32),
             "y": rng.standard_normal((BATCH, k)).astype(np.float32)} for _ in range(steps)]


def prepare(kind: str, out: Path) -> dict[str, float]:
    """The ONNX model in ``out`` (exported, or built for ``big``); its export time."""
    model = out / "model.onnx"
    if model.exists():
        return {}
    start = time.perf_counter()
    if kind == "gpt2":
        import warnings

        import torch

        feeds = _feeds(kind, 1)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(_gpt2_module(), (torch.from_numpy(feeds["ids"]), torch.from_numpy(feeds["labels"])),
                              str(model), dynamo=True, optimize=False, input_names=["ids", "labels"],
                              output_names=["loss"])
        return {"export_s": time.perf_counter() - start}
    sys.path.insert(0, str(REPO / "tests"))
    from test_large_models import make_model

    make_model(out, *SIZES[kind])
    return {}


def run_gradgraph(kind: str, out: Path, optimizer: str, steps: int) -> dict[str, float]:
    from gradgraph import TrainingConfig, TrainingSession
    from passes.optimizer import config_type

    start = time.perf_counter()
    session = TrainingSession(str(out / "model.onnx"), TrainingConfig("loss", config_type(optimizer)()),
                              providers=["CPUExecutionProvider"])
    setup = time.perf_counter() - start
    times = []
    for feeds in _feeds(kind, steps):
        t = time.perf_counter()
        session.train_step(feeds, lr=1e-4)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    session.save_checkpoint(out / "gg_checkpoint.safetensors")
    save = time.perf_counter() - t
    t = time.perf_counter()
    session.export_inference_model(out / "gg_inference.onnx", keep_loss=False)
    infer = time.perf_counter() - t
    return {"setup_s": setup, "step_s": statistics.median(times), "save_s": save,
            "inference_onnx_s": infer, "peak_rss_bytes": _peak_bytes()}


def run_cli(kind: str, out: Path, optimizer: str, steps: int) -> dict[str, float]:
    """``gradgraph train`` (in this process: its peak RSS is the command's), checkpoint and
    inference.onnx included; the whole command's time, step times not separable."""
    from gradgraph.cli.main import main as cli_main

    feeds = _feeds(kind, steps)
    data = out / "cli_data.npz"
    np.savez(data, **{k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]})
    start = time.perf_counter()
    code = cli_main(["train", str(out / "model.onnx"), "--loss", "loss", "--data", str(data),
                     "--optimizer", optimizer, "--lr", "1e-4", "--steps", str(steps), "--batch-size",
                     str(BATCH), "--checkpoint-dir", str(out / "cli_run"), "--overwrite", "--quiet"])
    if code != 0:
        raise SystemExit(f"gradgraph train exited {code}")
    return {"total_s": time.perf_counter() - start, "peak_rss_bytes": _peak_bytes()}


def _torch_model(kind: str, out: Path):  # type: ignore[no-untyped-def]
    """The module (its forward returns the loss) and how to call it on a batch."""
    import torch

    if kind == "gpt2":
        module = _gpt2_module()

        def loss_of(m, feeds):  # type: ignore[no-untyped-def]
            return m(torch.from_numpy(feeds["ids"]), torch.from_numpy(feeds["labels"]))
        return module, loss_of
    data = out / "model.onnx.data"
    k, n = SIZES[kind]

    class TwoWeights(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.from_numpy(np.fromfile(data, np.float32, k * n).reshape(k, n)))
            self.w2 = torch.nn.Parameter(torch.from_numpy(
                np.fromfile(data, np.float32, n * k, offset=k * n * 4).reshape(n, k)))

        def forward(self, x, y):  # type: ignore[no-untyped-def]
            return ((torch.tanh(x @ self.w1) @ self.w2 - y) ** 2).mean()

    def loss_of(m, feeds):  # type: ignore[no-untyped-def]
        return m(torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["y"]))
    return TwoWeights(), loss_of


def run_torch(kind: str, out: Path, optimizer: str, steps: int, ortmodule: bool = False) -> dict[str, float]:
    """Torch eager's loop, or (``ortmodule``) the same loop with the module in ORTModule: its
    first step (export and build) is reported apart, the median is over the others."""
    import safetensors.torch
    import torch

    start = time.perf_counter()
    module, loss_of = _torch_model(kind, out)
    params = list(module.parameters())
    if ortmodule:
        from gradgraph.torch import ORTModule

        module = ORTModule(module)
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=1e-4),
           "adamw": lambda: torch.optim.AdamW(params, lr=1e-4),
           "adam": lambda: torch.optim.Adam(params, lr=1e-4)}[optimizer]()
    setup = time.perf_counter() - start
    times = []
    for feeds in _feeds(kind, steps + ortmodule):
        t = time.perf_counter()
        opt.zero_grad()
        loss_of(module, feeds).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    tensors = {f"p{i}": p.detach() for i, p in enumerate(params)}
    for i, state in enumerate(opt.state.values()):
        tensors.update({f"s{i}.{k}": v for k, v in state.items() if torch.is_tensor(v) and v.dim()})
    safetensors.torch.save_file(tensors, str(out / "torch_checkpoint.safetensors"))
    save = time.perf_counter() - t
    first = {"first_step_s": times.pop(0)} if ortmodule else {}
    return {"setup_s": setup, **first, "step_s": statistics.median(times), "save_s": save,
            "peak_rss_bytes": _peak_bytes()}


WORKERS = {"torch": run_torch, "gradgraph": run_gradgraph, "cli": run_cli,
           "ortmodule": lambda *a: run_torch(*a, ortmodule=True)}


def _worker(args: argparse.Namespace) -> None:
    print(json.dumps(WORKERS[args.worker](args.model, Path(args.out), args.optimizer, args.steps)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt2", *SIZES], default="gpt2")
    parser.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="adamw")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--workers", default="torch,gradgraph,cli,ortmodule",
                        help="which to run, comma-separated (default: %(default)s)")
    parser.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_scale-"))
    out.mkdir(parents=True, exist_ok=True)
    workers = [w for w in args.workers.split(",") if w]
    unknown = sorted(set(workers) - set(WORKERS))
    if unknown or "torch" not in workers:
        parser.error(f"--workers: {unknown or 'torch'} ({'unknown' if unknown else 'needed: the ratios are to it'}); "
                     f"choose among {', '.join(WORKERS)}")
    export = prepare(args.model, out)
    rows: dict[str, dict[str, float]] = {}
    for worker in workers:
        print(f"[bench_scale] {worker} ...", file=sys.stderr, flush=True)
        result = subprocess.run([sys.executable, __file__, "--worker", worker, "--model", args.model,
                                 "--optimizer", args.optimizer, "--steps", str(args.steps), "--out", str(out)],
                                capture_output=True, text=True, cwd=REPO)
        if result.returncode != 0:
            raise SystemExit(f"the {worker} worker exited {result.returncode}:\n{result.stderr[-3000:]}")
        rows[worker] = json.loads(result.stdout.strip().splitlines()[-1])
    import onnx

    from gradgraph.runtime.external import check_external_data

    path = out / "model.onnx"
    weights = check_external_data(onnx.load(str(path), load_external_data=False), path)
    print(f"{args.model}, {args.optimizer}, batch {BATCH}, {weights / 1e6:.0f} MB of external weights, "
          f"files in {out}")
    columns = [("setup s", "setup_s", ".2f"), ("first step s", "first_step_s", ".2f"),
               ("median step s", "step_s", ".3f"), ("step / torch", "step_ratio", ".2f"),
               ("peak RSS GB", "peak_gb", ".2f"), ("RSS / torch", "rss_ratio", ".2f"),
               ("checkpoint save s", "save_s", ".2f"), ("inference.onnx s", "inference_onnx_s", ".2f"),
               ("whole command s", "total_s", ".1f")]
    base = rows["torch"]
    for r in rows.values():
        r["peak_gb"] = r["peak_rss_bytes"] / 1e9
        r["rss_ratio"] = r["peak_rss_bytes"] / base["peak_rss_bytes"]
        if "step_s" in r:
            r["step_ratio"] = r["step_s"] / base["step_s"]
    print("| | " + " | ".join(c[0] for c in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for worker, r in rows.items():
        cells = [format(r[key], fmt) if key in r else "-" for _, key, fmt in columns]
        print(f"| {worker} | " + " | ".join(cells) + " |")
    if export:
        print(f"export (torch.onnx.export dynamo=True, optimize=False): {export['export_s']:.1f} s")
    print("gradgraph: TrainingSession; cli: gradgraph train (steps, checkpoint and inference.onnx: the whole "
          "command); ortmodule: the torch loop with the module in gradgraph.torch.ORTModule (first step: "
          "export and build)")


if __name__ == "__main__":
    main()
