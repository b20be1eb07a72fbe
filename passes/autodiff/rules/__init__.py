"""Gradient rules, one module per op family; importing this package registers them all."""

from passes.autodiff.rules import (  # noqa: F401
    control,
    conv,
    elementwise,
    linalg,
    nn,
    nondiff,
    recurrent,
    reduce,
    resize,
    sequence,
    shape,
)
