"""The one-pass greedy pick (argmax and finite check) against its torch twin and torch's argmax
(interpreter on CPU, real on GPU)."""

import pytest
import torch

from tinyoss.kernels import greedy_pick_torch
from tinyoss.kernels import greedy_triton as gt
from tinyoss.kernels.greedy_triton import greedy_pick_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INF, NAN = float("inf"), float("nan")


def _check(logits: torch.Tensor) -> torch.Tensor:
    got = greedy_pick_triton(logits)
    want = greedy_pick_torch(logits)
    assert got.shape == (2, logits.shape[0]) and got.dtype == torch.int64
    assert torch.equal(got, want), (got, want)
    return got


@pytest.mark.parametrize("rows,vocab", [(1, 5000), (3, 2049), (2, 1024), (300, 700)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows_match_torch_argmax(rows, vocab, dtype):
    """Several splits a row (1 to 3 rows) and one (300 rows); V off the 1024-logit rounds."""
    torch.manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab, device=DEVICE).to(dtype)
    got = _check(logits)
    assert torch.equal(got[0], logits.argmax(-1)) and got[1].eq(1).all()


def test_splits_cover_the_row_in_whole_rounds():
    for rows, vocab in [(1, 201088), (8, 201088), (64, 201088), (300, 700), (1, 1)]:
        chunk, splits = gt.splits_for(rows, vocab)
        assert chunk % gt.BLOCK == 0 and (splits - 1) * chunk < vocab <= splits * chunk
        assert rows * splits <= max(2 * gt.TARGET_PROGRAMS, rows)
    assert gt.splits_for(1, 201088)[1] > 64  # batch 1 spreads over the GPU


def test_ties_take_the_first_index_across_lanes_and_splits():
    """The largest value at several places: in two splits, in two lanes of one round, in one
    lane in two rounds, at the very end: the first wins, as torch's argmax."""
    v = 5000  # 5 splits of 1024 at one row
    logits = torch.randn(6, v, device=DEVICE)
    for row, places in enumerate([(4000, 1500), (1030, 1029), (2100, 3124), (4999,),
                                  (0, 4999), (1024, 2048, 4096)]):
        logits[row, list(places)] = 9.0
    got = _check(logits[:1])  # one row: split across programs
    assert got[0].item() == 1500
    for row in range(6):
        got = _check(logits[row:row + 1])
        assert got[0].item() == logits[row].argmax().item()


def test_non_finite_rows_are_flagged_and_still_give_a_valid_id():
    v = 3000
    logits = torch.randn(6, v, device=DEVICE)
    logits[0, 17] = NAN  # a NaN is never the largest
    logits[1, 2500] = INF  # +inf is the largest, and not finite
    logits[2, 5] = -INF  # -inf is not finite either
    logits[3] = NAN  # a whole row of NaN: id 0
    logits[4] = -INF  # a whole row of -inf: id 0, as torch
    for row in range(6):
        got = _check(logits[row:row + 1])  # several splits
        assert got[1].item() == (1 if row == 5 else 0)
        assert 0 <= got[0].item() < v
    got = _check(logits)
    assert got[0, 1] == 2500 and got[0, 3] == 0 and got[0, 4] == 0
    assert got[0, 0] == logits[0].nan_to_num(nan=-INF).argmax()
    assert got[1].tolist() == [0, 0, 0, 0, 0, 1]


def test_the_tickets_reset_so_calls_repeat():
    """Each row's last program resets its ticket: the same call twice, and a larger batch after
    a smaller one, give the same picks."""
    logits = torch.randn(4, 4100, device=DEVICE)
    first = _check(logits[:1])
    assert torch.equal(_check(logits[:1]), first)
    _check(logits)
    assert torch.equal(_check(logits[:1]), first)


def test_rows_must_be_contiguous():
    with pytest.raises(ValueError, match="contiguous rows"):
        greedy_pick_triton(torch.randn(8, 4, device=DEVICE).t())


def test_batch_sizes_share_a_few_chunk_sizes():
    """Chunk and split counts are constexprs: every batch size of one power-of-two bucket takes
    the same, so serving meets at most a handful of variants to compile."""
    seen = {gt.splits_for(rows, 201088) for rows in range(1, 513)}
    assert len(seen) <= 10
    assert gt.splits_for(32, 201088) == gt.splits_for(63, 201088)
