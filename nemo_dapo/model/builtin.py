"""Built-in model names (``model.path: tiny``, ``model.path: smollm2-135m-instruct``) and the task
data built with each (``data.train_files: ["<name>:train"]``), resolved to local folders.

Each built-in is made on this machine from what the project's install step brought (no model
hub), cached by a hash of its recipe, and is an ordinary Hugging Face folder afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from nemo_dapo.errors import InputError
from nemo_dapo.model.smollm2 import SMOLLM2, SMOLLM2_ARITH, ensure_smollm2, ensure_smollm2_arith
from nemo_dapo.model.tiny import ensure_tiny_model

TINY_MODEL = "tiny"
BUILTIN_MODELS: dict[str, Callable[[], Path]] = {
    TINY_MODEL: ensure_tiny_model,
    SMOLLM2: ensure_smollm2,
    SMOLLM2_ARITH: ensure_smollm2_arith,
}


def _builtin_data(name: str) -> tuple[str, str] | None:
    """(model, split) of a ``<model>:<split>`` data name, None for a path."""
    model, sep, split = name.partition(":")
    return (model, split) if sep and model in BUILTIN_MODELS else None


def resolve_builtin(model_path: str, train_files: list[str], val_files: list[str]) -> tuple[str, list[str], list[str]]:
    """Real paths for the built-in names (building them once); any other value passes through."""
    folders: dict[str, Path] = {}

    def folder(model: str) -> Path:
        if model not in folders:
            folders[model] = BUILTIN_MODELS[model]()
        return folders[model]

    def resolve(name: str) -> str:
        builtin = _builtin_data(name)
        return name if builtin is None else str(folder(builtin[0]) / "data" / f"{builtin[1]}.parquet")

    model = str(folder(model_path)) if model_path in BUILTIN_MODELS else model_path
    if not Path(model, "config.json").is_file():
        raise InputError(
            f"model.path={model_path}: not a model folder here (no config.json) and not a built-in "
            f"({', '.join(BUILTIN_MODELS)}). nemo-dapo reads models from local folders, never from a hub: "
            f"download it first (e.g. `huggingface-cli download {model_path} --local-dir /models/NAME`, on a "
            "cluster into a folder every node sees), then set model.path (HF_MODEL for the batch scripts)"
        )
    return model, [resolve(f) for f in train_files], [resolve(f) for f in val_files]
