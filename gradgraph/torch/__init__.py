"""PyTorch front ends: :class:`ORTModule` runs a module's forward and backward in onnxruntime."""

from gradgraph.torch.export import ExportFailed, export_call
from gradgraph.torch.ortmodule import DebugOptions, ORTModule, ORTModuleTorchModelException

__all__ = ["DebugOptions", "ExportFailed", "ORTModule", "ORTModuleTorchModelException", "export_call"]
