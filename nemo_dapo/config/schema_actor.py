"""The ``actor`` section of the schema: the policy loss and update, the optimizer, the backends
(torch, megatron-core with its parallelism, packing and checkpoint settings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nemo_dapo.algo.kl import KL_PENALTY_NAMES
from nemo_dapo.algo.loss import LOSS_AGG_MODES
from nemo_dapo.config.declare import section, setting


@dataclass
class OptimConfig:
    lr: float = setting(1e-6, bounds="> 0", help="Peak learning rate of AdamW.")
    weight_decay: float = setting(0.1, help="AdamW decoupled weight decay.")
    betas: list[float] = setting(factory=lambda: [0.9, 0.999], help="AdamW (beta1, beta2).")
    eps: float = setting(1e-8, help="AdamW epsilon.")
    warmup_steps: int = setting(
        10, bounds=">= 0", help="Optimizer steps of linear warm-up to lr; the first runs at lr / warmup_steps."
    )
    lr_schedule: str = setting(
        "constant",
        choices=("constant", "cosine"),
        help="After warm-up: constant, or cosine decay to min_lr_ratio x lr at the last step.",
    )
    min_lr_ratio: float = setting(0.0, help="Cosine schedule: the final learning rate as a fraction of lr.")
    clip_grad: float = setting(1.0, bounds="> 0", help="Global gradient-norm clip.")


@dataclass
class MegatronConfig:
    """Parallel layout and precision of the megatron policy backend (ignored by ``torch``).

    The world is ``actor.num_workers`` ranks (one per GPU); DP = world / (TP x PP x CP). Experts
    are laid out as ETP x EP x PP with expert DP = world / (ETP x EP x PP), ETP the expert
    tensor parallelism (TP unless set).
    """

    tensor_model_parallel_size: int = setting(1, help="TP: ranks splitting every weight matrix.")
    pipeline_model_parallel_size: int = setting(1, help="PP: stages splitting the layers (1F1B schedule).")
    virtual_pipeline_model_parallel_size: Optional[int] = setting(
        None, help="Interleaved 1F1B: model chunks per pipeline rank (>= 2, needs PP >= 2); null: off."
    )
    context_parallel_size: int = setting(
        1, help="CP: ranks sharing each packed row's tokens (> 1 needs sequence_packing)."
    )
    expert_model_parallel_size: int = setting(1, help="EP: ranks splitting the experts of each MoE layer.")
    expert_tensor_parallel_size: Optional[int] = setting(
        None,
        bounds=">= 1",
        help="ETP: ranks splitting each expert's matrices; null: TP (megatron-core's default). An EP "
        "group is EP ranks ETP apart, so it stays inside a node when ETP x EP divides the node's GPUs "
        "(1 with EP=8 on 8-GPU nodes: the all-to-all on NVLink; start-up says when a group crosses nodes).",
    )
    sequence_parallel: bool = setting(
        False,
        help="Split norms and dropout activations along the sequence over the "
        "TP group (needs transformer_engine and TP > 1).",
    )
    transformer_impl: str = setting(
        "local",
        choices=("local", "transformer_engine"),
        help="Layer implementation: local (CPU or GPU), transformer_engine (GPU; FP8 and sequence_parallel need it).",
    )
    use_distributed_optimizer: bool = setting(True, help="Shard fp32 master weights and Adam moments over DP (ZeRO-1).")
    optimizer_checkpoint: str = setting(
        "dp_reshardable",
        choices=("dp_reshardable", "fully_reshardable"),
        help="How checkpoints store the distributed optimizer. dp_reshardable: every rank writes its own "
        "shard, nothing is gathered; resumes at any DP (and CP) size, at the saved TP, PP, virtual stages, "
        "EP, ddp_bucket_size and overlap_grad_reduce. fully_reshardable: gathered per parameter on the first "
        "rank of each DP group; resumes at any layout, but the gather holds training up at every save "
        "(measured in docs/benchmarks.md). The weights load at any layout either way.",
    )
    overlap_grad_reduce: bool = setting(
        False, help="Start each bucket's gradient reduce-scatter inside the last backward."
    )
    overlap_param_gather: bool = setting(
        False, help="Gather updated parameter shards during the next forward (needs use_distributed_optimizer)."
    )
    ddp_bucket_size: Optional[int] = setting(
        None, help="Parameters per gradient communication bucket; null: Megatron's default."
    )
    release_grad_buffers: bool = setting(
        False,
        help="Free the gradient buffers' memory from the end of an update to the next (megatron-core's "
        "offload_grad_buffers; they are zeroed before every step anyway): colocated engines wake into "
        "that much more, the gradients' line of nemo-dapo plan (7.99 GiB per GPU at the 32B preset).",
    )
    fp8: Optional[str] = setting(
        None, choices=(None, "hybrid", "e4m3"), help="FP8 training format (TransformerEngine, GPU only); null: off."
    )
    fp8_recipe: str = setting(
        "delayed", choices=("delayed", "tensorwise", "blockwise", "mxfp8"), help="FP8 scaling recipe."
    )
    recompute_granularity: Optional[str] = setting(
        None, choices=(None, "full", "selective"), help="Activation recomputation in backward; null: off."
    )
    moe_aux_loss_coeff: float = setting(
        0.0, help="MoE router load-balancing loss per routed token; 0: off (the RL loss alone moves the router)."
    )
    sequence_packing: bool = setting(
        False,
        help="Micro-batch rows end to end without padding (THD layout; each row attends only to itself). "
        "Meant for the TransformerEngine spec: the local spec attends and applies RoPE one row at a time, "
        "which is slower than padded micro-batches (docs/benchmarks.md).",
    )
    router_replay: str = setting(
        "none",
        choices=("none", "r2", "r3"),
        help="MoE routing replay (docs/moe.md): r3 trains on the experts the rollout engine picked for "
        "every token; r2 on those the trainer's own old_log_prob pass picked; none: the router decides "
        "in every pass.",
    )


@dataclass
class ActorConfig:
    backend: str = setting(
        "torch",
        choices=("torch", "megatron"),
        help="Training backend: torch (Hugging Face model, DDP over gloo/NCCL) or megatron "
        "(megatron-core: TP, PP, CP, EP, distributed optimizer).",
    )
    num_workers: int = setting(1, bounds=">= 1", help="Training ranks (one per GPU on a GPU cluster).")
    clip_ratio_low: float = setting(
        0.2,
        bounds="[0, 1)",
        help="Lower PPO clip: ratios below 1 - clip_ratio_low stop pushing down "
        "(DAPO, Yu et al. 2025, arXiv 2503.14476).",
    )
    clip_ratio_high: float = setting(
        0.28,
        bounds=">= 0",
        help="Upper PPO clip, decoupled from the lower one (DAPO's clip-higher): "
        "ratios above 1 + clip_ratio_high stop pushing up, and a larger value keeps "
        "low-probability tokens explorable (DAPO, Yu et al. 2025, arXiv 2503.14476).",
    )
    clip_ratio_c: float = setting(
        10.0,
        help="Dual-clip bound for negative advantages: the loss is capped at "
        "clip_ratio_c x |A| (Ye et al. 2020, arXiv 1912.09729); must be > 1.",
    )
    policy_loss: str = setting(
        "dapo",
        help="Policy loss by name (nemo_dapo/algo/policy_losses.py): dapo (decoupled "
        "+ dual clip), gspo and gspo_token (Zheng et al. 2025, arXiv 2507.18071), cispo "
        "(MiniMax-M1, arXiv 2506.13585), gmpo (arXiv 2507.20673), or 'your.module:name' for "
        "one registered with @register_policy_loss.",
    )
    loss_agg_mode: str = setting(
        "token-mean",
        choices=LOSS_AGG_MODES,
        help="How token losses become the batch loss: token-mean (DAPO's token-level loss), "
        "seq-mean-token-mean (GRPO), seq-mean-token-sum, seq-mean-token-sum-norm "
        "(Dr. GRPO: divided by loss_scale_factor).",
    )
    loss_scale_factor: Optional[float] = setting(
        None,
        help="seq-mean-token-sum-norm's constant divisor; null: data.max_response_length (made that "
        "value when the config loads).",
    )
    entropy_coeff: float = setting(0.0, help="Entropy bonus coefficient (0 in DAPO).")
    use_kl_loss: bool = setting(
        False, help="Add kl_loss_coef x KL(policy || reference) to the loss (builds a reference model; DAPO uses none)."
    )
    kl_loss_coef: float = setting(0.001, help="Coefficient of the KL loss.")
    kl_loss_type: str = setting(
        "low_var_kl", choices=KL_PENALTY_NAMES, help="KL estimator of the KL loss (low_var_kl = k3, Schulman 2020)."
    )
    ppo_epochs: int = setting(1, bounds=">= 1", help="Passes over each step's batch.")
    ppo_mini_batch_size: int = setting(
        32, help="Prompts per optimizer step (with their rollout.n samples); must divide data.train_batch_size."
    )
    attn_implementation: str = setting(
        "auto",
        choices=("auto", "sdpa", "eager"),
        help="Attention of the torch backend's Hugging Face model (transformers' attn_implementation). "
        "eager (matmul + softmax) trains faster on a CPU for short sequences (SDPA's CPU backward in "
        "bf16 is the slow part; docs/benchmarks.md); it keeps each layer's [heads, seq, seq] probabilities for the "
        "backward, so its memory grows with the square of the sequence length. auto: eager for "
        "the torch backend on CPUs when prompt + response fit 512 tokens, sdpa otherwise. The "
        "megatron backend and the engines use their own kernels.",
    )
    old_log_prob_from_forward: bool = setting(
        True,
        help="Take the first mini-batch's old log-probs from its own training forward (the weights "
        "have not moved yet: the same numbers) instead of scoring its rows in the old_log_prob pass, "
        "which then covers the other mini-batches only, and disappears with one mini-batch per step. "
        "Used only where exact: ppo_epochs=1, no KL in the reward, no IS weights or rejection sampling "
        "(they need old log-probs before the loss), no MoE routing replay. The old policy's metrics "
        "(actor/entropy_old, rollout_corr/*) still cover the whole batch.",
    )
    shared_prompt_forward: Optional[bool] = setting(
        None,
        help="Run each distinct prompt of a micro-batch through the decoder once, and its samples' "
        "responses on that prompt's keys and values, instead of every row whole: a GRPO group's "
        "rollout.n samples share one prompt. The same log-probs and gradients (float summation order "
        "aside) for fewer tokens: the more of a row its prompt is, the more is saved (docs/benchmarks.md). "
        "Rows with MoE routing to replay run whole. "
        "null: on for the torch backend; the megatron backend runs rows whole (true is refused there).",
    )
    max_token_len_per_micro_batch: int = setting(
        16384,
        bounds="> 0",
        help="Token budget of one forward/backward micro-batch "
        "(per rank); sequences are packed into micro-batches by length. With shared_prompt_forward, "
        "a prompt its rows share counts once, as it is computed once.",
    )
    logits_chunk_tokens: Optional[int] = setting(
        None,
        help="Response positions per output-layer chunk when "
        "computing log-probs and entropy (recomputed in backward, so the "
        "[tokens, vocab] logits never exist at once); null: 128 MiB of "
        "fp32 logits per chunk.",
    )
    optim: OptimConfig = section(OptimConfig, "Optimizer and learning-rate schedule.")
    megatron: MegatronConfig = section(MegatronConfig, "Parallel layout and precision of the megatron backend.")
