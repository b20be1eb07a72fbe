"""The messages with which gradgraph refuses torch parameters an export lost, or lists them.

A message names at most ``SHOWN`` parameters and gives the count of the rest (a GPT-2 export
can lose 48 or more); ``--list-weights`` lists every one of them with its reason, and the
:class:`GradientError` carries them all in ``parameters``. Each piece of advice is one that
the same command, or a re-export, can follow.
"""

from __future__ import annotations

from collections.abc import Sequence

from passes.autodiff.errors import GradientError

SHOWN = 5  # parameter names a message lists before "and N more"
OPTIMIZE_FALSE = "torch.onnx.export(..., optimize=False)"
LIST_HINT = "--list-weights (or gradgraph.list_weights) shows each with its reason"
# Said of a folded parameter, also by --list-weights.
REEXPORT_HINT = (f"re-export with {OPTIMIZE_FALSE} so that parameters stay initializers, or "
                 "choose the weights to differentiate yourself (grad/check --weights, "
                 "weights_to_train in the Python API)")
FREEZE_HINT = ("or train the rest with these held at their exported values (train/build --freeze "
               "NAME ..., weights_not_to_train)")


def name_list(names: Sequence[str], shown: int = SHOWN) -> str:
    """``['a', 'b']``, or ``['a', 'b', 'c', 'd', 'e'] and 43 more`` past ``shown`` names."""
    names = list(names)
    if len(names) <= shown:
        return str(names)
    return f"{names[:shown]} and {len(names) - shown} more"


def _count(names: Sequence[str]) -> str:
    return f"{len(names)} torch parameter{'s' if len(names) != 1 else ''}"


def lost_error(folded: Sequence[str], dropped: Sequence[str], *, optimized: bool,
               read_at_constants: Sequence[str], freezable: bool = False) -> GradientError:
    """The refusal of an export whose parameters gradgraph cannot give back.

    ``folded``: folded into other constants; ``dropped``: read by a call but in no constant
    (the exporter's form of the call does not use them); ``read_at_constants``: those of
    ``folded`` that were read at constant indices (embeddings of fixed position ids);
    ``freezable``: none of them left its name on other values, so freezing them all is a way out.
    """
    reasons = []
    if folded:
        text = (f"the exporter's optimizer folded {_count(folded)} into other constants in a way "
                f"gradgraph cannot undo: {name_list(folded)}; {REEXPORT_HINT}")
        if read_at_constants:
            text += (f" ({name_list(read_at_constants)} {'is' if len(read_at_constants) == 1 else 'are'} "
                     "read at indices the model makes itself, e.g. position or token-type ids, and "
                     "folded to the rows read: passing those ids as a model input also keeps the "
                     "parameter)")
        reasons.append(text)
    if dropped:
        how = (f"the exporter's optimizer may have removed them (re-export with {OPTIMIZE_FALSE}), or "
               if optimized else "")
        reasons.append(f"the export has no initializer for torch parameter(s) {name_list(dropped)} that "
                       f"its torch calls read and no folded constant names them: {how}torch's exporter "
                       "dropped them (its ONNX form of the call does not use them); choose the "
                       "weights to differentiate yourself (grad/check --weights, weights_to_train)")
    every = [*folded, *dropped]
    if freezable:
        reasons.append(FREEZE_HINT)
    error = GradientError("; ".join(reasons) + (f"; {LIST_HINT}" if len(every) > SHOWN else ""))
    error.parameters = tuple(every)  # type: ignore[attr-defined]
    return error


# Said of a parameter that is not in the export and that no node reads (--list-weights).
UNREAD_REASON = ("not in the export and no node reads it: unused by forward, tied to a parameter "
                 "the export keeps, or removed by onnxscript's no-op rules (x*1, x+0, x-0, x/1 with a "
                 f"0-d parameter equal to 1 or 0 at init); if forward reads it, re-export with {OPTIMIZE_FALSE}")

