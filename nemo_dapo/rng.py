"""The random-number state a checkpoint keeps (torch's CPU generator, numpy's, Python's), taken
and restored in one place: a resumed run draws the same numbers as an uninterrupted one.
Loaded back with :func:`nemo_dapo.safe_load.load_state`, which allows exactly these types."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
