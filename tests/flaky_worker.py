"""Failures for the driver's handling of them, importable by Ray's worker processes (pytest
imports test modules under names they cannot): a worker that sleeps or dies
(tests/test_remote_calls.py), an engine whose step fails (tests/test_engine_recovery.py), an
engine that fails while it receives weights (tests/test_engine_recovery.py,
tests/test_cluster_loopback.py), and the driver-side timer of such a failure."""

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


def fail_second_bucket(worker, rank: int) -> None:
    """Worker ``rank`` of an engine raises at the second bucket it loads over the collective
    weight path (an error while loading, its process alive: the receive fails mid-round)."""
    if worker.rank != rank:
        return
    model = worker.weight_transfer_engine.model
    load, loaded = model.load_weights, []

    def fails_at_the_second(bucket):
        loaded.append(len(bucket))
        if len(loaded) == 2:
            raise RuntimeError("loading a weight bucket failed (injected)")
        return load(bucket)

    model.load_weights = fails_at_the_second


def break_receiving(actor, rank: int = 0) -> None:
    """Make worker ``rank`` of a rollout worker's engine fail at the second bucket of its next
    collective weight sync."""
    import ray

    ray.get(actor.__ray_call__.remote(lambda w: w.llm.collective_rpc(fail_second_bucket, args=(rank,))))


def seconds_to_failure(rollout, sync, version: int) -> float:
    """Run ``sync(version)``, which is to fail; the seconds until the driver had the engines'
    failures in hand (its first call to replace them), without the replacements' start."""
    import time

    replace, failed_at = rollout.replace, []

    def noting_when(*args, **kwargs):
        failed_at.append(time.monotonic())
        return replace(*args, **kwargs)

    rollout.replace = noting_when
    started = time.monotonic()
    try:
        sync(version)
    finally:
        del rollout.replace
    return failed_at[0] - started
