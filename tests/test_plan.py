"""`nemo-dapo plan`: the production preset fits, impossible layouts are refused, formulas match a hand count."""

import json
import subprocess

import pytest

from nemo_dapo.cli import main
from nemo_dapo.commands.plan import make_plan
from nemo_dapo.config import ConfigError, load_config
from nemo_dapo.config.architecture import KNOWN_ARCHITECTURES, resolve_architecture
from nemo_dapo.config.capacity import GIB

# 24 GPUs: divisible by 3, so TP=3 / EP=3 pass the config's world-size check and reach the model's shape
THREE_NODES = ("trainer.nnodes=3", "actor.num_workers=24", "rollout.num_workers=6")


def run_plan(capsys, *args):
    code = main(["plan", *args, "--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


def test_known_architectures_match_published_parameter_counts():
    # Qwen2.5-32B: 32,763,876,352 (its config.json: 64 x 487,605,248 + 2 x 152064 x 5120 + 5120)
    assert KNOWN_ARCHITECTURES["qwen2.5-32b"].total_params() == 32_763_876_352
    assert KNOWN_ARCHITECTURES["qwen3-30b-a3b"].total_params() == pytest.approx(30.5e9, rel=0.01)
    assert resolve_architecture("/models/Qwen2.5-32B-Instruct/").name == "Qwen2.5-32B"
    assert resolve_architecture("Qwen/Qwen3-30B-A3B-Base").is_moe


H800_GIB = 81559 / 1024  # nvidia-smi's memory.total of an H800, in GiB (docs/cluster.md)


def test_32b_preset_fits_an_h800_with_headroom(capsys):
    code, plan, _ = run_plan(capsys, "dapo_qwen2.5_32b")
    assert code == 0 and plan["fits"] and plan["problems"] == [] and plan["warnings"] == []
    assert plan["gpu_memory_gib"] == pytest.approx(79.647, abs=1e-3)
    assert plan["headroom_gib"] == pytest.approx(H800_GIB - plan["colocated"]["peak"]) and plan["headroom_gib"] > 2
    assert plan["dp"] == 8 and plan["world"] == 128
    training = plan["training"]
    assert training["total"] < 80
    assert training["weights"] == pytest.approx(plan["params_per_gpu"] * 2 / GIB)
    assert training["activations"]["full"] < training["activations"]["none"] / 10  # recompute is what makes room
    assert plan["generation"]["full_sequences"] >= 1


def test_text_report_states_memory_and_verdict(capsys):
    assert main(["plan", "dapo_qwen2.5_32b"]) == 0
    report = capsys.readouterr().out
    assert "total per GPU" in report and "of 79.65" in report and "KV cache" in report
    assert "headroom    3.32 GiB per GPU beyond the reserve (peak 76.33 of 79.65)" in report
    assert report.rstrip().endswith("fits")


def test_moe_preset_fits(capsys):
    code, plan, _ = run_plan(capsys, "dapo_qwen3_30b_a3b")
    assert code == 0 and plan["expert_dp"] == 16 and plan["training"]["total"] < 80 and plan["warnings"] == []
    # ETP = TP = 2 (megatron-core's default) spreads each EP=8 group over two nodes: said, not refused
    code, plan, err = run_plan(capsys, "dapo_qwen3_30b_a3b", "actor.megatron.expert_tensor_parallel_size=null")
    assert code == 0 and plan["fits"] and "16 expert-parallel groups span nodes" in err
    assert [w for w in plan["warnings"] if "span nodes" in w] and plan["expert_dp"] == 8


def test_no_model_parallelism_for_32b_is_refused(capsys):
    code, plan, err = run_plan(
        capsys,
        "dapo_qwen2.5_32b",
        "actor.megatron.tensor_model_parallel_size=1",
        "actor.megatron.pipeline_model_parallel_size=1",
        "actor.megatron.sequence_parallel=false",
    )
    assert code == 1 and not plan["fits"]
    assert plan["training"]["total"] > 80
    assert any("training needs" in p and "the GPU has 79.65 GiB" in p for p in plan["problems"])
    assert "cannot run as configured" in err


def test_gpu_model_or_memory_flag_decides_and_thin_headroom_is_warned(capsys):
    code, plan, _ = run_plan(capsys, "dapo_qwen2.5_32b", "--gpu-memory-gib", "20")
    assert code == 1 and any("the GPU has 20 GiB" in p for p in plan["problems"])
    code, plan, _ = run_plan(capsys, "dapo_early_qwen2.5_32b", "--gpu", "H20")
    assert code == 0 and plan["gpu_memory_gib"] == pytest.approx(97871 / 1024)
    # vLLM's share at 0.75 of an H800 leaves 0.93 GiB beyond the reserve: it fits, with a warning
    code, plan, err = run_plan(capsys, "dapo_qwen2.5_32b", "rollout.gpu_memory_utilization=0.75")
    assert code == 0 and plan["fits"] and plan["headroom_gib"] == pytest.approx(0.93, abs=0.01)
    assert len(plan["warnings"]) == 1 and "leaves 0.93 GiB of the GPU's 79.65 beyond the 4 GiB reserve" in err
    code, plan, _ = run_plan(
        capsys, "dapo_qwen2.5_32b", "rollout.gpu_memory_utilization=0.75", "--min-headroom-gib", "0.5"
    )
    assert code == 0 and plan["warnings"] == []


def test_tp_not_dividing_heads_is_refused(capsys):
    code, plan, _ = run_plan(
        capsys,
        "dapo_qwen2.5_32b",
        *THREE_NODES,
        "actor.megatron.tensor_model_parallel_size=3",
        "actor.megatron.pipeline_model_parallel_size=1",
    )
    assert code == 1
    heads = "actor.megatron.tensor_model_parallel_size=3 does not divide the model's 40 attention heads"
    assert heads in plan["problems"]


def test_layers_experts_and_rollout_shapes_are_checked(capsys):
    _, plan, _ = run_plan(
        capsys,
        "dapo_qwen2.5_32b",
        *THREE_NODES,
        "actor.megatron.pipeline_model_parallel_size=3",
        "rollout.tensor_parallel_size=3",
    )
    problems = " | ".join(plan["problems"])
    assert "does not divide the model's 64 layers" in problems
    assert "rollout.tensor_parallel_size=3 does not divide the model's 40 attention heads" in problems
    _, plan, _ = run_plan(
        capsys, "dapo_qwen3_30b_a3b", *THREE_NODES, "rollout.n=3", "actor.megatron.expert_model_parallel_size=3"
    )
    assert "actor.megatron.expert_model_parallel_size=3 does not divide the model's 128 experts" in plan["problems"]
    _, plan, _ = run_plan(capsys, "dapo_qwen2.5_32b", "actor.megatron.expert_model_parallel_size=2")
    assert any("is dense (no experts)" in p for p in plan["problems"])
    _, plan, _ = run_plan(capsys, "dapo_qwen3_30b_a3b", "data.max_response_length=40000")
    longer = "data.max_prompt_length + data.max_response_length = 42048 exceeds the model's 40960 positions"
    assert any(p.startswith(longer) and p.endswith("at most 38912") for p in plan["problems"]), plan["problems"]
    _, plan, _ = run_plan(capsys, "dapo_qwen3_30b_a3b", "data.max_response_length=38912")
    assert not any("positions" in p for p in plan["problems"])
    _, plan, _ = run_plan(capsys, "dapo_qwen2.5_32b", "rollout.num_workers=64")
    assert "rollout.num_workers x rollout.tensor_parallel_size = 256 GPUs, the job has 128" in plan["problems"]


def test_colocated_peak_is_the_larger_phase(capsys):
    """Colocated, generation runs beside the resident training state; separate groups have no such figure."""
    _, plan, _ = run_plan(capsys, "dapo_qwen2.5_32b")
    training, colocated = plan["training"], plan["colocated"]
    resident = training["weights"] + training["gradients"] + training["optimizer"]
    assert colocated["training_phase"] == pytest.approx(training["total"])
    # the training process also keeps its reserve (CUDA context, NCCL buffers) while vLLM is awake
    assert colocated["generation_phase"] == pytest.approx(resident + training["reserve"] + 0.72 * H800_GIB)
    assert colocated["peak"] == max(colocated["training_phase"], colocated["generation_phase"]) < 80
    code, plan, _ = run_plan(capsys, "dapo_qwen2.5_32b", "rollout.gpu_memory_utilization=0.9")
    assert code == 1 and plan["colocated"]["generation_phase"] > 80
    assert any(
        p.startswith("colocated generation needs") and "rollout.gpu_memory_utilization to <= 0.76" in p
        for p in plan["problems"]
    )
    # the gradient buffers freed while the engines generate (actor.megatron.release_grad_buffers)
    _, released, _ = run_plan(capsys, "dapo_qwen2.5_32b", "actor.megatron.release_grad_buffers=true")
    freed = colocated["generation_phase"] - released["colocated"]["generation_phase"]
    assert freed == pytest.approx(training["gradients"]) and released["colocated"]["peak"] < colocated["peak"] - 7
    code, plan, _ = run_plan(
        capsys,
        "dapo_qwen2.5_32b",
        "rollout.gpu_memory_utilization=0.9",
        "trainer.colocate=false",
        "actor.num_workers=64",
        "rollout.num_workers=16",
    )
    assert code == 0 and plan["colocated"] is None


def test_colocated_kl_reference_adds_its_weights(capsys):
    """With a KL term the frozen reference model shares every GPU: its weights (and nothing else)
    stay resident in both phases; on separate GPUs it takes none of the actor's."""
    _, base, _ = run_plan(capsys, "dapo_qwen2.5_32b")
    _, kl, _ = run_plan(capsys, "dapo_qwen2.5_32b", "actor.use_kl_loss=true")
    assert base["training"]["reference"] == 0
    assert kl["training"]["reference"] == pytest.approx(kl["training"]["weights"])
    for phase in ("training_phase", "generation_phase"):
        assert kl["colocated"][phase] == pytest.approx(base["colocated"][phase] + kl["training"]["weights"])
    _, separate, _ = run_plan(
        capsys,
        "dapo_qwen2.5_32b",
        "actor.use_kl_loss=true",
        "trainer.colocate=false",
        "actor.num_workers=32",
        "rollout.num_workers=16",
    )
    assert separate["training"]["reference"] == 0


def test_kv_cache_without_room_is_refused(capsys):
    code, plan, _ = run_plan(capsys, "dapo_qwen2.5_32b", "rollout.tensor_parallel_size=1", "rollout.num_workers=128")
    assert code == 1 and plan["generation"]["kv_cache"] < 0
    assert any("vLLM" in p and "less than one 22528-token sequence" in p for p in plan["problems"])


def test_unknown_model_is_a_config_error(capsys):
    assert main(["plan", "dapo_qwen2.5_32b", "model.path=/nowhere/SomeModel-7B"]) == 2
    assert "not a known architecture" in capsys.readouterr().err


TINY = {
    "model_type": "llama",
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "intermediate_size": 16,
    "vocab_size": 10,
    "tie_word_embeddings": False,
    "attention_bias": False,
}


def test_numbers_match_a_hand_calculation(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    cfg = load_config(
        "dapo",
        [
            f"model.path={tmp_path}",
            "actor.backend=megatron",
            "trainer.n_gpus_per_node=4",
            "actor.num_workers=4",
            "actor.megatron.tensor_model_parallel_size=2",
            "actor.megatron.sequence_parallel=true",
            "actor.megatron.transformer_impl=transformer_engine",
            "data.max_prompt_length=4",
            "data.max_response_length=12",
            "reward.overlong_buffer.len=4",
            "actor.max_token_len_per_micro_batch=32",
            "rollout.tensor_parallel_size=2",
        ],
    )
    plan = make_plan(cfg, "tiny", gpu_memory_gib=1.0, reserve_gib=0.0)
    # per layer: attention 8*(8+4+4) + 8*8 = 192, MLP 3*8*16 = 384, norms 2*8 = 16 -> 592
    # total: 2*592 + embedding 80 + head 80 + final norm 8 = 1352
    assert plan.arch.total_params() == 1352
    # TP=2: per layer (192+384)/2 + 16 = 304; 2 layers + (80+80)/2 + 8 = 696 per GPU; DP = 4/2 = 2
    t = plan.training
    assert t.params == 696 and plan.layout.dp == 2
    assert t.weights * GIB == pytest.approx(696 * 2)  # bf16
    assert t.gradients * GIB == pytest.approx(696 * 4)  # fp32 grads
    assert t.optimizer * GIB == pytest.approx(696 * 12 / 2)  # master + m + v over DP=2
    # 32 tokens per micro-batch; per token per layer: 4h/TP (SP) = 16 + (2*8 + 2*4 + 3*16)/2 = 36
    # -> 52 elements = 104 bytes
    assert t.activations["none"] * GIB == pytest.approx(2 * 32 * 104)
    # full: each layer keeps its input, 32 tokens * 8 / 2 * 2 bytes = 256, plus one layer recomputed
    assert t.activations["full"] * GIB == pytest.approx(2 * 256 + 32 * 104)
    assert t.logits * GIB == pytest.approx(32 * 10 / 2 * (2 + 4 + 4))
    # vLLM TP=2 with 1 KV head: replicated; 2 layers * 1 head * 4 dims * (K, V) * 2 bytes = 32 bytes/token
    g = plan.generation
    assert g.kv_bytes_per_token == 32 and g.weights * GIB == pytest.approx(1352 * 2 / 2)
    assert g.kv_tokens == int((0.8 * GIB - 1352) // 32)
    assert g.full_sequences == g.kv_tokens // 16


def test_the_start_up_check_refuses_gpus_other_than_the_plan_assumes():
    """trainer.gpu_model against the head node's GPUs (facts as nvidia-smi gives them): the H800
    preset on H20 nodes, on a MIG slice, or with no GPU is refused naming what was found and the
    fix; the right GPUs, a CPU job and gpu_model=null pass."""
    from nemo_dapo.config import load_config
    from nemo_dapo.config.model_checks import gpu_problems

    h800 = load_config("dapo_qwen2.5_32b")
    assert h800.trainer.gpu_model == "H800" and load_config("dapo_early_qwen2.5_32b").trainer.gpu_model == "H20"
    assert gpu_problems(h800, [("NVIDIA H800", 81559)] * 8) == []
    (wrong,) = gpu_problems(h800, [("NVIDIA H20", 97871)] * 8)
    assert "GPUs are NVIDIA H20 (97871 MiB): set trainer.gpu_model=H20 after `nemo-dapo plan --gpu H20`" in wrong
    (sliced,) = gpu_problems(h800, [("NVIDIA H800", 40192)])
    assert "reports 40192 MiB, the plan assumes 81559 (a MIG slice" in sliced
    assert "nvidia-smi is missing" in gpu_problems(h800, None)[0]
    (unknown,) = gpu_problems(h800, [("NVIDIA A100-SXM4-80GB", 81920)])
    assert "GPUs are NVIDIA A100-SXM4-80GB (81920 MiB): check the nodes" in unknown
    assert gpu_problems(load_config("dapo_qwen2.5_32b", ["trainer.gpu_model=null"]), [("NVIDIA H20", 97871)]) == []
    assert gpu_problems(load_config("tiny_cpu", ["trainer.gpu_model=H800"]), None) == []  # CPU mode


def test_a_checkpoint_is_sized_and_a_background_save_longer_than_the_margin_is_warned(capsys):
    """32B in bf16: 2 bytes a parameter for the Hugging Face copy, 2 + 4 + 8 for the training state."""
    code, plan, err = run_plan(capsys, "dapo_qwen2.5_32b")
    params = KNOWN_ARCHITECTURES["qwen2.5-32b"].total_params()
    assert code == 0 and plan["checkpoint_gb"] == pytest.approx(params * 16 / 1e9) and "SAVE_MARGIN_S" not in err
    assert plan["save_s"] == pytest.approx(params * 16 / 1e9 / 5.0)  # the default 5 GB/s
    code, plan, err = run_plan(capsys, "dapo_qwen2.5_32b", "--storage-gb-per-s", "1")
    assert code == 0 and "longer than the batch script's SAVE_MARGIN_S=300 s" in err  # async_save in the preset
    code, plan, err = run_plan(capsys, "dapo_qwen2.5_32b", "checkpoint.async_save=false", "--storage-gb-per-s", "1")
    assert "SAVE_MARGIN_S" not in err  # a blocking save is on the trainer's own clock (checkpoint.save_by)


def test_train_refuses_a_layout_plan_refuses_before_touching_anything(tmp_path):
    """The 32B preset on two nodes (DP=1, the optimizer unsharded) with a 32B config.json: `nemo-dapo
    train` exits 2 naming the engine share that fits and the gradient buffers' release, before its
    output folder, the data or Ray exist; the same layout fitted by those settings passes the check."""
    from nemo_dapo.config.gpu_fit import startup_memory_problems
    from tests.train_runs import CLI, ENV

    model = tmp_path / "Qwen2.5-32B"
    model.mkdir()
    arch = KNOWN_ARCHITECTURES["qwen2.5-32b"]
    raw = {"model_type": "qwen2", "hidden_size": arch.hidden_size, "num_hidden_layers": arch.num_layers,
           "num_attention_heads": arch.num_attention_heads, "num_key_value_heads": arch.num_kv_heads,
           "intermediate_size": arch.intermediate_size, "vocab_size": arch.vocab_size,
           "max_position_embeddings": arch.max_positions}  # fmt: skip
    (model / "config.json").write_text(json.dumps(raw))
    out = tmp_path / "run"
    two_nodes = ["trainer.nnodes=2", "actor.num_workers=16", f"trainer.output_dir={out}"]
    env = {**ENV, "HF_MODEL": str(model), "DAPO_DATA_DIR": str(tmp_path / "no-data")}
    done = subprocess.run([*CLI, "train", "--config", "dapo_qwen2.5_32b", *two_nodes], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "colocated generation needs 97.3 GiB per GPU" in done.stderr
    assert "lower rollout.gpu_memory_utilization to <= 0.49" in done.stderr
    assert "set actor.megatron.release_grad_buffers=true (then rollout.gpu_memory_utilization <= 0.59)" in done.stderr
    assert "trainer.gpu_model=null skips this check" in done.stderr and not out.exists() and "ray" not in done.stderr
    fitted = ["rollout.gpu_memory_utilization=0.47", f"model.path={model}"]
    assert startup_memory_problems(load_config("dapo_qwen2.5_32b", [*two_nodes, *fitted])) == []
    unchecked = ["trainer.gpu_model=null", "rollout.gpu_memory_utilization=0.9"]  # plan's model is skipped
    assert startup_memory_problems(load_config("dapo_qwen2.5_32b", [*two_nodes, *fitted, *unchecked])) == []


@pytest.mark.parametrize("preset", ["dapo_qwen2.5_32b", "dapo_qwen3_30b_a3b"])
def test_every_ladder_rung_of_a_preset_fits_its_nodes(preset):
    """Rung 1 runs the preset's one-node sibling as it stands; rungs 2-4 run the preset on two nodes
    with the largest engine share that leaves 2 GiB of headroom; each final config loads and fits."""
    from nemo_dapo.commands.ladder import ONE_NODE_SIBLINGS, plan_rung, shape_overrides
    from nemo_dapo.config.capacity import gpu_memory_gib

    sibling = ONE_NODE_SIBLINGS[resolve_architecture(load_config(preset, placement=False).model.path).name]
    for rung in (1, 2, 3, 4):
        submission, _ = plan_rung(preset, rung, 2, [])
        assert (submission.config, submission.nodes) == ((sibling, 1) if rung == 1 else (preset, 2))
        fitted = [o for o in submission.overrides if o.startswith("rollout.gpu_memory_utilization=")]
        assert bool(fitted) == (rung != 1), submission.overrides
        base = load_config(submission.config, placement=False)
        cfg = load_config(submission.config, [*shape_overrides(base, submission.nodes), *submission.overrides])
        plan = make_plan(cfg, submission.config, gpu_memory_gib("H800"), 4.0, 2.0)
        assert not plan.problems and 2.0 <= plan.headroom < 2.8, (rung, plan.headroom)
    # the user's overrides come last and win; one that cannot fit refuses the rung
    submission, _ = plan_rung(preset, 3, 4, ["trainer.total_training_steps=7"])
    assert submission.overrides[-1] == "trainer.total_training_steps=7" and submission.nodes == 4
    with pytest.raises(ConfigError, match=r"rung 2 \(.* on 2 node\(s\)\) cannot run: it cannot fit"):
        plan_rung(preset, 2, 2, ["rollout.gpu_memory_utilization=0.9"])


def test_a_multi_node_gpu_run_without_a_fabric_says_what_it_sends_over_the_management_network():
    from nemo_dapo.config.model_checks import fabric_warning

    cfg = load_config("dapo_qwen2.5_32b", placement=False)
    assert "FABRIC_IFNAME is unset on a 16-node GPU run: the weight sync (at least the model, 65.5 GB" in (
        fabric_warning(cfg, {})
    )
    assert fabric_warning(cfg, {"FABRIC_IFNAME": "ib0"}) is None
    assert fabric_warning(load_config("dapo_qwen2.5_7b", placement=False), {}) is None  # one node
    assert fabric_warning(load_config("tiny_cpu", ["trainer.nnodes=2"], placement=False), {}) is None  # CPUs


POOLS_32B = (
    "trainer.nnodes=8",
    "actor.num_workers=64",
    "trainer.colocate=false",
    "trainer.gpu_model=H800",
    "trainer.rollout_pool.nnodes=4",
    "trainer.rollout_pool.gpu_model=H20",
    "rollout.num_workers=null",
    "rollout.tensor_parallel_size=2",
    "rollout.gpu_memory_utilization=0.9",
)


def test_two_pools_size_each_pool_on_its_own_gpu_and_split_a_step_between_them(capsys):
    """8 x H800 training, 4 x H20 engines: the engines' memory is an H20's, the engine count the
    rollout pool's GPUs over TP, and the step's split follows the roofline by hand."""
    code, plan, _ = run_plan(capsys, "dapo_qwen2.5_32b", *POOLS_32B, "--mean-response-tokens=4096")
    assert code == 0 and plan["fits"], plan["problems"]
    h20_gib = 97871 / 1024
    assert plan["generation"]["budget"] == pytest.approx(0.9 * h20_gib)
    assert plan["gpu_memory_gib"] == pytest.approx(H800_GIB)  # the training pool's
    params = KNOWN_ARCHITECTURES["qwen2.5-32b"].total_params()
    # update: 512 prompts x 16 x (256 + 4096) tokens, 8 x params FLOPs each, on 64 H800 at MFU 0.35
    update_s = 8 * params * 512 * 16 * (256 + 4096) / (64 * 989e12 * 0.35)
    pools = plan["pools"]
    assert pools["update_s"] == pytest.approx(update_s)
    # generation: 1536 x 16 sequences of 4096 tokens on 16 engines (4 nodes x 8 H20 / TP 2)
    per_engine = 512 * 3 * 16 * 4096 / 16 / pools["generation_s"]
    batch = min(1536, plan["generation"]["kv_tokens"] // (256 + 4096))
    compute_s = 2 * params / 2 * batch / (148e12 * 0.5)
    read_s = (plan["generation"]["weights"] * GIB + batch * 2304 * plan["generation"]["kv_bytes_per_token"]) / (
        4.0e12 * 0.6
    )
    assert per_engine == pytest.approx(batch / max(compute_s, read_s))
    ratio = pools["generation_s"] * 4 / pools["update_s"] / 8
    assert pools["balanced_rollout_nodes_per_training_node"] == pytest.approx(ratio)
    step = pools["generation_s"] + pools["update_s"]
    assert pools["idle_sync"] == pytest.approx([1 - pools["update_s"] / step, 1 - pools["generation_s"] / step])
    code, text = main(["plan", "dapo_qwen2.5_32b", *POOLS_32B]), capsys.readouterr().out
    assert code == 0 and "rollout nodes per training node keep both busy (this layout: 0.50)" in text
    assert "an estimate, not a measurement" in text


def test_two_pools_refuse_what_does_not_fit_a_pool():
    cases = {
        "trainer.colocate=true": "trainer.colocate",
        "rollout.tensor_parallel_size=16": "rollout.tensor_parallel_size=16: an engine stays inside one rollout node",
        "trainer.rollout_pool.n_gpus_per_node=0": "both pools have GPUs or neither",
        "rollout.min_engines=17": "rollout.min_engines=17: must be <= rollout.num_workers=16",
    }
    for override, named in cases.items():
        with pytest.raises(ConfigError, match=named):
            load_config("dapo_qwen2.5_32b", [*POOLS_32B, "rollout.num_workers=16", override])
    # 12 training nodes: DP = 96 / (TP 8 x PP 2) = 6 does not split the preset's mini-batch
    with pytest.raises(ConfigError, match="must split evenly over DP = 6"):
        load_config("dapo_qwen2.5_32b", [*POOLS_32B, "trainer.nnodes=12", "actor.num_workers=96"])
    assert load_config("dapo_qwen2.5_32b", list(POOLS_32B)).rollout.min_engines == 1
