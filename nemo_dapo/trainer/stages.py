"""The stages of a training step that run on the driver: reward, correction, advantages, metrics.

Each takes a RolloutBatch and adds fields; none rewrites another stage's fields.
"""

from __future__ import annotations

import torch

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.advantage import get_advantage_estimator
from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.correction import CorrectionSettings, apply_rollout_correction, mismatch_metrics
from nemo_dapo.algo.kl import apply_kl_in_reward
from nemo_dapo.algo.metrics import data_metrics
from nemo_dapo.config.schema import Config
from nemo_dapo.policy.inputs import loss_mask, mini_batch_rows
from nemo_dapo.policy.routing import ROUTED_EXPERTS, split_routing
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
    batch.add("loss_mask", batch["response_mask"] * (~truncated).to(batch["response_mask"].dtype)[:, None])
    return {mn.OVERLONG_FILTERED.name: float(truncated.float().mean())}


def add_old_log_prob_extras(batch: RolloutBatch, out: dict[str, torch.Tensor]) -> dict[str, float]:
    """MoE routing replay's part of the old_log_prob pass (docs/moe.md): r2's recorded routing
    joins the batch for the update to replay; r3's log-probs under the trainer's own routing
    measure the mismatch replay removed (``rollout_corr/no_replay/*``)."""
    if ROUTED_EXPERTS in out:
        for name, half in split_routing(out[ROUTED_EXPERTS], batch["prompts"].shape[1]).items():
            batch.add(name, half)
    if "own_log_probs" not in out:
        return {}
    own = mismatch_metrics(out["own_log_probs"], batch["rollout_log_probs"], loss_mask(batch).float())
    return {mn.NO_REPLAY_PREFIX + name.removeprefix("rollout_corr/"): value for name, value in own.items()}


def rows_scored_by_update(batch: RolloutBatch, cfg: Config, correction: CorrectionSettings) -> torch.Tensor | None:
    """The rows whose old log-probs the update's first forward gives (``actor.old_log_prob_from_forward``),
    or None where that would not be exact.

    The first optimizer step of a batch runs its forward on the weights the old_log_prob pass
    would use, so the log-probs it computes are the old ones. Nothing may read them earlier: a
    second epoch, the KL in the reward, IS weights and rejection sampling (applied before the
    loss), MoE routing replay (r2 records its routing in that pass) all keep the separate pass.
    """
    exact = (
        cfg.actor.old_log_prob_from_forward
        and cfg.actor.ppo_epochs == 1
        and not correction.bypass_mode
        and not cfg.algorithm.use_kl_in_reward
        and not (correction.rollout_is or correction.rollout_rs)
        and cfg.actor.megatron.router_replay == "none"
    )
    return mini_batch_rows(batch, cfg.actor.ppo_mini_batch_size)[0] if exact else None


# The batch fields of the old policy's scores, and the keys a log-prob pass returns them under.
OLD_POLICY_FIELDS = {"old_log_probs": "log_probs", "old_entropy": "entropy"}


def add_old_policy_scores(batch: RolloutBatch, scored: dict[str, torch.Tensor], rows: torch.Tensor | None) -> None:
    """``old_log_probs`` and ``old_entropy`` of the whole batch from ``scored``, the old_log_prob
    pass over ``rows`` (None: all rows); the other rows stay zero until :func:`add_forward_scores`."""
    for name, key in OLD_POLICY_FIELDS.items():
        if rows is None:
            values = scored[key]
        else:
            values = torch.zeros(batch["responses"].shape)
            if len(rows):
                values[rows] = scored[key]
        batch.add(name, values)


def add_forward_scores(batch: RolloutBatch, rows: torch.Tensor, forward: dict[str, torch.Tensor] | None) -> None:
    """The update's first forward (its ``first_forward``) fills in the old log-probs and entropy
    of its ``rows``."""
    if forward is None:
        raise RuntimeError("the policy's update returned no first_forward for rows it was to score")
    for name, key in OLD_POLICY_FIELDS.items():
        values = batch[name].clone()
        values[rows] = forward[key][:, : values.shape[1]]
        batch.add(name, values, overwrite=True)  # completes the field the old_log_prob pass began


def old_policy_metrics(batch: RolloutBatch, settings: CorrectionSettings) -> dict[str, float]:
    """The old policy's entropy and its gap to the engines (``rollout_corr/*``), with decoupled
    correction's weights and rejection (:func:`add_rollout_correction`)."""
    mask = batch["response_mask"]
    entropy = float((batch["old_entropy"] * mask).sum() / mask.sum().clamp(min=1))
    return {mn.ENTROPY_OLD.name: entropy, **add_rollout_correction(batch, settings)}


def add_rollout_correction(batch: RolloutBatch, settings: CorrectionSettings) -> dict[str, float]:
    """Decoupled mode: IS weights / rejection once per batch against the recomputed old policy.

    Without any correction configured this still measures the train/rollout mismatch.
    """
    weights, kept, metrics = apply_rollout_correction(
        batch["old_log_probs"], batch["rollout_log_probs"], loss_mask(batch).float(), settings
    )
    if weights is not None:
        batch.add("is_weights", weights)
    if settings.rollout_rs:  # narrows the overlong filter's mask when both are on
        batch.add("loss_mask", kept.long(), overwrite=True)
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
