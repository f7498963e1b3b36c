"""The learning-rate schedule both training backends step once per optimizer step."""

from __future__ import annotations

import math

from nemo_dapo.config.schema_actor import OptimConfig


def lr_lambda(optim: OptimConfig, total_steps: int):
    """Linear warm-up that starts at lr/warmup (never 0), then constant or cosine."""
    warmup = max(optim.warmup_steps, 0)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.lr_schedule == "constant" or total_steps <= warmup:
            return 1.0
        progress = min((step - warmup) / max(total_steps - warmup, 1), 1.0)
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
