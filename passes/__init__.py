"""Pure graph passes over ONNX models (autodiff included).

Nothing here imports from ``gradgraph``: the passes take and return models
(``onnx_ir.Model``) and can be composed by any pipeline.
"""
