"""``gradgraph build``: run the training pipeline offline, saving every stage and a summary."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from gradgraph.cli.common import (
    add_eps_argument,
    add_list_weights,
    add_pass_arguments,
    dims_arg,
    eps_kwargs,
    list_weights,
    main_for,
    pass_groups,
    weights_arg,
)
from gradgraph.feeds import InputError

if TYPE_CHECKING:
    from gradgraph.training.build import TrainingArtifacts

SUMMARY_NAME = "summary.txt"

DESCRIPTION = """\
Run the training build (forward clean-up -> graph transforms -> gradient -> recompute ->
training graph) on MODEL and write each stage's model to --save-stages DIR as
NN_<stage>.onnx, plus DIR/summary.txt: per stage the nodes added and removed by op type, and
the activations the backward keeps from the forward, with their bytes (--dim sizes symbolic
dimensions, e.g. --dim batch=8 --dim sequence=128).

All or nothing: the files appear in DIR once the whole build succeeded; a failing build
leaves DIR as it was. In a DIR that exists, an earlier build's NN_<stage>.onnx files and
summary.txt are replaced (ones this build does not write are removed); other files stay.
"""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("build", help="run the training pipeline, saving every stage",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="forward ONNX model whose graph outputs the loss")
    p.add_argument("--loss", required=True, help="name of the loss output")
    p.add_argument("--save-stages", metavar="DIR", help="directory for the stages and summary.txt "
                   "(required unless --list-weights)")
    add_list_weights(p)
    p.add_argument("--weights", nargs="*", help="names to train (default: the model's parameters)")
    p.add_argument("--freeze", nargs="*", default=[], metavar="NAME", help="weights not to train")
    p.add_argument("--reduce", choices=["sum", "mean"], default=None,
                   help="reduce a non-scalar loss (default: refuse one)")
    p.add_argument("--optimizer", default="adamw", choices=["sgd", "adam", "adamw", "lamb"])
    add_eps_argument(p)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    p.add_argument("--clip", type=float, default=None, help="global gradient-norm clipping")
    add_pass_arguments(p)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="the execution provider the graphs are for: mixed precision and cast "
                   "propagation keep in fp32 the ops its kernels lack in the low precision, and "
                   "cuda computes a training BatchNorm from standard ops (default: every kernel "
                   "assumed, as on onnxruntime's CUDA provider, and a training BatchNorm kept)")
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> object:
    """The TrainingConfig the options describe (option errors are InputErrors naming the flag)."""
    from gradgraph.training import options as opts
    from passes.optimizer import config_type
    from passes.optimizer.optimizer_pass import UpdateOptions

    if args.accumulate < 1:
        raise InputError(f"--accumulate must be a positive integer (got {args.accumulate})")
    if args.clip is not None and not (math.isfinite(args.clip) and args.clip > 0):
        raise InputError(f"--clip must be a finite number > 0 (got {args.clip})")
    groups = pass_groups(args)
    try:
        weights = weights_arg(args.weights)
        return opts.TrainingConfig(
            args.loss, config_type(args.optimizer)(**eps_kwargs(args)),
            weights_to_train=None if weights is None else tuple(weights),
            weights_not_to_train=tuple(args.freeze), loss_reduction=args.reduce,
            update=UpdateOptions(accumulation_steps=args.accumulate, max_grad_norm=args.clip),
            **groups)  # type: ignore[arg-type]
    except ValueError as exc:
        raise InputError(str(exc)) from exc


def _check_dims(dims: dict[str, int], artifacts: TrainingArtifacts) -> None:
    """--dim names a symbolic dimension of the graphs (else it sizes nothing)."""
    import onnx_ir as ir

    from gradgraph.training.build import check_dim_names, symbolic_dims

    graphs = [artifacts.gradient_ir] if artifacts.gradient_ir is not None else []
    known = set().union(symbolic_dims(ir.from_proto(artifacts.eval)), *map(symbolic_dims, graphs))
    check_dim_names(list(dims), known, "--dim")


def _providers(args: argparse.Namespace) -> list[str] | None:
    """The providers --device names (None: every kernel assumed)."""
    if args.device == "cuda":
        # CUDA alone: on a machine without it, the CPU's kernels must not be probed in its place
        return ["CUDAExecutionProvider"]
    if args.device == "cpu":
        return ["CPUExecutionProvider"]
    return None


def _warn_without_device(config: object) -> None:
    """Low-precision graphs built without --device may hold ops onnxruntime's CPU provider
    cannot run."""
    low = getattr(getattr(config, "mixed_precision", None), "dtype", None)
    cast = getattr(getattr(config, "graph_transformer", None), "propagate_cast_ops", None)
    if low is not None or (cast is not None and cast.enabled):
        low = low or "float16"
        warnings.warn(f"without --device the {low} graphs assume every op has a {low} kernel (as "
                      "onnxruntime's CUDA provider has); onnxruntime's CPU provider lacks many, so "
                      "they may not run there: pass --device cpu to keep those ops in fp32", stacklevel=2)


def _recompute_line(config: object, artifacts: TrainingArtifacts) -> str | None:
    """``recomputed: transformer_layers 42 nodes, gelu 0 nodes``: the forward nodes each asked
    recompute option clones (None when recompute is off)."""

    from passes.recompute import recomputed_counts

    options = getattr(getattr(config, "graph_transformer", None), "recompute", None)
    if options is None or artifacts.gradient_ir is None:
        return None
    counts = recomputed_counts(artifacts.gradient_ir)
    asked = [o for o in ("transformer_layers", "attn_dropout", "gelu") if getattr(options, o)]
    asked += ["memory_budget"] if options.memory_budget is not None else []
    return "recomputed: " + ", ".join(f"{o} {counts.get(o, 0)} nodes" for o in asked)


def _replaced(name: str) -> bool:
    """Files of an earlier build in --save-stages DIR that this build replaces."""
    from gradgraph.pipeline import is_stage_file

    return is_stage_file(name) or name == SUMMARY_NAME


def run(args: argparse.Namespace) -> int:
    from gradgraph.io import atomic_write_bytes, staged_folder
    from gradgraph.training.build import build_training_artifacts
    from gradgraph.training.summary import summary_text

    if args.list_weights:
        return list_weights(args)
    if not args.save_stages:
        raise InputError("--save-stages DIR is required (unless --list-weights)")
    config = config_from_args(args)
    dims = dims_arg(args.dim)
    out = Path(args.save_stages)
    if out.exists() and not out.is_dir():
        raise InputError(f"--save-stages {str(out)!r} exists and is not a directory")
    start = time.perf_counter()
    # All or nothing: the stages and summary.txt go to a temp folder (beside DIR, or inside it
    # when it exists), moved into DIR once everything succeeded; a failure leaves DIR as it was.
    with staged_folder(out, replaces=_replaced) as folder:
        config = dataclasses.replace(config, debug=dataclasses.replace(  # type: ignore[type-var]
            config.debug, save_stages=str(folder)))  # type: ignore[attr-defined]
        providers = _providers(args)
        artifacts = build_training_artifacts(args.model, config,  # type: ignore[arg-type]
                                             providers=providers)
        if providers is None:
            _warn_without_device(config)
        _check_dims(dims, artifacts)
        text = summary_text(artifacts, dims)
        atomic_write_bytes(folder / SUMMARY_NAME, text.encode())
        stages = sorted(p.name for p in folder.glob("*.onnx"))
    sys.stdout.write(text)
    recomputed = _recompute_line(config, artifacts)
    if recomputed:
        print(recomputed)
    print(f"wrote {len(stages)} stage models and {SUMMARY_NAME} to {out}/ "
          f"(built in {time.perf_counter() - start:.2f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_for(add_parser, argv)


if __name__ == "__main__":
    raise SystemExit(main())
