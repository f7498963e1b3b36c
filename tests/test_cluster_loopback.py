"""Ray worker groups on loopback: calls fan out in rank order, DP ranks agree, nothing listens off loopback."""

import os

import pytest
import torch

from nemo_dapo.cluster.weight_sync import CollectiveSync
from nemo_dapo.cluster.worker_group import Deadline
from nemo_dapo.config.schema_actor import OptimConfig
from nemo_dapo.digest import digest_files
from nemo_dapo.policy.base import LossSettings, WorkerSettings
from nemo_dapo.rollout.base import EngineSettings, RolloutWorker, SamplingSettings
from nemo_dapo.trainer.batching import build_rollout_batch
from tests.flaky_worker import break_receiving, seconds_to_failure
from tests.listeners import is_loopback, our_listeners


def policy_group(model_dir, dp):
    from nemo_dapo.cluster.groups import PolicyGroup
    from nemo_dapo.cluster.worker_group import GroupSpec, WorkerGroup
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker

    return PolicyGroup(
        WorkerGroup(
            TorchPolicyWorker,
            GroupSpec(f"actor_dp{dp}", dp),
            {
                "settings": WorkerSettings(
                    str(model_dir), OptimConfig(lr=1e-2, warmup_steps=0, clip_grad=1e9), max_token_len=64
                )
            },
        )
    )


def rollout_group(model_dir, tp=1, engines=1):
    """Engines that take weights on either path (gloo: vLLM's weight-transfer engine in each worker)."""
    from nemo_dapo.cluster.groups import RolloutGroup
    from nemo_dapo.cluster.worker_group import GroupSpec, WorkerGroup
    from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker

    settings = EngineSettings(str(model_dir), 128, tensor_parallel_size=tp, weight_transfer="gloo")
    return RolloutGroup(WorkerGroup(VLLMRolloutWorker, GroupSpec(f"rollout_tp{tp}", engines), {"settings": settings}))


def chat_prompts(tokenizer, questions):
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        )
        for q in questions
    ]


def test_placement_that_cannot_fit_fails_clearly(local_ray, tiny_model_dir):
    from nemo_dapo.cluster.worker_group import GroupSpec, WorkerGroup
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker

    with pytest.raises(RuntimeError, match="could not place 9 workers"):
        WorkerGroup(TorchPolicyWorker, GroupSpec("too_big", 9, placement_timeout_s=3))


def test_dp2_update_equals_dp1_and_all_listeners_are_loopback(local_ray, tiny_model_dir, tiny_tokenizer, tmp_path):
    import ray

    rollout = rollout_group(tiny_model_dir)
    policy1 = policy_group(tiny_model_dir, dp=1)
    policy2 = policy_group(tiny_model_dir, dp=2)
    ids = chat_prompts(tiny_tokenizer, ["12+3", "45-7", "99+9", "3-8"])
    generations = rollout.generate(ids, SamplingSettings(n=4, max_tokens=12))
    batch = build_rollout_batch(ids, generations, {}, "g", tiny_tokenizer.pad_token_id, 0)
    old = policy1.compute_log_prob(batch, 1.0)["log_probs"]
    assert torch.allclose(old, policy2.compute_log_prob(batch, 1.0)["log_probs"], atol=1e-6)
    # each DP=2 rank was sent its half of the batch (its own rows, put once for its replica)
    whole, halves = policy1.sent_bytes["compute_log_prob"], policy2.sent_bytes["compute_log_prob"]
    assert len(halves) == 2 and max(halves) < whole[0] * 0.6 + 4096, (whole, halves)
    batch.add("old_log_probs", old)
    batch.add("advantages", torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"])
    m1 = policy1.update(batch, LossSettings(), prompts_per_mini_batch=4, ppo_epochs=1).metrics
    # DP=2 takes the old log-probs from its forward (zeros given: read, they would change the loss);
    # the replicas' values come back in row order, equal to the old_log_prob pass's
    fused = batch.select(range(len(batch)))
    fused.add("old_log_probs", torch.zeros_like(old), overwrite=True)
    result = policy2.update(fused, LossSettings(), prompts_per_mini_batch=4, ppo_epochs=1, first_old_from_forward=True)
    assert (result.first_forward["log_probs"] - old).abs().max().item() < 1e-5
    m2 = result.metrics
    assert m2["perf/rank_input_mb/update"] * 2**20 == max(policy2.sent_bytes["update"])
    assert max(policy2.sent_bytes["update"]) < policy1.sent_bytes["update"][0] * 0.6 + 4096
    assert m1["actor/pg_loss"] == pytest.approx(m2["actor/pg_loss"], abs=1e-6)
    assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"], rel=1e-5)
    w1 = {name: t for ref in policy1.export_weights(1 << 30) for name, t in ray.get(ref)}
    w2 = {name: t for ref in policy2.export_weights(1 << 30) for name, t in ray.get(ref)}
    # Adam's first step is ~lr * g / |g| per element (1e-2 here): rounding in tiny gradients moves it a
    # little, so the weights agree to 1% of one step, not bit-exactly
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-4
    # the updated weights streamed into the engine in many small buckets: it now samples from the policy
    rollout.store.send(policy2.export_weights(1 << 14), version=1)
    fresh = build_rollout_batch(
        ids, rollout.generate(ids, SamplingSettings(n=2, max_tokens=12)), {}, "g", tiny_tokenizer.pad_token_id, 0
    )
    gap = (fresh["rollout_log_probs"] - policy2.compute_log_prob(fresh, 1.0)["log_probs"]) * fresh["response_mask"]
    assert gap.abs().max().item() < 1e-4
    # the collective path (DP rank 1 exports nothing and only runs its export); its groups stay open
    # for the listener check below: their rendezvous and gloo sockets are on loopback too
    sync = CollectiveSync(policy2, rollout, bucket_bytes=1 << 14)
    sync(version=2)
    assert sync.sent_bytes > 0 and rollout.workers.call_all(RolloutWorker.weight_version) == [2]
    # a checkpoint's digests, computed by the two ranks, each over its share: those of this process
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name, size in {"a.bin": 3 << 20, "b.bin": 2 << 20, "c.bin": 1 << 20, "empty": 0}.items():
        (folder / name).write_bytes(torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes())
    names = ["a.bin", "b.bin", "c.bin", "empty"]
    assert policy2.digest_files(folder, names) == digest_files(folder, names)
    listeners = our_listeners()
    assert len(listeners) >= 3  # Ray's GCS, raylet, workers... the check sees real sockets
    assert [who for ip, who in listeners if not is_loopback(ip)] == []
    assert is_loopback("::ffff:127.0.0.1") and not is_loopback("0.0.0.0") and not is_loopback("::")
    for group in (rollout, policy1, policy2):  # the CPUs they hold go back to the next test
        group.workers.shutdown()


def test_a_tp2_engine_takes_the_streamed_weights(local_ray, tiny_model_dir, tiny_tokenizer):
    """A TP=2 engine runs its ranks in processes of their own, so every bucket of a weight sync
    crosses vLLM's executor (object store) or reaches each rank from the sender itself (gloo):
    after the sync it samples from the updated policy, each token's log-prob the policy's own. A
    rank that fails mid-receive ends the round at once and the engine is replaced."""
    import ray

    rollout = rollout_group(tiny_model_dir, tp=2)
    policy = policy_group(tiny_model_dir, dp=1)
    ids = chat_prompts(tiny_tokenizer, ["12+3", "45-7"])

    def gap() -> float:
        fresh = build_rollout_batch(
            ids, rollout.generate(ids, SamplingSettings(n=4, max_tokens=12)), {}, "g", tiny_tokenizer.pad_token_id, 0
        )
        diff = fresh["rollout_log_probs"] - policy.compute_log_prob(fresh, 1.0)["log_probs"]
        return (diff * fresh["response_mask"]).abs().max().item()

    assert gap() < 1e-4
    batch = build_rollout_batch(
        ids, rollout.generate(ids, SamplingSettings(n=4, max_tokens=12)), {}, "g", tiny_tokenizer.pad_token_id, 0
    )
    batch.add("old_log_probs", policy.compute_log_prob(batch, 1.0)["log_probs"])
    batch.add("advantages", torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"])
    policy.update(batch, LossSettings(), prompts_per_mini_batch=2, ppo_epochs=1)
    assert gap() > 1e-3  # the engine still samples from the weights before the update
    rollout.store.send(policy.export_weights(1 << 14), version=1)
    assert gap() < 1e-4
    # the collective path: policy rank 0 broadcasts to both engine workers, each at its own rank in
    # the group (nothing over the engine's own group, nothing through the driver)
    policy.update(batch, LossSettings(), prompts_per_mini_batch=2, ppo_epochs=1)
    assert gap() > 1e-3
    rollout.workers.call_deadline = Deadline(60, "rollout.timeout_s")  # the gloo groups' timeout too
    sync = CollectiveSync(policy, rollout, bucket_bytes=1 << 14)
    sync(version=2)
    assert gap() < 1e-4 and rollout.workers.call_all(RolloutWorker.weight_version) == [2]
    model_bytes = sum(t.numel() * t.element_size() for ref in policy.export_weights(1 << 30) for _, t in ray.get(ref))
    assert model_bytes <= sync.sent_bytes < model_bytes * 1.02  # each tensor once (its bytes, aligned)
    # the engine's second worker fails loading its second bucket: the round ends within seconds
    # (every party leaves its group), not at the groups' timeout; the engine is replaced, takes
    # the weights through the object store, and the next sync builds groups with it
    rollout.max_restarts = 1
    rollout.set_weight_source(lambda: (policy.export_weights(1 << 14), 2))
    pid = engine_pid(rollout)
    break_receiving(rollout.workers.workers[0], rank=1)
    assert seconds_to_failure(rollout, sync, version=2) < 15
    assert rollout.restarts == 1 and engine_pid(rollout) != pid
    assert gap() < 1e-4
    policy.update(batch, LossSettings(), prompts_per_mini_batch=2, ppo_epochs=1)
    sync(version=3)
    assert gap() < 1e-4 and rollout.workers.call_all(RolloutWorker.weight_version) == [3]
    rollout.workers.shutdown()
    policy.workers.shutdown()


def engine_pid(rollout) -> int:
    import ray

    return ray.get(rollout.workers.workers[0].__ray_call__.remote(lambda _: os.getpid()))
