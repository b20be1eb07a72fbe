"""Split a training graph where its node marks say: forward model, backward model, the stash between."""

from passes.split.forward_backward import (
    SPLIT_KEY,
    ForwardBackwardSplit,
    SplitError,
    backward_side,
    split_forward_backward,
)

__all__ = ["SPLIT_KEY", "ForwardBackwardSplit", "SplitError", "backward_side", "split_forward_backward"]
