"""Every metric the trainer logs, written once, with how its parts combine and what it means.

Names stay verl's where verl has the quantity (users' dashboards depend on them). A name with
``{...}`` is a family (``timing_s/{stage}``); :meth:`Metric.of` fills it in. ``reduce`` says
how the parts of one value combine: ``SUM`` for a value each part holds a share of (a
micro-batch's or a data-parallel replica's share of the mini-batch loss), ``MAX`` / ``MIN``
for extremes, ``MEAN`` otherwise. Values of several optimizer steps or local updates are
averaged, except extremes. ``docs/monitoring.md`` lists this catalog (a test keeps it fresh,
another checks that a real run logs nothing outside it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache

import torch


class Reduce(str, Enum):
    MEAN = "mean"
    SUM = "sum"
    MAX = "max"
    MIN = "min"


@dataclass(frozen=True)
class Metric:
    name: str
    reduce: Reduce
    help: str
    pattern: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        regex = re.sub(r"\\\{[a-z_]+\\\}", r".+?", re.escape(self.name))
        object.__setattr__(self, "pattern", re.compile(f"^{regex}$"))

    def of(self, **parts: object) -> str:
        """The name of one member of a family: ``TIMING_S.of(stage="gen")`` -> ``timing_s/gen``."""
        return self.name.format(**parts)


CATALOG: list[Metric] = []


def metric(name: str, reduce: Reduce, help: str) -> Metric:
    declared = Metric(name, reduce, help)
    CATALOG.append(declared)
    return declared


def stats(prefix: str, help: str) -> dict[str, Metric]:
    """``<prefix>/mean``, ``/max`` and ``/min`` of a per-sample quantity."""
    return {
        "mean": metric(f"{prefix}/mean", Reduce.MEAN, f"{help}: mean"),
        "max": metric(f"{prefix}/max", Reduce.MAX, f"{help}: max"),
        "min": metric(f"{prefix}/min", Reduce.MIN, f"{help}: min"),
    }


# ---- the policy update (per optimizer step, then averaged over the step's optimizer steps)
PG_LOSS = metric("actor/pg_loss", Reduce.SUM, "policy loss (docs/algorithm.md §1-2)")
ENTROPY = metric("actor/entropy", Reduce.SUM, "entropy aggregated like the loss")
KL_LOSS = metric("actor/kl_loss", Reduce.SUM, "KL(policy || reference) aggregated like the loss")
ENTROPY_TOKEN_MEAN = metric("actor/entropy_token_mean", Reduce.MEAN, "entropy per token")
PG_CLIPFRAC = metric("actor/pg_clipfrac", Reduce.MEAN, "fraction of tokens whose ratio was clipped")
PG_CLIPFRAC_LOWER = metric("actor/pg_clipfrac_lower", Reduce.MEAN, "fraction of tokens the dual clip capped")
PPO_KL = metric("actor/ppo_kl", Reduce.MEAN, "mean old_lp - lp over the update's tokens")
GRAD_NORM = metric("actor/grad_norm", Reduce.MEAN, "gradient norm before clipping")
SKIPPED_STEPS = metric(
    "actor/skipped_steps",
    Reduce.MEAN,
    "fraction of the optimizer steps skipped for a non-finite gradient (weights and optimizer state untouched)",
)
LR = metric("actor/lr", Reduce.MEAN, "learning rate of the optimizer step")
MOE_LOAD_BALANCING_LOSS = metric(
    "actor/moe_load_balancing_loss", Reduce.MEAN, "MoE router load-balancing loss per layer and micro-batch"
)
ENTROPY_OLD = metric("actor/entropy_old", Reduce.MEAN, "entropy of the batch under the weights that scored it")
REWARD_KL_PENALTY = metric("actor/reward_kl_penalty", Reduce.MEAN, "KL per token subtracted from the reward")
REWARD_KL_PENALTY_COEFF = metric("actor/reward_kl_penalty_coeff", Reduce.MEAN, "KL-in-reward coefficient")

# ---- the batch
SCORE = stats("critic/score", "sample score from the reward function")
REWARDS = stats("critic/rewards", "sample reward after shaping and KL")
ADVANTAGES = stats("critic/advantages", "advantage over valid response tokens")
ACC = metric("critic/acc/mean", Reduce.MEAN, "fraction of the training batch answered right")
RESPONSE_LENGTH = stats("response_length", "response tokens")
PROMPT_LENGTH = stats("prompt_length", "prompt tokens")
RESPONSE_CLIP_RATIO = metric(
    "response_length/clip_ratio", Reduce.MEAN, "fraction of responses that hit data.max_response_length"
)
PROMPT_CLIP_RATIO = metric("prompt_length/clip_ratio", Reduce.MEAN, "fraction of prompts at data.max_prompt_length")
ABORTED_RATIO = metric("response/aborted_ratio", Reduce.MEAN, "fraction of samples the engine aborted")
OVERLONG_FRACTION = metric("overlong/fraction", Reduce.MEAN, "fraction of samples inside the overlong buffer")
OVERLONG_REWARD_MEAN = metric("overlong/reward_mean", Reduce.MEAN, "mean soft overlong punishment")
OVERLONG_PENALISED = metric("overlong/penalised_fraction", Reduce.MEAN, "fraction of samples punished")
OVERLONG_FILTERED = metric(
    "overlong/filtered_fraction", Reduce.MEAN, "fraction of samples overlong filtering took out of the loss"
)
GENERATED_SAMPLES = metric("rollout/generated_samples", Reduce.MAX, "samples generated since the start (cumulative)")

# ---- dynamic sampling (docs/algorithm.md §6)
NUM_GEN_BATCHES = metric("dapo/num_gen_batches", Reduce.MEAN, "generation rounds this step needed")
KEPT_GROUP_FRACTION = metric("dapo/kept_group_fraction", Reduce.MEAN, "fraction of generated groups kept")
CARRIED_IN_GROUPS = metric("dapo/carried_in_groups", Reduce.MEAN, "groups carried over from the previous step")
SURPLUS_GROUPS = metric("dapo/surplus_groups", Reduce.MEAN, "kept groups beyond the batch")
ROUND_KEPT_FRACTION = metric("dapo/round_{round}_kept_fraction", Reduce.MEAN, "fraction kept in each round")

# ---- rollout correction (docs/algorithm.md §7)
IS_WEIGHT = {  # verl's names: is_weight_mean, not is_weight/mean
    "mean": metric("rollout_corr/is_weight_mean", Reduce.MEAN, "truncated importance weight: mean"),
    "max": metric("rollout_corr/is_weight_max", Reduce.MAX, "truncated importance weight: max"),
    "min": metric("rollout_corr/is_weight_min", Reduce.MIN, "truncated importance weight: min"),
}
IS_TRUNCATED = metric("rollout_corr/is_truncated_fraction", Reduce.MEAN, "fraction of weights truncated")
RS_MODE_REJECTED = metric(
    "rollout_corr/rs_{mode}_rejected_fraction", Reduce.MEAN, "fraction rejected by one rejection-sampling mode"
)
RS_REJECTED = metric("rollout_corr/rejected_fraction", Reduce.MEAN, "fraction rejected by rejection sampling")
LOGPROB_DIFF_MEAN = metric("rollout_corr/logprob_abs_diff_mean", Reduce.MEAN, "|rollout_lp - old_lp| per token")
LOGPROB_DIFF_MAX = metric("rollout_corr/logprob_abs_diff_max", Reduce.MAX, "largest |rollout_lp - old_lp|")
ROLLOUT_KL_K1 = metric("rollout_corr/kl_k1", Reduce.MEAN, "k1 estimate of KL(engine || trainer)")
ROLLOUT_KL_K3 = metric("rollout_corr/kl_k3", Reduce.MEAN, "k3 estimate of KL(engine || trainer)")
NO_REPLAY_PREFIX = "rollout_corr/no_replay/"  # the same mismatch under the trainer's own MoE routing (r3)
NO_REPLAY_MISMATCH = [
    metric(NO_REPLAY_PREFIX + m.name.removeprefix("rollout_corr/"), m.reduce, m.help + ", trainer's own MoE routing")
    for m in (LOGPROB_DIFF_MEAN, LOGPROB_DIFF_MAX, ROLLOUT_KL_K1, ROLLOUT_KL_K3)
]

# ---- MoE routing replay (docs/moe.md)
ROUTER_AGREEMENT = {
    "mean": metric(
        "moe/router_agreement/mean",
        Reduce.MEAN,
        "share of the replayed top-k experts the trainer's router also picks, mean over MoE layers",
    ),
    "min": metric("moe/router_agreement/min", Reduce.MIN, "the same, its lowest MoE layer"),
}

# ---- off-policy samples (the streaming trainer)
STALENESS_LAG = stats("staleness/lag", "policy versions a trained sample lags behind")
DROPPED_STALE = metric("staleness/dropped_stale", Reduce.MAX, "stream: groups dropped as too stale (cumulative)")
REISSUED_PROMPTS = metric(
    "recovery/reissued_prompts",
    Reduce.MAX,
    "stream: prompts reissued after the last restore, a replaced engine or a stale drop",
)

# ---- streaming trainer (docs/architecture.md, "Streaming generation")
TOKEN_LAG = stats("staleness/token_lag", "policy versions a trained token lags behind the policy it trains")
PARTIAL_SHARE = metric(
    "stream/partial_share", Reduce.MEAN, "fraction of trained samples whose tokens span two or more weight versions"
)
STALE_TOKEN_FRACTION = metric(
    "stream/stale_token_fraction", Reduce.MEAN, "fraction of trained tokens trainer.max_token_staleness masked"
)
SAMPLES_IN_FLIGHT = metric("stream/samples_in_flight", Reduce.MEAN, "samples running in the engines at the step's end")
GROUPS_QUEUED = metric(
    "stream/groups_queued", Reduce.MEAN, "groups sent to the engines and waiting for a slot (rollout.max_inflight)"
)
ENGINE_BUSY = metric("stream/engine_busy", Reduce.MEAN, "fraction of the step's wall time the engines spent stepping")
ENGINE_STARVED = metric(
    "stream/engine_starved",
    Reduce.MEAN,
    "fraction of the step's wall time the engines held no sample (mostly: admission closed by the staleness bound)",
)
TRAINER_IDLE = metric("stream/trainer_idle", Reduce.MEAN, "fraction of the step the trainer waited for groups")
GEN_TOKENS_PER_S = metric("stream/gen_tokens_per_s", Reduce.MEAN, "response tokens the engines finished per second")
FILTERED_IN_STREAM = metric(
    "stream/filtered_groups", Reduce.MAX, "groups dynamic sampling dropped as they arrived (cumulative)"
)
ENGINE_RESTARTS = metric(
    "recovery/engine_restarts", Reduce.MAX, "rollout engines replaced after dying or hanging (cumulative, this run)"
)
ENGINES_IN_SERVICE = metric(
    "recovery/engines", Reduce.MIN, "rollout engines in service after the step (fewer while a rollout node is lost)"
)

# ---- time and throughput
TIMING_S = metric("timing_s/{stage}", Reduce.MEAN, "seconds of one stage of the step")
TIMING_PER_TOKEN_MS = metric(
    "timing_per_token_ms/{stage}", Reduce.MEAN, "ms per token of a stage (gen: response tokens; else all)"
)
TOTAL_NUM_TOKENS = metric("perf/total_num_tokens", Reduce.MEAN, "prompt + response tokens of the step")
TIME_PER_STEP = metric("perf/time_per_step", Reduce.MEAN, "seconds of the step")
THROUGHPUT = metric("perf/throughput", Reduce.MEAN, "tokens per second per device (per process on CPU)")
WEIGHT_SYNC_MB = metric(
    "perf/weight_sync_mb",
    Reduce.MEAN,
    "MiB the exporting training ranks broadcast to the engines in the step's weight sync "
    "(rollout.weight_transfer gloo or nccl; every worker of every engine receives all of it)",
)
RANK_INPUT_MB = metric(
    "perf/rank_input_mb/{call}",
    Reduce.MAX,
    "MiB of batch one training rank received for the call (the largest rank's; the ranks of a replica share one copy)",
)

# ---- validation (docs/algorithm.md §12)
VAL_ACC = metric("val-core/{source}/acc/mean@{n}", Reduce.MEAN, "held-out accuracy averaged over n samples")
EVAL_ACC = Metric("eval/{source}/acc/mean@{n}", Reduce.MEAN, "`nemo-dapo eval`'s accuracy (printed, not logged)")
VAL_PASS = metric("val-aux/{source}/pass@{k}", Reduce.MEAN, "unbiased pass@k on held-out problems")


def catalog_markdown() -> str:
    """The catalog as the table of docs/monitoring.md (``nemo-dapo metrics`` prints it)."""
    rows = ["| metric | parts combine by | what |", "| --- | --- | --- |"]
    rows += [f"| `{m.name}` | {m.reduce.value} | {m.help} |" for m in CATALOG]
    return "\n".join(rows) + "\n"


@lru_cache(maxsize=4096)
def find(name: str) -> Metric | None:
    """The catalog entry of a logged name, None for a name the catalog does not know."""
    return next((m for m in CATALOG if m.pattern.match(name)), None)


def reduction(name: str) -> Reduce:
    """How parts of ``name`` combine. A name outside the catalog (a user's loss metric) is an
    extreme if its last part says max or min, else averaged."""
    known = find(name)
    if known:
        return known.reduce
    leaf = name.rsplit("/", 1)[-1]
    return Reduce.MAX if "max" in leaf else Reduce.MIN if "min" in leaf else Reduce.MEAN


def combine_parts(name: str, values: Sequence[float]) -> float:
    """One value from its parts (micro-batches of a step, replicas of a mini-batch)."""
    tensor = torch.as_tensor([float(v) for v in values], dtype=torch.float64)
    how = reduction(name)
    if how is Reduce.SUM:
        return tensor.sum().item()
    if how is Reduce.MAX:
        return tensor.max().item()
    if how is Reduce.MIN:
        return tensor.min().item()
    return tensor.mean().item()


def combine_steps(metric_lists: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """One value per name from several optimizer steps or local updates: extremes stay extremes,
    everything else is averaged (a SUM metric is whole within each step)."""
    reduced = {}
    for name, values in metric_lists.items():
        if len(values) == 0:
            continue
        if reduction(name) in (Reduce.MAX, Reduce.MIN):
            reduced[name] = combine_parts(name, values)
        else:
            reduced[name] = math.fsum(float(v) for v in values) / len(values)
    return reduced
