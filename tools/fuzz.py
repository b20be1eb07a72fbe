"""Fuzz the model loader and gradient builder with damaged model files.

    python tools/fuzz.py [--model gradgraph/examples/mlp.onnx] [--loss loss] [--cases 300]
                         [--arg-lists 500] [--seed 0]

1. Damaged models: each case flips, deletes or inserts a few random bytes of the serialized
   model, then builds its gradient graph. Every case must end, within --timeout seconds,
   either with a gradient graph or with a ``GradientError`` (the one error type users get for a
   bad model).
2. Argument lists: each case runs the ``gradgraph`` command in-process on the bundled model
   with random sub-commands, flags and values (bad numbers, nan, missing files, unknown names,
   repeated flags). Every case must end with exit status 0-3 (argparse's own errors exit 2),
   never with a traceback.

Any other outcome or a hang is a finding, printed with the case number; the exit status is
then 1. ``tests/test_fuzz.py`` runs both in CI.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gradgraph import GradientError, build_gradient_graph  # noqa: E402


class CaseTimeout(Exception):
    pass


@contextlib.contextmanager
def alarms() -> Iterator[None]:
    """SIGALRM raises CaseTimeout while inside (each case arms ``signal.alarm`` itself)."""
    def alarm(signum: int, frame: object) -> None:
        raise CaseTimeout()

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def mutate(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(len(out))
        kind = rng.random()
        if kind < 0.6:
            out[pos] = rng.randrange(256)
        elif kind < 0.8:
            del out[pos:pos + rng.randint(1, 16)]
        else:
            out[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    return bytes(out)


def fuzz(model: bytes, loss: str, cases: int, seed: int = 0,
         timeout: int = 30) -> tuple[collections.Counter[str], list[str]]:
    """(outcome counts, findings): outcomes are "ok" and "GradientError"; anything else is a finding."""
    rng = random.Random(seed)
    counts: collections.Counter[str] = collections.Counter()
    findings: list[str] = []
    with alarms():
        for case in range(cases):
            data = mutate(model, rng)
            signal.alarm(timeout)
            try:
                build_gradient_graph(data, loss)
                counts["ok"] += 1
            except GradientError:
                counts["GradientError"] += 1
            except CaseTimeout:
                counts["timeout"] += 1
                findings.append(f"case {case}: no result within {timeout} s")
            except Exception as exc:  # noqa: BLE001 - what the fuzzer looks for
                counts[type(exc).__name__] += 1
                findings.append(f"case {case}: {type(exc).__name__}: {str(exc)[:200]}")
            finally:
                signal.alarm(0)
    return counts, findings


_VALUES = ["0", "-1", "1", "2", "nan", "inf", "-inf", "1e30", "abc", "", "3.5", "8", "99999"]
_FLAGS = {
    "grad": ["--weights", "--reduce", "-o", "--save-stages", "--allow-unused", "--list-weights"],
    "check": ["--weights", "--inputs", "--eps", "--rtol", "--atol", "--max-elements", "--seed",
              "--list-weights"],
    "train": ["--data", "--optimizer", "--lr", "--momentum", "--weight-decay", "--steps",
              "--batch-size", "--accumulate", "--clip", "--schedule", "--warmup-steps",
              "--max-skipped", "--freeze", "--no-decay", "--stop-at", "--resume", "--reduce",
              "--mixed-precision", "--recompute", "--memory-budget", "--cast-level",
              "--cast-strategy", "--cast-allow", "--dim", "--cleanup", "--checkpoint-every"],
    "build": ["--weights", "--freeze", "--accumulate", "--clip", "--recompute", "--memory-budget",
              "--dim", "--cast-level", "--cast-strategy", "--mixed-precision", "--cleanup"],
}
_SWITCHES = {"--allow-unused", "--list-weights", "--resume", "--cleanup"}


def random_arguments(rng: random.Random, model: str, data: str, out: str) -> list[str]:
    command = rng.choice(sorted(_FLAGS))
    args = [command, rng.choice([model, model, out + "/missing.onnx", data])]
    if rng.random() < 0.9:
        args += ["--loss", rng.choice(["loss", "loss", "logits", "nope", ""])]
    if command == "train":  # mostly well-formed, so the run gets past argument checks
        args += ["--data", data, "--steps", rng.choice(["1", "2", "0", "-5"]),
                 "--batch-size", rng.choice(["4", "8", "0", "1000"]), "--quiet"]
        if rng.random() < 0.5:
            args += ["--checkpoint-dir", out + "/ckpt"]
    if command in ("build",) or (command == "grad" and rng.random() < 0.7):
        args += ["--save-stages" if command == "build" else "-o",
                 out + ("/stages" if command == "build" else "/g.onnx")]
    for _ in range(rng.randint(0, 4)):
        flag = rng.choice(_FLAGS[command])
        args.append(flag)
        if flag not in _SWITCHES:
            args.append(rng.choice(_VALUES + ["fc1_weight", "fc1.weight", "sgd", "float16",
                                              "FLOOD_FILL", "transformer_layers", "batch=4"]))
    return args


def fuzz_arguments(model: str, data: str, cases: int, seed: int = 0,
                   timeout: int = 60) -> tuple[collections.Counter[str], list[str]]:
    """(exit-status counts, findings) of ``cases`` random command lines (see the docstring)."""
    import io
    import tempfile

    from gradgraph.cli.main import main as cli_main

    rng = random.Random(seed)
    counts: collections.Counter[str] = collections.Counter()
    findings: list[str] = []
    with alarms():
        for case in range(cases):
            with tempfile.TemporaryDirectory() as out:
                argv = random_arguments(rng, model, data, out)
                sink = io.StringIO()
                signal.alarm(timeout)
                here = os.getcwd()
                os.chdir(out)  # a random value after -o / --save-stages is a relative path
                try:
                    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                        code = cli_main(argv)
                except SystemExit as exc:  # argparse
                    code = exc.code if isinstance(exc.code, int) else 2
                except CaseTimeout:
                    findings.append(f"case {case}: no result within {timeout} s: {argv}")
                    continue
                except Exception as exc:  # noqa: BLE001 - what the fuzzer looks for
                    findings.append(f"case {case}: {type(exc).__name__}: {str(exc)[:160]}: {argv}")
                    continue
                finally:
                    signal.alarm(0)
                    os.chdir(here)
                counts[f"exit {code}"] += 1
                if code not in (0, 1, 2, 3) or "Traceback" in sink.getvalue():
                    findings.append(f"case {case}: exit {code}: {sink.getvalue()[-300:]}: {argv}")
    return counts, findings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "gradgraph" / "examples" / "mlp.onnx"))
    parser.add_argument("--loss", default="loss")
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arg-lists", type=int, default=0, help="random command lines to run")
    parser.add_argument("--data", default="", help=".npz for `train` (default: generated)")
    parser.add_argument("--timeout", type=int, default=30, help="seconds per case")
    args = parser.parse_args()
    import logging

    logging.disable(logging.WARNING)  # onnx_ir logs every dangling input of a damaged graph
    counts, findings = fuzz(Path(args.model).read_bytes(), args.loss, args.cases, args.seed,
                            args.timeout)
    print(f"{args.cases} damaged models: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if args.arg_lists:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            data = args.data or write_example_data(Path(tmp) / "data.npz")
            arg_counts, arg_findings = fuzz_arguments(args.model, data, args.arg_lists, args.seed)
        print(f"{args.arg_lists} command lines: "
              + ", ".join(f"{k} {v}" for k, v in sorted(arg_counts.items())))
        findings += arg_findings
    for finding in findings:
        print(finding)
    return 1 if findings else 0


def write_example_data(path: Path, rows: int = 16) -> str:
    """An .npz for the bundled example model (inputs ``x`` [rows, 16], ``labels`` [rows])."""
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(path, x=rng.standard_normal((rows, 16)).astype(np.float32),
             labels=rng.integers(0, 4, rows).astype(np.int64))
    return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
