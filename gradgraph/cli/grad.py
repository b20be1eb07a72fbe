"""``gradgraph grad``: write the gradient graph of a loss."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from gradgraph.cli.common import add_list_weights, list_weights, main_for, weights_arg
from gradgraph.feeds import InputError


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    grad = sub.add_parser("grad", help="write the gradient graph of a loss",
                          description="Write MODEL plus one output <name>_grad per trained name.")
    grad.add_argument("model", help="forward ONNX model whose graph outputs the loss")
    grad.add_argument("--loss", required=True, help="name of the loss tensor (a scalar, or see --reduce)")
    grad.add_argument("--weights", nargs="*",
                      help="names to differentiate (default: the model's parameters; see --list-weights)")
    add_list_weights(grad)
    grad.add_argument("--reduce", choices=["sum", "mean"], default=None,
                      help="reduce a non-scalar loss (default: refuse one)")
    grad.add_argument("-o", "--output", help="where to write the gradient model (required)")
    grad.add_argument("--save-stages", metavar="DIR", help="also save each stage's model in DIR")
    grad.add_argument("--allow-unused", action="store_true",
                      help="zero gradient for names off the loss path (default: an error)")
    grad.set_defaults(func=run)
    return grad


def run(args: argparse.Namespace) -> int:
    from gradgraph.api import build_gradient_graph
    from gradgraph.io import save_model
    from gradgraph.runtime.external import is_large

    if args.list_weights:
        return list_weights(args)
    if not args.output:
        raise InputError("-o/--output is required (unless --list-weights)")
    start = time.perf_counter()
    model = build_gradient_graph(args.model, args.loss, weights_arg(args.weights),
                                 loss_reduction=args.reduce, allow_unused=args.allow_unused,
                                 save_stages=args.save_stages, as_ir=True)
    built = time.perf_counter() - start
    save_model(model, args.output)  # with external data for a model over 1 GiB
    grads = [o for o in model.graph.outputs if "gradgraph.gradient_of" in o.metadata_props]
    data = f" (weights in {args.output}.data)" if Path(f"{args.output}.data").is_file() and \
        is_large(model) else ""
    print(f"wrote {args.output}{data}: {model.graph.num_nodes()} nodes, {len(grads)} gradient outputs "
          f"(built in {built:.2f} s)")
    if args.save_stages:
        print(f"stages saved under {args.save_stages}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_for(add_parser, argv)


if __name__ == "__main__":
    raise SystemExit(main())
