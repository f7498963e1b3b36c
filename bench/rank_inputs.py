"""How many bytes does each training rank receive per call: as views, as compact rows, as RankRows?

    .venv/bin/python bench/rank_inputs.py [--rows 256] [--prompt 2048] [--response 20480] [--dp 4]

Builds a scored batch of ``--rows`` samples with prompts and responses of uniformly random
lengths up to the given widths (the 32B preset's: 2048 + 20480), cuts it for ``--dp``
data-parallel replicas as the driver does for the log-prob pass (``worker_inputs`` + ``shard``)
and for an update (``mini_batches_per_rank``), and pickles one rank's part three ways:

- views: the row slices as plain dicts (pickling a view writes its whole storage);
- compact: each tensor its own rows, masks as bool, ids and positions as int32, padding included;
- rank_rows: ``RankRows`` as sent (compact, and no padding: real elements and row lengths).

Prints one JSON line per call with bytes per rank, bytes per batch token place, and the driver's
seconds to serialize every rank's part. Pickle is what Ray's serializer runs for these objects.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time

import torch

from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.policy.inputs import mini_batches_per_rank, shard, worker_inputs
from nemo_dapo.policy.rank_rows import _compact


def scored_batch(rows: int, prompt: int, response: int, group: int = 16) -> RolloutBatch:
    """Left-padded prompts and right-padded responses of random lengths, as the trainer builds them."""
    gen = torch.Generator().manual_seed(0)
    prompt_len = torch.randint(prompt // 8, prompt + 1, (rows // group,), generator=gen).repeat_interleave(group)
    response_len = torch.randint(1, response + 1, (rows,), generator=gen)
    prompt_mask = (torch.arange(prompt)[None, :] >= prompt - prompt_len[:, None]).long()
    response_mask = (torch.arange(response)[None, :] < response_len[:, None]).long()
    log_probs = -torch.rand(rows, response, generator=gen) * response_mask
    tensors = {
        "prompts": torch.randint(0, 151_000, (rows, prompt), generator=gen) * prompt_mask,
        "prompt_mask": prompt_mask,
        "responses": torch.randint(0, 151_000, (rows, response), generator=gen) * response_mask,
        "response_mask": response_mask,
        "loss_mask": response_mask.clone(),
        "rollout_log_probs": log_probs,
        "old_log_probs": log_probs.clone(),
        "advantages": torch.randn(rows, 1, generator=gen) * response_mask,
    }
    return RolloutBatch(tensors, {"uid": [f"s0:{row // group}" for row in range(rows)]})


def timed_bytes(parts: list) -> tuple[list[int], float]:
    start = time.perf_counter()
    sizes = [len(pickle.dumps(part, protocol=5)) for part in parts]
    return sizes, time.perf_counter() - start


def as_views(part):
    """A rank's part as plain dicts of the row slices (views)."""
    if isinstance(part, dict):
        return dict(part)
    return [type(mb)(dict(mb.data), mb.global_token_count, mb.global_seq_count) for mb in part]


def as_compact(part):
    """A rank's part with each tensor compact but padded (own storage, narrow integers)."""
    if isinstance(part, dict):
        return {name: _compact(tensor) for name, tensor in part.items()}
    return [type(mb)(as_compact(mb.data), mb.global_token_count, mb.global_seq_count) for mb in part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--response", type=int, default=20480)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--prompts-per-mini-batch", type=int, default=4)
    args = parser.parse_args()
    batch = scored_batch(args.rows, args.prompt, args.response)
    tokens = args.rows * (args.prompt + args.response)
    calls = {
        "compute_log_prob": shard(worker_inputs(batch), args.dp),
        "update": mini_batches_per_rank(batch, args.prompts_per_mini_batch, args.dp, ppo_epochs=1),
    }
    for call, parts in calls.items():
        line = {"call": call, "rows": args.rows, "tokens": tokens, "dp": args.dp}
        for way, sent in (("views", as_views), ("compact", as_compact), ("rank_rows", lambda part: part)):
            sizes, seconds = timed_bytes([sent(part) for part in parts])
            line |= {f"{way}_bytes_per_rank": max(sizes), f"{way}_bytes_per_token": round(sum(sizes) / tokens, 2)}
            line[f"{way}_serialize_s"] = round(seconds, 3)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
