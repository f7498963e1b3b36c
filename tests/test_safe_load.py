"""Checkpoint files load without running anything: a planted pickle is refused, naming the file."""

import dataclasses
import os
import pickle

import numpy as np
import pytest
import torch

from nemo_dapo.errors import InputError
from nemo_dapo.safe_load import (
    CHECKED_ITEMS,
    UnsafeCheckpointFile,
    _MetadataUnpickler,
    checked_distributed_checkpoint,
    load_state,
    refuse_unsafe_distributed_checkpoint,
)
from tests.planted import Planted, UnpicklesAFile, dotted_name_payload


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


def _dcp_folder(tmp_path, extra, weight=None):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "megatron"
    weight = torch.arange(4.0) if weight is None else weight
    dcp.save({"weight": weight, "extra": extra}, checkpoint_id=str(folder), no_dist=True)
    return folder


def _load(folder):
    import torch.distributed.checkpoint as dcp

    state = {"weight": torch.zeros(4), "extra": {"layer": None, "n": None}}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state


def test_a_distributed_checkpoint_loads_from_a_checked_copy_and_a_file_swapped_after_the_check_is_not_read(tmp_path):
    folder = _dcp_folder(tmp_path, {"layer": "state", "n": 3})
    marker = tmp_path / "ran"
    with checked_distributed_checkpoint(folder) as checked:
        (folder / ".metadata").write_bytes(pickle.dumps(Planted(marker)))  # swapped once checked
        state = _load(checked)
        staged = _MetadataUnpickler(open(checked / ".metadata", "rb")).load()
    assert torch.equal(state["weight"], torch.arange(4.0)) and state["extra"] == {"layer": "state", "n": 3}
    assert not marker.exists() and not checked.exists()
    byte_items = [info for index, info in staged.storage_data.items() if index.fqn.startswith("extra.")]
    assert byte_items and all(info.relative_path == CHECKED_ITEMS for info in byte_items)


@pytest.mark.parametrize("payload", ["module function", "dotted name", "package function", "byte item"])
def test_a_distributed_checkpoint_that_would_run_code_is_refused_and_runs_nothing(tmp_path, payload):
    marker = tmp_path / "ran"
    folder = _dcp_folder(tmp_path, Planted(marker) if payload == "byte item" else {"n": 3})
    if payload == "module function":
        (folder / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    elif payload == "dotted name":
        (folder / ".metadata").write_bytes(dotted_name_payload(marker))
    elif payload == "package function":
        torch.save({"x": Planted(marker)}, tmp_path / "planted.pt")
        (folder / ".metadata").write_bytes(pickle.dumps(UnpicklesAFile(tmp_path / "planted.pt", tmp_path / "out")))
    refused = {
        "module function": r"\.metadata: refused to load: global posix\.system is not allowed",
        "dotted name": r"global torch\.distributed\.checkpoint\.filesystem\.os\.system is not allowed",
        "package function": r"global torch\.distributed\.checkpoint\.format_utils\.torch_save_to_dcp is not allowed",
        "byte item": r"refused to load its item extra: it holds Python objects",
    }[payload]
    with pytest.raises(UnsafeCheckpointFile, match=refused):
        with checked_distributed_checkpoint(folder):
            pass
    assert not marker.exists()


def _store_weight_at(folder, where):
    """Rewrite the folder's .metadata so that the tensor item ``weight`` is read from ``where``."""
    metadata = _MetadataUnpickler(open(folder / ".metadata", "rb")).load()
    for index, info in metadata.storage_data.items():
        if index.fqn == "weight":
            metadata.storage_data[index] = dataclasses.replace(info, relative_path=str(where))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.timeout(60)  # unrefused, the FIFO case blocks in the load: a failure, not a hang
@pytest.mark.parametrize("place", ["absolute path", "parent folder", "link", "fifo"])
def test_a_tensor_item_stored_outside_the_checkpoint_is_refused_before_anything_is_read(tmp_path, place):
    """A planted .metadata that stores a tensor item in another checkpoint's file (by an absolute
    path, through ``..`` or a link) or in a FIFO: refused (exit 2) naming the item, by the check
    before Ray and by the load; unrefused, the load reads the other checkpoint's tensor or waits forever."""
    other = _dcp_folder(tmp_path / "other", {"n": 1}, weight=torch.full((4,), 7.0))
    folder = _dcp_folder(tmp_path / "planted", {"n": 3})
    other_file = next(other.glob("*.distcp"))
    if place == "absolute path":
        _store_weight_at(folder, other_file)
    elif place == "parent folder":
        _store_weight_at(folder, os.path.relpath(other_file, folder))
    elif place == "link":
        (folder / "elsewhere.distcp").symlink_to(other_file)
        _store_weight_at(folder, "elsewhere.distcp")
    else:
        os.mkfifo(tmp_path / "fifo")
        _store_weight_at(folder, tmp_path / "fifo")
    refused = r"elsewhere\.distcp: not a plain file" if place == "link" else r"\.metadata: item weight is stored at"
    with pytest.raises(UnsafeCheckpointFile, match=refused) as before_ray:
        refuse_unsafe_distributed_checkpoint(folder)
    assert isinstance(before_ray.value, InputError) and "resume from another one" in str(before_ray.value)
    with pytest.raises(UnsafeCheckpointFile, match=refused):
        with checked_distributed_checkpoint(folder) as checked:
            _load(checked)
