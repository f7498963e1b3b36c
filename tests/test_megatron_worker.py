"""Megatron-core policy worker: weight conversion, and parity with the torch worker at TP=1 / TP=2.

Megatron ranks run in spawned processes (gloo over a FileStore): its global parallel state and
the CPU compatibility patches never touch the pytest process.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from nemo_dapo.policy.base import WorkerSettings
from tests.batches import LR, WARMUP, add_training_fields, exported, make_batch, optim_settings
from tests.ranks import spawn

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
        reason="megatron-core is not installed (optional 'megatron' extra)",
    ),
]


def megatron_worker(rank: int, world_size: int, rendezvous: str, model_dir: str, **options):
    """A MegatronPolicyWorker as the trainer builds it: ``actor.megatron`` fields (by their config
    names) go into its MegatronConfig, the rest into its WorkerSettings."""
    from dataclasses import fields

    from nemo_dapo.config.schema_actor import MegatronConfig
    from nemo_dapo.policy.megatron.worker import MegatronPolicyWorker

    names = {f.name for f in fields(MegatronConfig)}
    layout = MegatronConfig(**{k: v for k, v in options.items() if k in names})
    settings = WorkerSettings(model_dir, optim_settings(), **{k: v for k, v in options.items() if k not in names})
    return MegatronPolicyWorker(rank, world_size, rendezvous, settings, layout)


def run_megatron_rank(
    rank: int,
    world_size: int,
    rendezvous: str,
    model_dir: str,
    tp: int,
    pp: int,
    out_dir: str,
    options: dict,
    padded: bool,
) -> None:
    """One Megatron rank: log-probs, one update (two micro-batches), exported weights -> out_dir.

    With world_size > tp * pp the data-parallel ranks each take their contiguous share of the rows
    and the mini-batch-wide token / sequence counts of the whole batch; log-probs are collected
    from every rank, so the result is that of the whole batch.
    """
    from nemo_dapo.policy.base import LossSettings, MiniBatch

    torch.set_num_threads(1)
    options = {"max_token_len": 40, **options}
    loss = LossSettings(**options.pop("loss", {}))  # the policy loss and its aggregation
    routing_file = options.pop("routing_file", None)  # MoE routing to replay (test_router_replay)
    from_forward = options.pop("old_from_forward", False)
    worker = megatron_worker(
        rank,
        world_size,
        rendezvous,
        model_dir,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        **options,
    )
    batch = make_batch(padded=padded)
    if routing_file:
        batch["routed_experts"] = torch.load(routing_file)
    dp_rank, dp_size = worker.data_parallel_layout()
    rows = len(batch["input_ids"]) // dp_size
    # advantages of the whole batch (they depend on the row index), then this replica's rows
    whole = add_training_fields(batch, torch.zeros_like(batch["responses"], dtype=torch.float))
    share = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in whole.items()}
    before = worker.compute_log_prob(share)
    loaded = exported(worker, 1 << 12)  # small buckets: many, streamed one layer at a time
    # old_from_forward: the update takes the old log-probs from its forward; zeros here would show if read
    old = torch.zeros_like(before["log_probs"]) if from_forward else before["log_probs"]
    full = {**share, "old_log_probs": old}
    counts = float(batch["loss_mask"].sum()), float(len(batch["input_ids"]))
    result = worker.update([MiniBatch(full, *counts, old_from_forward=from_forward)], loss)
    optimizer_numel = sum(p.numel() for group in worker.optimizer.param_groups for p in group["params"])
    after = worker.compute_log_prob(share)  # the updated weights, as the next step reads them
    torch.save(
        {
            "before": before,
            "after": after,
            "metrics": result.metrics,
            "first_forward": result.first_forward,
            "loaded": loaded,
            "weights": exported(worker),
            "dp": (dp_rank, dp_size),
            "optimizer_numel": optimizer_numel,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


def torch_reference(model_dir, loss: dict | None = None) -> dict:
    from nemo_dapo.policy.base import LossSettings, MiniBatch
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker

    worker = TorchPolicyWorker(0, 1, "", WorkerSettings(str(model_dir), optim_settings(), max_token_len=40))
    batch = make_batch()
    before = worker.compute_log_prob(batch)
    full = add_training_fields(batch, before["log_probs"])
    settings = LossSettings(**(loss or {}))
    metrics = worker.update(
        [MiniBatch(full, float(batch["loss_mask"].sum()), float(len(batch["input_ids"])))], settings
    ).metrics
    return {"before": before, "metrics": metrics, "weights": exported(worker)}


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return torch_reference(tiny_model_dir)


def megatron_result(
    tmp_path, model_dir, tp: int = 1, pp: int = 1, world_size: int | None = None, padded: bool = True, **options
) -> dict:
    """Rank 0's result, with log-probs and summed loss metrics assembled over the data-parallel ranks."""
    world_size = world_size or tp * pp
    spawn(
        run_megatron_rank,
        world_size,
        str(tmp_path / "rendezvous"),
        str(model_dir),
        tp,
        pp,
        str(tmp_path),
        options,
        padded,
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    replicas = {r["dp"][0]: r for r in ranks}  # one rank per data-parallel replica
    result = dict(ranks[0])
    if len(replicas) > 1:
        ordered = [replicas[i] for i in sorted(replicas)]
        for when in ("before", "after"):
            result[when] = {k: torch.cat([r[when][k] for r in ordered]) for k in ranks[0][when]}
        result["metrics"] = {
            **ranks[0]["metrics"],
            "actor/pg_loss": [sum(r["metrics"]["actor/pg_loss"][0] for r in ordered)],
        }
    # the ranks' exports are disjoint and together the whole model (one exporter per pipeline stage)
    for key in ("loaded", "weights"):
        names = [name for r in ranks for name in r[key]]
        assert len(names) == len(set(names)), f"{key}: a tensor exported twice"
        assert sum(1 for r in ranks if r[key]) == pp
        result[key] = {name: t for r in ranks for name, t in r[key].items()}
    return result


def test_hf_to_megatron_to_hf_is_bit_exact(tiny_model_dir):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from nemo_dapo.policy.megatron import convert as convert

    hf = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    shape = convert.model_shape(AutoConfig.from_pretrained(tiny_model_dir))
    full = convert.hf_to_megatron(hf, shape)
    # TP=2 x PP=2 split and re-assembly on the way back
    stages = [convert.stage_state(full, shape, pp, 2) for pp in range(2)]
    regathered = [
        {k: convert.unshard(k, [convert.shard(k, v, r, 2) for r in range(2)]) for k, v in stage.items()}
        for stage in stages
    ]
    back = convert.megatron_to_hf(convert.unstage_state(regathered, shape), shape)
    assert list(back) and set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    # one KV group per TP rank: rank 1's fused QKV is exactly group 1's q heads, k and v
    qkv1 = convert.shard(
        "decoder.layers.0.self_attention.linear_qkv.weight",
        full["decoder.layers.0.self_attention.linear_qkv.weight"],
        1,
        2,
    )
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    per_group = shape.head_dim * shape.num_attention_heads // shape.num_kv_heads
    expected = torch.cat([q[per_group:], k[shape.head_dim :], v[shape.head_dim :]])
    assert torch.equal(qkv1, expected)


def test_transformer_engine_names_round_trip():
    """The TE layer spec fuses the pre-norms into the linears: loading renames, exporting renames back."""
    from nemo_dapo.policy.megatron import model as mm

    local = {
        "decoder.layers.3.input_layernorm.weight": torch.ones(1),
        "decoder.layers.3.pre_mlp_layernorm.weight": torch.ones(2),
        "decoder.layers.3.self_attention.linear_qkv.weight": torch.ones(3),
        "decoder.final_layernorm.weight": torch.ones(4),
    }
    te = mm.to_te_names(local)
    assert set(te) == {
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.3.self_attention.linear_qkv.weight",
        "decoder.final_layernorm.weight",
    }
    assert mm.uses_fused_norms(te) and not mm.uses_fused_norms(local)
    assert mm.to_local_names(te) == local


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_transformer_engine_is_refused_on_a_rank_without_a_gpu():
    """The one layer-spec check the config cannot make: is there a GPU on this rank."""
    from nemo_dapo.config.schema_actor import MegatronConfig
    from nemo_dapo.policy.megatron import model as mm

    with pytest.raises(ValueError, match="transformer_impl=transformer_engine needs a GPU"):
        mm.require_runtime(MegatronConfig(transformer_impl="transformer_engine"))
    mm.require_runtime(MegatronConfig())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.megatron.fp8=hybrid"], r"actor\.megatron\.fp8.*needs transformer_impl=transformer_engine"),
        (["actor.megatron.transformer_impl=te"], r"actor\.megatron\.transformer_impl.*te"),
        (
            ["actor.megatron.sequence_parallel=true", "actor.megatron.tensor_model_parallel_size=2"],
            r"actor\.megatron\.sequence_parallel.*needs transformer_impl=transformer_engine",
        ),
    ],
)
def test_gpu_only_layer_options_are_refused_at_start_up(overrides, message):
    """FP8 and sequence parallelism need TransformerEngine's layers: the config says so before any
    rank starts (the worker trusts the validated config)."""
    from nemo_dapo.config import load_config
    from nemo_dapo.errors import ConfigError

    base = ["actor.backend=megatron", "actor.num_workers=2"]
    with pytest.raises(ConfigError, match=message):
        load_config("tiny_cpu", base + overrides, placement=False)


def test_recompute_fields():
    from nemo_dapo.config.schema_actor import MegatronConfig
    from nemo_dapo.policy.megatron import model as mm

    assert mm.layer_options(MegatronConfig(recompute_granularity="full"))["recompute_method"] == "uniform"
    assert "recompute_granularity" not in mm.layer_options(MegatronConfig())


def test_widths_are_padded_for_sequence_parallelism_and_fp8():
    """SP splits columns over TP; TransformerEngine's FP8 GEMMs need token counts divisible by 16."""
    from nemo_dapo.policy.megatron.inputs import width_multiple

    assert width_multiple(8, False, None) == 1 and width_multiple(8, True, None) == 8
    assert width_multiple(1, False, "hybrid") == 16 and width_multiple(6, True, "hybrid") == 48


def test_right_padding_to_a_multiple_changes_no_log_prob(tmp_path, tiny_model_dir):
    """Sequence parallelism pads each micro-batch to a multiple of TP: masked columns after every
    real token, positions continued, and the response slice unchanged."""
    from nemo_dapo.policy.megatron.inputs import attention_mask_4d, pad_width
    from nemo_dapo.policy.microbatch import MicroBatch

    worker = megatron_worker(0, 1, str(tmp_path / "store"), str(tiny_model_dir))
    micro = MicroBatch(make_batch(rows=3), torch.arange(3))
    stats = []
    with torch.no_grad():
        for multiple in (1, 5):
            tokens, positions, mask = pad_width(micro, multiple)
            assert tokens.shape[1] % multiple == 0 and (tokens.shape[1] > micro["input_ids"].shape[1]) == (multiple > 1)
            inputs = (t.to(worker.device) for t in (tokens, positions, attention_mask_4d(mask)))
            logits = worker.chunks[0](*inputs).cpu()
            stats.append(worker._response_stats(micro, logits, 1.0)[0] * micro["loss_mask"])
    assert (stats[0] - stats[1]).abs().max().item() < 1e-6


def assert_matches_torch(result: dict, reference: dict) -> None:
    mask = reference["before"]["log_probs"] != 0
    for key in ("log_probs", "entropy"):
        assert (result["before"][key] - reference["before"][key]).abs().max().item() < 1e-5, key
    assert mask.any()
    ours, theirs = result["metrics"], reference["metrics"]
    assert ours["actor/pg_loss"][0] == pytest.approx(theirs["actor/pg_loss"][0], abs=1e-5)
    assert ours["actor/grad_norm"][0] == pytest.approx(theirs["actor/grad_norm"][0], rel=1e-5)
    assert ours["actor/lr"] == pytest.approx(theirs["actor/lr"])
    assert set(result["weights"]) == set(reference["weights"])
    # Adam's first step is ~lr * g / (|g| + eps) per element: where |g| is near eps (k biases get exactly
    # zero gradient in exact arithmetic, some weights nearly so) rounding moves single elements by up to
    # a whole step. So: no element apart by 2 steps (a sign flip), few by a tenth of one, the mean far less
    step = LR / WARMUP
    moved = torch.cat([(result["weights"][k] - reference["weights"][k]).abs().flatten() for k in reference["weights"]])
    assert moved.max().item() < 2 * step
    assert (moved > 0.1 * step).float().mean().item() < 1e-4, int((moved > 0.1 * step).sum())
    assert moved.mean().item() < 1e-3 * step


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory, tiny_model_dir):
    """TP = PP = DP = 1: the Megatron layout every parallel one is compared with."""
    return megatron_result(tmp_path_factory.mktemp("single"), tiny_model_dir)


def assert_same_update(result: dict, single: dict) -> None:
    """Same log-probs, loss, gradient norm and updated weights as the single-rank Megatron run."""
    for when in ("before", "after"):
        for key in ("log_probs", "entropy"):
            assert (result[when][key] - single[when][key]).abs().max().item() < 1e-5, (when, key)
    assert result["metrics"]["actor/pg_loss"][0] == pytest.approx(single["metrics"]["actor/pg_loss"][0], abs=1e-6)
    assert result["metrics"]["actor/grad_norm"][0] == pytest.approx(single["metrics"]["actor/grad_norm"][0], rel=1e-5)
    assert set(result["weights"]) == set(single["weights"])
    step = LR / WARMUP  # see assert_matches_torch: single near-zero-gradient elements may move by rounding
    diffs = [(result["weights"][k] - single["weights"][k]).abs() for k in single["weights"]]
    assert max(d.max().item() for d in diffs) < 0.1 * step
    assert sum(d.sum().item() for d in diffs) / sum(d.numel() for d in diffs) < 1e-4 * step


def test_tp1_matches_torch_worker(single_rank, reference):
    assert_matches_torch(single_rank, reference)


def test_tp2_matches_torch_worker(tmp_path, tiny_model_dir, reference):
    assert_matches_torch(megatron_result(tmp_path, tiny_model_dir, tp=2), reference)


@pytest.mark.parametrize(
    "loss", [{"policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean"}, {"policy_loss": "cispo"}], ids=str
)
def test_other_policy_losses_on_megatron_tp2_match_the_torch_worker(tmp_path, tiny_model_dir, loss):
    """The registry's losses run through the shared actor loss on both backends: the same loss and
    gradient at TP=2. Weights are compared on average only: GSPO's sequence ratio leaves many
    near-zero gradients, whose first Adam step (~lr * g / |g|) turns rounding into a whole step."""
    result, reference = (
        megatron_result(tmp_path, tiny_model_dir, tp=2, loss=loss),
        torch_reference(tiny_model_dir, loss),
    )
    for key in ("log_probs", "entropy"):
        assert (result["before"][key] - reference["before"][key]).abs().max().item() < 1e-5, key
    ours, theirs = result["metrics"], reference["metrics"]
    assert ours["actor/pg_loss"][0] == pytest.approx(theirs["actor/pg_loss"][0], abs=1e-5)
    assert ours["actor/grad_norm"][0] == pytest.approx(theirs["actor/grad_norm"][0], rel=1e-5)
    diffs = [(result["weights"][k] - reference["weights"][k]).abs() for k in reference["weights"]]
    assert sum(d.sum().item() for d in diffs) / sum(d.numel() for d in diffs) < 1e-3 * LR / WARMUP


def test_pp2_matches_torch_worker_and_single_rank(tmp_path, tiny_model_dir, reference, single_rank):
    """Two pipeline stages (one layer each, tied embedding split between the first and last stage)."""
    result = megatron_result(tmp_path, tiny_model_dir, pp=2)
    assert_matches_torch(result, reference)
    assert_same_update(result, single_rank)


def test_pp2_takes_old_log_probs_from_the_update_forward(tmp_path, tiny_model_dir, reference):
    """A mini-batch marked old_from_forward trains exactly as with the old_log_prob pass's values
    (the data's old log-probs are zeros: read, they would change the loss), and returns its
    forward's log-probs and entropy, gathered from the last pipeline stage, equal to that pass's."""
    result = megatron_result(tmp_path, tiny_model_dir, pp=2, old_from_forward=True)
    assert_matches_torch(result, reference)
    for key in ("log_probs", "entropy"):
        gap = result["first_forward"][key] - reference["before"][key]
        assert gap.abs().max().item() < 1e-5, key


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    from nemo_dapo.model.tiny_qwen3 import TinyQwen3Spec, build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("qwen3_4_layers"), TinyQwen3Spec(num_experts=0, num_layers=4))


@pytest.fixture(scope="module")
def four_layers_single(tmp_path_factory, four_layers):
    return megatron_result(tmp_path_factory.mktemp("one"), four_layers)


# 40 tokens: 2 micro-batches of 3 rows; 30: 4 of 2 rows, the last all filler rows
@pytest.mark.parametrize("max_token_len", [40, 30])
def test_virtual_pipeline_stages_match_single_rank(tmp_path, four_layers, four_layers_single, max_token_len):
    """PP=2 with two interleaved chunks per rank (layers 0 and 2 on rank 0, 1 and 3 on rank 1)
    under Megatron's interleaved schedule (uniform micro-batches, filler rows masked out): the
    same log-probs, loss and update as one rank."""
    virtual = megatron_result(
        tmp_path, four_layers, pp=2, virtual_pipeline_model_parallel_size=2, max_token_len=max_token_len
    )
    assert_same_update(virtual, four_layers_single)


@pytest.mark.parametrize("layout", [{}, {"tp": 2}, {"pp": 2}])
def test_packed_micro_batches_give_the_unpacked_update(tmp_path, tiny_model_dir, reference, single_rank, layout):
    """Sequence packing (each micro-batch's rows end to end in one row, a block-diagonal causal
    mask): the same log-probs, loss and update as padded micro-batches, and as the torch worker
    (at TP=2, as without packing, only the latter: the two roundings of a TP split and a packed
    reduction order move updated log-probs of ~-11 by 1.5e-5)."""
    packed = megatron_result(tmp_path, tiny_model_dir, sequence_packing=True, **layout)
    assert_matches_torch(packed, reference)
    if "tp" not in layout:
        assert_same_update(packed, single_rank)


@pytest.mark.parametrize("tp", [1, 2])
def test_context_parallel_matches_single_rank(tmp_path, tiny_model_dir, reference, single_rank, tp):
    """CP=2 (x TP=2: four ranks): each rank holds two chunks of every packed row (load-balanced) and
    attends to the row's gathered keys; log-probs summed over CP, gradients over DP x CP: the single
    rank's update (at TP=2, as without CP, compared with the torch worker only)."""
    result = megatron_result(
        tmp_path, tiny_model_dir, tp=tp, world_size=2 * tp, context_parallel_size=2, sequence_packing=True
    )
    assert result["dp"] == (0, 1)
    assert_matches_torch(result, reference)
    if tp == 1:
        assert_same_update(result, single_rank)


def test_packed_interleaved_pipeline_matches_single_rank(tmp_path, four_layers, four_layers_single):
    """Interleaved stages with packing: packs of one width, filler packs up to a multiple of PP."""
    virtual = megatron_result(
        tmp_path, four_layers, pp=2, virtual_pipeline_model_parallel_size=2, max_token_len=30, sequence_packing=True
    )
    assert_same_update(virtual, four_layers_single)


def test_dp2_distributed_optimizer_matches_single_rank(tmp_path, tiny_model_dir, reference, single_rank):
    """Two data-parallel replicas, each with half the rows and the whole mini-batch's counts; the
    distributed optimizer holds half of the parameters' optimizer state on each rank."""
    result = megatron_result(tmp_path, tiny_model_dir, world_size=2)
    assert result["dp"] == (0, 2)
    assert 0 < result["optimizer_numel"] < single_rank["optimizer_numel"]
    assert_same_update(result, single_rank)
    assert_matches_torch(result, reference)


@pytest.mark.parametrize(
    "options",
    [{"recompute_granularity": "full"}, {"recompute_granularity": "selective"}, {"use_distributed_optimizer": False}],
)
def test_recompute_and_plain_optimizer_give_the_same_update(tmp_path, tiny_model_dir, single_rank, options):
    """Activation recompute replays the forward in the backward; the plain optimizer keeps whole
    state per rank: neither may change the numbers."""
    assert_same_update(megatron_result(tmp_path, tiny_model_dir, **options), single_rank)


def run_frozen_rank(rank: int, world_size: int, rendezvous: str, model_dir: str, out_dir: str) -> None:
    from nemo_dapo.policy.base import LossSettings

    torch.set_num_threads(1)
    worker = megatron_worker(rank, world_size, rendezvous, model_dir, max_token_len=40, trainable=False)
    with pytest.raises(RuntimeError, match="trainable=False") as refused:
        worker.update([], LossSettings())
    params = [p for model in worker.models for p in model.parameters()]
    torch.save(
        {
            "before": worker.compute_log_prob(make_batch()),
            "refused": str(refused.value),
            "optimizer": worker.optimizer,
            "trainable": [p for p in params if p.requires_grad],
            "grad_buffers": [p for p in params if hasattr(p, "main_grad")],
        },
        os.path.join(out_dir, "frozen.pt"),
    )


def test_reference_worker_keeps_weights_only_and_scores_like_the_actor(tmp_path, tiny_model_dir, single_rank):
    """trainable=False (the KL reference): no DDP gradient buffers, no optimizer, the same log-probs."""
    spawn(run_frozen_rank, 1, str(tmp_path / "rdv"), str(tiny_model_dir), str(tmp_path))
    frozen = torch.load(tmp_path / "frozen.pt", weights_only=False)
    assert frozen["optimizer"] is None and not frozen["trainable"] and not frozen["grad_buffers"]
    for key in ("log_probs", "entropy"):
        assert torch.equal(frozen["before"][key], single_rank["before"][key]), key


def run_overlap_rank(rank: int, world_size: int, rendezvous: str, model_dir: str, out_dir: str, overlap: bool) -> None:
    """Two updates of 2 then 3 micro-batches per rank; the weights read straight after the last
    optimizer step (no forward in between), then the log-probs of the updated model."""
    from nemo_dapo.policy.base import LossSettings, MiniBatch

    torch.set_num_threads(1)
    worker = megatron_worker(
        rank,
        world_size,
        rendezvous,
        model_dir,
        max_token_len=24,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
        ddp_bucket_size=20_000,
    )
    metrics = []
    for seed, rows in ((0, 6), (1, 10)):
        batch = make_batch(seed, rows=rows)
        share = {k: v[rank::world_size] for k, v in batch.items()}
        full = add_training_fields(share, worker.compute_log_prob(share)["log_probs"])
        metrics.append(
            worker.update([MiniBatch(full, float(batch["loss_mask"].sum()), float(rows))], LossSettings()).metrics
        )
    weights = exported(worker)
    after = worker.compute_log_prob(share)
    torch.save(
        {"metrics": metrics, "weights": weights, "after": after},
        os.path.join(out_dir, f"{'overlap' if overlap else 'plain'}{rank}.pt"),
    )


def test_overlapped_gradient_reduce_and_parameter_gather_give_the_same_updates(tmp_path, tiny_model_dir):
    """DP = 2, buckets of 20k parameters (several per rank): reduce-scatters started inside the
    backward of the last micro-batch (however many there are) and parameter all-gathers deferred to
    the next forward give the same two updates, exported weights and log-probs as plain DP."""
    for overlap in (False, True):
        spawn(run_overlap_rank, 2, str(tmp_path / f"rdv_{overlap}"), str(tiny_model_dir), str(tmp_path), overlap)
    runs = {
        name: [torch.load(tmp_path / f"{name}{rank}.pt", weights_only=False) for rank in range(2)]
        for name in ("plain", "overlap")
    }
    for ours, theirs in zip(runs["overlap"][0]["metrics"], runs["plain"][0]["metrics"]):
        assert ours["actor/grad_norm"][0] == pytest.approx(theirs["actor/grad_norm"][0], rel=1e-6)
    for ours, theirs in zip(runs["overlap"], runs["plain"]):  # log-probs near -10 over weights rounded apart
        print("LPGAP", (ours["after"]["log_probs"] - theirs["after"]["log_probs"]).abs().max().item())
    weights = {name: {k: t for run in ranks for k, t in run["weights"].items()} for name, ranks in runs.items()}
    assert set(weights["overlap"]) == set(weights["plain"])
    # the reduce-scatters sum in another order: Adam moves single near-zero-gradient elements
    diffs = [(weights["overlap"][k] - weights["plain"][k]).abs() for k in weights["plain"]]
    # (the largest: the key biases, whose gradient is 0 analytically, since a softmax ignores a shift
    # shared by all keys, so Adam turns their rounding noise into lr-sized steps: 2.2e-4 since the
    # chunked log-probs changed the rounding); the mean stays 1e-5 of a step
    assert max(d.max().item() for d in diffs) < 0.05 * LR / WARMUP
    assert sum(d.sum().item() for d in diffs) / sum(d.numel() for d in diffs) < 1e-5 * LR / WARMUP


def train_step(worker, seed: int) -> dict:
    """One update on batch ``seed`` (each DP replica its share of the rows) with the worker's own
    current log-probs as the old ones."""
    from nemo_dapo.policy.base import LossSettings, MiniBatch

    batch = make_batch(seed)
    dp_rank, dp_size = worker.data_parallel_layout()
    rows = len(batch["input_ids"]) // dp_size
    whole = add_training_fields(batch, torch.zeros_like(batch["responses"], dtype=torch.float))
    full = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in whole.items()}
    full["old_log_probs"] = worker.compute_log_prob(full)["log_probs"]
    return worker.update(
        [MiniBatch(full, float(batch["loss_mask"].sum()), float(len(batch["input_ids"])))], LossSettings()
    ).metrics


def run_resume_rank(
    rank: int,
    world_size: int,
    rendezvous: str,
    model_dir: str,
    checkpoint: str,
    out_dir: str,
    resume: bool,
    layout: dict,
    asynchronous: bool,
) -> None:
    """Uninterrupted (save after step 1, then step 2) or resumed (load, then step 2) run; an
    asynchronous save is still being written while step 2 changes the weights, and its HF copy
    holds the weights of the save's start."""
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    worker = megatron_worker(rank, world_size, rendezvous, model_dir, max_token_len=40, **layout)
    saved: dict = {}  # the weights this rank exports at the save, if any
    if resume:
        worker.load(checkpoint)
    else:
        train_step(worker, seed=0)
        saved = exported(worker)
        worker.save(checkpoint, asynchronous=asynchronous)
        # the global metadata is written when the background writes are finalised
        assert os.path.exists(os.path.join(checkpoint, "megatron", ".metadata")) != asynchronous
    metrics = train_step(worker, seed=1)
    assert worker.finish_save(blocking=True)
    weights = exported(worker)  # collective: every rank takes part
    if saved:
        written = {k: t for f in Path(checkpoint, "model").glob("*.safetensors") for k, t in load_file(f).items()}
        assert all(torch.equal(written[name], tensor) for name, tensor in saved.items())
        assert not all(torch.equal(written[name], tensor) for name, tensor in weights.items())
    torch.save(
        {"metrics": metrics, "weights": weights, "steps_done": worker.steps_done},
        os.path.join(out_dir, f"{'resumed' if resume else 'straight'}{rank}.pt"),
    )


def resume_run(tmp_path, model_dir, world_size: int, layout: dict, resume: bool, asynchronous: bool = False) -> dict:
    """Rank 0's metrics and step count, and the union of the ranks' exported weights."""
    name = "resumed" if resume else "straight"
    spawn(
        run_resume_rank,
        world_size,
        str(tmp_path / f"rdv_{name}"),
        str(model_dir),
        str(tmp_path / "ckpt"),
        str(tmp_path),
        resume,
        layout,
        asynchronous,
    )
    ranks = [torch.load(tmp_path / f"{name}{r}.pt", weights_only=False) for r in range(world_size)]
    return {**ranks[0], "weights": {k: t for r in ranks for k, t in r["weights"].items()}}


FULLY_RESHARDABLE = {"optimizer_checkpoint": "fully_reshardable"}


@pytest.mark.parametrize(
    "model, layout, asynchronous",
    [
        ("tiny_model_dir", {"tensor_model_parallel_size": 2, **FULLY_RESHARDABLE}, False),
        ("tiny_model_dir", {"tensor_model_parallel_size": 2, **FULLY_RESHARDABLE}, True),
        (
            "four_layers",
            {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2, **FULLY_RESHARDABLE},
            False,
        ),
        ("tiny_model_dir", {}, True),
        ("tiny_model_dir", {"context_parallel_size": 2, "sequence_packing": True}, False),
        ("tiny_model_dir", {"tensor_model_parallel_size": 2, "use_distributed_optimizer": False}, False),
    ],
)
def test_save_at_two_ranks_load_at_one_continues_like_uninterrupted_run(tmp_path, request, model, layout, asynchronous):
    """Saved at TP=2 (in the background, too) or at PP=2 with interleaved chunks with the optimizer
    fully reshardable; at DP=2 or at CP=2 (the distributed optimizer sharded over DP x CP) with
    each rank's optimizer shard as it is (the default); with the plain optimizer at TP=2, whose
    state is per parameter whatever the format; loaded on one rank (resharded)."""
    model_dir = request.getfixturevalue(model)
    straight = resume_run(tmp_path, model_dir, 2, layout, resume=False, asynchronous=asynchronous)
    same_optimizer = {k: v for k, v in layout.items() if k == "use_distributed_optimizer"}
    resumed = resume_run(tmp_path, model_dir, 1, same_optimizer, resume=True)
    assert straight["steps_done"] == resumed["steps_done"] == 2
    assert resumed["metrics"]["actor/lr"] == pytest.approx(straight["metrics"]["actor/lr"])
    assert resumed["metrics"]["actor/grad_norm"][0] == pytest.approx(
        straight["metrics"]["actor/grad_norm"][0], rel=1e-4
    )
    diffs = [(resumed["weights"][k] - straight["weights"][k]).abs() for k in straight["weights"]]
    # a wrong Adam step count after resume changes the bias correction: whole-step differences (~lr)
    assert max(d.max().item() for d in diffs) < 0.1 * LR
    assert sum(d.sum().item() for d in diffs) / sum(d.numel() for d in diffs) < 1e-3 * LR


def test_dp_reshardable_checkpoint_refuses_another_tp_and_names_the_fix(tmp_path, tiny_model_dir):
    """The default optimizer format loads only at its TP / PP: a load at another fails at once with
    the setting to use, not deep inside megatron-core (and the same DP-sharded state writes less)."""
    resume_run(tmp_path, tiny_model_dir, 2, {"tensor_model_parallel_size": 2}, resume=False)
    with pytest.raises(Exception) as failure:
        resume_run(tmp_path, tiny_model_dir, 1, {}, resume=True)
    message = str(failure.value)
    assert "CheckpointLayoutError" in message and "actor.megatron.tensor_model_parallel_size 2 -> 1" in message
    assert "actor.megatron.optimizer_checkpoint=fully_reshardable" in message


def run_save_rank(rank: int, world_size: int, rendezvous: str, model_dir: str, checkpoint: str) -> None:
    torch.set_num_threads(1)
    worker = megatron_worker(rank, world_size, rendezvous, model_dir, pipeline_model_parallel_size=world_size)
    worker.save(checkpoint)


def test_pp2_checkpoint_writes_one_hf_shard_per_stage(tmp_path, tiny_model_dir):
    """Each stage writes its own layers (no rank gathers the model); transformers loads the shards."""
    from transformers import AutoModelForCausalLM

    spawn(run_save_rank, 2, str(tmp_path / "rdv"), str(tiny_model_dir), str(tmp_path / "ckpt"))
    folder = tmp_path / "ckpt" / "model"
    assert sorted(p.name for p in folder.glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert loaded.keys() == original.keys()
    assert all(torch.equal(loaded[name], original[name]) for name in original)


# One check per CPU workaround in megatron_cpu_compat: each fails if its workaround is removed.
COMPAT_CHECKS = {
    "current_device": "from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding\n"
    "assert RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(4).shape[0] == 4",
    "device_literal": "assert torch.zeros(1, device='cuda').device.type == 'cpu'",
    "tensor_cuda": "t = torch.ones(2)\nassert t.cuda() is t",
    "type_string": "assert torch.ones(2).type() == 'torch.cuda.FloatTensor'",
    "synchronize": "torch.cuda.synchronize()",
    "rng_tracker": "from megatron.core.tensor_parallel.random import get_cuda_rng_tracker\n"
    "tracker = get_cuda_rng_tracker()\ntracker.add('x', 5)\n"
    "with tracker.fork('x'):\n    forked = torch.rand(3)\n"
    "torch.manual_seed(5)\nassert torch.equal(forked, torch.rand(3))",
    "recompute_rng": "from megatron.core.tensor_parallel.random import _fork_rng\n"
    "torch.manual_seed(3)\nwith _fork_rng():\n    torch.rand(2)\n"
    "torch.manual_seed(3)\nexpected = torch.rand(2)\ntorch.manual_seed(3)\n"
    "with _fork_rng():\n    torch.rand(5)\nassert torch.equal(torch.rand(2), expected)",
    # the MoE token dispatcher and router
    "cuda_stream": "stream = torch.cuda.Stream()\nif torch.cuda.current_stream() != stream:\n"
    "    stream.wait_stream(torch.cuda.current_stream())\n"
    "with torch.cuda.stream(stream):\n    pass\nstream.record_event().synchronize()",
    "split_sizes": "from megatron.core.transformer.moe import token_dispatcher\n"
    "sizes = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([2, 1]), as_numpy=True)\n"
    "assert not torch.is_tensor(sizes) and list(sizes) == [2, 1]",
    "router_gemm": "from nemo_dapo.policy.megatron.cpu_compat import define_router_gemm_without_te\n"
    "from megatron.core.transformer.moe.moe_utils import router_gating_linear\n"
    "define_router_gemm_without_te()\nx, w = torch.randn(3, 4), torch.randn(2, 4)\n"
    "assert torch.allclose(router_gating_linear(x, w, None, torch.float32), x @ w.t())",
}
COMPAT_RUNNER = """
import json, sys, torch, traceback
from nemo_dapo.policy.megatron.cpu_compat import enable_cpu_compat
assert enable_cpu_compat()
results = {}
for name, code in json.loads(sys.argv[1]).items():
    try:
        exec(code, {"torch": torch})
        results[name] = "ok"
    except Exception:
        results[name] = traceback.format_exc()
print("RESULTS" + json.dumps(results))
"""


def run_compat_checks(checks: dict[str, str]) -> dict[str, str]:
    """Each check's outcome ('ok' or its traceback) in a fresh process with the CPU layer on."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, "-c", COMPAT_RUNNER, json.dumps(checks)], capture_output=True, text=True, env=env, timeout=120
    )
    line = [line for line in run.stdout.splitlines() if line.startswith("RESULTS")]
    assert line, run.stderr[-3000:]
    return json.loads(line[0][len("RESULTS") :])


@pytest.fixture(scope="module")
def compat_results():
    return run_compat_checks(COMPAT_CHECKS)


@pytest.mark.parametrize("check", sorted(COMPAT_CHECKS))
def test_cpu_compat_workaround(compat_results, check):
    if torch.cuda.is_available():
        pytest.skip("the CPU compatibility layer is inactive with a GPU")
    assert compat_results[check] == "ok", compat_results[check]


def nonfinite_then_finite(worker) -> dict:
    """One update whose advantages are NaN, then one whose are not: metrics and weights of each."""
    from nemo_dapo.policy.base import LossSettings, MiniBatch

    batch = make_batch()
    full = add_training_fields(batch, worker.compute_log_prob(batch)["log_probs"])
    counts = float(batch["loss_mask"].sum()), float(len(batch["input_ids"]))
    start = exported(worker)
    poisoned = {**full, "advantages": full["advantages"] * float("nan")}
    skipped = worker.update([MiniBatch(poisoned, *counts)], LossSettings()).metrics
    after_skip = exported(worker)
    taken = worker.update([MiniBatch(full, *counts)], LossSettings()).metrics
    return {"start": start, "skipped": skipped, "after_skip": after_skip, "taken": taken, "end": exported(worker)}


def run_nonfinite_rank(rank: int, world_size: int, rendezvous: str, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    worker = megatron_worker(rank, world_size, rendezvous, model_dir, max_token_len=40)
    result = nonfinite_then_finite(worker)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_a_non_finite_gradient_skips_the_step_on_both_backends(backend, tmp_path, tiny_model_dir):
    """bf16 and fp32 have no loss scaler to skip an Inf/NaN step: the workers do, alike, leaving the
    weights (and the torch worker's Adam state) as they were, and say so in actor/skipped_steps."""
    if backend == "megatron":
        spawn(run_nonfinite_rank, 1, str(tmp_path / "rdv"), str(tiny_model_dir), str(tmp_path))
        result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    else:
        from nemo_dapo.policy.torch_worker import TorchPolicyWorker

        worker = TorchPolicyWorker(0, 1, "", WorkerSettings(str(tiny_model_dir), optim_settings(), max_token_len=40))
        result = nonfinite_then_finite(worker)
    assert result["skipped"]["actor/skipped_steps"] == [1.0] and result["taken"]["actor/skipped_steps"] == [0.0]
    assert all(torch.equal(result["after_skip"][k], v) for k, v in result["start"].items())  # nothing moved
    assert any(not torch.equal(result["end"][k], v) for k, v in result["start"].items())  # the next step did
    assert torch.isfinite(torch.cat([t.flatten().float() for t in result["end"].values()])).all()


def run_two_steps(rank: int, world_size: int, rendezvous: str, model_dir: str, out_dir: str, release: bool) -> None:
    """Two steps of one rank, each an update then what a colocated step does before the engines
    wake (``release_memory``); a checkpoint written after the first, while the buffers are freed."""
    from nemo_dapo.policy.base import LossSettings, MiniBatch

    torch.set_num_threads(1)
    worker = megatron_worker(rank, world_size, rendezvous, model_dir, max_token_len=40, release_grad_buffers=release)
    batch = make_batch()
    whole = add_training_fields(batch, torch.zeros_like(batch["responses"], dtype=torch.float))
    counts = float(batch["loss_mask"].sum()), float(len(batch["input_ids"]))
    metrics, held = [], []
    for step in range(2):
        old = worker.compute_log_prob(whole)["log_probs"]
        metrics.append(worker.update([MiniBatch({**whole, "old_log_probs": old}, *counts)], LossSettings()).metrics)
        worker.release_memory()
        held.append(sum(b.grad_data.untyped_storage().nbytes() for c in worker.chunks for b in c.buffers))
        if step == 0:
            worker.save(os.path.join(out_dir, f"checkpoint_{release}"))
    torch.save({"metrics": metrics, "held": held, "weights": exported(worker)}, os.path.join(out_dir, f"{release}.pt"))


def test_released_gradient_buffers_free_their_memory_and_change_no_update(tmp_path, tiny_model_dir):
    """actor.megatron.release_grad_buffers: between two updates the gradient buffers hold no memory
    (a checkpoint is written meanwhile), and both updates equal those of a run that keeps them."""
    runs = {}
    for release in (False, True):
        spawn(run_two_steps, 1, str(tmp_path / f"rendezvous_{release}"), str(tiny_model_dir), str(tmp_path), release)
        runs[release] = torch.load(tmp_path / f"{release}.pt", weights_only=False)
    kept, freed = runs[False], runs[True]
    assert freed["held"] == [0, 0] and min(kept["held"]) > 0
    losses = [{k: v for k, v in step.items() if k.startswith("actor/")} for step in kept["metrics"]]
    assert "actor/grad_norm" in losses[1] and losses[1] != losses[0]
    assert [{k: step[k] for k in loss} for step, loss in zip(freed["metrics"], losses)] == losses
    assert all(torch.equal(freed["weights"][name], tensor) for name, tensor in kept["weights"].items())
