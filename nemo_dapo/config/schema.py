"""The one typed config schema. Every default lives here; YAML presets in conf/ override them.

Names follow the DAPO reference recipe where it has one (clip_ratio_high, filter_groups,
overlong_buffer, loss_agg_mode, ...), so a verl user recognises the knobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    max_prompt_length: int = 2048
    max_response_length: int = 20480
    train_batch_size: int = 512  # prompts per training step
    gen_batch_size: Optional[int] = None  # prompts per generation round; None = train_batch_size
    truncation: str = "left"  # left | right | error
    filter_overlong_prompts: bool = True
    shuffle: bool = True
    seed: int = 1

    @property
    def effective_gen_batch_size(self) -> int:
        return self.train_batch_size if self.gen_batch_size is None else self.gen_batch_size


@dataclass
class ModelConfig:
    path: str = ""  # Hugging Face folder (config, weights, tokenizer)
    dtype: str = "bfloat16"  # float32 | bfloat16 | float16


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    metric: str = "acc"  # acc | score | seq_reward | seq_final_reward | any reward extra field
    max_num_gen_batches: int = 10  # <= 0: unbounded
    carry_over: bool = False  # keep surplus kept groups for the next step


@dataclass
class RolloutCorrectionConfig:
    """Unset (None) fields take the preset's value, or the plain default without a preset."""

    preset: Optional[str] = None
    rollout_is: Optional[str] = None  # none | token | sequence
    rollout_is_threshold: Optional[float] = None
    rollout_is_batch_normalize: Optional[bool] = None
    rollout_rs: Optional[str] = None  # e.g. "seq_mean_k1" or "token_k1,seq_max_k2"
    rollout_rs_threshold: Optional[str] = None  # e.g. "0.999_1.001" (k1) or "2.0" (k2/k3)
    bypass_mode: Optional[bool] = None
    loss_type: Optional[str] = None  # ppo_clip | reinforce


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    # DAPO's overlong filtering: responses the engine stopped at data.max_response_length leave the
    # loss and its denominators (their group keeps their score for advantages and dynamic sampling)
    overlong_filtering: bool = False
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 10
    lr_schedule: str = "constant"  # constant | cosine (after warm-up)
    min_lr_ratio: float = 0.0
    clip_grad: float = 1.0


@dataclass
class MegatronConfig:
    """Parallel layout and precision of the megatron policy backend (ignored by ``torch``).

    The world is ``actor.num_workers`` ranks (one per GPU); DP = world / (TP x PP x CP). Experts
    are laid out as TP x EP x PP with expert DP = world / (TP x EP x PP) (expert TP = TP).
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None  # interleaved 1F1B model chunks per rank; None = off
    context_parallel_size: int = 1  # ranks sharing each packed row (> 1 needs sequence_packing)
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False  # needs transformer_engine and TP > 1
    transformer_impl: str = "local"  # local (CPU or GPU) | transformer_engine (GPU; fp8 and SP need it)
    use_distributed_optimizer: bool = True  # shard fp32 master weights + Adam moments over DP
    overlap_grad_reduce: bool = False  # start each bucket's reduce-scatter inside the last backward
    overlap_param_gather: bool = False  # gather updated shards during the next forward (distributed optimizer)
    ddp_bucket_size: Optional[int] = None  # parameters per communication bucket; None = Megatron's default
    fp8: Optional[str] = None  # None | hybrid | e4m3 (TransformerEngine, GPU only)
    fp8_recipe: str = "delayed"  # delayed | tensorwise | blockwise | mxfp8
    recompute_granularity: Optional[str] = None  # None | full | selective
    moe_aux_loss_coeff: float = 0.0  # MoE router load-balancing loss per routed token; 0 = off (RL loss only)
    sequence_packing: bool = False  # micro-batch rows end to end, no padding (THD: each row attends to itself)


@dataclass
class ActorConfig:
    backend: str = "torch"  # torch | megatron
    num_workers: int = 1  # data-parallel training processes (torch backend)
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 10.0
    # the policy loss by name (nemo_dapo/algo/policy_losses.py): dapo (decoupled + dual clip),
    # gspo, gspo_token, cispo, gmpo, or "your.module:name" for one you registered yourself
    policy_loss: str = "dapo"
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None  # seq-mean-token-sum-norm constant; None = max_response_length
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 32  # prompts per optimizer step
    max_token_len_per_micro_batch: int = 16384
    # response positions per output-layer chunk when computing log-probs and entropy (recomputed in
    # backward, so a micro-batch's [tokens, vocab] logits never exist). None: 128 MiB of fp32 logits
    logits_chunk_tokens: Optional[int] = None
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class ValSamplingConfig:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 0.7
    do_sample: bool = True


@dataclass
class RolloutConfig:
    num_workers: int = 1
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.8
    n: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    val: ValSamplingConfig = field(default_factory=ValSamplingConfig)


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    len: int = 4096
    penalty_factor: float = 1.0


@dataclass
class RewardConfig:
    scorer: str = "math_dapo"  # math_dapo | math_verify
    num_workers: int = 2
    timeout_s: float = 10.0
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class CheckpointConfig:
    resume: str = "auto"  # auto | disable | <path to a checkpoint folder>
    keep_last: int = 2
    # megatron backend: the sharded state is written by a background process while training goes
    # on; the checkpoint becomes visible (manifest, rename, `latest`) once every rank finished
    async_save: bool = False


@dataclass
class TrainerConfig:
    mode: str = "sync"  # sync | async
    parameter_sync_step: int = 1  # async: local updates between two weight syncs
    max_staleness: int = 1  # async: oldest policy lag (versions) a trajectory may have; older ones are dropped
    experiment_name: str = "dapo"
    output_dir: str = "outputs/dapo"
    total_epochs: int = 1
    total_training_steps: Optional[int] = None  # None: epochs x batches per epoch
    # stop once this many samples were generated (sync mode): a budget that is fair to dynamic
    # sampling, whose steps generate more than train_batch_size x n. None: steps only
    total_generated_samples: Optional[int] = None
    test_freq: int = 5  # <= 0: no periodic validation
    save_freq: int = 5  # <= 0: no periodic checkpoint
    val_before_train: bool = True
    seed: int = 1
    loggers: list[str] = field(default_factory=lambda: ["console", "tensorboard"])
    nnodes: int = 1
    n_gpus_per_node: int = 8  # 0: CPU mode (workers are plain processes)
    # GPU mode: training ranks and vLLM engines share every GPU and take turns (the engines sleep
    # while the policy trains). false: each group gets GPUs of its own. Ignored in CPU mode.
    colocate: bool = False
    # CPU threads of each policy, reference and rollout worker. None: the cores of its node divided
    # among the workers of its group there (all the cores on a CPU machine, whose stages take turns)
    cpu_threads_per_worker: Optional[int] = None
    # the longest the driver waits on one call of a worker group (engine start, generate, log-probs,
    # update, weight sync, checkpoint save) before failing with the group, call and ranks named.
    # A dead worker fails at once. None: wait forever
    remote_timeout_s: Optional[float] = 7200.0


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
