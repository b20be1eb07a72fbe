"""Training-step benchmark: gradgraph.TrainingSession vs PyTorch eager vs onnxruntime-training.

    python tools/bench_training.py [--models mlp,bert,gpt2] [--reps 20] [--threads 2]
                                   [--provider cpu|cuda] [--ort-venv .venv-ort-training]

Same models, batches and optimizer for every peer: the peer definitions in ../shared/peer/
models_def.py (MLP 784-512-512-10 batch 64; BERT-like 4 layers hidden 256 seq 128 batch 8;
GPT-2-like 4 layers n_embd 256 seq 128 batch 8; dropout active), AdamW (lr 1e-3, betas
0.9/0.999, eps 1e-6, weight decay 0), 2 threads. Each (model, peer) runs in its own child
process, so peak RSS is per peer. A step is forward + backward + optimizer update; the
figure is the median of --reps timed steps after --warmup warm-ups. onnxruntime-training
1.19.2 runs the peer's own script (../shared/peer/ort_train_bench.py) in the reference venv
made by tools/setup_ort_training.sh; it is skipped when that venv is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import PEER, report_child, run_child, time_steps  # noqa: E402 - tools/ is not a package

ROOT = Path(__file__).resolve().parent.parent
BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")
LR, EPS = 1e-3, 1e-6


def _peer_models():
    sys.path.insert(0, str(PEER))
    import models_def  # noqa: PLC0415 - the peer's module, found at run time

    return models_def


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


# ---- children ------------------------------------------------------------------------------


def child_export(name: str, out_dir: str) -> dict:
    import numpy as np
    import torch

    models_def = _peer_models()
    module, inputs, input_names = getattr(models_def, f"build_{name}")()
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


def child_gradgraph(name: str, out_dir: str, args) -> dict:
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
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.inter_op_num_threads = 1
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if args.provider == "cuda" else ["CPUExecutionProvider"]
    start = time.perf_counter()
    session = TrainingSession(path, config, sess_options=opts, providers=providers)
    setup = time.perf_counter() - start
    losses = []
    timing = time_steps(lambda: losses.append(session.train_step(feeds, lr=LR)), args.warmup, args.reps)
    return {"ok": True, "setup_s": setup, "trained": len(trained), "loss_first": losses[0],
            "loss_last": losses[-1], **timing}


def child_torch(name: str, out_dir: str, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    models_def = _peer_models()
    module, inputs, _ = getattr(models_def, f"build_{name}")()
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

    timing = time_steps(step, args.warmup, args.reps)
    return {"ok": True, "loss_first": losses[0], "loss_last": losses[-1], **timing}


# ---- parent --------------------------------------------------------------------------------


def _ort_training(name: str, out_dir: str, venv: Path) -> dict:
    python = venv / "bin" / "python"
    if not python.exists():
        return {"ok": False, "error": f"no reference venv at {venv} (run tools/setup_ort_training.sh)"}
    script = str(PEER / "ort_train_bench.py")
    key = f"gradgraph_bench_{name}"
    env = dict(os.environ, PEER_RESULTS_DIR=out_dir)
    gen = subprocess.run([str(python), script, "--child", "gen", "--key", key, "--path",
                          os.path.join(out_dir, f"{name}.onnx")], capture_output=True, text=True, env=env)
    rec = next((json.loads(x[7:]) for x in gen.stdout.splitlines() if x.startswith("RESULT ")), None)
    if not rec or not rec.get("ok"):
        return {"ok": False, "error": (rec or {}).get("error", gen.stderr[-400:])}
    train = subprocess.run([str(python), script, "--child", "train", "--key", key, "--path",
                            os.path.join(out_dir, f"{name}_inputs.npz")], capture_output=True, text=True, env=env)
    rec = next((json.loads(x[7:]) for x in train.stdout.splitlines() if x.startswith("RESULT ")), None)
    return rec or {"ok": False, "error": train.stderr[-400:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,bert,gpt2")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ort-venv", default=os.environ.get("GRADGRAPH_ORT_TRAINING_VENV",
                                                             str(ROOT / ".venv-ort-training")))
    parser.add_argument("--child", choices=["export", "gradgraph", "torch"])
    parser.add_argument("--model")
    parser.add_argument("--dir")
    args = parser.parse_args()
    if args.child:
        fn = {"export": lambda: child_export(args.model, args.dir),
              "gradgraph": lambda: child_gradgraph(args.model, args.dir, args),
              "torch": lambda: child_torch(args.model, args.dir, args)}[args.child]
        report_child(fn)
        return
    if not (PEER / "models_def.py").exists():
        sys.exit(f"peer material not found at {PEER} (set GRADGRAPH_PEER_DIR)")
    common = [f"--threads={args.threads}", f"--reps={args.reps}", f"--warmup={args.warmup}",
              f"--provider={args.provider}"]
    print(f"training step = forward + backward + AdamW; median of {args.reps} steps after {args.warmup} "
          f"warm-ups; {args.threads} threads; provider {args.provider}")
    header = f"{'model':<6} {'gradgraph ms':>12} {'torch ms':>9} {'ort-train ms':>12} {'gg/torch':>8} " \
             f"{'gg/ort':>7}  {'peak RSS MB gg / torch / ort':>28}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            me = [sys.executable, __file__, "--model", name, "--dir", tmp]
            export = run_child(me + ["--child", "export"])
            if not export.get("ok"):
                print(f"{name}: export failed: {export.get('error')}")
                continue
            gg = run_child(me + ["--child", "gradgraph", *common])
            th = run_child(me + ["--child", "torch", *common])
            ort_rec = _ort_training(name, tmp, Path(args.ort_venv)) if args.provider == "cpu" else {
                "ok": False, "error": "onnxruntime-training CPU build only"}
            rows.append((name, gg, th, ort_rec))
            for label, rec in (("gradgraph", gg), ("torch", th), ("onnxruntime-training", ort_rec)):
                if not rec.get("ok"):
                    print(f"{name}: {label} failed: {rec.get('error')}")
    print(header)

    def ms(rec):
        return rec.get("median_ms") if rec.get("ok") else None

    def fmt(value, spec=".1f"):
        return "-" if value is None else format(value, spec)

    for name, gg, th, ort_rec in rows:
        g, t, o = ms(gg), ms(th), ms(ort_rec)
        rss = " / ".join(fmt(r.get("peak_rss_mb"), ".0f") for r in (gg, th, ort_rec))
        print(f"{name:<6} {fmt(g):>12} {fmt(t):>9} {fmt(o):>12} {fmt(g / t if g and t else None, '.2f'):>8} "
              f"{fmt(g / o if g and o else None, '.2f'):>7}  {rss:>28}")


if __name__ == "__main__":
    main()
