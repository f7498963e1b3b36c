"""A group of identical Ray actors that the driver addresses as one.

Worker classes are plain Python classes (testable without Ray); the group wraps them in
``ray.remote`` here, places them with a placement group, hands each its rank, and fans
calls out / gathers results in rank order.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Sequence


class WorkerGroup:
    def __init__(self, worker_cls: type, num_workers: int, *, name: str, num_cpus_per_worker: float = 1.0,
                 num_gpus_per_worker: float = 0.0, worker_kwargs: dict | None = None,
                 placement_timeout_s: float = 300.0) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name = name
        self.world_size = num_workers
        bundle = {"CPU": num_cpus_per_worker, **({"GPU": num_gpus_per_worker} if num_gpus_per_worker else {})}
        self._placement = placement_group([bundle] * num_workers, strategy="PACK")
        try:
            ray.get(self._placement.ready(), timeout=placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self._placement)
            raise RuntimeError(
                f"{name}: could not place {num_workers} workers of {bundle} within {placement_timeout_s:.0f} s; "
                f"the cluster has {ray.available_resources()} free. Lower the worker counts or add resources."
            ) from None
        self._rendezvous_dir = tempfile.mkdtemp(prefix=f"nemo_dapo_{name}_")
        remote_cls = ray.remote(num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker)(worker_cls)
        self.workers = [
            remote_cls.options(
                name=f"{name}_{rank}_{os.getpid()}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement, placement_group_bundle_index=rank),
            ).remote(rank=rank, world_size=num_workers, rendezvous=os.path.join(self._rendezvous_dir, "store"),
                     **(worker_kwargs or {}))
            for rank in range(num_workers)
        ]
        self.call_all("ready")

    def call_all(self, method: str, *args, **kwargs) -> list[Any]:
        """The same call on every worker; results in rank order."""
        import ray

        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def call_each(self, method: str, per_rank_args: Sequence[tuple]) -> list[Any]:
        """Rank r gets ``per_rank_args[r]``; results in rank order."""
        import ray

        if len(per_rank_args) != self.world_size:
            raise ValueError(f"{self.name}: {len(per_rank_args)} argument sets for {self.world_size} workers")
        return ray.get([getattr(w, method).remote(*args) for w, args in zip(self.workers, per_rank_args)])

    def call_rank0(self, method: str, *args, **kwargs) -> Any:
        import ray

        return ray.get(getattr(self.workers[0], method).remote(*args, **kwargs))

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []
        remove_placement_group(self._placement)
