"""Sequence packing bookkeeping (pure torch): bins, packed tokens, boundaries, response positions."""

import torch
from test_microbatch import batch_of

from nemo_dapo.policy.packing import (
    context_parallel_share,
    first_fit_decreasing,
    pack_rows,
    packed_micro_batches,
    response_positions,
    scatter_rows,
    uniform_packs,
)


def padded_batch() -> dict:
    """Six rows of varied real lengths (3 to 15 tokens), distinct random token ids."""
    batch = batch_of([2, 6, 1, 4, 3, 5], [9, 2, 2, 11, 5, 7])
    ids = torch.randint(1, 1000, batch["input_ids"].shape, generator=torch.Generator().manual_seed(0))
    ids = ids * batch["attention_mask"]
    return {**batch, "input_ids": ids, "responses": ids[:, 6:]}


def test_first_fit_decreasing_fills_earlier_bins_first():
    # longest first: 7 -> bin 0, 5 -> bin 1, 4 -> bin 1 (9), 3 -> bin 0 (10), 2 -> bin 2, 2 -> bin 2
    assert first_fit_decreasing([2, 7, 4, 3, 5, 2], 10) == [[1, 3], [4, 2], [0, 5]]
    assert first_fit_decreasing([12, 3], 10) == [[0], [1]]  # longer than the budget: alone


def test_pack_lays_real_tokens_end_to_end_and_points_at_each_response_token():
    batch = padded_batch()
    rows = [2, 0, 3]
    packed = pack_rows(batch, rows, multiple=4)
    real = batch["attention_mask"][rows].bool()
    lengths = real.sum(1)
    total = int(lengths.sum())
    width = packed.pack.width
    assert width % 4 == 0 and total <= width < total + 4
    assert torch.equal(packed.pack.ids[0, :total], batch["input_ids"][rows][real])
    assert torch.equal(packed.pack.cu_seqlens[: len(rows) + 1], torch.cat([torch.zeros(1), lengths.cumsum(0)]).int())
    assert packed.pack.cu_seqlens[-1] == width
    for k, length in enumerate(lengths.tolist()):
        start = int(packed.pack.cu_seqlens[k])
        assert torch.equal(packed.pack.positions[0, start : start + length], torch.arange(length))
    assert torch.equal(packed.rows, torch.tensor(rows))
    # the logits at response_index predict the next packed token: the row's response token
    response_real = packed["attention_mask"][:, packed.prompt_width :].bool()
    predicted = packed.pack.ids[0, packed.pack.response_index + 1]
    assert torch.equal(predicted[response_real], packed["responses"][response_real])


def test_response_positions_and_scatter_put_each_response_token_in_its_row():
    batch = padded_batch()
    packed = pack_rows(batch, [1, 4])
    logits = torch.randn(1, packed.pack.width, 11, requires_grad=True)
    positions, labels, real = response_positions(packed)
    assert positions.shape == (int(real.sum()),) and torch.equal(labels, packed["responses"][real])
    values = scatter_rows(logits[0, positions, 0], real)
    assert values.shape == packed["responses"].shape and (values[~real] == 0).all()
    assert torch.equal(values[real], logits[0, packed.pack.response_index[real], 0])
    values.sum().backward()
    assert logits.grad[..., 0].sum() == real.sum() and logits.grad[..., 1:].abs().sum() == 0


def test_packs_respect_the_budget_and_hold_every_row_once():
    batch = padded_batch()
    packs = packed_micro_batches(batch, max_tokens=16)
    rows = torch.cat([packed.rows for packed in packs]).sort().values
    assert torch.equal(rows, torch.arange(batch["input_ids"].shape[0]))
    lengths = batch["attention_mask"].sum(1)
    assert all(lengths[packed.rows].sum() <= 16 or len(packed.rows) == 1 for packed in packs)
    assert sum(packed.pack.width for packed in packs) == lengths.sum()  # no padding at all


def test_uniform_packs_share_one_width_and_fill_up_with_empty_packs():
    batch = padded_batch()
    packs = uniform_packs(batch, max_tokens=16, multiple=2, count_multiple=3)  # 4 packs + 2 fillers
    assert len(packs) == 6 and len({packed.pack.width for packed in packs}) == 1
    assert packs[0].pack.width % 2 == 0
    fillers = [packed for packed in packs if len(packed.rows) == 0]
    assert fillers and all(packed["loss_mask"].sum() == 0 for packed in fillers)
    real_rows = torch.cat([packed.rows for packed in packs]).sort().values
    assert torch.equal(real_rows, torch.arange(batch["input_ids"].shape[0]))


def test_context_parallel_shares_split_every_row_into_balanced_chunks():
    """CP=2: rows padded to multiples of 4; rank r holds chunks r and 3 - r of every row, together
    the ranks hold each position once, and a share's ``local`` inverts its ``index``."""
    batch = padded_batch()
    packed = pack_rows(batch, [0, 2, 5], multiple=8, segment_multiple=4)
    cu_seqlens = packed.pack.cu_seqlens.tolist()
    assert all((end - start) % 4 == 0 for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]))
    shares = [context_parallel_share(packed, 2, rank) for rank in range(2)]
    assert torch.equal(
        torch.cat([share.pack.share.index for share in shares]).sort().values, torch.arange(packed.pack.width)
    )
    start, end = cu_seqlens[0], cu_seqlens[1]
    chunk = (end - start) // 4
    assert torch.equal(
        shares[0].pack.share.index[: 2 * chunk], torch.cat([torch.arange(0, chunk), torch.arange(3 * chunk, 4 * chunk)])
    )
    assert torch.equal(shares[1].pack.share.index[: 2 * chunk], torch.arange(chunk, 3 * chunk))
    for share in shares:
        assert torch.equal(share.pack.share.local[share.pack.share.index], torch.arange(len(share.pack.share.index)))
        assert (share.pack.share.local >= 0).sum() == packed.pack.width // 2
