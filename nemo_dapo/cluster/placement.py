"""Where workers run: Ray placement groups and each worker's slot in them.

Two layouts (``trainer.colocate``, GPU mode), and pools:

- separate: every :class:`~nemo_dapo.cluster.worker_group.WorkerGroup` reserves bundles of its
  own (:func:`own_slots`), a whole GPU per training rank and TP GPUs per engine;
- colocated (NeMo RL / verl style): :class:`SharedGPUs` reserves every GPU of the job once, as
  one bundle ``{"GPU": 1, "CPU": 1}`` per GPU, one STRICT_PACK placement group per node, so GPU
  ``g`` is bundle ``g % n_gpus_per_node`` of node ``g // n_gpus_per_node``'s group. Training rank
  ``i`` runs on GPU ``i`` and engine ``e`` (TP ``t``) on GPUs ``e*t .. e*t+t-1``; each takes
  ``1 / groups`` of the GPU and of the bundle's CPU, ``groups`` being the groups that share it
  (actor + rollout, + the reference model when a KL term needs one). Ray's fractions are only
  scheduling tokens: memory is shared by taking turns (the engines sleep while the policy trains).

With a rollout pool (``trainer.rollout_pool``) every Ray node declares the pool it belongs to as
a custom resource (:func:`pool_resource`, ``slurm/ray_cluster.sh``), each group's bundles ask for
a token of their pool's (the training ranks land on training nodes, the engines on rollout
nodes), and every worker has a placement group of its own, given back when its node is lost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Slot:
    """One worker's place: a bundle of a placement group, the share of it it reserves, and the
    environment its actor starts with."""

    group: Any  # ray.util.placement_group.PlacementGroup
    bundle: int
    num_cpus: float
    num_gpus: float
    env: dict[str, str] = field(default_factory=dict)
    capture_child_tasks: bool = False  # tasks/actors the worker starts land in the same group

    def actor_options(self) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            self.group,
            placement_group_bundle_index=self.bundle,
            placement_group_capture_child_tasks=self.capture_child_tasks,
        )
        options = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "scheduling_strategy": strategy}
        if self.env:
            options["runtime_env"] = {"env_vars": dict(self.env)}  # merged with the job's env_vars
        return options


POOL_TOKEN = 0.001  # what a bundle takes of its pool's resource: a label, not a count (a node offers 1)


def pool_resource(pool: str) -> str:
    """The custom resource a node of ``pool`` (``train``, ``rollout``) offers Ray."""
    return f"nemo_dapo_pool_{pool}"


def pool_bundle(pool: str | None) -> dict[str, float]:
    """What a bundle adds to be placed on a node of ``pool`` (None: anywhere)."""
    return {pool_resource(pool): POOL_TOKEN} if pool else {}


def placed(group: Any) -> bool:
    """Whether every bundle of the placement group sits on a live node (after a node died, Ray
    reschedules its bundles; the group is whole again once a node with room joined)."""
    from ray.util import placement_group_table

    return placement_group_table(group).get("state") == "CREATED"


def pool_nodes(pool: str | None) -> set[str]:
    """The live Ray nodes offering ``pool`` (every live node for None)."""
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and (pool is None or pool_resource(pool) in n["Resources"])}


def reserve(bundles: list[dict], strategy: str, name: str, timeout_s: float, unit: str = "workers"):
    """A ready placement group, or a clear error: at once when the cluster has fewer GPUs than
    asked for in total (it could never fit), after ``timeout_s`` when they are held by others."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    wanted = sum(b.get("GPU", 0) for b in bundles)
    total = ray.cluster_resources().get("GPU", 0)
    if wanted > total:
        raise RuntimeError(
            f"{name}: {len(bundles)} {unit} need {wanted:g} GPUs, the Ray cluster has {total:g}. "
            "Lower the worker counts, or share the GPUs (trainer.colocate=true)."
        )
    group = placement_group(bundles, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(
            f"{name}: could not place {len(bundles)} {unit} of {bundles[0]} within {timeout_s:.0f} s; "
            f"the cluster has {ray.available_resources()} free. Lower the worker counts or add resources."
        ) from None
    return group


def own_slots(
    name: str,
    num_workers: int,
    num_cpus: float,
    num_gpus: float,
    timeout_s: float,
    strategy: str = "PACK",
    pool: str | None = None,
) -> tuple[list, list[Slot]]:
    """A group's own placement: one whole bundle per worker on the nodes of ``pool`` (None: any
    node). Without a pool, one placement group placed by ``strategy`` (``trainer.placement_strategy``:
    PACK fills a node first, SPREAD one per node). With one, a placement group per worker
    (:func:`own_slot`), so that a worker whose node is lost gives its slot back
    (:func:`release`) instead of leaving Ray rescheduling a bundle: Ray's control store retries a
    placement group it cannot place again without pause, a busy core on the head node for as
    long as the node is gone. Returns the placement groups and the slots."""
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {}), **pool_bundle(pool)}
    if pool is None:
        group = reserve([bundle] * num_workers, strategy, name, timeout_s)
        return [group], [Slot(group, rank, num_cpus, num_gpus) for rank in range(num_workers)]
    slots: list[Slot] = []
    try:
        for rank in range(num_workers):
            slots.append(own_slot(Slot(None, 0, num_cpus, num_gpus), pool, f"{name} worker {rank}", timeout_s))
    except RuntimeError:
        release([slot.group for slot in slots])
        raise
    return [slot.group for slot in slots], slots


def own_slot(like: Slot, pool: str | None, name: str, timeout_s: float) -> Slot:
    """``like`` on a placement group of its own (one bundle, on a node of ``pool``), placed within
    ``timeout_s`` or a RuntimeError."""
    bundle = {"CPU": like.num_cpus, **({"GPU": like.num_gpus} if like.num_gpus else {}), **pool_bundle(pool)}
    return replace(like, group=reserve([bundle], "STRICT_PACK", name, timeout_s), bundle=0)


def release(groups: list) -> None:
    from ray.util.placement_group import remove_placement_group

    for group in groups:
        remove_placement_group(group)


class SharedGPUs:
    """Every GPU of the job reserved once and shared by ``groups`` worker groups (module doc)."""

    def __init__(self, nnodes: int, gpus_per_node: int, groups: int, timeout_s: float = 300.0) -> None:
        self.gpus_per_node = gpus_per_node
        self.fraction = math.floor(10_000 / groups) / 10_000  # Ray counts resources in 1e-4 units
        self.node_groups: list = []
        try:
            for node in range(nnodes):
                self.node_groups.append(
                    reserve(
                        [{"GPU": 1, "CPU": 1}] * gpus_per_node,
                        "STRICT_PACK",
                        f"shared GPUs of node {node}",
                        timeout_s,
                        unit="GPUs",
                    )
                )
        except RuntimeError:
            self.shutdown()  # free the nodes already reserved
            raise

    def _slot(self, gpu: int, num_gpus: float, **extra) -> Slot:
        return Slot(
            self.node_groups[gpu // self.gpus_per_node], gpu % self.gpus_per_node, self.fraction, num_gpus, **extra
        )

    def training_slots(self, ranks: int) -> list[Slot]:
        """Training rank ``i`` on GPU ``i``."""
        return [self._slot(rank, self.fraction) for rank in range(ranks)]

    @staticmethod
    def engine_executor(tensor_parallel_size: int) -> str | None:
        """vLLM's executor for an engine on shared GPUs: Ray's when TP > 1 (its TP workers must land
        on the engine's bundles), else vLLM's default (in the engine actor, on its slot's GPU)."""
        return "ray" if tensor_parallel_size > 1 else None

    def engine_slots(self, engines: int, tensor_parallel_size: int) -> list[Slot]:
        """Engine ``e`` on GPUs ``e*t .. e*t+t-1``; its actor sits on the first of them."""
        if self.engine_executor(tensor_parallel_size) is None:
            return [self._slot(engine, self.fraction) for engine in range(engines)]
        return [
            self._ray_executor_slot(engine * tensor_parallel_size, tensor_parallel_size) for engine in range(engines)
        ]

    def _ray_executor_slot(self, first_gpu: int, tensor_parallel_size: int) -> Slot:
        """GPU only, untested here (no multi-GPU machine): a TP > 1 engine runs its TP workers as
        Ray actors of vLLM's Ray executor, on the engine's bundles of this node's group. The engine
        actor itself holds no GPU; vLLM reads each worker's share and bundles from the environment
        (``VLLM_RAY_PER_WORKER_GPUS``, ``VLLM_RAY_BUNDLE_INDICES``, as in vLLM's rlhf_colocate example)."""
        local = first_gpu % self.gpus_per_node
        env = {
            "VLLM_RAY_PER_WORKER_GPUS": str(self.fraction),
            "VLLM_RAY_BUNDLE_INDICES": ",".join(str(b) for b in range(local, local + tensor_parallel_size)),
        }
        return self._slot(first_gpu, 0.0, env=env, capture_child_tasks=True)

    def shutdown(self) -> None:
        release(self.node_groups)
        self.node_groups = []
