"""A streaming vLLM engine (trainer.mode=stream) takes new weights without draining its samples:
every token carries the version that drew it, recomputed samples continue under the new weights to
their budget, and the prefix cache never serves keys and values of older weights."""

import time

import pytest
import torch

from nemo_dapo.config.schema_actor import OptimConfig
from nemo_dapo.policy.base import WorkerSettings
from nemo_dapo.policy.inputs import worker_inputs
from nemo_dapo.rollout.base import EngineSettings, SamplingSettings
from nemo_dapo.trainer.batching import build_rollout_batch

pytestmark = pytest.mark.quiet  # an engine's starved and busy time


TOLERANCE = 1e-4  # float32 engine and policy; the sync test observes ~3e-6
RAMBLING = SamplingSettings(n=4, temperature=2.0, max_tokens=96)  # hot enough to rarely stop early


@pytest.fixture(scope="module")
def policies(tiny_model_dir):
    """The tiny model's weights (version 0) and a perturbed copy (version 1)."""
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker

    policy = TorchPolicyWorker(0, 1, "", WorkerSettings(str(tiny_model_dir), OptimConfig()))
    old = {k: v.clone() for k, v in policy.model.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in policy.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    new = {k: v.clone() for k, v in policy.model.state_dict().items()}
    return policy, old, new


def streaming_engine(tiny_model_dir, kv_after_update: str):
    from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker

    engine = VLLMRolloutWorker(0, 1, "", EngineSettings(str(tiny_model_dir), max_model_len=256))
    engine.start_stream(max_inflight=16, kv_after_update=kv_after_update)
    return engine


def buckets_of(policy, weights):
    policy.model.load_state_dict(weights)
    return list(policy.export_weights(bucket_bytes=1 << 20))


def log_probs_under(policy, weights, batch, temperature):
    policy.model.load_state_dict(weights)
    return policy.compute_log_prob(worker_inputs(batch), temperature)["log_probs"]


def prompt_ids(tokenizer, questions):
    return [tokenizer.encode(f"Compute this sum for me, please. Compute {q} and explain.") for q in questions]


def take_all(engine, count, wait_s=120.0):
    taken, deadline = [], time.monotonic() + wait_s
    while len(taken) < count and time.monotonic() < deadline:
        taken += engine.stream_take(1.0)
    assert len(taken) == count, f"{len(taken)} of {count} groups finished in {wait_s} s"
    return sorted(taken, key=lambda group: group.key)


def test_an_update_in_flight_shows_in_the_versions_and_later_tokens_follow_the_new_weights(
    tiny_model_dir, tiny_tokenizer, policies
):
    policy, old, new = policies
    engine = streaming_engine(tiny_model_dir, "recompute")
    ids = prompt_ids(tiny_tokenizer, ["12+3", "45-7"])
    engine.stream_add([("a", ids[0]), ("b", ids[1])], RAMBLING)
    stream = engine._stream
    while stream._stats.busy_s < 0.05:  # some tokens drawn by version 0 before the update
        time.sleep(0.005)
    engine.update_weights(buckets_of(policy, new), version=1)
    groups = take_all(engine, 2)
    assert [g.admitted_version for g in groups] == [0, 0]
    generations = [g.generation for g in groups]
    batch = build_rollout_batch(ids, generations, {}, "t", tiny_tokenizer.pad_token_id, 0)
    versions = torch.zeros_like(batch["responses"])
    for row, tokens in enumerate(v for g in generations for v in g.token_versions):
        assert tokens == sorted(tokens), "versions go back in time"
        versions[row, : len(tokens)] = torch.tensor(tokens)
    mask = batch["response_mask"].bool()
    spanning = [row for row in range(len(batch)) if {0, 1} <= set(versions[row][mask[row]].tolist())]
    assert spanning, "no sample was running when the weights changed"
    under_old = log_probs_under(policy, old, batch, RAMBLING.temperature)
    under_new = log_probs_under(policy, new, batch, RAMBLING.temperature)
    engine_lp = batch["rollout_log_probs"]
    drawn_old, drawn_new = mask & (versions == 0), mask & (versions == 1)
    assert (engine_lp - under_old)[drawn_old].abs().max() < TOLERANCE
    assert (engine_lp - under_new)[drawn_new].abs().max() < TOLERANCE  # recomputed: no stale keys
    assert (under_new - under_old)[drawn_new].abs().max() > 100 * TOLERANCE  # the weights do differ
    # a recomputed sample keeps its budget: it stops at max_tokens, counted across the update
    lengths = mask.sum(dim=1)
    assert int(lengths.max()) <= RAMBLING.max_tokens
    for row in spanning:
        if batch["finish_reason"][row] == "length":
            assert int(lengths[row]) == RAMBLING.max_tokens
    engine._stream.stop()


def test_the_prefix_cache_serves_no_keys_of_older_weights(tiny_model_dir, tiny_tokenizer, policies):
    """keep mode resets nothing at an update: the per-version cache salt is what keeps a prompt
    computed by the old weights from being reused by a request drawn by the new ones."""
    policy, old, new = policies
    engine = streaming_engine(tiny_model_dir, "keep")
    prompt = prompt_ids(tiny_tokenizer, ["31+5 " * 12])  # several 32-token KV blocks
    greedy = SamplingSettings(n=1, temperature=1.0, max_tokens=8)
    engine.generate(prompt, greedy)  # the prompt's blocks are cached under version 0
    engine.update_weights(buckets_of(policy, new), version=1)
    generation = engine.generate(prompt, greedy)[0]
    assert generation.token_versions == [[1] * len(generation.token_ids[0])]
    batch = build_rollout_batch(prompt, [generation], {}, "t", tiny_tokenizer.pad_token_id, 1)
    under_new = log_probs_under(policy, new, batch, greedy.temperature)
    mask = batch["response_mask"].bool()
    assert (batch["rollout_log_probs"] - under_new)[mask].abs().max() < TOLERANCE
    engine._stream.stop()


def test_groups_beyond_max_inflight_wait_in_the_engine_and_enter_as_slots_free(tiny_model_dir, tiny_tokenizer):
    from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker

    engine = VLLMRolloutWorker(0, 1, "", EngineSettings(str(tiny_model_dir), max_model_len=256))
    engine.start_stream(max_inflight=RAMBLING.n, kv_after_update="recompute")  # one group at a time
    ids = prompt_ids(tiny_tokenizer, ["12+3", "45-7", "8+8"])
    engine.stream_add([(k, p) for k, p in zip("abc", ids)], RAMBLING)
    deadline = time.monotonic() + 60
    while (stats := engine.stream_stats()).samples_running == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert (stats.samples_running, stats.groups_queued) == (RAMBLING.n, 2)
    assert [g.key for g in take_all(engine, 3)] == ["a", "b", "c"]
    stats = engine.stream_stats()
    assert (stats.samples_running, stats.groups_queued) == (0, 0) and stats.tokens > 0
    assert stats.starved_s < 0.1 * stats.wall_s  # it had samples until the last group finished
    time.sleep(0.3)
    stats = engine.stream_stats()
    assert 0.9 * stats.wall_s < stats.starved_s <= stats.wall_s and stats.busy_s == 0
    engine._stream.stop()
