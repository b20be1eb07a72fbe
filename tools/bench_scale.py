"""Scale benchmark (issue 34 §5, partial): gradgraph's TrainingSession against torch eager on a
real-size model, each in its own process.

    python tools/bench_scale.py --model gpt2 --optimizer adamw    # HF GPT-2 small, 124 M params
    python tools/bench_scale.py --model big --optimizer sgd       # 2 x 1.1 GB MatMul weights
    python tools/bench_scale.py --model mid --optimizer adamw     # 2 x 268 MB, the same layout

Columns: export time (torch.onnx.export dynamo=True, optimize=False; GPT-2 only), setup
(gradgraph: TrainingSession from the file; torch: the module and optimizer), the median step,
peak RSS (the process's VmHWM), checkpoint save (gradgraph: save_checkpoint; torch:
safetensors.torch.save_file of the state dict and the optimizer's state) and, for gradgraph,
inference.onnx (export_inference_model). Not measured here: ORTModule, and a GPU column.
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


def run_torch(kind: str, out: Path, optimizer: str, steps: int) -> dict[str, float]:
    import safetensors.torch
    import torch

    start = time.perf_counter()
    if kind == "gpt2":
        module = _gpt2_module()
        params = list(module.parameters())

        def loss_of(feeds):  # type: ignore[no-untyped-def]
            return module(torch.from_numpy(feeds["ids"]), torch.from_numpy(feeds["labels"]))
    else:
        data = out / "model.onnx.data"
        k, n = SIZES[kind]
        w1 = torch.nn.Parameter(torch.from_numpy(np.fromfile(data, np.float32, k * n).reshape(k, n)))
        w2 = torch.nn.Parameter(torch.from_numpy(np.fromfile(data, np.float32, n * k, offset=k * n * 4)
                                                 .reshape(n, k)))
        params = [w1, w2]

        def loss_of(feeds):  # type: ignore[no-untyped-def]
            x, y = torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["y"])
            return ((torch.tanh(x @ w1) @ w2 - y) ** 2).mean()
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=1e-4),
           "adamw": lambda: torch.optim.AdamW(params, lr=1e-4),
           "adam": lambda: torch.optim.Adam(params, lr=1e-4)}[optimizer]()
    setup = time.perf_counter() - start
    times = []
    for feeds in _feeds(kind, steps):
        t = time.perf_counter()
        opt.zero_grad()
        loss_of(feeds).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    tensors = {f"p{i}": p.detach() for i, p in enumerate(params)}
    for i, state in enumerate(opt.state.values()):
        tensors.update({f"s{i}.{k}": v for k, v in state.items() if torch.is_tensor(v) and v.dim()})
    safetensors.torch.save_file(tensors, str(out / "torch_checkpoint.safetensors"))
    save = time.perf_counter() - t
    return {"setup_s": setup, "step_s": statistics.median(times), "save_s": save,
            "peak_rss_bytes": _peak_bytes()}


def _worker(args: argparse.Namespace) -> None:
    run = run_gradgraph if args.worker == "gradgraph" else run_torch
    print(json.dumps(run(args.model, Path(args.out), args.optimizer, args.steps)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt2", *SIZES], default="gpt2")
    parser.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="adamw")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", choices=["gradgraph", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_scale-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = {"export": prepare(args.model, out)}
    for worker in ("torch", "gradgraph"):
        result = subprocess.run([sys.executable, __file__, "--worker", worker, "--model", args.model,
                                 "--optimizer", args.optimizer, "--steps", str(args.steps), "--out", str(out)],
                                capture_output=True, text=True, check=True, cwd=REPO)
        rows[worker] = json.loads(result.stdout.strip().splitlines()[-1])
    import onnx

    from gradgraph.runtime.external import check_external_data

    path = out / "model.onnx"
    weights = check_external_data(onnx.load(str(path), load_external_data=False), path)
    print(f"{args.model}, {args.optimizer}, batch {BATCH}, {weights / 1e6:.0f} MB of external weights, "
          f"files in {out}")
    print("| | setup s | median step s | peak RSS GB | checkpoint save s | inference.onnx s |")
    print("|---|---|---|---|---|---|")
    for worker in ("torch", "gradgraph"):
        r = rows[worker]
        print(f"| {worker} | {r['setup_s']:.2f} | {r['step_s']:.3f} | {r['peak_rss_bytes'] / 1e9:.2f} | "
              f"{r['save_s']:.2f} | {r.get('inference_onnx_s', float('nan')):.2f} |")
    if rows["export"]:
        print(f"export (torch.onnx.export dynamo=True, optimize=False): {rows['export']['export_s']:.1f} s")
    ratio = rows["gradgraph"]["peak_rss_bytes"] / rows["torch"]["peak_rss_bytes"]
    print(f"peak RSS gradgraph / torch: {ratio:.2f}")


if __name__ == "__main__":
    main()
