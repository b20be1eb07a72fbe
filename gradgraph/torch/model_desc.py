"""``IODescription`` and ``ModelDescription``: ORTTrainer's ``model_desc`` schema (the
reference's classes, with the legacy trainer's attribute names)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class IODescription:
    """``IODescription(name, shape, dtype=None, num_classes=None)`` (the reference's schema class)."""

    def __init__(self, name: str, shape: Sequence[int | str], dtype: Any = None,
                 num_classes: int | None = None, is_loss: bool = False) -> None:
        self.name, self.shape, self.dtype, self.num_classes = name, list(shape), dtype, num_classes
        self.is_loss = is_loss

    # the legacy trainer's attribute names (onnxruntime.capi.ort_trainer.IODescription)
    name_ = property(lambda self: self.name)
    shape_ = property(lambda self: self.shape)
    dtype_ = property(lambda self: self.dtype)
    num_classes_ = property(lambda self: self.num_classes)


class ModelDescription:
    """``ModelDescription(inputs, outputs)`` parsed from ORTTrainer's ``model_desc`` dict."""

    def __init__(self, inputs: list[IODescription], outputs: list[IODescription]) -> None:
        self.inputs, self.outputs = inputs, outputs

    inputs_ = property(lambda self: self.inputs)  # the legacy trainer's names
    outputs_ = property(lambda self: self.outputs)

    @property
    def loss(self) -> str:
        return next(o.name for o in self.outputs if o.is_loss)

    @classmethod
    def parse(cls, desc: Any) -> ModelDescription:
        if isinstance(desc, ModelDescription):
            return desc
        if not isinstance(desc, Mapping) or set(desc) != {"inputs", "outputs"}:
            raise ValueError("model_desc must be a dict {'inputs': [(name, shape)], 'outputs': "
                             f"[(name, shape, is_loss)]}}; got {desc!r}")
        inputs = [cls._entry(e, f"model_desc['inputs'][{i}]", 2) for i, e in enumerate(desc["inputs"])]
        outputs = [cls._entry(e, f"model_desc['outputs'][{i}]", 3) for i, e in enumerate(desc["outputs"])]
        names = [e.name for e in inputs + outputs]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"model_desc: names must be unique; {repeated} repeat")
        losses = [o.name for o in outputs if o.is_loss]
        if len(losses) != 1:
            raise ValueError(f"model_desc: exactly one output must be flagged is_loss=True (the "
                             f"tuple's third entry); {len(losses)} are: {losses}")
        return cls(inputs, outputs)

    @staticmethod
    def _entry(entry: Any, where: str, most: int) -> IODescription:
        if isinstance(entry, IODescription):
            return entry
        if not isinstance(entry, (tuple, list)) or not 2 <= len(entry) <= most:
            form = "(name, shape)" if most == 2 else "(name, shape) or (name, shape, is_loss)"
            raise ValueError(f"{where} must be a tuple {form}; got {entry!r}")
        name, shape = entry[0], entry[1]
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: the name must be a non-empty string; got {name!r}")
        if isinstance(shape, (str, bytes)) or not isinstance(shape, (list, tuple)) or not all(
                isinstance(d, str) or (isinstance(d, int) and not isinstance(d, bool) and d >= 0)
                for d in shape):
            raise ValueError(f"{where} ({name!r}): the shape must be a list of dimensions, each a "
                             f"string (symbolic) or an int >= 0; got {shape!r}")
        is_loss = entry[2] if len(entry) == 3 else False
        if not isinstance(is_loss, bool):
            raise ValueError(f"{where} ({name!r}): is_loss must be a bool; got {is_loss!r}")
        return IODescription(name, shape, is_loss=is_loss)
