"""Start-up checks that need the model's shape: will the layouts split it, will a CPU run's workers
fit this machine's memory. Run by ``nemo-dapo train`` before any worker is placed and by
``nemo-dapo plan`` (:mod:`nemo_dapo.commands.plan`), which adds the GPU memory model.
"""

from __future__ import annotations

from collections.abc import Mapping

from nemo_dapo.config.architecture import Architecture, resolve_architecture
from nemo_dapo.config.capacity import DTYPE_BYTES, GPU_MEMORY_MIB, Layout, layout_of, training_memory
from nemo_dapo.config.schema import Config


def _divides(problems: list[str], size: int, count: int, what: str, key: str) -> None:
    if count % size:
        problems.append(f"{key}={size} does not divide the model's {count} {what}")


def training_layout_problems(arch: Architecture, layout: Layout) -> list[str]:
    """What Megatron cannot shard: heads and FFN widths over TP, layers over PP, experts over EP."""
    split = layout.parallel
    problems: list[str] = []
    key = "actor.megatron"
    _divides(
        problems,
        split.tensor,
        arch.num_attention_heads,
        "attention heads",
        f"{key}.tensor_model_parallel_size",
    )
    _divides(
        problems,
        split.tensor,
        arch.num_kv_heads,
        "KV heads (query groups)",
        f"{key}.tensor_model_parallel_size",
    )
    if arch.is_moe:
        _divides(
            problems,
            split.tensor,
            arch.moe_intermediate_size,
            "expert FFN width",
            f"{key}.tensor_model_parallel_size",
        )
        _divides(problems, split.expert, arch.num_experts, "experts", f"{key}.expert_model_parallel_size")
    else:
        _divides(problems, split.tensor, arch.intermediate_size, "FFN width", f"{key}.tensor_model_parallel_size")
        if split.expert > 1:
            problems.append(f"{key}.expert_model_parallel_size={split.expert}: {arch.name} is dense (no experts)")
    _divides(
        problems,
        split.pipeline * (split.virtual or 1),
        arch.num_layers,
        "layers",
        f"{key}.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size",
    )
    return problems


def rollout_layout_problems(cfg: Config, arch: Architecture) -> list[str]:
    """vLLM's own constraints (the GPU counts are :func:`placement_problems`)."""
    tp, problems = cfg.rollout.tensor_parallel_size, []
    _divides(problems, tp, arch.num_attention_heads, "attention heads", "rollout.tensor_parallel_size")
    if arch.num_kv_heads % tp and tp % arch.num_kv_heads:
        problems.append(
            f"rollout.tensor_parallel_size={tp}: neither divides nor is a multiple of the model's "
            f"{arch.num_kv_heads} KV heads"
        )
    return problems


def shape_problems(cfg: Config, arch: Architecture) -> list[str]:
    """How the training and rollout layouts split this model (heads, widths, layers, experts)."""
    problems = training_layout_problems(arch, layout_of(cfg)) if cfg.actor.backend == "megatron" else []
    replay = cfg.actor.megatron.router_replay
    if replay != "none" and not arch.is_moe:
        problems.append(
            f"actor.megatron.router_replay={replay}: {arch.name} is dense (no experts, nothing routed); set it to none"
        )
    return problems + rollout_layout_problems(cfg, arch) + context_problems(cfg, arch)


def context_problems(cfg: Config, arch: Architecture) -> list[str]:
    """A prompt and its response longer than the model's positions: vLLM refuses such an engine
    (and Megatron's rotary table stops there), so the run would fail late, in a worker."""
    longest = cfg.data.max_sequence_length
    if arch.max_positions is None or longest <= arch.max_positions:
        return []
    return [
        f"data.max_prompt_length + data.max_response_length = {longest} exceeds the model's "
        f"{arch.max_positions} positions (max_position_embeddings in {arch.name}'s config.json): "
        f"lower data.max_response_length to at most {arch.max_positions - cfg.data.max_prompt_length}"
    ]


def startup_shape_problems(cfg: Config) -> list[str]:
    """:func:`shape_problems` for a run about to place its workers, when the model's shape can be
    known (a local folder or a listed model); otherwise the workers check it as they build."""
    try:
        arch = resolve_architecture(cfg.model.path)
    except (ValueError, KeyError):
        return []
    return shape_problems(cfg, arch)


def cpu_memory_problems(cfg: Config, host_gib: float) -> list[str]:
    """A CPU-mode run (``trainer.n_gpus_per_node=0``) whose workers cannot fit ``host_gib`` of memory
    together: each policy rank's update (fp32 weights, gradients, Adam, activations of one
    micro-batch, one logits chunk, eager attention's probabilities) plus each engine's weights and
    KV cache. Refused before any worker starts, naming the micro-batch budget, which the
    activations grow with."""
    if cfg.trainer.n_gpus_per_node > 0:
        return []
    try:
        arch = resolve_architecture(cfg.model.path)
    except (ValueError, KeyError):
        return []
    training = training_memory(cfg, arch, reserve_gib=0.0)
    eager = eager_attention_bytes(cfg, arch) / 2**30
    activations = training.activations[training.recompute] + eager
    per_rank = training.total + eager
    engine = arch.total_params() * 4 / 2**30 + 1.0  # fp32 weights + the engines' 1 GiB KV cache on CPU
    need = per_rank * cfg.actor.num_workers + engine * cfg.rollout.num_workers
    if need <= HOST_MEMORY_FRACTION * host_gib:
        return []
    return [
        f"actor.max_token_len_per_micro_batch={cfg.actor.max_token_len_per_micro_batch}: the workers need about "
        f"{need:.1f} GiB ({activations:.1f} GiB of activations per policy rank) of this machine's "
        f"{host_gib:.1f} GiB; lower it (activations grow with it) or use fewer actor.num_workers"
    ]


def eager_attention_bytes(cfg: Config, arch: Architecture) -> float:
    """What ``actor.attn_implementation=eager`` keeps for the backward beyond the other activations:
    every layer's attention probabilities, ``heads x sequence`` values per token of a micro-batch, in
    fp32 (the softmax) and in the compute dtype (the copy the value matmul reads)."""
    if cfg.actor.attn_implementation != "eager":
        return 0.0
    sequence = cfg.data.max_sequence_length
    per_value = 4 + DTYPE_BYTES[cfg.model.dtype]
    tokens = cfg.actor.max_token_len_per_micro_batch
    return tokens * arch.num_attention_heads * sequence * per_value * arch.num_layers


HOST_MEMORY_FRACTION = 0.85  # the rest: driver, Ray, the reward pool, the page cache


def gpu_problems(cfg: Config, gpus: list[tuple[str, int]] | None) -> list[str]:
    """The GPUs of the head node (name, MiB; None: no nvidia-smi) against ``trainer.gpu_model``,
    whose memory the config's figures assume: a job of an H20 preset on H800 nodes, or the reverse,
    or on a partitioned (MIG) GPU, is refused before Ray starts instead of failing late."""
    model = cfg.trainer.gpu_model
    if cfg.trainer.n_gpus_per_node == 0 or model is None:
        return []
    skip = "(trainer.gpu_model=null skips this check)"
    if not gpus:
        found = "nvidia-smi is missing" if gpus is None else "nvidia-smi lists no GPU"
        return [f"trainer.gpu_model={model}: {found} on the head node, so its GPUs cannot be checked {skip}"]
    problems = []
    for name, mib in sorted(set(gpus)):
        other = next((m for m in GPU_MEMORY_MIB if m in name.split()), None)
        if other != model:
            fix = f"set trainer.gpu_model={other} after `nemo-dapo plan --gpu {other}`" if other else "check the nodes"
            problems.append(f"trainer.gpu_model={model}: the head node's GPUs are {name} ({mib} MiB): {fix} {skip}")
        elif mib < GPU_MEMORY_MIB[model]:
            problems.append(
                f"trainer.gpu_model={model}: the head node's {name} reports {mib} MiB, the plan assumes "
                f"{GPU_MEMORY_MIB[model]} (a MIG slice or a limit?): give the job whole GPUs {skip}"
            )
    return problems


def head_node_gpus() -> list[tuple[str, int]] | None:
    """(name, memory MiB) of each GPU nvidia-smi lists here, without making a CUDA context."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    lines = subprocess.run(query, capture_output=True, text=True, timeout=60).stdout.splitlines()
    return [(name.strip(), int(mib)) for name, mib in (line.rsplit(",", 1) for line in lines if "," in line)]


def fabric_warning(cfg: Config, environ: Mapping[str, str]) -> str | None:
    """A multi-node GPU run without ``FABRIC_IFNAME`` (slurm/site_env.sh) sends its weight sync and
    its ranks' traffic over whatever network the node names resolve to: on most sites the
    management Ethernet, slow and shared, and nothing fails to say so."""
    if cfg.trainer.n_gpus_per_node == 0 or cfg.trainer.nnodes < 2 or environ.get("FABRIC_IFNAME"):
        return None
    try:
        model_gb = resolve_architecture(cfg.model.path).total_params() * DTYPE_BYTES[cfg.model.dtype] / 1e9
    except (ValueError, KeyError):
        return None
    return (
        f"FABRIC_IFNAME is unset on a {cfg.trainer.nnodes}-node GPU run: the weight sync (at least the model, "
        f"{model_gb:.1f} GB, into every node at every step), the ranks' rendezvous and gloo use the address each "
        "node's name resolves to, on most sites the management network; set FABRIC_IFNAME to the fast network's "
        "interface (e.g. ib0; docs/cluster.md, Site settings)"
    )
