"""What gradgraph needs to know about, or hand to, onnxruntime, apart from the public API.

- :mod:`~gradgraph.runtime.kernels`: which ops a provider runs in a dtype (the probe behind the
  precision passes);
- :mod:`~gradgraph.runtime.compat`: making a model loadable by an older onnxruntime (IR version,
  opset), and the session/provider helpers;
- :mod:`~gradgraph.runtime.external`: weights in external data handed to sessions as OrtValues
  (models over 2 GB);
- :mod:`~gradgraph.runtime.reference_kernels`: float64-exact kernels for onnx's
  ReferenceEvaluator, the finite-difference oracle's runtime.
"""
