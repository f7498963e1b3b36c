"""Failures for the driver's handling of them, importable by Ray's worker processes (pytest
imports test modules under names they cannot): a worker that sleeps or dies
(tests/test_remote_calls.py), an engine whose step fails (tests/test_engine_recovery.py)."""

import os


class Napper:
    """A worker whose rank 1 sleeps or dies, as a stuck or crashed engine would."""

    def __init__(self, rank: int, world_size: int, rendezvous: str) -> None:
        self.rank = rank

    def ready(self) -> bool:
        return True

    def nap(self, seconds: float) -> int:
        import time

        time.sleep(seconds if self.rank == 1 else 0)
        return self.rank

    def die(self) -> None:
        if self.rank == 1:
            os._exit(1)


def break_forward(worker) -> None:
    """A device error in the model's forward, inside the engine's step (run by collective_rpc)."""

    def fails(*args, **kwargs):
        raise RuntimeError("device error in the forward (injected)")

    worker.model_runner.execute_model = fails


def break_engine(actor) -> None:
    """Make a rollout worker's engine fail at its next step, the actor itself staying alive."""
    import ray

    ray.get(actor.__ray_call__.remote(lambda w: w.llm.collective_rpc(break_forward)))
