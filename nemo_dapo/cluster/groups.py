"""Driver-side handles for the two worker groups: shard, fan out, gather.

The trainer talks to these through the same methods whether the workers are local Ray
actors on a laptop CPU or 128 GPU processes on a Slurm cluster.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.correction import CorrectionSettings
from nemo_dapo.cluster.worker_group import WorkerGroup
from nemo_dapo.policy.base import LossSettings
from nemo_dapo.policy.inputs import mini_batches_per_rank, shard, worker_inputs
from nemo_dapo.rollout.base import Generation, SamplingSettings

# Weight buckets a policy rank may gather ahead of the engines (and each engine's queue depth).
EXPORT_BUCKETS_AHEAD = 2


class PolicyGroup:
    """Training ranks addressed as one: rows are sharded over data-parallel replicas.

    Ranks of one replica (its tensor/pipeline-parallel peers) receive the same rows; results
    are read from the first rank of each replica.
    """

    def __init__(self, workers: WorkerGroup) -> None:
        self.workers = workers
        layout = workers.call_all("data_parallel_layout")
        self.dp_size = layout[0][1]
        self._dp_rank = [dp_rank for dp_rank, _ in layout]
        self._leaders = [self._dp_rank.index(r) for r in range(self.dp_size)]

    @property
    def world_size(self) -> int:
        return self.workers.world_size

    def _per_worker(self, per_replica: list) -> list:
        return [per_replica[dp_rank] for dp_rank in self._dp_rank]

    def compute_log_prob(self, batch: RolloutBatch, temperature: float) -> dict[str, torch.Tensor]:
        shards = shard(worker_inputs(batch), self.dp_size)
        results = self.workers.call_each("compute_log_prob", [(s, temperature) for s in self._per_worker(shards)])
        width = batch["responses"].shape[1]
        leaders = [results[i] for i in self._leaders]
        return {key: torch.cat([r[key][:, :width] for r in leaders]) for key in leaders[0]}

    def update(
        self,
        batch: RolloutBatch,
        settings: LossSettings,
        prompts_per_mini_batch: int,
        ppo_epochs: int,
        correction: CorrectionSettings | None = None,
    ) -> dict[str, float]:
        per_replica = mini_batches_per_rank(batch, prompts_per_mini_batch, self.dp_size, ppo_epochs)
        results = self.workers.call_each(
            "update", [(mbs, settings, correction) for mbs in self._per_worker(per_replica)]
        )
        # per optimizer step, the replicas' parts combine into one value (a SUM metric: each holds
        # its share of the mini-batch's), then the steps into the logged one
        parts: dict[str, list[list[float]]] = {}
        for rank_metrics in (results[i] for i in self._leaders):
            for key, values in rank_metrics.items():
                parts.setdefault(key, []).append(values)
        return mn.combine_steps(
            {key: [mn.combine_parts(key, step) for step in zip(*replicas)] for key, replicas in parts.items()}
        )

    def export_weights(self, bucket_bytes: int) -> Iterator:
        """Object refs of the weight buckets in HF order, streamed while the ranks gather them.

        Every rank runs its (collective) exporter as a Ray streaming generator; at most
        ``EXPORT_BUCKETS_AHEAD`` buckets per rank wait unconsumed, so a rank never runs far ahead of
        the engines. Ranks are read in rank order: pipeline stages come out first to last.
        """
        streams = [
            worker.export_weights.options(
                num_returns="streaming", _generator_backpressure_num_objects=EXPORT_BUCKETS_AHEAD
            ).remote(bucket_bytes)
            for worker in self.workers.workers
        ]
        for stream in streams:
            yield from stream

    def save(self, path: str, asynchronous: bool = False) -> None:
        self.workers.call_all("save", path, asynchronous)

    def finish_save(self, blocking: bool = True) -> bool:
        """Whether every rank has finished writing (all ranks take part in the check)."""
        return all(self.workers.call_all("finish_save", blocking))

    def load(self, path: str) -> None:
        self.workers.call_all("load", path)


class RolloutGroup:
    def __init__(self, workers: WorkerGroup) -> None:
        self.workers = workers
        self._queues: list | None = None

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[Generation]:
        return self.collect(self.submit(prompts, sampling))

    def submit(self, prompts: list[list[int]], sampling: SamplingSettings) -> list:
        """Start generating without waiting (the async trainer overlaps it with training)."""
        size = self.workers.world_size
        bounds = [len(prompts) * r // size for r in range(size + 1)]
        return [
            worker.generate.remote(prompts[bounds[r] : bounds[r + 1]], sampling)
            for r, worker in enumerate(self.workers.workers)
        ]

    def collect(self, handles: list) -> list[Generation]:
        return [generation for part in self.workers.gather(handles, "generate") for generation in part]

    def sleep(self) -> None:
        """Engines release their GPU memory to the colocated training ranks (no-op where they can't)."""
        self.workers.call_all("sleep")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.workers.call_all("wake_up", tags)

    def update_weights(self, bucket_refs: Iterable, version: int) -> None:
        """Stream weight buckets (object refs) into every engine as they come, through a bounded
        queue per engine: no process holds the whole model on the way."""
        queues = self._weight_queues()
        pending = [worker.receive_weights.remote(queue, version) for worker, queue in zip(self.workers.workers, queues)]
        for ref in bucket_refs:
            self._push(queues, pending, [ref])  # wrapped: the engine fetches the bucket itself
        self._push(queues, pending, None)
        versions = self.workers.gather(pending, "receive_weights")
        if set(versions) != {version}:
            raise RuntimeError(f"rollout engines report weight versions {versions}, expected {version}")

    def _weight_queues(self) -> list:
        from ray.util.queue import Queue

        if self._queues is None:
            self._queues = [
                Queue(maxsize=EXPORT_BUCKETS_AHEAD, actor_options={"num_cpus": 0}) for _ in self.workers.workers
            ]
        return self._queues

    @staticmethod
    def _push(queues: list, pending: list, item) -> None:
        """Put ``item`` on every queue; if an engine stopped reading (it failed), raise its error."""
        import ray
        from ray.util.queue import Full

        for queue in queues:
            while True:
                try:
                    queue.put(item, timeout=1.0)
                    break
                except Full as full:
                    done, _ = ray.wait(pending, timeout=0)
                    if done:
                        ray.get(done)
                        raise RuntimeError(
                            "a rollout engine finished its weight update before all buckets arrived"
                        ) from full
