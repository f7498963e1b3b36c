"""The torch policy worker and the vLLM engine agree, before and after a live weight update."""

import pytest
import torch

from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.config.schema_actor import OptimConfig
from nemo_dapo.policy.base import LossSettings, WorkerSettings
from nemo_dapo.policy.inputs import mini_batches_per_rank, worker_inputs
from nemo_dapo.rollout.base import EngineSettings, SamplingSettings
from nemo_dapo.trainer.batching import build_rollout_batch

TOLERANCE = 1e-4  # float32 on both sides; observed max |diff| ~ 3e-6


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    from torch._dynamo.utils import counters

    from nemo_dapo.policy.torch_worker import TorchPolicyWorker
    from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker

    compiled_before = counters["frames"]["total"]
    # built for vLLM's nccl weight transfer, which nothing here calls (it needs CUDA): the weights
    # below take the object-store path, which works whatever backend the engine was built for
    settings = EngineSettings(str(tiny_model_dir), max_model_len=128, weight_transfer="nccl")
    engine = VLLMRolloutWorker(0, 1, "", settings)
    engine.compiled_frames = counters["frames"]["total"] - compiled_before  # its start returned log-probs
    policy = TorchPolicyWorker(0, 1, "", WorkerSettings(str(tiny_model_dir), OptimConfig(lr=1e-2, warmup_steps=0)))
    return engine, policy


def prompts(tokenizer, questions):
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for q in questions
    ]


def rollout(engine, tokenizer, questions, n=4, version=0) -> RolloutBatch:
    ids = prompts(tokenizer, questions)
    generations = engine.generate(ids, SamplingSettings(n=n, temperature=1.0, max_tokens=16))
    return build_rollout_batch(ids, generations, {}, "t", tokenizer.pad_token_id, version)


# a shared prefix of more than one 32-token KV block: the engine's prefix cache holds it across
# calls, so stale keys after a weight update would show as a gap
SHARED_PREFIX = "Compute this sum for me, please. " * 2


def max_gap(engine, policy, tokenizer) -> float:
    batch = rollout(engine, tokenizer, [SHARED_PREFIX + q for q in ["12+3", "45-7", "99+9", "0-8"]])
    ours = policy.compute_log_prob(worker_inputs(batch))["log_probs"]
    mask = batch["response_mask"].bool()
    return (ours - batch["rollout_log_probs"])[mask].abs().max().item()


def test_generation_shapes_and_finish_reasons(engines, tiny_tokenizer):
    engine, _ = engines
    batch = rollout(engine, tiny_tokenizer, ["1+1", "2+2"], n=3)
    assert len(batch) == 6 and batch["uid"] == ["t:0"] * 3 + ["t:1"] * 3
    assert set(batch["finish_reason"]) <= {"stop", "length"}
    lengths = batch["response_mask"].sum(dim=1)
    assert int(lengths.max()) <= 16
    stopped = [i for i, r in enumerate(batch["finish_reason"]) if r == "stop"]
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert all(batch["responses"][i, int(lengths[i]) - 1].item() == eos for i in stopped)  # EOS counted


def test_engines_run_eagerly_on_cpu_and_with_cuda_graphs_on_gpus_unless_told(engines):
    from nemo_dapo.rollout.vllm_worker import runs_eagerly

    assert runs_eagerly(None, on_cpu=True) and not runs_eagerly(None, on_cpu=False)
    assert runs_eagerly(True, on_cpu=False) and not runs_eagerly(False, on_cpu=True)
    # an eager CPU engine compiles nothing, not even the sampler's rank function (1.6-3 s a start)
    assert engines[0].compiled_frames == 0


def test_an_engine_built_for_nccl_holds_vllms_nccl_engine_in_its_worker(engines):
    """rollout.weight_transfer=nccl gives vLLM weight_transfer_config={"backend": "nccl"}: every
    worker builds vLLM's own NCCLWeightTransferEngine, which the driver's groups then join."""
    engine, _ = engines
    assert engine.weight_transfer_setup() == ("nccl", 1)
    assert engine.llm.collective_rpc(lambda worker: type(worker.weight_transfer_engine).__name__) == [
        "NCCLWeightTransferEngine"
    ]


def test_logprobs_match_before_and_after_weight_update(engines, tiny_tokenizer):
    engine, policy = engines
    assert max_gap(engine, policy, tiny_tokenizer) < TOLERANCE
    batch = rollout(engine, tiny_tokenizer, ["31+5", "77-9"], n=4)
    batch.add("old_log_probs", batch["rollout_log_probs"])
    scores = torch.tensor([1.0, -1.0] * 4)
    batch.add("advantages", scores[:, None] * batch["response_mask"])
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    per_rank = mini_batches_per_rank(batch, prompts_per_mini_batch=2, world_size=1, ppo_epochs=1)
    metrics = policy.update(per_rank[0], LossSettings()).metrics
    assert metrics["actor/grad_norm"][0] > 0
    changed = [k for k, v in policy.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "the update changed no weight"
    # the gradients are freed with the update: they would sit through generation, the sync and a save
    assert all(p.grad is None for p in policy.model.parameters())
    assert max_gap(engine, policy, tiny_tokenizer) > TOLERANCE  # engine still has the old weights
    assert engine.update_weights(policy.export_weights(bucket_bytes=1 << 16), version=1) == 1
    assert engine.weight_version() == 1
    assert max_gap(engine, policy, tiny_tokenizer) < TOLERANCE


def test_export_respects_bucket_size(engines):
    _, policy = engines
    buckets = list(policy.export_weights(bucket_bytes=1 << 16))
    names = [name for bucket in buckets for name, _ in bucket]
    assert len(buckets) > 1 and len(names) == len(set(names)) == len(policy.model.state_dict())
    for bucket in buckets:
        assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= 1 << 16


@pytest.mark.parametrize("family", ["tiny_model_dir", "moe_dir"])  # Qwen2 dense, Qwen3-MoE (fused experts)
def test_torch_worker_checkpoint_restores_the_weights(family, request, tmp_path):
    """A MoE keeps its experts fused in memory and per expert on disk: the load maps them back."""
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker

    model_dir = str(request.getfixturevalue(family))
    saved = TorchPolicyWorker(0, 1, "", WorkerSettings(model_dir, OptimConfig()))
    with torch.no_grad():
        for param in saved.model.parameters():
            param.add_(torch.randn_like(param) * 0.01)  # not the weights a fresh worker starts from
    saved.save(str(tmp_path / "ckpt"))
    loaded = TorchPolicyWorker(0, 1, "", WorkerSettings(model_dir, OptimConfig()))
    loaded.load(str(tmp_path / "ckpt"))
    expected = saved.model.state_dict()
    assert all(torch.equal(t, expected[name]) for name, t in loaded.model.state_dict().items())


def test_a_bf16_run_sends_the_engines_bf16_and_keeps_fp32_master_weights(tiny_model_dir):
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker

    policy = TorchPolicyWorker(0, 1, "", WorkerSettings(str(tiny_model_dir), OptimConfig(lr=1e-2), dtype="bfloat16"))
    sent = dict(pair for bucket in policy.export_weights() for pair in bucket)
    master = policy.model.state_dict()
    assert sent.keys() == master.keys()  # tied weights under each name (the engine reloads every layer)
    for name, tensor in sent.items():
        assert master[name].dtype == torch.float32 and tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, master[name].to(torch.bfloat16)), name
