"""The ``algorithm`` section of the schema: advantages, KL, dynamic sampling, rollout correction,
overlong filtering (docs/algorithm.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nemo_dapo.algo.advantage import registered_estimators
from nemo_dapo.algo.kl import KL_PENALTY_NAMES
from nemo_dapo.config.declare import section, setting


@dataclass
class KLControlConfig:
    type: str = setting(
        "fixed",
        choices=("fixed", "adaptive"),
        help="KL-in-reward coefficient: fixed, or adaptive (steered towards target_kl, Ziegler et al. 2019).",
    )
    kl_coef: float = setting(0.001, help="KL-in-reward coefficient (the starting value when adaptive).")
    horizon: int = setting(10000, help="Adaptive controller: samples over which the coefficient moves by at most 20%.")
    target_kl: float = setting(0.1, help="Adaptive controller: the KL per token it steers towards.")


@dataclass
class FilterGroupsConfig:
    enable: bool = setting(
        False,
        help="DAPO's dynamic sampling: drop groups whose samples all score the same "
        "(zero advantage, no gradient) and generate more rounds until train_batch_size groups "
        "remain.",
    )
    metric: str = setting(
        "acc",
        help="Per-sample value whose spread decides if a group is kept: acc, score, seq_reward (the sum "
        "of the token scores, overlong shaping included), seq_final_reward (the same: the filter runs "
        "before a KL-in-reward term exists, so it is refused with use_kl_in_reward), or any extra field "
        "the reward returns (e.g. overlong_reward).",
    )
    max_num_gen_batches: int = setting(
        10,
        help="Most generation rounds per step before the run fails (the "
        "error says how many groups were kept); <= 0: unbounded.",
    )
    carry_over: Optional[bool] = setting(
        None,
        help="Keep the kept groups beyond train_batch_size for the next step instead of dropping them "
        "(stream: the groups finished beyond the batch when a step takes it). null: the mode's way: "
        "dropped in sync, kept in stream, where groups finish one by one and the next batch starts with them "
        "(made true or false when the config loads).",
    )


@dataclass
class RolloutCorrectionConfig:
    """Training on rollouts the engine sampled with slightly different numerics (or an older policy).

    Unset (null) fields take the preset's value, or the plain default without a preset.
    """

    preset: Optional[str] = setting(
        None,
        help="Named combination: decoupled_token_is, decoupled_seq_is, "
        "decoupled_geo_rs, bypass_pg_is, ... (nemo_dapo/algo/correction.py). Fields set "
        "beside it override it.",
    )
    rollout_is: Optional[str] = setting(
        None,
        choices=("none", "token", "sequence"),
        help="Importance weights pi_old/pi_rollout, truncated and detached, per token "
        "or per sequence (product over tokens). none: off.",
    )
    rollout_is_threshold: Optional[float] = setting(None, help="Upper truncation of the IS weights (default 2.0).")
    rollout_is_batch_normalize: Optional[bool] = setting(
        None, help="Rescale the IS weights to mean 1 over the batch's valid tokens."
    )
    rollout_rs: Optional[str] = setting(
        None,
        help="Rejection sampling: comma list of <level>_<stat> with level in "
        "token, seq_sum, seq_mean, seq_max and stat in k1, k2, k3, e.g. seq_mean_k1 "
        "(masks samples whose rollout/old divergence is out of bounds).",
    )
    rollout_rs_threshold: Optional[str] = setting(
        None,
        help="One bound per rollout_rs mode: 'lower_upper' ratio "
        "range for k1 (e.g. 0.999_1.001), an upper bound for k2/k3.",
    )
    bypass_mode: Optional[bool] = setting(
        None, help="Skip the old-log-prob pass: the rollout's log-probs act as pi_old (one forward less per step)."
    )
    loss_type: Optional[str] = setting(
        None,
        choices=("ppo_clip", "reinforce"),
        help="Bypass mode's loss: ppo_clip (the clipped policy loss on rollout "
        "ratios) or reinforce (IS-weighted policy gradient, needs bypass_mode).",
    )


@dataclass
class AlgorithmConfig:
    adv_estimator: str = setting(
        "grpo",
        choices=registered_estimators,
        help="Advantage estimator by registry name (@register_adv_est): grpo is the "
        "group-normalised reward (Shao et al. 2024).",
    )
    norm_adv_by_std: bool = setting(
        True, help="GRPO: divide by the group's reward std (false: Dr. GRPO's mean-only baseline, Liu et al. 2025)."
    )
    use_kl_in_reward: bool = setting(
        False,
        help="Subtract kl_ctrl.kl_coef x KL(policy || reference) from the reward per token (builds a reference model).",
    )
    kl_penalty: str = setting(
        "kl",
        choices=KL_PENALTY_NAMES,
        help="KL estimator of the in-reward penalty: kl/k1, abs, mse/k2, low_var_kl/k3, full; "
        "a '+' suffix uses the straight-through form.",
    )
    kl_ctrl: KLControlConfig = section(KLControlConfig, "Coefficient of the KL-in-reward penalty.")
    overlong_filtering: bool = setting(
        False,
        help="DAPO's overlong filtering: responses the engine stopped at "
        "data.max_response_length leave the loss and its denominators; their group "
        "keeps their score for advantages and dynamic sampling.",
    )
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig, "Dynamic sampling (DAPO).")
    rollout_correction: RolloutCorrectionConfig = section(
        RolloutCorrectionConfig, "Rollout correction: IS weights and rejection sampling against the engine's log-probs."
    )
