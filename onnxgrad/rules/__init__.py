"""The built-in gradient rules, one module per op family; importing them registers them."""
from . import (  # noqa: F401
    elementwise,
    activations,
    linalg,
    shape,
    reduce,
    nn,
    normalization,
    losses,
    stop,
)
