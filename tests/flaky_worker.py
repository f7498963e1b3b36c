"""A Ray worker for the driver's failure handling (tests/test_remote_calls.py), importable by
Ray's worker processes (pytest imports test modules under names they cannot)."""

import os


class Napper:
    """A worker whose rank 1 sleeps or dies, as a stuck or crashed engine would."""

    def __init__(self, rank: int, world_size: int, rendezvous: str) -> None:
        self.rank = rank
        if rank == 0:  # as torch.distributed's FileStore does for the ranks of a real group
            open(rendezvous, "a").close()

    def ready(self) -> bool:
        return True

    def nap(self, seconds: float) -> int:
        import time

        time.sleep(seconds if self.rank == 1 else 0)
        return self.rank

    def die(self) -> None:
        if self.rank == 1:
            os._exit(1)
