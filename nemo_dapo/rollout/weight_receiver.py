"""The object-store weight path into a running vLLM engine, on every one of its workers
(tensor-parallel ranks), and the registration of the collective one.

vLLM mixes :class:`WeightReceiver` into each of its worker processes (``worker_extension_cls``),
and the engine drives it with three ``collective_rpc`` calls per update: start, one call per
bucket, finish. A bucket is loaded as it arrives, so no process holds the whole model on the way.
With ``tensor_parallel_size > 1`` the workers are other processes and vLLM's executor pickles
each call's arguments: a bucket (a list of tensors) travels that way, where a generator over all
buckets could not. Both paths load through :mod:`~nemo_dapo.transfer.reload`.

Importing this module (vLLM does, in each worker, before the model loads) registers the ``gloo``
weight-transfer backend (:mod:`~nemo_dapo.transfer.gloo`), which the worker then builds from
the engine's ``weight_transfer_config``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nemo_dapo.transfer import gloo
from nemo_dapo.transfer.reload import finish_reload, start_reload

gloo.register()


class WeightReceiver:
    """Methods vLLM adds to its worker class; ``self`` is the worker (``self.model_runner``)."""

    def start_bucket_reload(self) -> None:
        start_reload(self._model())

    def reload_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of (Hugging Face name, tensor) pairs."""
        self._model().load_weights(bucket)
        return len(bucket)

    def finish_bucket_reload(self) -> int:
        """Finish the reload and drop state derived from the old weights; returns the number of
        MoE layers re-packed for the CPU."""
        runner = self.model_runner  # type: ignore[attr-defined]
        packed = finish_reload(self._model(), runner.model_config)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            getattr(runner, reset, lambda: None)()
        return packed

    def _model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]
