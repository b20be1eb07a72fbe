"""ORTModule's debug options and log levels (onnxruntime's ``DebugOptions`` / ``LogLevel``)."""

from __future__ import annotations

import dataclasses
import enum
import logging

import onnx
import onnx_ir as ir

from gradgraph.io import save_model

logger = logging.getLogger("gradgraph.torch")


class LogLevel(enum.IntEnum):
    """onnxruntime's ORTModule log levels (``DebugOptions(log_level=LogLevel.INFO)``)."""

    VERBOSE = 0
    INFO = 1
    WARNING = 2
    ERROR = 3
    FATAL = 4


# the Python logging level of ``gradgraph.torch`` for each LogLevel
_PY_LEVEL = {LogLevel.VERBOSE: logging.DEBUG, LogLevel.INFO: logging.INFO, LogLevel.WARNING: logging.WARNING,
             LogLevel.ERROR: logging.ERROR, LogLevel.FATAL: logging.CRITICAL}


@dataclasses.dataclass
class DebugOptions:
    """onnxruntime ORTModule's debug options.

    ``save_onnx``: write each signature's graphs under ``onnx_prefix`` with onnxruntime's names,
    ``<prefix>_<stage>_<training|inference>.onnx``: ``torch_exported`` (the exporter's model),
    ``optimized_pre_grad`` (weights as inputs, optimized, ready for the gradient),
    ``optimized`` (with the gradient; training only) and what onnxruntime runs
    (``execution_model`` for inference; for training ``execution_model_forward`` and
    ``execution_model_backward``). ``log_level`` (a :class:`LogLevel` or its name): ``INFO``
    reports each build with its time, ``VERBOSE`` adds onnxruntime's own session log.
    """

    save_onnx: bool = False
    onnx_prefix: str = ""
    log_level: LogLevel | str = LogLevel.WARNING

    def __post_init__(self) -> None:
        if self.save_onnx and not self.onnx_prefix:
            raise ValueError("DebugOptions: save_onnx=True needs an onnx_prefix (the path prefix of "
                             "the saved graphs)")
        level = self.log_level
        if isinstance(level, str):
            name = "VERBOSE" if level.upper() == "DEBUG" else level.upper()
            if name not in LogLevel.__members__:
                raise ValueError(f"DebugOptions: log_level {level!r} is not one of "
                                 f"{', '.join(LogLevel.__members__)}")
            level = LogLevel[name]
        elif not isinstance(level, int) or isinstance(level, bool) or level not in tuple(LogLevel):
            raise ValueError(f"DebugOptions: log_level {level!r} is not a LogLevel")
        self.log_level = LogLevel(level)

    @property
    def level(self) -> LogLevel:
        """``log_level`` as a :class:`LogLevel` (``__post_init__`` checked it)."""
        assert isinstance(self.log_level, LogLevel)
        return self.log_level

    @property
    def ort_severity(self) -> int:
        """onnxruntime's session log severity: its warnings (mostly unused initializers) and its
        error line (a failed run, which ORTModule reports as an exception) only from INFO down."""
        level = self.level
        return int(level) if level <= LogLevel.INFO else int(LogLevel.FATAL)

    def save(self, model: ir.Model | onnx.ModelProto, stage: str, training: bool) -> None:
        """Write ``model`` as ``<prefix>_<stage>_<training|inference>.onnx`` (atomically)."""
        if self.save_onnx:
            path = f"{self.onnx_prefix}_{stage}_{'training' if training else 'inference'}.onnx"
            save_model(model, path)



def set_log_level(level: LogLevel) -> None:
    """The ``gradgraph.torch`` logger at ``level``, printing to stderr when no handler is set."""
    logger.setLevel(_PY_LEVEL[level])
    if level <= LogLevel.INFO and not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)

