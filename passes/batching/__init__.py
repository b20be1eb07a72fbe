"""Passes about the batch dimension.

- :mod:`dynamic_batch`: ``DynamicBatchPass`` makes a fixed export batch symbolic and rewrites the
  shape constants that bake it in (or refuses with :data:`BATCH_ERROR`); the rules are listed
  in its docstring;
- :mod:`state`: what the analysis tracks per value (``Batch``) and the edits it plans (``Edit``);
- :mod:`tracing`: the analysis' bookkeeping and its trace-back to where values come from;
- :mod:`op_rules`: how each op moves the batch axis (``Analysis``);
- :mod:`emit`: applies the edits to the graph.
"""

from passes.batching.dynamic_batch import (
    BATCH_ERROR,
    DynamicBatchPass,
    batch_error,
    select_batch_inputs,
)

__all__ = ["BATCH_ERROR", "DynamicBatchPass", "batch_error", "select_batch_inputs"]
