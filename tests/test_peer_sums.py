"""The all-reduce folded into the kernels (`kernels/peer_sums.py`), with several sets of slots on
one device standing in for the ranks (Triton's interpreter on CPU, real kernels on a GPU).

A real rank's reader waits for slots its peers fill while it runs; here the other ranks' parts
are written into a stand-in's slots before its kernel runs, so no kernel waits. What must hold:
the sum is the rank-order fp32 sum of every rank's part, rounded as an all-reduce's output (so
equal to the unfolded kernels on that sum, bit for bit), a writer lands in its own slot of every
rank with -0.0 stored as +0.0, and a reader leaves its slots marked empty for the next step.
Real ranks on two GPUs: tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tinyoss.kernels.layer_ops_triton import norm_route_triton, rms_norm_triton
from tinyoss.kernels.moe_triton import combine_norm
from tinyoss.kernels.peer_sites import EMPTY_BITS, PartialSums
from tinyoss.kernels.peer_sums import local_sites, peer_push, sum_ranks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, MAX_TOKENS = 96, 4


def empty(slots: torch.Tensor) -> torch.Tensor:
    return slots.view(torch.int16) == EMPTY_BITS


def bits(x: torch.Tensor) -> torch.Tensor:
    """x's bits with -0.0 as +0.0, as a writer stores them."""
    b = x.view(torch.int16)
    return torch.where(b == EMPTY_BITS, torch.zeros_like(b), b)


def parts(ranks: int, tokens: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, H, generator=gen).to(DEVICE, torch.bfloat16)
            for _ in range(ranks)]


@triton.jit
def _round_rows(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n).to(out_ptr.dtype.element_ty),
             mask=i < n)


def rounded(x: torch.Tensor) -> torch.Tensor:
    """fp32 x to bf16 as the kernels round (Triton's interpreter truncates where torch rounds
    to nearest even; on a GPU both round to nearest even)."""
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    _round_rows[(triton.cdiv(x.numel(), 1024),)](x.contiguous(), out, x.numel(), BLOCK=1024)
    return out


@triton.jit
def _push_rows(push_ptr, x_ptr, H, RANKS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    peer_push(push_ptr, t, cols, ok, tl.load(x_ptr + t * H + cols, mask=ok), H, RANKS)


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_writer_lands_in_its_slot_of_every_rank(ranks):
    sites = local_sites(ranks, MAX_TOKENS, H, torch.bfloat16, DEVICE)
    rows = parts(1, 2, ranks)[0]
    rows[0, :5] = -0.0  # the empty mark: must arrive as +0.0
    me = ranks - 1
    _push_rows[(2,)](sites[me].push, rows, H, RANKS=ranks, BLOCK=triton.next_power_of_2(H))
    for site in sites:
        assert torch.equal(site.slots[me, :2].view(torch.int16), bits(rows))
        assert not empty(site.slots[me, :2]).any()
        others = [r for r in range(ranks) if r != me]
        assert empty(site.slots[others]).all() and empty(site.slots[me, 2:]).all()


@pytest.mark.parametrize("ranks,tokens", [(2, 1), (2, 2), (3, 2)])
def test_norm_route_sums_the_ranks_slots(ranks, tokens):
    """Twice in a row through the same slots: the first launch must leave them empty."""
    gen = torch.Generator().manual_seed(tokens)
    experts = 32
    res = torch.randn(tokens, H, generator=gen).to(DEVICE, torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(H, generator=gen)).to(DEVICE)
    rw = (torch.randn(experts, H, generator=gen) / H**0.5).to(DEVICE, torch.bfloat16)
    rb = (0.1 * torch.randn(experts, generator=gen)).to(DEVICE, torch.bfloat16)
    site = local_sites(ranks, MAX_TOKENS, H, torch.bfloat16, DEVICE)[0]
    for step in range(2):
        ps = parts(ranks, tokens, 10 * step + ranks)
        for r, p in enumerate(ps):
            site.slots[r, :tokens] = p
        want = norm_route_triton(rounded(sum_ranks(ps)), res, nw, 1e-5, rw, rb, 4)
        got = norm_route_triton(PartialSums(site, tokens), res, nw, 1e-5, rw, rb, 4)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert empty(site.slots).all()


@pytest.mark.parametrize("ranks,tokens", [(2, 1), (2, 3), (3, 2)])
def test_combine_pushes_its_part_and_sums_every_rank(ranks, tokens):
    """Each rank in turn: its part (the top-k rows summed, pairs another rank holds skipped)
    reaches every rank's slot, and its output is the norm of the rank-order sum plus the
    residual, as `combine_norm` without peers gives for that sum; its slots end empty."""
    gen = torch.Generator().manual_seed(ranks * 10 + tokens)
    k = 4
    ys = [torch.randn(tokens * k, H, generator=gen).to(DEVICE, torch.bfloat16)
          for _ in range(ranks)]
    ids = [torch.randint(-1, 8, (tokens, k), generator=gen, dtype=torch.int32).to(DEVICE)
           for _ in range(ranks)]
    res = torch.randn(tokens, H, generator=gen).to(DEVICE, torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(H, generator=gen)).to(DEVICE)

    def part(r: int) -> torch.Tensor:
        held = (ids[r] >= 0).view(tokens, k, 1)
        rows = torch.where(held, ys[r].view(tokens, k, H).float(), 0.0)
        tot = torch.zeros(tokens, H, device=DEVICE)
        for j in range(k):  # slot order, as the kernel adds
            tot += rows[:, j]
        return rounded(tot)

    ps = [part(r) for r in range(ranks)]
    want_norm, want_res = rms_norm_triton(rounded(sum_ranks(ps)), nw, 1e-5,
                                          res.clone())
    for me in range(ranks):
        sites = local_sites(ranks, MAX_TOKENS, H, torch.bfloat16, DEVICE)
        for r in range(ranks):
            if r != me:
                sites[me].slots[r, :tokens] = ps[r]  # arrived before this rank's launch
        normed, new_res = combine_norm(ys[me], ids[me], res.clone(), nw, 1e-5, sites[me])
        assert torch.equal(new_res, want_res) and torch.equal(normed, want_norm)
        assert empty(sites[me].slots).all()
        for q in range(ranks):
            if q != me:
                assert torch.equal(sites[q].slots[me, :tokens].view(torch.int16), bits(ps[me]))


def test_slots_hold_only_16_bit_floats():
    from tinyoss.kernels.peer_sums import empty_slots

    with pytest.raises(ValueError, match="bf16 or fp16"):
        empty_slots(2, 1, H, torch.float32, DEVICE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("tokens", [1, 2])
def test_the_streaming_gemv_writes_every_ranks_slot(tokens):
    """The o_proj GEMV's writer: the rows it would return (with -0.0 as +0.0) in its slot of
    every stand-in rank, and nothing else written."""
    from tinyoss.kernels.moe_gemv_mma import load

    mma, why = load(torch.cuda.get_device_capability())
    if mma is None:
        pytest.skip(why)
    gen = torch.Generator().manual_seed(tokens)
    n, k = 2880, 2048  # gpt-oss's hidden by a TP 2 rank's 32 heads of 64
    x = torch.randn(tokens, k, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to("cuda", torch.bfloat16)
    w[:7] = 0  # rows that sum to zero
    bias = torch.randn(n, generator=gen).to("cuda", torch.bfloat16)
    bias[:7] = 0
    want = mma.stream_linear(x, w, bias)
    sites = local_sites(3, MAX_TOKENS, n, torch.bfloat16, "cuda")
    assert mma.push_linear(x, w, bias, sites[1].push)
    for site in sites:
        assert torch.equal(site.slots[1, :tokens].view(torch.int16), bits(want))
        assert empty(site.slots[[0, 2]]).all() and empty(site.slots[1, tokens:]).all()
    assert not mma.push_linear(x[:, :-8].contiguous(), w, bias, sites[1].push)  # K differs
