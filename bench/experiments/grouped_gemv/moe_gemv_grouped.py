"""Expert-grouped MoE GEMV for a few tokens (2 <= T <= 8): each distinct expert's weights are
read once and multiplied against every token routed to it.

The pair GEMV (`moe_triton._pair_gemv`) gives each of the T*K (token, expert) pairs its own
programs, so an expert that several tokens pick is streamed once a pair. Here the pair ids are
sorted by expert on the device (`torch.sort`, stable) and a static grid of (T*K, N / BLOCK_N)
programs runs; the program of sorted slot s works only if s opens its expert's group
(sorted_ids[s] != sorted_ids[s-1]) and otherwise returns at once. It loads each weight tile
once, dequantizes it once (`_e2m1_fp32`, three integer ops a value) and then, in a loop over the
group's rows only (never padded to MAX_M), multiplies it against each row's activations and
reduces over K into that row of a [MAX_M, BLOCK_N] fp32 accumulator (`padded` instead
multiplies all MAX_M rows at once, absent ones masked). Every pair's row is written at the
pair's original index, so `y` [T*K, H] is `_gemv_pairs`'s and `_combine` / `_combine_norm` work
unchanged. Nothing syncs with the host: it captures in CUDA graphs (the bench does).

Numerics are `_pair_gemv`'s: E2M1 codes as fp32 times 2**-126, activations pre-scaled by 2**64,
each word's eight products summed then multiplied by its UE8M0 scale, fp32 accumulation, bias,
the clamped SwiGLU on interleaved gate/up rows, the routing weight on down. Only the order of the
K sum differs (words reduced every K step instead of after the loop): fp32 rounding.

Not faster on an H100 (bench_grouped_gemv.py beside this file, 20b shapes): the Gluon pair GEMV
took the same time whether the T*4 pairs hit 4 experts or 21 (T = 8: 192 vs 200 us), so it is
not bound by DRAM (a repeated expert's rows come from L2: the pairs' programs of one row tile
run side by side) but by instruction issue, and this Triton kernel spends more instructions a
weight and row than it saves by dequantizing once: 1.7-2.3x slower than the pair GEMV with
random routing, 1.4-1.9x with every token on the same four experts, over 25 tile/variant
configurations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tinyoss.kernels.moe_torch import ExpertWeights
from tinyoss.kernels.moe_triton import (
    _combine_pairs,
    _e2m1_fp32,
    _empty,
    _output,
    _phases,
    _shapes,
    _strides,
    _ue8m0_fp32,
)


@dataclass(frozen=True)
class GroupedGemvConfig:
    """A program streams BLOCK_N rows of one expert, BLOCK_K values of each row a step, and
    keeps the step's eight dequantized code planes (BLOCK_N * BLOCK_K fp32 values) in registers
    while it runs over the group's rows: BLOCK_N * BLOCK_K / (32 * num_warps) registers a
    thread, 64 at the defaults (8 rows x 256 values on one warp, 1 KB of weights a step).

    `phases`: load each row's activations as one contiguous [BLOCK_K] vector and split it into
    the eight column phases (`moe_triton._phases`) rather than eight strided loads of
    [BLOCK_K/8]. `padded`: multiply all MAX_M rows of a group at once ([MAX_M, BLOCK_N,
    BLOCK_K/8] products, absent rows masked) instead of looping over the group's rows.
    `prefetch`: load the next step's packed codes and scales before this step's arithmetic.

    Defaults: the best with random routing of an H100 sweep at 20b shapes, T = 2, 4, 8 (loop
    8/8/256/1 with phases: 113, 213, 442 us against the pair GEMV's 63, 107, 200); with every
    token on the same four experts `padded` 4/4/512/1 was better (97, 145, 312 against 58, 101,
    192)."""

    block_n1: int = 8
    block_n2: int = 8
    block_k: int = 256
    num_warps: int = 1
    phases: bool = True
    padded: bool = False
    prefetch: bool = True


@triton.jit
def _strided(x_row, xo, x_ok, j: tl.constexpr):
    """Activations x[xo + j] of a row (phase j of each word), fp32 times 2**64, as [1, W]."""
    return tl.load(x_row + xo + j, mask=x_ok, other=0.0).to(tl.float32)[None, :] * 2.0**64


@triton.jit
def _tile(qp, sp, row_ok, words, k0, K):
    """One K step of the row tile: code words [BLOCK_N, BLOCK_K/8] and each word's scale byte
    (zeros past K)."""
    kw = k0 // 8 + words
    ok = row_ok[:, None] & (kw < K // 8)[None, :]
    return tl.load(qp + kw[None, :], mask=ok, other=0), tl.load(sp + (kw // 4)[None, :], mask=ok,
                                                                 other=0)


@triton.jit
def _grouped_gemv(x_ptr, x_div, sorted_ptr, order_ptr, q_ptr, s_ptr, b_ptr, wts_ptr, out_ptr,
                  P, N, K, stride_qe, stride_q, stride_se, stride_s, alpha, limit,
                  SWIGLU: tl.constexpr, MAX_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PHASES: tl.constexpr,
                  PADDED: tl.constexpr, PREFETCH: tl.constexpr):
    """Rows of W_e @ x[pair // x_div] + b_e for every pair of the expert group that opens at
    sorted slot s = program 0 (e = sorted_ids[s]); then the clamped SwiGLU into out [pairs, N/2]
    (gate_up), or the routing weight into out [pairs, N] (down), at each pair's index."""
    slot = tl.program_id(0)
    e = tl.load(sorted_ptr + slot)
    prev = tl.load(sorted_ptr + tl.maximum(slot - 1, 0))
    if (slot > 0) & (prev == e):  # not the first slot of its group: nothing to do
        return
    m = tl.arange(0, MAX_M)
    inside = slot + m < P
    member = inside & (tl.load(sorted_ptr + slot + m, mask=inside, other=-1) == e)
    count = tl.sum(member.to(tl.int32), 0)  # the group's rows: sorted slots slot .. slot+count-1
    pairs = tl.load(order_ptr + slot + m, mask=member, other=0)
    e = e.to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    words = tl.arange(0, BLOCK_K // 8)
    r64 = rows.to(tl.int64)[:, None]
    qp = (q_ptr + e * stride_qe).to(tl.pointer_type(tl.int32)) + r64 * (stride_q // 4)
    sp = s_ptr + e * stride_se + r64 * stride_s
    x_rows = x_ptr + ((pairs // x_div).to(tl.int64) * K)[:, None]  # [MAX_M, 1]
    acc = tl.zeros((MAX_M, BLOCK_N), tl.float32)
    if PREFETCH:
        q_next, s_next = _tile(qp, sp, row_ok, words, 0, K)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:  # the next step's packed codes load while this one's arithmetic runs
            q, sc = q_next, s_next
            q_next, s_next = _tile(qp, sp, row_ok, words, k0 + BLOCK_K, K)
        else:
            q, sc = _tile(qp, sp, row_ok, words, k0, K)
        scale = _ue8m0_fp32(sc)
        if PADDED:
            # every row of [MAX_M] at once (absent rows masked): [MAX_M, BLOCK_N, BLOCK_K/8]
            kk = k0 + tl.arange(0, BLOCK_K)
            xa = tl.load(x_rows + kk[None, :], mask=member[:, None] & (kk < K)[None, :],
                         other=0.0).to(tl.float32) * 2.0**64
            x0, x1, x2, x3, x4, x5, x6, x7 = _phases(xa, BLOCK_K)
            p = _e2m1_fp32(q, 0)[None, :, :] * x0[:, None, :]
            p += _e2m1_fp32(q, 1)[None, :, :] * x1[:, None, :]
            p += _e2m1_fp32(q, 2)[None, :, :] * x2[:, None, :]
            p += _e2m1_fp32(q, 3)[None, :, :] * x3[:, None, :]
            p += _e2m1_fp32(q, 4)[None, :, :] * x4[:, None, :]
            p += _e2m1_fp32(q, 5)[None, :, :] * x5[:, None, :]
            p += _e2m1_fp32(q, 6)[None, :, :] * x6[:, None, :]
            p += _e2m1_fp32(q, 7)[None, :, :] * x7[:, None, :]
            acc += tl.sum(p * scale[None, :, :], 2)
        else:
            # the tile's eight code planes, dequantized once for the whole group
            c0 = _e2m1_fp32(q, 0)
            c1 = _e2m1_fp32(q, 1)
            c2 = _e2m1_fp32(q, 2)
            c3 = _e2m1_fp32(q, 3)
            c4 = _e2m1_fp32(q, 4)
            c5 = _e2m1_fp32(q, 5)
            c6 = _e2m1_fp32(q, 6)
            c7 = _e2m1_fp32(q, 7)
            xo = k0 + 8 * words  # each word's first activation
            x_ok = xo < K
            for i in range(0, count):  # the group's rows only
                x_row = x_ptr + tl.sum(tl.where(m == i, (pairs // x_div).to(tl.int64) * K, 0), 0)
                if PHASES:
                    kk = k0 + tl.arange(0, BLOCK_K)
                    xa = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32) * 2.0**64
                    x0, x1, x2, x3, x4, x5, x6, x7 = _phases(xa[None, :], BLOCK_K)
                else:
                    x0 = _strided(x_row, xo, x_ok, 0)
                    x1 = _strided(x_row, xo, x_ok, 1)
                    x2 = _strided(x_row, xo, x_ok, 2)
                    x3 = _strided(x_row, xo, x_ok, 3)
                    x4 = _strided(x_row, xo, x_ok, 4)
                    x5 = _strided(x_row, xo, x_ok, 5)
                    x6 = _strided(x_row, xo, x_ok, 6)
                    x7 = _strided(x_row, xo, x_ok, 7)
                p = c0 * x0
                p += c1 * x1
                p += c2 * x2
                p += c3 * x3
                p += c4 * x4
                p += c5 * x5
                p += c6 * x6
                p += c7 * x7
                part = tl.sum(p * scale, 1)  # [BLOCK_N]
                acc += tl.where(m[:, None] == i, part[None, :], 0.0)
    bias = tl.load(b_ptr + e * N + rows, mask=row_ok, other=0.0).to(tl.float32)
    h = acc * 2.0**62 + bias[None, :]
    dst = pairs.to(tl.int64)[:, None]
    if SWIGLU:
        gate, up = tl.split(h.reshape(MAX_M, BLOCK_N // 2, 2))
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        half = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + dst * (N // 2) + half[None, :],
                 ((up + 1) * gate * tl.sigmoid(alpha * gate)).to(out_ptr.dtype.element_ty),
                 mask=member[:, None] & (half < N // 2)[None, :])
    else:
        wt = tl.load(wts_ptr + pairs, mask=member, other=0.0).to(tl.float32)
        tl.store(out_ptr + dst * N + rows[None, :], h * wt[:, None],
                 mask=member[:, None] & row_ok[None, :])


def grouped_gemv_pairs(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       w: ExpertWeights, config: GroupedGemvConfig | None = None) -> torch.Tensor:
    """Each (token, expert) pair's weighted expert output, y [T * K, H] fp32 (the contract of
    `moe_triton._gemv_pairs`), by expert-grouped GEMVs: a sort and two launches, no sync."""
    t, h, k, e, i = _shapes(x, topk_ids, w)
    cfg = config or GroupedGemvConfig()
    if cfg.block_k % 32 or cfg.block_k & (cfg.block_k - 1) or cfg.block_n1 % 2:
        raise ValueError(f"block_k must be a power of two >= 32 and block_n1 even: {cfg}")
    pairs = t * k
    y = _empty((pairs, h), torch.float32, x.device)
    if t == 0:
        return y
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    wts = topk_weights.contiguous().view(-1)
    gu = (w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias)
    dn = (w.down_blocks, w.down_scales, w.down_bias)
    act = _empty((pairs, i), torch.float32, x.device)
    # a token picks distinct experts, so a group holds at most T pairs
    launch = {"MAX_M": triton.next_power_of_2(t), "BLOCK_K": cfg.block_k,
              "PHASES": cfg.phases, "PADDED": cfg.padded,
              "PREFETCH": cfg.prefetch, "num_warps": cfg.num_warps}
    _grouped_gemv[(pairs, triton.cdiv(2 * i, cfg.block_n1))](
        x.contiguous(), k, sorted_ids, order, *gu, wts, act, pairs, 2 * i, h,
        *_strides(*gu[:2]), w.alpha, w.limit, SWIGLU=True, BLOCK_N=cfg.block_n1, **launch)
    _grouped_gemv[(pairs, triton.cdiv(h, cfg.block_n2))](
        act, 1, sorted_ids, order, *dn, wts, y, pairs, h, i, *_strides(*dn[:2]), w.alpha,
        w.limit, SWIGLU=False, BLOCK_N=cfg.block_n2, **launch)
    return y


def moe_gemv_grouped(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     w: ExpertWeights, out: torch.Tensor | None = None,
                     config: GroupedGemvConfig | None = None) -> torch.Tensor:
    """Like `moe_triton.moe_gemv`: x [T, H] -> [T, H], each distinct expert read once."""
    out = _output(x, out)
    _combine_pairs(grouped_gemv_pairs(x, topk_weights, topk_ids, w, config), topk_ids, out)
    return out
