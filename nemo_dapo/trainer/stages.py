"""The stages of a training step that run on the driver: reward, correction, advantages, metrics.

Each takes a RolloutBatch and adds fields; none rewrites another stage's fields.
"""

from __future__ import annotations

import torch

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.advantage import get_advantage_estimator
from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.correction import CorrectionSettings, apply_rollout_correction
from nemo_dapo.algo.kl import apply_kl_in_reward
from nemo_dapo.algo.metrics import data_metrics
from nemo_dapo.config.schema import Config
from nemo_dapo.reward.manager import RewardManager


def score_batch(batch: RolloutBatch, reward: RewardManager, tokenizer) -> None:
    """Decode, score, shape; adds ``token_level_scores`` and per-sample ``acc``/``score``/overlong fields."""
    mask = batch["response_mask"]
    lengths = mask.sum(dim=1)
    texts = tokenizer.batch_decode(
        [row[: int(n)].tolist() for row, n in zip(batch["responses"], lengths)], skip_special_tokens=True
    )
    result = reward.score(texts, batch["ground_truth"], batch["data_source"], lengths)
    batch.add("token_level_scores", result.token_level_rewards(mask))
    for name in ("acc", "score", "overlong_reward", "overlong"):
        batch.add(name, torch.as_tensor(result.extras[name]).tolist())
    batch.add("pred", result.extras["pred"])


def add_rewards(batch: RolloutBatch, cfg: Config, kl_controller) -> dict[str, float]:
    """Final token rewards: the scores, minus ``beta * KL`` when the KL is in the reward."""
    if not cfg.algorithm.use_kl_in_reward:
        batch.add("token_level_rewards", batch["token_level_scores"])
        return {}
    rewards, metrics = apply_kl_in_reward(
        batch["token_level_scores"],
        batch["old_log_probs"],
        batch["ref_log_probs"],
        batch["response_mask"].float(),
        kl_controller,
        cfg.algorithm.kl_penalty,
    )
    batch.add("token_level_rewards", rewards)
    return metrics


def add_overlong_filter(batch: RolloutBatch, cfg: Config) -> dict[str, float]:
    """DAPO's overlong filtering: rows the engine stopped at the length limit (finish reason
    ``length``, not a token-count guess) get an empty ``loss_mask``, so they leave the loss and every
    denominator built from it (mini-batch token and sequence counts, on every rank). Their scores
    stay: the group's advantages and dynamic sampling were computed with them."""
    if not cfg.algorithm.overlong_filtering:
        return {}
    truncated = torch.tensor([reason == "length" for reason in batch["finish_reason"]])
    batch.narrow_loss_mask(~truncated[:, None])
    return {mn.OVERLONG_FILTERED.name: float(truncated.float().mean())}


def add_stale_token_mask(batch: RolloutBatch, current_version: int, max_token_staleness: int | None) -> dict:
    """Streaming (``trainer.max_token_staleness``): tokens drawn by weights more than that many
    versions older than the policy that trains on them leave the loss and its denominators, as
    overlong filtering takes out whole rows; the rest of their sample stays."""
    if max_token_staleness is None or "token_versions" not in batch:
        return {}
    fresh = (current_version - batch["token_versions"] <= max_token_staleness).to(batch["response_mask"].dtype)
    batch.narrow_loss_mask(fresh)
    drawn = batch["response_mask"].bool()
    return {mn.STALE_TOKEN_FRACTION.name: float(1.0 - fresh[drawn].float().mean())}


def add_rollout_correction(batch: RolloutBatch, settings: CorrectionSettings) -> dict[str, float]:
    """Decoupled mode: IS weights / rejection once per batch against the recomputed old policy.

    Without any correction configured this still measures the train/rollout mismatch.
    """
    weights, kept, metrics = apply_rollout_correction(
        batch["old_log_probs"], batch["rollout_log_probs"], batch["loss_mask"].float(), settings
    )
    if weights is not None:
        batch.add("is_weights", weights)
    if settings.rollout_rs:
        batch.narrow_loss_mask(kept)
    return metrics


def add_advantages(batch: RolloutBatch, cfg: Config) -> None:
    estimator = get_advantage_estimator(cfg.algorithm.adv_estimator)
    advantages, returns = estimator(
        token_level_rewards=batch["token_level_rewards"],
        response_mask=batch["response_mask"].float(),
        group_ids=batch["uid"],
        norm_adv_by_std=cfg.algorithm.norm_adv_by_std,
    )
    batch.add("advantages", advantages)
    batch.add("returns", returns)


def batch_metrics(batch: RolloutBatch, cfg: Config) -> dict[str, float]:
    """docs/algorithm.md §9 data metrics plus accuracy and overlong shaping activity."""
    metrics = data_metrics(
        scores=batch["token_level_scores"].sum(dim=1),
        rewards=batch["token_level_rewards"].sum(dim=1),
        advantages=batch["advantages"],
        response_mask=batch["response_mask"],
        prompt_lengths=batch["prompt_mask"].sum(dim=1),
        max_response_length=cfg.data.max_response_length,
        max_prompt_length=cfg.data.max_prompt_length,
        aborted=batch["aborted"],
    )
    metrics[mn.ACC.name] = float(torch.tensor(batch["acc"], dtype=torch.float32).mean())
    metrics[mn.OVERLONG_FRACTION.name] = float(torch.tensor(batch["overlong"], dtype=torch.float32).mean())
    penalties = torch.tensor(batch["overlong_reward"], dtype=torch.float32)
    metrics[mn.OVERLONG_REWARD_MEAN.name] = float(penalties.mean())
    metrics[mn.OVERLONG_PENALISED.name] = float((penalties < 0).float().mean())
    return metrics
