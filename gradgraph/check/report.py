"""What ``gradgraph check`` reports: a row per checked name, the oracle used, its tolerances."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import overload

ORACLE_FLOAT64_ORT = "float64-ort"
ORACLE_FLOAT64_REFERENCE = "float64-reference"
ORACLE_FLOAT32_ORT = "float32-ort"
_ORACLE_TEXT = {
    ORACLE_FLOAT64_ORT: "float64 central differences in onnxruntime",
    ORACLE_FLOAT64_REFERENCE: "float64 central differences in the ONNX reference evaluator",
    ORACLE_FLOAT32_ORT: "float32 central differences in onnxruntime",
}

RESULT_OK, RESULT_FAIL, RESULT_SKIPPED = "ok", "FAIL", "skipped"


@dataclasses.dataclass(frozen=True)
class CheckRow:
    """One trained name: ``checked`` entries compared, their worst errors, the outcome.

    ``result`` is ``"ok"``, ``"FAIL"`` or ``"skipped"`` (nothing to compare: an empty tensor,
    or every entry picked sits at a kink); ``detail`` says why. The errors are NaN or infinite
    when an analytic or numeric value was (``nonfinite`` counts those entries). ``kinks``
    counts entries not compared because the loss has a kink within the step (a ReLU or Clip
    switching), where the difference quotient does not estimate the derivative.
    """

    name: str
    checked: int
    max_abs_err: float
    max_rel_err: float
    result: str = RESULT_OK
    detail: str = ""
    nonfinite: int = 0
    kinks: int = 0
    mismatches: tuple[str, ...] = ()  # "[flat index] analytic A vs numeric N" per failing entry

    @property
    def ok(self) -> bool:
        return self.result == RESULT_OK

    @property
    def result_text(self) -> str:
        return f"{self.result} ({self.detail})" if self.detail else self.result


@dataclasses.dataclass(frozen=True)
class CheckReport(Sequence[CheckRow]):
    """The rows of a check (it is a sequence of them) and how the numeric side was computed.

    ``oracle`` is one of ``ORACLE_FLOAT64_ORT``, ``ORACLE_FLOAT64_REFERENCE``,
    ``ORACLE_FLOAT32_ORT``; ``oracle_reason`` says why a fallback was needed ("" for the
    first); ``eps`` / ``rtol`` / ``atol`` are the values used (``atol`` before scaling by
    ``max(1, |loss|)`` for the float32 oracle, ``eps`` relative there).
    """

    rows: tuple[CheckRow, ...]
    oracle: str
    oracle_reason: str
    eps: float
    rtol: float
    atol: float
    loss_value: float
    low_precision: str | None = None  # "float16" / "bfloat16" when the model computes in it
    notes: tuple[str, ...] = ()  # what the check changed in the model to compare it (Dropout off)

    @overload
    def __getitem__(self, index: int) -> CheckRow: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[CheckRow]: ...
    def __getitem__(self, index: int | slice) -> CheckRow | Sequence[CheckRow]:
        return self.rows[index]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[CheckRow]:
        return iter(self.rows)

    @property
    def passed(self) -> list[CheckRow]:
        return [r for r in self.rows if r.result == RESULT_OK]

    @property
    def failed(self) -> list[CheckRow]:
        return [r for r in self.rows if r.result == RESULT_FAIL]

    @property
    def skipped(self) -> list[CheckRow]:
        return [r for r in self.rows if r.result == RESULT_SKIPPED]

    @property
    def ok(self) -> bool:
        """No row failed and at least one entry was compared."""
        return not self.failed and any(r.checked for r in self.rows)

    @property
    def oracle_label(self) -> str:
        """What computed the numeric side, e.g. "float64 central differences in onnxruntime"."""
        return _ORACLE_TEXT[self.oracle]

    @property
    def oracle_text(self) -> str:
        """:attr:`oracle_label`, with the reason for a fallback in parentheses."""
        return f"{self.oracle_label} ({self.oracle_reason})" if self.oracle_reason else self.oracle_label

    @property
    def tolerance_text(self) -> str:
        if self.low_precision and self.oracle != ORACLE_FLOAT32_ORT:
            return (f"eps={self.eps:g}, rtol={self.rtol:g}, atol={self.atol:g} x max |gradient| "
                    f"(the model computes in {self.low_precision})")
        if self.oracle == ORACLE_FLOAT32_ORT:
            return (f"eps={self.eps:g} x max(1, |x|), rtol={self.rtol:g}, "
                    f"atol={self.atol:g} x max(1, |loss|)")
        return f"eps={self.eps:g}, rtol={self.rtol:g}, atol={self.atol:g}"
