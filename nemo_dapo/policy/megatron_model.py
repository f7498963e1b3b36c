"""Build a Megatron-core GPTModel from a Hugging Face folder, and move weights in and out.

Process groups: gloo over a FileStore (no listener) when there is no GPU, NCCL otherwise.
Weights enter as HF tensors (converted, pipeline-sliced and TP-sharded per rank by
:mod:`nemo_dapo.policy.megatron_convert`) and leave the same way, gathered over TP and PP.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_dapo.policy import megatron_convert as convert


@dataclass(frozen=True)
class Parallelism:
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1


def init_distributed(rank: int, world_size: int, rendezvous: str, parallel: Parallelism, seed: int) -> None:
    """Default group (loopback only) + Megatron's TP/PP/DP/EP groups + the model-parallel RNG."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(rendezvous, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor, pipeline_model_parallel_size=parallel.pipeline,
            expert_model_parallel_size=parallel.expert)
    model_parallel_cuda_manual_seed(seed)


def rope_theta(hf_config) -> float:
    """transformers 5 keeps it in ``rope_parameters``; older versions on the config itself."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


TRANSFORMER_IMPLS = ("local", "transformer_engine")


def check_transformer_impl(transformer_impl: str, fp8: str | None) -> None:
    """TransformerEngine (and so FP8) needs a GPU and the ``transformer_engine`` package."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl must be one of {TRANSFORMER_IMPLS}, not {transformer_impl!r}")
    if transformer_impl == "transformer_engine" and not torch.cuda.is_available():
        raise ValueError("transformer_impl='transformer_engine' needs a GPU; use 'local' on the CPU")
    if fp8 and transformer_impl != "transformer_engine":
        raise ValueError("fp8 training needs transformer_impl='transformer_engine'")


def transformer_config(hf_config, parallel: Parallelism, dtype: torch.dtype, fp8: str | None = None,
                       fp8_recipe: str = "delayed"):
    """The TransformerConfig equivalent of a Qwen2 / Llama HF config (no fusions).

    ``fp8`` ('hybrid' or 'e4m3', TransformerEngine layer spec only) turns on FP8 GEMMs with
    ``fp8_recipe`` scaling; weights and optimizer state stay in ``dtype`` / fp32.
    """
    from megatron.core.transformer import TransformerConfig

    shape = convert.ModelShape.from_hf_config(hf_config)
    on_cpu = not torch.cuda.is_available()
    qkv_bias = hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=hf_config.hidden_size, num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=qkv_bias,
        hidden_dropout=0.0, attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
        tensor_model_parallel_size=parallel.tensor, pipeline_model_parallel_size=parallel.pipeline,
        expert_model_parallel_size=parallel.expert, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        # the actor loss is already normalised by the mini-batch-wide token count: gradients are summed
        calculate_per_token_loss=True,
        variable_seq_lengths=parallel.pipeline > 1,  # micro-batches are trimmed to their own width
        moe_token_dispatcher_type="alltoall",  # the only dispatcher that accepts variable sequence lengths
        use_cpu_initialization=on_cpu, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        fp8=fp8, fp8_recipe=fp8_recipe)


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


def layer_spec(transformer_impl: str):
    from megatron.core.models.gpt import gpt_layer_specs

    if transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")


def build_gpt_model(hf_config, config, transformer_impl: str = "local"):
    """GPTModel for this rank's pipeline stage; logits gathered over TP (``parallel_output=False``)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    shape = convert.ModelShape.from_hf_config(hf_config)
    return GPTModel(
        config, layer_spec(transformer_impl),
        vocab_size=padded_vocab_size(shape.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=shape.tied_embeddings, position_embedding_type="rope",
        rotary_base=rope_theta(hf_config), parallel_output=False)


def read_hf_weights(model_path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(model_path)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(model_path, name)))
    return weights


VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def local_weights(hf: dict[str, torch.Tensor], shape: convert.ModelShape, tp_size: int) -> dict[str, torch.Tensor]:
    """This rank's (stage-sliced, TP-sharded) GPTModel parameters from HF tensors."""
    from megatron.core import parallel_state

    full = convert.hf_to_megatron(hf, shape)
    padded = padded_vocab_size(shape.vocab_size, tp_size)
    full = {k: convert.pad_vocab(v, padded) if k in VOCAB_ROWS else v for k, v in full.items()}
    stage = convert.stage_state(full, shape, parallel_state.get_pipeline_model_parallel_rank(),
                                parallel_state.get_pipeline_model_parallel_world_size())
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return {k: convert.shard(k, v, tp_rank, tp_size) for k, v in stage.items()}


# The TransformerEngine spec fuses each pre-norm into the linear layer after it.
TE_FUSED_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                  "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


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
    return _rename_layer_suffixes(state, TE_FUSED_NORMS)


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
        raise RuntimeError(f"weights do not match the Megatron model: missing {sorted(missing)}, "
                           f"unexpected {sorted(unexpected)}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(weights[name])


def gather_hf_weights(model: torch.nn.Module, shape: convert.ModelShape) -> dict[str, torch.Tensor]:
    """HF-named full tensors, gathered over TP (all-gather) and PP (object all-gather); on every rank.

    A tied ``lm_head.weight`` is included (as the torch worker's state dict does) so generation
    engines receive the same names from either backend.
    """
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    stage = {}
    for name, param in model.named_parameters():
        shards = [torch.empty_like(param) for _ in range(tp_size)]
        if tp_size > 1:
            dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
        else:
            shards = [param.detach().clone()]
        stage[name] = convert.unshard(name, shards).cpu()  # HF copies live on the CPU, as the torch worker's
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    stages = [stage]
    if pp_size > 1:
        stages = [None] * pp_size
        dist.all_gather_object(stages, stage, group=parallel_state.get_pipeline_model_parallel_group())
    full = to_local_names(convert.unstage_state(stages, shape))
    full = {k: v[: shape.vocab_size] if k in VOCAB_ROWS else v for k, v in full.items()}
    hf = convert.megatron_to_hf(full, shape)
    if shape.tied_embeddings:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    return hf
