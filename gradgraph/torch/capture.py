"""What a forward does that an ONNX graph cannot do as PyTorch does.

ORTModule's probe run (:func:`gradgraph.torch.export.export_call` with ``stop_gradients``)
runs the forward once in PyTorch, with grad enabled, under :class:`CaptureWatch`. The watch
records, with the user's source line, each construct whose effect on values or gradients the
exported graph would not reproduce:

1. a stop-gradient: ``.detach()``, ``.data``, a result of ``torch.no_grad()`` of tensors that
   require grad, then read by a differentiable call (the graph would differentiate through it);
2. a tensor-to-Python conversion of a float tensor on the gradient's path (``.item()``,
   ``float(t)``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.numpy()``): torch treats the number
   as a constant, the exported graph computes it from the tensor and differentiates through it;
3. a hook on an intermediate tensor (``register_hook``, ``register_post_accumulate_grad_hook``)
   or ``retain_grad()``: the backward runs in onnxruntime and calls no hook, fills no ``.grad``;
4. a custom ``torch.autograd.Function`` (its own backward; the graph would differentiate its
   forward), ``torch.utils.checkpoint`` with ``use_reentrant=True`` (a Function too), an
   ORTModule called inside the forward;
5. saved-tensor hooks pushed inside the forward (``torch.autograd.graph.saved_tensors_hooks``,
   ``save_on_cpu``, ``torch.utils.checkpoint`` with ``use_reentrant=False``);
6. an embedding's ``scale_grad_by_freq=True`` (an option only torch's gradient has).

Any of them makes the signature fall back to PyTorch (:class:`NotCapturable`), its warning
naming the construct and the line.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import sys
import weakref
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

# torch's and gradgraph's own files: a construct's line is the first frame outside them
_INTERNAL = (os.path.dirname(torch.__file__) + os.sep,
             os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
             contextlib.__file__, functools.__file__)

# tensor-to-Python conversions, by the name torch's function mode sees, as the user writes them
CONVERSIONS = {"item": ".item()", "__float__": "float(tensor)", "__int__": "int(tensor)",
               "__bool__": "bool(tensor)", "__index__": "an index from a tensor", "tolist": ".tolist()",
               "numpy": ".numpy()", "__array__": "numpy.asarray(tensor)", "__complex__": "complex(tensor)"}
# hooks on a tensor and retain_grad: the backward in onnxruntime calls none of them
TENSOR_HOOKS = {"register_hook": ".register_hook()",
                "register_post_accumulate_grad_hook": ".register_post_accumulate_grad_hook()",
                "retain_grad": ".retain_grad()"}

_DATA_GET = torch.Tensor.data.__get__  # type: ignore[attr-defined]
# positions of the weight and of ``scale_grad_by_freq`` among each embedding call's arguments
_FREQ_ARGS = {torch.nn.functional.embedding: (1, 5), torch.embedding: (0, 3),
              torch.nn.functional.embedding_bag: (1, 5), torch.embedding_bag: (0, 3)}


class NotCapturable(RuntimeError):
    """The forward uses a construct the onnxruntime graph cannot express as PyTorch does; the
    message names it and its source line."""


def user_line(frame: FrameType | None) -> str:
    """``file.py:12 (code)`` of the first frame from ``frame`` outwards outside torch, gradgraph
    and contextlib: the line of the user's code that did it."""
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_INTERNAL) and not name.startswith("<frozen"):
            code = linecache.getline(name, frame.f_lineno).strip()
            where = f"{os.path.basename(name)}:{frame.f_lineno}"
            return f"{where} (`{code[:120]}`)" if code else where
        frame = frame.f_back
    return "an unknown line"


def _function_class(frame: FrameType | None) -> tuple[type | None, FrameType | None]:
    """The ``torch.autograd.Function`` whose ``apply`` is running on a tensor that requires grad
    (else torch runs no backward of it either), and that frame, if any."""
    while frame is not None:
        if frame.f_code.co_name == "apply":
            cls = frame.f_locals.get("cls")
            if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
                args = (frame.f_locals.get("args", ()), frame.f_locals.get("kwargs", {}))
                if any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(args)):
                    return cls, frame
                return None, None
        frame = frame.f_back
    return None, None


def function_construct(cls: type) -> str:
    """How a warning names the Function ``cls``."""
    qualname = getattr(cls, "__qualname__", cls.__name__)
    if qualname == "CheckpointFunction" and cls.__module__ == "torch.utils.checkpoint":
        return "torch.utils.checkpoint(use_reentrant=True)"
    if cls.__module__ == "gradgraph.torch.runner":
        return "an ORTModule called inside the forward"
    return f"the custom autograd.Function {qualname}"


def _saved_hooks() -> Any:
    """The innermost saved-tensor hooks torch has on (None when none; where this torch cannot
    say, a marker that never equals the probe's start)."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False)
    except Exception:  # noqa: BLE001 - a private function of torch
        return None


def _in_checkpoint(frame: FrameType | None) -> FrameType | None:
    """The frame of ``torch.utils.checkpoint.checkpoint`` running, if any."""
    while frame is not None:
        if frame.f_code.co_name == "checkpoint" and frame.f_code.co_filename.endswith(
                os.path.join("utils", "checkpoint.py")):
            return frame
        frame = frame.f_back
    return None


def _scales_grad_by_freq(func: Any, args: tuple, kwargs: dict) -> bool:
    """Is this an embedding call whose weight gets a frequency-scaled gradient?"""
    positions = _FREQ_ARGS.get(func)
    if positions is None:
        return False
    weight_at, scaled_at = positions
    weight = kwargs.get("weight", args[weight_at] if len(args) > weight_at else None)
    scaled = kwargs.get("scale_grad_by_freq", args[scaled_at] if len(args) > scaled_at else False)
    return bool(scaled) and isinstance(weight, torch.Tensor) and weight.requires_grad


class CaptureWatch(TorchFunctionMode):
    """Records, during one forward with grad enabled, the constructs of the module docstring:
    ``reads`` (a stopped gradient read by a differentiable call), ``gradient_only`` (case 6)
    and ``found`` (cases 2-5: what, where)."""

    def __init__(self) -> None:
        super().__init__()
        self._stopped: dict[int, weakref.ref] = {}
        self.reads: list[str] = []
        self.gradient_only: list[str] = []
        self.found: list[str] = []
        self._hooks_at_start = _saved_hooks()

    def __enter__(self) -> CaptureWatch:
        self._hooks_at_start = _saved_hooks()
        super().__enter__()
        return self

    def _is_stopped(self, t: torch.Tensor) -> bool:
        ref = self._stopped.get(id(t))
        return ref is not None and ref() is t

    def _stop(self, out: Any) -> None:
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self._stopped[id(t)] = weakref.ref(t)

    def _note(self, what: str, frame: FrameType | None) -> None:
        entry = f"{what} at {user_line(frame)}"
        if entry not in self.found:
            self.found.append(entry)

    def _on_gradient_path(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point() and (t.requires_grad or self._is_stopped(t))

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        grad_on = torch.is_grad_enabled()
        name = getattr(func, "__name__", None) or str(func)
        first = args[0] if args else None
        caller = sys._getframe(1)
        if name in CONVERSIONS and self._on_gradient_path(first):
            self._note(f"{CONVERSIONS[name]} of a tensor on the gradient's path (PyTorch treats the "
                       "number as a constant; the graph would differentiate through it)", caller)
        elif name in TENSOR_HOOKS and isinstance(first, torch.Tensor) and first.requires_grad:
            self._note(f"{TENSOR_HOOKS[name]} on an intermediate tensor (the backward runs in "
                       "onnxruntime and cannot call it)", caller)
        if self._hooks_at_start is None and _saved_hooks() is not None:
            checkpoint = _in_checkpoint(caller)
            if checkpoint is not None:
                self._note("torch.utils.checkpoint(use_reentrant=False)", checkpoint)
            else:
                self._note("saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks / save_on_cpu) "
                           "pushed inside the forward", caller)
        if not grad_on:
            cls, frame = _function_class(caller)
            if cls is not None:
                self._note(function_construct(cls) + " (its backward is its own; the graph would "
                           "differentiate its forward)", frame)
        out = func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if grad_on and _scales_grad_by_freq(func, args, kwargs):
            self.gradient_only.append(f"{name}(scale_grad_by_freq=True)")
        if (name in ("detach", "detach_") or func == _DATA_GET) and tensors and tensors[0].requires_grad:
            self._stop(out)
            return out
        if not grad_on:
            if any(t.requires_grad or self._is_stopped(t) for t in tensors):
                self._stop(out)
        elif not self.reads and any(isinstance(o, torch.Tensor) and o.is_floating_point()
                                    for o in pytree.tree_leaves(out)):
            if any(t.is_floating_point() and self._is_stopped(t) for t in tensors):
                self.reads.append(name)
        return out


def functions_in_graph(outputs: list[Any]) -> list[str]:
    """The custom Functions on the autograd graph of ``outputs`` (a Function whose forward
    runs no torch op is not seen by :class:`CaptureWatch`), named by
    :func:`function_construct` with the line of their ``forward``."""
    found: list[str] = []
    seen: set[int] = set()
    todo = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        cls = getattr(node, "_forward_cls", None)
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
            code = getattr(cls.forward, "__code__", None)
            where = f" (forward at {os.path.basename(code.co_filename)}:{code.co_firstlineno})" if code else ""
            entry = function_construct(cls) + where
            if entry not in found:
                found.append(entry)
        todo.extend(n for n, _ in getattr(node, "next_functions", ()))
    return found
