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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from nemo_dapo.data.synthetic import ArithmeticSpec, write_arithmetic_dataset
from nemo_dapo.model.cache import cached_build
from nemo_dapo.model.tokenizer import EOS_TOKEN, build_tokenizer, default_corpus
from nemo_dapo.model.warmup import WarmupSpec, warm_up

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
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def build_tiny_model(output_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Build tokenizer, data and warmed-up model into ``output_dir`` (HF folder + data/)."""
    from transformers import Qwen2ForCausalLM

    output_dir = Path(output_dir)
    data = write_arithmetic_dataset(output_dir / "data", spec.task)
    tokenizer = build_tokenizer(output_dir, corpus=default_corpus(seed=spec.seed))
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(_qwen2_config(tokenizer, spec))
    final_loss = warm_up(
        model,
        tokenizer,
        data["train"],
        WarmupSpec(spec.warmup_steps, spec.warmup_batch_size, spec.warmup_lr, spec.seed),
    )
    model.save_pretrained(output_dir)
    (output_dir / "tiny_spec.json").write_text(json.dumps({**asdict(spec), "final_warmup_loss": final_loss}, indent=1))
    return output_dir


def ensure_tiny_model(spec: TinyModelSpec = TinyModelSpec(), cache_dir: str | Path | None = None) -> Path:
    """The cached tiny model folder, built once."""
    return cached_build(f"tiny-qwen2-{spec.digest()}", lambda staging: build_tiny_model(staging, spec), cache_dir)
