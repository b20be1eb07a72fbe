"""``gradgraph train``: train an ONNX model whose graph computes its own loss.

``add_parser(subparsers)`` registers the sub-command; ``run(args)`` runs it. Help text for
users is ``DESCRIPTION`` (what ``gradgraph train -h`` prints).
"""

from __future__ import annotations

import argparse
import io
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir
from tqdm import tqdm

from gradgraph.cli.common import (
    EXIT_INTERRUPTED,
    STATUS_FILE_ENV,
    add_eps_argument,
    add_list_weights,
    add_pass_arguments,
    dims_arg,
    eps_kwargs,
    list_weights,
    main_for,
    pass_groups,
    require_torch,
)
from gradgraph.feeds import InputError, load_npz
from gradgraph.index_inputs import IndexCheck
from gradgraph.io import atomic_write_bytes, load_model, remove_stale_temps
from gradgraph.training.checkpoint import CheckpointError
from gradgraph.training.rank_agreement import command_configuration
from gradgraph.training.schedules import KINDS, Schedule
from passes.optimizer import config_type

DESCRIPTION = """\
Train an ONNX model whose graph outputs its own loss (e.g. a torch.onnx.export of a module
whose forward returns the loss). By default the model's parameters are trained (see
--list-weights); buffers and exporter constants stay fixed.

Data: an .npz with one array per model input, batched along axis 0 (extra arrays are an
error). Micro-batch k of the run takes rows k*B .. k*B+B-1, wrapping around the data, so
every batch is full and a resumed run reads the same stream. A model exported with a fixed
batch dimension is made batch-dynamic when --batch-size differs from it.

A step whose loss, weights or optimizer state would turn NaN/inf is skipped (nothing
changes); after --max-skipped skipped steps in a row the run stops with exit status 3.
With --checkpoint-dir the latest state goes to checkpoint.safetensors, the loss curve to
loss.png and the trained model to inference.onnx. Ctrl-C saves a checkpoint and exits 130.
A folder that already holds a checkpoint is refused unless --resume (continue it) or
--overwrite (start afresh, replacing it) is given.

inference.onnx is the model for inference: Dropout off, BatchNorm in inference mode, the
trained weights inside, and the loss (with the inputs only the loss reads, such as the labels)
removed whenever the model has other outputs. A model whose only output is the loss keeps it,
and its inputs. checkpoint.safetensors loads into the torch module the model was exported
from: model.load_state_dict(safetensors.torch.load_file(path), strict=False) (it also holds
the optimizer state and the step, which the module does not take). Models over 1 GiB are
written with external data: inference.onnx + inference.onnx.data.

Data parallel: --nproc N launches N local ranks through torch.distributed's launcher
(torchrun; gloo on CPU, NCCL on CUDA). --batch-size is then the per-rank batch: rank r reads
rows r*B .. r*B+B-1 of every global micro-batch of N*B rows, so the run is the same training as
one process with --batch-size N*B (gradients are averaged over the ranks). Rank 0 writes the
checkpoint, the loss curve and the model. Under torchrun itself (several machines: torchrun
--nnodes ... -m gradgraph train ...), leave --nproc out: each process is one rank.

Exit status: 0 done; 1 internal error; 2 a user error (one line on stderr, nothing written);
3 training diverged (too many non-finite steps in a row); 130 interrupted.
"""
EXIT_DIVERGED = 3
CHECKPOINT_NAME = "checkpoint.safetensors"
CURVE_NAME = "loss.png"
INFERENCE_NAME = "inference.onnx"
# Options that may differ between data-parallel ranks (paths, output): the others must agree.
PER_RANK_OPTIONS = ("model", "data", "checkpoint_dir", "save_stages", "quiet", "argv", "command",
                    "list_weights", "func")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train an ONNX model (forward graph with a loss output)",
                              description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="forward model (.onnx) whose graph outputs the loss")
    p.add_argument("--loss", required=True, help="name of the loss output")
    p.add_argument("--data", help=".npz with one array per model input (required unless "
                   "--list-weights)")
    add_list_weights(p)
    p.add_argument("--reduce", choices=["sum", "mean"], default=None,
                   help="reduce a non-scalar loss (default: refuse one)")
    p.add_argument("--optimizer", default="adamw", choices=["sgd", "adam", "adamw", "lamb"],
                   help="optimizer (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=None,
                   help="weight decay (default: the optimizer's: 0.01 for adamw, 0 otherwise)")
    add_eps_argument(p)
    p.add_argument("--no-decay", nargs="*", default=[], metavar="PATTERN",
                   help="weight name patterns trained without weight decay (e.g. '*.bias')")
    p.add_argument("--freeze", nargs="*", default=[], metavar="NAME",
                   help="weights not to train (exact names, see --list-weights)")
    p.add_argument("--steps", type=int, help="optimizer steps to reach (required unless --list-weights)")
    p.add_argument("--batch-size", type=int, help="rows per micro-batch (required unless --list-weights)")
    p.add_argument("--nproc", type=int, default=1,
                   help="local data-parallel ranks; --batch-size is per rank (default: %(default)s)")
    p.add_argument("--accumulate", type=int, default=1,
                   help="micro-batches per optimizer step (default: %(default)s)")
    p.add_argument("--clip", type=float, default=None,
                   help="global gradient-norm clipping threshold (default: no clipping)")
    p.add_argument("--schedule", default="constant", choices=KINDS,
                   help="learning-rate schedule (default: %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warmup steps (default: %(default)s)")
    p.add_argument("--max-skipped", type=int, default=5,
                   help="stop (exit 3) after this many non-finite steps in a row (default: %(default)s)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where checkpoint.safetensors, loss.png and inference.onnx go (default: none)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="steps between checkpoints; 0: at the end only (default: %(default)s)")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop (and checkpoint) at this step; the schedule still spans --steps")
    p.add_argument("--resume", action="store_true", help="continue from CHECKPOINT_DIR's checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in a CHECKPOINT_DIR that holds a checkpoint, replacing it "
                   "(without --resume or --overwrite such a folder is refused)")
    p.add_argument("--save-stages", default=None, metavar="DIR",
                   help="also save each build stage's model in DIR")
    add_pass_arguments(p)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="execution provider (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def _validate(args: argparse.Namespace) -> None:
    """Range checks of the numeric options: a user error, never a traceback or a silent no-op."""
    def need(ok: bool, flag: str, what: str) -> None:
        if not ok:
            raise InputError(f"{flag} must be {what} (got {getattr(args, flag[2:].replace('-', '_'))})")

    for flag in ("--data", "--steps", "--batch-size"):
        if getattr(args, flag[2:].replace("-", "_")) is None:
            raise InputError(f"{flag} is required (unless --list-weights)")
    need(args.steps >= 1, "--steps", "a positive integer")
    need(args.batch_size >= 1, "--batch-size", "a positive integer")
    need(args.accumulate >= 1, "--accumulate", "a positive integer")
    need(args.nproc >= 1, "--nproc", "a positive integer")
    need(math.isfinite(args.lr) and args.lr > 0, "--lr", "a finite number > 0")
    need(math.isfinite(args.momentum) and 0 <= args.momentum < 1, "--momentum", "in [0, 1)")
    need(args.weight_decay is None or (math.isfinite(args.weight_decay) and args.weight_decay >= 0),
         "--weight-decay", "a finite number >= 0")
    need(args.clip is None or (math.isfinite(args.clip) and args.clip > 0), "--clip", "a finite number > 0")
    need(0 <= args.warmup_steps <= args.steps, "--warmup-steps", "in [0, --steps]")
    need(args.checkpoint_every >= 0, "--checkpoint-every", "an integer >= 0")
    need(args.max_skipped >= 1, "--max-skipped", "a positive integer")
    need(args.stop_at is None or 0 <= args.stop_at <= args.steps, "--stop-at", "in [0, --steps]")
    dims_arg(args.dim)  # a malformed --dim is an error whatever else is given
    launching = args.nproc > 1 and "RANK" not in os.environ  # rank 0 will say it again
    if args.dim and not args.recompute and args.memory_budget is None and not launching:
        warnings.warn("--dim sizes symbolic dimensions for the recompute planner (--recompute, "
                      "--memory-budget); without them it changes nothing", stacklevel=2)
    if args.momentum and args.optimizer != "sgd" and not launching:
        warnings.warn(f"--momentum is SGD's; --optimizer {args.optimizer} ignores it", stacklevel=2)
    if args.resume and args.checkpoint_dir is None:
        raise InputError("--resume needs --checkpoint-dir (the folder holding " + CHECKPOINT_NAME + ")")


def _checkpoint_dir(args: argparse.Namespace, rank: int = 0) -> Path | None:
    """Create and probe the checkpoint folder before training, so a bad one fails in a second
    (rank 0 only: the other ranks write nothing)."""
    if args.checkpoint_dir is None:
        return None
    path = Path(args.checkpoint_dir)
    if args.resume and args.overwrite:
        raise InputError("--resume continues the checkpoint that --overwrite would replace: give one "
                         "of them")
    if not args.resume and not args.overwrite and (path / CHECKPOINT_NAME).is_file():
        raise InputError(f"--checkpoint-dir {str(path)!r} already holds {CHECKPOINT_NAME} from an earlier "
                         "run: give --resume to continue it, or --overwrite to start afresh and "
                         "replace it")
    if args.resume and not (path / CHECKPOINT_NAME).is_file():
        raise InputError(f"--resume: no {CHECKPOINT_NAME} in {str(path)!r} (train without --resume "
                         "first, or point --checkpoint-dir at a run's folder)")
    if rank != 0:
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".gradgraph-probe-"):
            pass
    except OSError as exc:
        raise InputError(f"--checkpoint-dir {str(path)!r} is not a writable folder: {exc.strerror or exc}") from exc
    for name in (CHECKPOINT_NAME, CURVE_NAME, INFERENCE_NAME):  # left by a killed earlier run
        for stale in remove_stale_temps(path / name):
            print(f"gradgraph train: removed {stale.name}, left by an interrupted save",
                  file=sys.stderr)
    return path


def _optimizer(args: argparse.Namespace) -> object:
    cls = config_type(args.optimizer)
    kwargs: dict[str, float] = {}
    if args.weight_decay is not None:
        kwargs["weight_decay"] = args.weight_decay
    if args.optimizer == "sgd":
        kwargs["momentum"] = args.momentum
    kwargs.update(eps_kwargs(args))
    try:
        return cls(**kwargs)
    except ValueError as exc:  # a value the config refuses, named by its field
        raise InputError(f"optimizer options: {exc}") from exc


def _batch(data: dict[str, np.ndarray], index: int, size: int, rank: int = 0,
           world: int = 1) -> dict[str, np.ndarray]:
    """Rank ``rank``'s ``size`` rows of global micro-batch ``index`` (``world * size`` rows)."""
    rows = next(iter(data.values())).shape[0]
    take = (np.arange(size) + rank * size + index * size * world) % rows
    return {k: v[take] for k, v in data.items()}


def _world(args: argparse.Namespace) -> tuple[int, int]:
    """(rank, world size) of this process: torchrun's environment, else (0, 1)."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world > 1 and args.nproc not in (1, local):
        raise InputError(f"--nproc {args.nproc}: this process is already rank {rank} of {world} "
                         "(started by torchrun); leave --nproc out under torchrun")
    return rank, world


def _launch_ranks(args: argparse.Namespace) -> int:
    """``--nproc N`` outside torchrun: run this command line as N ranks under torchrun."""
    _precheck(args)
    argv, rest = [], iter(args.argv)
    for item in rest:  # the ranks get the command line without --nproc (torchrun would take it)
        if item == "--nproc":
            next(rest, None)
        elif not item.startswith("--nproc="):
            argv.append(item)
    command = [sys.executable, "-m", "gradgraph.cli.launch", "--standalone",
               f"--nproc-per-node={args.nproc}", "--module", "gradgraph", *argv]
    env = dict(os.environ)
    # each rank gets its share of the cores (onnxruntime's threads; torch's for the all-reduce)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    with tempfile.TemporaryDirectory(prefix="gradgraph-ranks-") as tmp:
        status_file = Path(tmp) / "rank0.status"
        env[STATUS_FILE_ENV] = str(status_file)
        proc = subprocess.Popen(command, env=env)
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:  # torchrun forwards it to the ranks: wait for their saves
                continue
        # rank 0's own status (2 user error, 3 diverged, 130 interrupted) rather than torchrun's 1
        if status_file.is_file():
            return int(status_file.read_text() or code)
        return code if code else 1


def _precheck(args: argparse.Namespace) -> None:
    """The user errors every rank would hit, found once before the ranks start: the loss name,
    --freeze names, the data arrays against the model's inputs."""
    from gradgraph.io import load_model
    from passes.exports.signature import torch_parameter_names

    model = load_model(args.model, lazy=True)  # names and shapes: the weights stay in their file
    outputs = [v.name for v in model.graph.outputs]
    if args.loss not in outputs:
        raise InputError(f"--loss {args.loss!r} is not an output of {args.model!r} (outputs: {outputs})")
    known = set(model.graph.initializers) | torch_parameter_names(model)  # folded ones too
    unknown = [n for n in args.freeze if n not in known]
    if unknown:
        raise InputError(f"--freeze {unknown}: not initializers of {args.model!r}")
    inputs = [v.name or "" for v in model.graph.inputs if not v.is_initializer()]
    IndexCheck(model)(_check_data(load_npz(args.data, "data file"), inputs, args.data), f"data file {args.data!r}")


def _check_data(data: dict[str, np.ndarray], inputs: Sequence[str], path: str) -> dict[str, np.ndarray]:
    """The arrays for the model's user inputs: all present, none extra, the same row count."""
    missing = [n for n in inputs if n not in data]
    extra = sorted(set(data) - set(inputs))
    if missing or extra:
        raise InputError(f"data file {path!r} must hold exactly the model inputs {list(inputs)}: "
                         f"missing {missing}, unexpected {extra}")
    scalars = [n for n in inputs if not data[n].ndim]
    if scalars:
        raise InputError(f"data file {path!r}: {scalars} are 0-d arrays (one value each); every array "
                         "needs a row axis 0 that batches are cut from")
    rows = {n: data[n].shape[0] for n in inputs}
    if len(set(rows.values())) != 1:
        raise InputError(f"data file {path!r}: every array needs the same number of rows on axis 0; "
                         f"got {rows}")
    if next(iter(rows.values())) == 0:
        raise InputError(f"data file {path!r} holds no rows")
    return {n: data[n] for n in inputs}


def _resumed_losses(value: object, path: Path) -> list[float]:
    """The loss curve a checkpoint's user metadata holds: a list of numbers (finite or NaN)."""
    def number(x: object) -> bool:
        return (isinstance(x, (int, float)) and not isinstance(x, bool)
                and (math.isfinite(x) or math.isnan(x)))

    if not isinstance(value, list) or not all(number(x) for x in value):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise CheckpointError(f"checkpoint {str(path)!r}: metadata 'losses' must be a list of "
                              f"numbers (the loss curve), got {shown}; the file is damaged or was "
                              "edited (train without --resume, or into another --checkpoint-dir)")
    return [float(x) for x in value]


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
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())  # a unique temp name, renamed over the old curve


def run(args: argparse.Namespace) -> int:
    from gradgraph.training.options import TrainingConfig
    from gradgraph.training.session import TrainingSession
    from passes.optimizer import ParamGroup
    from passes.optimizer.optimizer_pass import UpdateOptions

    if args.list_weights:
        return list_weights(args)
    _validate(args)
    rank, world = _world(args)
    if (world > 1 or args.nproc > 1) and args.mixed_precision == "float16":
        raise InputError("--mixed-precision float16 with data-parallel training (--nproc or torchrun) "
                         "is not implemented yet (its loss scale would have to agree across ranks): "
                         "use --mixed-precision bfloat16, or float32")
    ckpt_dir = _checkpoint_dir(args, rank)
    data = load_npz(args.data, "data file")
    if args.nproc > 1 and world == 1:
        require_torch(f"--nproc {args.nproc} (data-parallel ranks on torch.distributed)")
        return _launch_ranks(args)  # the checks above ran once, here, before any rank starts
    groups = (ParamGroup(tuple(args.no_decay), {"weight_decay": 0.0}),) if args.no_decay else ()
    try:
        config = TrainingConfig(args.loss, _optimizer(args), weights_not_to_train=tuple(args.freeze),
                                loss_reduction=args.reduce, update=UpdateOptions(
                                    groups=groups, accumulation_steps=args.accumulate,
                                    max_grad_norm=args.clip), **pass_groups(args))  # type: ignore[arg-type]
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    providers: list = ["CUDAExecutionProvider", "CPUExecutionProvider"] if args.device == "cuda" \
        else ["CPUExecutionProvider"]
    if args.device == "cuda" and world > 1:  # one GPU per local rank
        providers[0] = ("CUDAExecutionProvider", {"device_id": int(os.environ.get("LOCAL_RANK", "0"))})
    model = _fit_batch(args.model, args.batch_size)
    distributed, sess_options = None, None
    if world > 1:
        import onnxruntime as ort

        from gradgraph.training.distributed import DistributedConfig

        distributed = DistributedConfig.from_env()
        sess_options = ort.SessionOptions()
        sess_options.intra_op_num_threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    session = TrainingSession(model, config, sess_options, providers=providers,
                              save_stages=args.save_stages if rank == 0 else None,
                              distributed=distributed)
    data = _check_data(data, session.artifacts.feeds, args.data)
    graph = model if isinstance(model, ir.Model) else load_model(model, lazy=True)
    IndexCheck(graph)(data, f"data file {args.data!r}")  # torch's IndexError, before any step
    if session.data_parallel is not None:  # every rank's options and data alike, or one line
        session.data_parallel.agree(command_configuration(vars(args), data, PER_RANK_OPTIONS))
    schedule = Schedule(args.schedule, args.lr, args.steps, args.warmup_steps)
    losses: list[float] = []
    if args.resume and ckpt_dir is not None:
        path = ckpt_dir / CHECKPOINT_NAME
        losses = _resumed_losses(session.load_checkpoint(path).get("losses", []), path)
    resumed_from = len(losses)
    last = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    if args.resume and session.step > args.steps:
        raise InputError(f"--resume: the checkpoint in {str(ckpt_dir)!r} is at step {session.step}, past "
                         f"--steps {args.steps}; give --steps above {session.step} to train on")
    if args.resume and session.step >= last:
        if rank == 0:
            print(f"gradgraph train: the checkpoint in {ckpt_dir}/ is already at step {session.step} "
                  f"(--{'steps' if last == args.steps else 'stop-at'} {last}); nothing to train",
                  file=sys.stderr)
        return 0

    def checkpoint() -> None:
        if ckpt_dir is not None and rank == 0:
            session.save_checkpoint(ckpt_dir / CHECKPOINT_NAME, {"losses": losses})
            save_curve(losses, ckpt_dir / CURVE_NAME)

    bar = tqdm(total=args.steps, initial=session.step, disable=args.quiet or rank != 0, unit="step",
               mininterval=0.5 if sys.stderr.isatty() else 5.0)
    start, done, in_a_row = time.perf_counter(), 0, 0
    micro = session.step * args.accumulate + session.micro_step
    status = 0
    try:
        while session.step < last:
            lr = schedule.lr_at(session.step)
            micro_losses = []
            for _ in range(args.accumulate - session.micro_step):
                try:
                    micro_losses.append(session.train_step(
                        _batch(data, micro, args.batch_size, rank, world), lr=lr))
                except InputError as exc:
                    bar.close()
                    raise InputError(f"data file {args.data!r} does not fit the model: {exc}") from exc
                micro += 1
            if not session.last_step_finite:
                in_a_row += 1
                bar.set_postfix(skipped=session.skipped_steps, refresh=False)
                if in_a_row >= args.max_skipped:
                    status = EXIT_DIVERGED
                    break
                continue
            in_a_row = 0
            step_loss = float(np.mean(micro_losses))
            if session.data_parallel is not None:  # the global batch's loss: the ranks' mean
                step_loss = session.data_parallel.mean_over_ranks(step_loss)
            losses.append(step_loss)
            done += 1
            bar.set_postfix(loss=f"{losses[-1]:.4g}", lr=f"{lr:.3g}", skipped=session.skipped_steps,
                            steps_per_s=f"{done / (time.perf_counter() - start):.1f}", refresh=False)
            bar.update(1)
            if args.checkpoint_every and session.step % args.checkpoint_every == 0:
                checkpoint()
    except KeyboardInterrupt:
        bar.close()
        checkpoint()
        where = f"; checkpoint saved in {ckpt_dir}/" if ckpt_dir is not None else " (no --checkpoint-dir: nothing saved)"
        print(f"gradgraph train: interrupted at step {session.step}{where}", file=sys.stderr)
        return EXIT_INTERRUPTED
    bar.close()
    checkpoint()  # skipped steps changed nothing: this is the last finite state
    if ckpt_dir is not None and rank == 0:
        session.export_inference_model(ckpt_dir / INFERENCE_NAME, keep_loss=False)
    if session.data_parallel is not None:  # the ranks leave together, once rank 0 has written
        session.data_parallel.coll.barrier()
    if rank != 0:
        return 0  # rank 0 reports the run's outcome (its status is the command's)
    if status == EXIT_DIVERGED:
        print(f"gradgraph train: stopped at step {session.step}: {in_a_row} steps in a row had a "
              "non-finite loss, weight or optimizer state (NaN/inf in the data, or a learning rate "
              f"too high?); weights are those of the last finite step ({session.skipped_steps} "
              "skipped in all)", file=sys.stderr)
        return status
    run_losses = losses[resumed_from:]
    if run_losses:
        where = f"; loss curve and checkpoint in {ckpt_dir}/" if ckpt_dir is not None else ""
        skipped = f"; {session.skipped_steps} non-finite steps skipped" if session.skipped_steps else ""
        print(f"step {session.step}: loss {run_losses[-1]:.6g} (first step of this run: "
              f"{run_losses[0]:.6g}){skipped}{where}", file=sys.stderr)
    return 0


def _fit_batch(model: str, batch_size: int) -> ir.Model | str:
    """The model's path when its batch fits (the session reads the file itself, the weights
    straight into its buffers: a model loaded here would hold a second copy of the weights of
    one under 1 GiB all through training), else the model made batch-dynamic and verified (an
    IR model: the weights of one over 1 GiB stay in its external data, never in a protobuf)."""
    from gradgraph.io import load_model
    from passes.batching import select_batch_inputs

    fixed, _ = select_batch_inputs(load_model(model, lazy=True).graph)
    if not fixed or fixed == batch_size:
        return model
    loaded = load_model(model)
    from gradgraph.batching import batch_dynamic_ir

    print(f"gradgraph train: the model was exported with batch {fixed}; making its batch dimension "
          f"dynamic for --batch-size {batch_size}", file=sys.stderr)
    return batch_dynamic_ir(loaded)


def main(argv: Sequence[str] | None = None) -> int:
    return main_for(add_parser, None if argv is None else list(argv))


if __name__ == "__main__":
    raise SystemExit(main())
