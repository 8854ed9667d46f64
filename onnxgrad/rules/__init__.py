"""The built-in gradient rules, one module per op family; importing them registers them."""
from . import (  # noqa: F401
    activations,
    attention,
    control,
    elementwise,
    linalg,
    losses,
    nn,
    normalization,
    recurrent,
    reduce,
    sampling,
    sequence,
    shape,
    spectral,
    stop,
)
