"""``gradgraph train``: train an ONNX model whose graph computes its own loss.

``add_parser(subparsers)`` registers the sub-command; ``main(argv)`` runs it stand-alone
(``python -m gradgraph.train_cli MODEL.onnx --loss loss --data data.npz ...``).

Data: an ``.npz`` whose arrays are named after the model's inputs, batched along axis 0.
Micro-batch ``k`` (counted over the whole run) takes rows ``k*B .. k*B+B-1`` modulo the row
count, so a resumed run reads the same stream. With ``--checkpoint-dir`` the latest state
goes to ``checkpoint.safetensors`` (every ``--checkpoint-every`` steps and at the end), the
loss curve to ``loss.png`` and the trained inference model to ``inference.onnx``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gradgraph.feeds import InputError, load_npz
from gradgraph.schedules import KINDS, Schedule
from passes.optimizers import config_type

CHECKPOINT_NAME = "checkpoint.safetensors"
CURVE_NAME = "loss.png"
INFERENCE_NAME = "inference.onnx"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train an ONNX model (forward graph with a loss output)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="forward model (.onnx) whose graph outputs the loss")
    p.add_argument("--loss", required=True, help="name of the scalar loss output")
    p.add_argument("--data", required=True, help=".npz with one array per model input")
    p.add_argument("--optimizer", default="adamw", choices=["sgd", "adam", "adamw", "lamb"])
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, default=None, help="optimizer weight decay")
    p.add_argument("--no-decay", nargs="*", default=[], metavar="PATTERN",
                   help="weight name patterns trained without weight decay (e.g. '*.bias')")
    p.add_argument("--freeze", nargs="*", default=[], metavar="NAME", help="weights not to train")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps to reach")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--clip", type=float, default=None, help="global gradient-norm clipping threshold")
    p.add_argument("--schedule", default="constant", choices=KINDS)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: end only)")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop (and checkpoint) at this step; the schedule still spans --steps")
    p.add_argument("--resume", action="store_true", help="continue from CHECKPOINT_DIR's checkpoint")
    p.add_argument("--save-stages", default=None, help="directory for the intermediate models")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def _optimizer(args: argparse.Namespace) -> object:
    cls = config_type(args.optimizer)
    kwargs: dict[str, float] = {}
    if args.weight_decay is not None:
        kwargs["weight_decay"] = args.weight_decay
    if args.optimizer == "sgd":
        kwargs["momentum"] = args.momentum
    return cls(**kwargs)


def _batch(data: dict[str, np.ndarray], index: int, size: int) -> dict[str, np.ndarray]:
    rows = next(iter(data.values())).shape[0]
    take = (np.arange(size) + index * size) % rows
    return {k: v[take] for k, v in data.items()}


def save_curve(losses: Sequence[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from gradgraph.session import TrainingSession
    from gradgraph.training import TrainingConfig
    from passes.optimizers import ParamGroup

    data = load_npz(args.data, "data file")
    if not data:
        raise InputError(f"data file {args.data!r} holds no arrays")
    groups = (ParamGroup(tuple(args.no_decay), {"weight_decay": 0.0}),) if args.no_decay else ()
    config = TrainingConfig(args.loss, _optimizer(args), weights_not_to_train=tuple(args.freeze),
                            groups=groups, accumulation_steps=args.accumulate, max_grad_norm=args.clip)
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if args.device == "cuda" \
        else ["CPUExecutionProvider"]
    session = TrainingSession(args.model, config, providers=providers, save_stages=args.save_stages)
    schedule = Schedule(args.schedule, args.lr, args.steps, args.warmup_steps)
    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    losses: list[float] = []
    if args.resume:
        if ckpt_dir is None or not (ckpt_dir / CHECKPOINT_NAME).is_file():
            raise SystemExit("--resume needs --checkpoint-dir holding " + CHECKPOINT_NAME)
        losses = list(session.load_checkpoint(ckpt_dir / CHECKPOINT_NAME).get("losses", []))

    def checkpoint() -> None:
        if ckpt_dir is not None:
            session.save_checkpoint(ckpt_dir / CHECKPOINT_NAME, {"losses": losses})
            save_curve(losses, ckpt_dir / CURVE_NAME)

    bar = tqdm(total=args.steps, initial=session.step, disable=args.quiet, unit="step",
               mininterval=0.5 if sys.stderr.isatty() else 5.0)
    start, done = time.perf_counter(), 0
    micro = session.step * args.accumulate + session.micro_step
    last = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    while session.step < last:
        step = session.step
        lr = schedule.lr_at(step)
        micro_losses = []
        while session.step == step:
            try:
                loss = session.train_step(_batch(data, micro, args.batch_size), lr=lr)
            except InputError as exc:
                bar.close()
                raise InputError(f"data file {args.data!r} does not fit the model: {exc}") from exc
            micro_losses.append(loss)
            micro += 1
        losses.append(float(np.mean(micro_losses)))
        done += 1
        bar.set_postfix(loss=f"{losses[-1]:.4g}", lr=f"{lr:.3g}",
                        steps_per_s=f"{done / (time.perf_counter() - start):.1f}", refresh=False)
        bar.update(1)
        if args.checkpoint_every and session.step % args.checkpoint_every == 0:
            checkpoint()
    bar.close()
    checkpoint()
    if ckpt_dir is not None:
        session.export_inference_model(ckpt_dir / INFERENCE_NAME)
    if losses:
        where = f"; loss curve and checkpoint in {ckpt_dir}/" if ckpt_dir is not None else ""
        print(f"step {session.step}: loss {losses[-1]:.6g} (first step of this run: {losses[0]:.6g}){where}",
              file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradgraph")
    add_parser(parser.add_subparsers(dest="command", required=True))
    from gradgraph.cli import run_command

    return run_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
