"""Overlong reward shaping (DAPO, docs/algorithm.md §5).

A response that runs into the last ``buffer_len`` tokens before ``max_response_length``
is penalised linearly, so the policy learns to finish before it is cut off instead of
being scored as if truncation were a wrong answer.
"""

from __future__ import annotations

import torch


def check_overlong_buffer(max_response_length: int, buffer_len: int, penalty_factor: float) -> None:
    """Reject a buffer that cannot work: it must be positive and fit inside the response."""
    if buffer_len <= 0:
        raise ValueError(
            f"reward.overlong_buffer.len={buffer_len}: must be > 0 when the overlong buffer is enabled "
            "(disable it with reward.overlong_buffer.enable=false)"
        )
    if buffer_len > max_response_length:
        raise ValueError(
            f"reward.overlong_buffer.len={buffer_len} is longer than data.max_response_length="
            f"{max_response_length}: choose a buffer <= the response length"
        )
    if penalty_factor < 0:
        raise ValueError(f"reward.overlong_buffer.penalty_factor={penalty_factor}: must be >= 0")


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """Per-sequence penalty ``min(-(L - expected) / buffer_len * penalty_factor, 0)``.

    ``expected = max_response_length - buffer_len``; ``L`` counts response tokens (EOS included).
    The penalty is 0 up to ``expected`` and falls linearly to ``-penalty_factor`` at
    ``max_response_length``.
    """
    check_overlong_buffer(max_response_length, buffer_len, penalty_factor)
    lengths = torch.as_tensor(response_lengths, dtype=torch.float64)
    expected = max_response_length - buffer_len
    penalty = -(lengths - expected) / buffer_len * penalty_factor
    return torch.clamp(penalty, max=0.0).to(torch.float32)
