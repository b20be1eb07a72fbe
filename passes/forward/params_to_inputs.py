"""ParamsToInputsPass: make named initializers graph inputs (held and fed by the runtime).

1. each named initializer is removed from the initializers and appended to the graph inputs,
   keeping its type and shape; its value is recorded in ``self.values`` (numpy, not copied:
   it may view the model's tensor or its memory-mapped file; copy it before writing) and dropped;
2. names that are not initializers are left alone (they may already be inputs);
3. ``names=None``: the initializers marked held (``gradgraph.held``, see passes.marks).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.marks import HELD_KEY


class ParamsToInputsPass(InPlacePass):
    def __init__(self, names: Sequence[str] | None = None) -> None:
        super().__init__()
        self.names = None if names is None else list(names)
        self.values: dict[str, np.ndarray] = {}

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        modified = False
        names = self.names
        if names is None:
            names = [n for n, v in graph.initializers.items() if HELD_KEY in v.metadata_props]
        for name in names:
            value = graph.initializers.get(name)
            if value is None:
                continue
            tensor = value.const_value
            if tensor is None:
                raise ValueError(f"initializer {name!r} has no value")
            self.values[name] = tensor.numpy()  # read-only views may alias the model: copy to write
            graph.initializers.pop(name)
            value.const_value = None
            if not value.is_graph_input():
                graph.inputs.append(value)
            modified = True
        return PassResult(model, modified)
