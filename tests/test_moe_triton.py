"""Triton MoE (pair GEMV and grouped GEMMs) against the `moe_torch` reference.

On CPU the kernels run in the Triton interpreter with fp32 operands and agree with the reference
to fp32 rounding (~3e-7 measured; TOL 1e-5). On a GPU the activations are bf16 and TOL is 1e-2.
Every workspace and output starts as NaN, so a row nobody wrote shows; inputs are fresh random
draws for every case, sized so that some gate/up pre-activations pass the clamp limit 7.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tinyoss.kernels import moe_triton as mt
from tinyoss.kernels.moe_torch import ExpertWeights, moe_torch
from tinyoss.model import mxfp4

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = 1e-2 if CUDA else 1e-5  # ||out - ref|| / ||ref||
E, H, I, TOPK = 8, 96, 64, 4  # H != I catches swapped dimensions; K tiles of 64 leave H ragged
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# Tiles small enough for several row blocks and K tiles at these shapes. On a GPU the tensor
# cores need K tiles >= 128 (eight dots of K/8 >= 16): one ragged tile here.
PREFILL = mt.PrefillConfig(block_m=16, block_n1=64, block_n2=32, block_k=128 if CUDA else 64,
                           num_warps=4)


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Workspaces and outputs start as NaN: an unwritten row cannot pass."""
    monkeypatch.setattr(mt, "_empty", _poisoned)


def small_weights(gen: torch.Generator, e: int = E, h: int = H, i: int = I) -> ExpertWeights:
    """Float experts quantized to MXFP4 (real code statistics), biases of the same spread."""
    gate_up = torch.randn(e, 2 * i, h, generator=gen) * 0.4
    down = torch.randn(e, h, i, generator=gen) * 0.2
    gb, gs = mxfp4.quantize(gate_up)
    db, ds = mxfp4.quantize(down)
    w = ExpertWeights(
        gb, gs, torch.randn(e, 2 * i, generator=gen), db, ds, torch.randn(e, h, generator=gen)
    )
    return ExpertWeights(
        *(
            t.to(DEVICE)
            for t in (
                w.gate_up_blocks,
                w.gate_up_scales,
                w.gate_up_bias,
                w.down_blocks,
                w.down_scales,
                w.down_bias,
            )
        )
    )


def routing(
    gen: torch.Generator, t: int, e: int = E, allowed: int | None = None, always: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] fp32, ids [T, K] int64): distinct experts per token, drawn from the first
    `allowed` experts; `always` is in every token's top-k (at a random position)."""
    pool = allowed or e
    rows = []
    for _ in range(t):
        ids = torch.randperm(pool, generator=gen)[:TOPK]
        if always is not None and always not in ids:
            ids[torch.randint(TOPK, (1,), generator=gen)] = always
        rows.append(ids)
    ids = torch.stack(rows)
    weights = torch.softmax(torch.randn(t, TOPK, generator=gen), dim=-1)
    return weights.to(DEVICE), ids.to(DEVICE)


def inputs(
    seed: int, t: int, **route
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ExpertWeights]:
    gen = torch.Generator().manual_seed(seed)
    w = small_weights(gen)
    x = (torch.randn(t, H, generator=gen) * 2).to(DEVICE, DTYPE)
    weights, ids = routing(gen, t, **route)
    return x, weights, ids, w


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), "unwritten or NaN output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def preactivation_max(x: torch.Tensor, ids: torch.Tensor, w: ExpertWeights) -> float:
    """Largest |gate/up| pre-activation the case produces (to prove the clamp is exercised)."""
    out = 0.0
    for e in ids.unique().tolist():
        w1 = mxfp4.dequantize(w.gate_up_blocks[e], w.gate_up_scales[e])
        out = max(out, (x.float() @ w1.T + w.gate_up_bias[e].float()).abs().max().item())
    return out


GEMV = mt.GemvConfig(block_n1=16, block_n2=16, block_k=64 if not CUDA else 512)


@pytest.mark.parametrize("t", [1, 2, 3])
def test_pair_gemv(t):
    """Each (token, expert) pair on its own programs; H = 96 leaves a ragged K tile."""
    x, weights, ids, w = inputs(200 + t, t)
    out = torch.full((t, H), float("nan"), dtype=DTYPE, device=DEVICE)
    got = mt.moe_gemv(x, weights, ids, w, GEMV, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert rel_err(out, moe_torch(x, weights, ids, w)) < TOL
    assert preactivation_max(x, ids, w) > 7.0


def test_pair_gemv_bf16_activations():
    x, weights, ids, w = inputs(210, 2)
    x = x.to(torch.bfloat16)
    assert rel_err(mt.moe_gemv(x, weights, ids, w, GEMV), moe_torch(x, weights, ids, w)) < 1e-2


def test_prefill():
    x, weights, ids, w = inputs(7, 40)
    out = mt.moe_prefill(x, weights, ids, w, PREFILL)
    assert rel_err(out, moe_torch(x, weights, ids, w)) < TOL


def test_prefill_all_tokens_share_one_expert():
    """Expert 3 in all 40 tokens' top-k: its rows span several 16-row tiles."""
    x, weights, ids, w = inputs(22, 40, always=3)
    assert (
        rel_err(mt.moe_prefill(x, weights, ids, w, PREFILL), moe_torch(x, weights, ids, w))
        < TOL
    )


def test_some_experts_unused():
    """Only experts 0-3 picked (all four by every token): the others have no rows or tiles."""
    x, weights, ids, w = inputs(31, 40, allowed=TOPK)
    assert ids.unique().numel() == TOPK
    assert (
        rel_err(mt.moe_prefill(x, weights, ids, w, PREFILL), moe_torch(x, weights, ids, w))
        < TOL
    )
    x, weights, ids, w = inputs(32, 2, allowed=TOPK)
    assert rel_err(mt.moe_gemv(x, weights, ids, w, GEMV), moe_torch(x, weights, ids, w)) < TOL


@pytest.mark.parametrize("t", [1, mt.GEMV_MAX_TOKENS, mt.GEMV_MAX_TOKENS + 1, 40])
def test_moe_triton_default_configs(t):
    x, weights, ids, w = inputs(41 + t, t)
    assert rel_err(mt.moe_triton(x, weights, ids, w), moe_torch(x, weights, ids, w)) < TOL


def test_rejects_bad_tiles():
    x, weights, ids, w = inputs(51, 1)
    with pytest.raises(ValueError, match="row tiles must be even"):
        mt.moe_prefill(x, weights, ids, w, mt.PrefillConfig(block_n1=63))
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        mt.moe_gemv(x, weights, ids, w, mt.GemvConfig(block_k=96))
    with pytest.raises(ValueError):
        mt.moe_gemv(x, weights, ids, w, out=torch.empty(2, H, dtype=DTYPE, device=DEVICE))


def held_elsewhere(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """ids with about half the pairs set to -1, as expert parallelism hands a rank the pairs
    whose experts another rank holds; with several tokens, all of token 0's."""
    gen = torch.Generator().manual_seed(seed)
    away = torch.rand(ids.shape, generator=gen) < 0.5
    away[0, 0] = True
    away[-1, -1] = False
    if ids.shape[0] > 1:
        away[0] = True
    return torch.where(away.to(ids.device), -1, ids)


@pytest.mark.parametrize("t", [1, 3, mt.GEMV_MAX_TOKENS + 1, 40])
def test_pairs_held_by_another_rank_add_nothing(t):
    """Expert parallelism: a pair of expert id -1 reads no expert and adds nothing, on the pair
    GEMV (t <= 8) and the grouped GEMMs, and in the combine fused with the next norm; a token
    whose pairs are all elsewhere gets exactly 0. Workspaces start as NaN, so a combine that
    read a skipped pair's row would show."""
    from tinyoss.kernels.layer_ops_triton import rms_norm_triton

    x, weights, ids, w = inputs(500 + t, t)
    ids = held_elsewhere(ids, t)
    away = ids.reshape(-1) < 0
    pairs = (mt._gemv_pairs(x, weights, ids, w, GEMV) if t <= mt.GEMV_MAX_TOKENS
             else mt._prefill_pairs(x, weights, ids, w, PREFILL))
    assert pairs[away].isnan().all() and not pairs[~away].isnan().any()  # skipped, unwritten
    want = moe_torch(x, weights, ids, w)
    got = mt.moe_triton(x, weights, ids, w)
    assert rel_err(got, want) < TOL
    if t > 1:
        assert torch.equal(got[0], torch.zeros_like(got[0]))
    gen = torch.Generator().manual_seed(t)
    residual = (torch.randn(t, H, generator=gen) * 3).to(DEVICE, DTYPE)
    norm_w = (torch.rand(H, generator=gen) + 0.5).to(DEVICE)
    want_norm, want_res = rms_norm_triton(got, norm_w, 1e-5, residual.clone())
    normed, res = mt.moe_norm_triton(x, weights, ids, w, residual.clone(), norm_w, 1e-5)
    assert torch.equal(res, want_res) and torch.equal(normed, want_norm)


# ------------------------------------------------------------------------------------------------
# GPU only: gpt-oss-20b shapes (H = I = 2880, E = 32, top-4), bf16 activations


def big_case(seed: int, t: int, i: int = 2880
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ExpertWeights]:
    """20b-shaped random experts made on the GPU: uniform E2M1 codes, scales giving weights of
    ~0.1 (gate_up: pre-activations of std ~5, past the clamp) and ~0.03 (down); `i` the
    intermediate size (a tensor-parallel rank's share)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    e, h = 32, 2880

    def codes(shape: tuple[int, ...], exponent: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(0, 256, shape, generator=gen, device=DEVICE, dtype=torch.uint8)
        scales = torch.randint(
            exponent - 1, exponent + 2, shape[:-1], generator=gen, device=DEVICE, dtype=torch.int32
        ).to(torch.uint8)
        return blocks, scales

    gb, gs = codes((e, 2 * i, h // 32, 16), 127 + round(math.log2(0.1 / 2.93)))
    db, ds = codes((e, h, i // 32, 16), 127 + round(math.log2(0.03 / 2.93)))
    gate_up_bias = torch.randn(e, 2 * i, generator=gen, device=DEVICE).to(DTYPE)
    down_bias = torch.randn(e, h, generator=gen, device=DEVICE).to(DTYPE)
    w = ExpertWeights(gb, gs, gate_up_bias, db, ds, down_bias)
    x = torch.randn(t, h, generator=gen, device=DEVICE).to(DTYPE)
    logits = torch.randn(t, e, generator=gen, device=DEVICE)
    top, ids = logits.topk(TOPK, dim=-1)
    return x, torch.softmax(top, dim=-1), ids, w


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("t", [1, 2, 8, 32, 512])
def test_gpt_oss_20b_shapes(t):
    x, weights, ids, w = big_case(t, t)
    assert rel_err(mt.moe_triton(x, weights, ids, w), moe_torch(x, weights, ids, w)) < TOL


@gpu
@pytest.mark.parametrize("t", [4, 24])
def test_captures_in_cuda_graph(t):
    """Neither path syncs with the host: each captures, and replays on new inputs."""
    x, weights, ids, w = inputs(81, t)
    mt.moe_triton(x, weights, ids, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mt.moe_triton(x, weights, ids, w)
    x2, weights2, ids2, _ = inputs(82, t)
    x.copy_(x2)
    weights.copy_(weights2)
    ids.copy_(ids2)
    graph.replay()
    assert rel_err(out, moe_torch(x, weights, ids, w)) < TOL


@pytest.mark.parametrize("t", [1, 3, 12])
def test_moe_norm_is_moe_then_add_rms_norm(t):
    """The combine fused with the residual add and the next RMSNorm: the same bits as
    `moe_triton` then `rms_norm_triton` (pair GEMV at T <= 8, grouped GEMMs above), the new
    residual written over the old."""
    from tinyoss.kernels.layer_ops_triton import rms_norm_triton

    x, weights, ids, w = inputs(400 + t, t)
    gen = torch.Generator().manual_seed(t)
    residual = (torch.randn(t, H, generator=gen) * 3).to(DEVICE, DTYPE)
    norm_w = (torch.rand(H, generator=gen) + 0.5).to(DEVICE)
    gemv = GEMV if t <= mt.GEMV_MAX_TOKENS else None
    moe = mt.moe_gemv(x, weights, ids, w, GEMV) if gemv else mt.moe_prefill(x, weights, ids, w)
    want, want_res = rms_norm_triton(moe, norm_w, 1e-5, residual.clone())
    res = residual.clone()
    got, got_res = mt.moe_norm_triton(x, weights, ids, w, res, norm_w, 1e-5, gemv=gemv)
    assert got_res is res and torch.equal(got_res, want_res) and torch.equal(got, want)
    assert not got.isnan().any()
    with pytest.raises(ValueError, match="residual must be contiguous"):
        mt.moe_norm_triton(x, weights, ids, w, residual.T, norm_w, 1e-5)


# ------------------------------------------------------------------------------------------------
# GPU only: the tensor-core pair GEMV (moe_gemv_mma, Hopper, built with nvcc)


@gpu
@pytest.mark.parametrize("t,scale", [(1, 1.0), (2, 1.0), (3, 1.0), (8, 1.0), (4, 3e4),
                                     (4, 1e-6)])
def test_mma_gemv_matches_gluon(t, scale, mma):
    """Each pair's fp32 output equals the Gluon kernel's to ~2e-7 (bound 1e-5), also for
    activations far below 1 and past fp16's range (staged times a power of two), with each tile
    the library picks by pairs (4: t = 1, 5-8: t = 2, more: gate_up streamed through shared
    memory). At x * 3e4 the pre-activations reach ~1e5 and both
    kernels part from `moe_torch` by ~1e-4 (measured: 1.2e-4 this one, 1.5e-4 Gluon), so there
    the bound is 1e-4. At 1 token down is the resident kernel launched early behind gate_up."""
    x, weights, ids, w = big_case(600 + t, t)
    x = (x.float() * scale).to(DTYPE)
    got = mt._gemv_pairs(x, weights, ids, w, None, mma)
    want = mt._gemv_pairs(x, weights, ids, w, None)
    assert rel_err(got, want) < (1e-5 if scale <= 1 else 1e-4)
    assert not torch.equal(got, want)  # the tensor cores ran: their sums round differently
    assert rel_err(mt.moe_triton(x, weights, ids, w, mma=mma), moe_torch(x, weights, ids, w)) < TOL


@gpu
@pytest.mark.parametrize("t", [1, 2, 3, 8])
@pytest.mark.parametrize("blocks", [45, 23, 12])
def test_mma_gemv_matches_gluon_on_a_rank_share(t, blocks, mma):
    """A tensor-parallel rank's experts (intermediate 32 * blocks: TP 2, 4, 8) on the tensor
    cores for both projections: down's K is no multiple of its tiles' load groups, so the pair
    kernel cuts the last one (t = 2: the few-pairs tile, K split in two; 3 and 8: the wide
    tile); gate_up's fewer rows take one-tile programs at 1-2 tokens (K in 2 or 5 parts); at 1
    token TP 2's down is the resident kernel launched early behind gate_up, TP 4's and 8's
    Gluon's. Each pair's output equals the Gluon kernel's within 1e-5, as at full size."""
    x, weights, ids, w = big_case(800 + 10 * t + blocks, t, i=32 * blocks)
    assert mma.supports_down(x, w)
    got = mt._gemv_pairs(x, weights, ids, w, None, mma)
    want = mt._gemv_pairs(x, weights, ids, w, None)
    assert rel_err(got, want) < 1e-5
    assert not torch.equal(got, want)  # the tensor cores ran: their sums round differently
    assert rel_err(mt.moe_triton(x, weights, ids, w, mma=mma), moe_torch(x, weights, ids, w)) < TOL


@gpu
@pytest.mark.parametrize("t,scale,crowded", [(9, 1.0, False), (16, 1.0, False),
                                             (48, 1.0, False), (64, 1.0, False),
                                             (12, 1.0, True), (40, 1.0, True),
                                             (12, 3e4, False), (12, 1e-6, False),
                                             (17, 3e4, False)])
def test_grouped_mma_matches_gluon(t, scale, crowded, mma):
    """Above GEMV_MAX_TOKENS the pairs grouped by expert (up to 8 an MMA's columns) give each
    pair's fp32 output as the Gluon pair GEMV does, to the pair kernels' bounds (1e-5; 1e-4 at
    x * 3e4), also with every token on the same 4 experts (2 and 5 groups an expert), with each
    column staged times its own power of two (x * 1e-6), and through the streamed down kernel
    (above 16 tokens)."""
    x, weights, ids, w = big_case(700 + t, t)
    x = (x.float() * scale).to(DTYPE)
    if crowded:
        ids = torch.arange(TOPK, device=DEVICE).repeat(t, 1)
    assert mt._grouped(x, w, mma)
    got = mt._grouped_pairs(x, weights, ids, w, mma)
    want = mt._gemv_pairs(x, weights, ids, w, None)
    assert rel_err(got, want) < (1e-5 if scale <= 1 else 1e-4)
    assert rel_err(mt.moe_triton(x, weights, ids, w, mma=mma), moe_torch(x, weights, ids, w)) < TOL


@gpu
@pytest.mark.parametrize("t", [9, 33, 64])
@pytest.mark.parametrize("blocks", [45, 23, 12])
def test_grouped_mma_matches_gluon_on_a_rank_share(t, blocks, mma):
    """A tensor-parallel rank's experts (intermediate 32 * blocks: TP 2, 4, 8) grouped by expert
    (9-64 tokens): gate_up's 2880, 1472 or 768 rows (1472: the 64-row programs), down's K in no
    whole load groups at 23 and 12 blocks (the last one cut) and in no whole stages of the
    streamed kernel (t = 33 and 64 take the register kernel). Each pair's output equals the
    Gluon kernel's within 1e-5, as at full size."""
    x, weights, ids, w = big_case(900 + 10 * t + blocks, t, i=32 * blocks)
    assert mt._grouped(x, w, mma)
    got = mt._grouped_pairs(x, weights, ids, w, mma)
    want = mt._gemv_pairs(x, weights, ids, w, None)
    assert rel_err(got, want) < 1e-5
    assert rel_err(mt.moe_triton(x, weights, ids, w, mma=mma), moe_torch(x, weights, ids, w)) < TOL


@gpu
@pytest.mark.parametrize("t", [1, 2, 8, 12, 40, 64])
def test_mma_kernels_skip_pairs_held_by_another_rank(t, mma):
    """Expert parallelism on the GPU's kernels: pairs of id -1 are skipped by the tensor-core
    pair kernels (gate_up from 1 token, streamed above 8 pairs; down from 2), the resident down
    launched early behind gate_up (1 token), the grouped kernels (12: register down, 40 and 64:
    streamed) and, without the tensor-core library, Gluon's pair GEMV and the grouped GEMMs."""
    x, weights, ids, w = big_case(1000 + t, t)
    ids = held_elsewhere(ids, t)
    away = ids.reshape(-1) < 0
    for pairs in ((mt._gemv_pairs(x, weights, ids, w, None, mma), mt._gemv_pairs(
            x, weights, ids, w, None)) if t <= mt.GEMV_MAX_TOKENS else (
            mt._grouped_pairs(x, weights, ids, w, mma), mt._prefill_pairs(
                x, weights, ids, w, None))):
        assert pairs[away].isnan().all() and not pairs[~away].isnan().any()  # skipped
    want = moe_torch(x, weights, ids, w)
    assert rel_err(mt.moe_triton(x, weights, ids, w, mma=mma), want) < TOL
    assert rel_err(mt.moe_triton(x, weights, ids, w), want) < TOL


@gpu
@pytest.mark.parametrize("pairs,experts", [(1, 32), (37, 32), (192, 4), (300, 128)])
def test_sort_pairs_is_a_stable_sort(pairs, experts, mma):
    """Sorted as a stable torch.sort, and cut into runs of up to 8 pairs of one expert (or of
    id -1), in order, the rest of the table -1."""
    # -1: pairs another rank holds (expert parallelism), sorted first like any id
    ids = torch.randint(-1, experts, (pairs,), device=DEVICE, dtype=torch.int32)
    sorted_ids, order, groups = mma.sort_pairs(ids, experts)
    want_ids, want_order = torch.sort(ids, stable=True)
    assert torch.equal(sorted_ids, want_ids) and torch.equal(order, want_order.to(torch.int32))
    want, runs = [], torch.unique_consecutive(want_ids.cpu(), return_counts=True)[1].tolist()
    start = 0
    for n in runs:
        want += [(start + j) | (min(8, n - j) << 16) for j in range(0, n, 8)]
        start += n
    assert len(groups) == min(pairs, pairs // 8 + experts + 1) >= len(want)
    assert groups.tolist() == want + [-1] * (len(groups) - len(want))
    with pytest.raises(ValueError, match="int32 ids"):
        mma.sort_pairs(ids.long(), experts)
    with pytest.raises(ValueError, match="4096"):
        mma.sort_pairs(torch.zeros(4097, device=DEVICE, dtype=torch.int32), experts)


@gpu
def test_grouped_mma_is_the_path_up_to_its_limit(mma):
    """The dispatch: pair kernels to GEMV_MAX_TOKENS, grouped to GROUPED_MAX_TOKENS, then the
    grouped GEMMs (which round their products to bf16: further from the fp32 pair outputs)."""
    from tinyoss.kernels.moe_gemv_mma import GROUPED_MAX_TOKENS

    x, weights, ids, w = big_case(800, GROUPED_MAX_TOKENS + 1)
    assert not mt._grouped(x[:mt.GEMV_MAX_TOKENS], w, mma)
    assert mt._grouped(x[:GROUPED_MAX_TOKENS], w, mma)
    assert not mt._grouped(x, w, mma)
    assert not mt._grouped(x[:GROUPED_MAX_TOKENS], w, None)


@gpu
@pytest.mark.parametrize("t,i", [(1, 2880), (1, 1440), (6, 2880), (20, 2880)])
def test_mma_gemv_captures_in_cuda_graph(t, i, mma):
    """Replays on new inputs, also at 1 token (one GPU's experts and TP 2's share), where down
    is launched before gate_up ends and waits for it in the graph (a programmatic edge)."""
    x, weights, ids, w = big_case(90, t, i)
    mt.moe_triton(x, weights, ids, w, mma=mma)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mt.moe_triton(x, weights, ids, w, mma=mma)
    x2, weights2, ids2, _ = big_case(91, t, i)
    x.copy_(x2)
    weights.copy_(weights2)
    ids.copy_(ids2)
    graph.replay()
    assert rel_err(out, moe_torch(x, weights, ids, w)) < TOL


@gpu
def test_one_token_layers_routed_on_the_device_replay_as_eager(mma):
    """Four one-token MoE layers in one CUDA graph, each routed by the one before on the device:
    down (launched while gate_up runs) reads its pairs' ids before it waits for gate_up, so each
    layer must see the ids just written. The graph's outputs on a new input equal the eager
    chain's bit for bit."""
    x, weights, ids, w = big_case(95, 1)
    router = torch.randn(32, 2880, generator=torch.Generator().manual_seed(95)).to(DEVICE)

    def chain(h, wts, top_ids):
        outs = []
        for _ in range(4):
            h = mt.moe_triton(h, wts, top_ids, w, mma=mma)
            top, top_ids = (h.float() @ router.T).topk(TOPK, dim=-1)
            wts = torch.softmax(top, dim=-1)
            outs.append(h)
        return outs

    chain(x, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(x, weights, ids)
    x2, weights2, ids2, _ = big_case(96, 1)
    x.copy_(x2)
    weights.copy_(weights2)
    ids.copy_(ids2)
    graph.replay()
    want = chain(x2, weights2, ids2)
    assert all(torch.equal(a, b) for a, b in zip(outs, want))
    assert len({tuple(o.float().flatten()[:8].tolist()) for o in want}) == 4  # layers differ


def test_the_grouped_gemms_read_each_pair_phase_as_one_slice():
    """`_permute_columns`: column 8w + jj + 4h of each K tile lands at (tile/4) jj + 2w + h,
    past K zeros; `_permuted` (where gate_up writes down's input) agrees with it column for
    column."""
    import triton
    import triton.language as tl

    x = torch.arange(1, 3 * 200 + 1, dtype=torch.float32).view(3, 200)
    for tile in (64, 128):
        xp = mt._permute_columns(x, tile)
        assert xp.shape == (3, triton.cdiv(200, tile) * tile)
        for c in range(xp.shape[1]):
            t0, r = divmod(c, tile)
            w, j = divmod(r, 8)
            want = x[:, c] if c < 200 else torch.zeros(3)
            assert torch.equal(xp[:, t0 * tile + (tile // 4) * (j % 4) + 2 * w + j // 4], want)

        @triton.jit
        def where(out_ptr, N: tl.constexpr, TILE: tl.constexpr):
            c = tl.arange(0, N)
            tl.store(out_ptr + c, mt._permuted(c, TILE))

        at = torch.empty(256, dtype=torch.int32, device=DEVICE)
        where[(1,)](at, N=256, TILE=tile)
        at = at.cpu()
        moved = torch.zeros_like(xp)
        moved[:, at[:200].long()] = x
        assert torch.equal(moved, xp)


@pytest.mark.parametrize("h,i", [(160, 96), (96, 160)])
def test_grouped_gemms_with_k_tails_on_both_projections(h, i):
    """K tiles of 128 over H and I that leave a last tile of one or three scale blocks (as a
    tensor-parallel rank's I = 1440 does): x and down's input are padded with zero columns
    (the workspace starts as NaN, so an unzeroed pad cannot pass)."""
    gen = torch.Generator().manual_seed(h + i)
    w = small_weights(gen, E, h, i)
    t = 24
    x = (torch.randn(t, h, generator=gen) * 2).to(DEVICE, DTYPE)
    weights, ids = routing(gen, t)
    cfg = mt.PrefillConfig(block_m=16, block_n1=32, block_n2=32, block_k=128, num_warps=4)
    out = mt.moe_prefill(x, weights, ids, w, cfg)
    assert rel_err(out, moe_torch(x, weights, ids, w)) < TOL
