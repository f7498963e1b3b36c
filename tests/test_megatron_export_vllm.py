"""Weights exported by the Megatron worker drive vLLM to the same greedy output as the HF model."""

import importlib.util

import pytest
import torch

from nemo_dapo.policy.base import WorkerSettings
from tests.ranks import spawn

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
        reason="the megatron extra is not installed",
    ),
]


def greedy_after_export(rank: int, world_size: int, model_dir: str, out_file: str) -> None:
    """In a fresh process (vLLM and Megatron keep one parallel state per process): HF's greedy
    answers, the Megatron export against the checkpoint, vLLM's answers after scrambled and
    after exported weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_dapo.config.schema_actor import OptimConfig
    from nemo_dapo.policy.megatron.model import read_hf_weights
    from nemo_dapo.policy.megatron.worker import MegatronPolicyWorker
    from nemo_dapo.rollout.base import EngineSettings, SamplingSettings
    from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        )
        for q in ["12+3", "45-7", "99+9", "3-8", "70+6"]
    ]
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        expected = [
            hf.generate(
                torch.tensor([ids]),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=hf.config.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(ids) :].tolist()
            for ids in prompts
        ]

    worker = MegatronPolicyWorker(0, 1, out_file + ".store", WorkerSettings(model_dir, OptimConfig()))
    exported = list(worker.export_weights(bucket_bytes=1 << 16))
    checkpoint = read_hf_weights(model_dir)  # the checkpoint's names (per-expert for MoE)
    if hf.config.tie_word_embeddings:
        checkpoint["lm_head.weight"] = checkpoint["model.embed_tokens.weight"]
    names_equal = {name for bucket in exported for name, _ in bucket} == set(checkpoint)
    tensors_equal = all(torch.equal(tensor, checkpoint[name]) for bucket in exported for name, tensor in bucket)

    engine = VLLMRolloutWorker(0, 1, "", EngineSettings(model_dir, max_model_len=128))
    greedy = SamplingSettings(n=1, temperature=0.0, max_tokens=12)

    def answers(weights=None, version=0):
        if weights is not None:
            engine.update_weights(weights, version)
        return [g.token_ids[0] for g in engine.generate(prompts, greedy)]

    result = {
        "expected": expected,
        "names_equal": names_equal,
        "tensors_equal": tensors_equal,
        "fresh": answers(),
        "reloaded": answers([list(checkpoint.items())], 1),
        "scrambled": answers([[(n, torch.randn_like(t)) for n, t in b] for b in exported], 2),
        "exported": answers(exported, 3),
    }
    torch.save(result, out_file)


@pytest.mark.parametrize("family", ["tiny_model_dir", "moe_dir", "smollm2_dir"])  # Qwen2, Qwen3-MoE, real Llama
def test_greedy_output_after_megatron_export_equals_hf(family, request, tmp_path):
    out_file = str(tmp_path / "greedy.pt")
    spawn(greedy_after_export, 1, str(request.getfixturevalue(family)), out_file)
    result = torch.load(out_file)
    assert result["names_equal"] and result["tensors_equal"]
    assert result["fresh"] == result["expected"]  # vLLM's own load of the checkpoint answers as HF does
    assert result["scrambled"] != result["expected"]  # the answers below come from the exported weights
    assert result["reloaded"] == result["expected"]  # a reload of the checkpoint's own tensors changes nothing
    assert result["exported"] == result["expected"]
