"""A servable Hugging Face folder from a checkpoint (``nemo-dapo export``, and every run's
``hf_export`` at its end).

The weights are the checkpoint's HF copy, the tokenizer files come from the model folder. An
export is written to a new staging folder and moved into place, replacing the weight files of an
earlier model in the folder (``folders.place_model``); other files stay. A record naming the checkpoint is
written last: a folder without it holds no complete export (a run found finished exports again).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

from nemo_dapo.config import ConfigError, from_yaml
from nemo_dapo.folders import NotPlainFile, check_target, open_plain, place_model, replace_file
from nemo_dapo.trainer.assembly import resolve_paths
from nemo_dapo.trainer.checkpoint import CheckpointError, verify

EXPORT_RECORD = "nemo_dapo_export.json"  # {"checkpoint": <the folder exported>}, written last
TOKENIZER_FILES = ("chat_template.jinja", "special_tokens_map.json")  # besides tokenizer*
HF_WEIGHTS = ("policy", "model")  # where in a checkpoint its Hugging Face copy of the weights is
COPY_CHUNK = 16 << 20
CONFIG = "config.yaml"  # the run's resolved config, in every checkpoint
GIVE_TOKENIZER = "the export copies: or give that model's folder with --tokenizer"


def export_hf(
    checkpoint: str | Path, tokenizer_source: str | Path, output_dir: str | Path, overwrite: bool = False
) -> Path:
    """Export ``checkpoint`` into ``output_dir``. A non-empty ``output_dir`` is refused unless
    ``overwrite``, which replaces the weights and the files written, and keeps the others."""
    output_dir = Path(output_dir)
    check_target(output_dir, overwrite, "the exported model")
    checkpoint = verify(checkpoint)
    staging = output_dir.parent / f".{output_dir.name}.{secrets.token_hex(4)}.tmp"
    staging.mkdir()  # a new folder (never one a link planted at a known name points to)
    try:
        copy_weights(checkpoint, staging)
        for source in Path(tokenizer_source).iterdir():  # the user's model folder: its links are followed
            if source.is_file() and (source.name.startswith("tokenizer") or source.name in TOKENIZER_FILES):
                shutil.copy2(source, staging / source.name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    (output_dir / EXPORT_RECORD).unlink(missing_ok=True)  # complete again once the record is back
    place_model(staging, output_dir)
    replace_file(output_dir / EXPORT_RECORD, json.dumps({"checkpoint": str(checkpoint.resolve())}))
    return output_dir


def base_model_of(checkpoint: str | Path) -> str:
    """The model folder of the run that wrote ``checkpoint`` (its ``config.yaml``'s ``model.path``,
    a built-in name made a path): where ``nemo-dapo export`` takes the tokenizer from. The config
    is checked against the manifest first and loaded with registry names only
    (:func:`~nemo_dapo.config.from_yaml`): nothing read from a checkpoint imports a module."""
    config = verify(checkpoint, only=[]) / CONFIG  # a sealed checkpoint (its digests: below, the config's)
    if not config.is_file():
        raise CheckpointError(f"{config}: missing; it names the base model whose tokenizer {GIVE_TOKENIZER}")
    verify(checkpoint, only=[CONFIG])
    try:
        return resolve_paths(from_yaml(config.read_text(), source=str(config))).model.path
    except ConfigError as err:
        raise ConfigError(f"{err}\n(export reads there the base model whose tokenizer {GIVE_TOKENIZER})") from None


def copy_weights(checkpoint: Path, target: Path) -> None:
    """Copy a verified checkpoint's Hugging Face weights (the plain files of ``policy/model``)
    into ``target``, following no link: each folder and file is opened relative to the one above
    it by :func:`open_plain`, so a link placed after the checkpoint was verified is refused,
    naming it, and never followed out of the checkpoint."""
    folder = os.open(checkpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    shown = checkpoint
    try:
        for part in HF_WEIGHTS:
            shown = shown / part
            inner = _open_inside(folder, part, shown, os.O_RDONLY | os.O_DIRECTORY)
            os.close(folder)
            folder = inner
        for name in sorted(os.listdir(folder)):
            source = _open_inside(folder, name, shown / name, os.O_RDONLY)
            with os.fdopen(source, "rb") as reader, open(target / name, "xb") as writer:
                shutil.copyfileobj(reader, writer, COPY_CHUNK)
    finally:
        os.close(folder)


def _open_inside(folder: int, name: str, shown: Path, flags: int) -> int:
    try:
        return open_plain(name, flags, dir_fd=folder)
    except NotPlainFile:
        raise CheckpointError(
            f"{shown}: a link, or not a {'folder' if flags & os.O_DIRECTORY else 'plain file'}: the checkpoint was "
            "changed after it was verified (it holds plain files only); export another checkpoint"
        ) from None


def exported_from(folder: Path) -> Path | None:
    """The checkpoint a complete export in ``folder`` was made from; None when there is none."""
    try:
        return Path(json.loads((folder / EXPORT_RECORD).read_text())["checkpoint"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
