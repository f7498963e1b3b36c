"""The config schema: every preset validates, impossible values fail with the key named."""

import pytest

from nemo_dapo.algo.correction import correction_settings
from nemo_dapo.config import ConfigError, from_yaml, list_presets, load_config, to_yaml
from nemo_dapo.config.load import conf_dir


def test_there_are_presets():
    assert "tiny_cpu" in list_presets() and "dapo" in list_presets()


@pytest.mark.parametrize("name", sorted(p.stem for p in conf_dir().glob("*.yaml")))
def test_every_preset_loads_and_validates(name):
    cfg = load_config(name)
    assert cfg.actor.clip_ratio_c > 1
    assert from_yaml(to_yaml(cfg)) == cfg  # the saved config reloads to the same object


def test_dapo_defaults():
    cfg = load_config("dapo")
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high, cfg.actor.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert cfg.actor.loss_agg_mode == "token-mean"
    assert cfg.algorithm.filter_groups.enable and cfg.reward.overlong_buffer.enable
    assert not cfg.algorithm.use_kl_in_reward and not cfg.actor.use_kl_loss


def test_dotted_overrides_and_composition():
    cfg = load_config("tiny_cpu", ["actor.clip_ratio_high=0.3", "algorithm.filter_groups.enable=false"])
    assert cfg.actor.clip_ratio_high == 0.3 and not cfg.algorithm.filter_groups.enable
    assert cfg.actor.clip_ratio_c == 10.0  # from dapo.yaml through `defaults:`
    assert cfg.data.effective_gen_batch_size == 48


@pytest.mark.parametrize(
    "override,key",
    [
        ("actor.clip_ratio_c=1.0", "actor.clip_ratio_c"),
        ("reward.overlong_buffer.len=64", "reward.overlong_buffer.len"),
        ("reward.overlong_buffer.len=0", "reward.overlong_buffer.len"),
        ("actor.loss_agg_mode=token-sum", "actor.loss_agg_mode"),
        ("data.gen_batch_size=8", "data.gen_batch_size"),
        ("actor.ppo_mini_batch_size=5", "actor.ppo_mini_batch_size"),
        ("algorithm.adv_estimator=gae", "algorithm.adv_estimator"),
        ("algorithm.kl_penalty=k4", "algorithm.kl_penalty"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("trainer.mode=fast", "trainer.mode"),
        ("algorithm.rollout_correction.preset=magic", "algorithm.rollout_correction.preset"),
        ("algorithm.rollout_correction.loss_type=reinforce", "algorithm.rollout_correction.loss_type"),
        ("algorithm.rollout_correction.rollout_rs=token_k1", "rollout_rs"),
        ("algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.type"),
        ("checkpoint.async_save=true", "checkpoint.async_save"),  # the torch backend saves synchronously
        ("actor.attn_implementation=flash", "actor.attn_implementation"),
    ],
)
def test_impossible_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("tiny_cpu", [override])


def test_eager_attention_is_the_torch_backends_choice():
    assert load_config("tiny_cpu", ["actor.attn_implementation=eager"]).actor.attn_implementation == "eager"
    with pytest.raises(ConfigError, match=r"actor\.attn_implementation='eager': chooses the torch backend"):
        load_config("tiny_cpu", ["actor.attn_implementation=eager", "actor.backend=megatron"])


def test_auto_attention_is_eager_for_short_sequences_of_the_torch_backend_on_cpus():
    """auto: eager where it trains faster (torch backend, CPU, prompt + response <= 512 tokens);
    sdpa for long sequences (eager's memory grows with their square), on GPUs, and for megatron,
    which takes auto like sdpa instead of refusing it as it refuses eager."""

    def attention(preset: str, *overrides: str) -> str:
        return load_config(preset, list(overrides)).actor.attn_implementation

    assert attention("tiny_cpu") == "eager" and attention("smollm2_cpu") == "eager"
    assert attention("tiny_cpu", "data.max_prompt_length=256", "data.max_response_length=256") == "eager"
    assert attention("tiny_cpu", "data.max_prompt_length=256", "data.max_response_length=257") == "sdpa"
    assert attention("tiny_cpu", "actor.backend=megatron") == "sdpa"
    assert attention("dapo_qwen2.5_32b") == "sdpa"  # GPU nodes
    assert attention("tiny_cpu", "actor.attn_implementation=sdpa") == "sdpa"  # a choice stays


def test_auto_dtype_is_bf16_on_gpus_and_on_cpus_with_bf16_matrix_instructions(tmp_path, monkeypatch):
    from nemo_dapo import threads

    amx, avx2 = tmp_path / "amx", tmp_path / "avx2"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n")
    avx2.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n")
    assert threads.cpu_has_bf16_matmul(str(amx)) and not threads.cpu_has_bf16_matmul(str(avx2))
    assert not threads.cpu_has_bf16_matmul(str(tmp_path / "absent"))
    for has_bf16, cpu_dtype in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(threads, "cpu_has_bf16_matmul", lambda answer=has_bf16: answer)
        assert load_config("tiny_cpu", ["model.dtype=auto"]).model.dtype == cpu_dtype
        assert load_config("dapo_qwen2.5_32b", ["model.dtype=auto"]).model.dtype == "bfloat16"  # GPU nodes


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as err:
        load_config("tiny_cpu", ["actor.clip_ratio_c=0.5", "rollout.n=0"])
    assert "actor.clip_ratio_c" in str(err.value) and "rollout.n" in str(err.value)


def test_unknown_key_and_wrong_type_name_the_key():
    with pytest.raises(ConfigError, match="actor.clip_ratio_hgih"):
        load_config("tiny_cpu", ["actor.clip_ratio_hgih=0.3"])
    with pytest.raises(ConfigError, match="actor.ppo_epochs"):
        load_config("tiny_cpu", ["actor.ppo_epochs=many"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("no_such_preset")


def test_correction_preset_then_explicit_fields():
    cfg = load_config(
        "tiny_cpu",
        [
            "algorithm.rollout_correction.preset=decoupled_token_is",
            "algorithm.rollout_correction.rollout_is_threshold=3.0",
        ],
    )
    settings = correction_settings(cfg.algorithm.rollout_correction)
    assert (settings.rollout_is, settings.rollout_is_threshold, settings.bypass_mode) == ("token", 3.0, False)
    cfg = load_config(
        "tiny_cpu", ["algorithm.rollout_correction.preset=bypass_pg_is", "algorithm.rollout_correction.rollout_is=none"]
    )
    assert correction_settings(cfg.algorithm.rollout_correction).rollout_is is None


def test_preset_loop_detected(tmp_path, monkeypatch):
    (tmp_path / "a.yaml").write_text("defaults: [b]\n")
    (tmp_path / "b.yaml").write_text("defaults: [a]\n")
    monkeypatch.setenv("NEMO_DAPO_CONF_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="loop"):
        load_config("a")


def test_a_hub_name_as_model_path_is_refused_before_anything_runs(tmp_path, capsys):
    """No hub is reachable from a training job: a name that is neither a folder nor a built-in
    fails at start-up naming model.path and how to download it, not after training."""
    from nemo_dapo.cli import main

    code = main(["train", "model.path=Qwen/Qwen2.5-32B", f"trainer.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "model.path=Qwen/Qwen2.5-32B: not a model folder here" in err, err[-2000:]
    assert "huggingface-cli download Qwen/Qwen2.5-32B" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_retired_async_trainer_is_refused_naming_stream(tmp_path, capsys):
    """trainer.mode=async and a parameter_sync_step other than 1 fail at load naming trainer.mode=stream;
    parameter_sync_step=1, which every config saved by an older run holds, is dropped."""
    from nemo_dapo.cli import main
    from nemo_dapo.config.load import from_yaml, to_yaml

    with pytest.raises(ConfigError, match=r"trainer\.mode='async': .* set trainer\.mode=stream"):
        load_config("tiny_cpu", ["trainer.mode=async"])
    with pytest.raises(ConfigError, match=r"trainer\.parameter_sync_step=3: .*trainer\.mode=stream.* remove the key"):
        load_config("tiny_cpu", ["trainer.parameter_sync_step=3"])
    saved = to_yaml(load_config("tiny_cpu", ["trainer.max_staleness=2"]))
    older = saved.replace("  max_staleness: 2", "  parameter_sync_step: 1\n  max_staleness: 2")
    assert older != saved and from_yaml(older) == from_yaml(saved)
    code = main(["train", "trainer.mode=async", f"trainer.output_dir={tmp_path / 'run'}"])
    assert code == 2 and "set trainer.mode=stream" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_numbers_are_checked_against_the_bounds_their_fields_declare():
    from nemo_dapo.config.fields import settings

    bounded = {key: s for key, s in settings().items() if s.bounds is not None}
    assert len(bounded) >= 20 and all(s.in_bounds(s.default) for s in bounded.values())
    top_p = bounded["rollout.top_p"]
    assert top_p.in_bounds(1.0) and not top_p.in_bounds(0.0) and not top_p.in_bounds(1.01)
    assert bounded["actor.clip_ratio_low"].in_bounds(0.0) and not bounded["actor.clip_ratio_low"].in_bounds(1.0)
    assert not bounded["rollout.n"].in_bounds("8") and not bounded["rollout.n"].in_bounds(True)
    with pytest.raises(ConfigError) as err:
        load_config("tiny_cpu", ["rollout.top_p=0", "trainer.total_training_steps=0", "actor.optim.lr=-1"])
    message = str(err.value)
    assert "rollout.top_p=0.0: must be in (0, 1]" in message
    assert "trainer.total_training_steps=0: must be >= 1 or null" in message
    assert "actor.optim.lr=-1.0: must be > 0" in message
    assert load_config("tiny_cpu", ["trainer.total_training_steps=null"]).trainer.total_training_steps is None


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.mode=stream", "rollout.max_inflight=0"], r"rollout\.max_inflight=0"),
        (["trainer.max_token_staleness=1"], r"trainer\.max_token_staleness=1: only the streaming trainer"),
        (["trainer.mode=stream", "rollout.kv_after_update=drop"], r"rollout\.kv_after_update"),
    ],
)
def test_streaming_settings_that_cannot_work_fail_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny_cpu", overrides)


def test_a_sample_budget_counts_streamed_samples():
    cfg = load_config("tiny_cpu", ["trainer.mode=stream", "trainer.total_generated_samples=1000"])
    assert cfg.trainer.total_generated_samples == 1000 and cfg.rollout.kv_after_update == "recompute"
    assert cfg.algorithm.filter_groups.carry_over is True  # null: the stream's own way, kept
    assert cfg.rollout.max_inflight == 2 * 32 * 8  # null: (max_staleness 1 + 1) x 32 groups x 8, one engine
    assert cfg.actor.loss_scale_factor == 16.0 and cfg.rollout.timeout_s == cfg.trainer.remote_timeout_s
    synced = load_config("tiny_cpu", ["rollout.timeout_s=30", "actor.loss_scale_factor=4"])
    assert synced.algorithm.filter_groups.carry_over is False and synced.rollout.max_inflight is None  # sync: unused
    assert (synced.rollout.timeout_s, synced.actor.loss_scale_factor) == (30, 4.0)  # given: kept


def test_engines_follow_the_allocation_when_colocated_on_gpus():
    """rollout.num_workers=null (the GPU cluster presets): the job's GPUs over the engines' TP, so a
    two-node bring-up needs only what the batch script passes from the allocation."""
    assert load_config("dapo_qwen2.5_32b").rollout.num_workers == 32
    two_nodes = ["trainer.nnodes=2", "actor.num_workers=16"]
    assert load_config("dapo_qwen2.5_32b", two_nodes).rollout.num_workers == 4
    assert load_config("dapo_qwen2.5_32b", [*two_nodes, "rollout.tensor_parallel_size=8"]).rollout.num_workers == 2
    with pytest.raises(ConfigError, match=r"rollout\.num_workers=2: colocated, the engines must cover all 16 GPUs"):
        load_config("dapo_qwen2.5_32b", [*two_nodes, "rollout.num_workers=2"])  # given, it is taken as given
    with pytest.raises(ConfigError, match=r"rollout\.num_workers=None: null is derived only for a GPU job"):
        load_config("tiny_cpu", ["rollout.num_workers=null"])
