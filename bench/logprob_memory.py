"""What does the log-prob / entropy computation keep for the backward pass, per rank?

    .venv/bin/python bench/logprob_memory.py [--tokens 1024] [--vocab 151936] [--tp 8] [--entropy-grad]

Counts the bytes of the distinct tensors autograd saves (``saved_tensors_hooks``) while the
response log-probs and entropy are computed from one micro-batch's logits, for:

- ``gathered``: the full-vocabulary logits on every rank (what ``parallel_output=False`` gives),
  scored with :mod:`nemo_dapo.algo.logprob` (the torch worker's formulas);
- ``vocab_parallel``: this rank's ``V / TP`` columns, scored with
  :func:`nemo_dapo.policy.megatron.vocab.vocab_parallel_stats` (the Megatron worker before chunking);
- ``head_whole`` / ``head_chunked``: from the final hidden states through the output layer, the
  whole micro-batch's logits at once (before) or :func:`nemo_dapo.algo.logprob.chunked_token_stats`
  (both workers now); here the output layer's input and weight are counted too.

Runs on one process: the TP all-reduces are over a group of one, so only the shard's width
matters. The logits tensor itself (the output layer's result) is counted for both. Prints one
JSON line per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def saved_bytes(compute) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of ``compute()``."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        compute()
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--entropy-grad", action="store_true", help="entropy bonus on (entropy_coeff != 0)")
    parser.add_argument("--hidden", type=int, default=576, help="hidden size for the head_* variants")
    args = parser.parse_args()

    from nemo_dapo.algo.logprob import (
        chunk_tokens_for,
        chunked_token_stats,
        entropy_from_logits,
        log_probs_from_logits,
        token_stats,
    )
    from nemo_dapo.config.topology import Parallelism
    from nemo_dapo.policy.megatron import model as mm
    from nemo_dapo.policy.megatron.cpu_compat import enable_cpu_compat
    from nemo_dapo.policy.megatron.vocab import vocab_parallel_stats

    enable_cpu_compat()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mm.init_distributed(0, 1, os.path.join(tempfile.mkdtemp(), "rdv"), Parallelism(), seed=1)
    dtype = getattr(torch, args.dtype)
    labels = torch.randint(0, args.vocab, (1, args.tokens))

    def gathered():
        logits = torch.randn(1, args.tokens, args.vocab, dtype=dtype, requires_grad=True)
        return log_probs_from_logits(logits, labels), entropy_from_logits(logits)

    def vocab_parallel():
        width = -(-args.vocab // args.tp)
        logits = torch.randn(1, args.tokens, width, dtype=dtype, requires_grad=True)
        return vocab_parallel_stats(logits, labels.clamp(max=width - 1), 1.0, width, args.entropy_grad)

    head = torch.nn.Linear(args.hidden, args.vocab, bias=False).to(dtype)

    def head_whole():
        hidden = torch.randn(1, args.tokens, args.hidden, dtype=dtype, requires_grad=True)
        return token_stats(head(hidden), labels)

    def head_chunked():
        hidden = torch.randn(1, args.tokens, args.hidden, dtype=dtype, requires_grad=True)
        return chunked_token_stats(hidden, labels, head, token_stats, chunk_tokens_for(args.vocab))

    variants = (
        ("gathered", gathered),
        ("vocab_parallel", vocab_parallel),
        ("head_whole", head_whole),
        ("head_chunked", head_chunked),
    )
    for name, compute in variants:
        kept = saved_bytes(compute)
        print(
            json.dumps(
                {
                    "variant": name,
                    "tokens": args.tokens,
                    "vocab": args.vocab,
                    "tp": args.tp,
                    "entropy_grad": args.entropy_grad or name != "vocab_parallel",
                    "saved_for_backward_mib": round(kept / 2**20, 1),
                    "bytes_per_token": round(kept / args.tokens),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
