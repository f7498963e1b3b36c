"""The one typed config schema: every default, help text and list of allowed values lives here.

YAML presets in conf/ override the defaults. Each leaf is declared with :func:`setting`, whose
help text feeds ``nemo-dapo config --explain KEY`` and the generated ``docs/configuration.md``,
and whose ``choices`` are what start-up validation accepts (``config/validate.py`` reads them
from here, so the allowed values are written once). Names follow the DAPO reference recipe
where it has one (clip_ratio_high, filter_groups, overlong_buffer, loss_agg_mode, ...), so a
verl user recognises the knobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any, Optional

from nemo_dapo.algo.advantage import registered_estimators
from nemo_dapo.algo.kl import KL_PENALTY_NAMES
from nemo_dapo.algo.loss import LOSS_AGG_MODES

Choices = tuple | Callable[[], Any]


def setting(
    default: Any = MISSING,
    *,
    help: str,
    choices: Choices | None = None,
    bounds: str | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A schema field with its help text and the values validation accepts: ``choices`` for
    enumerations, ``bounds`` for numbers.

    ``choices`` is a tuple, or a function returning the names of a registry that users can
    extend (advantage estimators). ``None`` inside the tuple means null is one of the choices.
    ``bounds`` is ``">= 1"``, ``"> 0"`` (likewise ``<=``, ``<``) or an interval such as
    ``"[0, 1)"``; an optional field may also be null.
    """
    metadata = {"help": " ".join(help.split())}
    if choices is not None:
        metadata["choices"] = choices
    if bounds is not None:
        metadata["bounds"] = bounds
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type, help: str) -> Any:
    """A nested settings group, built from its class's defaults."""
    return field(default_factory=cls, metadata={"help": help})


@dataclass
class DataConfig:
    train_files: list[str] = setting(
        factory=list,
        help="Training data: parquet or JSONL files in verl's format "
        "(prompt as chat messages, reward_model.ground_truth), or <model>:<split> for "
        "the task built with a built-in model (tiny:train).",
    )
    val_files: list[str] = setting(
        factory=list,
        help="Held-out data scored every trainer.test_freq steps (val-core/<source>/acc/mean@n). Empty: no validation.",
    )
    max_prompt_length: int = setting(2048, bounds="> 0", help="Longest prompt in tokens, chat template included.")
    max_response_length: int = setting(
        20480,
        bounds="> 0",
        help="Generation budget per response in tokens; a response that hits "
        "it ends with finish reason 'length' (see algorithm.overlong_filtering).",
    )
    train_batch_size: int = setting(512, bounds="> 0", help="Prompts per training step (each sampled rollout.n times).")
    gen_batch_size: Optional[int] = setting(
        None,
        help="Prompts per generation round; larger than train_batch_size "
        "leaves room for dynamic sampling to drop groups. null: train_batch_size.",
    )
    truncation: str = setting(
        "left",
        choices=("left", "right", "error"),
        help="What to do with a prompt over max_prompt_length when filter_overlong_prompts is "
        "off: keep its end (left), keep its start (right) or fail naming the row (error).",
    )
    filter_overlong_prompts: bool = setting(
        True,
        help="Drop prompts longer than max_prompt_length when the data "
        "loads (counted in the log) instead of truncating them.",
    )
    shuffle: bool = setting(
        True, help="Shuffle the prompts every epoch (resumable: the order is a function of seed and epoch)."
    )
    seed: int = setting(1, help="Seed of the prompt order.")

    @property
    def effective_gen_batch_size(self) -> int:
        return self.train_batch_size if self.gen_batch_size is None else self.gen_batch_size


@dataclass
class ModelConfig:
    path: str = setting(
        "",
        help="Hugging Face folder (config, safetensors, tokenizer), or the name of a model the "
        "project builds and caches itself: tiny, smollm2-135m-instruct, smollm2-135m-arith.",
    )
    dtype: str = setting(
        "bfloat16",
        choices=("float32", "bfloat16", "float16", "auto"),
        help="Compute dtype of the policy and the engines; the optimizer keeps fp32 master weights and "
        "log-prob / entropy reductions are fp32 whatever it is. auto: bfloat16 on GPUs and on CPUs "
        "with bf16 matrix instructions (AMX, AVX-512 BF16), float32 on other CPUs (resolved when the "
        "config is loaded; the saved config records the choice).",
    )


@dataclass
class KLControlConfig:
    type: str = setting(
        "fixed",
        choices=("fixed", "adaptive"),
        help="KL-in-reward coefficient: fixed, or adaptive (steered towards target_kl, Ziegler et al. 2019).",
    )
    kl_coef: float = setting(0.001, help="KL-in-reward coefficient (the starting value when adaptive).")
    horizon: int = setting(10000, help="Adaptive controller: samples over which the coefficient moves by at most 20%.")
    target_kl: float = setting(0.1, help="Adaptive controller: the KL per token it steers towards.")


@dataclass
class FilterGroupsConfig:
    enable: bool = setting(
        False,
        help="DAPO's dynamic sampling: drop groups whose samples all score the same "
        "(zero advantage, no gradient) and generate more rounds until train_batch_size groups "
        "remain.",
    )
    metric: str = setting(
        "acc",
        help="Per-sample value whose spread decides if a group is kept: acc, score, seq_reward (the sum "
        "of the token scores, overlong shaping included), seq_final_reward (the same: the filter runs "
        "before a KL-in-reward term exists, so it is refused with use_kl_in_reward), or any extra field "
        "the reward returns (e.g. overlong_reward).",
    )
    max_num_gen_batches: int = setting(
        10,
        help="Most generation rounds per step before the run fails (the "
        "error says how many groups were kept); <= 0: unbounded.",
    )
    carry_over: Optional[bool] = setting(
        None,
        help="Keep the kept groups beyond train_batch_size for the next step instead of dropping them. "
        "null: the mode's way: dropped in sync, kept in stream (which has no other).",
    )


@dataclass
class RolloutCorrectionConfig:
    """Training on rollouts the engine sampled with slightly different numerics (or an older policy).

    Unset (null) fields take the preset's value, or the plain default without a preset.
    """

    preset: Optional[str] = setting(
        None,
        help="Named combination: decoupled_token_is, decoupled_seq_is, "
        "decoupled_geo_rs, bypass_pg_is, ... (nemo_dapo/algo/correction.py). Fields set "
        "beside it override it.",
    )
    rollout_is: Optional[str] = setting(
        None,
        choices=("none", "token", "sequence"),
        help="Importance weights pi_old/pi_rollout, truncated and detached, per token "
        "or per sequence (product over tokens). none: off.",
    )
    rollout_is_threshold: Optional[float] = setting(None, help="Upper truncation of the IS weights (default 2.0).")
    rollout_is_batch_normalize: Optional[bool] = setting(
        None, help="Rescale the IS weights to mean 1 over the batch's valid tokens."
    )
    rollout_rs: Optional[str] = setting(
        None,
        help="Rejection sampling: comma list of <level>_<stat> with level in "
        "token, seq_sum, seq_mean, seq_max and stat in k1, k2, k3, e.g. seq_mean_k1 "
        "(masks samples whose rollout/old divergence is out of bounds).",
    )
    rollout_rs_threshold: Optional[str] = setting(
        None,
        help="One bound per rollout_rs mode: 'lower_upper' ratio "
        "range for k1 (e.g. 0.999_1.001), an upper bound for k2/k3.",
    )
    bypass_mode: Optional[bool] = setting(
        None, help="Skip the old-log-prob pass: the rollout's log-probs act as pi_old (one forward less per step)."
    )
    loss_type: Optional[str] = setting(
        None,
        choices=("ppo_clip", "reinforce"),
        help="Bypass mode's loss: ppo_clip (the clipped policy loss on rollout "
        "ratios) or reinforce (IS-weighted policy gradient, needs bypass_mode).",
    )


@dataclass
class AlgorithmConfig:
    adv_estimator: str = setting(
        "grpo",
        choices=registered_estimators,
        help="Advantage estimator by registry name (@register_adv_est): grpo is the "
        "group-normalised reward (Shao et al. 2024).",
    )
    norm_adv_by_std: bool = setting(
        True, help="GRPO: divide by the group's reward std (false: Dr. GRPO's mean-only baseline, Liu et al. 2025)."
    )
    use_kl_in_reward: bool = setting(
        False,
        help="Subtract kl_ctrl.kl_coef x KL(policy || reference) from the reward per token (builds a reference model).",
    )
    kl_penalty: str = setting(
        "kl",
        choices=KL_PENALTY_NAMES,
        help="KL estimator of the in-reward penalty: kl/k1, abs, mse/k2, low_var_kl/k3, full; "
        "a '+' suffix uses the straight-through form.",
    )
    kl_ctrl: KLControlConfig = section(KLControlConfig, "Coefficient of the KL-in-reward penalty.")
    overlong_filtering: bool = setting(
        False,
        help="DAPO's overlong filtering: responses the engine stopped at "
        "data.max_response_length leave the loss and its denominators; their group "
        "keeps their score for advantages and dynamic sampling.",
    )
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig, "Dynamic sampling (DAPO).")
    rollout_correction: RolloutCorrectionConfig = section(
        RolloutCorrectionConfig, "Rollout correction: IS weights and rejection sampling against the engine's log-probs."
    )


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
    are laid out as TP x EP x PP with expert DP = world / (TP x EP x PP) (expert TP = TP).
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
        None, help="seq-mean-token-sum-norm's constant divisor; null: data.max_response_length."
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


@dataclass
class ValSamplingConfig:
    n: int = setting(1, bounds=">= 1", help="Samples per validation prompt (acc/mean@n, pass@n).")
    temperature: float = setting(1.0, help="Validation sampling temperature.")
    top_p: float = setting(0.7, bounds="(0, 1]", help="Validation nucleus sampling (DAPO evaluates at 0.7).")
    do_sample: bool = setting(True, help="false: greedy decoding for validation.")


@dataclass
class RolloutConfig:
    num_workers: Optional[int] = setting(
        1,
        bounds=">= 1",
        help="vLLM engines. null: on GPUs, the job's GPUs over tensor_parallel_size, what colocation "
        "needs (the batch scripts set trainer.nnodes and n_gpus_per_node from the allocation, so a "
        "smaller bring-up needs no override); on CPUs it must be given.",
    )
    tensor_parallel_size: int = setting(1, help="GPUs per engine.")
    gpu_memory_utilization: float = setting(
        0.8, help="Fraction of each GPU an engine may take for weights and KV cache."
    )
    enforce_eager: Optional[bool] = setting(
        None,
        help="Run the engines' model eagerly (true) or compiled with CUDA graphs (false). null: eager on "
        "CPU, where compiling costs more start-up than it saves in a short run (docs/benchmarks.md); "
        "CUDA graphs on GPUs, vLLM's default, where small-batch decoding is launch-bound.",
    )
    n: int = setting(16, bounds=">= 1", help="Samples per prompt (the group size of GRPO).")
    temperature: float = setting(
        1.0, bounds="> 0", help="Training sampling temperature; the trainer's log-probs use the same one."
    )
    top_p: float = setting(1.0, bounds="(0, 1]", help="Training nucleus sampling (1.0: off, as DAPO).")
    top_k: int = setting(-1, help="Training top-k sampling (-1: off).")
    val: ValSamplingConfig = section(ValSamplingConfig, "Sampling for validation.")
    timeout_s: Optional[float] = setting(
        None,
        help="Longest the driver waits on one engine call (a generation round, a weight update); "
        "an engine silent that long is treated as dead. null: trainer.remote_timeout_s.",
    )
    max_inflight: Optional[int] = setting(
        None,
        bounds=">= 1",
        help="trainer.mode=stream: samples one engine runs at once; groups of n enter as others "
        "finish. null: every sample the staleness bound admits ((max_staleness + 1) x "
        "train_batch_size x n, over the engines).",
    )
    kv_after_update: str = setting(
        "recompute",
        choices=("recompute", "keep"),
        help="trainer.mode=stream, a weight update reaching running samples: recompute (their "
        "prompt and tokens so far are run again by the new weights, then they go on: every token "
        "is drawn on keys and values of the weights that drew it) or keep (they go on with the "
        "keys and values the old weights computed: no recompute, slightly off the new policy). "
        "Either way a sample keeps its tokens, log-probs and remaining budget.",
    )
    weight_transfer: str = setting(
        "gloo",
        choices=("gloo", "object_store"),
        help="How the weights reach the engines after each update. gloo: the training ranks that "
        "export them (one per pipeline stage) broadcast straight to each engine (its first worker passes "
        "them on to the others) through "
        "vLLM's weight-transfer API, nothing through the driver; object_store: buckets through "
        "Ray's object store, a queue per engine (docs/architecture.md, Weight sync).",
    )
    max_restarts: int = setting(
        3,
        bounds=">= 0",
        help="Engines replaced in one run after dying or hanging while generating: the new one gets "
        "the current weights and regenerates its prompts. One more failure stops the run naming the "
        "engine. 0: fail at the first.",
    )


@dataclass
class OverlongBufferConfig:
    enable: bool = setting(
        False,
        help="DAPO's soft overlong punishment: responses longer than "
        "data.max_response_length - len lose up to penalty_factor of reward, linearly.",
    )
    len: int = setting(4096, help="Length of the punishment interval at the end of the budget, in tokens.")
    penalty_factor: float = setting(1.0, bounds=">= 0", help="Reward lost at the budget's end.")


@dataclass
class RewardConfig:
    scorer: str = setting(
        "math_dapo",
        choices=("math_dapo", "math_verify"),
        help="Answer checker: math_dapo (DAPO's 'Answer:' line, exact after normalisation) or "
        "math_verify (HF math-verify, symbolic equivalence).",
    )
    num_workers: int = setting(2, help="Scoring processes.")
    timeout_s: float = setting(
        10.0,
        bounds="> 0",
        help="Longest one answer may take to score (math_verify); a timeout scores -1 and is flagged as such.",
    )
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig, "Soft overlong punishment (DAPO).")


@dataclass
class CheckpointConfig:
    resume: str = setting(
        "auto",
        help="auto (the newest checkpoint in trainer.output_dir, if any), disable, or the path of a checkpoint "
        "folder. An older checkpoint of this run rolls back: the later ones are moved to checkpoints/abandoned/ "
        "(kept), and the run goes on from there (continue it with auto).",
    )
    keep_last: int = setting(2, help="Checkpoints kept; older ones are deleted after a new one is complete.")
    async_save: bool = setting(
        False,
        help="megatron backend: a background process writes the sharded state while "
        "training goes on; the checkpoint becomes visible (manifest, rename, latest) once "
        "every rank finished.",
    )


@dataclass
class TrainerConfig:
    mode: str = setting(
        "sync",
        choices=("sync", "stream"),
        help="sync: generate, then train, then sync weights. stream: "
        "the engines generate continuously, prompts enter as others finish, groups are scored and "
        "filtered as they arrive, weights load into the running engines (docs/architecture.md, "
        "Streaming generation).",
    )
    max_staleness: int = setting(
        1,
        bounds=">= 0",
        help="stream: the bound at admission: a prompt enters "
        "only while fewer than (version + max_staleness + 1) x train_batch_size unfiltered groups "
        "were admitted, so a sample's first token lags the policy that trains on it by at most "
        "max_staleness versions (a group that still ends up older is dropped, counted, and its "
        "prompt reissued). 0: on-policy, generation and training take turns.",
    )
    max_token_staleness: Optional[int] = setting(
        None,
        bounds=">= 0",
        help="stream: tokens drawn by weights more than this many versions older than the policy "
        "that trains on them leave the loss (the rest of their sample stays); null: every token "
        "counts (the rollout correction still weighs each by its own behaviour log-prob).",
    )
    project_name: str = setting("nemo-dapo", help="W&B project and MLflow experiment the run logs into.")
    experiment_name: str = setting("dapo", help="Run name in TensorBoard, W&B and MLflow.")
    output_dir: str = setting("outputs/dapo", help="Checkpoints, logs, TensorBoard events and summary.json.")
    total_epochs: int = setting(1, bounds=">= 1", help="Passes over the training prompts.")
    total_training_steps: Optional[int] = setting(
        None, bounds=">= 1", help="Training steps; null: total_epochs x steps per epoch."
    )
    total_generated_samples: Optional[int] = setting(
        None,
        help="Stop once this many samples were generated (sync "
        "mode): a budget fair to dynamic sampling, whose steps generate "
        "more than train_batch_size x n. null: steps only.",
    )
    test_freq: int = setting(5, help="Validate every this many steps; <= 0: never.")
    save_freq: int = setting(
        5, help="Checkpoint every this many steps (and after the last one); <= 0: only at the end and at preemption."
    )
    val_before_train: bool = setting(True, help="Validate once before the first step (the baseline).")
    seed: int = setting(1, help="Seed of model init, sampling and shuffling.")
    loggers: list[str] = setting(
        factory=lambda: ["console", "tensorboard"],
        choices=("console", "tensorboard", "wandb", "mlflow"),
        help="Metric sinks (metrics.jsonl is always written). wandb and mlflow need the "
        "'loggers' extra; a resumed run continues their runs.",
    )
    log_level: str = setting(
        "info",
        choices=("info", "debug"),
        help="info: the progress bar, one line per step, and every warning but the known-harmless "
        "ones (nemo_dapo/logs.py). debug: everything the libraries print (vLLM, Ray, transformers).",
    )
    wandb_mode: Optional[str] = setting(
        None,
        choices=(None, "online", "offline"),
        help="W&B mode; offline writes to output_dir/wandb with no network (upload later with "
        "`wandb sync`). null: W&B's own default (WANDB_MODE, else online).",
    )
    mlflow_tracking_uri: Optional[str] = setting(
        None,
        help="MLflow store (a server URL or sqlite:///file.db). null: MLFLOW_TRACKING_URI, "
        "else sqlite:///<output_dir>/mlflow.db.",
    )
    nnodes: int = setting(1, help="Nodes of the job.")
    n_gpus_per_node: int = setting(8, help="GPUs per node; 0: CPU mode (workers are plain processes).")
    gpu_model: Optional[str] = setting(
        None,
        choices=("H800", "H100", "H20", "H200"),
        help="The GPU the config's memory figures are for (`nemo-dapo plan --gpu`): at start-up the "
        "head node's GPUs (nvidia-smi) must be that model, with the memory CUDA reports for it, "
        "else the run is refused naming what it found. null: not checked.",
    )
    colocate: bool = setting(
        False,
        help="GPU mode: training ranks and vLLM engines share every GPU and take turns "
        "(the engines sleep while the policy trains). false: each group gets GPUs of its own. "
        "Ignored in CPU mode.",
    )
    placement_strategy: str = setting(
        "PACK",
        choices=("PACK", "SPREAD"),
        help="Where a group's workers go when each group has resources of its own (not colocated): "
        "PACK fills one node before the next (a node's ranks talk over its fastest links), SPREAD "
        "puts consecutive workers on different nodes (one rank per CPU node).",
    )
    cpu_threads_per_worker: Optional[int] = setting(
        None,
        help="CPU threads of each policy, reference and rollout "
        "worker. null: the cores of its node divided among the workers "
        "of its group there.",
    )
    keep_freed_memory: Optional[bool] = setting(
        None,
        help="Policy, reference and rollout workers keep the memory a pass or a weight sync frees "
        "for the next one (glibc: large blocks from the heap, heap never trimmed) instead of "
        "handing it back and faulting it in again (a quarter of a CPU policy worker's time, half "
        "of a CPU weight sync). null: on in CPU mode, off on GPU nodes, where host memory should "
        "go back.",
    )
    max_nonfinite_steps: int = setting(
        3,
        help="Training steps in a row with an optimizer step skipped for a non-finite (NaN/Inf) gradient "
        "after which the run stops with exit 1, before checkpointing them; a skipped step leaves the "
        "weights and optimizer state as they were. <= 0: never stop.",
    )
    remote_timeout_s: Optional[float] = setting(
        7200.0,
        help="Longest the driver waits on one call of a worker "
        "group (engine start, generate, log-probs, update, weight sync, "
        "checkpoint) before failing with the group, call and ranks named; a "
        "dead worker fails at once. null: wait forever.",
    )


@dataclass
class Config:
    data: DataConfig = section(DataConfig, "Prompts and lengths.")
    model: ModelConfig = section(ModelConfig, "The policy's weights.")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "Advantages, KL, dynamic sampling, rollout correction.")
    actor: ActorConfig = section(ActorConfig, "The policy loss and its training backend.")
    rollout: RolloutConfig = section(RolloutConfig, "Generation by the vLLM engines.")
    reward: RewardConfig = section(RewardConfig, "Scoring the responses.")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "Saving and resuming.")
    trainer: TrainerConfig = section(TrainerConfig, "The loop, the cluster shape and logging.")
