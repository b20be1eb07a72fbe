"""Gradient rules, one module per op family; importing this package registers them all."""

from passes.autodiff.rules import (  # noqa: F401
    attention,
    control,
    conv,
    deform_conv,
    elementwise,
    linalg,
    newer,
    nn,
    nondiff,
    quant_signal,
    recurrent,
    reduce,
    resize,
    sequence,
    shape,
)
