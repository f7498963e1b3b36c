"""A rollout engine that dies (SIGKILL) or stops answering (SIGSTOP) while generating, stops
taking weights during a weight sync, or fails while it receives them over gloo is replaced on
its slot, given the policy's current weights, and its prompts are generated again (the sync
trainer) or sent again to the replacement (the streaming trainer). An engine that fails inside
its live actor (an error in its step) counts as dead. A stream goes on whatever replaced
an engine (a weight sync, validation, a failed warm-up), and replaces a hung one within its own
deadline (derived from the engines' step times), not the group's. One failure past
``rollout.max_restarts`` stops with the engine, the call and the logs named. Real Ray actors,
real vLLM engines, a real torch policy."""

import os
import signal
import time

import pytest
import torch

from nemo_dapo.config.schema_actor import OptimConfig
from nemo_dapo.policy.base import LossSettings, WorkerSettings
from nemo_dapo.rollout.base import EngineSettings, SamplingSettings
from nemo_dapo.trainer.batching import build_rollout_batch
from tests.flaky_worker import break_engine, break_receiving, seconds_to_failure

pytestmark = [pytest.mark.slow, pytest.mark.quiet]  # 6-second call deadlines
GREEDY = SamplingSettings(n=1, temperature=0.0, max_tokens=12)
QUESTIONS = ["12+3", "45-7", "99+9", "3-8"]
TIMEOUT_S = 6


@pytest.fixture(scope="module")
def groups(local_ray, tiny_model_dir):
    """One policy rank, trained one step (its weights are no longer the engines' base model), and
    two engines given those weights (version 1)."""
    from nemo_dapo.cluster.groups import PolicyGroup, RolloutGroup
    from nemo_dapo.cluster.worker_group import GroupSpec, WorkerGroup
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker
    from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker

    policy = PolicyGroup(
        WorkerGroup(
            TorchPolicyWorker,
            GroupSpec("policy", 1),
            {"settings": WorkerSettings(str(tiny_model_dir), OptimConfig(lr=3e-2, warmup_steps=0))},
        )
    )
    engines = WorkerGroup(
        VLLMRolloutWorker,
        GroupSpec("rollout", 2, call_timeout_s=TIMEOUT_S, timeout_key="rollout.timeout_s", start_timeout_s=300),
        {"settings": EngineSettings(str(tiny_model_dir), 128, weight_transfer="gloo")},
    )
    rollout = RolloutGroup(engines, max_restarts=10)
    rollout.set_weight_source(lambda: (policy.export_weights(1 << 16), 1))
    yield policy, rollout
    rollout.workers.shutdown()
    policy.workers.shutdown()


def prompt_ids(tokenizer) -> list[list[int]]:
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [
        tokenizer.encode(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)) for c in chats
    ]


def engine_pid(rollout, rank: int) -> int:
    import ray

    return ray.get(rollout.workers.workers[rank].__ray_call__.remote(lambda _: os.getpid()))


def train_one_step(policy, rollout, ids, tokenizer) -> None:
    batch = build_rollout_batch(
        ids, rollout.generate(ids, SamplingSettings(n=4, max_tokens=12)), {}, "g", tokenizer.pad_token_id, 0
    )
    batch.add("old_log_probs", policy.compute_log_prob(batch, 1.0)["log_probs"])
    batch.add("advantages", torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"])
    policy.update(batch, LossSettings(), prompts_per_mini_batch=4, ppo_epochs=1)


def assert_same(generations, reference) -> None:
    for ours, theirs in zip(generations, reference, strict=True):
        assert ours.token_ids == theirs.token_ids
        assert torch.allclose(torch.tensor(ours.log_probs[0]), torch.tensor(theirs.log_probs[0]), atol=1e-4)


def test_replaced_engines_generate_with_the_current_weights(groups, tiny_tokenizer):
    policy, rollout = groups
    ids = prompt_ids(tiny_tokenizer)
    base = rollout.generate(ids, GREEDY)
    train_one_step(policy, rollout, ids, tiny_tokenizer)
    rollout.store.send(policy.export_weights(1 << 16), version=1)
    current = rollout.generate(ids, GREEDY)
    gap = max(abs(a - b) for g0, g1 in zip(base, current) for a, b in zip(g0.log_probs[0], g1.log_probs[0]))
    assert gap > 1e-3  # a replacement left with the base model's weights would be caught below

    # sync trainer: engine 1 killed, engine 0 stopped (silent past the timeout) as a generation is sent
    for rank, sig in ((1, signal.SIGKILL), (0, signal.SIGSTOP)):
        pid = engine_pid(rollout, rank)
        os.kill(pid, sig)
        assert_same(rollout.generate(ids, GREEDY), current)
        assert engine_pid(rollout, rank) != pid
    assert rollout.restarts == 2 and rollout.workers.restarts == [1, 1]

    # a weight sync with engine 0 stopped: past the deadline it leaves the sync and is replaced,
    # engine 1 syncs; the replacement takes the weights before it generates
    pid = engine_pid(rollout, 0)
    os.kill(pid, signal.SIGSTOP)
    rollout.store.send(policy.export_weights(1 << 16), version=1)
    assert rollout.restarts == 3 and engine_pid(rollout, 0) != pid
    assert_same(rollout.generate(ids, GREEDY), current)


@pytest.fixture(scope="module")
def stream(groups):
    """The two engines streaming (trainer.mode=stream) from the first test that asks on."""
    from nemo_dapo.cluster.streaming import StreamingEngines

    return StreamingEngines(groups[1], GREEDY, max_inflight=16, kv_after_update="recompute", call_floor_s=3)


def stream_all(stream, ids, tag: str) -> list:
    """Send one group per prompt (alternating: the odd ones go to engine 1) and take them all back."""
    stream.add([(f"{tag}{i}", p) for i, p in enumerate(ids)])
    taken: list = []
    while len(taken) < len(ids):
        taken += stream.take(1.0)
    assert not stream.outstanding
    return [g.generation for g in sorted(taken, key=lambda g: g.key)]


def test_a_stream_goes_on_whenever_and_however_an_engine_fails(groups, stream, tiny_tokenizer):
    policy, rollout = groups
    ids = prompt_ids(tiny_tokenizer)
    current = rollout.generate(ids, GREEDY)
    # engine 1 killed holding groups; its replacement gets the current weights, streams, and is
    # sent those groups again
    pid = engine_pid(rollout, 1)
    stream.add([(f"k{i}", p) for i, p in enumerate(ids)])
    os.kill(pid, signal.SIGKILL)
    taken: list = []
    while len(taken) < len(ids):
        taken += stream.take(1.0)
    assert stream.resent == 2 and rollout.restarts == 4 and not stream.outstanding
    assert_same([g.generation for g in sorted(taken, key=lambda g: g.key)], current)

    # engine 1 dies before a weight sync, which replaces it; its first replacement dies while it
    # warms up: the next call warms the one after and starts its stream once (a second start raises)
    os.kill(engine_pid(rollout, 1), signal.SIGKILL)
    rollout.store.send(policy.export_weights(1 << 16), version=1)
    assert rollout.restarts == 5
    killed: list[int] = []

    def dies_while_warming_up():
        if not killed:
            killed.append(engine_pid(rollout, 1))
            os.kill(killed[0], signal.SIGKILL)
        return policy.export_weights(1 << 16), 1

    rollout.set_weight_source(dies_while_warming_up)
    assert_same(stream_all(stream, ids, "w"), current)
    assert killed and rollout.restarts == 6 and engine_pid(rollout, 1) != killed[0]
    rollout.set_weight_source(lambda: (policy.export_weights(1 << 16), 1))

    # an engine that fails inside its live actor (an error in its step) is replaced as a dead one:
    # engine 1 while streaming; engine 0 in validation's generate, after which the stream goes on
    break_engine(rollout.workers.workers[1])
    assert_same(stream_all(stream, ids, "f"), current)
    assert rollout.restarts == 7
    break_engine(rollout.workers.workers[0])
    assert_same(rollout.generate(ids, GREEDY), current)
    assert rollout.restarts == 8 and stream.load().wall_s > 0
    assert_same(stream_all(stream, ids, "v"), current)

    # an engine that hangs (SIGSTOP) while streaming is replaced within the stream's own deadline
    # (10 x its slowest step, at least 3 s here), not the group's (two minutes here)
    from nemo_dapo.cluster.worker_group import Deadline

    group_deadline = rollout.workers.call_deadline
    rollout.workers.call_deadline = Deadline(120, "rollout.timeout_s")
    try:
        assert 0 < stream.load().slowest_step_s < 0.3  # the tiny engine's steps, so the floor holds
        os.kill(engine_pid(rollout, 1), signal.SIGSTOP)
        started = time.monotonic()
        assert_same(stream_all(stream, ids, "h"), current)
        assert time.monotonic() - started < 60 and rollout.restarts == 9
    finally:
        rollout.workers.call_deadline = group_deadline


def test_a_broken_collective_sync_replaces_its_engines_for_one_restart(groups, tiny_tokenizer):
    """Over gloo an engine that fails mid-receive (an error loading its second bucket, its process
    alive) breaks the broadcast for all: it leaves its groups, the sender's broadcast fails and the
    sender leaves too, so the round ends within seconds, far inside the groups' 60-second timeout
    (before, the senders waited it out). Every engine that was receiving holds half-reloaded
    weights and is replaced, for one restart; the replacements warm up through the object store,
    and the next sync builds new groups with them."""
    from nemo_dapo.cluster.weight_sync import CollectiveSync
    from nemo_dapo.cluster.worker_group import Deadline

    policy, rollout = groups
    ids = prompt_ids(tiny_tokenizer)
    current = rollout.generate(ids, GREEDY)
    group_deadline = rollout.workers.call_deadline
    rollout.workers.call_deadline = Deadline(60, "rollout.timeout_s")  # the gloo groups' timeout too
    try:
        sync = CollectiveSync(policy, rollout, bucket_bytes=1 << 16)
        sync(version=1)  # builds the groups
        assert rollout.restarts == 9 and sync.sent_bytes > 0
        pids = [engine_pid(rollout, 0), engine_pid(rollout, 1)]
        break_receiving(rollout.workers.workers[1])
        assert seconds_to_failure(rollout, sync, version=1) < 15
    finally:
        rollout.workers.call_deadline = group_deadline
    assert rollout.restarts == 10 and sync.sent_bytes == 0
    assert engine_pid(rollout, 0) != pids[0] and engine_pid(rollout, 1) != pids[1]
    assert_same(rollout.generate(ids, GREEDY), current)
    sync(version=1)  # new groups, with the replacements
    assert rollout.restarts == 10 and sync.sent_bytes > 0
    assert_same(rollout.generate(ids, GREEDY), current)


def test_a_failure_past_the_restart_budget_stops_naming_the_engine(groups, tiny_tokenizer):
    """One failure more than rollout.max_restarts: the run stops, naming the engine and where to look."""
    from nemo_dapo.errors import RemoteCallError

    _, rollout = groups
    ids = prompt_ids(tiny_tokenizer)
    assert rollout.restarts == rollout.max_restarts
    pid = engine_pid(rollout, 0)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(
        RemoteCallError,
        match=r"rollout\.generate: a worker died .* their logs: /\S+/logs .*Rollout engine 0 failed while "
        r"generating, after 10 engine restart\(s\) in this run \(rollout\.max_restarts=10\)",
    ):
        rollout.generate(ids, GREEDY)
