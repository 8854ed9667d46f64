"""The MLP training fixture's batches (models/training/), a poisoned one, and the check that a refused step
changed nothing: shared by the training tests on the CPU and on a device."""
from __future__ import annotations

from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parents[1] / "models" / "training"
DATA = np.load(FIXTURES / "trajectories.npz")


def batch(step: int = 0) -> dict[str, np.ndarray]:
    return {"x": DATA["x"][step], "y": DATA["y"][step]}


def poisoned() -> dict[str, np.ndarray]:
    """The first batch with one NaN input."""
    x = DATA["x"][0].copy()
    x[3, 2] = np.nan
    return {"x": x, "y": DATA["y"][0]}


def assert_unchanged(session, before: dict, state: dict) -> None:
    """The session's parameters and optimizer state are exactly ``before`` and ``state``."""
    for name, value in session.parameters().items():
        np.testing.assert_array_equal(value, before[name])
    for p, st in session.optimizer_state().items():
        for k, v in st.items():
            np.testing.assert_array_equal(v, state[p][k])
