"""The streaming mode's batch source (``trainer.mode=stream``; docs/architecture.md, "Streaming
generation"): the engines generate continuously (:mod:`~nemo_dapo.rollout.vllm_stream`); the
source keeps them fed under the staleness bound and takes groups as they finish, by the rules of
:mod:`~nemo_dapo.algo.staleness`.

Finished groups are scored at once; under dynamic sampling a group without signal is dropped and
its slot goes to the next prompt, with the sync mode's bound on wasted generation
(``max_num_gen_batches x gen_batch_size`` groups per step). The new weights go into the running
engines. A checkpoint keeps the rows drawn but not trained; a resumed run issues them first
(counted), so no prompt is lost and none is trained twice. The books keep dataset positions (what
the sampler draws); prompts.jsonl and the checkpoint name rows by their ``index`` in the files
(before overlong filtering), as the sync mode does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.batch import RolloutBatch, group_rows
from nemo_dapo.algo.metrics import staleness_metrics, token_staleness_metrics
from nemo_dapo.algo.sampling import exhausted, informative_rows
from nemo_dapo.algo.staleness import KeptGroup, StreamBooks
from nemo_dapo.cluster.streaming import StreamingEngines
from nemo_dapo.config import Config
from nemo_dapo.config.topology import num_engines
from nemo_dapo.rollout.base import StreamedGroup
from nemo_dapo.trainer.batching import batch_from_items
from nemo_dapo.trainer.preemption import StepAbandoned
from nemo_dapo.trainer.settings import train_sampling
from nemo_dapo.trainer.source import PromptDraws, StepPlace
from nemo_dapo.trainer.stages import add_stale_token_mask, score_batch
from nemo_dapo.trainer.tracking import StageTimer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nemo_dapo.cluster.groups import RolloutGroup
    from nemo_dapo.data.dataset import RLDataset
    from nemo_dapo.reward.manager import RewardManager

log = logging.getLogger(__name__)
POLL_S = 1.0  # longest one engine waits for a finished group before answering the driver


def stream_engines(cfg: Config, rollout: RolloutGroup) -> StreamingEngines:
    """The rollout group's engines as one stream, each holding up to ``rollout.max_inflight`` samples."""
    assert cfg.rollout.max_inflight is not None, "resolved when the config loads (config/load.py)"
    return StreamingEngines(rollout, train_sampling(cfg), cfg.rollout.max_inflight, cfg.rollout.kv_after_update)


class StreamSource:
    """Groups taken from the engines' streams as they finish
    (:class:`~nemo_dapo.trainer.source.BatchSource`)."""

    def __init__(
        self,
        cfg: Config,
        draws: PromptDraws,
        data: RLDataset,
        engines: StreamingEngines,
        tokenizer: PreTrainedTokenizerBase,
        reward: RewardManager,
    ) -> None:
        self.cfg, self.draws, self.data, self.engines = cfg, draws, data, engines
        self.tokenizer, self.reward = tokenizer, reward
        filtering = cfg.algorithm.filter_groups
        drop_surplus = filtering.enable and not filtering.carry_over
        self.books = StreamBooks(cfg.data.train_batch_size, cfg.trainer.max_staleness, drop_surplus)
        self.engines.load()  # the engines' busy time counts from here

    def _admit(self) -> None:
        """Send prompts while the staleness bound has room."""
        sent = self.books.admit(self.draws.next_positions)
        if sent:
            self.engines.add([(key, self.data[position]["prompt_ids"]) for key, position in sent])

    def _arrivals(self, place: StepPlace, timer: StageTimer, poll: int) -> int:
        """Take what finished, score it, keep the informative groups; returns groups arrived."""
        with timer("gen"):
            self._admit()
            finished = self.engines.take(POLL_S)
        if not finished:
            return 0
        places = [self.books.arrived(group.key) for group in finished]
        self.draws.generated_samples += sum(len(group.generation.token_ids) for group in finished)
        batch = self._scored(finished, [position for _, position in places], f"s{place.global_step}p{poll}", timer)
        keep = self._keep_rows(batch)
        members = group_rows(batch["uid"])
        for order, ((sequence, position), group) in enumerate(zip(places, finished)):
            rows = members[f"s{place.global_step}p{poll}:{order}"]
            if keep[rows[0]]:
                self.books.keep(KeptGroup(sequence, batch.select(rows), group.admitted_version, position))
            else:
                self.books.filter_out(position)
        return len(finished)

    def _scored(self, finished: list[StreamedGroup], positions: list[int], prefix: str, timer: StageTimer):
        batch = batch_from_items(
            [self.data[position] for position in positions],
            [group.generation for group in finished],
            prefix,
            self.tokenizer.pad_token_id,
            [group.admitted_version for group in finished],
        )
        with timer("reward"):
            score_batch(batch, self.reward, self.tokenizer)
        return batch

    def _keep_rows(self, batch: RolloutBatch) -> torch.Tensor:
        if not self.cfg.algorithm.filter_groups.enable:
            return torch.ones(len(batch), dtype=torch.bool)
        return informative_rows(batch, self.cfg.algorithm.filter_groups.metric)[0]

    def _check_waste(self, arrived: int, kept_before: int) -> None:
        """The sync mode's bound on generation spent to fill one batch, counted in groups."""
        filtering = self.cfg.algorithm.filter_groups
        rounds = filtering.max_num_gen_batches
        if filtering.enable and rounds > 0 and arrived >= rounds * self.cfg.data.effective_gen_batch_size:
            held = len(self.books.kept) - kept_before
            raise exhausted(held, self.books.batch_groups, f"{arrived} groups generated in the stream", rounds)

    def next_batch(self, place: StepPlace, timer: StageTimer) -> tuple[RolloutBatch, dict[str, float]]:
        """The first-issued ``train_batch_size`` kept groups not older than ``max_staleness``,
        taken as they arrive. A stop gives the step up: the checkpoint keeps every untrained row."""
        arrived, kept_before, poll = 0, len(self.books.kept), 0
        while True:
            if poll and place.stop_asked():
                raise StepAbandoned
            self.books.drop_stale(place.weight_version)
            if self.books.full():
                break
            self._check_waste(arrived, kept_before)
            arrived += self._arrivals(place, timer, poll)
            poll += 1
        taken = self.books.take()
        metrics = {}
        if arrived:
            metrics[mn.KEPT_GROUP_FRACTION.name] = (len(self.books.kept) + len(taken) - kept_before) / arrived
        if self.books.drop_surplus:
            metrics[mn.SURPLUS_GROUPS.name] = float(self.books.drop_kept_surplus())
        return RolloutBatch.concat(g.batch for g in taken), metrics

    def before_update(self, batch: RolloutBatch, weight_version: int) -> dict[str, float]:
        """The engines work on while the policy trains; the batch's lag behind the policy, and its
        tokens older than ``trainer.max_token_staleness`` out of the loss."""
        self._admit()
        metrics = staleness_metrics(batch["policy_version"].tolist(), weight_version)
        metrics.update(token_staleness_metrics(batch["token_versions"], batch["response_mask"], weight_version))
        metrics.update(add_stale_token_mask(batch, weight_version, self.cfg.trainer.max_token_staleness))
        return metrics

    def sync(self, timer: StageTimer, sync_weights: Callable[[], None]) -> None:
        with timer("sync_weights"):
            sync_weights()  # into the running engines

    def after_sync(self) -> None:
        self.books.synced_once()
        self._admit()

    def prompts_of_step(self) -> tuple[list[int], dict | None]:
        """The rows drawn this step, those dynamic sampling dropped in the stream, and (with
        ``carry_over=false``) those finished beyond the batch and dropped."""
        filtered, surplus = ([self.data.row_id(p) for p in part] for part in self.books.take_dropped())
        extra = {"filtered": sorted(filtered)}
        if self.books.drop_surplus:
            extra["surplus"] = sorted(surplus)
        return self.draws.take_consumed(), extra

    def metrics(self, timer: StageTimer, step_s: float) -> dict[str, float]:
        load = self.engines.load()
        return {
            mn.SAMPLES_IN_FLIGHT.name: float(load.samples_running),
            mn.GROUPS_QUEUED.name: float(load.groups_queued),
            mn.ENGINE_BUSY.name: load.busy_fraction,
            mn.ENGINE_STARVED.name: load.starved_fraction,
            mn.TRAINER_IDLE.name: (timer.seconds.get("gen", 0.0)) / max(step_s, 1e-9),
            mn.GEN_TOKENS_PER_S.name: load.tokens / max(load.wall_s / num_engines(self.cfg), 1e-9),
            mn.FILTERED_IN_STREAM.name: float(self.books.filtered),
            mn.DROPPED_STALE.name: float(self.books.dropped_stale),
            mn.REISSUED_PROMPTS.name: float(self.books.reissued + self.engines.resent),
        }

    def state(self) -> dict:
        """The draws, and the rows drawn and not trained (as row ids), in issue order."""
        untrained = [self.data.row_id(p) for p in self.books.untrained_positions()]
        return {**self.draws.state(), "accumulator": None, "stream_untrained": untrained}

    def restore(self, state: dict, global_step: int) -> None:
        self.draws.restore(state)
        self.books.restore(global_step, [self.data.position_of(row) for row in state["stream_untrained"]])
        log.info("reissued %d prompts drawn but not trained before the checkpoint", self.books.reissued)
