"""A seeded batch sampler that resumes mid-epoch from a checkpoint.

Each epoch's order is a permutation drawn from ``seed + epoch`` alone, so a
fresh sampler can rebuild any epoch's order from ``(seed, epoch)`` and skip the
``position`` batches already handed out: resuming neither repeats nor skips a
prompt, and later epochs are identical to an uninterrupted run.
"""

from collections.abc import Iterator
from typing import Any

import numpy as np


class ResumableBatchSampler:
    """Yields lists of dataset indices, ``batch_size`` at a time; the tail of each epoch is dropped.

    One ``iter()`` covers the rest of the current epoch; the next ``iter()``
    starts the following epoch. ``position`` counts batches handed out, so with
    a DataLoader that prefetches (``num_workers > 0``) it runs ahead of the
    batches the trainer actually consumed; checkpoint with ``num_workers=0`` or
    iterate the sampler directly.
    """

    def __init__(self, dataset_size: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}; expected at least 1")
        if dataset_size < batch_size:
            raise ValueError(f"dataset_size={dataset_size} is smaller than batch_size={batch_size}: no full batch")
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.dataset_size // self.batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The index order of ``epoch``, a pure function of ``seed + epoch``."""
        if not self.shuffle:
            return np.arange(self.dataset_size)
        return np.random.default_rng(self.seed + epoch).permutation(self.dataset_size)

    def __iter__(self) -> Iterator[list[int]]:
        if self.position >= len(self):  # the previous epoch was fully handed out but not closed
            self._start_next_epoch()
        order = self.epoch_order(self.epoch)
        while self.position < len(self):
            start = self.position * self.batch_size
            self.position += 1  # counted before yielding: a checkpoint taken after receiving it won't replay it
            yield order[start : start + self.batch_size].tolist()
        self._start_next_epoch()

    def _start_next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpointed state; the dataset size and batch size must match the saved run."""
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise KeyError(f"sampler state is missing {sorted(missing)}")
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"sampler position {state['position']} is outside an epoch of {len(self)} batches")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.seed = int(state["seed"])
