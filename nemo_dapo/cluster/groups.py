"""Driver-side handles for the two worker groups: shard, fan out, gather.

The trainer talks to these through the same methods whether the workers are local Ray
actors on a laptop CPU or 128 GPU processes on a Slurm cluster.
"""

from __future__ import annotations

import torch

from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.correction import CorrectionSettings
from nemo_dapo.algo.metrics import reduce_metrics
from nemo_dapo.cluster.worker_group import WorkerGroup
from nemo_dapo.policy.base import LossSettings
from nemo_dapo.rollout.base import Generation, SamplingSettings
from nemo_dapo.trainer.batching import mini_batches_per_rank, shard, worker_inputs


class PolicyGroup:
    def __init__(self, workers: WorkerGroup) -> None:
        self.workers = workers

    @property
    def world_size(self) -> int:
        return self.workers.world_size

    def compute_log_prob(self, batch: RolloutBatch, temperature: float) -> dict[str, torch.Tensor]:
        shards = shard(worker_inputs(batch), self.world_size)
        results = self.workers.call_each("compute_log_prob", [(s, temperature) for s in shards])
        width = batch["responses"].shape[1]
        return {key: torch.cat([r[key][:, :width] for r in results]) for key in results[0]}

    def update(self, batch: RolloutBatch, settings: LossSettings, prompts_per_mini_batch: int, ppo_epochs: int,
               correction: CorrectionSettings | None = None) -> dict[str, float]:
        per_rank = mini_batches_per_rank(batch, prompts_per_mini_batch, self.world_size, ppo_epochs)
        results = self.workers.call_each("update", [(mbs, settings, correction) for mbs in per_rank])
        merged: dict[str, list[float]] = {}
        for rank_metrics in results:
            for key, values in rank_metrics.items():
                merged.setdefault(key, []).extend(values)
        reduced = reduce_metrics(merged)
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):  # rank shares of one mini-batch value
            if key in reduced:
                reduced[key] *= self.world_size
        return reduced

    def export_weights(self, bucket_bytes: int):
        return self.workers.call_rank0("export_weights", bucket_bytes)

    def save(self, path: str) -> None:
        self.workers.call_all("save", path)

    def load(self, path: str) -> None:
        self.workers.call_all("load", path)


class RolloutGroup:
    def __init__(self, workers: WorkerGroup) -> None:
        self.workers = workers

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[Generation]:
        size = self.workers.world_size
        bounds = [len(prompts) * r // size for r in range(size + 1)]
        parts = self.workers.call_each("generate", [(prompts[bounds[r]: bounds[r + 1]], sampling) for r in range(size)])
        return [generation for part in parts for generation in part]

    def update_weights(self, buckets, version: int) -> None:
        import ray

        handle = ray.put(buckets)  # one copy in the object store, read by every engine
        versions = self.workers.call_all("update_weights", handle, version)
        if set(versions) != {version}:
            raise RuntimeError(f"rollout engines report weight versions {versions}, expected {version}")
