"""Dynamic sampling: drop prompt groups that carry no learning signal (docs/algorithm.md §6).

A group whose answers all got the same metric (all right or all wrong) has zero GRPO
advantage everywhere, so it only dilutes the batch. Kept groups accumulate over generation
rounds until the batch holds ``train_batch_size`` groups.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.batch import RolloutBatch, group_rows


class DynamicSamplingExhausted(RuntimeError):
    """Raised when ``max_num_gen_batches`` rounds did not fill the batch."""


def group_keep_mask(group_ids: Sequence[Hashable], metric: torch.Tensor) -> tuple[torch.Tensor, list[Hashable]]:
    """Rows of kept groups, and the kept group ids in first-appearance order.

    A group is kept iff the population std (ddof 0) of its metric is > 0, or it has one member.
    """
    values = torch.as_tensor(metric, dtype=torch.float64)
    if values.shape[0] != len(group_ids):
        raise ValueError(f"{len(group_ids)} group ids for {values.shape[0]} metric values")
    kept = [
        gid for gid, rows in group_rows(group_ids).items() if len(rows) == 1 or values[rows].std(unbiased=False) > 0
    ]
    kept_set = set(kept)
    return torch.tensor([gid in kept_set for gid in group_ids], dtype=torch.bool), kept


def informative_rows(batch: RolloutBatch, metric: str, uid_key: str = "uid") -> tuple[torch.Tensor, list[Hashable]]:
    """The filter of every mode: rows of the groups whose ``metric`` varies (or of one member),
    and those groups' ids in first-appearance order."""
    return group_keep_mask(batch[uid_key], filter_metric(batch, metric))


def exhausted(held: int, target: int, generated: str, limit: int) -> DynamicSamplingExhausted:
    """The error of a step whose generation bound ran out before ``target`` informative groups:
    the run fails rather than train on a partial batch."""
    return DynamicSamplingExhausted(
        f"dynamic sampling held {held}/{target} informative groups after {generated} "
        f"(algorithm.filter_groups.max_num_gen_batches={limit} x data.gen_batch_size). Raise "
        "algorithm.filter_groups.max_num_gen_batches (<= 0 means unbounded), raise data.gen_batch_size, or "
        "lower data.train_batch_size; the data may also be too easy or too hard for the model (all answers "
        "right or all wrong)."
    )


def filter_metric(batch: RolloutBatch, metric: str) -> torch.Tensor:
    """The per-sequence value the filter looks at.

    ``seq_reward``: sum of token scores (shaping included); ``seq_final_reward``: the final
    reward, which is the same sum: the filter runs before the KL-in-reward term can be computed
    (it needs the old and reference log-probs of the kept rows), and the config refuses
    ``seq_final_reward`` together with ``algorithm.use_kl_in_reward``. Any other name is read from
    the batch (``acc``, ``score``, or a reward extra field).
    """
    if metric in ("seq_reward", "seq_final_reward"):
        return batch["token_level_scores"].sum(dim=-1)
    if metric not in batch:
        raise KeyError(
            f"algorithm.filter_groups.metric={metric!r} is not in the batch; available: "
            f"seq_reward, seq_final_reward, {sorted(batch.keys())}"
        )
    return torch.as_tensor([float(v) for v in batch[metric]], dtype=torch.float64)


class GroupAccumulator:
    """Collect kept groups across generation rounds until a training batch is full.

    ``max_num_gen_batches <= 0`` means unbounded. With ``carry_over`` the surplus groups of a
    full batch start the next step's batch instead of being discarded (they are then one
    policy version old; ``policy_version`` in the batch says so).
    """

    def __init__(
        self,
        target_groups: int,
        max_num_gen_batches: int = 0,
        carry_over: bool = False,
        metric: str = "acc",
        uid_key: str = "uid",
    ) -> None:
        if target_groups <= 0:
            raise ValueError(f"data.train_batch_size={target_groups}: must be > 0")
        self.target_groups = target_groups
        self.max_num_gen_batches = max_num_gen_batches
        self.carry_over = carry_over
        self.metric = metric
        self.uid_key = uid_key
        self._carried = RolloutBatch()
        self._reset_round_state()

    def _reset_round_state(self) -> None:
        self._parts: list[RolloutBatch] = [self._carried] if len(self._carried) else []
        self.num_gen_batches = 0
        self.round_kept_fractions: list[float] = []
        self.groups_seen = 0
        self.groups_kept = 0
        self.carried_in_groups = self.num_groups(self._carried)
        self.surplus_groups = 0
        self._carried = RolloutBatch()

    def num_groups(self, batch: RolloutBatch) -> int:
        return len(set(batch[self.uid_key])) if len(batch) else 0

    @property
    def held_groups(self) -> int:
        return sum(self.num_groups(p) for p in self._parts)

    def add_round(self, batch: RolloutBatch) -> None:
        """Filter one generation round and keep its informative groups."""
        keep_rows, kept = informative_rows(batch, self.metric, self.uid_key)
        total = len(group_rows(batch[self.uid_key]))
        self.num_gen_batches += 1
        self.groups_seen += total
        self.groups_kept += len(kept)
        self.round_kept_fractions.append(len(kept) / max(total, 1))
        if kept:
            self._parts.append(batch.select(torch.nonzero(keep_rows).flatten()))

    def is_full(self) -> bool:
        return self.held_groups >= self.target_groups

    def check_limit(self) -> None:
        """Fail loudly rather than train on a partial batch."""
        limit = self.max_num_gen_batches
        if limit > 0 and self.num_gen_batches >= limit and not self.is_full():
            raise exhausted(self.held_groups, self.target_groups, f"{self.num_gen_batches} generation rounds", limit)

    def pop_batch(self) -> RolloutBatch:
        """The first ``target_groups`` whole groups; surplus is carried or discarded."""
        if not self.is_full():
            raise RuntimeError(f"batch not full: {self.held_groups}/{self.target_groups} groups")
        held = RolloutBatch.concat(self._parts)
        members = group_rows(held[self.uid_key])
        ordered = list(members.values())
        take = [row for rows in ordered[: self.target_groups] for row in rows]
        rest = [row for rows in ordered[self.target_groups :] for row in rows]
        self.surplus_groups = len(ordered) - self.target_groups
        metrics = self.metrics()  # before the reset below clears the round counters
        self._carried = held.select(rest) if (self.carry_over and rest) else RolloutBatch()
        self._reset_round_state()
        self.last_metrics = metrics
        return held.select(take)

    def metrics(self) -> dict[str, float]:
        metrics = {
            mn.NUM_GEN_BATCHES.name: float(self.num_gen_batches),
            mn.KEPT_GROUP_FRACTION.name: self.groups_kept / max(self.groups_seen, 1),
            mn.CARRIED_IN_GROUPS.name: float(self.carried_in_groups),
            mn.SURPLUS_GROUPS.name: float(self.surplus_groups),
        }
        for i, fraction in enumerate(self.round_kept_fractions):
            metrics[mn.ROUND_KEPT_FRACTION.of(round=i)] = fraction
        return metrics

    def state_dict(self) -> dict:
        """Carried-over groups survive a checkpoint (docs/algorithm.md §11). Between steps the held
        groups are one part at most, returned as they are (no copy: nothing changes a part in place)."""
        if len(self._carried):
            carried = self._carried
        else:
            carried = self._parts[0] if len(self._parts) == 1 else RolloutBatch.concat(self._parts)
        return {"carried": {"tensors": carried.tensors, "fields": carried.fields, "meta": carried.meta}}

    def load_state_dict(self, state: dict) -> None:
        self._carried = RolloutBatch(**state["carried"])
        if "response_mask" in self._carried and "loss_mask" not in self._carried:  # saved before the field
            self._carried.add("loss_mask", self._carried["response_mask"].clone())
        self._reset_round_state()
