"""The decoder's hidden states before each response token, each distinct prompt computed once.

A GRPO group is ``rollout.n`` rows with one prompt. Run row by row, the decoder computes that
prompt ``n`` times; on the SmolLM2 preset the prompts are ~85% of the tokens a step trains
(39-token prompts, answers of a few tokens). Here each distinct prompt of a micro-batch runs once,
keeping its keys and values (a Hugging Face ``DynamicCache``, with gradients), and every row's
response then runs on its prompt's cache. Attention sees the same keys and values as in the
row-by-row forward, so log-probs and gradients are the same up to float summation order; the
gradients of the rows sharing a prompt meet in its one computation.
"""

from __future__ import annotations

import torch

from nemo_dapo.policy.microbatch import MicroBatch, prompt_groups, shares_prompts


def distinct_prompts(micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(one row per distinct prompt, each row's index into those)``, or None when every prompt
    differs (nothing to share)."""
    inverse = prompt_groups(micro.tensors)
    rows, count = inverse.shape[0], int(inverse.max()) + 1
    if count == rows:
        return None
    first = torch.full((count,), rows, dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(rows), reduce="amin")
    return first, inverse


def hidden_before_responses(decoder: torch.nn.Module, micro: MicroBatch, share: bool) -> torch.Tensor:
    """``[rows, response width, hidden]``: the last decoder layer's output at each position whose next
    token is a response token (the last prompt position, then all response positions but the last),
    the input of the output layer. ``decoder`` is a transformers base model (``model.base_model``);
    with ``share``, each distinct prompt goes through it once (:func:`distinct_prompts`)."""
    width = micro.prompt_width
    ids, mask, positions = micro["input_ids"], micro["attention_mask"], micro["position_ids"]
    groups = distinct_prompts(micro) if shares_prompts(share, micro.routing is not None) else None
    if groups is None:
        return decoder(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state[:, width - 1 : -1]
    first, inverse = groups
    # one embedding lookup for both passes: the backward of each lookup fills a dense
    # [vocab, hidden] gradient (113 MB at SmolLM2's 49k vocabulary)
    embeds = decoder.get_input_embeddings()(ids)
    prompt = decoder(
        inputs_embeds=embeds[first, :width],
        attention_mask=mask[first, :width],
        position_ids=positions[first, :width],
        use_cache=True,
    )
    cache = prompt.past_key_values
    for layer in cache.layers:  # every row gets its prompt's keys and values (an indexed copy)
        layer.keys, layer.values = rows_of(layer.keys, inverse), rows_of(layer.values, inverse)
    responses = decoder(
        inputs_embeds=embeds[:, width:],
        attention_mask=mask,
        position_ids=positions[:, width:],
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state
    # prompts are left-padded: column width - 1 is every prompt's last real token
    return torch.cat([rows_of(prompt.last_hidden_state, inverse)[:, width - 1 :], responses[:, :-1]], dim=1)


def rows_of(prompts: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Each row's copy of its prompt's ``prompts[inverse[row]]``, by ``index_select``: its backward
    (``index_add_``) adds the rows' gradients in row order. Indexing (``prompts[inverse]``) would
    be the same copy, but its backward on a CPU adds fp32 gradients with atomic adds from several
    threads, in whichever order the threads reach them: two runs of the same seed then part in
    the last bits (docs/architecture.md, "Same seed, same numbers")."""
    return prompts.index_select(0, inverse)
