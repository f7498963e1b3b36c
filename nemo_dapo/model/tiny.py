"""The embedded default's model: a tiny Qwen2-architecture LM, warmed up on arithmetic.

Built locally (no hub): tokenizer, random init, then a short supervised warm-up so RL starts
from a weak but non-zero policy. The result is an ordinary Hugging Face folder, cached by a
hash of everything that shapes it, so vLLM, the torch worker and Megatron all load it the
same way a real checkpoint is loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from nemo_dapo.data.records import read_records
from nemo_dapo.data.dataset import render_prompt
from nemo_dapo.data.synthetic import ArithmeticSpec, solution_text, write_arithmetic_dataset
from nemo_dapo.model.tokenizer import EOS_TOKEN, build_tokenizer, default_corpus

log = logging.getLogger(__name__)
RECIPE_VERSION = 1  # bump when the build changes in a way the spec fields do not capture


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    warmup_steps: int = 400
    warmup_batch_size: int = 64
    warmup_lr: float = 1e-3
    seed: int = 0
    task: ArithmeticSpec = field(default_factory=ArithmeticSpec)

    def digest(self) -> str:
        payload = json.dumps({"spec": asdict(self), "recipe": RECIPE_VERSION}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def _qwen2_config(tokenizer, spec: TinyModelSpec):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN), pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def _sft_examples(tokenizer, train_file: Path) -> list[tuple[list[int], int]]:
    """(prompt + answer + EOS token ids, prompt length) for every training row."""
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    examples = []
    for record in read_records(train_file):
        prompt = tokenizer.encode(render_prompt(tokenizer, record.messages), add_special_tokens=False)
        answer = tokenizer.encode(solution_text(record.ground_truth), add_special_tokens=False)
        examples.append((prompt + answer + [eos], len(prompt)))
    return examples


def _sft_batch(examples, rows, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(examples[r][0]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        tokens, prompt_len = examples[r]
        ids[i, : len(tokens)] = torch.tensor(tokens)
        labels[i, prompt_len: len(tokens)] = torch.tensor(tokens[prompt_len:])
        attention[i, : len(tokens)] = 1
    return ids, labels, attention


def warm_up(model, tokenizer, train_file: Path, spec: TinyModelSpec) -> float:
    """Supervised steps on (prompt, ``Answer: N``) pairs; loss only on the answer. Returns the last loss."""
    examples = _sft_examples(tokenizer, train_file)
    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.warmup_lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(spec.warmup_steps):
        rows = torch.randint(len(examples), (spec.warmup_batch_size,), generator=generator).tolist()
        ids, labels, attention = _sft_batch(examples, rows, tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0:
            log.info("warm-up step %d/%d loss %.3f", step, spec.warmup_steps, loss.item())
    model.eval()
    return loss.item()


def build_tiny_model(output_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Build tokenizer, data and warmed-up model into ``output_dir`` (HF folder + data/)."""
    from transformers import Qwen2ForCausalLM

    output_dir = Path(output_dir)
    data = write_arithmetic_dataset(output_dir / "data", spec.task)
    tokenizer = build_tokenizer(output_dir, corpus=default_corpus(seed=spec.seed))
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(_qwen2_config(tokenizer, spec))
    final_loss = warm_up(model, tokenizer, data["train"], spec)
    model.save_pretrained(output_dir)
    (output_dir / "tiny_spec.json").write_text(json.dumps({**asdict(spec), "final_warmup_loss": final_loss}, indent=1))
    return output_dir


def default_cache_dir() -> Path:
    return Path(os.environ.get("NEMO_DAPO_CACHE", Path.home() / ".cache" / "nemo_dapo"))


def ensure_tiny_model(spec: TinyModelSpec = TinyModelSpec(), cache_dir: str | Path | None = None) -> Path:
    """The cached tiny model folder, built once (atomically: temp folder, then rename)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-qwen2-{spec.digest()}"
    if (target / "model.safetensors").exists():
        return target
    staging = root / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    log.info("building the tiny model into %s (cached for later runs)", target)
    build_tiny_model(staging, spec)
    try:
        staging.rename(target)
    except OSError:  # another process won the race: use its copy
        shutil.rmtree(staging, ignore_errors=True)
    return target


TINY_MODEL = "tiny"  # model.path value that selects the embedded default model
TINY_DATA_PREFIX = "tiny:"  # data files "tiny:train" / "tiny:val": the synthetic task built with it


def resolve_builtin(model_path: str, train_files: list[str], val_files: list[str]) -> tuple[str, list[str], list[str]]:
    """Real paths for the built-in names; any other value passes through unchanged."""
    uses_tiny = model_path == TINY_MODEL or any(f.startswith(TINY_DATA_PREFIX) for f in [*train_files, *val_files])
    if not uses_tiny:
        return model_path, list(train_files), list(val_files)
    folder = ensure_tiny_model()

    def resolve(name: str) -> str:
        return str(folder / "data" / f"{name[len(TINY_DATA_PREFIX):]}.parquet") if name.startswith(TINY_DATA_PREFIX) else name

    model = str(folder) if model_path == TINY_MODEL else model_path
    return model, [resolve(f) for f in train_files], [resolve(f) for f in val_files]
