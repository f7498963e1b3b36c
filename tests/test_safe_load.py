"""Checkpoint files load without running anything: a planted pickle is refused, naming the file."""

import os

import numpy as np
import pytest
import torch

from nemo_dapo.safe_load import UnsafeCheckpointFile, check_distributed_checkpoint, load_state


class Planted:
    """What an attacker would put in a shared checkpoint folder: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_trainer_and_rng_states_load_and_a_planted_pickle_does_not_run(tmp_path):
    state = {
        "global_step": 3,
        "sampler": {"epoch": 0, "position": 2, "seed": 1},
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": __import__("random").getstate(),
        },
        "carried": {"tensors": {"x": torch.ones(2)}, "fields": {"uid": ["a", "b"]}, "meta": {}},
    }
    torch.save(state, tmp_path / "trainer_state.pt")
    loaded = load_state(tmp_path / "trainer_state.pt")
    assert loaded["global_step"] == 3 and torch.equal(loaded["rng"]["torch"], state["rng"]["torch"])
    np.random.set_state(loaded["rng"]["numpy"])  # the numpy state comes back usable
    marker = tmp_path / "ran"
    torch.save({"global_step": Planted(marker)}, tmp_path / "planted.pt")
    with pytest.raises(UnsafeCheckpointFile, match=r"planted\.pt: refused to load: it holds Python objects"):
        load_state(tmp_path / "planted.pt")
    assert not marker.exists()


def test_a_distributed_checkpoint_is_read_safely_first(tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "megatron"
    dcp.save(
        {"weight": torch.arange(4.0), "extra": {"layer": "state", "n": 3}}, checkpoint_id=str(folder), no_dist=True
    )
    check_distributed_checkpoint(folder)  # what torch_dist writes passes
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(UnsafeCheckpointFile, match=r"\.metadata: refused to load: global posix\.system is not allowed"):
        check_distributed_checkpoint(folder)
    assert not marker.exists()
