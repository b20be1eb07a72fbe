"""The ``gradgraph`` command: build and check gradient graphs offline.

    gradgraph grad MODEL.onnx --loss NAME [--weights W ...] -o OUT.onnx [--save-stages DIR]
    gradgraph check MODEL.onnx --loss NAME [--weights W ...] [--inputs batch.npz]
    gradgraph train MODEL.onnx --loss NAME --data DATA.npz ...   (see ``gradgraph train -h``)
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from gradgraph import train_cli
from gradgraph.checkpoint import CheckpointError
from gradgraph.feeds import InputError, load_npz
from passes.autodiff import GradientError


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

    start = time.perf_counter()
    model = build_gradient_graph(args.model, args.loss, _weights_arg(args.weights),
                                 allow_unused=args.allow_unused, save_stages=args.save_stages)
    built = time.perf_counter() - start
    save_model(model, args.output)
    grads = [o.name for o in model.graph.output if o.name.endswith("_grad")]
    print(f"wrote {args.output}: {len(model.graph.node)} nodes, {len(grads)} gradient outputs "
          f"(built in {built:.2f} s)")
    if args.save_stages:
        print(f"stages saved under {args.save_stages}/")
    return 0


def _load_inputs(path: str | None) -> dict[str, np.ndarray] | None:
    return None if path is None else load_npz(path, "inputs file")


def _cmd_check(args: argparse.Namespace) -> int:
    from gradgraph.check import gradcheck

    rows = gradcheck(args.model, args.loss, _weights_arg(args.weights), _load_inputs(args.inputs),
                     eps=args.eps, rtol=args.rtol, atol=args.atol, max_elements=args.max_elements,
                     seed=args.seed)
    width = max([len(r.name) for r in rows] + [len("name")])
    print(f"{'name':<{width}}  {'checked':>7}  {'max abs err':>11}  {'max rel err':>11}  result")
    for r in rows:
        print(f"{r.name:<{width}}  {r.checked:>7}  {r.max_abs_err:>11.3e}  {r.max_rel_err:>11.3e}  "
              f"{'ok' if r.ok else 'FAIL'}")
    failed = [r.name for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed "
          f"(float64 central differences, eps={args.eps}, rtol={args.rtol}, atol={args.atol})")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradgraph", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    grad = sub.add_parser("grad", help="write the gradient graph of a loss")
    grad.add_argument("model", help="forward ONNX model")
    grad.add_argument("--loss", required=True, help="name of the (scalar) loss tensor")
    grad.add_argument("--weights", nargs="*", help="names to differentiate (default: all float initializers)")
    grad.add_argument("-o", "--output", required=True, help="where to write the gradient model")
    grad.add_argument("--save-stages", metavar="DIR", help="also save each stage's model in DIR")
    grad.add_argument("--allow-unused", action="store_true", help="zero gradient for names off the loss path")
    grad.set_defaults(func=_cmd_grad)

    check = sub.add_parser("check", help="finite-difference check of the gradient graph")
    check.add_argument("model", help="forward ONNX model")
    check.add_argument("--loss", required=True)
    check.add_argument("--weights", nargs="*", help="names to check (default: all float initializers)")
    check.add_argument("--inputs", help=".npz with the graph inputs (default: random)")
    check.add_argument("--eps", type=float, default=1e-6, help="central-difference step (float64)")
    check.add_argument("--rtol", type=float, default=1e-3)
    check.add_argument("--atol", type=float, default=1e-5)
    check.add_argument("--max-elements", type=int, default=16, help="entries checked per name")
    check.add_argument("--seed", type=int, default=0)
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
