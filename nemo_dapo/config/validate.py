"""Start-up validation: impossible settings fail before any worker starts.

Every message names the key, the value and what is allowed, and all problems are reported
at once so a user fixes a config in one go.
"""

from __future__ import annotations

from nemo_dapo.algo.correction import correction_settings, parse_rs_modes
from nemo_dapo.algo.policy_losses import policy_loss_problems
from nemo_dapo.config.fields import settings as schema_settings
from nemo_dapo.config.problems import Problems, raise_problems
from nemo_dapo.config.schema import Config
from nemo_dapo.config.topology import (
    engine_gpus,
    engine_pool_gpus,
    expert_groups_across_nodes,
    exporting_ranks,
    has_rollout_pool,
    is_colocated,
    needs_reference,
    policy_groups,
    training_pool_gpus,
    training_world_size,
)
from nemo_dapo.config.validate_megatron import check_megatron, check_router_replay
from nemo_dapo.errors import ConfigError


def _check_choices(cfg: Config, problems: Problems) -> None:
    """Every enumerated setting against the choices the schema declares for it.

    null passes where the field is optional and null is not one of the choices: there it means
    "unset" (the preset's or the derived value). A list setting checks each element. The
    megatron group is checked only with that backend (the torch backend ignores it).
    """
    for setting in schema_settings().values():
        choices = setting.choices
        if choices is None or (setting.key.startswith("actor.megatron.") and cfg.actor.backend != "megatron"):
            continue
        value = setting.value_in(cfg)
        if value is None and None not in choices and setting.type_name.endswith("or null"):
            continue
        if not all(v in choices for v in (value if isinstance(value, list) else [value])):
            problems.append(f"{setting.key}={value!r}: choose one of {setting.allowed_text()}")


def _check_bounds(cfg: Config, problems: Problems) -> None:
    """Every number against the bounds the schema declares for it (``setting(bounds=...)``)."""
    for setting in schema_settings().values():
        if setting.bounds is not None and not setting.in_bounds(value := setting.value_in(cfg)):
            problems.append(f"{setting.key}={value!r}: {setting.bounds_text()}")


def _check_algorithm(cfg: Config, problems: Problems) -> None:
    algo = cfg.algorithm
    if algo.kl_ctrl.type == "adaptive":
        problems.require(
            algo.kl_ctrl.target_kl > 0, "algorithm.kl_ctrl.target_kl", algo.kl_ctrl.target_kl, "must be > 0"
        )
        problems.require(algo.kl_ctrl.horizon > 0, "algorithm.kl_ctrl.horizon", algo.kl_ctrl.horizon, "must be > 0")
    problems.require(
        bool(algo.filter_groups.metric),
        "algorithm.filter_groups.metric",
        algo.filter_groups.metric,
        "name the per-sample value to filter on, e.g. acc",
    )
    problems.require(
        not (algo.filter_groups.enable and algo.filter_groups.metric == "seq_final_reward" and algo.use_kl_in_reward),
        "algorithm.filter_groups.metric",
        algo.filter_groups.metric,
        "with algorithm.use_kl_in_reward=true the final reward's KL term is computed after the filter (it needs "
        "the kept rows' old and reference log-probs); filter on seq_reward or acc",
    )
    try:
        settings = correction_settings(algo.rollout_correction)
    except ConfigError as err:
        problems.append(str(err))
        return
    key = "algorithm.rollout_correction"
    problems.require(
        settings.rollout_is_threshold > 0,
        f"{key}.rollout_is_threshold",
        settings.rollout_is_threshold,
        "must be > 0 (IS weights are truncated above it)",
    )
    problems.require(
        settings.loss_type != "reinforce" or settings.bypass_mode,
        f"{key}.loss_type",
        settings.loss_type,
        "the REINFORCE loss needs bypass_mode=true (decoupled mode uses ppo_clip)",
    )
    try:
        parse_rs_modes(settings.rollout_rs, settings.rollout_rs_threshold)
    except ValueError as err:
        problems.append(str(err))


def _check_actor(cfg: Config, problems: Problems) -> None:
    actor, optim = cfg.actor, cfg.actor.optim
    problems.require(
        actor.clip_ratio_c > 1,
        "actor.clip_ratio_c",
        actor.clip_ratio_c,
        "the dual-clip bound must be > 1 (DAPO uses 10)",
    )
    problems.extend(policy_loss_problems(actor.policy_loss, actor.loss_agg_mode))
    problems.require(
        actor.policy_loss == "dapo" or correction_settings(cfg.algorithm.rollout_correction).loss_type != "reinforce",
        "actor.policy_loss",
        actor.policy_loss,
        "bypass mode's REINFORCE loss (rollout_correction loss_type=reinforce) takes the place of the "
        "policy loss: keep actor.policy_loss=dapo, or use loss_type=ppo_clip",
    )
    problems.require(
        actor.attn_implementation == "sdpa" or actor.backend == "torch",
        "actor.attn_implementation",
        actor.attn_implementation,
        "chooses the torch backend's attention; the megatron backend has its own (set it to sdpa)",
    )
    problems.require(
        not actor.shared_prompt_forward or actor.backend == "torch",
        "actor.shared_prompt_forward",
        actor.shared_prompt_forward,
        "is implemented by the torch backend only; the megatron backend runs every row whole (set it to false or null)",
    )
    batch, mini = cfg.data.train_batch_size, actor.ppo_mini_batch_size
    problems.require(
        0 < mini <= batch and batch % mini == 0,
        "actor.ppo_mini_batch_size",
        mini,
        f"must divide data.train_batch_size={batch} (each mini-batch is one optimizer step)",
    )
    problems.require(
        len(optim.betas) == 2 and all(0 <= b < 1 for b in optim.betas),
        "actor.optim.betas",
        optim.betas,
        "two numbers in [0, 1)",
    )


def _check_placement(cfg: Config, problems: Problems) -> None:
    """What the two worker groups need of the job's GPUs (GPU mode only).

    Colocated, GPU ``g`` hosts training rank ``g`` and a TP slice of engine ``g // TP``, so both
    groups must cover every GPU exactly once and no engine may straddle two nodes. With a rollout
    pool each group must fit its own pool.
    """
    if has_rollout_pool(cfg):
        _check_pools(cfg, problems)
    gpus, world = training_pool_gpus(cfg), training_world_size(cfg)
    if gpus == 0:
        return
    tp, n_gpus, engines = cfg.rollout.tensor_parallel_size, cfg.trainer.n_gpus_per_node, engine_gpus(cfg)
    problems.require(
        world <= gpus,
        "actor.num_workers",
        world,
        f"one training rank per GPU: the {'training pool' if has_rollout_pool(cfg) else 'job'} has {gpus} "
        "(trainer.nnodes x trainer.n_gpus_per_node)",
    )
    if engines > engine_pool_gpus(cfg):
        where = "the rollout pool" if has_rollout_pool(cfg) else "the job"
        problems.append(
            f"rollout.num_workers x rollout.tensor_parallel_size = {engines} GPUs, {where} has {engine_pool_gpus(cfg)}"
        )
    if not is_colocated(cfg):
        return
    fix = "or set trainer.colocate=false to give each group GPUs of its own"
    problems.require(
        cfg.trainer.mode == "sync",
        "trainer.mode",
        cfg.trainer.mode,
        "the stream trainer generates while it trains, so it cannot share GPUs with the engines "
        "(trainer.colocate=true): use trainer.mode=sync, or trainer.colocate=false with "
        "actor.num_workers + rollout.num_workers x rollout.tensor_parallel_size <= the job's GPUs",
    )
    problems.require(
        n_gpus % tp == 0,
        "rollout.tensor_parallel_size",
        tp,
        f"colocated engines must not span nodes: must divide trainer.n_gpus_per_node={n_gpus}",
    )
    problems.require(
        world >= gpus,
        "actor.num_workers",
        world,
        f"colocated, every GPU hosts one training rank: must be {gpus} "
        f"(trainer.nnodes x trainer.n_gpus_per_node), {fix}",
    )
    problems.require(
        engines >= gpus,
        "rollout.num_workers",
        cfg.rollout.num_workers,
        f"colocated, the engines must cover all {gpus} GPUs: rollout.num_workers x "
        f"rollout.tensor_parallel_size = {engines}; set rollout.num_workers={gpus // tp}, {fix}",
    )


def _check_pools(cfg: Config, problems: Problems) -> None:
    """A rollout pool (``trainer.rollout_pool``): engines alone on its nodes, each inside one node."""
    pool, trainer = cfg.trainer.rollout_pool, cfg.trainer
    problems.require(
        not trainer.colocate,
        "trainer.colocate",
        trainer.colocate,
        "with a rollout pool the engines have GPUs of their own: set trainer.colocate=false, or "
        "trainer.rollout_pool.nnodes=0 to share the training nodes' GPUs",
    )
    problems.require(
        (pool.n_gpus_per_node == 0) == (trainer.n_gpus_per_node == 0),
        "trainer.rollout_pool.n_gpus_per_node",
        pool.n_gpus_per_node,
        f"both pools have GPUs or neither (trainer.n_gpus_per_node={trainer.n_gpus_per_node}; 0 is CPU mode)",
    )
    tp = cfg.rollout.tensor_parallel_size
    problems.require(
        pool.n_gpus_per_node == 0 or pool.n_gpus_per_node % tp == 0,
        "rollout.tensor_parallel_size",
        tp,
        f"an engine stays inside one rollout node: must divide trainer.rollout_pool.n_gpus_per_node="
        f"{pool.n_gpus_per_node}",
    )


def separate_groups_problems(cfg: Config) -> list[str]:
    """Separate groups (GPU mode, not colocated) must fit the job side by side; with a rollout pool
    the training ranks fit the training pool (the engines' pool is checked with the placement).

    Checked when the job starts, before Ray (and listed by ``plan``), not when a config loads:
    a base preset with made-up sizes still loads and plans.
    """
    gpus = training_pool_gpus(cfg)
    if gpus == 0 or is_colocated(cfg):
        return []
    training = training_world_size(cfg) * policy_groups(cfg)
    engines = 0 if has_rollout_pool(cfg) else engine_gpus(cfg)
    if training + engines <= gpus:
        return []
    reference = " (x2: the reference model's ranks)" if needs_reference(cfg) else ""
    if has_rollout_pool(cfg):
        return [
            f"actor.num_workers{reference} = {training} GPUs, the training pool has {gpus} "
            "(trainer.nnodes x trainer.n_gpus_per_node): lower actor.num_workers or add training nodes"
        ]
    return [
        f"trainer.colocate=false: actor.num_workers{reference} + rollout.num_workers x "
        f"rollout.tensor_parallel_size = {training} + {engines} GPUs, the job has {gpus} "
        "(trainer.nnodes x trainer.n_gpus_per_node): set trainer.colocate=true to share the GPUs, or "
        "lower the worker counts"
    ]


def placement_problems(cfg: Config) -> list[str]:
    """Every GPU-placement problem of ``cfg`` (what ``plan`` reports)."""
    problems = Problems()
    _check_placement(cfg, problems)
    return problems + separate_groups_problems(cfg)


def _check_data_and_rollout(cfg: Config, problems: Problems) -> None:
    data, rollout = cfg.data, cfg.rollout
    problems.require(
        rollout.min_engines is None or rollout.min_engines <= (rollout.num_workers or 0),
        "rollout.min_engines",
        rollout.min_engines,
        f"must be <= rollout.num_workers={rollout.num_workers} (the engines the run starts with)",
    )
    problems.require(
        data.effective_gen_batch_size >= data.train_batch_size,
        "data.gen_batch_size",
        data.gen_batch_size,
        f"must be >= data.train_batch_size={data.train_batch_size} (or null to use it)",
    )
    problems.require(
        0 < rollout.gpu_memory_utilization <= 1,
        "rollout.gpu_memory_utilization",
        rollout.gpu_memory_utilization,
        "must be in (0, 1]",
    )


def _check_weight_transfer(cfg: Config, problems: Problems) -> None:
    """The CUDA paths where they cannot work (docs/architecture.md, Weight sync)."""
    key, path = "rollout.weight_transfer", cfg.rollout.weight_transfer
    problems.require(
        path != "ipc",
        key,
        path,
        "vLLM's ipc backend needs every training rank to hold every weight whole on its own GPU (an "
        "FSDP-style source); our ranks hold tensor- and pipeline-parallel shards and one rank per stage "
        "exports: use nccl (engines on GPUs of their own) or gloo (colocated)",
    )
    if path != "nccl":
        return
    problems.require(cfg.trainer.n_gpus_per_node > 0, key, path, "NCCL moves CUDA tensors: on CPUs use gloo (or auto)")
    problems.require(
        not is_colocated(cfg),
        key,
        path,
        "the engines share the training ranks' GPUs (trainer.colocate=true), and one NCCL group cannot hold "
        "two ranks of one GPU: use gloo (or auto)",
    )
    problems.require(
        exporting_ranks(cfg) == 1,
        key,
        path,
        f"{exporting_ranks(cfg)} pipeline stages export the weights, one sender each, and vLLM's nccl engines "
        "join one sender (actor.megatron.pipeline_model_parallel_size=1 for nccl): use gloo (or auto)",
    )


def _check_reward_and_trainer(cfg: Config, problems: Problems) -> None:
    buffer = cfg.reward.overlong_buffer
    if buffer.enable:
        problems.require(
            buffer.len > 0,
            "reward.overlong_buffer.len",
            buffer.len,
            "must be > 0 when enabled (or set reward.overlong_buffer.enable=false)",
        )
        problems.require(
            buffer.len <= cfg.data.max_response_length,
            "reward.overlong_buffer.len",
            buffer.len,
            f"must be <= data.max_response_length={cfg.data.max_response_length}",
        )
    trainer = cfg.trainer
    problems.require(
        trainer.remote_timeout_s is None or trainer.remote_timeout_s > 0,
        "trainer.remote_timeout_s",
        trainer.remote_timeout_s,
        "must be > 0 seconds, or null to wait forever",
    )
    timeout = cfg.rollout.timeout_s
    problems.require(
        timeout is None or timeout > 0, "rollout.timeout_s", timeout, "must be > 0 seconds, or null for trainer's"
    )
    budget = trainer.total_generated_samples
    problems.require(budget is None or budget >= 1, "trainer.total_generated_samples", budget, "must be >= 1 or null")
    problems.require(
        trainer.max_token_staleness is None or trainer.mode == "stream",
        "trainer.max_token_staleness",
        trainer.max_token_staleness,
        "only the streaming trainer draws one sample with several weight versions: "
        "set trainer.mode=stream or leave it null",
    )
    problems.require(bool(trainer.output_dir), "trainer.output_dir", trainer.output_dir, "must name a folder")
    problems.require(cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last", cfg.checkpoint.keep_last, "must be >= 1")
    problems.require(
        not cfg.checkpoint.async_save or cfg.actor.backend == "megatron",
        "checkpoint.async_save",
        cfg.checkpoint.async_save,
        "needs actor.backend=megatron (the torch worker saves synchronously)",
    )
    problems.require(
        bool(cfg.checkpoint.resume),
        "checkpoint.resume",
        cfg.checkpoint.resume,
        "use auto, disable, or a checkpoint folder",
    )


def validate(cfg: Config, placement: bool = True) -> Config:
    """Raise :class:`ConfigError` listing every impossible value; return ``cfg`` if none.

    ``placement=False`` leaves the GPU placement to the caller: ``plan`` lists those problems
    next to the memory figures instead of refusing to load.
    """
    problems = Problems()
    if cfg.rollout.num_workers is None:  # everything after counts engines: nothing else is checked
        problems.require(
            False,
            "rollout.num_workers",
            None,
            "null is derived only for a GPU job whose engine GPUs (the rollout pool's, else trainer.nnodes x "
            "trainer.n_gpus_per_node) divide by rollout.tensor_parallel_size: give the engine count",
        )
        raise_problems(problems)
    checks = [
        _check_choices,
        _check_bounds,
        _check_data_and_rollout,
        _check_weight_transfer,
        _check_algorithm,
        _check_actor,
        check_megatron,
        check_router_replay,
        _check_reward_and_trainer,
    ]
    for check in checks + ([_check_placement] if placement else []):
        check(cfg, problems)
    raise_problems(problems)
    return cfg


def combination_notes(cfg: Config) -> list[str]:
    """What a legal but easily misread combination of settings does (logged at start-up)."""
    notes = []
    if cfg.algorithm.overlong_filtering and cfg.reward.overlong_buffer.enable:
        buffer = cfg.reward.overlong_buffer
        notes.append(
            f"algorithm.overlong_filtering with reward.overlong_buffer: truncated responses leave the loss, so the "
            f"soft punishment acts on the finished responses longer than "
            f"{cfg.data.max_response_length - buffer.len} tokens (and on truncated ones only through their "
            f"group's advantage baseline)"
        )
    crossing = expert_groups_across_nodes(cfg)
    if crossing:
        mg, gpus = cfg.actor.megatron, cfg.trainer.n_gpus_per_node
        etp = mg.expert_tensor_parallel_size or mg.tensor_model_parallel_size
        notes.append(
            f"actor.megatron: {len(crossing)} expert-parallel groups span nodes (e.g. ranks {crossing[0]} with "
            f"{gpus} GPUs per node): ETP={etp} x EP={mg.expert_model_parallel_size} ranks per group do not fit "
            "one node, so the experts' all-to-all leaves NVLink; actor.megatron.expert_tensor_parallel_size=1, "
            "or an EP dividing the node's GPUs, keeps it inside"
        )
    return notes
