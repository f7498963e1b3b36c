"""A short supervised warm-up on (prompt, answer) pairs, so that RL starts from a policy that
knows the answer format and is sometimes right: a group of samples that are all wrong carries
no signal for a group-relative advantage, and a model that never writes ``Answer: N`` scores 0."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from nemo_dapo.data.dataset import render_prompt
from nemo_dapo.data.records import read_records
from nemo_dapo.data.synthetic import solution_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmupSpec:
    steps: int = 400
    batch_size: int = 64
    lr: float = 1e-3
    seed: int = 0
    dtype: str = "float32"  # compute precision (bfloat16: autocast over fp32 weights and optimizer)


def _sft_examples(tokenizer, train_file: Path) -> list[tuple[list[int], int]]:
    """(prompt + answer + EOS token ids, prompt length) for every training row."""
    examples = []
    for record in read_records(train_file):
        prompt = tokenizer.encode(render_prompt(tokenizer, record.messages), add_special_tokens=False)
        answer = tokenizer.encode(solution_text(record.ground_truth), add_special_tokens=False)
        examples.append((prompt + answer + [tokenizer.eos_token_id], len(prompt)))
    return examples


def _sft_batch(examples, rows, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(examples[r][0]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        tokens, prompt_len = examples[r]
        ids[i, : len(tokens)] = torch.tensor(tokens)
        labels[i, prompt_len : len(tokens)] = torch.tensor(tokens[prompt_len:])
        attention[i, : len(tokens)] = 1
    return ids, labels, attention


def warm_up(model, tokenizer, train_file: Path, spec: WarmupSpec) -> float:
    """Supervised steps on (prompt, ``Answer: N``) pairs; loss only on the answer. Returns the last loss."""
    examples = _sft_examples(tokenizer, train_file)
    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    dtype = getattr(torch, spec.dtype)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(spec.steps):
        rows = torch.randint(len(examples), (spec.batch_size,), generator=generator).tolist()
        ids, labels, attention = _sft_batch(examples, rows, tokenizer.pad_token_id)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == spec.steps - 1:
            log.info("warm-up step %d/%d loss %.3f", step + 1, spec.steps, loss.item())
    model.eval()
    return loss.item()
