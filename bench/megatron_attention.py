"""Megatron's local attention against torch SDPA in the local spec, padded and packed, on this CPU.

    .venv/bin/python bench/megatron_attention.py [--rows 8] [--max-response 1536] [--repeats 3]

Builds a random dense Qwen3-shaped model (hidden 256, 8 heads / 2 KV groups, 2 layers), draws
rows with DAPO-like lengths (prompts 64-192 tokens, responses exponential, 15 % at the maximum)
and, for each variant, in its own process (Megatron's parallel state is global):

- ``megatron_dot_product``: Megatron's ``DotProductAttention`` (what the local spec had), padded;
- ``sdpa``: :class:`nemo_dapo.policy.megatron.attention.SdpaAttention`, padded micro-batches;
- ``sdpa_packed``: the same with ``sequence_packing`` (THD, one row at a time).

It prints the seconds per DAPO update (forward + backward + Adam, mean of ``--repeats`` after one
warm-up) and the bytes autograd keeps for the backward of one forward over the whole batch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = ("megatron_dot_product", "sdpa", "sdpa_packed")


def dapo_like_batch(rows: int, max_response: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    rng = random.Random(seed)
    max_prompt = 192
    attention = torch.zeros(rows, max_prompt + max_response, dtype=torch.long)
    for row in range(rows):
        response = (
            max_response if rng.random() < 0.15 else min(max_response, 32 + int(rng.expovariate(4 / max_response)))
        )
        attention[row, max_prompt - rng.randint(64, max_prompt) : max_prompt + response] = 1
    ids = torch.randint(3, vocab, attention.shape, generator=torch.Generator().manual_seed(seed)) * attention
    loss_mask = attention[:, max_prompt:]
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
        "responses": ids[:, max_prompt:],
        "loss_mask": loss_mask,
        "advantages": torch.linspace(-1, 1, rows)[:, None] * loss_mask,
    }


def run_variant(variant: str, model_dir: str, args, out: str) -> None:
    from logprob_memory import saved_bytes

    from nemo_dapo.config.schema_actor import MegatronConfig, OptimConfig
    from nemo_dapo.policy.base import LossSettings, MiniBatch, WorkerSettings
    from nemo_dapo.policy.megatron import attention as megatron_attention
    from nemo_dapo.policy.megatron.worker import MegatronPolicyWorker

    if variant == "megatron_dot_product":
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        megatron_attention.SdpaAttention = DotProductAttention  # what layer_spec puts in the local spec
    torch.set_num_threads(args.threads)
    worker = MegatronPolicyWorker(
        0,
        1,
        os.path.join(out, f"rdv_{variant}"),
        WorkerSettings(model_dir, OptimConfig(), max_token_len=1 << 20),
        MegatronConfig(sequence_packing=variant.endswith("packed")),
    )
    batch = dapo_like_batch(args.rows, args.max_response, 400, seed=0)
    micro = worker._micro_batches(batch)[0]
    worker._set_mode(train=True)
    saved = saved_bytes(lambda: worker.chunks[0](**worker._model_inputs(micro)))
    full = {**batch, "old_log_probs": worker.compute_log_prob(batch)["log_probs"]}
    mini = MiniBatch(full, float(batch["loss_mask"].sum()), float(args.rows))
    times = []
    for _ in range(args.repeats + 1):
        started = time.perf_counter()
        worker.update([mini], LossSettings())
        times.append(time.perf_counter() - started)
    with open(os.path.join(out, f"{variant}.json"), "w") as handle:
        json.dump(
            {
                "variant": variant,
                "update_s": sum(times[1:]) / args.repeats,
                "saved_for_backward_mib": round(saved / 2**20, 1),
                "real_tokens": int(batch["attention_mask"].sum()),
                "padded_tokens": int(batch["attention_mask"].numel()),
            },
            handle,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-response", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    from nemo_dapo.model.tiny_qwen3 import TinyQwen3Spec, build_tiny_qwen3

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as work:
        spec = TinyQwen3Spec(num_experts=0, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2)
        model_dir = str(build_tiny_qwen3(os.path.join(work, "model"), spec))
        for variant in VARIANTS:
            process = mp.get_context("spawn").Process(target=run_variant, args=(variant, model_dir, args, work))
            process.start()
            process.join()
            with open(os.path.join(work, f"{variant}.json")) as handle:
                print(handle.read(), flush=True)


if __name__ == "__main__":
    main()
