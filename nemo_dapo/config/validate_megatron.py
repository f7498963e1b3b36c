"""Start-up checks of the megatron backend: its parallel sizes against the model and the job,
the features each layout supports here, and MoE routing replay."""

from __future__ import annotations

from nemo_dapo.algo.correction import correction_settings
from nemo_dapo.config.problems import Problems
from nemo_dapo.config.schema import Config
from nemo_dapo.config.topology import is_colocated, training_world_size


def check_megatron(cfg: Config, problems: Problems) -> None:
    """Layouts Megatron would reject at start-up, after the cluster is already allocated."""
    if cfg.actor.backend != "megatron":
        return
    if _check_megatron_sizes(cfg, problems):
        _check_megatron_features(cfg, problems)


def _check_megatron_sizes(cfg: Config, problems: Problems) -> bool:
    """The parallel sizes: each >= 1, and their products dividing the training ranks and a
    mini-batch's sequences. False when a size is below 1 (nothing else is checked then)."""
    mg, key = cfg.actor.megatron, "actor.megatron"
    tp, pp, cp, ep = (
        mg.tensor_model_parallel_size,
        mg.pipeline_model_parallel_size,
        mg.context_parallel_size,
        mg.expert_model_parallel_size,
    )
    sizes = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": cp,
        "expert_model_parallel_size": ep,
    }
    for name, size in sizes.items():
        problems.require(size >= 1, f"{key}.{name}", size, "must be >= 1")
    if min(sizes.values()) < 1:
        return False
    vpp = mg.virtual_pipeline_model_parallel_size
    problems.require(
        vpp is None or (vpp >= 2 and pp >= 2),
        f"{key}.virtual_pipeline_model_parallel_size",
        vpp,
        f"interleaving needs >= 2 chunks and pipeline_model_parallel_size >= 2 (it is {pp}); null turns it off",
    )
    world = training_world_size(cfg)
    if world % (tp * pp * cp):
        problems.append(
            f"{key}: TP={tp} x PP={pp} x CP={cp} = {tp * pp * cp} must divide the {world} training "
            "ranks (actor.num_workers); DP is the quotient"
        )
    etp = mg.expert_tensor_parallel_size or tp
    if world % (etp * ep * pp):
        problems.append(
            f"{key}: ETP={etp} x EP={ep} x PP={pp} = {etp * ep * pp} must divide the {world} training "
            "ranks (the expert layout; expert DP is the quotient)"
        )
    if world % (tp * pp * cp) == 0:
        dp = world // (tp * pp * cp)
        sequences = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
        problems.require(
            sequences % dp == 0,
            "actor.ppo_mini_batch_size",
            cfg.actor.ppo_mini_batch_size,
            f"x rollout.n = {sequences} sequences per optimizer step must split evenly over DP = {dp}",
        )
    return True


def _check_megatron_features(cfg: Config, problems: Problems) -> None:
    """Features that need another setting (sequence parallelism, FP8, context parallelism,
    overlapped gathers) and the numbers Megatron takes as they are."""
    mg, key = cfg.actor.megatron, "actor.megatron"
    tp, cp, ep = mg.tensor_model_parallel_size, mg.context_parallel_size, mg.expert_model_parallel_size
    problems.require(
        not mg.sequence_parallel or tp > 1,
        f"{key}.sequence_parallel",
        mg.sequence_parallel,
        "needs tensor_model_parallel_size > 1 (it splits the sequence over the TP group)",
    )
    problems.require(
        ep == 1 or tp == 1 or mg.sequence_parallel,
        f"{key}.sequence_parallel",
        mg.sequence_parallel,
        "must be true when experts (EP > 1) are combined with tensor parallelism (TP > 1)",
    )
    te = mg.transformer_impl == "transformer_engine"
    problems.require(
        not mg.sequence_parallel or te,
        f"{key}.sequence_parallel",
        mg.sequence_parallel,
        "needs transformer_impl=transformer_engine (its norms handle sequence-split activations)",
    )
    problems.require(not mg.fp8 or te, f"{key}.fp8", mg.fp8, "needs transformer_impl=transformer_engine")
    problems.require(
        cp == 1 or mg.sequence_packing,
        f"{key}.context_parallel_size",
        cp,
        "context parallelism splits packed rows: set actor.megatron.sequence_packing=true (or use 1)",
    )
    problems.require(
        not mg.overlap_param_gather or mg.use_distributed_optimizer,
        f"{key}.overlap_param_gather",
        mg.overlap_param_gather,
        "needs use_distributed_optimizer=true (it gathers the optimizer's shards)",
    )
    problems.require(
        mg.moe_aux_loss_coeff >= 0,
        f"{key}.moe_aux_loss_coeff",
        mg.moe_aux_loss_coeff,
        "must be >= 0 (0 turns the router's load-balancing loss off)",
    )
    problems.require(
        not mg.release_grad_buffers or is_colocated(cfg),
        f"{key}.release_grad_buffers",
        mg.release_grad_buffers,
        "frees the gradients' memory for engines that share the GPUs (trainer.colocate=true on GPU nodes); "
        "this run's engines have memory of their own: set it to false",
    )
    problems.require(
        mg.ddp_bucket_size is None or mg.ddp_bucket_size > 0,
        f"{key}.ddp_bucket_size",
        mg.ddp_bucket_size,
        "must be a positive number of parameters, or null for Megatron's default",
    )


def check_router_replay(cfg: Config, problems: Problems) -> None:
    """Routing replay (docs/moe.md) lives in the Megatron worker's MoE routers; R2 records in the
    old_log_prob pass, which bypass mode skips."""
    mode, key = cfg.actor.megatron.router_replay, "actor.megatron.router_replay"
    if mode == "none":
        return
    problems.require(
        cfg.actor.backend == "megatron",
        key,
        mode,
        "the torch (HF) worker has no routing replay: use actor.backend=megatron, or set it to none",
    )
    problems.require(
        mode != "r2" or not correction_settings(cfg.algorithm.rollout_correction).bypass_mode,
        key,
        mode,
        "r2 replays what the old_log_prob pass recorded, and bypass mode skips that pass: use r3 "
        "(the engine's routing) or decoupled mode",
    )
