"""What every sub-command shares: running one with user errors as one line, weight lists."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from gradgraph.feeds import InputError
from gradgraph.training.checkpoint import CheckpointError
from passes.autodiff import GradientError

# Exit status of a user error (bad file, option or model): one line on stderr, nothing written.
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it


def describe_os_error(exc: OSError) -> str:
    """One line for an OSError met reading or writing a path the user gave (a missing file, no
    permission, an I/O error, a full or read-only disk, a name too long, ...)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is None:
        return (f"{reason} while reading or writing a file; check the paths given, the disk and "
                "its permissions")
    where = repr(os.fsdecode(exc.filename))
    if exc.filename2 is not None:
        where += f" (and {os.fsdecode(exc.filename2)!r})"
    return f"cannot use {where}: {reason}; check the path, the disk and its permissions"


STATUS_FILE_ENV = "GRADGRAPH_RANK0_STATUS"


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed sub-command; user mistakes print one line and return 2, gradgraph's
    warnings one line each."""
    # a data-parallel rank other than 0 leaves warnings and collective failures to rank 0 (they
    # would repeat); its own error (its rows' bad label) is its own: printed, with its rank
    rank = os.environ.get("RANK", "0")
    quiet = rank != "0"

    def one_line(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
        if not quiet:
            print(f"gradgraph {args.command}: warning: {message}", file=sys.stderr)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = one_line
            status = int(args.func(args) or 0)
    except (GradientError, InputError, CheckpointError) as exc:
        from gradgraph.training.distributed import DistributedError

        if not quiet:
            print(f"gradgraph {args.command}: error: {exc}", file=sys.stderr)
            every = getattr(exc, "parameters", ())
            if every and getattr(args, "verbose", False):  # the message names the first few
                print(f"gradgraph {args.command}: all {len(every)} parameters: "
                      f"{', '.join(every)}", file=sys.stderr)
        elif not isinstance(exc, DistributedError):
            print(f"gradgraph {args.command}: error: rank {rank}: {exc}", file=sys.stderr)
        status = EXIT_USER_ERROR
    except OSError as exc:  # any errno: ENOENT, EACCES, EIO, ENOSPC, EROFS, ENAMETOOLONG, ...
        if not quiet:
            print(f"gradgraph {args.command}: error: {describe_os_error(exc)}", file=sys.stderr)
        status = EXIT_USER_ERROR
    except KeyboardInterrupt:  # Ctrl-C while loading or building (train's step loop saves its own)
        if not quiet:  # stage folders are all or nothing; a checkpoint is written whole or not
            print(f"gradgraph {args.command}: interrupted", file=sys.stderr)
        status = EXIT_INTERRUPTED
    report = os.environ.get(STATUS_FILE_ENV)
    if report and not quiet:  # ``train --nproc``: the launcher returns rank 0's status
        Path(report).write_text(str(status))
    return status


def weights_arg(values: list[str] | None) -> list[str] | None:
    """``--weights a b,c`` -> ["a", "b", "c"]; nothing given -> None (the default set)."""
    if not values:
        return None
    names: list[str] = []
    for value in values:
        names.extend(v for v in value.split(",") if v)
    return names


def list_weights(args: argparse.Namespace) -> int:
    """``--list-weights``: every float initializer, whether it is trained and why."""
    from gradgraph.weights import format_weights
    from gradgraph.weights import list_weights as listing

    rows = listing(args.model, args.loss)
    names = [r.name for r in rows]
    chosen = weights_arg(getattr(args, "weights", None))  # --weights / --freeze of the same command line
    frozen = list(getattr(args, "freeze", None) or [])
    others = [n for n in [*(chosen or []), *frozen] if n not in names]
    inputs = _graph_input_names(args.model) if others else set()  # the file read again only then
    unknown = [n for n in others if n not in inputs]
    if unknown:
        raise InputError(f"{unknown}: neither float initializers nor graph inputs of {args.model!r}; "
                         "see the list without --weights / --freeze")
    for k, row in enumerate(rows):
        if chosen is not None:
            picked = row.name in chosen
            rows[k] = dataclasses.replace(row, trained=picked, reason="--weights" if picked else "not in --weights")
        if row.name in frozen:
            rows[k] = dataclasses.replace(rows[k], trained=False, reason="--freeze")
    print(format_weights(rows))
    differentiated = [n for n in chosen or [] if n in inputs]
    if differentiated:
        print(f"graph inputs differentiated too (--weights): {differentiated}")
    return 0


def _graph_input_names(path: Any) -> set[str]:
    """The graph input names of the model file (its weights not read)."""
    import onnx

    try:
        return {i.name for i in onnx.load(str(path), load_external_data=False).graph.input}
    except Exception:  # noqa: BLE001 - listing() already said what is wrong with the file
        return set()


def add_eps_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adam-eps", type=float, default=None, metavar="EPS",
                        help="epsilon of adam / adamw / lamb (default: the optimizer's, 1e-8 / 1e-8 / "
                        "1e-6; float16 weights need >= 1e-7)")


def eps_kwargs(args: argparse.Namespace) -> dict[str, float]:
    """``--adam-eps`` as the optimizer config's ``eps`` (refused for sgd, which has none)."""
    if args.adam_eps is None:
        return {}
    if args.optimizer == "sgd":
        raise InputError("--adam-eps sets the epsilon of adam, adamw or lamb; sgd has none")
    return {"eps": args.adam_eps}


def add_list_weights(parser: argparse.ArgumentParser) -> None:
    """The flags every sub-command has for saying more: --list-weights and --verbose."""
    parser.add_argument("--list-weights", action="store_true",
                        help="print every float initializer, whether it is trained and why; then exit")
    parser.add_argument("--verbose", action="store_true",
                        help="an error that names a few of many parameters lists all of them")


def main_for(add_parser: object, argv: list[str] | None) -> int:
    """Run one sub-command's parser alone (``python -m gradgraph.cli.train ...``)."""
    from gradgraph.cli.parser import CommandParser, parse

    parser = CommandParser(prog="gradgraph")
    add_parser(parser.add_subparsers(dest="command", required=True))  # type: ignore[operator]
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(parser, argv)
    args.argv = argv
    return run_command(args)


def add_pass_arguments(p: argparse.ArgumentParser) -> None:
    """The graph-transform options shared by ``build`` and ``train``."""
    p.add_argument("--cleanup", action="store_true",
                   help="run the clean-up passes (dead code, CSE, folding, identities)")
    p.add_argument("--standard-ops", action="store_true",
                   help="standard ONNX ops only: no onnxruntime com.microsoft op (below opset 20 a "
                        "written-out GELU otherwise becomes com.microsoft Gelu/FastGelu)")
    p.add_argument("--recompute", nargs="+", default=[], metavar="PATTERN",
                   choices=["gelu", "attn_dropout", "transformer_layers"],
                   help="recompute patterns (the reference's gelu_recompute, "
                        "attn_dropout_recompute, transformer_layer_recompute)")
    p.add_argument("--recompute-layers", type=int, default=None,
                   help="number_recompute_layers, with --recompute transformer_layers (0, the default: "
                        "all layers but the last)")
    p.add_argument("--memory-budget", type=int, default=None, metavar="BYTES",
                   help="recompute planner: bytes of activations the backward may keep")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                   help="a value for a symbolic dimension, to size tensors (repeatable)")
    p.add_argument("--cast-level", type=int, default=-1,
                   help="propagate_cast_ops level 0/1/2 (default -1: off; as onnxruntime's, a negative "
                        "level is off and a level above 2 is 2)")
    p.add_argument("--cast-strategy", default="FLOOD_FILL",
                   choices=["NONE", "INSERT_AND_REDUCE", "FLOOD_FILL"])
    p.add_argument("--cast-allow", nargs="*", default=[], metavar="OP",
                   help="propagate_cast_ops allow list (op types)")
    p.add_argument("--mixed-precision", choices=["float16", "bfloat16"], default=None,
                   help="fp16/bf16 compute with fp32 master weights (fp16: dynamic loss scaling)")


def dims_arg(values: list[str]) -> dict[str, int]:
    """``--dim NAME=VALUE`` flags as a dict (a user error names the bad flag)."""
    dims = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name or not value.isdigit() or int(value) < 1:
            raise InputError(f"--dim {item!r}: expected NAME=VALUE with a positive integer VALUE")
        dims[name] = int(value)
    return dims


def pass_groups(args: argparse.Namespace) -> dict[str, object]:
    """``graph_transformer`` and ``mixed_precision`` groups of a TrainingConfig from the flags."""
    from gradgraph.training import options as opts

    recompute = None
    if args.cast_level < 0 and (args.cast_strategy != "FLOOD_FILL" or args.cast_allow):
        import warnings  # noqa: PLC0415

        warnings.warn("--cast-strategy / --cast-allow change nothing without --cast-level 0, 1 or 2 "
                      "(cast propagation is off at the default level -1)", stacklevel=2)
    if args.recompute_layers is not None and "transformer_layers" not in args.recompute:
        raise InputError("--recompute-layers sets how many transformer layers are recomputed: it needs "
                         "--recompute transformer_layers")
    if args.recompute or args.memory_budget is not None:
        from passes.recompute import RecomputeOptions

        try:
            recompute = RecomputeOptions(
                gelu="gelu" in args.recompute, attn_dropout="attn_dropout" in args.recompute,
                transformer_layers="transformer_layers" in args.recompute,
                number_recompute_layers=args.recompute_layers or 0, memory_budget=args.memory_budget,
                dims=tuple(sorted(dims_arg(args.dim).items())))
        except ValueError as exc:
            raise InputError(f"recompute options: {exc}") from exc
    try:
        return {
            "graph_transformer": opts.GraphTransformerOptions(
                cleanup=args.cleanup, recompute=recompute, contrib_ops=not args.standard_ops,
                propagate_cast_ops=opts.CastPropagationConfig(
                    opts.CastStrategy[args.cast_strategy], args.cast_level,
                    tuple(args.cast_allow))),
            "mixed_precision": opts.MixedPrecisionConfig(dtype=args.mixed_precision),
        }
    except ValueError as exc:
        raise InputError(str(exc)) from exc


def fit_batch(model: str, inputs: dict[str, Any], command: str) -> str | Any:
    """``model``, or, when the rows of ``inputs`` differ from the batch its inputs fix, the model
    made batch-dynamic as ``train`` makes it (:func:`gradgraph.make_batch_dynamic`, verified)."""
    from gradgraph.io import load_model
    from passes.batching import select_batch_inputs

    loaded = load_model(model)
    fixed, batched = select_batch_inputs(loaded.graph)
    rows = {int(inputs[v.name].shape[0]) for v in batched
            if v.name in inputs and getattr(inputs[v.name], "ndim", 0) > 0}
    if not fixed or not rows or rows == {fixed}:
        return model
    from gradgraph.batching import make_batch_dynamic

    print(f"gradgraph {command}: the model was exported with batch {fixed}; making its batch "
          f"dimension dynamic for the {sorted(rows)[0]} rows given", file=sys.stderr)
    return make_batch_dynamic(loaded)


TORCH_EXTRA = "pip install 'gradgraph[torch]'"


def require_torch(what: str) -> None:
    """A user error naming the ``torch`` extra when PyTorch is not installed."""
    import importlib.util

    try:
        missing = importlib.util.find_spec("torch") is None
    except (ImportError, ValueError):  # a broken or stubbed torch
        missing = True
    if missing:
        raise InputError(f"{what} needs PyTorch, which is not installed: {TORCH_EXTRA}")
