"""``gradgraph check``: finite-difference check of the gradient graph."""

from __future__ import annotations

import argparse

from gradgraph import check as checking
from gradgraph.cli.common import add_list_weights, fit_batch, list_weights, main_for, weights_arg
from gradgraph.feeds import load_npz


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
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
    check.add_argument("--loss", required=True, help="name of the loss tensor (a scalar, or see --reduce)")
    check.add_argument("--reduce", choices=["sum", "mean"], default=None,
                       help="reduce a non-scalar loss first, as `grad --reduce` does (default: refuse one)")
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
                       help="seed of the random inputs, of the entries picked and of the random draws "
                            "(Dropout masks, RandomNormal, ...) held fixed on both sides (default: 0)")
    add_list_weights(check)
    check.set_defaults(func=run)
    return check


def run(args: argparse.Namespace) -> int:
    if args.list_weights:
        return list_weights(args)
    inputs = None if args.inputs is None else load_npz(args.inputs, "inputs file")
    model = args.model if inputs is None else fit_batch(args.model, inputs, "check")
    report = checking.gradcheck(model, args.loss, weights_arg(args.weights), inputs,
                                eps=args.eps, rtol=args.rtol, atol=args.atol,
                                max_elements=args.max_elements, seed=args.seed,
                                loss_reduction=args.reduce)
    width = max([len(r.name) for r in report] + [len("name")])
    print(f"{'name':<{width}}  {'checked':>7}  {'max abs err':>11}  {'max rel err':>11}  result")
    for r in report:
        # NaN / inf print as such (format e keeps them): a non-finite entry never shows as 0.000e+00
        errs = [f"{e:>11.3e}" if r.checked else f"{'-':>11}" for e in (r.max_abs_err, r.max_rel_err)]
        print(f"{r.name:<{width}}  {r.checked:>7}  {errs[0]}  {errs[1]}  {r.result_text}")
    print(f"oracle: {report.oracle_text}")
    for note in report.notes:
        print(f"note: {note}")
    counts = f"{len(report.passed)} passed, {len(report.failed)} failed"
    if report.skipped:
        counts += f", {len(report.skipped)} skipped"
    if not any(r.checked for r in report):
        counts += ": nothing was checked"
    print(f"{counts} ({report.oracle_label}, {report.tolerance_text})")
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    return main_for(add_parser, argv)


if __name__ == "__main__":
    raise SystemExit(main())
