"""Passes about the batch dimension.

- :mod:`dynamic_batch`: ``DynamicBatchPass`` makes a fixed export batch symbolic and rewrites the
  shape constants that bake it in (or refuses with :data:`BATCH_ERROR`).
"""

from passes.batching.dynamic_batch import (
    BATCH_ERROR,
    DynamicBatchPass,
    batch_error,
    select_batch_inputs,
)

__all__ = ["BATCH_ERROR", "DynamicBatchPass", "batch_error", "select_batch_inputs"]
