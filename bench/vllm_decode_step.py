"""What does one vLLM decoding step cost on this CPU, by batch size? The floor under a generation
round: a round lasts as many steps as its longest sample, and its last samples decode almost alone.

    .venv/bin/python bench/vllm_decode_step.py [--model smollm2-135m-arith] [--compiled]

One in-process engine (bf16, as the smollm2_cpu preset runs it; ``--compiled``: without
``enforce_eager``, i.e. with vLLM's torch.compile) decodes 128 tokens per sample, ignoring EOS,
for 1, 12 and 96 samples of 39-token prompts (96 = the preset's 12 prompts x 8), after one
untimed round per size; prints the engine's start-up seconds and milliseconds per decoding step.
"""

from __future__ import annotations

import argparse
import os
import time

STEPS = 128
PROMPT_TOKENS = 39


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-arith")
    parser.add_argument("--compiled", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from nemo_dapo.model.builtin import resolve_builtin
    from nemo_dapo.rollout.vllm_worker import CPU_BLOCK_SIZE

    start = time.perf_counter()
    llm = LLM(
        model=resolve_builtin(args.model, [], [])[0],
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=not args.compiled,
        block_size=CPU_BLOCK_SIZE,  # the KV block size our rollout worker uses on a CPU
        gpu_memory_utilization=0.5,
        logprobs_mode="processed_logprobs",
    )
    print(f"engine start-up {time.perf_counter() - start:.1f} s ({'compiled' if args.compiled else 'eager'})")
    for prompts, samples in ((1, 1), (12, 1), (12, 8)):
        sampling = SamplingParams(n=samples, max_tokens=STEPS, ignore_eos=True, logprobs=0, temperature=1.0)
        batch = [TokensPrompt(prompt_token_ids=[1] + [100 + p] * (PROMPT_TOKENS - 1)) for p in range(prompts)]
        llm.generate(batch, sampling, use_tqdm=False)
        start = time.perf_counter()
        llm.generate(batch, sampling, use_tqdm=False)
        step_ms = 1000 * (time.perf_counter() - start) / STEPS
        print(f"{prompts * samples:3d} samples: {step_ms:6.1f} ms per decoding step")


if __name__ == "__main__":
    main()
