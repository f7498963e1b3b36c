"""Driver-side handles for the two worker groups: shard, fan out, gather.

The trainer talks to these through the same methods whether the workers are local Ray
actors on a laptop CPU or 128 GPU processes on a Slurm cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.correction import CorrectionSettings
from nemo_dapo.cluster.placement import pool_nodes
from nemo_dapo.cluster.store_sync import BUCKETS_AHEAD, StoreSync
from nemo_dapo.cluster.worker_group import Calls, Deadline, RankCall, WorkerGroup, rank_call
from nemo_dapo.digest import digest_files, shares_by_size
from nemo_dapo.errors import RemoteCallError
from nemo_dapo.policy.base import LossSettings, PolicyWorker, UpdateResult
from nemo_dapo.policy.inputs import mini_batches_per_rank, shard, worker_inputs
from nemo_dapo.policy.microbatch import ROUTED_EXPERTS
from nemo_dapo.rollout.base import Generation, RolloutWorker, SamplingSettings

log = logging.getLogger(__name__)


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
        ``BUCKETS_AHEAD`` buckets per rank wait unconsumed, so a rank never runs far ahead of
        the engines. Ranks are read in rank order: pipeline stages come out first to last.
        """
        streams = [
            worker.export_weights.options(
                num_returns="streaming", _generator_backpressure_num_objects=BUCKETS_AHEAD
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


WeightSource = Callable[[], tuple[Iterable, int]]
RESTORE_PLACEMENT_S = 30.0  # how long a lost engine's slot may take to be placed on a node that joined


class RolloutGroup:
    """The vLLM engines addressed as one. Every call that reaches them goes through
    :meth:`fan_out` (or :meth:`start` + :meth:`finish`, where the driver does something between
    submitting and waiting): an engine that dies, fails its engine or gives no answer within the
    call's deadline is replaced on its slot (up to ``max_restarts`` replacements per run), and
    gets the current policy weights before it next generates.

    An engine whose node left Ray is not replaced but taken out of service (:attr:`lost`, not
    counted as a restart; its slot given back): the calls go to the engines left
    (:meth:`in_service`) while there are at least ``min_engines``; :meth:`restore_lost` starts it
    again once a node of its pool joined Ray, before a weight sync gives it the weights."""

    def __init__(self, workers: WorkerGroup, max_restarts: int = 0, min_engines: int | None = None) -> None:
        self.workers = workers
        self.max_restarts = max_restarts
        self.min_engines = workers.world_size if min_engines is None else min_engines
        self.restarts = 0
        self.lost: set[int] = set()  # engines whose node is gone, out of service until it is back
        self._pool_nodes: set[str] = set()  # the live nodes of the engines' pool at the last loss
        self._cold: set[int] = set()  # replaced engines still holding the base model's weights
        self._current_weights: WeightSource | None = None
        self.store = StoreSync(self)  # the object-store path: warm-ups, and rollout.weight_transfer=object_store

    def in_service(self) -> list[int]:
        """The engines the calls go to: every rank but the lost ones."""
        return [rank for rank in range(self.workers.world_size) if rank not in self.lost]

    def set_weight_source(self, current_weights: WeightSource) -> None:
        """How to get the policy's current weights (bucket refs, version) for a replaced engine."""
        self._current_weights = current_weights

    # ----------------------------------------------------------------- the fan-out
    def start(self, calls: Mapping[int, RankCall]) -> Calls:
        """Submit each rank's call (:func:`~nemo_dapo.cluster.worker_group.rank_call` of one
        :class:`RolloutWorker` method); :meth:`finish` waits for them."""
        ranks = list(calls)
        names = {call.method.__name__ for call in calls.values()}
        if len(names) > 1:
            raise ValueError(f"one method per fan-out, not {sorted(names)}")
        refs = [
            self.workers.submit(rank, calls[rank].method, *calls[rank].args, **calls[rank].kwargs) for rank in ranks
        ]
        return Calls(names.pop() if names else "", ranks, refs)

    def finish(
        self,
        calls: Calls,
        stage: str,
        deadline: Deadline | None = None,
        stop: Callable[[], bool] | None = None,
        one_failure: bool = False,
    ) -> dict[int, Any]:
        """The results of the calls that succeeded, by rank; each engine whose call failed is
        replaced (``stage`` says where, for the log and the error past ``max_restarts``).
        ``one_failure``: the failed engines fell together (a broken collective), one restart for
        all. ``deadline``: the group's call deadline unless given; ``stop``: see :meth:`generate`."""
        outcomes = self.workers.settle(calls.refs, calls.method, calls.ranks, deadline, stop)
        failed = [(rank, o) for rank, o in zip(calls.ranks, outcomes) if isinstance(o, RemoteCallError)]
        for index, (rank, error) in enumerate(failed):
            self.replace(rank, error, stage, counted=index == 0 or not one_failure)
        return {rank: o for rank, o in zip(calls.ranks, outcomes) if not isinstance(o, RemoteCallError)}

    def fan_out(
        self,
        calls: Mapping[int, RankCall],
        stage: str,
        deadline: Deadline | None = None,
        stop: Callable[[], bool] | None = None,
        one_failure: bool = False,
    ) -> dict[int, Any]:
        """:meth:`start` then :meth:`finish`: the results by rank of the engines that answered."""
        return self.finish(self.start(calls), stage, deadline, stop, one_failure)

    # ----------------------------------------------------------------- generation
    def generate(
        self, prompts: list[list[int]], sampling: SamplingSettings, stop: Callable[[], bool] | None = None
    ) -> list[Generation]:
        """The generations in prompt order, the prompts split evenly over the engines in service; a
        failed engine's prompts are generated again on its replacement, a lost engine's on the
        others. ``stop``: asked while the engines generate; once it says yes,
        :class:`GenerationStopped` (a stop signal gives up a long generation at once instead of
        waiting for its end)."""
        shares = _split(list(range(len(prompts))), self.in_service())
        results: list[Generation | None] = [None] * len(prompts)
        while shares:
            for rank in [rank for rank in shares if rank in self.lost]:
                for survivor, part in _split(shares.pop(rank), self.in_service()).items():
                    if part:
                        shares[survivor] = shares.get(survivor, []) + part
            for rank in shares.keys() & self._cold:
                self.warm_up(rank)
            calls = {
                rank: rank_call(RolloutWorker.generate, [prompts[i] for i in share], sampling)
                for rank, share in shares.items()
            }
            for rank, generations in self.fan_out(calls, "while generating", stop=stop).items():
                for index, generation in zip(shares.pop(rank), generations):
                    results[index] = generation
        return cast(list[Generation], results)  # every share came back

    # ----------------------------------------------------------------- engines
    def replace(self, rank: int, error: RemoteCallError, stage: str = "while generating", counted: bool = True) -> None:
        """``counted=False``: an engine taken down by another's failure (a broken collective weight
        sync), which that failure's restart already counts. An engine whose node is gone is taken
        out of service instead (:meth:`_lose`), also when Ray learns so only as its replacement
        fails to start (its worker's death can reach the driver before its node's)."""
        if self._node_gone(rank, error):
            self._lose(rank, error, stage)
            return
        if counted and self.restarts >= self.max_restarts:
            raise RemoteCallError(
                f"{error}. Rollout engine {rank} failed {stage}, after {self.restarts} engine "
                f"restart(s) in this run (rollout.max_restarts={self.max_restarts})"
            ) from error
        number = self.restarts + counted
        log.warning("%s; restarting rollout engine %d (restart %d of %d)", error, rank, number, self.max_restarts)
        try:
            self.workers.restart(rank)
        except RemoteCallError as again:
            if not self._node_gone(rank, again):
                raise
            self._lose(rank, again, stage)
            return
        self.restarts += counted
        self.store.engine_replaced(rank)
        self._cold.add(rank)

    def _node_gone(self, rank: int, error: RemoteCallError) -> bool:
        return self.workers.node_lost(rank) or "node has died" in str(error)

    def _lose(self, rank: int, error: RemoteCallError, stage: str) -> None:
        """Engine ``rank``'s node left Ray: the engine leaves the run until the node is back; with
        fewer than ``min_engines`` left the run fails (the job requeues, as for a training node)."""
        before = len(self.in_service())
        self.lost.add(rank)
        self._cold.discard(rank)
        self.store.engine_replaced(rank)
        self.workers.release_slot(rank)
        self._pool_nodes = pool_nodes(self.workers.pool)
        node = self.workers.node_addresses[rank] if self.workers.node_addresses else "?"
        if before - 1 < self.min_engines:
            raise RemoteCallError(
                f"{error}. Rollout engine {rank}'s node {node} is lost {stage}: engines {before} -> {before - 1}, "
                f"fewer than rollout.min_engines={self.min_engines}"
            ) from error
        log.warning(
            "rollout engine %d: its node %s is lost %s; engines %d -> %d (rollout.min_engines=%d)",
            rank, node, stage, before, before - 1, self.min_engines,
        )  # fmt: skip

    def restore_lost(self) -> list[int]:
        """Start the lost engines again once a node of their pool joined Ray since the last loss
        (their node's Ray is back, or another node): each slot is placed again there
        (:data:`RESTORE_PLACEMENT_S`), the engine starts, cold until the weight sync that follows.
        Returns their ranks."""
        if not self.lost or not pool_nodes(self.workers.pool) - self._pool_nodes:
            return []
        back = []
        for rank in sorted(self.lost):
            try:
                if not self.workers.slot_ready(rank, RESTORE_PLACEMENT_S):
                    continue
                self.workers.restart(rank)
            except RemoteCallError as error:  # the node went again, or cannot hold the engine yet
                log.warning("rollout engine %d could not start again (%s); it stays out of service", rank, error)
                continue
            back.append(rank)
            self.lost.discard(rank)
            self._cold.add(rank)
            log.warning(
                "rollout engine %d is back on node %s; engines %d -> %d",
                rank, self.workers.node_addresses[rank], len(self.in_service()) - 1, len(self.in_service()),
            )  # fmt: skip
        self._pool_nodes = pool_nodes(self.workers.pool)
        return back

    def warm_up(self, rank: int) -> None:
        """A replaced engine gets the policy's current weights before it generates (one that took
        them in a weight sync since it started has them)."""
        if rank not in self._cold:
            return
        if self._current_weights is None:
            raise RuntimeError("a replaced rollout engine needs the policy's weights: call set_weight_source first")
        bucket_refs, version = self._current_weights()
        self.store.send(bucket_refs, version, ranks=[rank])  # which marks it warm

    def synced(self, reported: dict[int, int], version: int) -> None:
        """The engines that took weight ``version`` (their reports, by rank) hold it: warm."""
        for rank, outcome in reported.items():
            if outcome != version:
                raise RuntimeError(f"rollout engine {rank} reports weight version {outcome}, expected {version}")
            self._cold.discard(rank)

    def sleep(self) -> None:
        """Engines release their GPU memory to the colocated training ranks (no-op where they can't)."""
        self.fan_out(dict.fromkeys(self.in_service(), rank_call(RolloutWorker.sleep)), "going to sleep")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.fan_out(dict.fromkeys(self.in_service(), rank_call(RolloutWorker.wake_up, tags)), "waking up")


def _split(indices: list[int], ranks: list[int]) -> dict[int, list[int]]:
    """``indices`` in contiguous, even parts over ``ranks`` (every rank gets a part, maybe empty)."""
    size = len(ranks)
    return {rank: indices[len(indices) * i // size : len(indices) * (i + 1) // size] for i, rank in enumerate(ranks)}
