"""A group of identical Ray actors that the driver addresses as one.

Worker classes are plain Python classes (testable without Ray); the group wraps them in
``ray.remote`` here, places each on its :class:`~nemo_dapo.cluster.placement.Slot`, hands each
its rank, and fans calls out / gathers results in rank order.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

from nemo_dapo.cluster.placement import Slot, own_slots


class RemoteCallError(RuntimeError):
    """A worker that died, or gave no answer in time, during a call the driver waits on. The
    message names the group, the call, the ranks and where their logs are."""


class WorkerGroup:
    def __init__(
        self,
        worker_cls: type,
        num_workers: int,
        *,
        name: str,
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float = 0.0,
        worker_kwargs: dict | None = None,
        placement_timeout_s: float = 300.0,
        slots: Sequence[Slot] | None = None,
        call_timeout_s: float | None = None,
    ) -> None:
        """Without ``slots`` the group reserves a placement group of its own (one bundle of
        ``num_cpus_per_worker`` CPUs and ``num_gpus_per_worker`` GPUs per worker) and frees it at
        shutdown; with ``slots`` (one per worker, e.g. shares of GPUs colocated with another group)
        it runs there and the placement group stays the caller's. ``call_timeout_s``: the longest
        the driver waits on one call (None: no limit), ``trainer.remote_timeout_s``."""
        import ray

        self.name = name
        self.world_size = num_workers
        self.call_timeout_s = call_timeout_s
        self._own_placement = None
        if slots is None:
            self._own_placement, slots = own_slots(
                name, num_workers, num_cpus_per_worker, num_gpus_per_worker, placement_timeout_s
            )
        if len(slots) != num_workers:
            raise ValueError(f"{name}: {len(slots)} slots for {num_workers} workers")
        self._rendezvous_dir = tempfile.mkdtemp(prefix=f"nemo_dapo_{name}_")
        remote_cls: Any = ray.remote(worker_cls)
        self.workers: list[Any] = [
            remote_cls.options(name=f"{name}_{rank}_{os.getpid()}", **slot.actor_options()).remote(
                rank=rank,
                world_size=num_workers,
                rendezvous=os.path.join(self._rendezvous_dir, "store"),
                **(worker_kwargs or {}),
            )
            for rank, slot in enumerate(slots)
        ]
        self.call_all("ready")

    def call_all(self, method: str, *args, **kwargs) -> list[Any]:
        """The same call on every worker; results in rank order."""
        return self.gather([getattr(w, method).remote(*args, **kwargs) for w in self.workers], method)

    def call_each(self, method: str, per_rank_args: Sequence[tuple]) -> list[Any]:
        """Rank r gets ``per_rank_args[r]``; results in rank order."""
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"{self.name}: {len(per_rank_args)} argument sets for {self.world_size} workers")
        return self.gather([getattr(w, method).remote(*args) for w, args in zip(self.workers, per_rank_args)], method)

    def gather(self, refs: list, method: str) -> list[Any]:
        """``ray.get`` of one call's per-rank results (rank order), within ``call_timeout_s``; a dead
        or silent worker becomes a :class:`RemoteCallError` instead of a hang or a bare Ray error."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(refs, timeout=self.call_timeout_s)
        except GetTimeoutError:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            silent = [rank for rank, ref in enumerate(refs) if ref not in done]
            raise RemoteCallError(
                f"{self.name}.{method}: rank(s) {silent} gave no answer within "
                f"{self.call_timeout_s:g} s (trainer.remote_timeout_s); {self._logs()}"
            ) from None
        except RayActorError as err:
            raise RemoteCallError(
                f"{self.name}.{method}: a worker died ({err.__class__.__name__}: "
                f"{str(err).splitlines()[0]}); {self._logs()}"
            ) from err

    @staticmethod
    def _logs() -> str:
        """Where the workers' stderr is: this Ray session's log folder (worker-*.err)."""
        from ray._private.worker import global_worker

        node = getattr(global_worker, "node", None)  # None when attached to a remote cluster
        folder = f"{node.get_session_dir_path()}/logs" if node else "the head node's /tmp/ray/session_latest/logs"
        return f"their logs: {folder} (worker-*.err)"

    def gpu_ids(self) -> list[list]:
        """``ray.get_gpu_ids()`` of every worker, in rank order (which GPUs Ray gave each)."""
        import ray

        return ray.get([w.__ray_call__.remote(lambda _: ray.get_gpu_ids()) for w in self.workers])

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []
        if self._own_placement is not None:
            remove_placement_group(self._own_placement)
            self._own_placement = None
