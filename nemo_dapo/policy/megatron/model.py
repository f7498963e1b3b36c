"""Build a Megatron-core GPTModel from a Hugging Face folder, and move weights in and out.

Process groups: gloo when there is no GPU, NCCL otherwise, met at the driver's TCPStore, each
rank on its node's address (:mod:`nemo_dapo.network`).
Weights enter as HF tensors (converted, pipeline-sliced, expert-sliced and TP-sharded per rank
by :mod:`nemo_dapo.policy.megatron.convert`) and leave the same way: :func:`gather_param`
gathers one parameter over TP (experts over expert TP and EP) for the streaming exporter.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from nemo_dapo.config.architecture import Architecture
from nemo_dapo.config.schema_actor import MegatronConfig
from nemo_dapo.config.topology import Parallelism
from nemo_dapo.errors import InputError
from nemo_dapo.network import join_group
from nemo_dapo.policy.megatron import convert as convert
from nemo_dapo.policy.megatron.cpu_compat import define_router_gemm_without_te


def chunk_index(vp_stage: int) -> int:
    """The model-wide position of this rank's ``vp_stage``-th chunk: chunk ``v`` of every rank
    comes after chunk ``v - 1`` of all ranks, as Megatron interleaves them."""
    from megatron.core import parallel_state as ps

    return vp_stage * ps.get_pipeline_model_parallel_world_size() + ps.get_pipeline_model_parallel_rank()


def num_chunks() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size() * (ps.get_virtual_pipeline_model_parallel_world_size() or 1)


def init_distributed(rank: int, world_size: int, rendezvous: str, parallel: Parallelism, seed: int) -> None:
    """The default group (:func:`~nemo_dapo.network.join_group`) + Megatron's TP/PP/DP/EP groups +
    the model-parallel RNG."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    join_group(rank, world_size, rendezvous)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor,
            pipeline_model_parallel_size=parallel.pipeline,
            virtual_pipeline_model_parallel_size=parallel.virtual,
            expert_model_parallel_size=parallel.expert,
            expert_tensor_parallel_size=parallel.expert_tensor,
            context_parallel_size=parallel.context,
        )
    model_parallel_cuda_manual_seed(seed)


def rope_theta(hf_config) -> float:
    """transformers 5 keeps it in ``rope_parameters``; older versions on the config itself."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def require_runtime(layout: MegatronConfig) -> None:
    """What the config cannot know (it validated every combination at start-up): TransformerEngine
    needs a GPU on this rank and the package installed."""
    if layout.transformer_impl != "transformer_engine":
        return
    if not torch.cuda.is_available():
        raise ValueError(
            "actor.megatron.transformer_impl=transformer_engine needs a GPU on every training rank; "
            "use local on the CPU"
        )
    if importlib.util.find_spec("transformer_engine") is None:
        raise ValueError(
            "actor.megatron.transformer_impl=transformer_engine: the transformer_engine package is not "
            "installed here (use the GPU container, or transformer_impl=local)"
        )


def layer_options(layout: MegatronConfig) -> dict[str, Any]:
    """The TransformerConfig fields ``actor.megatron`` sets: FP8, sequence parallelism, recompute."""
    recompute: dict[str, dict[str, Any]] = {
        "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        "selective": {"recompute_granularity": "selective"},
    }
    return {
        "fp8": layout.fp8,
        "fp8_recipe": layout.fp8_recipe,
        "sequence_parallel": layout.sequence_parallel,
        **recompute.get(layout.recompute_granularity or "", {}),
    }


def ddp_config(layout: MegatronConfig):
    """Megatron DDP's settings from ``actor.megatron``: the distributed optimizer and the overlap of
    its reduce-scatter with the backward and of its all-gather with the next forward (both also run
    over gloo on the CPU). Gradients are reduced in fp32."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=layout.use_distributed_optimizer,
        overlap_grad_reduce=layout.overlap_grad_reduce,
        overlap_param_gather=layout.overlap_param_gather,
        bucket_size=layout.ddp_bucket_size,
    )


def check_expert_layout(shape: Architecture, parallel: Parallelism, sequence_parallel: bool) -> None:
    """EP must split a MoE model's experts evenly (and means nothing for a dense model).

    Megatron trains MoE layers with TP > 1 only with sequence parallelism: refuse it without,
    here rather than at the first update.
    """
    key = f"actor.megatron.expert_model_parallel_size={parallel.expert}"
    if not shape.num_experts and parallel.expert > 1:
        raise ValueError(f"{key}: the model has no experts; set it to 1")
    if shape.num_experts % parallel.expert:
        raise ValueError(f"{key}: must divide the model's {shape.num_experts} experts")
    if shape.num_experts and parallel.tensor > 1 and not sequence_parallel:
        raise ValueError(
            f"actor.megatron.tensor_model_parallel_size={parallel.tensor}: Megatron trains MoE layers "
            "with TP > 1 only with actor.megatron.sequence_parallel=true (TransformerEngine, GPU); "
            "on the CPU shard the experts with expert_model_parallel_size and keep TP = 1"
        )


def moe_settings(hf_config, shape: Architecture, aux_loss_coeff: float = 0.0) -> dict:
    """TransformerConfig fields that make Megatron's MoE layer compute what HF Qwen3-MoE computes.

    HF routes with softmax over all experts, top-k, then (``norm_topk_prob``) renormalises the k
    probabilities, which equals Megatron's default softmax over the top-k logits; without the
    renormalisation it is Megatron's ``moe_router_pre_softmax``. The switch load-balancing loss
    only with ``aux_loss_coeff`` > 0 (off by default: the RL loss is the objective); no z-loss,
    no token dropping, one expert MLP after the other.
    """
    if not shape.num_experts:
        if aux_loss_coeff:
            raise ValueError(
                f"actor.megatron.moe_aux_loss_coeff={aux_loss_coeff}: the model has no experts; set it to 0"
            )
        return {}
    return dict(
        num_moe_experts=shape.num_experts,
        moe_router_topk=shape.experts_per_token,
        moe_ffn_hidden_size=shape.moe_intermediate_size,
        moe_router_pre_softmax=not hf_config.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_grouped_gemm=False,
    )


def transformer_config(hf_config, dtype: torch.dtype, layout: MegatronConfig | None = None):
    """The TransformerConfig equivalent of a Qwen2 / Qwen3 / Llama / Qwen3-MoE HF config (no fusions).

    ``layout`` (``actor.megatron``) gives the parallel sizes, FP8, sequence parallelism, recompute
    and the router loss. Experts are tensor-parallel over the TP ranks (Megatron's default expert TP).
    """
    from megatron.core.transformer import TransformerConfig

    layout = layout or MegatronConfig()
    parallel = Parallelism.of(layout)
    shape = convert.model_shape(hf_config)
    check_expert_layout(shape, parallel, layout.sequence_parallel)
    on_cpu = not torch.cuda.is_available()
    qkv_bias = hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
    return TransformerConfig(
        **moe_settings(hf_config, shape, layout.moe_aux_loss_coeff),
        qk_layernorm=shape.qk_norm,
        num_layers=shape.num_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        virtual_pipeline_model_parallel_size=parallel.virtual,
        context_parallel_size=parallel.context,
        expert_model_parallel_size=parallel.expert,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # the actor loss is already normalised by the mini-batch-wide token count: gradients are summed
        calculate_per_token_loss=True,
        # micro-batches are trimmed to their own width; the interleaved schedule needs one shape
        variable_seq_lengths=parallel.pipeline > 1 and not parallel.virtual,
        # interleaved, a rank's previous and next stage can be the same peer (PP = 2): batched p2p
        # posts its sends and receives in one order on every rank and pairs activations with
        # gradients of the same shape; the unbatched ops order them by rank parity
        batch_p2p_comm=not parallel.virtual,
        moe_token_dispatcher_type="alltoall",  # the only dispatcher that accepts variable sequence lengths
        use_cpu_initialization=on_cpu,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        **layer_options(layout),
    )


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


def layer_spec(transformer_impl: str, shape: Architecture):
    """Megatron's GPT layer spec; MoE layers get the sequential expert MLP (no grouped GEMM). The
    local spec's core attention is torch SDPA (:mod:`~nemo_dapo.policy.megatron.attention`): fused
    kernels, packed rows."""
    from megatron.core.models.gpt import gpt_layer_specs

    from nemo_dapo.policy.megatron.attention import SdpaAttention

    options = {"num_experts": shape.num_experts or None, "qk_layernorm": shape.qk_norm}
    if transformer_impl == "transformer_engine":
        return with_padding_mask(gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**options))
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **options)
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    return spec


def with_padding_mask(spec):
    """TE's attention in Megatron's spec is causal only and would let tokens attend to the left
    padding of a prompt; ``padding_causal`` takes the padding mask as well."""
    from megatron.core.transformer.enums import AttnMaskType

    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.padding_causal
    return spec


def build_gpt_model(hf_config, config, transformer_impl: str = "local", vp_stage: int | None = None):
    """GPTModel for this rank's pipeline stage (its ``vp_stage``-th chunk with virtual stages);
    logits left split over TP (``parallel_output=True``: :mod:`~nemo_dapo.policy.megatron.vocab` never gathers them)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    shape = convert.model_shape(hf_config)
    if shape.num_experts:
        define_router_gemm_without_te()
    place = {"ignore_virtual": vp_stage is None, "vp_stage": vp_stage}
    return GPTModel(
        config,
        layer_spec(transformer_impl, shape),
        vocab_size=padded_vocab_size(shape.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(**place),
        post_process=parallel_state.is_pipeline_last_stage(**place),
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
        parallel_output=True,
        vp_stage=vp_stage,
    )


def read_hf_weights(model_path: str, wanted: Callable[[str], bool] = lambda name: True) -> dict[str, torch.Tensor]:
    """The folder's weights, or only those ``wanted``: the others are never read. The files are
    the ones its ``model.safetensors.index.json`` names, else ``model.safetensors`` (as
    transformers reads them: a stray shard beside them is not the model's)."""
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for file in hf_weight_files(model_path):
        with safe_open(os.path.join(model_path, file), framework="pt") as handle:
            weights.update({name: handle.get_tensor(name) for name in handle.keys() if wanted(name)})
    return weights


def hf_weight_files(model_path: str) -> list[str]:
    import json

    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            return sorted(set(json.load(handle)["weight_map"].values()))
    if os.path.isfile(os.path.join(model_path, "model.safetensors")):
        return ["model.safetensors"]
    raise InputError(
        f"{model_path}: no model.safetensors and no model.safetensors.index.json; give a Hugging Face "
        "model folder with safetensors weights"
    )


def chunk_needs(shape: Architecture, vp_stage: int = 0) -> Callable[[str], bool]:
    """Which HF tensors this rank's ``vp_stage``-th chunk is built from (a rank reads about
    1 / (PP x virtual stages) of a dense model, and 1 / EP of the experts)."""
    from megatron.core import parallel_state as ps

    index, count = chunk_index(vp_stage), num_chunks()
    layers = convert.stage_layers(shape.num_layers, index, count)
    ep = (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())
    return lambda name: convert.hf_name_needed(name, shape, layers, index == 0, index == count - 1, *ep)


VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def full_megatron_state(hf: dict[str, torch.Tensor], shape: Architecture, tp_size: int) -> dict[str, torch.Tensor]:
    """GPTModel parameters (vocabulary padded to divide over TP) of the given HF tensors: the whole
    model's, or the share :func:`chunk_needs` selects."""
    padded = padded_vocab_size(shape.vocab_size, tp_size)
    return {
        k: convert.pad_vocab(v, padded) if k in VOCAB_ROWS else v for k, v in convert.hf_to_megatron(hf, shape).items()
    }


def local_weights(
    full: dict[str, torch.Tensor], shape: Architecture, tp_size: int, vp_stage: int = 0
) -> dict[str, torch.Tensor]:
    """One chunk's (stage-sliced, EP-sliced, TP- or expert-TP-sharded) parameters from
    :func:`full_megatron_state`; a pipeline rank holds one chunk, or ``virtual`` interleaved ones."""
    from megatron.core import parallel_state as ps

    stage = convert.stage_state(full, shape, chunk_index(vp_stage), num_chunks())
    if shape.num_experts:
        stage = convert.slice_experts(
            stage, shape, ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
        )
    dense = (ps.get_tensor_model_parallel_rank(), tp_size)
    expert = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    return {k: convert.shard(k, v, *(expert if convert.is_expert(k) else dense)) for k, v in stage.items()}


# The TransformerEngine spec fuses each pre-norm into the linear layer after it.
TE_FUSED_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _rename_layer_suffixes(state: dict[str, torch.Tensor], renames: dict[str, str]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        match = convert.MEGATRON_LAYER.fullmatch(name)
        if match and match.group(2) in renames:
            name = f"decoder.layers.{match.group(1)}.{renames[match.group(2)]}"
        out[name] = tensor
    return out


def uses_fused_norms(names) -> bool:
    return any(name.endswith(TE_FUSED_NORMS["input_layernorm.weight"]) for name in names)


def to_te_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Local-spec parameter names -> TransformerEngine-spec names (norms fused into the linears)."""
    renames = dict(TE_FUSED_NORMS)
    if any(name.endswith("mlp.router.weight") for name in state):
        del renames["pre_mlp_layernorm.weight"]  # MoE layers keep it: no single linear follows it
    return _rename_layer_suffixes(state, renames)


def to_local_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_te_names`."""
    return _rename_layer_suffixes(state, {v: k for k, v in TE_FUSED_NORMS.items()})


def load_local_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy into the existing parameters (keeps DDP's contiguous buffers intact)."""
    params = dict(model.named_parameters())
    if uses_fused_norms(params):
        weights = to_te_names(weights)
    missing = set(params) - set(weights)
    unexpected = set(weights) - set(params)
    if missing or unexpected:
        raise RuntimeError(
            f"weights do not match the Megatron model: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(weights[name])


def _all_gather(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every group rank's ``tensor``, in group-rank order (``tensor`` itself for a group of one)."""
    if size == 1:
        return [tensor.detach()]
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor.detach().contiguous(), group=group)
    return out


def gather_param(name: str, param: torch.Tensor, shape: Architecture) -> dict[str, torch.Tensor]:
    """Full CPU copies of one parameter under stage-local names; collective (see :func:`takes_part_in_gather`).

    A dense parameter is gathered over TP. A local expert's parameter is gathered over expert TP,
    then over EP: the same local expert of every EP rank, each under its global expert index.
    """
    from megatron.core import parallel_state as ps

    if not convert.is_expert(name):
        tp = (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size())
        return {name: convert.unshard(name, _all_gather(param, *tp)).to("cpu", copy=True)}
    etp = (ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size())
    ep_size = ps.get_expert_model_parallel_world_size()
    full = convert.unshard(name, _all_gather(param, *etp))
    copies = _all_gather(full, ps.get_expert_model_parallel_group(), ep_size)
    return {
        convert.global_expert_name(name, ep_rank, shape.num_experts // ep_size): expert.to("cpu", copy=True)
        for ep_rank, expert in enumerate(copies)
    }


def takes_part_in_gather(name: str) -> bool:
    """Whether this rank must join :func:`gather_param` for ``name`` when only one replica exports:
    the first data-parallel replica (its first context-parallel rank) gathers dense parameters, the
    first expert-data-parallel replica (which spans several data-parallel replicas when EP > 1) the
    experts."""
    from megatron.core import parallel_state as ps

    if convert.is_expert(name):
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank(with_context_parallel=True) == 0
