"""PyTorch front ends: :class:`ORTModule` runs a module's forward and backward in onnxruntime;
:class:`TorchOrtFactory` makes an ONNX graph a ``torch.autograd.Function``; :class:`ORTTrainer`
(with :class:`ORTTrainerOptions` and the configs of :mod:`gradgraph.torch.optim`) trains a
module or an ONNX model with gradgraph's training graph."""

try:
    import torch  # noqa: F401
except ModuleNotFoundError as _exc:
    if _exc.name != "torch":
        raise
    raise ModuleNotFoundError("gradgraph.torch needs PyTorch, which is not installed: "
                              "pip install 'gradgraph[torch]'", name="torch") from None

from gradgraph.torch import optim
from gradgraph.torch.export import ExportFailed, export_call
from gradgraph.torch.factory import TorchOrtFactory, TorchOrtFunction
from gradgraph.torch.ortmodule import (
           DebugOptions,
           LogLevel,
           ORTModule,
           ORTModuleTorchModelException,
)
from gradgraph.torch.trainer import IODescription, ModelDescription, ORTTrainer
from gradgraph.torch.trainer_options import ORTTrainerOptions

__all__ = ["DebugOptions", "ExportFailed", "IODescription", "LogLevel", "ModelDescription", "ORTModule",
           "ORTModuleTorchModelException", "ORTTrainer", "ORTTrainerOptions", "TorchOrtFactory",
           "TorchOrtFunction", "export_call", "optim"]
