"""A group of identical Ray actors that the driver addresses as one.

Worker classes are plain Python classes (testable without Ray); the group wraps them in
``ray.remote`` here, places each on its :class:`~nemo_dapo.cluster.placement.Slot`, hands each
its rank, and fans calls out / gathers results in rank order.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from nemo_dapo.cluster.placement import Slot, own_slot, own_slots, placed, release
from nemo_dapo.errors import EngineFailure, GenerationStopped, RemoteCallError
from nemo_dapo.network import Rendezvous, node_address

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Deadline:
    """How long the driver waits, and the config key that sets it (named when it runs out)."""

    seconds: float | None
    key: str


@dataclass(frozen=True)
class RankCall(Generic[R]):
    """One rank's call of an interface method (``RolloutWorker.generate``) with its arguments;
    :func:`rank_call` makes one, and the type checker holds the arguments to the method."""

    method: Callable[..., R]
    args: tuple
    kwargs: dict


def rank_call(method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> RankCall[R]:
    return RankCall(method, args, kwargs)


@dataclass
class Calls:
    """One method's calls submitted to some ranks and not yet waited on: ``refs[i]`` is rank
    ``ranks[i]``'s (:meth:`~nemo_dapo.cluster.groups.RolloutGroup.start`)."""

    method: str
    ranks: list[int]
    refs: list


def placement_summary(node_addresses: Sequence[str]) -> str:
    """Which ranks run on which node, e.g. ``2 workers on 2 nodes: 10.0.0.2 [0], 10.0.0.3 [1]``."""
    ranks: dict[str, list[int]] = {}
    for rank, address in enumerate(node_addresses):
        ranks.setdefault(address, []).append(rank)
    nodes = ", ".join(f"{address} {members}" for address, members in ranks.items())
    return f"{len(node_addresses)} worker(s) on {len(ranks)} node(s): {nodes}"


STOP_POLL_S = 0.5  # how often a wait that a stop may end asks whether one came


def _wait_all(refs: list, seconds: float | None, stop: Callable[[], bool] | None) -> None:
    """Until every call returned or ``seconds`` passed (None: no limit); :class:`GenerationStopped`
    as soon as ``stop()`` says so, before the wait too (a stop that came before the calls)."""
    import ray

    if stop is None:
        ray.wait(refs, num_returns=len(refs), timeout=seconds)
        return
    end = None if seconds is None else time.monotonic() + seconds
    ready: list = []
    while not stop():
        left = STOP_POLL_S if end is None else min(STOP_POLL_S, end - time.monotonic())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(left, 0.0))
        if len(ready) == len(refs) or (end is not None and time.monotonic() >= end):
            return
    raise GenerationStopped(f"a stop came while {len(refs) - len(ready)} call(s) still ran")


def _without_worker(_worker: Any, function: Callable, *args: Any) -> Any:
    return function(*args)


def _node_of_worker() -> tuple[str, str]:
    """This worker's node: its address and Ray node id."""
    import ray

    return node_address(), ray.get_runtime_context().get_node_id()


@dataclass(frozen=True)
class GroupSpec:
    """What a worker group is, apart from its workers' class and arguments: its name and size;
    where it runs (without ``slots``, a placement group of its own, one bundle of
    ``num_cpus_per_worker`` CPUs and ``num_gpus_per_worker`` GPUs per worker, placed by Ray's
    ``strategy`` (PACK, SPREAD) within ``placement_timeout_s`` and freed at shutdown; with
    ``slots``, one per worker, e.g. shares of GPUs colocated with another group, the caller's);
    ``env``, variables every worker process starts with (added to its slot's); and how long the
    driver waits: ``call_timeout_s`` on one call (None: no limit), named by the config key
    ``timeout_key``, and ``start_timeout_s`` on a worker's start (a model load;
    ``trainer.remote_timeout_s``), by default the same; ``pool``: the nodes its own placement
    group may use (``train``, ``rollout``; None: any)."""

    name: str
    num_workers: int
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0
    slots: Sequence[Slot] | None = None
    strategy: str = "PACK"
    placement_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)
    call_timeout_s: float | None = None
    timeout_key: str = "trainer.remote_timeout_s"
    start_timeout_s: float | None = None
    pool: str | None = None


class WorkerGroup:
    """``num_workers`` Ray actors of one worker class, addressed as one: calls go to every rank
    (or one) and come back in rank order, each bounded by the group's deadline; a rank that dies
    or hangs fails the call with a :class:`~nemo_dapo.errors.RemoteCallError` naming the group,
    the call, the ranks and their logs. :class:`~nemo_dapo.cluster.groups.PolicyGroup` and
    ``RolloutGroup`` wrap one each with the calls a trainer makes."""

    def __init__(self, worker_cls: type, spec: GroupSpec, worker_kwargs: dict | None = None, wait: bool = True) -> None:
        """``spec.num_workers`` actors of ``worker_cls``, each built with ``worker_kwargs`` (and its
        rank, the world size and the group's rendezvous). ``wait=False`` returns as soon as the
        actors are asked for, so several groups load their models at once; :meth:`wait_ready`
        then waits for them. The ranks meet at a TCPStore this process serves while the group
        lives (:class:`~nemo_dapo.network.Rendezvous`)."""
        import ray

        self.name = spec.name
        self.world_size = spec.num_workers
        self.call_deadline = Deadline(spec.call_timeout_s, spec.timeout_key)
        start_s = spec.start_timeout_s
        self.start_deadline = self.call_deadline if start_s is None else Deadline(start_s, "trainer.remote_timeout_s")
        self._own_placements: list = []
        self.pool = spec.pool
        self._placement_per_worker = spec.slots is None and spec.pool is not None  # own_slots' choice
        slots = spec.slots
        if slots is None:
            self._own_placements, slots = own_slots(
                spec.name,
                spec.num_workers,
                spec.num_cpus_per_worker,
                spec.num_gpus_per_worker,
                spec.placement_timeout_s,
                spec.strategy,
                spec.pool,
            )
        if spec.env:
            slots = [replace(slot, env={**slot.env, **spec.env}) for slot in slots]
        if len(slots) != spec.num_workers:
            raise ValueError(f"{spec.name}: {len(slots)} slots for {spec.num_workers} workers")
        self._rendezvous = Rendezvous()
        self._remote_cls: Any = ray.remote(worker_cls)
        self._slots, self._kwargs = list(slots), dict(worker_kwargs or {})
        self.restarts = [0] * spec.num_workers  # per rank: how often its actor was replaced
        self.node_addresses: list[str] = []  # per rank: its node's address, once ready
        self.node_ids: list[str] = []  # per rank: its Ray node, once ready
        self.workers: list[Any] = [self._start(rank) for rank in range(spec.num_workers)]
        self._starting = [worker.ready.remote() for worker in self.workers]
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Return once every worker is built (at once after the first time); a worker that failed
        to build raises here."""
        starting, self._starting = self._starting, []
        if starting:
            self.gather(starting, "ready", self.start_deadline)
            nodes = self.run_each(_node_of_worker, [()] * self.world_size)
            self.node_addresses, self.node_ids = [address for address, _ in nodes], [node for _, node in nodes]
            log.info("%s: %s", self.name, placement_summary(self.node_addresses))

    def _start(self, rank: int) -> Any:
        """Rank's actor on its slot (a replacement gets a name of its own: the old one may linger)."""
        suffix = f"_restart{self.restarts[rank]}" if self.restarts[rank] else ""
        options = self._slots[rank].actor_options()
        return self._remote_cls.options(name=f"{self.name}_{rank}_{os.getpid()}{suffix}", **options).remote(
            rank=rank, world_size=self.world_size, rendezvous=self._rendezvous.url, **self._kwargs
        )

    def restart(self, rank: int) -> None:
        """Replace rank's actor (dead, or stuck and killed here) by a fresh one on the same slot,
        built with the same arguments; returns once it is ready."""
        import ray

        ray.kill(self.workers[rank], no_restart=True)
        self.restarts[rank] += 1
        self.workers[rank] = self._start(rank)
        self.gather([self.workers[rank].ready.remote()], "ready", self.start_deadline)
        if self.node_ids:
            address, self.node_ids[rank] = self.gather(
                [self.workers[rank].__ray_call__.remote(_without_worker, _node_of_worker)], "ready"
            )[0]
            self.node_addresses[rank] = address

    def node_lost(self, rank: int) -> bool:
        """Whether the node rank's worker ran on is gone from Ray (dead, or drained and removed)."""
        import ray

        if not self.node_ids:
            return False
        return not any(node["NodeID"] == self.node_ids[rank] and node["Alive"] for node in ray.nodes())

    def release_slot(self, rank: int) -> None:
        """Give back rank's own placement group (its node is lost: nothing for Ray to reschedule)."""
        slot = self._slots[rank]
        if slot.group is None or not self._placement_per_worker:
            return  # a shared placement group, or the whole group's: Ray keeps it
        self._own_placements.remove(slot.group)
        release([slot.group])
        self._slots[rank] = replace(slot, group=None)

    def slot_ready(self, rank: int, timeout_s: float) -> bool:
        """Whether rank's slot can take a worker now: its placement group whole on live nodes, or,
        given back, placed again within ``timeout_s`` on a node of the group's pool."""
        slot = self._slots[rank]
        if slot.group is not None:
            return placed(slot.group)
        try:
            self._slots[rank] = own_slot(slot, self.pool, f"{self.name} worker {rank}", timeout_s)
        except RuntimeError:
            return False
        self._own_placements.append(self._slots[rank].group)
        return True

    def call_all(self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """The same call on every worker; results in rank order. ``method`` is the interface's
        (``PolicyWorker.save``): the type checker holds the arguments to it, and a reader goes
        from here to the worker's code."""
        name = method.__name__
        return self.gather([getattr(w, name).remote(*args, **kwargs) for w in self.workers], name)

    def call_each(self, method: Callable[..., R], per_rank_args: Sequence[tuple]) -> list[R]:
        """Rank r gets ``per_rank_args[r]``; results in rank order."""
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"{self.name}: {len(per_rank_args)} argument sets for {self.world_size} workers")
        name = method.__name__
        return self.gather([getattr(w, name).remote(*args) for w, args in zip(self.workers, per_rank_args)], name)

    def submit(self, rank: int, method: Callable[Concatenate[Any, P], Any], *args: P.args, **kwargs: P.kwargs) -> Any:
        """Rank ``rank``'s call to the interface's ``method``, not waited on: its Ray object ref
        (:meth:`gather` it)."""
        return getattr(self.workers[rank], method.__name__).remote(*args, **kwargs)

    def run_each(self, function: Callable, per_rank_args: Sequence[tuple]) -> list[Any]:
        """``function(*per_rank_args[r])`` in rank r's process (beside its worker, on its node);
        results in rank order."""
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"{self.name}: {len(per_rank_args)} argument sets for {self.world_size} workers")
        refs = [w.__ray_call__.remote(_without_worker, function, *args) for w, args in zip(self.workers, per_rank_args)]
        return self.gather(refs, getattr(function, "__name__", "function"))

    def gather(self, refs: list, method: str, deadline: Deadline | None = None) -> list[Any]:
        """``ray.get`` of one call's per-rank results (rank order), within the call deadline; a dead
        or silent worker (or one whose engine failed: :class:`EngineFailure`) becomes a
        :class:`RemoteCallError` instead of a hang or a bare Ray error."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        deadline = deadline or self.call_deadline
        try:
            return ray.get(refs, timeout=deadline.seconds)
        except GetTimeoutError:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            silent = [rank for rank, ref in enumerate(refs) if ref not in done]
            raise self._silent(method, silent, deadline) from None
        except (RayActorError, EngineFailure) as err:
            raise self._died(method, err) from err

    def settle(
        self,
        refs: list,
        method: str,
        ranks: Sequence[int],
        deadline: Deadline | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> list[Any]:
        """Each call's result, or the :class:`RemoteCallError` of a rank (``ranks[i]`` made
        ``refs[i]``) that died or gave no answer within ``deadline`` (the call deadline unless
        given; one for all of them):
        the caller decides what to do about each failed rank; a worker whose engine failed
        (:class:`EngineFailure`) counts as dead. Any other error the worker raised itself (a bug,
        bad input) is raised as is. ``stop`` is asked every :data:`STOP_POLL_S` while the calls
        run; once it says yes the wait ends with :class:`GenerationStopped`, the calls left running."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        deadline = deadline or self.call_deadline
        _wait_all(refs, deadline.seconds, stop)
        outcomes: list[Any] = []
        for rank, ref in zip(ranks, refs):
            try:
                outcomes.append(ray.get(ref, timeout=0))
            except GetTimeoutError:
                outcomes.append(self._silent(method, [rank], deadline))
            except (RayActorError, EngineFailure) as err:
                outcomes.append(self._died(method, err))
        return outcomes

    def _silent(self, method: str, ranks: list[int], deadline: Deadline) -> RemoteCallError:
        return RemoteCallError(
            f"{self.name}.{method}: rank(s) {ranks} gave no answer within "
            f"{deadline.seconds:g} s ({deadline.key}); {self._logs()}"
        )

    def _died(self, method: str, err: Exception) -> RemoteCallError:
        if isinstance(err, EngineFailure):  # Ray's error holds the worker's own as its cause
            what = f"a worker's engine failed ({str(getattr(err, 'cause', err)).splitlines()[0]})"
        else:
            what = f"a worker died ({err.__class__.__name__}: {str(err).splitlines()[0]})"
        return RemoteCallError(f"{self.name}.{method}: {what}; {self._logs()}")

    @staticmethod
    def _logs() -> str:
        """Where the workers' stderr is: this Ray session's log folder (worker-*.err)."""
        from ray._private.worker import global_worker

        node = getattr(global_worker, "node", None)  # None when attached to a remote cluster
        folder = (
            f"{node.get_session_dir_path()}/logs" if node else "the head node's $RAY_TEMP_DIR/ray/session_latest/logs"
        )
        return f"their logs: {folder} (worker-*.err)"

    def gpu_ids(self) -> list[list]:
        """``ray.get_gpu_ids()`` of every worker, in rank order (which GPUs Ray gave each)."""
        import ray

        return ray.get([w.__ray_call__.remote(lambda _: ray.get_gpu_ids()) for w in self.workers])

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []
        release(self._own_placements)
        self._own_placements = []
        self._rendezvous.close()
