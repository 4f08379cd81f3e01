"""The MoE pair GEMV in Gluon (Triton's explicit-layout dialect): what `moe_triton._pair_gemv`
computes, for a GPU, with the register layout spelled out.

Each 32-bit word of eight E2M1 codes covers activations x[8w .. 8w+7]. The Triton kernel loads
x as a row and splits it into eight phases, and Triton moves them into the weights' layout
through shared memory (16 barriers a K step). Here one 3-D layout [rows, words, 8] places a
thread's eight activations of each of its words in its own registers: x loads as [words, 8] in
16-byte vectors and the phases split off in registers, with no barrier. It is faster than the
Triton kernel at every measured token count (bench/results/2026-11-24_h100_moe_gemv_gluon.txt).

A program takes two tiles of HALF_N rows (gate_up: the gate rows and the up rows of HALF_N
interleaved pairs, so the clamped SwiGLU needs no shuffle; down: two consecutive halves).
Dequantization, scales and the 2**64 activation pre-scale are `_pair_gemv`'s. Gluon does not
run in the Triton interpreter: on CPU the Triton kernel runs instead (`GLUON` says whether this
module's kernel can be used at all).
"""

from __future__ import annotations

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    GLUON = True
except ImportError:  # a Triton without Gluon: moe_triton keeps its Triton kernel
    GLUON = False

BLOCK_KS = (256, 512, 1024)  # words a step / 4 must divide a warp's 32 threads


def check(block_k: int, block_n: int, num_warps: int) -> None:
    """The tiles the layout can take: a K step of 256-1024 values, an even row count that
    fills the rows a warp's threads and the program's warps cover."""
    rows = (32 // (block_k // 32)) * num_warps
    if block_k not in BLOCK_KS or block_n % (2 * rows):
        raise ValueError(f"the Gluon pair GEMV takes block_k in {BLOCK_KS} and block_n a "
                         f"multiple of {2 * rows} at {num_warps} warps, got {block_k}, {block_n}")


if GLUON:

    @gluon.jit
    def _tile(qp, sp, rows, row_ok, kw, K, stride_q4, stride_s):
        """One K step of a row tile: code words [R, W] and each word's scale byte."""
        r64 = rows.to(gl.int64)
        ok = row_ok[:, None] & (kw // 4 < K // 32)[None, :]  # constant over 16 bytes
        q = gl.load(qp + r64[:, None] * stride_q4 + kw[None, :], mask=ok, other=0,
                    eviction_policy="evict_first")
        sc = gl.load(sp + r64[:, None] * stride_s + (kw // 4)[None, :], mask=ok, other=0,
                     eviction_policy="evict_first")
        return q, sc

    @gluon.jit
    def _code(q, j: gl.constexpr):
        """Code j of each word as an fp32 equal to its value times 2**-126 (`_e2m1_fp32`)."""
        return (((q << (28 - 4 * j)) >> 6) & -0x7E400000).to(gl.float32, bitcast=True)

    @gluon.jit
    def _words(q, sc, x0, x1, x2, x3, x4, x5, x6, x7):
        """Each word's eight products with its activations, times the word's scale."""
        p = _code(q, 0) * x0[None, :]
        p += _code(q, 1) * x1[None, :]
        p += _code(q, 2) * x2[None, :]
        p += _code(q, 3) * x3[None, :]
        p += _code(q, 4) * x4[None, :]
        p += _code(q, 5) * x5[None, :]
        p += _code(q, 6) * x6[None, :]
        p += _code(q, 7) * x7[None, :]
        return p * (sc.to(gl.int32) << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def _phases(xv, LW: gl.constexpr):
        """x [W, 8] (the 8 in each thread's registers) -> columns j = 0..7, each [W] in LW."""
        W: gl.constexpr = xv.shape[0]
        a, b = gl.split(gl.reshape(xv, [W, 4, 2]))  # j = 2u + t: a even j, b odd j
        a0, a1 = gl.split(gl.reshape(a, [W, 2, 2]))  # a0: j = 0, 4; a1: j = 2, 6
        b0, b1 = gl.split(gl.reshape(b, [W, 2, 2]))  # b0: j = 1, 5; b1: j = 3, 7
        x0, x4 = gl.split(a0)
        x2, x6 = gl.split(a1)
        x1, x5 = gl.split(b0)
        x3, x7 = gl.split(b1)
        return (gl.convert_layout(x0, LW, True), gl.convert_layout(x1, LW, True),
                gl.convert_layout(x2, LW, True), gl.convert_layout(x3, LW, True),
                gl.convert_layout(x4, LW, True), gl.convert_layout(x5, LW, True),
                gl.convert_layout(x6, LW, True), gl.convert_layout(x7, LW, True))

    @gluon.jit
    def _pair_gemv_gluon(x_ptr, x_div, ids_ptr, q_ptr, s_ptr, b_ptr, wts_ptr, out_ptr, N, K,
                         stride_qe, stride_q, stride_se, stride_s, alpha, limit,
                         SWIGLU: gl.constexpr, HALF_N: gl.constexpr, BLOCK_K: gl.constexpr,
                         WARPS: gl.constexpr):
        """Rows of W_e @ x[pair // x_div] + b_e for pair = program 0 and e = ids[pair]; then
        the clamped SwiGLU into out [pairs, N/2] (gate_up), or the routing weight into out
        [pairs, N] (down), as `moe_triton._pair_gemv`."""
        W: gl.constexpr = BLOCK_K // 8
        L3: gl.constexpr = gl.BlockedLayout([1, 4, 8], [32 // (W // 4), W // 4, 1],
                                            [WARPS, 1, 1], [2, 1, 0])
        LQ: gl.constexpr = gl.SliceLayout(2, L3)  # [rows, words]
        LX: gl.constexpr = gl.SliceLayout(0, L3)  # [words, 8]
        pair = gl.program_id(0)
        e = gl.load(ids_ptr + pair).to(gl.int64)
        if e < 0:  # held by another rank: nothing to read or write (the combine skips it)
            return
        i = gl.arange(0, HALF_N, layout=gl.SliceLayout(1, LQ))
        if SWIGLU:
            ra = 2 * (gl.program_id(1) * HALF_N + i)
            rb = ra + 1
        else:
            ra = gl.program_id(1) * 2 * HALF_N + i
            rb = ra + HALF_N
        ok_a, ok_b = ra < N, rb < N
        x_row = x_ptr + (pair // x_div).to(gl.int64) * K
        words = gl.arange(0, W, layout=gl.SliceLayout(0, LQ))
        xo = gl.arange(0, W, layout=gl.SliceLayout(1, LX))[:, None] * 8 + gl.arange(
            0, 8, layout=gl.SliceLayout(0, LX))[None, :]
        qp = (q_ptr + e * stride_qe).to(gl.pointer_type(gl.int32))
        sp = s_ptr + e * stride_se
        acc_a = gl.zeros([HALF_N, W], gl.float32, LQ)
        acc_b = gl.zeros([HALF_N, W], gl.float32, LQ)
        for k0 in range(0, K, BLOCK_K):
            kw = k0 // 8 + words
            qa, sa = _tile(qp, sp, ra, ok_a, kw, K, stride_q // 4, stride_s)
            qb, sb = _tile(qp, sp, rb, ok_b, kw, K, stride_q // 4, stride_s)
            xv = gl.load(x_row + k0 + xo, mask=k0 + xo < K, other=0.0).to(gl.float32) * 2.0**64
            x0, x1, x2, x3, x4, x5, x6, x7 = _phases(xv, gl.SliceLayout(0, LQ))
            acc_a += _words(qa, sa, x0, x1, x2, x3, x4, x5, x6, x7)
            acc_b += _words(qb, sb, x0, x1, x2, x3, x4, x5, x6, x7)
        bias = b_ptr + e * N
        ha = gl.sum(acc_a, axis=1) * 2.0**62 + gl.load(bias + ra, mask=ok_a, other=0.0).to(
            gl.float32)
        hb = gl.sum(acc_b, axis=1) * 2.0**62 + gl.load(bias + rb, mask=ok_b, other=0.0).to(
            gl.float32)
        if SWIGLU:
            gate = gl.minimum(ha, limit)
            up = gl.minimum(gl.maximum(hb, -limit), limit)
            half = gl.program_id(1) * HALF_N + i
            gl.store(out_ptr + pair.to(gl.int64) * (N // 2) + half,
                     (up + 1) * gate / (1.0 + gl.exp(-alpha * gate)), mask=half < N // 2)
        else:
            wt = gl.load(wts_ptr + pair).to(gl.float32)
            gl.store(out_ptr + pair.to(gl.int64) * N + ra, ha * wt, mask=ok_a)
            gl.store(out_ptr + pair.to(gl.int64) * N + rb, hb * wt, mask=ok_b)


def pair_gemv_gluon(x: torch.Tensor, x_div: int, ids: torch.Tensor, q: torch.Tensor,
                    s: torch.Tensor, b: torch.Tensor, wts: torch.Tensor, out: torch.Tensor, n: int,
                    k: int, alpha: float, limit: float, swiglu: bool, block_n: int, block_k: int,
                    num_warps: int) -> None:
    """Launches `_pair_gemv_gluon` over (pairs, N / block_n) programs: the arguments of
    `moe_triton._pair_gemv`, row tiles of block_n rows."""
    check(block_k, block_n, num_warps)
    _pair_gemv_gluon[(ids.numel(), triton.cdiv(n, block_n))](
        x, x_div, ids, q, s, b, wts, out, n, k, q.stride(0), q.stride(1), s.stride(0),
        s.stride(1), alpha, limit, SWIGLU=swiglu, HALF_N=block_n // 2, BLOCK_K=block_k,
        WARPS=num_warps, num_warps=num_warps)
