"""Batches and settings the policy-worker tests share: random token rows shaped as the trainer
builds them, the training fields an update reads, the optimizer settings, a worker's exported
weights, and a scored RolloutBatch with truncated rows."""

import torch

from nemo_dapo.algo.batch import RolloutBatch

LR = 1e-2
WARMUP = 2  # first step runs at lr / 2


def optim_settings():
    from nemo_dapo.config.schema_actor import OptimConfig

    return OptimConfig(lr=LR, warmup_steps=WARMUP)


def make_batch(
    seed: int = 0, rows: int = 6, prompt: int = 5, response: int = 7, vocab: int = 494, padded: bool = True
) -> dict:
    """Left-padded prompts + right-padded responses of random tokens, as the trainer builds them
    (``padded=False``: every row full length, so micro-batches keep the rows in order)."""
    gen = torch.Generator().manual_seed(seed)
    width = prompt + response
    attention = torch.ones(rows, width, dtype=torch.long)
    for row in range(rows if padded else 0):
        attention[row, : int(torch.randint(0, prompt - 1, (1,), generator=gen))] = 0
        attention[row, width - int(torch.randint(0, response - 1, (1,), generator=gen)) :] = 0
    ids = torch.randint(3, vocab, (rows, width), generator=gen) * attention
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
        "responses": ids[:, prompt:],
        "loss_mask": attention[:, prompt:],
    }


def add_training_fields(batch: dict, old_log_probs: torch.Tensor) -> dict:
    rows = batch["input_ids"].shape[0]
    return {
        **batch,
        "old_log_probs": old_log_probs,
        "advantages": torch.linspace(-1, 1, rows)[:, None] * batch["loss_mask"],
    }


def exported(worker, bucket_bytes: int = 1 << 30) -> dict:
    """This rank's share of the exported HF weights."""
    return {name: tensor for bucket in worker.export_weights(bucket_bytes) for name, tensor in bucket}


REASONS = ["stop", "length", "stop", "stop", "length", "stop"]  # 3 prompts x 2 samples


def rollout_batch(rows=None) -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 494, (6, 4), generator=gen)
    responses = torch.randint(3, 494, (6, 6), generator=gen)
    response_mask = (torch.arange(6)[None, :] < torch.tensor([6, 6, 2, 4, 6, 3])[:, None]).long()
    batch = RolloutBatch(
        {
            "prompts": prompts,
            "prompt_mask": torch.ones_like(prompts),
            "responses": responses * response_mask,
            "response_mask": response_mask,
            "loss_mask": response_mask.clone(),
            "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])[:, None] * response_mask,
        },
        {"uid": ["a", "a", "b", "b", "c", "c"], "finish_reason": list(REASONS)},
    )
    return batch if rows is None else batch.select(rows)
