"""Value and node names shared by the passes."""

from __future__ import annotations


def free_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name_1``, ``name_2`` ... when taken; the result is added to ``taken``."""
    candidate, k = name, 0
    while candidate in taken:
        k += 1
        candidate = f"{name}_{k}"
    taken.add(candidate)
    return candidate
