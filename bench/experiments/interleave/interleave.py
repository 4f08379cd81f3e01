"""The experts "word-interleaved" at load, and the MoE prefill GEMMs on that layout.

Session 11 shuffled each 16-row tile of the experts into MMA-fragment order: the decode GEMVs
got 16-byte lane loads and ran 3-11% faster, but the prefill GEMMs lost 22-48%, since a lane's
16 bytes mixed two rows (`2026-11-25_h100_shuffled_moe.md`). This layout keeps every row's bytes
in its row and only transposes, within each group of 4 scale blocks (64 bytes), the 4 x 4 words:
physical word 4t + j of group G is word t of block 4G + j (a row's last group, nblk % 4 blocks
when K / 32 is no multiple of 4, likewise with gs = nblk % 4: word gs * t + j). A decode lane
(g, t), which takes word t of each block, loads 16 contiguous bytes for four blocks
(`il_pair.cu`); the prefill GEMMs load rows as before, take each word's scale by its block and
read x with its columns permuted to match (`il_column`), which costs nothing extra since x is
permuted anyway (pair phases, `moe_triton._permute_columns`).

Measured on an H100 (session 26): both halves slower than the product on the checkpoint's rows,
the pair GEMVs by 5-12% and the prefill GEMMs by 11-31%
(bench/results/2026-11-27_h100_interleave_8bf58d8.txt), so the product keeps that layout.

    python bench/experiments/interleave/bench.py --tokens 1,2,4,8           # decode GEMVs (GPU)
    python bench/experiments/interleave/bench.py --prefill 128,512,2048,8192  # prefill (GPU)
    python -m pytest bench/experiments/interleave                           # CPU or GPU
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tinyoss.kernels import moe_triton as mt
from tinyoss.kernels.moe_torch import ExpertWeights

TILE = 128  # the prefill K tile: one group of 4 blocks


def interleave(blocks: torch.Tensor) -> torch.Tensor:
    """Experts' MXFP4 codes [E, N, nblk, 16] (the checkpoint's) -> the same shape, each row's
    groups of 4 blocks word-transposed (module docstring)."""
    e, n, nblk, _ = blocks.shape
    words = blocks.reshape(e, n, nblk, 4, 4)  # [.., block, word t, byte]
    full = nblk // 4 * 4
    parts = [words[:, :, :full].reshape(e, n, full // 4, 4, 4, 4).transpose(3, 4)
             .reshape(e, n, full * 16)]
    if nblk > full:
        parts.append(words[:, :, full:].transpose(2, 3).reshape(e, n, (nblk - full) * 16))
    return torch.cat(parts, -1).reshape(e, n, nblk, 16).contiguous()


@triton.jit
def il_column(c, NBLK):
    """Where logical column c (code k) of a row lands in the interleaved layout."""
    b = c // 32
    t = (c // 8) % 4
    grp = b // 4
    gs = tl.minimum(4, NBLK - 4 * grp)
    return 8 * (16 * grp + gs * t + b % 4) + c % 8


def il_columns(k: int) -> torch.Tensor:
    """il_column for every column of a K-wide row (on the host)."""
    c = torch.arange(k)
    b, t, grp = c // 32, (c // 8) % 4, c // 128
    gs = torch.clamp(k // 32 - 4 * grp, max=4)
    return 8 * (16 * grp + gs * t + b % 4) + c % 8


@functools.lru_cache(maxsize=None)
def _gather(k: int, device: torch.device) -> torch.Tensor:
    """Column of [x | 0] at each position of `permute_columns_il`'s output (made once, so a
    CUDA graph can capture the gather)."""
    kp = triton.cdiv(k, TILE) * TILE
    phys = torch.empty(k, dtype=torch.long)
    phys[il_columns(k)] = torch.arange(k)  # physical column -> logical column
    src = torch.cat([phys, torch.full((kp - k,), k)])  # padding reads a zero column
    pos = torch.arange(kp).view(kp // TILE, TILE // 8, 2, 4).permute(0, 3, 1, 2).reshape(kp)
    return src[pos].to(device)


def permute_columns_il(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] -> [R, KP] pair-permuted (`moe_triton._permute_columns`) after the interleave's
    column permutation, in one gather."""
    return torch.nn.functional.pad(x, (0, 1))[:, _gather(x.shape[1], x.device)]


@triton.jit
def _mx_gemm_il(acc, xp_ptr, a_rows, a_ok, KP, K, q_ptr, s_ptr, stride_q, stride_s, rows,
                row_ok, DOT_DTYPE: tl.constexpr):
    """`moe_triton._mx_gemm_wx` at K tiles of 128 on interleaved rows: each of a tile's 16 words
    takes the scale of its block 4G + (c mod gs)."""
    BLOCK_K: tl.constexpr = 128
    a_off = a_rows.to(tl.int64)[:, None] * KP
    r = rows.to(tl.int64)[:, None]
    c = tl.arange(0, BLOCK_K // 8)
    c2 = tl.arange(0, BLOCK_K // 4)
    nblk = K // 32
    for k0 in range(0, K, BLOCK_K):
        kw = k0 // 8 + c
        q = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + r * (stride_q // 4) + kw[None, :],
                    mask=row_ok[:, None] & (kw // 4 < nblk)[None, :], other=0)
        grp = k0 // 128
        gs = tl.minimum(4, nblk - 4 * grp)
        kg = 4 * grp + c % gs
        s = tl.load(s_ptr + r * stride_s + kg[None, :],
                    mask=row_ok[:, None] & (kw // 4 < nblk)[None, :], other=0).to(tl.int32)
        if DOT_DTYPE == tl.bfloat16:
            sc = tl.where(s == 0, 0x40, s << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            sc = ((s + 14) << 23).to(tl.float32, bitcast=True)
        sc = tl.broadcast_to(sc[:, :, None], (rows.shape[0], BLOCK_K // 8, 2))
        sc = sc.reshape(rows.shape[0], BLOCK_K // 4)
        for jj in tl.static_range(4):
            xj = tl.load(xp_ptr + a_off + (k0 + (BLOCK_K // 4) * jj + c2)[None, :],
                         mask=a_ok[:, None], other=0.0)
            if DOT_DTYPE == tl.bfloat16:
                if jj < 2:
                    em = (q << (6 - 4 * jj)) & 0x01C001C0
                else:
                    em = (q >> (4 * jj - 6)) & 0x01C001C0
                p = ((q << (12 - 4 * jj)) & -0x7FFF8000) | em
                lo = (p & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
                hi = ((p >> 16) & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
                w = tl.join(lo, hi).reshape(rows.shape[0], BLOCK_K // 4)
                w = (w * 2.0**126).to(tl.bfloat16) * sc
                acc = tl.dot(w, tl.trans(xj.to(tl.bfloat16)), acc)
            else:
                lo = (((q << (28 - 4 * jj)) >> 19) & 0x8E00).to(tl.uint16)
                hi = (((q << (12 - 4 * jj)) >> 19) & 0x8E00).to(tl.uint16)
                w = tl.join(lo.to(tl.float16, bitcast=True).to(tl.float32),
                            hi.to(tl.float16, bitcast=True).to(tl.float32))
                w = w.reshape(rows.shape[0], BLOCK_K // 4) * sc
                acc = tl.dot(w, tl.trans(xj.to(tl.float32)), acc, input_precision="ieee")
    return acc


@triton.jit
def _gate_up_il(xp_ptr, order_ptr, off_ptr, q_ptr, s_ptr, b_ptr, act_ptr, E, H, HP, N, IP,
                stride_qe, stride_q, stride_se, stride_s, alpha, limit, TOPK: tl.constexpr,
                E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_DTYPE: tl.constexpr):
    """`moe_triton._prefill_gate_up` on interleaved rows; act goes out where down's interleaved
    rows read it."""
    e, row0, row_end = mt._tile_rows(off_ptr, tl.program_id(0), E, E_PAD, BLOCK_M)
    if row0 >= row_end:
        return
    m = row0 + tl.arange(0, BLOCK_M)
    ok = m < row_end
    tok = tl.load(order_ptr + m, mask=ok, other=0) // TOPK
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.trans(_mx_gemm_il(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), xp_ptr, tok, ok, HP, H,
                               q_ptr + e * stride_qe, s_ptr + e * stride_se, stride_q, stride_s,
                               rows, row_ok, DOT_DTYPE))
    bias = tl.load(b_ptr + e * N + rows, mask=row_ok, other=0.0).to(tl.float32)
    y = mt._swiglu(acc + bias[None, :], alpha, limit, BLOCK_M, BLOCK_N)
    half = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    at = mt._permuted(il_column(half, N // 64), 128)
    tl.store(act_ptr + m.to(tl.int64)[:, None] * IP + at[None, :],
             y.to(act_ptr.dtype.element_ty), mask=ok[:, None] & (half < N // 2)[None, :])


@triton.jit
def _down_il(act_ptr, order_ptr, off_ptr, wts_ptr, q_ptr, s_ptr, b_ptr, y_ptr, E, I, IP, H,
             stride_qe, stride_q, stride_se, stride_s, E_PAD: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """`moe_triton._prefill_down` on interleaved rows."""
    e, row0, row_end = mt._tile_rows(off_ptr, tl.program_id(0), E, E_PAD, BLOCK_M)
    if row0 >= row_end:
        return
    m = row0 + tl.arange(0, BLOCK_M)
    ok = m < row_end
    slot = tl.load(order_ptr + m, mask=ok, other=0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    acc = _mx_gemm_il(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), act_ptr, m, ok, IP, I,
                      q_ptr + e * stride_qe, s_ptr + e * stride_se, stride_q, stride_s, rows,
                      row_ok, DOT_DTYPE)
    bias = tl.load(b_ptr + e * H + rows, mask=row_ok, other=0.0).to(tl.float32)
    wt = tl.load(wts_ptr + slot, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + slot.to(tl.int64)[None, :] * H + rows[:, None],
             (acc + bias[:, None]) * wt[None, :], mask=ok[None, :] & row_ok[:, None])


def prefill_pairs_il(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     w: ExpertWeights, gate_up_il: torch.Tensor, down_il: torch.Tensor,
                     cfg: mt.PrefillConfig | None = None) -> torch.Tensor:
    """`moe_triton._prefill_pairs` on the interleaved experts (`interleave(blocks)`)."""
    t, h, k, e, i = mt._shapes(x, topk_ids, w)
    cfg = cfg or mt.prefill_config(x.shape[0], w.gate_up_blocks.shape[0], topk_ids.shape[1])
    assert cfg.block_k == TILE
    pairs = t * k
    y = torch.empty(pairs, h, dtype=torch.float32, device=x.device)
    xp = permute_columns_il(x.contiguous())
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    bounds = torch.arange(e + 1, device=x.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds)
    ip = triton.cdiv(i, TILE) * TILE
    act = torch.empty(pairs, ip, dtype=x.dtype, device=x.device)
    if ip > i:  # the interleave permutes within [0, i): the padding sits where the product's does
        act.view(pairs, ip // TILE, 4, TILE // 8, 2)[:, -1, :, (i % TILE) // 8:] = 0
    n_tiles = triton.cdiv(pairs, cfg.block_m) + e
    common = dict(E_PAD=triton.next_power_of_2(e), BLOCK_M=cfg.block_m,
                  DOT_DTYPE=mt._dot_dtype(x), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _gate_up_il[(n_tiles, triton.cdiv(2 * i, cfg.block_n1))](
        xp, order, offsets, gate_up_il, w.gate_up_scales, w.gate_up_bias, act, e, h,
        xp.shape[1], 2 * i, ip, *mt._strides(gate_up_il, w.gate_up_scales), float(w.alpha),
        float(w.limit), TOPK=k, BLOCK_N=cfg.block_n1, **common)
    _down_il[(n_tiles, triton.cdiv(h, cfg.block_n2))](
        act, order, offsets, topk_weights.contiguous().view(-1), down_il, w.down_scales,
        w.down_bias, y, e, i, ip, h, *mt._strides(down_il, w.down_scales),
        BLOCK_N=cfg.block_n2, **common)
    return y
