"""Reading the ``.pt`` files of a checkpoint (trainer state, optimizer state, RNG states) without
running anything they might hold.

A shared checkpoint folder is writable by others: with a plain ``torch.load`` a planted pickle
would run its code in the next auto-resume. These files are loaded with ``weights_only=True``,
which builds tensors, containers and plain values only, plus the pieces of a NumPy RNG state
(arrays of plain numbers) named below; anything else is refused with the file named, including
what megatron-core adds to torch's ``weights_only`` list in its processes
(:func:`refuse_foreign_globals`).

Outside contract (torch's ``weights_only`` unpickler): see docs/architecture.md, "Outside contracts".
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from nemo_dapo.errors import InputError
from nemo_dapo.folders import NotPlainFile, open_plain


class UnsafeCheckpointFile(InputError):
    """A checkpoint file that holds Python objects whose loading could run code."""


def _numpy_rng_globals() -> list:
    """What ``np.random.get_state()`` pickles into: a uint32 array and its reconstruction."""
    import numpy as np

    return [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]


def _names(objects: list) -> set[str]:
    """How a pickle names each of ``objects`` (module and qualified name, as torch matches them)."""
    return {f"{obj.__module__}.{obj.__qualname__}" for obj in objects}


def refuse_foreign_globals(handle: BinaryIO, allowed: set[str], refusal: str) -> None:
    """Refuse the ``torch.save`` file open in ``handle`` (rewound after), the error starting with
    ``refusal``, if its pickle names a class or function beyond torch's own ``weights_only``
    list and ``allowed``.

    A ``weights_only`` load also admits whatever the process added to torch's list, and
    importing megatron-core adds, in every Megatron rank, SimpleNamespace, argparse.Namespace,
    io.BytesIO, pathlib.PosixPath, signal.Signals, its OptimizerConfig and its enums
    (``megatron/core/safe_globals.py``): a planted file could build those where our state holds
    tensors and numbers (an OptimizerConfig is built by calling it with the file's arguments).
    The names are read statically (torch's own scan of the opcodes its loader accepts), before
    anything is built."""
    from torch import _weights_only_unpickler as unpickler
    from torch.serialization import _open_zipfile_reader

    with _open_zipfile_reader(handle) as archive:
        named = unpickler.get_globals_in_pkl(io.BytesIO(archive.get_record("data.pkl")))
    handle.seek(0)
    foreign = sorted(named - set(unpickler._get_allowed_globals()) - allowed)
    if foreign:
        raise UnsafeCheckpointFile(
            f"{refusal}: it holds Python objects beyond tensors and plain data ({', '.join(foreign)}; what "
            f"megatron-core adds to torch's weights_only list does not count here); {ALTERED}"
        )


def load_state(path: str | Path) -> Any:
    """A ``.pt`` file of a checkpoint: tensors, containers, plain values and the NumPy RNG
    pieces only, whatever else the process's ``weights_only`` list admits."""
    import torch

    ours = _numpy_rng_globals()
    try:
        with open(path, "rb") as handle:
            refuse_foreign_globals(handle, _names(ours), f"{path}: refused to load")
            with torch.serialization.safe_globals(ours):
                return torch.load(handle, weights_only=True, map_location="cpu")
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
ALTERED = "the checkpoint was altered; resume from another one or move it away"


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
    file replaced in ``folder`` after the check is therefore never unpickled. Every item must be
    stored in a plain file of the folder (:func:`_checked_folder`). The folder is removed on exit."""
    source = Path(folder).resolve()
    staging = Path(tempfile.mkdtemp(prefix="nemo_dapo_checked_"))
    try:
        files, metadata = _checked_folder(source)
        _stage_byte_items(source, metadata, staging / CHECKED_ITEMS)
        (staging / ".metadata").write_bytes(pickle.dumps(metadata))
        for entry in files:
            if entry.suffix == ".distcp":
                (staging / entry.name).symlink_to(entry)
            else:
                (staging / entry.name).write_bytes(_checked_plain_file(entry))
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
        files, metadata = _checked_folder(source)
        for _ in _checked_byte_items(source, metadata):
            pass
        for entry in files:
            if entry.suffix != ".distcp":
                _checked_plain_file(entry)
    except UnsafeCheckpointFile:
        raise
    except Exception:  # damage, not danger: not this check's to report
        return


def _checked_folder(source: Path) -> tuple[list[Path], Any]:
    """The folder's plain files (``.metadata`` aside) and its parsed metadata, each item of which
    is stored in one of those files: a storage path elsewhere (absolute, with ``..`` or a folder,
    naming a link, a FIFO or a device) would make the load read another checkpoint's tensors, or
    wait forever on a FIFO; it is refused, naming the item, before any item is read."""
    files = _plain_files(source)
    metadata = _read_metadata(source / ".metadata")
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise UnsafeCheckpointFile(f"{source / '.metadata'}: no storage record of its items; {ALTERED}")
    names = {entry.name for entry in files}
    for index, info in storage.items():
        where = getattr(info, "relative_path", None)
        if not isinstance(where, str) or where not in names:
            raise UnsafeCheckpointFile(
                f"{source / '.metadata'}: item {getattr(index, 'fqn', index)} is stored at {where!r}, not in a plain "
                f"file of the checkpoint folder, where a checkpoint nemo-dapo wrote stores all its items; {ALTERED}"
            )
    return files, metadata


def _plain_files(source: Path) -> list[Path]:
    """The folder's files other than ``.metadata``; anything else (a link, a folder) is refused."""
    files = []
    for entry in sorted(source.iterdir()):
        if entry.name == ".metadata":
            continue
        if not entry.is_file() or entry.is_symlink():
            raise UnsafeCheckpointFile(f"{entry}: not a plain file (a checkpoint nemo-dapo writes none); {ALTERED}")
        files.append(entry)
    return files


def _read_plain(path: Path, offset: int = 0, length: int = -1) -> bytes:
    """Bytes of a file of the checkpoint, which is read only if it is still a plain file (not a
    link or a FIFO put in its place after the folder was listed)."""
    try:
        fd = open_plain(path, os.O_RDONLY)
    except NotPlainFile as err:
        raise UnsafeCheckpointFile(f"{err}; {ALTERED}") from None
    with os.fdopen(fd, "rb") as handle:
        handle.seek(offset)
        return handle.read(length)


def _checked_plain_file(entry: Path) -> bytes:
    """A small file of the folder, read once; a ``.pt`` there (megatron-core's ``common.pt``,
    which it loads with ``weights_only=True`` under its own additions to torch's list) may name
    nothing beyond torch's list (:func:`refuse_foreign_globals`)."""
    data = _read_plain(entry)
    if entry.suffix == ".pt":
        refuse_foreign_globals(io.BytesIO(data), set(), f"{entry}: refused to load")
    return data


def _read_metadata(path: Path) -> Any:
    try:
        return _MetadataUnpickler(io.BytesIO(_read_plain(path))).load()
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointFile(
            f"{path}: refused to load: {err}; a checkpoint nemo-dapo wrote holds only torch's checkpoint "
            f"classes there: {ALTERED}"
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
        data = _read_plain(source / info.relative_path, info.offset, info.length)
        try:
            where = f"{source / info.relative_path}: refused to load its item {index.fqn}"
            refuse_foreign_globals(io.BytesIO(data), set(), where)
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointFile(
                f"{source / info.relative_path}: refused to load its item {index.fqn}: it holds Python objects "
                f"whose loading could run code ({str(err).strip().splitlines()[0][:200]}); {ALTERED}"
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
