"""The one typed config schema: every default, help text and list of allowed values lives here
and in its two larger sections, ``schema_actor.py`` and ``schema_algorithm.py`` (fields declared
with ``declare.py``'s :func:`setting` and :func:`section`).

YAML presets in conf/ override the defaults. Each leaf is declared with :func:`setting`, whose
help text feeds ``nemo-dapo config --explain KEY`` and the generated ``docs/configuration.md``,
and whose ``choices`` are what start-up validation accepts (``config/validate.py`` reads them
from here, so the allowed values are written once). Names follow the DAPO reference recipe
where it has one (clip_ratio_high, filter_groups, overlong_buffer, loss_agg_mode, ...), so a
verl user recognises the knobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nemo_dapo.config.declare import section, setting
from nemo_dapo.config.schema_actor import ActorConfig
from nemo_dapo.config.schema_algorithm import AlgorithmConfig


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
    drop_duplicate_prompts: bool = setting(
        False,
        help="Train on the first row of each repeated problem only (same data_source, prompt and ground "
        "truth; kept rows keep their row index); the log counts the repeats either way. false trains on "
        "the files as shipped: DAPO-Math-17k holds ~17.9k problems ~100 times each (1.79M rows), as the "
        "DAPO paper trained; true keeps ~1/100 of its rows, so an epoch (trainer.total_epochs) is ~100x "
        "fewer steps. Changing it on a resume changes which prompts are drawn. Validation files are "
        "always folded: one row per problem, sampled rollout.val.n times.",
    )
    shuffle: bool = setting(
        True, help="Shuffle the prompts every epoch (resumable: the order is a function of seed and epoch)."
    )
    seed: int = setting(1, help="Seed of the prompt order.")

    @property
    def effective_gen_batch_size(self) -> int:
        return self.train_batch_size if self.gen_batch_size is None else self.gen_batch_size

    @property
    def max_sequence_length(self) -> int:
        """The longest prompt and response together: the engines' model length, the memory model's."""
        return self.max_prompt_length + self.max_response_length


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
class ValSamplingConfig:
    n: int = setting(1, bounds=">= 1", help="Samples per validation prompt (acc/mean@n, pass@n).")
    temperature: float = setting(1.0, bounds="[0, 2]", help="Validation sampling temperature (with do_sample).")
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
        1.0, bounds="(0, 2]", help="Training sampling temperature; the trainer's log-probs use the same one."
    )
    top_p: float = setting(1.0, bounds="(0, 1]", help="Training nucleus sampling (1.0: off, as DAPO).")
    top_k: int = setting(-1, help="Training top-k sampling (-1: off).")
    val: ValSamplingConfig = section(ValSamplingConfig, "Sampling for validation.")
    timeout_s: Optional[float] = setting(
        None,
        help="Longest the driver waits on one engine call (a generation round, a weight update); "
        "an engine silent that long is treated as dead. null: trainer.remote_timeout_s (made that "
        "value when the config loads).",
    )
    max_inflight: Optional[int] = setting(
        None,
        bounds=">= 1",
        help="trainer.mode=stream: samples one engine runs at once; groups of n enter as others "
        "finish. null: every sample the staleness bound admits ((max_staleness + 1) x "
        "train_batch_size x n, over the engines, at least n), made that value when the config loads.",
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
        "auto",
        choices=("auto", "gloo", "nccl", "ipc", "object_store"),
        help="How the weights reach the engines after each update (docs/architecture.md, Weight sync). "
        "gloo: the training ranks that export them (one per pipeline stage) broadcast straight to every "
        "worker of every engine through vLLM's weight-transfer API, through host memory, nothing through "
        "the driver; nccl: vLLM's own nccl backend, GPU to GPU, for engines on GPUs of their own and one "
        "exporting rank (no pipeline stages): NOT YET RUN on a GPU; ipc: vLLM's CUDA-IPC backend, refused "
        "(it needs every training rank to hold every weight whole on its GPU, and ours hold shards); "
        "object_store: buckets through Ray's object store, a queue per engine. auto: nccl where it "
        "applies on GPUs, gloo otherwise (CPUs, colocated engines, pipeline stages).",
    )
    min_engines: Optional[int] = setting(
        None,
        bounds=">= 1",
        help="Engines the run goes on with when rollout nodes are lost (trainer.rollout_pool): a lost "
        "node's engines leave the run, their prompts go to the others, and they come back at a weight "
        "sync once the node is in Ray again; with fewer than this the run fails and the job requeues. "
        "A lost node of the training pool always requeues. null: 1 with a rollout pool, else "
        "rollout.num_workers (every engine needed).",
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
    save_by: Optional[float] = setting(
        None,
        bounds="> 0",
        help="A Unix time by which the run's last checkpoint must be written (the job's end less a "
        "margin; slurm/dapo_32b.sbatch sets it from Slurm's end time and SAVE_MARGIN_S). Before each "
        "step the trainer adds its slowest recent step (with validation when one is due) and its last "
        "save to the clock; past save_by it checkpoints and stops as on USR1 (exit 3, the job "
        "requeues). null: no deadline.",
    )


@dataclass
class RolloutPoolConfig:
    nnodes: int = setting(
        0,
        bounds=">= 0",
        help="Nodes of the job that run only vLLM engines (the rollout pool: a partition of its own, e.g. "
        "H20 beside H800, one Slurm heterogeneous job, slurm/dapo_pools.sbatch). Then trainer.nnodes, "
        "n_gpus_per_node and gpu_model describe the training pool, the engines go to this pool, a lost "
        "rollout node costs its engines instead of the run (rollout.min_engines), and "
        "trainer.colocate must be false. 0: one pool, every worker on the trainer.nnodes nodes.",
    )
    n_gpus_per_node: int = setting(
        8, bounds=">= 0", help="GPUs per rollout node; 0: CPU mode (as trainer.n_gpus_per_node, which must agree)."
    )
    gpu_model: Optional[str] = setting(
        None,
        choices=("H800", "H100", "H20", "H200"),
        help="The rollout nodes' GPU (`nemo-dapo plan` sizes the engines' memory for it). null: as trainer.gpu_model.",
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
    rollout_pool: RolloutPoolConfig = section(
        RolloutPoolConfig, "Nodes of the job for the engines alone (docs/cluster.md, Two pools)."
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
