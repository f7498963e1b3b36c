"""Reading the ``.pt`` files of a checkpoint (trainer state, optimizer state, RNG states) without
running anything they might hold.

A shared checkpoint folder is writable by others: with a plain ``torch.load`` a planted pickle
would run its code in the next auto-resume. These files are loaded with ``weights_only=True``,
which builds tensors, containers and plain values only, plus the pieces of a NumPy RNG state
(arrays of plain numbers) named below; anything else is refused with the file named.
"""

from __future__ import annotations

import io
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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


# Every global a torch.distributed.checkpoint ``.metadata`` pickle is made of, as (module, name):
# the metadata dataclasses and enums, the save plan megatron-core caches in it (its planner
# data), the file-system reader's storage record, tensor sizes, the layout helper and the
# checkpoint id's path. Exact pairs: a dotted name ("os.system" looked up in a module that
# imports os) or another function of the package matches none of them.
DCP_METADATA_GLOBALS = frozenset(
    [
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ]
    + [
        ("torch.distributed.checkpoint.planner", name)
        for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
    ]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size")]
    + [("torch.serialization", "_get_layout")]
    + [("pathlib", name) for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")]
)


def _allowed_in_dcp_metadata(module: str, name: str) -> bool:
    import torch

    if (module, name) in DCP_METADATA_GLOBALS:
        return True
    return module == "torch" and name.isidentifier() and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed_in_dcp_metadata(module, name):
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


CHECKED_ITEMS = "checked_byte_items.bin"  # the staged copy of a checkpoint's byte items


@contextmanager
def checked_distributed_checkpoint(folder: str | Path) -> Iterator[Path]:
    """A private copy of what loading a torch.distributed.checkpoint folder (Megatron's torch_dist
    format) unpickles, checked, for torch and megatron-core to load from instead of ``folder``.

    torch reads the ``.metadata`` with ``pickle`` and each byte item (e.g. layers' extra state)
    with ``torch.load(weights_only=False)``: either could run code. Here the metadata is parsed
    once with an unpickler that builds only the classes above, each byte item is read once and
    loaded with ``weights_only=True``, and the bytes checked are the bytes loaded: the metadata
    (pointing its byte items at a staged copy of them) and the small files are written to a
    private folder, the tensor files linked (torch reads tensors with ``weights_only=True``). A
    file replaced in ``folder`` after the check is therefore never unpickled. The folder is
    removed on exit."""
    source = Path(folder)
    staging = Path(tempfile.mkdtemp(prefix="nemo_dapo_checked_"))
    try:
        metadata = _read_metadata(source / ".metadata")
        _stage_byte_items(source, metadata, staging / CHECKED_ITEMS)
        (staging / ".metadata").write_bytes(pickle.dumps(metadata))
        for entry in _plain_files(source):
            if entry.suffix == ".distcp":
                (staging / entry.name).symlink_to(entry.resolve())
            else:
                (staging / entry.name).write_bytes(entry.read_bytes())
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def refuse_unsafe_distributed_checkpoint(folder: str | Path) -> None:
    """What :func:`checked_distributed_checkpoint` would refuse, said before anything starts (the
    driver, before Ray), by the same checks without writing the staged copy; a folder damaged
    in other ways is left to the manifest check and the load, which fall back to an older
    checkpoint where they may."""
    source = Path(folder)
    try:
        metadata = _read_metadata(source / ".metadata")
        for _ in _checked_byte_items(source, metadata):
            pass
        for _ in _plain_files(source):
            pass
    except UnsafeCheckpointFile:
        raise
    except Exception:  # damage, not danger: not this check's to report
        return


def _plain_files(source: Path) -> Iterator[Path]:
    """The folder's files other than ``.metadata``; anything else (a link, a folder) is refused."""
    for entry in source.iterdir():
        if entry.name == ".metadata":
            continue
        if not entry.is_file() or entry.is_symlink():
            raise UnsafeCheckpointFile(f"{entry}: not a plain file; a checkpoint nemo-dapo wrote holds none")
        yield entry


def _read_metadata(path: Path) -> Any:
    try:
        return _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointFile(
            f"{path}: refused to load: {err}; a checkpoint nemo-dapo wrote holds only torch's checkpoint "
            "classes there: it was altered; resume from another one or move it away"
        ) from None


def _checked_byte_items(source: Path, metadata: Any) -> Iterator[tuple[Any, Any, bytes]]:
    """Each byte item (its index, storage info and bytes), read once and loaded with
    ``weights_only=True``; one holding Python objects whose loading could run code is refused."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    byte_items = {key for key, item in metadata.state_dict_metadata.items() if isinstance(item, BytesStorageMetadata)}
    for index, info in metadata.storage_data.items():
        if index.fqn not in byte_items:
            continue
        with open(source / Path(info.relative_path).name, "rb") as handle:
            handle.seek(info.offset)
            data = handle.read(info.length)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointFile(
                f"{source / info.relative_path}: refused to load its item {index.fqn}: it holds Python objects "
                f"whose loading could run code ({str(err).strip().splitlines()[0][:200]}); the checkpoint was "
                "altered; resume from another one or move it away"
            ) from None
        yield index, info, data


def _stage_byte_items(source: Path, metadata: Any, staged: Path) -> None:
    """Copy each byte item once into ``staged``, checked, and point the metadata at the copy."""
    import dataclasses

    with open(staged, "wb") as out:
        for index, info, data in _checked_byte_items(source, metadata):
            metadata.storage_data[index] = dataclasses.replace(
                info, relative_path=CHECKED_ITEMS, offset=out.tell(), length=len(data)
            )
            out.write(data)
