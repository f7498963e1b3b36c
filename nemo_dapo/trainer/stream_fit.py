"""The streaming DAPO trainer (``trainer.mode=stream``; docs/architecture.md, "Streaming generation").

The engines generate continuously (:mod:`~nemo_dapo.rollout.vllm_stream`); the driver keeps
them fed and takes groups as they finish:

1. admission: a prompt (a group of ``rollout.n`` samples) enters while fewer than
   ``(version + max_staleness + 1) x train_batch_size`` unfiltered groups were admitted (AReaL's
   bound on off-policyness; ``version``: the weight syncs so far): a group's first token then lags
   the policy that trains on it by at most ``max_staleness`` versions, unless it finishes later
   than groups admitted after it;
2. arrival: finished groups are scored at once; under dynamic sampling a group without signal is
   dropped and its slot goes to the next prompt at once, with the sync trainer's bound on wasted
   generation (``max_num_gen_batches x gen_batch_size`` groups per step);
3. a step trains the ``train_batch_size`` kept groups issued first with the synchronous trainer's
   :meth:`train_on_batch` (old log-probs, rollout correction with the engines' per-token
   log-probs, advantages, update) and loads the new weights into the running engines. A group
   older than ``max_staleness`` versions is not trained: it is counted and its prompt reissued.

A checkpoint keeps the dataset rows drawn but not trained; a resumed run issues them again
first (counted), so no prompt is lost and none is trained twice. The trainer keeps dataset
positions (what the sampler draws); prompts.jsonl and the checkpoint name rows by their ``index``
in the files (before overlong filtering), as the other trainers do.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.batch import RolloutBatch, group_rows
from nemo_dapo.algo.metrics import staleness_metrics, token_staleness_metrics
from nemo_dapo.algo.sampling import exhausted, informative_rows
from nemo_dapo.cluster.streaming import StreamingEngines
from nemo_dapo.config.topology import num_engines
from nemo_dapo.trainer.batching import batch_from_items
from nemo_dapo.trainer.fit import DAPOTrainer
from nemo_dapo.trainer.preemption import StepAbandoned
from nemo_dapo.trainer.stages import add_stale_token_mask, score_batch
from nemo_dapo.trainer.tracking import StageTimer
from nemo_dapo.trainer.validation import train_sampling

log = logging.getLogger(__name__)
POLL_S = 1.0  # longest one engine waits for a finished group before answering the driver


@dataclass
class KeptGroup:
    """A finished, scored group waiting for a step: its rows and its place in issue order."""

    sequence: int
    batch: RolloutBatch
    admitted_version: int
    position: int  # the prompt's place in the dataset


class StreamDAPOTrainer(DAPOTrainer):
    """Replaces :meth:`train_step` and the checkpointed state of :class:`DAPOTrainer` (its hook
    contract); validation's generate joins the engines' streams."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        self.batch_groups, self.max_staleness = cfg.data.train_batch_size, cfg.trainer.max_staleness
        per_engine = cfg.rollout.max_inflight or max(
            cfg.rollout.n, -(-(self.max_staleness + 1) * self.batch_groups * cfg.rollout.n // num_engines(cfg))
        )
        self.engines = StreamingEngines(self.rollout, train_sampling(cfg), per_engine, cfg.rollout.kv_after_update)
        self.issued = 0  # sequence number of the next prompt sent (its group key is g<sequence>)
        self.admitted = 0  # groups admitted since the start, less those filtered or dropped
        self.synced = 0  # weight syncs since the start: the bound's version
        self.in_flight: dict[str, tuple[int, int]] = {}  # group key -> (sequence, dataset position)
        self.kept: list[KeptGroup] = []
        self.to_issue: deque[int] = deque()  # dataset positions to send before drawing new ones
        self.filtered = self.dropped_stale = self.reissued = 0
        self._filtered_rows: list[int] = []  # row ids dynamic sampling dropped this step
        filtering = cfg.algorithm.filter_groups
        self.drop_surplus = filtering.enable and filtering.carry_over is False
        self._surplus_rows: list[int] = []  # row ids of groups finished beyond this step's batch, dropped
        self.engines.load()  # the engines' busy time counts from here

    # ----------------------------------------------------------------- admission
    def _next_position(self) -> int:
        if not self.to_issue:
            positions = self._next_prompt_indices()
            self._consumed += [self.train_data.row_id(p) for p in positions]
            self.to_issue.extend(positions)
        return self.to_issue.popleft()

    def _admit(self) -> None:
        """Send prompts while the staleness bound has room."""
        room = (self.synced + self.max_staleness + 1) * self.batch_groups - self.admitted
        if room <= 0:
            return
        groups = []
        for _ in range(room):
            position, key = self._next_position(), f"g{self.issued}"
            self.in_flight[key] = (self.issued, position)
            self.issued += 1
            groups.append((key, self.train_data[position]["prompt_ids"]))
        self.admitted += room
        self.engines.add(groups)

    # ----------------------------------------------------------------- arrival
    def _arrivals(self, timer: StageTimer, poll: int) -> int:
        """Take what finished, score it, keep the informative groups; returns groups arrived."""
        with timer("gen"):
            self._admit()
            finished = self.engines.take(POLL_S)
        if not finished:
            return 0
        places = [self.in_flight.pop(group.key) for group in finished]
        self.generated_samples += sum(len(group.generation.token_ids) for group in finished)
        prefix = f"s{self.global_step}p{poll}"
        batch = batch_from_items(
            [self.train_data[position] for _, position in places],
            [group.generation for group in finished],
            prefix,
            self.tokenizer.pad_token_id,
            [group.admitted_version for group in finished],
        )
        with timer("reward"):
            score_batch(batch, self.reward, self.tokenizer)
        keep = self._keep_rows(batch)
        members = group_rows(batch["uid"])
        for order, ((sequence, position), group) in enumerate(zip(places, finished)):
            rows = members[f"{prefix}:{order}"]
            if keep[rows[0]]:
                self.kept.append(KeptGroup(sequence, batch.select(rows), group.admitted_version, position))
            else:
                self._filtered_rows.append(self.train_data.row_id(position))
                self.filtered += 1
                self.admitted -= 1  # its slot goes to the next prompt
        return len(finished)

    def _keep_rows(self, batch: RolloutBatch) -> torch.Tensor:
        if not self.cfg.algorithm.filter_groups.enable:
            return torch.ones(len(batch), dtype=torch.bool)
        return informative_rows(batch, self.cfg.algorithm.filter_groups.metric)[0]

    def _check_waste(self, arrived: int, kept_before: int) -> None:
        """The sync trainer's bound on generation spent to fill one batch, counted in groups."""
        filtering = self.cfg.algorithm.filter_groups
        rounds = filtering.max_num_gen_batches
        if filtering.enable and rounds > 0 and arrived >= rounds * self.cfg.data.effective_gen_batch_size:
            held = len(self.kept) - kept_before
            raise exhausted(held, self.batch_groups, f"{arrived} groups generated in the stream", rounds)

    def _next_batch(self, timer: StageTimer) -> tuple[RolloutBatch, dict[str, float]]:
        """The step's batch: the first-issued ``train_batch_size`` kept groups not older than
        ``max_staleness``, taken as they arrive."""
        arrived, kept_before, poll = 0, len(self.kept), 0
        while True:
            if poll and self.stop_asked():  # the checkpoint keeps every untrained row, in flight or kept
                raise StepAbandoned
            fresh: list[KeptGroup] = []
            for group in self.kept:
                if self.weight_version - group.admitted_version <= self.max_staleness:
                    fresh.append(group)
                else:  # finished after groups admitted later: not trained, its prompt reissued
                    self.dropped_stale += 1
                    self.reissued += 1
                    self.admitted -= 1
                    self.to_issue.appendleft(group.position)
            self.kept = sorted(fresh, key=lambda g: g.sequence)
            if len(self.kept) >= self.batch_groups:
                break
            self._check_waste(arrived, kept_before)
            arrived += self._arrivals(timer, poll)
            poll += 1
        taken, self.kept = self.kept[: self.batch_groups], self.kept[self.batch_groups :]
        metrics = {}
        if arrived:
            metrics[mn.KEPT_GROUP_FRACTION.name] = (len(self.kept) + len(taken) - kept_before) / arrived
        if self.drop_surplus:
            metrics[mn.SURPLUS_GROUPS.name] = float(len(self.kept))
            self._drop_surplus()
        return RolloutBatch.concat(g.batch for g in taken), metrics

    def _drop_surplus(self) -> None:
        """``filter_groups.carry_over=false``: the groups finished beyond the batch are not trained
        (as the sync trainer drops a round's surplus); their slots go to new prompts."""
        self._surplus_rows += [self.train_data.row_id(group.position) for group in self.kept]
        self.admitted -= len(self.kept)
        self.kept = []

    # ----------------------------------------------------------------- the step's hooks
    def _before_update(self, batch: RolloutBatch) -> dict[str, float]:
        """The engines work on while the policy trains; the batch's lag behind the policy, and its
        tokens older than ``trainer.max_token_staleness`` out of the loss."""
        self._admit()
        metrics = staleness_metrics(batch["policy_version"].tolist(), self.weight_version)
        metrics.update(token_staleness_metrics(batch["token_versions"], batch["response_mask"], self.weight_version))
        metrics.update(add_stale_token_mask(batch, self.weight_version, self.cfg.trainer.max_token_staleness))
        return metrics

    def _sync_engines(self, timer: StageTimer) -> None:
        with timer("sync_weights"):
            self.sync_weights()  # into the running engines

    def _after_sync(self) -> None:
        self.synced += 1
        self._admit()

    def _prompts_of_step(self) -> tuple[list[int], dict | None]:
        """The rows drawn this step, those dynamic sampling dropped in the stream, and (with
        ``carry_over=false``) those finished beyond the batch and dropped."""
        consumed, self._consumed = self._consumed, []
        filtered, self._filtered_rows = sorted(self._filtered_rows), []
        if not self.drop_surplus:
            return consumed, {"filtered": filtered}
        surplus, self._surplus_rows = sorted(self._surplus_rows), []
        return consumed, {"filtered": filtered, "surplus": surplus}

    def _mode_metrics(self, timer: StageTimer, step_s: float) -> dict[str, float]:
        load = self.engines.load()
        return {
            mn.GENERATED_SAMPLES.name: float(self.generated_samples),
            mn.SAMPLES_IN_FLIGHT.name: float(load.samples_running),
            mn.GROUPS_QUEUED.name: float(load.groups_queued),
            mn.ENGINE_BUSY.name: load.busy_fraction,
            mn.ENGINE_STARVED.name: load.starved_fraction,
            mn.TRAINER_IDLE.name: (timer.seconds.get("gen", 0.0)) / max(step_s, 1e-9),
            mn.GEN_TOKENS_PER_S.name: load.tokens / max(load.wall_s / num_engines(self.cfg), 1e-9),
            mn.FILTERED_IN_STREAM.name: float(self.filtered),
            mn.DROPPED_STALE.name: float(self.dropped_stale),
            mn.REISSUED_PROMPTS.name: float(self.reissued + self.engines.resent),
        }

    # ----------------------------------------------------------------- checkpoints
    def _untrained_rows(self) -> list[int]:
        """The row ids drawn and not trained, in issue order: in flight, kept, not yet sent."""
        waiting = sorted(self.in_flight.values()) + [(g.sequence, g.position) for g in self.kept]
        positions = [position for _, position in sorted(waiting)] + list(self.to_issue)
        return [self.train_data.row_id(p) for p in positions]

    def _restore_untrained(self, rows: list[int]) -> None:
        """The checkpoint's untrained row ids, issued first (as dataset positions)."""
        self.to_issue = deque(self.train_data.position_of(row) for row in rows)

    def trainer_state(self) -> dict:
        return {**super().trainer_state(), "stream_untrained": self._untrained_rows()}

    def _restore(self, state: dict) -> None:
        """Every step trained ``train_batch_size`` groups: so many were admitted and count against
        the bound; the rows drawn and not trained are issued again first."""
        self.synced = self.global_step
        self.admitted = self.global_step * self.batch_groups
        self._restore_untrained(state["stream_untrained"])
        self.reissued = len(self.to_issue)
        log.info("reissued %d prompts drawn but not trained before the checkpoint", self.reissued)
