"""Weights exported by the Megatron worker drive vLLM to the same greedy output as the HF model."""

import importlib.util
from dataclasses import asdict

import pytest
import torch

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
                       reason="the megatron extra is not installed"),
]


def test_greedy_output_after_megatron_export_equals_hf(tiny_model_dir, tiny_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from nemo_dapo.config.schema import OptimConfig
    from nemo_dapo.policy.megatron_worker import MegatronPolicyWorker
    from nemo_dapo.rollout.base import SamplingSettings
    from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker

    questions = ["12+3", "45-7", "99+9", "3-8", "70+6"]
    prompts = [tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)) for q in questions]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                              eos_token_id=hf.config.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)
        expected.append(out[0, len(ids):].tolist())

    worker = MegatronPolicyWorker(0, 1, str(tmp_path / "store"), str(tiny_model_dir), asdict(OptimConfig()))
    exported = list(worker.export_weights(bucket_bytes=1 << 16))
    hf_state = hf.state_dict()
    assert {name for bucket in exported for name, _ in bucket} == set(hf_state)
    assert all(torch.equal(tensor, hf_state[name]) for bucket in exported for name, tensor in bucket)

    engine = VLLMRolloutWorker(0, 1, "", str(tiny_model_dir), max_model_len=128)
    scrambled = [[(name, torch.randn_like(t)) for name, t in bucket] for bucket in exported]
    engine.update_weights(scrambled, version=1)  # make sure the next answers come from the export
    engine.update_weights(exported, version=2)
    greedy = engine.generate(prompts, SamplingSettings(n=1, temperature=0.0, max_tokens=12))
    assert [g.token_ids[0] for g in greedy] == expected
