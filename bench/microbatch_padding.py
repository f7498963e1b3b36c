"""How much padding do the micro-batches compute: batch order, length-sorted, packed?

    .venv/bin/python bench/microbatch_padding.py [--rows 512] [--budget 22528] [--max-response 20480]

Draws one DP rank's rows with DAPO-like lengths (prompts 100-600 tokens; responses: 15 % hit the
maximum, the rest exponential with mean 4000), splits them by the token budget of the 32B preset
(``actor.max_token_len_per_micro_batch``) three ways and prints the micro-batch count, the computed
(padded) tokens per real token, and the attention score pairs per pair a row needs (sum of squared
real lengths; packed THD attention stays within each row). Packs are padded to a multiple of 8
(TP=8 with sequence parallelism). Pure arithmetic on masks: no model runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dapo_like_mask(rows: int, max_prompt: int, max_response: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    mask = torch.zeros(rows, max_prompt + max_response, dtype=torch.long)
    for row in range(rows):
        prompt = rng.randint(100, 600)
        response = max_response if rng.random() < 0.15 else min(max_response, 50 + int(rng.expovariate(1 / 4000)))
        mask[row, max_prompt - prompt : max_prompt + response] = 1
    return mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--budget", type=int, default=22528)
    parser.add_argument("--max-prompt", type=int, default=2048)
    parser.add_argument("--max-response", type=int, default=20480)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from nemo_dapo.policy.microbatch import micro_batches, token_budget_split, trim_padding
    from nemo_dapo.policy.packing import packed_micro_batches

    mask = dapo_like_mask(args.rows, args.max_prompt, args.max_response, args.seed)
    batch = {"input_ids": mask, "attention_mask": mask, "responses": mask[:, args.max_prompt :]}
    lengths = mask.sum(1)
    real, needed_pairs = int(lengths.sum()), int((lengths**2).sum())
    in_order = [trim_padding(batch, rows) for rows in token_budget_split(lengths.tolist(), args.budget)]
    packed = packed_micro_batches(batch, args.budget, multiple=8)
    splits = [
        (
            name,
            micros,
            sum(m["attention_mask"].numel() for m in micros),
            sum(m["attention_mask"].shape[0] * m["attention_mask"].shape[1] ** 2 for m in micros),
        )
        for name, micros in (("batch_order", in_order), ("length_sorted", micro_batches(batch, args.budget)))
    ]
    cu = [m["cu_seqlens"].long() for m in packed]
    splits.append(
        (
            "packed",
            packed,
            sum(m["packed_ids"].numel() for m in packed),
            sum(int(((c[1:] - c[:-1]) ** 2).sum()) for c in cu),
        )
    )
    for name, micros, computed, pairs in splits:
        print(
            json.dumps(
                {
                    "split": name,
                    "micro_batches": len(micros),
                    "computed_per_real_token": round(computed / real, 3),
                    "attention_pairs_per_needed": round(pairs / needed_pairs, 3),
                    "rows": args.rows,
                    "budget": args.budget,
                }
            )
        )


if __name__ == "__main__":
    main()
