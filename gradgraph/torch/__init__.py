"""PyTorch front ends: :class:`ORTModule` runs a module's forward and backward in onnxruntime;
:class:`TorchOrtFactory` makes an ONNX graph a ``torch.autograd.Function``."""

from gradgraph.torch.export import ExportFailed, export_call
from gradgraph.torch.factory import TorchOrtFactory, TorchOrtFunction
from gradgraph.torch.ortmodule import DebugOptions, ORTModule, ORTModuleTorchModelException

__all__ = ["DebugOptions", "ExportFailed", "ORTModule", "ORTModuleTorchModelException", "TorchOrtFactory",
           "TorchOrtFunction", "export_call"]
