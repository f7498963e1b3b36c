"""Importing megatron-core widens torch's ``weights_only`` allow-list for the whole process
(``megatron/core/safe_globals.py``: SimpleNamespace, argparse.Namespace, io.BytesIO,
pathlib.PosixPath, signal.Signals, OptimizerConfig, its enums), in every Megatron rank. Our
checkpoint loads do not follow it: ``load_state`` (trainer, optimizer and RNG states) and the
torch_dist byte-item check admit torch's own list and the NumPy RNG pieces only
(nemo_dapo/safe_load.py, refuse_foreign_globals)."""

import argparse
import io
from pathlib import PosixPath
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nemo_dapo.safe_load import UnsafeCheckpointFile, load_state, refuse_unsafe_distributed_checkpoint


def megatron_admitted() -> dict:
    """One object of each kind megatron-core adds, by the name a pickle gives it."""
    import megatron.core  # noqa: F401  (importing it registers its list, as in every Megatron rank)
    from megatron.core.optimizer import OptimizerConfig

    return {
        "types.SimpleNamespace": SimpleNamespace(lr=1.0),
        "argparse.Namespace": argparse.Namespace(lr=1.0),
        "pathlib.PosixPath": PosixPath("/etc/passwd"),
        "_io.BytesIO": io.BytesIO(b"bytes"),
        "megatron.core.optimizer.optimizer_config.OptimizerConfig": OptimizerConfig(lr=1.0),
    }


@pytest.mark.megatron
def test_what_megatron_core_admits_process_wide_our_loads_refuse_and_our_own_states_still_load(tmp_path):
    for name, planted in megatron_admitted().items():
        path = tmp_path / "trainer_state.pt"
        torch.save({"global_step": 3, "sampler": planted}, path)
        assert torch.load(path, weights_only=True)["global_step"] == 3  # what the process's list admits
        with pytest.raises(
            UnsafeCheckpointFile, match=rf"trainer_state\.pt: refused to load: .*\({name}; what megatron"
        ):
            load_state(path)
    torch.save({"global_step": 3, "rng": {"numpy": np.random.get_state(), "torch": torch.get_rng_state()}}, path)
    assert load_state(path)["global_step"] == 3  # tensors, numbers and the NumPy RNG state pass


@pytest.mark.megatron
def test_a_byte_item_holding_what_megatron_core_admits_is_refused_before_the_load(tmp_path):
    import torch.distributed.checkpoint as dcp

    megatron_admitted()
    folder = tmp_path / "megatron"
    dcp.save(
        {"weight": torch.arange(4.0), "extra": {"n": SimpleNamespace(lr=1.0)}}, checkpoint_id=str(folder), no_dist=True
    )
    with pytest.raises(UnsafeCheckpointFile, match=r"refused to load its item extra\.n: .*\(types\.SimpleNamespace;"):
        refuse_unsafe_distributed_checkpoint(folder)


@pytest.mark.megatron
def test_a_common_pt_holding_what_megatron_core_admits_is_refused_before_ray_and_at_the_load(tmp_path):
    """megatron-core loads a torch_dist folder's ``common.pt`` itself, with ``weights_only=True``
    under its own list; the checked copy it loads from holds only one that names torch's list."""
    import torch.distributed.checkpoint as dcp

    from nemo_dapo.safe_load import checked_distributed_checkpoint

    megatron_admitted()
    folder = tmp_path / "megatron"
    dcp.save({"weight": torch.arange(4.0)}, checkpoint_id=str(folder), no_dist=True)
    torch.save({"steps_done": 2}, folder / "common.pt")
    with checked_distributed_checkpoint(folder) as checked:
        assert torch.load(checked / "common.pt", weights_only=True) == {"steps_done": 2}
    torch.save({"steps_done": 2, "args": argparse.Namespace(lr=1.0)}, folder / "common.pt")
    refused = r"common\.pt: refused to load: .*\(argparse\.Namespace;"
    with pytest.raises(UnsafeCheckpointFile, match=refused):
        refuse_unsafe_distributed_checkpoint(folder)
    with pytest.raises(UnsafeCheckpointFile, match=refused):
        with checked_distributed_checkpoint(folder):
            pass
