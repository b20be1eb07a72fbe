"""The ``gradgraph`` command (``main``); the user-facing help is ``DESCRIPTION``."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from gradgraph import train_cli
from gradgraph.checkpoint import CheckpointError
from gradgraph.feeds import InputError, load_npz
from passes.autodiff import GradientError

DESCRIPTION = """\
Gradient and training graphs for ONNX models, in standard ONNX ops.

  gradgraph grad MODEL.onnx --loss NAME -o OUT.onnx     write the gradient graph
  gradgraph check MODEL.onnx --loss NAME                finite-difference check of it
  gradgraph train MODEL.onnx --loss NAME --data D.npz --steps N --batch-size B

By default the model's parameters are differentiated/trained; --list-weights shows which
and why. Results go to stdout, progress and errors to stderr. A user error prints one line
and exits 2. `gradgraph SUB-COMMAND -h` for each sub-command's options.
"""


def _weights_arg(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    names: list[str] = []
    for value in values:
        names.extend(v for v in value.split(",") if v)
    return names


def _cmd_grad(args: argparse.Namespace) -> int:
    from gradgraph.api import build_gradient_graph
    from gradgraph.io import save_model

    if args.list_weights:
        return _list_weights(args)
    if not args.output:
        raise InputError("-o/--output is required (unless --list-weights)")
    start = time.perf_counter()
    model = build_gradient_graph(args.model, args.loss, _weights_arg(args.weights),
                                 loss_reduction=args.reduce,
                                 allow_unused=args.allow_unused, save_stages=args.save_stages)
    built = time.perf_counter() - start
    save_model(model, args.output)
    grads = [o.name for o in model.graph.output if o.name.endswith("_grad")]
    print(f"wrote {args.output}: {len(model.graph.node)} nodes, {len(grads)} gradient outputs "
          f"(built in {built:.2f} s)")
    if args.save_stages:
        print(f"stages saved under {args.save_stages}/")
    return 0


def _list_weights(args: argparse.Namespace) -> int:
    from gradgraph.weights import format_weights, list_weights

    print(format_weights(list_weights(args.model, args.loss)))
    return 0


def _load_inputs(path: str | None) -> dict[str, np.ndarray] | None:
    return None if path is None else load_npz(path, "inputs file")


def _cmd_check(args: argparse.Namespace) -> int:
    from gradgraph.check import gradcheck

    if args.list_weights:
        return _list_weights(args)

    report = gradcheck(args.model, args.loss, _weights_arg(args.weights), _load_inputs(args.inputs),
                       eps=args.eps, rtol=args.rtol, atol=args.atol, max_elements=args.max_elements,
                       seed=args.seed)
    width = max([len(r.name) for r in report] + [len("name")])
    print(f"{'name':<{width}}  {'checked':>7}  {'max abs err':>11}  {'max rel err':>11}  result")
    for r in report:
        # NaN / inf print as such (format e keeps them): a non-finite entry never shows as 0.000e+00
        errs = [f"{e:>11.3e}" if r.checked else f"{'-':>11}" for e in (r.max_abs_err, r.max_rel_err)]
        print(f"{r.name:<{width}}  {r.checked:>7}  {errs[0]}  {errs[1]}  {r.result_text}")
    print(f"oracle: {report.oracle_text}")
    counts = f"{len(report.passed)} passed, {len(report.failed)} failed"
    if report.skipped:
        counts += f", {len(report.skipped)} skipped"
    if not any(r.checked for r in report):
        counts += ": nothing was checked"
    print(f"{counts} ({report.oracle_label}, {report.tolerance_text})")
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    from gradgraph import __version__

    parser = argparse.ArgumentParser(prog="gradgraph", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"gradgraph {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    grad = sub.add_parser("grad", help="write the gradient graph of a loss",
                          description="Write MODEL plus one output <name>_grad per trained name.")
    grad.add_argument("model", help="forward ONNX model whose graph outputs the loss")
    grad.add_argument("--loss", required=True, help="name of the loss tensor (a scalar, or see --reduce)")
    grad.add_argument("--weights", nargs="*",
                      help="names to differentiate (default: the model's parameters; see --list-weights)")
    grad.add_argument("--list-weights", action="store_true",
                      help="print every float initializer, whether it is trained and why; then exit")
    grad.add_argument("--reduce", choices=["sum", "mean"], default=None,
                      help="reduce a non-scalar loss (default: refuse one)")
    grad.add_argument("-o", "--output", help="where to write the gradient model (required)")
    grad.add_argument("--save-stages", metavar="DIR", help="also save each stage's model in DIR")
    grad.add_argument("--allow-unused", action="store_true",
                      help="zero gradient for names off the loss path (default: an error)")
    grad.set_defaults(func=_cmd_grad)

    from gradgraph import check as checking

    check = sub.add_parser(
        "check", help="finite-difference check of the gradient graph",
        description="Compare the gradient graph (run in onnxruntime) with central differences of "
                    "the loss, entry by entry. The oracle is float64 in onnxruntime; where "
                    "onnxruntime lacks a float64 kernel, float64 in the ONNX reference evaluator "
                    f"(models of at most {checking.REFERENCE_MAX_VALUES:,} values, checked in "
                    f"about {checking.REFERENCE_MAX_SECONDS:g} s or less), else float32 in "
                    "onnxruntime with a larger step and looser tolerances. The oracle used is "
                    "printed. Entries where the loss has a kink within the step (a ReLU "
                    "switching) are counted, not compared. Exit 0: every compared entry agrees; "
                    "1: an entry is off or non-finite, or nothing was compared; 2: the check "
                    "could not run.")
    check.add_argument("model", help="forward ONNX model whose graph outputs the loss")
    check.add_argument("--loss", required=True, help="name of the loss tensor")
    check.add_argument("--weights", nargs="*", help="names to check (default: the trained set of `grad`)")
    check.add_argument("--inputs", metavar="NPZ",
                       help=".npz with the graph inputs (default: random, seeded by --seed)")
    check.add_argument("--eps", type=float, default=None,
                       help=f"central-difference step (default: {checking.FLOAT64_EPS:g} for float64 "
                            f"oracles; for float32 a relative step, eps x max(1, |x|), default "
                            f"{checking.FLOAT32_EPS:g})")
    check.add_argument("--rtol", type=float, default=None,
                       help=f"relative tolerance (default: {checking.FLOAT64_RTOL:g} float64, "
                            f"{checking.FLOAT32_RTOL:g} float32)")
    check.add_argument("--atol", type=float, default=None,
                       help=f"absolute tolerance (default: {checking.FLOAT64_ATOL:g} float64; for "
                            f"float32 it is scaled, atol x max(1, |loss|), default "
                            f"{checking.FLOAT32_ATOL:g})")
    check.add_argument("--max-elements", type=int, default=16,
                       help="entries checked per name, at least 1 (default: 16)")
    check.add_argument("--seed", type=int, default=0,
                       help="seed of the random inputs and of the entries picked (default: 0)")
    check.add_argument("--list-weights", action="store_true",
                       help="print every float initializer, whether it is trained and why; then exit")
    check.set_defaults(func=_cmd_check)

    train_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed sub-command; user mistakes print one line and return 2."""
    try:
        return int(args.func(args) or 0)
    except (GradientError, InputError, CheckpointError) as exc:
        print(f"gradgraph {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, PermissionError, IsADirectoryError) as exc:
        print(f"gradgraph {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
