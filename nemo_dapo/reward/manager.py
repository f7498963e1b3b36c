"""Batch reward: task score from a named scorer plus DAPO overlong shaping (docs/algorithm.md §5, §10).

The trainer hands over decoded responses and their token lengths; the manager returns one
float reward per sequence and the per-sample details the metrics and the dynamic-sampling
filter need (``acc``, ``pred``, the overlong penalty and the truncation flag).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nemo_dapo.algo.shaping import check_overlong_buffer, overlong_penalty
from nemo_dapo.reward.math_verify_scorer import DEFAULT_TIMEOUT_S
from nemo_dapo.reward.scorers import make_scorer


def token_level_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's score on its last valid response token (B x T, float32).

    Outcome rewards belong to the final action; every other token gets 0. A row whose mask is
    all zeros (nothing generated, or an aborted sample) gets all zeros.
    """
    if response_mask.dim() != 2 or scores.shape != response_mask.shape[:1]:
        raise ValueError(
            f"scores {tuple(scores.shape)} must be [B] and response_mask {tuple(response_mask.shape)} [B, T]"
        )
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    if response_mask.shape[1] == 0:
        return rewards
    mask = response_mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=1)
    rows = torch.nonzero(last >= 0).squeeze(1)
    rewards[rows, last[rows]] = scores.to(device=rewards.device, dtype=torch.float32)[rows]
    return rewards


@dataclass
class RewardResult:
    """Per-sequence rewards of one batch.

    ``scores``: float32 [B], task score + overlong penalty (the reward to train on).
    ``extras``: per-sample fields for metrics and filtering: ``score`` (float32 [B], same as
    ``scores``), ``acc`` (bool [B]), ``pred`` (list[str]), ``overlong_reward`` (float32 [B],
    <= 0, all 0 when shaping is off), ``overlong`` (bool [B], length >= max_response_length,
    i.e. truncated), ``timeout`` (bool [B], scorer ran out of time), ``data_source`` (list[str]).
    """

    scores: torch.Tensor
    extras: dict[str, torch.Tensor | list] = field(default_factory=dict)

    def token_level_rewards(self, response_mask: torch.Tensor) -> torch.Tensor:
        """See :func:`token_level_rewards`."""
        return token_level_rewards(self.scores, response_mask)


class RewardManager:
    """Scores batches with one named scorer and applies overlong shaping.

    Holds the scorer's resources (the math_verify process pool) across steps: create once,
    call :meth:`score` every step, :meth:`close` at the end (or use ``with``).
    """

    def __init__(
        self,
        scorer: str = "math_dapo",
        *,
        max_response_length: int,
        overlong_enable: bool = False,
        buffer_len: int = 0,
        penalty_factor: float = 1.0,
        num_workers: int = 4,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if max_response_length <= 0:
            raise ValueError(f"max_response_length={max_response_length}: must be > 0")
        if overlong_enable:
            check_overlong_buffer(max_response_length, buffer_len, penalty_factor)
        self.max_response_length = max_response_length
        self.overlong_enable = overlong_enable
        self.buffer_len = buffer_len
        self.penalty_factor = penalty_factor
        self.scorer_name = scorer
        self._scorer = make_scorer(scorer, num_workers, timeout_s)

    def score(
        self,
        responses: list[str],
        ground_truths: list[str],
        data_sources: list[str],
        response_lengths,
    ) -> RewardResult:
        """Reward each response; ``response_lengths`` counts its tokens, EOS included."""
        lengths = self._check_batch(responses, ground_truths, data_sources, response_lengths)
        samples = self._scorer.score_batch(list(responses), list(ground_truths))
        task_scores = torch.tensor([s["score"] for s in samples], dtype=torch.float32)
        penalties = self._overlong_penalties(lengths)
        scores = task_scores + penalties
        extras = {
            "score": scores.clone(),
            "acc": torch.tensor([bool(s["acc"]) for s in samples], dtype=torch.bool),
            "pred": [s["pred"] for s in samples],
            "overlong_reward": penalties,
            "overlong": lengths >= self.max_response_length,
            "timeout": torch.tensor([bool(s.get("timeout", False)) for s in samples], dtype=torch.bool),
            "data_source": list(data_sources),
        }
        return RewardResult(scores=scores, extras=extras)

    def _overlong_penalties(self, lengths: torch.Tensor) -> torch.Tensor:
        """The docs/algorithm.md §5 penalty per sequence, or zeros when shaping is off."""
        if not self.overlong_enable:
            return torch.zeros(lengths.shape, dtype=torch.float32)
        return overlong_penalty(lengths, self.max_response_length, self.buffer_len, self.penalty_factor)

    @staticmethod
    def _check_batch(responses, ground_truths, data_sources, response_lengths) -> torch.Tensor:
        """All inputs describe the same B samples; lengths become a 1-D int64 tensor."""
        lengths = torch.as_tensor(response_lengths)
        if lengths.dim() != 1:
            raise ValueError(f"response_lengths must be 1-D [B], got shape {tuple(lengths.shape)}")
        sizes = {
            "responses": len(responses),
            "ground_truths": len(ground_truths),
            "data_sources": len(data_sources),
            "response_lengths": lengths.numel(),
        }
        if len(set(sizes.values())) != 1:
            raise ValueError(f"reward inputs disagree on the batch size: {sizes}")
        if lengths.numel() and (lengths.is_floating_point() or lengths.dtype == torch.bool):
            raise TypeError(f"response_lengths must be integer token counts, got {lengths.dtype}")
        if (lengths < 0).any():
            raise ValueError("response_lengths must be >= 0")
        return lengths.to(torch.int64)

    def close(self) -> None:
        """Release the scorer's workers."""
        self._scorer.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
