"""The one exception type the gradient builder raises."""

from __future__ import annotations

from collections.abc import Sequence


class GradientError(ValueError):
    """Raised for everything the gradient builder refuses.

    Attributes name what was refused so callers can act on it:
    ``op_type``, ``domain``, ``opset``, ``node`` (node name) and ``path``
    (value names from the offending node down to the loss).
    """

    def __init__(
        self,
        message: str,
        *,
        op_type: str | None = None,
        domain: str | None = None,
        opset: int | None = None,
        node: str | None = None,
        path: Sequence[str] = (),
    ) -> None:
        self.op_type = op_type
        self.domain = domain
        self.opset = opset
        self.node = node
        self.path = tuple(path)
        details = []
        if op_type is not None:
            details.append(f"op {(domain or 'ai.onnx')}::{op_type}")
        if opset is not None:
            details.append(f"opset {opset}")
        if node is not None:
            details.append(f"node {node!r}")
        if self.path:
            details.append("path to loss: " + " -> ".join(self.path))
        full = message if not details else f"{message} [{'; '.join(details)}]"
        super().__init__(full)


def unwrap_pass_errors(error: BaseException) -> BaseException:
    """The GradientError inside onnx_ir's PassError wrapping (Sequential wraps what passes
    raise), or ``error`` itself: a user error must reach the user as a GradientError."""
    cause: BaseException | None = error
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen:  # a chain can loop back on itself
        if isinstance(cause, GradientError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__
    return error
