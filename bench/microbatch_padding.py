"""How much padding do the micro-batches compute: batch order, length-sorted, packed?

    .venv/bin/python bench/microbatch_padding.py [--rows 512] [--budget 22528] [--max-response 20480]
    .venv/bin/python bench/microbatch_padding.py --scenario smollm2 [--time smollm2-135m-arith]

``--scenario dapo32b`` (default) draws one DP rank's rows with DAPO-like lengths (prompts 100-600
tokens; responses: 15 % hit the maximum, the rest exponential with mean 4000) at the token budget
of the 32B preset (``actor.max_token_len_per_micro_batch``). ``--scenario smollm2`` draws a step of
the ``smollm2_cpu`` preset as its runs look (64 rows, 39-token prompts; most answers 6-8 tokens,
3 % ramble to the 128-token limit, 5 % stop at 20-40) at its budget of 1024. Each is split four
ways: greedy in batch order, greedy longest first (the rule before 2026-12-02), longest first with
the fewest padded tokens (``policy/microbatch.py``, what the workers run) and packed (padded to a
multiple of 8, as for TP=8 with sequence parallelism). Printed per split: the micro-batch count,
the computed (padded) tokens per real token, and the attention score pairs per pair a row needs
(sum of squared real lengths; packed THD attention stays within each row). ``--time MODEL`` also
times one forward + backward over each padded split on that model in this process (median of
``--reps``), so the padding is priced in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCENARIOS = {  # rows, budget, max prompt, max response
    "dapo32b": (512, 22528, 2048, 20480),
    "smollm2": (64, 1024, 64, 128),
}


def dapo_like_lengths(rng: random.Random, max_response: int) -> tuple[int, int]:
    prompt = rng.randint(100, 600)
    response = max_response if rng.random() < 0.15 else min(max_response, 50 + int(rng.expovariate(1 / 4000)))
    return prompt, response


def smollm2_like_lengths(rng: random.Random, max_response: int) -> tuple[int, int]:
    draw = rng.random()
    response = max_response if draw < 0.03 else rng.randint(20, 40) if draw < 0.08 else rng.randint(6, 8)
    return 39, response


def step_mask(scenario: str, rows: int, max_prompt: int, max_response: int, seed: int) -> torch.Tensor:
    """Left-padded prompts, right-padded responses of the scenario's lengths."""
    rng = random.Random(seed)
    draw = dapo_like_lengths if scenario == "dapo32b" else smollm2_like_lengths
    mask = torch.zeros(rows, max_prompt + max_response, dtype=torch.long)
    for row in range(rows):
        prompt, response = draw(rng, max_response)
        mask[row, max_prompt - prompt : max_prompt + response] = 1
    return mask


def greedy_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """The rule the workers ran before 2026-12-02: fill each group in turn while rows x longest fits."""
    groups: list[list[int]] = [[]]
    longest = 0
    for row, length in enumerate(lengths):
        if groups[-1] and max(longest, length) * (len(groups[-1]) + 1) > max_tokens:
            groups.append([])
            longest = 0
        groups[-1].append(row)
        longest = max(longest, length)
    return groups


def padded_splits(batch: dict, budget: int) -> dict[str, list[dict]]:
    from nemo_dapo.policy.microbatch import micro_batches, trim_padding

    lengths = batch["attention_mask"].sum(1)
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    sorted_groups = greedy_groups([int(lengths[row]) for row in order], budget)
    return {
        "batch_order": [trim_padding(batch, rows) for rows in greedy_groups(lengths.tolist(), budget)],
        "greedy_longest_first": [trim_padding(batch, [order[i] for i in rows]) for rows in sorted_groups],
        "fewest_padded": micro_batches(batch, budget),
    }


def timed_splits(model_name: str, splits: dict[str, list[dict]], reps: int) -> dict[str, float]:
    """Median seconds of one forward + backward over each split's micro-batches (log-probs summed)."""
    from _policy_timing import forward_backward_s, policy_worker

    from nemo_dapo.config import load_config

    worker = policy_worker(model_name, load_config("smollm2_cpu", []).model.dtype)  # the preset's, on this CPU
    seconds: dict[str, list[float]] = {name: [] for name in splits}
    for _ in range(reps):
        for name, micros in splits.items():  # alternated, so drift hits every split alike
            seconds[name].append(forward_backward_s(worker, micros))
    return {name: statistics.median(values) for name, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="dapo32b")
    parser.add_argument("--rows", type=int, help="default: the scenario's")
    parser.add_argument("--budget", type=int, help="default: the scenario's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time", metavar="MODEL", help="also time forward + backward per split on this model")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    from nemo_dapo.policy.packing import packed_micro_batches

    rows, budget, max_prompt, max_response = SCENARIOS[args.scenario]
    rows, budget = args.rows or rows, args.budget or budget
    mask = step_mask(args.scenario, rows, max_prompt, max_response, args.seed)
    ids = torch.randint(3, 1000, mask.shape, generator=torch.Generator().manual_seed(args.seed)) * mask
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "responses": ids[:, max_prompt:],
    }
    lengths = mask.sum(1)
    real, needed_pairs = int(lengths.sum()), int((lengths**2).sum())
    splits = padded_splits(batch, budget)
    timed = timed_splits(args.time, splits, args.reps) if args.time else {}
    report = [
        (name, len(micros), sum(m["attention_mask"].numel() for m in micros), attention_pairs(micros))
        for name, micros in splits.items()
    ]
    packed = packed_micro_batches(batch, budget, multiple=8)
    cu = [m["cu_seqlens"].long() for m in packed]
    computed = sum(m["packed_ids"].numel() for m in packed)
    report.append(("packed", len(packed), computed, sum(int(((c[1:] - c[:-1]) ** 2).sum()) for c in cu)))
    for name, count, computed, pairs in report:
        line = {
            "scenario": args.scenario,
            "split": name,
            "micro_batches": count,
            "computed_per_real_token": round(computed / real, 3),
            "attention_pairs_per_needed": round(pairs / needed_pairs, 3),
            "rows": rows,
            "budget": budget,
        }
        if name in timed:
            line["forward_backward_s"] = round(timed[name], 3)
        print(json.dumps(line))


def attention_pairs(micros: list[dict]) -> int:
    return sum(m["attention_mask"].shape[0] * m["attention_mask"].shape[1] ** 2 for m in micros)


if __name__ == "__main__":
    main()
