"""`nemo-dapo plan CONFIG`: will this model and layout fit, before 128 GPUs are queued?

Prints parameters and memory per GPU for the training update and for generation (formulas
in :mod:`nemo_dapo.config.capacity`) and exits 1, listing every reason, when a layout cannot
work: more memory than the GPU has (colocated: in the update or in generation beside the
resident training state), no room for one full-length sequence in the KV cache, heads /
layers / experts that do not split evenly over TP / PP / EP, or worker groups that do not fit
the job's GPUs. The GPU's memory is what CUDA reports for the model (``--gpu``); the headroom
(what the peak leaves beyond the reserve) is printed, with a warning below ``--min-headroom-gib``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace

from nemo_dapo.config import ConfigError, load_config
from nemo_dapo.config.architecture import Architecture, resolve_architecture
from nemo_dapo.config.capacity import (
    GPU_MEMORY_MIB,
    ColocatedMemory,
    GenerationMemory,
    Layout,
    TrainingMemory,
    gpu_memory_gib,
    layout_of,
)
from nemo_dapo.config.gpu_fit import MIN_HEADROOM_GIB, RESERVE_GIB, GpuMemory, gpu_memory, memory_problems
from nemo_dapo.config.model_checks import shape_problems
from nemo_dapo.config.pool_sizing import PoolSplit, pool_split
from nemo_dapo.config.pool_sizing import describe as describe_pools
from nemo_dapo.config.schema import Config
from nemo_dapo.config.topology import has_rollout_pool
from nemo_dapo.config.validate import combination_notes, placement_problems
from nemo_dapo.policy.routing import routing_bytes_per_token


@dataclass(frozen=True)
class Plan:
    config: str
    arch: Architecture
    layout: Layout
    memory: GpuMemory  # both phases per GPU; its peak and headroom are the verdict's
    engines: int
    sequences_per_round: int
    problems: list[str]
    routing_bytes_per_token: int = 0  # MoE routing replay's ids (0: off)
    routing_batch_gib: float = 0.0  # the same for a full-length training batch
    warnings: tuple[str, ...] = ()
    checkpoint_gb: tuple[float, float] = (0.0, 0.0)  # one save: the Hugging Face copy, the training state
    save_s: float = 0.0  # one save's write at the storage speed given
    pools: PoolSplit | None = None  # with a rollout pool: the step's split between the pools (estimated)
    pool_lines: tuple[str, ...] = ()

    @property
    def training(self) -> TrainingMemory:
        return self.memory.training

    @property
    def generation(self) -> GenerationMemory:
        return self.memory.generation

    @property
    def colocated(self) -> ColocatedMemory | None:
        return self.memory.colocated

    @property
    def gpu_memory_gib(self) -> float:
        return self.memory.gpu_gib

    @property
    def peak(self) -> float:
        return self.memory.peak

    @property
    def headroom(self) -> float:
        """What the peak leaves of the GPU, beyond the reserve it already counts."""
        return self.memory.headroom

    def as_dict(self) -> dict:
        """Machine-readable plan (``--json``); memory in GiB."""
        training, generation = self.training, self.generation
        return {
            "config": self.config,
            "model": self.arch.name,
            "params_total": self.arch.total_params(),
            "params_per_gpu": round(training.params),
            "world": self.layout.world,
            "dp": self.layout.dp,
            "expert_dp": self.layout.expert_dp,
            "gpu_memory_gib": self.gpu_memory_gib,
            "peak_gib": self.peak,
            "headroom_gib": self.headroom,
            "warnings": list(self.warnings),
            "checkpoint_gb": sum(self.checkpoint_gb),
            "save_s": self.save_s,
            "training": {
                "weights": training.weights,
                "gradients": training.gradients,
                "optimizer": training.optimizer,
                "activations": training.activations,
                "recompute": training.recompute,
                "logits": training.logits,
                "reserve": training.reserve,
                "reference": training.reference,
                "total": training.total,
            },
            "generation": {
                "budget": generation.budget,
                "weights": generation.weights,
                "reserve": generation.reserve,
                "kv_cache": generation.kv_cache,
                "kv_bytes_per_token": generation.kv_bytes_per_token,
                "kv_tokens": generation.kv_tokens,
                "full_sequences": generation.full_sequences,
            },
            "colocated": self.colocated
            and {
                "training_phase": self.colocated.training_phase,
                "generation_phase": self.colocated.generation_phase,
                "peak": self.colocated.peak,
            },
            "routing_replay": {
                "bytes_per_token": self.routing_bytes_per_token,
                "batch_gib": self.routing_batch_gib,
            },
            "pools": self.pools
            and {
                "generation_s": self.pools.generation_s,
                "update_s": self.pools.update_s,
                "balanced_rollout_nodes_per_training_node": self.pools.balanced_ratio,
                "idle_sync": self.pools.idle(stream=False),
                "idle_stream": self.pools.idle(stream=True),
            },
            "fits": not self.problems,
            "problems": self.problems,
        }


SAVE_MARGIN_S = 300  # slurm/dapo_32b.sbatch's default: the last checkpoint is due this long before the job's end


def checkpoint_gb(cfg: Config, arch: Architecture) -> tuple[float, float]:
    """One checkpoint in GB (an estimate from the parameter count): the Hugging Face copy in
    ``model.dtype``, and the sharded training state (weights in that dtype, fp32 master weights,
    Adam's two fp32 moments)."""
    params, width = arch.total_params(), 2 if cfg.model.dtype in ("bfloat16", "float16") else 4
    return params * width / 1e9, params * (width + 12) / 1e9


def save_warning(cfg: Config, save_s: float, storage_gb_per_s: float) -> str | None:
    """With ``checkpoint.async_save`` the trainer's deadline clock sees only a save's blocking part:
    the background write must fit in the batch script's margin."""
    if not cfg.checkpoint.async_save or save_s <= SAVE_MARGIN_S:
        return None
    return (
        f"a checkpoint takes ~{save_s:.0f} s to write at {storage_gb_per_s:g} GB/s, longer than the batch script's "
        f"SAVE_MARGIN_S={SAVE_MARGIN_S} s, which must cover a background save (checkpoint.async_save): submit with "
        f"SAVE_MARGIN_S={int(save_s * 1.5)} or more"
    )


def make_plan(
    cfg: Config,
    config_name: str,
    gpu_memory_gib: float,
    reserve_gib: float,
    min_headroom_gib: float = 0.0,
    storage_gb_per_s: float = 5.0,
    mean_response_tokens: int | None = None,
) -> Plan:
    try:
        arch = resolve_architecture(cfg.model.path)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    layout = layout_of(cfg)
    memory = gpu_memory(cfg, arch, gpu_memory_gib, reserve_gib)
    problems = shape_problems(cfg, arch) + placement_problems(cfg)
    problems += memory_problems(cfg, arch, gpu_memory_gib, reserve_gib)
    engines = cfg.rollout.num_workers
    saved = checkpoint_gb(cfg, arch)
    plan = Plan(
        config=config_name,
        arch=arch,
        layout=layout,
        memory=memory,
        engines=engines,
        sequences_per_round=cfg.data.effective_gen_batch_size * cfg.rollout.n,
        problems=problems,
        warnings=tuple(combination_notes(cfg)),
        checkpoint_gb=saved,
        save_s=sum(saved) / storage_gb_per_s,
        **routing_replay_size(cfg, arch),
    )
    if has_rollout_pool(cfg):
        split = pool_split(cfg, arch, memory.generation, mean_response_tokens)
        plan = replace(plan, pools=split, pool_lines=tuple(describe_pools(split, cfg)))
    if warning := save_warning(cfg, plan.save_s, storage_gb_per_s):
        plan = replace(plan, warnings=(*plan.warnings, warning))
    if not problems and plan.headroom < min_headroom_gib:
        warning = (
            f"the peak ({plan.peak:.2f} GiB per GPU) leaves {plan.headroom:.2f} GiB of the GPU's "
            f"{gpu_memory_gib:.2f} beyond the {reserve_gib:g} GiB reserve, less than {min_headroom_gib:g}: "
            "allocator fragmentation or longer sequences may run out of memory; lower "
            "rollout.gpu_memory_utilization or shard the training state further"
        )
        plan = replace(plan, warnings=(*plan.warnings, warning))
    return plan


def routing_replay_size(cfg: Config, arch: Architecture) -> dict:
    """What routing replay adds to every batch (docs/moe.md): ids per token, and for a training
    batch of full-length sequences (held on the driver, sent to the ranks with the batch)."""
    if cfg.actor.megatron.router_replay == "none" or not arch.is_moe:
        return {}
    per_token = routing_bytes_per_token(arch.num_layers, arch.experts_per_token, arch.num_experts)
    tokens = cfg.data.train_batch_size * cfg.rollout.n * cfg.data.max_sequence_length
    return {"routing_bytes_per_token": per_token, "routing_batch_gib": per_token * tokens / 2**30}


def _describe_model(arch: Architecture) -> str:
    kind = f"MoE {arch.num_experts} experts top-{arch.experts_per_token}" if arch.is_moe else "dense"
    return (
        f"{arch.name}: {arch.total_params() / 1e9:.2f} B parameters, {arch.num_layers} layers, hidden "
        f"{arch.hidden_size}, {arch.num_attention_heads} heads / {arch.num_kv_heads} KV heads, {kind}"
    )


def _describe_layout(layout: Layout) -> str:
    split = layout.parallel
    flags = (
        f"SP={'on' if layout.sequence_parallel else 'off'} "
        f"distributed optimizer={'on' if layout.distributed_optimizer else 'off'}"
    )
    return (
        f"TP={split.tensor} PP={split.pipeline} CP={split.context} EP={split.expert} ETP={split.etp} "
        f"VPP={split.virtual or '-'} {flags} "
        f"-> DP={layout.dp}, expert DP={layout.expert_dp} over {layout.world} ranks"
    )


def render(plan: Plan) -> str:
    t, g = plan.training, plan.generation
    acts = " / ".join(f"{t.activations[k]:.2f}" for k in ("none", "selective", "full"))
    lines = [
        f"plan for {plan.config}",
        f"model       {_describe_model(plan.arch)}",
        f"training    {_describe_layout(plan.layout)}",
        f"  parameters per GPU                 {t.params / 1e9:.3f} B (heaviest pipeline stage)",
        f"  weights                            {t.weights:7.2f} GiB",
        f"  gradients (fp32)                   {t.gradients:7.2f} GiB",
        f"  optimizer (fp32 master + Adam)     {t.optimizer:7.2f} GiB",
        f"  activations none/selective/full    {acts} GiB (recompute: {t.recompute})",
        f"  logits (last stage)                {t.logits:7.2f} GiB",
        f"  reference model (KL, colocated)    {t.reference:7.2f} GiB",
        f"  reserve                            {t.reserve:7.2f} GiB",
        f"  total per GPU                      {t.total:7.2f} GiB of {plan.gpu_memory_gib:.4g}",
        f"generation  {plan.engines} vLLM engines, {g.budget:.1f} GiB per GPU for vLLM",
        f"  weights                            {g.weights:7.2f} GiB",
        f"  KV cache                           {g.kv_cache:7.2f} GiB = {g.kv_tokens} tokens "
        f"({g.kv_bytes_per_token / 1024:.1f} KiB per token per GPU)",
        f"  full-length sequences at once      {g.full_sequences} of {g.sequence_tokens} tokens per engine",
        f"  sequences per generation round     {plan.sequences_per_round} "
        f"({plan.sequences_per_round / max(plan.engines, 1):.0f} per engine)",
    ]
    if plan.colocated:
        c = plan.colocated
        lines += [
            "colocated   training ranks and vLLM engines take turns on every GPU",
            f"  update, engines asleep             {c.training_phase:7.2f} GiB",
            f"  generation beside training state   {c.generation_phase:7.2f} GiB "
            f"({c.training_kept:.2f} training state + reserve, {c.vllm:.2f} vLLM)",
            f"  peak per GPU                       {c.peak:7.2f} GiB of {plan.gpu_memory_gib:.4g}",
        ]
    lines += plan.pool_lines
    if plan.routing_bytes_per_token:
        lines.append(
            f"routing replay {plan.routing_bytes_per_token} B per token (expert ids of every MoE layer), "
            f"{plan.routing_batch_gib:.2f} GiB per full-length training batch"
        )
    hf, state = plan.checkpoint_gb
    lines.append(
        f"checkpoint  {hf + state:.1f} GB per save (Hugging Face copy {hf:.1f} + training state {state:.1f}), "
        f"~{plan.save_s:.0f} s to write at the storage speed given (--storage-gb-per-s)"
    )
    lines.append(
        f"headroom    {plan.headroom:.2f} GiB per GPU beyond the reserve "
        f"(peak {plan.peak:.2f} of {plan.gpu_memory_gib:.4g})"
    )
    lines += [f"warning     {warning}" for warning in plan.warnings]
    verdict = "fits" if not plan.problems else "REFUSED:\n  - " + "\n  - ".join(plan.problems)
    return "\n".join(lines + [f"verdict     {verdict}"])


def run_plan(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides, placement=False)  # placement problems are listed below
    gpu_gib = args.gpu_memory_gib or gpu_memory_gib(args.gpu or cfg.trainer.gpu_model or "H800")
    plan = make_plan(
        cfg,
        args.config,
        gpu_gib,
        args.reserve_gib,
        args.min_headroom_gib,
        args.storage_gb_per_s,
        args.mean_response_tokens,
    )
    print(json.dumps(plan.as_dict(), indent=1) if args.json else render(plan))
    for warning in plan.warnings:
        print(f"nemo-dapo plan: warning: {warning}", file=sys.stderr)
    if plan.problems:
        print(
            f"nemo-dapo plan: {args.config} cannot run as configured ({len(plan.problems)} problem(s))", file=sys.stderr
        )
        return 1
    return 0


def above_zero(text: str) -> float:
    """An argument that sizes something (GiB, GB/s): a finite number above 0; anything else is
    refused by argparse, naming the argument (exit 2), rather than planned on or divided by."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a size: give a number above 0")
    return value


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="per-GPU memory of a preset's layout; refuses layouts that cannot fit")
    parser.add_argument("config", help="preset name in conf/ or a YAML path")
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. actor.megatron.tensor_model_parallel_size=4"
    )
    parser.add_argument(
        "--gpu",
        choices=sorted(GPU_MEMORY_MIB),
        help="GPU model: its memory as CUDA reports it (H800 and H100: 79.65 GiB, H20: 95.58, H200: 140.40); "
        "default: the config's trainer.gpu_model, else H800",
    )
    parser.add_argument("--gpu-memory-gib", type=above_zero, help="memory of one GPU in GiB, for a model --gpu lacks")
    parser.add_argument(
        "--min-headroom-gib",
        type=float,
        default=MIN_HEADROOM_GIB,
        help="warn when the peak leaves less than this of the GPU beyond the reserve",
    )
    parser.add_argument(
        "--reserve-gib",
        type=float,
        default=RESERVE_GIB,
        help="per GPU and phase: CUDA context, NCCL buffers, fragmentation",
    )
    parser.add_argument(
        "--storage-gb-per-s",
        type=above_zero,
        default=5.0,
        help="the shared storage's write speed for one job's checkpoint (an assumption: measure it with the "
        "bring-up ladder's checkpoint drill, docs/cluster.md)",
    )
    parser.add_argument(
        "--mean-response-tokens",
        type=int,
        help="with trainer.rollout_pool: the mean response length the pools' split assumes (default: a "
        "quarter of data.max_response_length)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(fn=run_plan)
