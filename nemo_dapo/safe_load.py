"""Reading the ``.pt`` files of a checkpoint (trainer state, optimizer state, RNG states) without
running anything they might hold.

A shared checkpoint folder is writable by others: with a plain ``torch.load`` a planted pickle
would run its code in the next auto-resume. These files are loaded with ``weights_only=True``,
which builds tensors, containers and plain values only, plus the pieces of a NumPy RNG state
(arrays of plain numbers) named below; anything else is refused with the file named.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from nemo_dapo.errors import InputError


class UnsafeCheckpointFile(InputError):
    """A checkpoint file that holds Python objects whose loading could run code."""


def _numpy_rng_globals() -> list:
    """What ``np.random.get_state()`` pickles into: a uint32 array and its reconstruction."""
    import numpy as np

    return [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]


def load_state(path: str | Path) -> Any:
    import torch

    try:
        with torch.serialization.safe_globals(_numpy_rng_globals()):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0]
        raise UnsafeCheckpointFile(
            f"{path}: refused to load: it holds Python objects beyond tensors and plain data, whose loading "
            f"could run code ({first[:200]}). nemo-dapo never writes such files: the checkpoint was altered; "
            "resume from another one (checkpoint.resume=<path>) or move this one away"
        ) from None


def _allowed_in_dcp_metadata(module: str, name: str) -> bool:
    """The classes torch.distributed.checkpoint's ``.metadata`` pickle is made of (dataclasses and
    enums of that package, tensor sizes and dtypes, the checkpoint's path)."""
    import torch

    if module.startswith("torch.distributed.checkpoint."):
        return True
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    if module == "pathlib":
        return name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
    return (module, name) == ("torch.serialization", "_get_layout")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed_in_dcp_metadata(module, name):
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


def check_distributed_checkpoint(folder: str | Path) -> None:
    """Refuse a torch.distributed.checkpoint folder (Megatron's torch_dist format) whose loading
    could run code: torch reads its ``.metadata`` with ``pickle`` and its byte items (e.g. layers'
    extra state) with ``torch.load(weights_only=False)``. Both are read here first the safe way:
    the metadata with an unpickler that builds only the checkpoint package's own classes, each
    byte item with ``weights_only=True``."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = Path(folder)
    path = folder / ".metadata"
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointFile(
            f"{path}: refused to load: {err}; a checkpoint nemo-dapo wrote holds only torch's checkpoint "
            "classes there: it was altered; resume from another one or move it away"
        ) from None
    byte_items = {key for key, item in metadata.state_dict_metadata.items() if isinstance(item, BytesStorageMetadata)}
    for index, info in metadata.storage_data.items():
        if index.fqn not in byte_items:
            continue
        with open(folder / info.relative_path, "rb") as handle:
            handle.seek(info.offset)
            data = handle.read(info.length)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointFile(
                f"{folder / info.relative_path}: refused to load its item {index.fqn}: it holds Python objects "
                f"whose loading could run code ({str(err).strip().splitlines()[0][:200]}); the checkpoint was "
                "altered; resume from another one or move it away"
            ) from None
