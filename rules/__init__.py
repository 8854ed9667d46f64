"""The built-in gradient rules, one module per op family; importing them registers them."""
from . import (
    activations,  # noqa: F401
    attention,  # noqa: F401
    control,  # noqa: F401
    elementwise,  # noqa: F401
    linalg,  # noqa: F401
    losses,  # noqa: F401
    nn,  # noqa: F401
    normalization,  # noqa: F401
    recurrent,  # noqa: F401
    reduce,  # noqa: F401
    sampling,  # noqa: F401
    sequence,  # noqa: F401
    shape,  # noqa: F401
    spectral,  # noqa: F401
    stop,  # noqa: F401
)
