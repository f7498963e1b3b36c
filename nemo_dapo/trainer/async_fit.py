"""The asynchronous DAPO trainer (SPEC 8): generation overlaps training through a data plane.

Prompts and trajectories live in the data plane under keys with tags (``is_prompt``,
``status`` pending|running|done, ``global_steps``, ``policy_version``). While the policy
trains on one batch, the engines already generate the next with the previous weights; one
trainer step is ``parameter_sync_step`` local updates, then a weight sync. Trajectories more
than ``max_staleness`` versions behind are dropped and counted. The local update itself is the
synchronous trainer's (``train_on_batch``): one step implementation for both loops.
"""

from __future__ import annotations

import logging
import time

from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.metrics import reduce_metrics, staleness_metrics
from nemo_dapo.rollout.base import Generation
from nemo_dapo.trainer.batching import build_rollout_batch
from nemo_dapo.trainer.data_plane import DataPlane
from nemo_dapo.trainer.fit import DAPOTrainer
from nemo_dapo.trainer.recovery import PROMPT_FIELDS, reissue_inflight_prompts
from nemo_dapo.trainer.stages import score_batch
from nemo_dapo.trainer.tracking import StageTimer

log = logging.getLogger(__name__)
PARTITION = "train"
TRAJECTORY_FIELDS = ("token_ids", "log_probs", "finish_reason")


class AsyncDAPOTrainer(DAPOTrainer):
    def __init__(self, *args, plane: DataPlane, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plane = plane
        self.issued = 0
        self.inflight: tuple | None = None  # (prompt keys, attempts, engine handles, weight version)
        self.dropped_stale = 0
        self.reissued = 0
        self.overlap = self.cfg.trainer.max_staleness > 0

    # ----------------------------------------------------------------- data plane traffic
    def _issue_prompts(self) -> None:
        indices = self._next_prompt_indices()
        items = [self.train_data[i] for i in indices]
        keys = [f"q{self.issued + j}" for j in range(len(items))]
        self.issued += len(items)
        fields = {"prompt_ids": [it["prompt_ids"] for it in items], "ground_truth": [it["ground_truth"] for it in items],
                  "data_source": [it["data_source"] for it in items], "prompt_index": [it["index"] for it in items]}
        tags = [{"is_prompt": True, "status": "pending", "global_steps": self.global_step, "attempt": 1}] * len(keys)
        self.plane.kv_batch_put(keys, fields, tags, PARTITION)

    def _launch_generation(self) -> None:
        """Send the pending prompts (one round's worth) to the engines, without waiting."""
        if self.inflight is not None:
            return
        pending = self.plane.kv_list(PARTITION, {"is_prompt": True, "status": "pending"})
        if not pending.keys:
            self._issue_prompts()
            pending = self.plane.kv_list(PARTITION, {"is_prompt": True, "status": "pending"})
        keys = pending.keys[: self.sampler.batch_size]
        attempts = [tag["attempt"] for tag in pending.tags[: len(keys)]]
        prompts = self.plane.kv_batch_get(keys, ["prompt_ids"], PARTITION)["prompt_ids"]
        self.plane.kv_update_tags(keys, {"status": "running"}, PARTITION)
        self.inflight = (keys, attempts, self.rollout.submit(prompts, self._sampling()), self.weight_version)

    def _harvest(self) -> None:
        """Wait for the in-flight generation and store its trajectories ``<prompt_key>_<k>``."""
        keys, attempts, handles, version = self.inflight
        self.inflight = None
        generations = self.rollout.collect(handles)
        traj_keys, tags, fields = [], [], {name: [] for name in TRAJECTORY_FIELDS}
        for key, attempt, generation in zip(keys, attempts, generations):
            for k, sample in enumerate(zip(generation.token_ids, generation.log_probs, generation.finish_reasons)):
                traj_keys.append(f"{key}_{k}")
                tags.append({"is_prompt": False, "prompt_id": key, "status": "done", "policy_version": version,
                             "attempt": attempt})
                for name, value in zip(TRAJECTORY_FIELDS, sample):
                    fields[name].append(value)
        self.plane.kv_batch_put(traj_keys, fields, tags, PARTITION)
        self.plane.kv_update_tags(keys, {"status": "done"}, PARTITION)

    def _take_done_groups(self, round_index: int) -> RolloutBatch:
        """Read and remove the finished prompts with their trajectories (a few store calls per
        round, not per prompt); drop the stale ones."""
        done = self.plane.kv_list(PARTITION, {"is_prompt": True, "status": "done"})
        trajectories = self.plane.kv_list(PARTITION, {"is_prompt": False, "prompt_id": done.keys})
        prompt_fields = self.plane.kv_batch_get(done.keys, list(PROMPT_FIELDS), PARTITION)
        samples = self.plane.kv_batch_get(trajectories.keys, list(TRAJECTORY_FIELDS), PARTITION)
        self.plane.kv_clear([*done.keys, *trajectories.keys], PARTITION)
        per_prompt: dict[str, list[int]] = {key: [] for key in done.keys}
        for row, tags in enumerate(trajectories.tags):
            per_prompt[tags["prompt_id"]].append(row)
        rows, generations, versions = [], [], []
        for i, key in enumerate(done.keys):
            mine = per_prompt[key]
            version = trajectories.tags[mine[0]]["policy_version"]
            if self.weight_version - version > self.cfg.trainer.max_staleness:
                self.dropped_stale += 1
                continue
            rows.append(i)
            generations.append(Generation(*([samples[name][r] for r in mine] for name in TRAJECTORY_FIELDS)))
            versions.append(version)
        fields = {name: [prompt_fields[name][i] for i in rows] for name in ("ground_truth", "data_source", "prompt_index")}
        fields["prompt_key"] = [done.keys[i] for i in rows]
        fields["attempt"] = [done.tags[i]["attempt"] for i in rows]
        prompts = [prompt_fields["prompt_ids"][i] for i in rows]
        return build_rollout_batch(prompts, generations, fields, f"s{self.global_step}r{round_index}",
                                   self.tokenizer.pad_token_id, versions) if rows else RolloutBatch()

    def _next_round(self, timer: StageTimer, round_index: int) -> RolloutBatch:
        """A round from the data plane: harvest the in-flight generation (launching it if none)."""
        while True:
            with timer("gen"):
                self._launch_generation()
                self._harvest()
            batch = self._take_done_groups(round_index)
            if len(batch):
                break
        with timer("reward"):
            score_batch(batch, self.reward, self.tokenizer)
        return batch

    # ----------------------------------------------------------------- one trainer step
    def train_step(self) -> dict[str, float]:
        """``parameter_sync_step`` local updates, each overlapping the next generation, then a sync."""
        timer = StageTimer()
        step_start = time.perf_counter()
        collected: list[dict[str, float]] = []
        batches, consumed = [], []
        for _ in range(self.cfg.trainer.parameter_sync_step):
            batch, metrics, round_consumed = self._collect_batch(timer)
            if self.overlap:
                with timer("gen"):
                    self._launch_generation()  # runs on the engines while the policy trains
            versions = batch["policy_version"].tolist()
            metrics.update(staleness_metrics(versions, versions, self.weight_version))
            metrics.update(self.train_on_batch(batch, timer))
            collected.append(metrics)
            batches.append(batch)
            consumed += round_consumed
        with timer("sync_weights"):
            self.sync_weights()
        metrics = reduce_metrics({k: [m[k] for m in collected if k in m] for k in collected[-1]})
        metrics.update({"staleness/dropped_stale": float(self.dropped_stale),
                        "recovery/reissued_prompts": float(self.reissued)})
        batch = RolloutBatch.concat(batches)
        self._finish_step_metrics(batch, metrics, timer, step_start)
        self._record_prompts(consumed, batch)
        return metrics

    # ----------------------------------------------------------------- checkpoints
    def trainer_state(self) -> dict:
        """The data plane is snapshotted between two driver calls: no writer is active then."""
        return {**super().trainer_state(), "data_plane": self.plane.snapshot(), "issued": self.issued}

    def load_checkpoint(self, path) -> None:
        import torch

        super().load_checkpoint(path)
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        self.plane.restore(state["data_plane"])
        self.issued = state["issued"]
        self.inflight = None
        self.reissued = reissue_inflight_prompts(self.plane, self.global_step, mode="async", partition=PARTITION)
        log.info("reissued %d in-flight prompts after restore", self.reissued)
