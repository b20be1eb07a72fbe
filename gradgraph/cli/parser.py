"""The argument parser of every ``gradgraph`` command: a usage error is one line with close matches.

argparse's own parser prints the whole usage (25 lines for ``train``) before its error, accepts
abbreviated flags (``--step 5`` for ``--steps``), and reports a misspelt flag of a sub-command
through the top-level parser, without naming a flag that exists. :class:`CommandParser`:

1. an error prints ``gradgraph SUB: error: ...`` on one line and exits 2 (``-h`` still prints
   the full help);
2. abbreviations are refused (``allow_abbrev=False``), so ``--batch 8`` is an unknown flag;
3. an unknown flag names the sub-command's flags closest to it (:func:`close_flags`);
4. a value outside an option's choices lists the choices and the closest one.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

EXIT_USAGE = 2  # argparse's own status for a usage error


def close_flags(flag: str, known: Iterable[str], n: int = 2) -> list[str]:
    """The flags of ``known`` closest to ``flag``: difflib's matches, and a flag spelling the
    initials of ``flag``'s words (``--learning-rate`` -> ``--lr``)."""
    known = sorted({k for k in known if k.startswith("--") and k != "--help"})
    name = flag.split("=", 1)[0]
    matches = difflib.get_close_matches(name, known, n=n, cutoff=0.6)
    words = [w for w in name.lstrip("-").replace("_", "-").split("-") if w]
    initials = "--" + "".join(w[0] for w in words)
    if len(words) > 1 and initials in known and initials not in matches:
        matches.insert(0, initials)
    return matches[:n]


def _quoted(values: Sequence[object]) -> str:
    return ", ".join(str(v) for v in values)


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (see the module docstring).
    Sub-command parsers made by ``add_subparsers().add_parser`` are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (`{self.prog} -h` lists the options)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)

    def flags(self) -> list[str]:
        return [s for action in self._actions for s in action.option_strings]

    def unrecognized(self, extras: Sequence[str]) -> NoReturn:
        """Error for arguments no option took, naming the closest flags of this parser."""
        flags = [e for e in extras if e.startswith("-")]
        parts = []
        for flag in flags:
            matches = close_flags(flag, self.flags())
            hint = f" (did you mean {' or '.join(matches)}?)" if matches else ""
            parts.append(f"{flag}{hint}")
        if not flags:
            self.error(f"unexpected argument(s): {' '.join(extras)}")
        self.error(f"unknown option {', '.join(parts)}")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        choices = action.choices
        if choices is None or value in choices:
            return
        if isinstance(choices, dict):  # the sub-commands
            choices = list(choices)
        names = list(choices)  # type: ignore[arg-type]
        close = difflib.get_close_matches(str(value), [str(c) for c in names], n=1, cutoff=0.5)
        lowered = [str(c) for c in names if str(c).lower() == str(value).lower()]
        guess = (lowered or close)[:1]
        hint = f"; did you mean {guess[0]!r}?" if guess else ""
        raise argparse.ArgumentError(
            action, f"invalid choice {value!r} (choose from {_quoted(names)}){hint}")


def parse(parser: CommandParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; arguments no option took are reported by the sub-command they follow."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        command = getattr(args, "command", None)
        sub = _subparser(parser, command)
        (sub or parser).unrecognized(extras)
    return args


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> CommandParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            found = action.choices[command]
            return found if isinstance(found, CommandParser) else None
    return None
