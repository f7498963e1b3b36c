"""Micro-batches by token budget: rows of similar length together, padding trimmed, rows put back."""

import torch

from nemo_dapo.policy.microbatch import micro_batches, place_rows, uniform_micro_batches


def batch_of(prompts: list[int], responses: list[int], prompt_width: int = 6, response_width: int = 12) -> dict:
    """Left-padded prompts and right-padded responses of the given real lengths (ids = row number + 1)."""
    rows = len(prompts)
    attention = torch.zeros(rows, prompt_width + response_width, dtype=torch.long)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        attention[row, prompt_width - p : prompt_width + r] = 1
    ids = (torch.arange(rows)[:, None] + 1) * attention
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
        "responses": ids[:, prompt_width:],
        "loss_mask": attention[:, prompt_width:],
    }


def test_rows_of_similar_length_share_a_micro_batch():
    """Lengths 4, 14, 5, 13, 6 with 30 tokens per micro-batch: the two long rows go together and the
    three short ones together (in batch order the first pair alone would already pad 4 up to 14)."""
    batch = batch_of([2, 4, 2, 4, 3], [2, 10, 3, 9, 3])
    micros = micro_batches(batch, 30)
    assert [m.rows.tolist() for m in micros] == [[1, 3], [4, 2, 0]]
    assert [tuple(m["input_ids"].shape) for m in micros] == [(2, 14), (3, 6)]  # 28 + 18 tokens, not 5 x 18
    for micro in micros:  # every row is the one it claims to be, its real tokens all kept
        for i, row in enumerate(micro.rows.tolist()):
            assert set(micro["input_ids"][i].unique().tolist()) <= {0, row + 1}
            assert micro["attention_mask"][i].sum() == batch["attention_mask"][row].sum()


def test_a_long_row_is_not_padded_together_with_short_ones():
    """One response ran to the limit (1 + 10 tokens), five stopped at 1 (1 + 1), 40 tokens per
    micro-batch: filling greedily would pad two short rows to 11 (3 x 11 + 3 x 2 = 39 tokens);
    the split leaves the long row alone (11 + 5 x 2 = 21) in as few micro-batches."""
    batch = batch_of([1] * 6, [10, 1, 1, 1, 1, 1])
    micros = micro_batches(batch, 40)
    assert [m.rows.tolist() for m in micros] == [[0], [1, 2, 3, 4, 5]]
    assert [tuple(m["input_ids"].shape) for m in micros] == [(1, 11), (5, 2)]


def test_padded_width_counts_the_longest_prompt_and_the_longest_response():
    """Rows (prompt, response) (5, 1) and (1, 5) are 6 tokens each but pad to 5 + 5 together:
    20 tokens, over a budget of 12, so they go apart."""
    micros = micro_batches(batch_of([5, 1], [1, 5]), 12)
    assert [tuple(m["input_ids"].shape) for m in micros] == [(1, 6), (1, 6)]
    # rows without a response still keep one response column: three of them are 3 x 4 > 9 tokens
    micros = micro_batches(batch_of([3, 3, 3], [0, 0, 0]), 9)
    assert [tuple(m["input_ids"].shape) for m in micros] == [(1, 4), (2, 4)]


def test_results_go_back_to_their_rows():
    batch = batch_of([2, 4, 2, 4, 3], [2, 10, 3, 9, 3])
    per_row = torch.arange(5.0)[:, None] + torch.arange(12.0) / 100  # a distinct value per row and column
    parts = [(m.rows, per_row[m.rows, : m["responses"].shape[1]]) for m in micro_batches(batch, 30)]
    placed = place_rows(batch["responses"].shape, parts)
    real = batch["loss_mask"].bool()
    assert torch.equal(placed[real], per_row[real])


def test_uniform_micro_batches_name_their_real_rows_only():
    batch = batch_of([2, 3, 2], [3, 4, 2])
    micros = uniform_micro_batches(batch, 16, multiple=2)
    assert len({tuple(m["input_ids"].shape) for m in micros}) == 1 and len(micros) % 2 == 0
    assert [row for m in micros for row in m.rows.tolist()] == [0, 1, 2]
    for micro in micros:  # filler rows after the real ones contribute no response token
        assert micro["loss_mask"][len(micro.rows) :].sum() == 0


def test_a_shared_prompt_counts_once_in_the_budget():
    """Two prompts of 5 tokens, 3 samples each with 2-token answers, 20 tokens per micro-batch: row
    by row, 7 tokens a row fit 2 rows (3 micro-batches); sharing, each prompt's 3 rows cost
    5 + 3 x 2 = 11 tokens, so each group forms one micro-batch (both together: 22 > 20)."""
    batch = batch_of([5] * 6, [2] * 6)
    batch["input_ids"][:, :6] = torch.tensor([7, 7, 7, 9, 9, 9])[:, None] * batch["attention_mask"][:, :6]
    assert len(micro_batches(batch, 20)) == 3
    micros = micro_batches(batch, 20, share_prompts=True)
    assert [m.rows.tolist() for m in micros] == [[0, 1, 2], [3, 4, 5]]
    assert len(micro_batches(dict(batch, routed_experts=torch.zeros(6, 18, 1, 1)), 20, share_prompts=True)) == 3
