"""Fuzz the model loader and gradient builder with damaged model files.

    python tools/fuzz.py [--model gradgraph/examples/mlp.onnx] [--loss loss] [--cases 300] [--seed 0]

Each case flips, deletes or inserts a few random bytes of the serialized model, then builds
its gradient graph. Every case must end, within --timeout seconds, either with a gradient
graph or with a ``GradientError`` (the one error type users get for a bad model): any other
exception or a hang is a finding, printed with the case number, and the exit status is 1.
``tests/test_fuzz.py`` runs it in CI.
"""

from __future__ import annotations

import argparse
import collections
import random
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gradgraph import GradientError, build_gradient_graph  # noqa: E402


class CaseTimeout(Exception):
    pass


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

    def alarm(signum: int, frame: object) -> None:
        raise CaseTimeout()

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
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
    finally:
        signal.signal(signal.SIGALRM, previous)
    return counts, findings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "gradgraph" / "examples" / "mlp.onnx"))
    parser.add_argument("--loss", default="loss")
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=30, help="seconds per case")
    args = parser.parse_args()
    import logging

    logging.disable(logging.WARNING)  # onnx_ir logs every dangling input of a damaged graph
    counts, findings = fuzz(Path(args.model).read_bytes(), args.loss, args.cases, args.seed,
                            args.timeout)
    print(f"{args.cases} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for finding in findings:
        print(finding)
    return 1 if findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
