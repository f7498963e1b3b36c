"""The training ranks' side of the collective weight paths (docs/architecture.md, Weight sync):
each rank that exports weights (one per pipeline stage) opens an endpoint, meets every engine
worker there as vLLM's trainer-side weight-transfer engine of ``rollout.weight_transfer``'s
backend, and sends its export bucket by bucket as the export gathers it. The other ranks only
take part in the export's gathers.

The engine side's calls (init, start, update, finish) are the driver's to make
(``cluster/weight_sync.py``): it replaces an engine that fails, which a training rank cannot.
A failed send is reported, not raised, so the driver does not take it for this rank's death; the
rank has left its group first, so the engines still blocked on it fail at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from nemo_dapo.policy.weights import WEIGHT_BUCKET_BYTES, Bucket


class _Export:
    """The export's buckets, noting whether the export itself raised (a failure of this rank)
    rather than the transfer that consumed them."""

    def __init__(self, buckets: Iterable[Bucket]) -> None:
        self.buckets = iter(buckets)
        self.failed = False

    def __iter__(self) -> Iterator[Bucket]:
        while True:  # not ``yield from``: closing this generator must not close the export
            try:
                bucket = next(self.buckets)
            except StopIteration:
                return
            except BaseException:
                self.failed = True
                raise
            yield bucket


def open_sender(backend: str, export: Callable[[int], Iterator[Bucket]], exports: bool, bucket_bytes: int) -> Any:
    """The sender of ``backend`` for this rank (None where it exports nothing). ``nccl`` declares
    every tensor before it sends (vLLM's engines size their receive buffers from that): every
    rank runs ``export`` once, a collective, and the exporter notes what it yields."""
    if backend == "nccl":
        from nemo_dapo.transfer import nccl

        declared = nccl.declare(export(bucket_bytes))
        return nccl.NCCLSender(declared, bucket_bytes) if exports else None
    if backend != "gloo":
        raise ValueError(f"no collective weight path {backend!r}")
    from nemo_dapo.transfer import gloo

    gloo.register()
    return gloo.GlooSender() if exports else None


class WeightSender:
    """Mixed into each policy worker, which provides ``export_weights`` and ``exports_weights``."""

    _sender: Any = None  # the backend's sender, on an exporting rank once opened

    def exports_weights(self) -> bool:
        raise NotImplementedError

    def export_weights(self, bucket_bytes: int = WEIGHT_BUCKET_BYTES) -> Iterator[Bucket]:
        raise NotImplementedError

    def open_weight_transfer(self, backend: str, bucket_bytes: int) -> dict | None:
        """An exporting rank's endpoint, what the engines need to join it (None on the others)."""
        self.close_weight_transfer()
        self._sender = open_sender(backend, self.export_weights, self.exports_weights(), bucket_bytes)
        return None if self._sender is None else self._sender.endpoint()

    def join_weight_transfer(self, world_size: int, timeout_s: float) -> str | None:
        """Meet the engine workers (they join at the same time); an error's text, or None."""
        if self._sender is None:
            return None
        try:
            self._sender.join(world_size, timeout_s)
        except RuntimeError as error:  # an engine worker never came, or died meanwhile
            self.close_weight_transfer()
            return repr(error)
        return None

    def send_weights(self, bucket_bytes: int) -> dict:
        """One round: ``sent_bytes`` this rank sent, ``error`` (text) if the transfer failed.
        Every rank runs its export to the end, since the others gather with it."""
        export = _Export(self.export_weights(bucket_bytes))
        if self._sender is None:
            for _ in export:
                pass
            return {"sent_bytes": 0, "error": None}
        try:
            return {"sent_bytes": self._sender.send(iter(export)), "error": None}
        except RuntimeError as error:
            if export.failed:
                raise
            self.close_weight_transfer()  # the sender left its group already: the engines fail now
            for _ in export.buckets:
                pass
            return {"sent_bytes": 0, "error": repr(error)}

    def close_weight_transfer(self) -> None:
        """Leave the groups (an engine worker blocked on one fails at once)."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
