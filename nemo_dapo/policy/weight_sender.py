"""The training ranks' side of the collective weight path (docs/architecture.md, Weight sync): each rank that
exports weights (one per pipeline stage) serves a rendezvous, joins each engine's first worker in a
gloo group as vLLM's trainer-side weight-transfer engine, and broadcasts its export bucket by bucket
as the export gathers it. The other ranks only take part in the export's gathers.

The engine side's calls (init, start, update, finish) are the driver's to make
(``cluster/weight_sync.py``): it replaces an engine that fails, which a training rank cannot.
A failed broadcast is reported, not raised, so the driver does not take it for this rank's death.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from nemo_dapo.network import Rendezvous
from nemo_dapo.policy.weights import Bucket


class _Export:
    """The export's buckets, noting whether the export itself raised (a failure of this rank)
    rather than the broadcast that consumed them."""

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


class WeightSender:
    """Mixed into each policy worker, which provides ``export_weights`` and ``exports_weights``."""

    _rendezvous: Rendezvous | None = None
    _transfer: Any = None  # the trainer-side engine, on an exporting rank once joined

    def exports_weights(self) -> bool:
        raise NotImplementedError

    def export_weights(self, bucket_bytes: int = 512 << 20) -> Iterator[Bucket]:
        raise NotImplementedError

    def open_weight_transfer(self) -> str | None:
        """An exporting rank's rendezvous address (None on the others)."""
        self.close_weight_transfer()
        if not self.exports_weights():
            return None
        self._rendezvous = Rendezvous()
        return self._rendezvous.url

    def join_weight_transfer(self, world_size: int, timeout_s: float) -> str | None:
        """Meet the engine workers (they join at the same time); an error's text, or None."""
        if self._rendezvous is None:
            return None
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from nemo_dapo.transfer import gloo

        gloo.register()
        info = gloo.GlooTrainerInitInfo(self._rendezvous.url, world_size, timeout_s, rank=0)
        try:
            self._transfer = WeightTransferTrainerFactory.trainer_init(info, client=None)
        except RuntimeError as error:  # gloo: an engine worker never came, or died meanwhile
            self.close_weight_transfer()
            return repr(error)
        return None

    def send_weights(self, bucket_bytes: int) -> dict:
        """One round: ``sent_bytes`` this rank broadcast, ``error`` (text) if the broadcast failed.
        Every rank runs its export to the end, since the others gather with it."""
        export = _Export(self.export_weights(bucket_bytes))
        if self._transfer is None:
            for _ in export:
                pass
            return {"sent_bytes": 0, "error": None}
        try:
            return {"sent_bytes": self._transfer.send_weights(iter(export)), "error": None}
        except RuntimeError as error:
            if export.failed:
                raise
            for _ in export.buckets:
                pass
            self.close_weight_transfer()
            return {"sent_bytes": 0, "error": repr(error)}

    def close_weight_transfer(self) -> None:
        """Leave the groups (an engine worker blocked on one fails at once) and stop the rendezvous."""
        if self._transfer is not None:
            self._transfer.shutdown()
            self._transfer = None
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None
