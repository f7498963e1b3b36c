"""Driver-side handles for the two worker groups: shard, fan out, gather.

The trainer talks to these through the same methods whether the workers are local Ray
actors on a laptop CPU or 128 GPU processes on a Slurm cluster.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.correction import CorrectionSettings
from nemo_dapo.cluster.worker_group import WorkerGroup
from nemo_dapo.digest import digest_files, shares_by_size
from nemo_dapo.errors import RemoteCallError
from nemo_dapo.policy.base import LossSettings, PolicyWorker, UpdateResult
from nemo_dapo.policy.inputs import mini_batches_per_rank, shard, worker_inputs
from nemo_dapo.policy.microbatch import ROUTED_EXPERTS
from nemo_dapo.rollout.base import Generation, RolloutWorker, SamplingSettings

log = logging.getLogger(__name__)
# Weight buckets a policy rank may gather ahead of the engines (and each engine's queue depth).
EXPORT_BUCKETS_AHEAD = 2


class PolicyGroup:
    """Training ranks addressed as one: rows are sharded over data-parallel replicas.

    Ranks of one replica (its tensor/pipeline-parallel peers) receive the same rows; results
    are read from the first rank of each replica.
    """

    def __init__(self, workers: WorkerGroup) -> None:
        self.workers = workers
        layout = workers.call_all(PolicyWorker.data_parallel_layout)
        self.dp_size = layout[0][1]
        self._dp_rank = [dp_rank for dp_rank, _ in layout]
        self._leaders = [self._dp_rank.index(r) for r in range(self.dp_size)]
        self.sent_bytes: dict[str, list[int]] = {}  # per call: the bytes each rank received, rank order

    @property
    def world_size(self) -> int:
        return self.workers.world_size

    def _per_worker(self, per_replica: list) -> list:
        return [per_replica[dp_rank] for dp_rank in self._dp_rank]

    def _send(self, call: str, per_replica: list) -> list:
        """Each replica's inputs go into the object store once, as one object that all its ranks
        (tensor/pipeline/context-parallel peers) read: Ray moves it to a node once, not once per
        rank. Records the bytes each rank receives in ``sent_bytes[call]``."""
        import ray

        refs = [ray.put(part) for part in per_replica]
        sizes = ray.experimental.get_object_locations(refs)
        self.sent_bytes[call] = self._per_worker([sizes[ref]["object_size"] for ref in refs])
        return self._per_worker(refs)

    def compute_log_prob(self, batch: RolloutBatch, temperature: float) -> dict[str, torch.Tensor]:
        shards = self._send("compute_log_prob", shard(worker_inputs(batch), self.dp_size))
        results = self.workers.call_each(PolicyWorker.compute_log_prob, [(s, temperature) for s in shards])
        width = batch["responses"].shape[1]
        leaders = [results[i] for i in self._leaders]
        # [B, R] results are cut to the batch's response width; routing ([B, P + R, L, K]) is whole
        return {
            key: torch.cat([r[key] if key == ROUTED_EXPERTS else r[key][:, :width] for r in leaders])
            for key in leaders[0]
        }

    def update(
        self,
        batch: RolloutBatch,
        settings: LossSettings,
        prompts_per_mini_batch: int,
        ppo_epochs: int,
        correction: CorrectionSettings | None = None,
        first_old_from_forward: bool = False,
    ) -> UpdateResult:
        """The optimizer steps over ``batch``; ``first_old_from_forward``: the first mini-batch's
        old log-probs are its own forward's, returned (its rows in order) as ``first_forward``."""
        per_replica = mini_batches_per_rank(
            batch, prompts_per_mini_batch, self.dp_size, ppo_epochs, first_old_from_forward
        )
        results = self.workers.call_each(
            PolicyWorker.update, [(mbs, settings, correction) for mbs in self._send("update", per_replica)]
        )
        leaders = [results[i] for i in self._leaders]
        # per optimizer step, the replicas' parts combine into one value (a SUM metric: each holds
        # its share of the mini-batch's), then the steps into the logged one
        parts: dict[str, list[list[float]]] = {}
        for result in leaders:
            for key, values in result.metrics.items():
                parts.setdefault(key, []).append(values)
        metrics = mn.combine_steps(
            {key: [mn.combine_parts(key, step) for step in zip(*replicas)] for key, replicas in parts.items()}
        )
        metrics.update({mn.RANK_INPUT_MB.of(call=call): max(sent) / 2**20 for call, sent in self.sent_bytes.items()})
        first_forward = None
        if first_old_from_forward:  # the replicas' shards are contiguous, in data-parallel rank order
            shards = [cast(dict, result.first_forward) for result in leaders]
            first_forward = {key: torch.cat([part[key] for part in shards]) for key in shards[0]}
        return UpdateResult(metrics, first_forward)

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
        self.workers.call_all(PolicyWorker.save, path, asynchronous)

    def finish_save(self, blocking: bool = True) -> bool:
        """Whether every rank has finished writing (all ranks take part in the check)."""
        return all(self.workers.call_all(PolicyWorker.finish_save, blocking))

    def load(self, path: str) -> None:
        self.workers.call_all(PolicyWorker.load, path)

    def release_memory(self) -> int:
        """Bytes of cached GPU memory the ranks gave back (see ``PolicyWorker.release_memory``)."""
        return sum(self.workers.call_all(PolicyWorker.release_memory))

    def digest_files(self, folder: Path, names: Sequence[str]) -> dict[str, str]:
        """A checkpoint's file digests, computed by the ranks in parallel on their own nodes, each
        over a share of about equal bytes (every rank sees the output folder)."""
        shares = shares_by_size(folder, names, self.world_size)
        found = self.workers.run_each(digest_files, [(str(folder), share) for share in shares])
        return {name: digest for part in found for name, digest in part.items()}


@dataclass
class EngineShare:
    """One engine's part of a generation request: prompts ``start:stop``, and its pending call."""

    rank: int
    start: int
    stop: int
    ref: Any


@dataclass
class GenerationRequest:
    prompts: list[list[int]]
    sampling: SamplingSettings
    shares: list[EngineShare]


WeightSource = Callable[[], tuple[Iterable, int]]


class RolloutGroup:
    """The vLLM engines addressed as one. An engine that dies or gives no answer within the
    group's call timeout during generation is replaced on its slot, given the current policy
    weights, and its prompts are generated again (up to ``max_restarts`` replacements per run);
    see :meth:`collect`."""

    def __init__(self, workers: WorkerGroup, max_restarts: int = 0) -> None:
        self.workers = workers
        self.max_restarts = max_restarts
        self.restarts = 0
        self._cold: set[int] = set()  # replaced engines still holding the base model's weights
        self._current_weights: WeightSource | None = None
        self._queues: list | None = None

    def set_weight_source(self, current_weights: WeightSource) -> None:
        """How to get the policy's current weights (bucket refs, version) for a replaced engine."""
        self._current_weights = current_weights

    def generate(
        self, prompts: list[list[int]], sampling: SamplingSettings, stop: Callable[[], bool] | None = None
    ) -> list[Generation]:
        """``stop``: asked while the engines generate; once it says yes, :class:`GenerationStopped`
        (a stop signal gives up a long generation at once instead of waiting for its end)."""
        return cast(list[Generation], self.collect(self.submit(prompts, sampling), stop=stop))

    def submit(self, prompts: list[list[int]], sampling: SamplingSettings) -> GenerationRequest:
        """Start generating without waiting (the async trainer overlaps it with training)."""
        size = self.workers.world_size
        bounds = [len(prompts) * r // size for r in range(size + 1)]
        request = GenerationRequest(prompts, sampling, [])
        request.shares = [self._send(request, r, bounds[r], bounds[r + 1]) for r in range(size)]
        return request

    def _send(self, request: GenerationRequest, rank: int, start: int, stop: int) -> EngineShare:
        if rank in self._cold:
            self.warm_up(rank)
        ref = self.workers.submit(rank, RolloutWorker.generate, request.prompts[start:stop], request.sampling)
        return EngineShare(rank, start, stop, ref)

    def collect(
        self, request: GenerationRequest, regenerate: bool = True, stop: Callable[[], bool] | None = None
    ) -> list[Generation | None]:
        """The generations in prompt order. A failed engine is replaced; its prompts are generated
        again on the new one (``regenerate``), or come back as None for the caller to reissue
        (the async trainer's data plane). ``stop`` as in :meth:`generate`."""
        results: list[Generation | None] = [None] * len(request.prompts)
        pending = request.shares
        while pending:
            refs, ranks = [s.ref for s in pending], [s.rank for s in pending]
            outcomes = self.workers.settle(refs, "generate", ranks, stop=stop)
            failed = []
            for share, outcome in zip(pending, outcomes):
                if isinstance(outcome, RemoteCallError):
                    self.replace(share.rank, outcome)
                    failed.append(share)
                else:
                    results[share.start : share.stop] = outcome
            pending = [self._send(request, s.rank, s.start, s.stop) for s in failed] if regenerate else []
        return results

    def replace(self, rank: int, error: RemoteCallError, stage: str = "while generating", counted: bool = True) -> None:
        """``counted=False``: an engine taken down by another's failure (a broken collective weight
        sync), which that failure's restart already counts."""
        if counted and self.restarts >= self.max_restarts:
            raise RemoteCallError(
                f"{error}. Rollout engine {rank} failed {stage}, after {self.restarts} engine "
                f"restart(s) in this run (rollout.max_restarts={self.max_restarts})"
            ) from error
        self.restarts += counted
        log.warning(
            "%s; restarting rollout engine %d (restart %d of %d)", error, rank, self.restarts, self.max_restarts
        )
        self.workers.restart(rank)
        if self._queues is not None:  # the dead engine may have left buckets in its queue
            self._queues[rank].shutdown()
            self._queues[rank] = self._new_queue()
        self._cold.add(rank)

    def replace_failed(self, failed: list[tuple[int, RemoteCallError]], stage: str, one_failure: bool) -> None:
        """Replace each ``(rank, error)``; ``one_failure``: they fell together, one restart for all."""
        for index, (rank, error) in enumerate(failed):
            self.replace(rank, error, stage, counted=index == 0 or not one_failure)

    def warm_up(self, rank: int) -> None:
        """A replaced engine gets the policy's current weights before it generates."""
        if self._current_weights is None:
            raise RuntimeError("a replaced rollout engine needs the policy's weights: call set_weight_source first")
        bucket_refs, version = self._current_weights()
        self.update_weights(bucket_refs, version, ranks=[rank])  # which marks it warm

    def sleep(self) -> None:
        """Engines release their GPU memory to the colocated training ranks (no-op where they can't)."""
        self.workers.call_all(RolloutWorker.sleep)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.workers.call_all(RolloutWorker.wake_up, tags)

    def update_weights(self, bucket_refs: Iterable, version: int, ranks: list[int] | None = None) -> None:
        """Stream weight buckets (object refs) into the engines (``ranks``; all by default) as they
        come, through a bounded queue per engine: no process holds the whole model on the way.

        The sync has the group's call deadline: an engine that dies, or takes no bucket for that
        long, is replaced as a failed generation is (it gets the weights before it next generates)
        while the others sync on; past ``max_restarts`` the run stops naming the engine."""
        ranks = list(range(self.workers.world_size)) if ranks is None else ranks
        syncing = {
            rank: (
                self._weight_queues()[rank],
                self.workers.submit(rank, RolloutWorker.receive_weights, self._weight_queues()[rank], version),
            )
            for rank in ranks
        }
        for ref in bucket_refs:
            self._push(syncing, [ref], version)  # wrapped: the engine fetches the bucket itself
        self._push(syncing, None, version)
        live = list(syncing)
        self.settle_sync(live, self.workers.settle([syncing[r][1] for r in live], "receive_weights", live), version)

    def settle_sync(self, ranks: list[int], outcomes: list, version: int, one_failure: bool = False) -> None:
        """After a sync: replace the engines that failed it, mark the others warm. ``one_failure``:
        the failed engines fell together (a collective sync), one restart for all of them."""
        failed = [(rank, o) for rank, o in zip(ranks, outcomes) if isinstance(o, RemoteCallError)]
        self.replace_failed(failed, "during a weight sync", one_failure)
        for rank, outcome in zip(ranks, outcomes):
            if isinstance(outcome, RemoteCallError):
                continue
            if outcome != version:
                raise RuntimeError(f"rollout engine {rank} reports weight version {outcome}, expected {version}")
            else:
                self._cold.discard(rank)

    @staticmethod
    def _new_queue():
        from ray.util.queue import Queue

        return Queue(maxsize=EXPORT_BUCKETS_AHEAD, actor_options={"num_cpus": 0})

    def _weight_queues(self) -> list:
        if self._queues is None:
            self._queues = [self._new_queue() for _ in self.workers.workers]
        return self._queues

    def _push(self, syncing: dict, item, version: int) -> None:
        """Put ``item`` on every syncing engine's queue; an engine that failed or stopped taking
        buckets for the call deadline is replaced and leaves the sync (``syncing`` shrinks)."""
        import ray
        from ray.util.queue import Full

        deadline = self.workers.call_deadline
        for rank in list(syncing):
            queue, pending = syncing[rank]
            waited = time.monotonic()
            while True:
                try:
                    queue.put(item, timeout=1.0)
                    break
                except Full:
                    done, _ = ray.wait([pending], timeout=0)
                    stuck = deadline.seconds is not None and time.monotonic() - waited > deadline.seconds
                    if done or stuck:
                        error = self.workers.settle([pending], "receive_weights", [rank])[0] if done else None
                        del syncing[rank]
                        self.replace(rank, self._sync_failure(rank, version, error), "during a weight sync")
                        break

    def _sync_failure(self, rank: int, version: int, error) -> RemoteCallError:
        """Why engine ``rank`` left the weight sync: its own error, or its silence past the deadline."""
        if isinstance(error, RemoteCallError):
            return error
        if error is not None:  # it returned before the last bucket: a bug, not a failure to recover from
            raise RuntimeError(f"rollout engine {rank} finished its weight update (version {version}) early")
        deadline = self.workers.call_deadline
        return RemoteCallError(
            f"{self.workers.name}.receive_weights: rank(s) [{rank}] took no weight bucket within "
            f"{deadline.seconds:g} s ({deadline.key}) during the weight sync to version {version}"
        )
