"""Chunked log-probs and entropy: equal to the whole-logits computation, gradients included, and
never holding a micro-batch's ``[tokens, vocab]`` logits for the backward."""

import functools

import pytest
import torch

from bench.logprob_memory import saved_bytes  # the bench measures with the counter this test checks
from nemo_dapo.algo.logprob import (
    chunk_tokens_for,
    chunked_token_stats,
    entropy_from_logits,
    log_probs_from_logits,
    token_stats,
)

TOKENS, HIDDEN, VOCAB, TEMPERATURE = 37, 16, 301, 0.7


def problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(2, TOKENS, HIDDEN, generator=gen) * 2).requires_grad_(True)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen))
    labels = torch.randint(0, VOCAB, (2, TOKENS), generator=gen)
    return hidden, head, labels


def loss_and_grads(chunk_tokens: int | None):
    """Values and gradients (w.r.t. hidden and the output layer) of a loss using both outputs."""
    hidden, head, labels = problem()
    stats = functools.partial(token_stats, temperature=TEMPERATURE)
    if chunk_tokens is None:
        log_probs, entropy = stats(head(hidden), labels)
    else:
        log_probs, entropy = chunked_token_stats(hidden, labels, head, stats, chunk_tokens)
    (log_probs * torch.linspace(-1, 1, TOKENS)).sum().add(0.3 * entropy.sum()).backward()
    return log_probs.detach(), entropy.detach(), hidden.grad, head.weight.grad


@pytest.mark.parametrize("chunk_tokens", [1, 5, 37, 74, 1000])  # 5 does not divide 74 positions
def test_chunked_equals_whole_logits_values_and_gradients(chunk_tokens):
    expected = loss_and_grads(None)
    got = loss_and_grads(chunk_tokens)
    for name, want, have in zip(("log_probs", "entropy", "d hidden", "d weight"), expected, got):
        assert torch.allclose(have, want, atol=1e-4, rtol=1e-5), (name, (have - want).abs().max())


@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
def test_one_log_softmax_equals_the_definitions_with_gradients(temperature):
    hidden, head, labels = problem()
    results = []
    for stats in (
        lambda z: (log_probs_from_logits(z, labels, temperature), entropy_from_logits(z, temperature)),
        lambda z: token_stats(z, labels, temperature),
    ):
        logits = head(hidden).detach().requires_grad_(True)
        log_probs, entropy = stats(logits)
        (log_probs * torch.linspace(-1, 1, TOKENS)).sum().add(0.3 * entropy.sum()).backward()
        results.append((log_probs.detach(), entropy.detach(), logits.grad))
    for name, want, have in zip(("log_probs", "entropy", "d logits"), *results):
        assert torch.allclose(have, want, atol=1e-5, rtol=1e-5), (name, (have - want).abs().max())


def test_a_metric_only_entropy_keeps_no_graph_and_leaves_the_log_prob_gradient():
    hidden, head, labels = problem()
    grads = []
    for entropy_grad in (True, False):
        logits = head(hidden).detach().requires_grad_(True)
        log_probs, entropy = token_stats(logits, labels, TEMPERATURE, entropy_grad=entropy_grad)
        assert entropy.requires_grad == entropy_grad
        log_probs.sum().backward()
        grads.append(logits.grad)
    assert torch.equal(grads[0], grads[1])


def test_without_gradients_no_graph_is_kept():
    hidden, head, labels = problem()
    with torch.no_grad():
        log_probs, entropy = chunked_token_stats(hidden, labels, head, token_stats, 8)
    assert not log_probs.requires_grad and not entropy.requires_grad
    assert torch.allclose(log_probs, token_stats(head(hidden), labels)[0].detach(), atol=1e-5)


def test_the_backward_keeps_no_full_logits():
    hidden, head, labels = problem()
    logits_bytes = 2 * TOKENS * VOCAB * 4
    whole = saved_bytes(lambda: token_stats(head(hidden), labels))
    chunked = saved_bytes(lambda: chunked_token_stats(hidden, labels, head, token_stats, 8))
    assert whole >= logits_bytes  # the unchunked computation keeps the logits (or their softmax)
    assert chunked < logits_bytes / 4, (chunked, logits_bytes)  # inputs and output layer only


def test_chunk_size_follows_the_vocabulary():
    assert chunk_tokens_for(49152) == 682  # SmolLM2: 128 MiB of fp32 logits per chunk
    assert chunk_tokens_for(151936) == 220  # Qwen2.5
    assert chunk_tokens_for(10**12) == 1


def test_no_positions_still_back_propagates_to_the_output_layer():
    hidden, head, labels = problem()
    log_probs, entropy = chunked_token_stats(hidden[:, :0], labels[:, :0], head, token_stats, 8)
    assert log_probs.shape == (2, 0) and log_probs.requires_grad  # a rank holding no response token
    (log_probs.sum() + entropy.sum()).backward()
    assert head.weight.grad is not None and head.weight.grad.abs().max() == 0
