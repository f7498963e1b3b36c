"""Vocabulary-parallel log-probs and entropy equal the gathered-logits formulas, gradients included.

Two tensor-parallel ranks (gloo over a FileStore, spawned) each hold half the columns of a
vocabulary padded from 11 to 12 entries; the reference is :mod:`nemo_dapo.algo.logprob` on the
whole logits in the test process.
"""

import importlib.util
import os

import pytest
import torch

from nemo_dapo.config.topology import Parallelism
from tests.ranks import spawn

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
        reason="megatron-core is not installed (optional 'megatron' extra)",
    ),
]

VOCAB, PADDED, TEMPERATURE = 11, 12, 0.7


def sample(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, PADDED, generator=gen) * 4
    labels = torch.randint(0, VOCAB, (3, 5), generator=gen)
    return logits, labels


def run_rank(rank: int, world_size: int, rendezvous: str, out_dir: str) -> None:
    from nemo_dapo.policy.megatron import model as mm
    from nemo_dapo.policy.megatron.cpu_compat import enable_cpu_compat
    from nemo_dapo.policy.megatron.vocab import vocab_parallel_stats

    enable_cpu_compat()
    mm.init_distributed(rank, world_size, rendezvous, Parallelism(tensor=world_size), seed=1)
    logits, labels = sample()
    width = PADDED // world_size
    shard = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
    log_probs, entropy = vocab_parallel_stats(shard, labels, TEMPERATURE, VOCAB)
    (log_probs.sum() + 0.3 * entropy.sum()).backward()
    _, metric_only = vocab_parallel_stats(shard, labels, TEMPERATURE, VOCAB, entropy_grad=False)
    torch.save(
        {
            "log_probs": log_probs.detach(),
            "entropy": entropy.detach(),
            "grad": shard.grad,
            "metric_has_graph": metric_only.requires_grad,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


def test_two_vocabulary_shards_give_the_gathered_log_probs_entropy_and_gradients(tmp_path):
    from nemo_dapo.algo.logprob import entropy_from_logits, log_probs_from_logits

    spawn(run_rank, 2, str(tmp_path / "rdv"), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    logits, labels = sample()
    whole = logits.clone().requires_grad_(True)
    expected_lp = log_probs_from_logits(whole[..., :VOCAB], labels, TEMPERATURE)
    expected_ent = entropy_from_logits(whole[..., :VOCAB], TEMPERATURE)
    (expected_lp.sum() + 0.3 * expected_ent.sum()).backward()
    for result in ranks:  # every rank ends with the whole rows' values
        assert torch.allclose(result["log_probs"], expected_lp.detach(), atol=1e-6)
        assert (result["entropy"] - expected_ent.detach()).abs().max() < 1e-5, (
            (result["entropy"] - expected_ent).abs().max()
        )
        assert not result["metric_has_graph"]
    grad = torch.cat([r["grad"] for r in ranks], dim=-1)
    assert torch.allclose(grad, whole.grad, atol=1e-6)
    assert grad[..., VOCAB:].abs().max() == 0  # the padding column takes no part
