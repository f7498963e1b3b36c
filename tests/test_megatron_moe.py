"""Qwen3-MoE (and dense Qwen3) on the Megatron policy worker: conversion, expert parallelism, parity.

The tiny models are random (:mod:`nemo_dapo.model.tiny_qwen3`). Ranks run in spawned processes
over gloo on 127.0.0.1, as in ``test_megatron_worker``, whose helpers these tests share. At EP=2
the two ranks are also two data-parallel replicas: each takes half the rows, and the all-to-all
dispatcher sends every token to the rank that holds its experts.
"""

import dataclasses
import importlib.util
import re

import pytest
import torch
from test_megatron_worker import assert_matches_torch, assert_same_update, megatron_result, torch_reference

from nemo_dapo.config.architecture import Architecture
from nemo_dapo.config.topology import Parallelism

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
        reason="megatron-core is not installed (optional 'megatron' extra)",
    ),
]


def checkpoint_and_shape(model_dir):
    from transformers import AutoConfig

    from nemo_dapo.policy.megatron.convert import model_shape
    from nemo_dapo.policy.megatron.model import read_hf_weights

    return read_hf_weights(str(model_dir)), model_shape(AutoConfig.from_pretrained(model_dir))


@pytest.mark.parametrize("tied", [False, True])
def test_each_chunk_reads_only_its_share_of_the_checkpoint(moe_dir, tied):
    """2 pipeline chunks x 2 EP ranks: every layer tensor is read by one chunk, every expert by one
    (chunk, EP rank), the embedding by the first chunk (and the last, whose head it is when tied),
    the final norm and head by the last; nothing else is read anywhere."""
    from nemo_dapo.policy.megatron import convert as convert

    hf, shape = checkpoint_and_shape(moe_dir)
    names = set(hf) | {"lm_head.weight"}
    shape = dataclasses.replace(shape, tie_word_embeddings=tied)
    chunks = [(convert.stage_layers(shape.num_layers, c, 2), c == 0, c == 1) for c in range(2)]
    readers = {
        name: [
            (c, ep)
            for c, chunk in enumerate(chunks)
            for ep in range(2)
            if convert.hf_name_needed(name, shape, *chunk, ep, 2)
        ]
        for name in names
    }
    for name, who in readers.items():
        if convert.HF_EXPERT.fullmatch(name):
            layer, expert = map(int, re.findall(r"\d+", name)[:2])
            assert who == [(layer * 2 // shape.num_layers, expert * 2 // shape.num_experts)], name
        elif convert.HF_LAYER.fullmatch(name):
            layer = int(re.findall(r"\d+", name)[0])
            assert {c for c, _ in who} == {layer * 2 // shape.num_layers} and len(who) == 2, name
        elif name == "model.embed_tokens.weight":
            assert {c for c, _ in who} == ({0, 1} if tied else {0}), name
        else:
            assert {c for c, _ in who} == {1}, name


@pytest.mark.parametrize("family", ["moe_dir", "qwen3_dir"])
def test_hf_to_megatron_to_hf_is_bit_exact(family, request):
    """PP=2, then EP=2 (a no-op for the dense model), then TP=2 and back."""
    from nemo_dapo.policy.megatron import convert as convert

    hf, shape = checkpoint_and_shape(request.getfixturevalue(family))
    full = convert.hf_to_megatron(hf, shape)

    def split_and_join(stage):
        parts = [convert.slice_experts(stage, shape, ep_rank, 2) for ep_rank in range(2)]
        parts = [
            {k: convert.unshard(k, [convert.shard(k, v, r, 2) for r in range(2)]) for k, v in part.items()}
            for part in parts
        ]
        return convert.unslice_experts(parts, shape)

    stages = [split_and_join(convert.stage_state(full, shape, pp, 2)) for pp in range(2)]
    back = convert.megatron_to_hf(convert.unstage_state(stages, shape), shape)
    assert list(back) and set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    assert torch.equal(
        full["decoder.layers.1.self_attention.k_layernorm.weight"], hf["model.layers.1.self_attn.k_norm.weight"]
    )


def test_expert_j_lives_on_ep_rank_j_div_n_as_local_expert_j_mod_n(moe_dir):
    from nemo_dapo.policy.megatron import convert as convert

    hf, shape = checkpoint_and_shape(moe_dir)
    second = convert.slice_experts(convert.hf_to_megatron(hf, shape), shape, ep_rank=1, ep_size=2)
    local = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc{}.weight"
    assert sum(convert.is_expert(k) for k in second) == shape.num_layers * 2 * 2  # 2 experts, fc1 + fc2
    assert torch.equal(second[local.format(2)], hf["model.layers.1.mlp.experts.3.down_proj.weight"])
    assert convert.global_expert_name(local.format(2), ep_rank=1, experts_per_rank=2) == local.format(2).replace(
        "local_experts.1", "local_experts.3"
    )
    # expert TP: rank 1's fc1 shard is the second half of gate, then the second half of up
    gate, up = (hf[f"model.layers.1.mlp.experts.3.{p}_proj.weight"] for p in ("gate", "up"))
    half = shape.moe_intermediate_size // 2
    assert torch.equal(
        convert.shard(local.format(1), second[local.format(1)], 1, 2), torch.cat([gate[half:], up[half:]])
    )
    assert torch.equal(second["decoder.layers.1.mlp.router.weight"], hf["model.layers.1.mlp.gate.weight"])


def test_transformer_engine_names_keep_the_moe_pre_mlp_norm():
    """The TE spec fuses the pre-MLP norm into linear_fc1 only in dense layers: a MoE layer keeps its own."""
    from nemo_dapo.policy.megatron import model as mm

    local = {
        "decoder.layers.0.input_layernorm.weight": torch.ones(1),
        "decoder.layers.0.pre_mlp_layernorm.weight": torch.ones(2),
        "decoder.layers.0.mlp.router.weight": torch.ones(3),
    }
    te = mm.to_te_names(local)
    assert set(te) == {
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.mlp.router.weight",
    }
    assert mm.to_local_names(te) == local


def test_unsupported_moe_layouts_are_refused():
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    from nemo_dapo.policy.megatron import model as mm
    from nemo_dapo.policy.megatron.convert import model_shape

    for config in (Qwen3MoeConfig(mlp_only_layers=[0]), Qwen3MoeConfig(decoder_sparse_step=2), Qwen2MoeConfig()):
        with pytest.raises(ValueError, match="mlp_only_layers|model_type"):
            model_shape(config)
    moe = model_shape(Qwen3MoeConfig(num_experts=4))
    with pytest.raises(ValueError, match=r"expert_model_parallel_size=3: must divide the model's 4 experts"):
        mm.check_expert_layout(moe, Parallelism(expert=3), sequence_parallel=False)
    with pytest.raises(ValueError, match=r"expert_model_parallel_size=2: the model has no experts"):
        dense = Architecture("dense", 64, 2, 4, 2, 16, 128, 100)
        mm.check_expert_layout(dense, Parallelism(expert=2), sequence_parallel=False)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2: Megatron trains MoE layers with TP > 1 only"):
        mm.check_expert_layout(moe, Parallelism(tensor=2, expert=2), sequence_parallel=False)
    mm.check_expert_layout(moe, Parallelism(tensor=2, expert=2), sequence_parallel=True)  # the GPU layout


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["actor.megatron.expert_model_parallel_size=3"],
            r"expert_model_parallel_size=3 does not divide the model's 4 "
            "experts",
        ),
        (
            ["actor.megatron.expert_model_parallel_size=2", "model.path={dense}"],
            r"expert_model_parallel_size=2: .* is dense \(no experts\)",
        ),
    ],
)
def test_start_up_knows_the_experts_of_a_local_model(overrides, message, moe_dir, qwen3_dir):
    """Checked before any worker is placed (the config itself loads: its model may not exist yet)."""
    from nemo_dapo.config import load_config
    from nemo_dapo.config.model_checks import startup_shape_problems

    base = [
        "actor.backend=megatron",
        "actor.num_workers=12",
        f"model.path={moe_dir}",  # 12 ranks: EP 2 or 3 fit
        "rollout.n=12",
    ]
    problems = startup_shape_problems(load_config("tiny_cpu", base + [o.format(dense=qwen3_dir) for o in overrides]))
    assert any(re.search(message, p) for p in problems), problems
    assert startup_shape_problems(load_config("tiny_cpu", base + ["actor.megatron.expert_model_parallel_size=2"])) == []


def megatron_run(tmp_path, model_dir, ep: int = 1, world_size: int = 1) -> dict:
    """The dense tests' run (log-probs, exports before and after one update), at EP = ``ep``."""
    return megatron_result(tmp_path, model_dir, world_size=world_size, expert_model_parallel_size=ep)


def per_expert_names(weights: dict) -> dict:
    """The torch worker's weights (HF keeps experts fused in memory: ``experts.gate_up_proj`` [E, 2F, H],
    ``experts.down_proj`` [E, H, F]) under the checkpoint's per-expert names, as Megatron exports them."""
    out = {}
    for name, tensor in weights.items():
        prefix, fused, kind = name.rpartition(".experts.")
        if not fused:
            out[name] = tensor
        elif kind == "gate_up_proj":
            for j, (gate, up) in enumerate(expert.chunk(2) for expert in tensor):
                out[f"{prefix}.experts.{j}.gate_proj.weight"], out[f"{prefix}.experts.{j}.up_proj.weight"] = gate, up
        else:
            out.update({f"{prefix}.experts.{j}.down_proj.weight": down for j, down in enumerate(tensor)})
    return out


def assert_exports_checkpoint(exported_weights: dict, model_dir) -> None:
    from nemo_dapo.policy.megatron.model import read_hf_weights

    checkpoint = read_hf_weights(str(model_dir))
    assert set(exported_weights) == set(checkpoint)
    assert all(torch.equal(exported_weights[k], checkpoint[k]) for k in checkpoint)


@pytest.fixture(scope="module")
def moe_reference(moe_dir):
    reference = torch_reference(moe_dir)
    return {**reference, "weights": per_expert_names(reference["weights"])}


@pytest.fixture(scope="module")
def ep1(tmp_path_factory, moe_dir):
    return megatron_run(tmp_path_factory.mktemp("ep1"), moe_dir)


@pytest.fixture(scope="module")
def ep2(tmp_path_factory, moe_dir):
    return megatron_run(tmp_path_factory.mktemp("ep2"), moe_dir, ep=2, world_size=2)


def test_ep1_matches_torch_worker(ep1, moe_reference):
    """Log-probs, loss, gradient norm and updated weights (experts and router included) of HF's model."""
    assert_matches_torch(ep1, moe_reference)


def test_ep2_matches_torch_worker(ep2, moe_reference):
    assert_matches_torch(ep2, moe_reference)


def test_ep2_update_matches_ep1(ep2, ep1):
    """Experts split over the two ranks, dense weights replicated (distributed optimizer): the same step."""
    assert_same_update(ep2, ep1)


def test_packed_ep2_matches_ep1(tmp_path, moe_dir, ep1, moe_reference):
    """Packed rows (THD, q/k norms, RoPE per row) through the all-to-all dispatcher at EP=2."""
    packed = megatron_result(tmp_path, moe_dir, world_size=2, expert_model_parallel_size=2, sequence_packing=True)
    assert_same_update(packed, ep1)
    assert_matches_torch(packed, moe_reference)


@pytest.mark.parametrize("run", ["ep1", "ep2"])
def test_export_of_loaded_weights_is_the_checkpoint(run, request, moe_dir):
    assert_exports_checkpoint(request.getfixturevalue(run)["loaded"], moe_dir)


def test_load_balancing_loss_is_normalised_per_routed_token_of_the_mini_batch(tmp_path, moe_dir):
    """With the router's aux loss on, EP=2 (two DP ranks of 3 rows) takes the same step as one rank
    (two micro-batches of the same 3 rows: full-length rows keep their order; the aux loss depends
    on which tokens share a micro-batch; a per-rank normalisation would double it), and the
    router's step differs from the RL loss alone (the loss reaches it)."""
    aux = {"moe_aux_loss_coeff": 0.1, "padded": False}
    for name in ("one", "two", "off"):
        (tmp_path / name).mkdir()
    single = megatron_result(tmp_path / "one", moe_dir, **aux)
    split = megatron_result(tmp_path / "two", moe_dir, world_size=2, expert_model_parallel_size=2, **aux)
    assert_same_update(split, single)
    without = megatron_result(tmp_path / "off", moe_dir, padded=False)
    router = [name for name in single["weights"] if name.endswith("mlp.gate.weight")]
    assert router and all((single["weights"][n] - without["weights"][n]).abs().max() > 1e-4 for n in router)
    for result in (single, split):  # Switch loss: E / k x sum_e f_e P_e, 1 for perfectly balanced routing
        assert 0.9 < result["metrics"]["actor/moe_load_balancing_loss"][0] < 4
    assert "actor/moe_load_balancing_loss" not in without["metrics"]


def test_dense_qwen3_matches_torch_worker(tmp_path, qwen3_dir):
    result = megatron_run(tmp_path, qwen3_dir)
    assert_matches_torch(result, torch_reference(qwen3_dir))
    assert_exports_checkpoint(result["loaded"], qwen3_dir)


LAYOUTS = [  # (TP, ETP or None for TP, EP, PP, world)
    (2, None, 8, 1, 128),
    (2, 1, 8, 1, 128),
    (1, None, 4, 2, 16),
    (4, 2, 2, 2, 32),
    (2, 1, 4, 1, 8),
]


@pytest.mark.parametrize("tp,etp,ep,pp,world", LAYOUTS)
def test_expert_groups_are_megatron_cores(tp, etp, ep, pp, world):
    """The arithmetic the start-up check uses gives megatron-core's own expert-parallel groups."""
    from megatron.core.parallel_state import RankGenerator

    parallel = Parallelism(tensor=tp, pipeline=pp, expert=ep, expert_tensor=etp)
    edp = world // (parallel.etp * ep * pp)
    theirs = RankGenerator(tp=parallel.etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp", rank_offset=0)
    assert sorted(map(tuple, parallel.expert_groups(world))) == sorted(map(tuple, theirs.get_ranks("ep")))


def test_the_moe_preset_keeps_each_expert_group_in_a_node_and_a_crossing_is_named():
    from nemo_dapo.config import load_config
    from nemo_dapo.config.topology import expert_groups_across_nodes
    from nemo_dapo.config.validate import combination_notes

    preset = load_config("dapo_qwen3_30b_a3b")
    assert preset.actor.megatron.expert_tensor_parallel_size == 1 and expert_groups_across_nodes(preset) == []
    assert not any("expert-parallel groups span nodes" in note for note in combination_notes(preset))
    crossing = load_config("dapo_qwen3_30b_a3b", ["actor.megatron.expert_tensor_parallel_size=null"])
    assert len(expert_groups_across_nodes(crossing)) == 16  # ETP = TP = 2: ranks 0, 2, ..., 14 on two nodes
    (note,) = [n for n in combination_notes(crossing) if "span nodes" in n]
    assert "ranks [0, 2, 4, 6, 8, 10, 12, 14] with 8 GPUs per node" in note and "ETP=2 x EP=8" in note


def run_group_sizes(rank: int, world_size: int, rendezvous: str, out_dir: str) -> None:
    from megatron.core import parallel_state as ps

    from nemo_dapo.policy.megatron import model as mm
    from nemo_dapo.policy.megatron.cpu_compat import enable_cpu_compat

    enable_cpu_compat()
    mm.init_distributed(rank, world_size, rendezvous, Parallelism(tensor=2, expert_tensor=1), seed=1)
    sizes = (ps.get_tensor_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size())
    torch.save(sizes, f"{out_dir}/rank{rank}.pt")


def test_the_workers_pass_expert_tensor_parallelism_to_megatron_core(tmp_path):
    """ETP=1 beside TP=2 reaches megatron-core's groups (without it ETP would be TP's 2)."""
    from tests.ranks import spawn

    spawn(run_group_sizes, 2, str(tmp_path / "rdv"), str(tmp_path))
    assert [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)] == [(2, 1), (2, 1)]
