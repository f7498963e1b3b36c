"""A servable Hugging Face folder from a checkpoint (``nemo-dapo export``, and every run's
``hf_export`` at its end).

The weights are the checkpoint's HF copy, the tokenizer files come from the model folder. An
export is written to a staging folder and moved into place, replacing the weight files of an
earlier model in the folder (``folders.place_model``); other files stay. A record naming the checkpoint is
written last: a folder without it holds no complete export (a run found finished exports again).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from nemo_dapo.folders import check_target, place_model
from nemo_dapo.trainer.checkpoint import verify

EXPORT_RECORD = "nemo_dapo_export.json"  # {"checkpoint": <the folder exported>}, written last
TOKENIZER_FILES = ("chat_template.jinja", "special_tokens_map.json")  # besides tokenizer*


def export_hf(
    checkpoint: str | Path, tokenizer_source: str | Path, output_dir: str | Path, overwrite: bool = False
) -> Path:
    """Export ``checkpoint`` into ``output_dir``. A non-empty ``output_dir`` is refused unless
    ``overwrite``, which replaces the weights and the files written, and keeps the others."""
    output_dir = Path(output_dir)
    check_target(output_dir, overwrite, "the exported model")
    checkpoint = verify(checkpoint)
    staging = output_dir.parent / f".{output_dir.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(checkpoint / "policy" / "model", staging)
    for source in Path(tokenizer_source).iterdir():
        if source.is_file() and (source.name.startswith("tokenizer") or source.name in TOKENIZER_FILES):
            shutil.copy2(source, staging / source.name)
    (output_dir / EXPORT_RECORD).unlink(missing_ok=True)  # complete again once the record is back
    place_model(staging, output_dir)
    record = output_dir / f".{EXPORT_RECORD}.tmp"
    record.write_text(json.dumps({"checkpoint": str(checkpoint.resolve())}))
    os.replace(record, output_dir / EXPORT_RECORD)
    return output_dir


def exported_from(folder: Path) -> Path | None:
    """The checkpoint a complete export in ``folder`` was made from; None when there is none."""
    try:
        return Path(json.loads((folder / EXPORT_RECORD).read_text())["checkpoint"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
