"""Production presets carry the paper's recipe (docs/algorithm.md §12), and impossible Megatron layouts fail at load."""

import pytest

from nemo_dapo.config import ConfigError, load_config

RECIPE_32B = ("dapo_qwen2.5_32b", "dapo_wo_ds_qwen2.5_32b", "dapo_early_qwen2.5_32b")


@pytest.mark.parametrize("name", RECIPE_32B)
def test_32b_presets_carry_the_spec_12_recipe(name):
    cfg = load_config(name)
    optim = cfg.actor.optim
    assert (optim.lr, optim.warmup_steps, optim.weight_decay, optim.clip_grad) == (1e-6, 10, 0.1, 1.0)
    assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, cfg.rollout.n) == (512, 32, 16)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (2048, 20480)
    assert (cfg.rollout.temperature, cfg.rollout.top_p) == (1.0, 1.0)
    assert (cfg.rollout.val.n, cfg.rollout.val.temperature, cfg.rollout.val.top_p) == (32, 1.0, 0.7)
    assert cfg.actor.entropy_coeff == 0.0 and not cfg.actor.use_kl_loss and not cfg.algorithm.use_kl_in_reward
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.2, 0.28)
    buffer = cfg.reward.overlong_buffer
    assert (buffer.enable, buffer.len, buffer.penalty_factor) == (True, 4096, 1.0)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (16, 8)
    assert cfg.model.path == "Qwen/Qwen2.5-32B" and cfg.model.dtype == "bfloat16"
    assert cfg.actor.backend == "megatron"
    assert cfg.trainer.experiment_name == name and cfg.trainer.output_dir == f"outputs/{name}"


def test_full_dapo_uses_dynamic_sampling_and_token_mean():
    cfg = load_config("dapo_qwen2.5_32b")
    assert cfg.data.effective_gen_batch_size == 1536
    assert cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.metric == "acc"
    assert cfg.actor.loss_agg_mode == "token-mean"
    assert cfg.rollout.gpu_memory_utilization == 0.72  # the H800 cluster: 3.3 GiB of headroom (tests/test_plan.py)


def test_ablations_differ_only_where_the_paper_says():
    without_ds = load_config("dapo_wo_ds_qwen2.5_32b")
    assert not without_ds.algorithm.filter_groups.enable
    assert without_ds.data.effective_gen_batch_size == without_ds.data.train_batch_size
    assert without_ds.actor.loss_agg_mode == "token-mean"
    early = load_config("dapo_early_qwen2.5_32b")
    assert not early.algorithm.filter_groups.enable and early.data.effective_gen_batch_size == 512
    assert early.actor.loss_agg_mode == "seq-mean-token-mean"
    assert early.rollout.gpu_memory_utilization == 0.78  # the H20 cluster's value (colocated: fits 96 GB)


def test_32b_layout_is_the_documented_one():
    mg = load_config("dapo_qwen2.5_32b").actor.megatron
    layout = (
        mg.tensor_model_parallel_size,
        mg.pipeline_model_parallel_size,
        mg.context_parallel_size,
        mg.expert_model_parallel_size,
    )
    assert layout == (8, 2, 1, 1)
    assert mg.sequence_parallel and mg.use_distributed_optimizer and mg.recompute_granularity == "full"


def test_moe_preset_keeps_the_recipe_with_its_own_model_and_layout():
    cfg = load_config("dapo_qwen3_30b_a3b")
    assert cfg.model.path == "Qwen/Qwen3-30B-A3B-Base"
    assert cfg.actor.megatron.expert_model_parallel_size == 8 and cfg.actor.megatron.sequence_parallel
    assert cfg.actor.optim.lr == 1e-6 and cfg.data.effective_gen_batch_size == 1536


def test_environment_sets_model_and_data_paths(monkeypatch):
    monkeypatch.setenv("HF_MODEL", "/models/qwen25-32b")
    monkeypatch.setenv("DAPO_DATA_DIR", "/shared/dapo")
    cfg = load_config("dapo_qwen2.5_32b")
    assert cfg.model.path == "/models/qwen25-32b"
    assert cfg.data.train_files == ["/shared/dapo/dapo-math-17k.parquet"]
    assert cfg.data.val_files == ["/shared/dapo/aime-2024.parquet"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["actor.megatron.tensor_model_parallel_size=3"], r"TP=3 x PP=2 x CP=1 = 6 must divide the 128"),
        (["actor.megatron.expert_model_parallel_size=3"], r"ETP=8 x EP=3 x PP=2 = 48 must divide the 128"),
        (
            ["actor.megatron.tensor_model_parallel_size=1", "actor.megatron.pipeline_model_parallel_size=8"],
            r"actor\.megatron\.sequence_parallel=True: needs tensor_model_parallel_size > 1",
        ),
        (
            ["actor.megatron.pipeline_model_parallel_size=1", "actor.megatron.virtual_pipeline_model_parallel_size=2"],
            r"actor\.megatron\.virtual_pipeline_model_parallel_size=2",
        ),
        (["actor.megatron.fp8=e5m2"], r"actor\.megatron\.fp8='e5m2': choose one of \['null', 'hybrid', 'e4m3'\]"),
        (["actor.megatron.fp8_recipe=nvfp4"], r"actor\.megatron\.fp8_recipe='nvfp4'"),
        (["actor.megatron.recompute_granularity=some"], r"actor\.megatron\.recompute_granularity='some'"),
        (
            ["actor.megatron.sequence_parallel=false", "actor.megatron.expert_model_parallel_size=2"],
            r"must be true when experts",
        ),
        (
            [
                "actor.megatron.tensor_model_parallel_size=1",
                "actor.megatron.pipeline_model_parallel_size=1",
                "actor.megatron.sequence_parallel=false",
                "actor.ppo_mini_batch_size=1",
                "rollout.n=1",
                "data.train_batch_size=1",
                "data.gen_batch_size=1",
            ],
            r"1 sequences per optimizer step must split evenly over DP = 128",
        ),
        (["actor.megatron.context_parallel_size=0"], r"actor\.megatron\.context_parallel_size=0: must be >= 1"),
        (
            ["actor.megatron.context_parallel_size=2", "actor.megatron.pipeline_model_parallel_size=1"],
            r"context_parallel_size=2: context parallelism splits packed rows: "
            r"set actor.megatron.sequence_packing=true",
        ),
        (
            ["actor.megatron.transformer_impl=local"],
            r"sequence_parallel=True: needs transformer_impl=transformer_engine",
        ),
        (
            [
                "actor.megatron.transformer_impl=local",
                "actor.megatron.sequence_parallel=false",
                "actor.megatron.fp8=hybrid",
            ],
            r"fp8='hybrid': needs transformer_impl=transformer_engine",
        ),
        (["actor.megatron.transformer_impl=te"], r"transformer_impl='te'"),
        (
            ["actor.megatron.use_distributed_optimizer=false"],
            r"overlap_param_gather=True: needs use_distributed_optimizer=true",
        ),
        (["actor.megatron.ddp_bucket_size=0"], r"ddp_bucket_size=0: must be a positive number"),
        (["actor.megatron.moe_aux_loss_coeff=-0.1"], r"moe_aux_loss_coeff=-0.1: must be >= 0"),
        (
            ["actor.megatron.release_grad_buffers=true", "trainer.colocate=false"],
            r"release_grad_buffers=True: frees the gradients' memory for engines that share the GPUs",
        ),
    ],
)
def test_impossible_megatron_layouts_fail_with_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("dapo_qwen2.5_32b", overrides)


def test_more_training_ranks_than_gpus_fail():
    with pytest.raises(ConfigError, match=r"actor\.num_workers=256: one training rank per GPU: the job has 128"):
        load_config("dapo_qwen2.5_32b", ["actor.num_workers=256"])


def test_megatron_fields_are_ignored_by_the_torch_backend():
    cfg = load_config("tiny_cpu", ["actor.megatron.tensor_model_parallel_size=3", "actor.megatron.fp8=e5m2"])
    assert cfg.actor.backend == "torch"


def test_megatron_on_cpu_counts_processes():
    """Without GPUs the training ranks are actor.num_workers processes (the gloo test bed)."""
    base = ["actor.backend=megatron", "actor.num_workers=2", "actor.megatron.tensor_model_parallel_size=2"]
    assert load_config("tiny_cpu", base).actor.megatron.tensor_model_parallel_size == 2
    with pytest.raises(ConfigError, match="must divide the 2 training ranks"):
        load_config("tiny_cpu", base + ["actor.megatron.pipeline_model_parallel_size=2"])


def test_every_megatron_field_reaches_the_worker():
    """The worker is built from ``actor.megatron`` itself, and every field of it is read by the
    Megatron backend (a field nobody reads would be a setting silently dropped)."""
    import inspect
    from dataclasses import fields
    from pathlib import Path

    from nemo_dapo.config.schema_actor import MegatronConfig
    from nemo_dapo.policy.megatron.worker import MegatronPolicyWorker

    assert "layout" in inspect.signature(MegatronPolicyWorker).parameters
    backend = Path(inspect.getfile(MegatronPolicyWorker)).parent
    topology = backend.parents[1] / "config" / "topology.py"  # Parallelism.of: the sizes, for the worker
    assert "Parallelism.of(layout)" in (backend / "worker.py").read_text()
    source = "".join(path.read_text() for path in [*backend.glob("*.py"), topology])
    unread = [f.name for f in fields(MegatronConfig) if f"layout.{f.name}" not in source]
    assert not unread, f"actor.megatron fields the Megatron backend never reads: {unread}"
    assembly = backend.parents[1] / "trainer" / "assembly.py"
    assert 'kwargs["layout"] = cfg.actor.megatron' in assembly.read_text()
