"""The synchronous mode's batch source (``trainer.mode=sync``, docs/algorithm.md §8): each step
generates a round of prompts with the policy's current weights, scores it, and (dynamic
sampling) generates more rounds until ``train_batch_size`` informative groups are held; colocated
engines sleep through the update."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.sampling import GroupAccumulator
from nemo_dapo.config import Config
from nemo_dapo.config.topology import is_colocated
from nemo_dapo.errors import GenerationStopped
from nemo_dapo.trainer.batching import batch_from_items
from nemo_dapo.trainer.preemption import StepAbandoned
from nemo_dapo.trainer.settings import train_sampling
from nemo_dapo.trainer.source import PromptDraws, StepPlace
from nemo_dapo.trainer.stages import score_batch
from nemo_dapo.trainer.tracking import StageTimer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nemo_dapo.cluster.groups import PolicyGroup, RolloutGroup
    from nemo_dapo.data.dataset import RLDataset
    from nemo_dapo.reward.manager import RewardManager


class SyncSource:
    """Rounds generated for each step (:class:`~nemo_dapo.trainer.source.BatchSource`)."""

    def __init__(
        self,
        cfg: Config,
        draws: PromptDraws,
        data: RLDataset,
        policy: PolicyGroup,
        rollout: RolloutGroup,
        tokenizer: PreTrainedTokenizerBase,
        reward: RewardManager,
    ) -> None:
        self.cfg, self.draws, self.data = cfg, draws, data
        self.policy, self.rollout, self.tokenizer, self.reward = policy, rollout, tokenizer, reward
        filtering = cfg.algorithm.filter_groups
        self.accumulator = (
            GroupAccumulator(
                cfg.data.train_batch_size, filtering.max_num_gen_batches, bool(filtering.carry_over), filtering.metric
            )
            if filtering.enable
            else None
        )

    def _round(self, place: StepPlace, timer: StageTimer, round_index: int) -> RolloutBatch:
        """One generation round, scored."""
        items = [self.data[i] for i in self.draws.next_positions()]
        with timer("gen"):
            prompts = [it["prompt_ids"] for it in items]
            generations = self.rollout.generate(prompts, train_sampling(self.cfg), stop=place.stop_asked)
        self.draws.generated_samples += len(items) * self.cfg.rollout.n
        uid_prefix = f"s{place.global_step}r{round_index}"
        batch = batch_from_items(items, generations, uid_prefix, self.tokenizer.pad_token_id, place.weight_version)
        with timer("reward"):
            score_batch(batch, self.reward, self.tokenizer)
        return batch

    def next_batch(self, place: StepPlace, timer: StageTimer) -> tuple[RolloutBatch, dict[str, float]]:
        """One round, or (dynamic sampling) rounds until train_batch_size informative groups are held.
        A stop asked for while a round generates (or before it) gives the step up: the sampler and
        the held groups go back to where the step began, so a resumed run draws them again."""
        began = self.state()
        round_index = 0
        while True:
            try:
                batch = self._round(place, timer, round_index)
            except GenerationStopped as stopped:
                self.restore(began, place.global_step)
                raise StepAbandoned(str(stopped)) from None
            round_index += 1
            if self.accumulator is None:
                return batch, {}
            self.accumulator.add_round(batch)
            if self.accumulator.is_full():
                return self.accumulator.pop_batch(), self.accumulator.last_metrics
            self.accumulator.check_limit()

    def before_update(self, batch: RolloutBatch, weight_version: int) -> dict[str, float]:
        """Engines colocated with the training ranks sleep from the end of generation to the sync
        (a no-op otherwise)."""
        self.rollout.sleep()
        return {}

    def sync(self, timer: StageTimer, sync_weights: Callable[[], None]) -> None:
        """The colocated engines' weights wake first, the KV cache once the new weights are in."""
        if is_colocated(self.cfg):  # the engines wake into what the update's allocator cached
            self.policy.release_memory()
        with timer("sync_weights"):
            self.rollout.wake_up(["weights"])
            sync_weights()
            self.rollout.wake_up(["kv_cache"])

    def after_sync(self) -> None:
        """Nothing: the next step generates afresh."""

    def metrics(self, timer: StageTimer, step_s: float) -> dict[str, float]:
        """None of its own: the samples generated are every mode's (the trainer logs them)."""
        return {}

    def prompts_of_step(self) -> tuple[list[int], dict | None]:
        return self.draws.take_consumed(), None

    def state(self) -> dict:
        """What drawing prompts changes: the sampler, dynamic sampling's held groups, the budget."""
        accumulator = self.accumulator.state_dict() if self.accumulator is not None else None
        return {**self.draws.state(), "accumulator": accumulator}

    def restore(self, state: dict, global_step: int) -> None:
        self.draws.restore(state)
        if self.accumulator is not None and state["accumulator"] is not None:
            self.accumulator.load_state_dict(state["accumulator"])
