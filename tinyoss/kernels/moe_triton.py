"""Mixture-of-experts on packed MXFP4 experts in Triton: a drop-in for `moe_torch`.

The experts stay exactly as the checkpoint stores them (`ExpertWeights`); every kernel reads the
packed bytes and scales and dequantizes tiles in registers, so no bf16 copy of an expert exists.

Three paths, chosen by the static token count T (never by data): nothing syncs with the host and
every grid has a static size, so both can be captured in CUDA graphs.

* pair GEMV (T <= GEMV_MAX_TOKENS): every (token, expert) pair gets its own programs, so one
  token fills the GPU; `_pair_gemv` streams gate_up rows (bias + clamped SwiGLU fused), then
  down rows (bias, routing weight), and `_combine` sums each token's top-k rows. On a GPU the
  same GEMV runs as a Gluon kernel with explicit layouts (`moe_gemv_gluon`), which is faster.
* grouped tensor-core GEMV (GEMV_MAX_TOKENS < T <= `moe_gemv_mma.GROUPED_MAX_TOKENS`, when the
  tensor-core library runs): pairs sorted by expert (`MmaGemv.sort_pairs`), up to 8 pairs of
  an expert a program, then `_combine` (`_grouped_pairs`).
* grouped GEMMs: pairs sorted by expert on the device (`torch.sort` + `torch.searchsorted`), a
  static grid of ceil(pairs / BLOCK_M) + E row tiles (programs past the last tile return at
  once), `_prefill_gate_up` (bias + SwiGLU in the epilogue) and `_prefill_down` (bias, routing
  weight), then `_combine`. Token tiles are sized to the rows an expert gets. The weights are
  `tl.dot`'s left operand (wgmma takes it from registers) and the activations come with their
  columns permuted per K tile (`_permute_columns`; gate_up writes down's input so), so that no
  operand passes through registers into shared memory, and two codes are decoded a 32-bit op
  (`_mx_gemm_wx`).

`moe_norm_triton` (`Kernels.moe_then_norm`) ends either path with `_combine_norm` instead: the
top-k sum, the residual add and the next layer's RMSNorm in one launch.

Both dequantize without a table: three integer ops a value on 32-bit words of eight codes put
the code's bits into a float (see `_mx_gemm_wx` and `_pair_gemv`). The GEMV multiplies on the
CUDA cores in fp32 (activations below 2**64 in magnitude); the grouped GEMMs dequantize tiles
to bf16 for `tl.dot` on the tensor cores, exactly. Real checkpoints are far inside these
limits. (`_mx_gemm_wx` serves the dense MXFP4 layers of `linear_mxfp4_triton` too.)

On CPU the kernels run in the Triton interpreter with fp32 operands (bf16 `tl.dot` is wrong
there), so both paths match `moe_torch` to fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tinyoss.kernels.moe_gemv_gluon import GLUON, pair_gemv_gluon
from tinyoss.kernels.moe_gemv_mma import (
    GATE_UP_MIN_TOKENS,
    GROUPED_MAX_TOKENS,
    MmaGemv,
)
from tinyoss.kernels.moe_torch import ExpertWeights


@dataclass(frozen=True)
class PrefillConfig:
    """Tiles of the grouped GEMMs: block_m sorted (token, expert) rows, block_n1 / block_n2
    weight rows of gate_up / down, K tiles of 128 (the activations are pair-permuted per K
    tile, four dots of 32 a tile)."""

    block_m: int = 64
    block_n1: int = 128
    block_n2: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


def prefill_config(num_tokens: int, num_experts: int, top_k: int) -> PrefillConfig:
    """Tiles sized to the rows an expert gets on average (T * K / E): 16-row tiles up to 8 rows,
    32 up to 16, 64 on 4 warps up to 64, then 128 rows on 8 warps, and 256 weight rows a tile
    beyond 256 (the best of a sweep of the weights-left GEMMs at gpt-oss-20b shapes,
    bench/results/2026-11-27_session23.md)."""
    rows = max(1, num_tokens * top_k // num_experts)
    if rows <= 64:
        return PrefillConfig(block_m=16 if rows <= 8 else 32 if rows <= 16 else 64)
    n = 128 if rows <= 256 else 256
    return PrefillConfig(block_m=128, block_n1=n, block_n2=n, num_warps=8)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output and workspace comes from here, so tests can poison them."""
    return torch.empty(shape, dtype=dtype, device=device)


# ------------------------------------------------------------------------------------------------
# Tile helpers (the K loops inline their loads: the interpreter pays for every helper call)


@triton.jit
def _phases(a, BLOCK_K: tl.constexpr):
    """a [M, BLOCK_K] -> its eight column phases a[:, 8w + j], j = 0..7, each [M, BLOCK_K/8]."""
    a_even, a_odd = tl.split(a.reshape(a.shape[0], BLOCK_K // 8, 2, 2, 2))  # k = 8w + 4u + 2v + t
    e0, e1 = tl.split(a_even)
    o0, o1 = tl.split(a_odd)
    a0, a4 = tl.split(e0)
    a2, a6 = tl.split(e1)
    a1, a5 = tl.split(o0)
    a3, a7 = tl.split(o1)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _swiglu(h, alpha, limit, BM: tl.constexpr, BN: tl.constexpr):
    """gpt-oss's clamped SwiGLU on interleaved gate/up columns: [BM, BN] -> [BM, BN/2]."""
    gate, up = tl.split(h.reshape(BM, BN // 2, 2))
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return (up + 1) * gate * tl.sigmoid(alpha * gate)


# ------------------------------------------------------------------------------------------------
# Grouped GEMMs: pairs sorted by expert, token tiles per expert


@triton.jit
def _tile_rows(off_ptr, tile, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first sorted row, end of the expert's rows) of row tile `tile`.

    off [E+1] holds each expert's first row among the expert-sorted pairs; expert e owns
    ceil(count_e / BLOCK_M) consecutive tiles. A tile past the last gives an empty range."""
    ex = tl.arange(0, E_PAD)
    lo = tl.load(off_ptr + ex, mask=ex < E, other=0)
    hi = tl.load(off_ptr + ex + 1, mask=ex < E, other=0)
    n_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    end = tl.cumsum(n_tiles, 0)
    e = tl.sum((end <= tile).to(tl.int32), 0)
    sel = ex == e
    row0 = tl.sum(tl.where(sel, lo + (tile - end + n_tiles) * BLOCK_M, 0), 0)
    return e.to(tl.int64), row0, tl.sum(tl.where(sel, hi, 0), 0)


@triton.jit
def _permuted(c, BLOCK_K: tl.constexpr):
    """Where column c of the activations lands in the pair-permuted layout
    (`_permute_columns`): column 8w + jj + 4h of a K tile (jj 0..3, h 0..1) at
    (BLOCK_K/4) jj + 2w + h."""
    r = c % BLOCK_K
    j = r % 8
    return c - r + (BLOCK_K // 4) * (j % 4) + 2 * (r // 8) + j // 4


@triton.jit
def _mx_gemm_wx(acc, xp_ptr, a_rows, a_ok, KP, K, q_ptr, s_ptr, stride_q, stride_s, rows,
                row_ok, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """acc [N, M] + W[rows, :K] @ A[a_rows, :K].T, the weights on the left of `tl.dot`.

    W is one expert's MXFP4 rows (bytes at q_ptr, row stride stride_q = K/2; scales at s_ptr,
    stride_s = K/32). A comes pair-permuted ([*, KP], KP = K in whole K tiles, `_permuted`): a
    32-bit word holds codes k = 8w + j, and codes jj and jj + 4 sit 16 bits apart, so one
    shift-and-mask pair decodes both into the two bf16 halves of one register, the two adjacent
    k positions wgmma's register operand holds. The tile is four dots of K = BLOCK_K/4, one a
    pair phase jj, and phase jj of A is one contiguous [M, BLOCK_K/4] slice. With W on the left
    the decoded weights reach wgmma from registers, and each phase of A goes global -> shared
    memory by cp.async untouched: no thread stores an operand to shared memory.

    Decoding, no table: on the GPU straight to bf16 bits (sign to bits 15 / 31, exponent and
    mantissa to bits 8..6 / 24..22: the value times 2**-126, the code 0.5 a subnormal), about
    three integer ops a pair of codes, then two packed bf16 multiplies, by 2**126 and by the
    scale: exact, every product has at most two significant bits. In the interpreter (fp32
    dots; its bf16 flushes subnormals) to fp16 bits times 2**(s - 127 + 14) in fp32."""
    a_off = a_rows.to(tl.int64)[:, None] * KP
    r = rows.to(tl.int64)[:, None]
    c = tl.arange(0, BLOCK_K // 8)
    c2 = tl.arange(0, BLOCK_K // 4)
    for k0 in range(0, K, BLOCK_K):
        kw = k0 // 8 + c
        q = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + r * (stride_q // 4) + kw[None, :],
                    mask=row_ok[:, None] & (kw // 4 < K // 32)[None, :], other=0)
        kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(s_ptr + r * stride_s + kg[None, :],
                    mask=row_ok[:, None] & (kg < K // 32)[None, :], other=0).to(tl.int32)
        if DOT_DTYPE == tl.bfloat16:
            sc = tl.where(s == 0, 0x40, s << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            sc = ((s + 14) << 23).to(tl.float32, bitcast=True)
        # each word's scale, twice: both codes of a pair share it
        sc = tl.broadcast_to(sc[:, :, None, None], (rows.shape[0], BLOCK_K // 32, 4, 2))
        sc = sc.reshape(rows.shape[0], BLOCK_K // 4)
        for jj in tl.static_range(4):
            xj = tl.load(xp_ptr + a_off + (k0 + (BLOCK_K // 4) * jj + c2)[None, :],
                         mask=a_ok[:, None], other=0.0)
            if DOT_DTYPE == tl.bfloat16:
                if jj < 2:
                    em = (q << (6 - 4 * jj)) & 0x01C001C0
                else:
                    em = (q >> (4 * jj - 6)) & 0x01C001C0
                p = ((q << (12 - 4 * jj)) & -0x7FFF8000) | em  # 0x80008000 as an int32
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
def _prefill_gate_up(xp_ptr, order_ptr, off_ptr, q_ptr, s_ptr, b_ptr, act_ptr, E, H, HP, N, IP,
                     stride_qe, stride_q, stride_se, stride_s, alpha, limit, TOPK: tl.constexpr,
                     E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """act[sorted row] = swiglu(x[token] @ gate_up_e.T + b_e) for a tile of BLOCK_M sorted rows
    and BLOCK_N weight rows; x comes pair-permuted ([T, HP]) and act goes out pair-permuted
    ([pairs, IP]) for `_prefill_down`."""
    e, row0, row_end = _tile_rows(off_ptr, tl.program_id(0), E, E_PAD, BLOCK_M)
    if row0 >= row_end:
        return
    m = row0 + tl.arange(0, BLOCK_M)
    ok = m < row_end
    tok = tl.load(order_ptr + m, mask=ok, other=0) // TOPK
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.trans(_mx_gemm_wx(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), xp_ptr, tok, ok, HP, H,
                               q_ptr + e * stride_qe, s_ptr + e * stride_se, stride_q, stride_s,
                               rows, row_ok, BLOCK_K, DOT_DTYPE))
    bias = tl.load(b_ptr + e * N + rows, mask=row_ok, other=0.0).to(tl.float32)
    y = _swiglu(acc + bias[None, :], alpha, limit, BLOCK_M, BLOCK_N)
    half = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(act_ptr + m.to(tl.int64)[:, None] * IP + _permuted(half, BLOCK_K)[None, :],
             y.to(act_ptr.dtype.element_ty), mask=ok[:, None] & (half < N // 2)[None, :])


@triton.jit
def _prefill_down(act_ptr, order_ptr, off_ptr, wts_ptr, q_ptr, s_ptr, b_ptr, y_ptr, E, I, IP, H,
                  stride_qe, stride_q, stride_se, stride_s, E_PAD: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_DTYPE: tl.constexpr):
    """y[pair] = w_pair * (act[sorted row] @ down_e.T + b_e), fp32, stored transposed from the
    [BLOCK_N, BLOCK_M] accumulator (no layout conversion)."""
    e, row0, row_end = _tile_rows(off_ptr, tl.program_id(0), E, E_PAD, BLOCK_M)
    if row0 >= row_end:
        return
    m = row0 + tl.arange(0, BLOCK_M)
    ok = m < row_end
    slot = tl.load(order_ptr + m, mask=ok, other=0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    acc = _mx_gemm_wx(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), act_ptr, m, ok, IP, I,
                      q_ptr + e * stride_qe, s_ptr + e * stride_se, stride_q, stride_s, rows,
                      row_ok, BLOCK_K, DOT_DTYPE)
    bias = tl.load(b_ptr + e * H + rows, mask=row_ok, other=0.0).to(tl.float32)
    wt = tl.load(wts_ptr + slot, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + slot.to(tl.int64)[None, :] * H + rows[:, None],
             (acc + bias[:, None]) * wt[None, :], mask=ok[None, :] & row_ok[:, None])


@triton.jit
def _combine(y_ptr, ids_ptr, out_ptr, H, TOPK: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[t] = sum over k of y[t*TOPK + k], in slot order (deterministic); a pair of expert id
    -1 (held by another rank) was skipped by the expert kernels, so its row is not read."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < H
    tot = tl.zeros((BLOCK_N,), tl.float32)
    for k in tl.static_range(TOPK):
        held = tl.load(ids_ptr + t * TOPK + k + 0 * cols) >= 0  # the pair's id, a column each
        tot += tl.load(y_ptr + (t * TOPK + k) * H + cols, mask=ok & held, other=0.0)
    tl.store(out_ptr + t * H + cols, tot.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_norm(y_ptr, ids_ptr, res_ptr, w_ptr, out_ptr, H, eps, TOPK: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Token t (program 0): moe = sum over k of y[t*TOPK + k] (pairs of id -1 skipped, as in
    `_combine`), rounded to the activation dtype as `_combine` stores it; x = moe + res[t]
    (rounded likewise) over res[t]; out[t] = w * x * rsqrt(mean(x^2) + eps), as
    `layer_ops_triton._add_rms_norm_kernel` computes it."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    tot = tl.zeros((BLOCK,), tl.float32)
    for k in tl.static_range(TOPK):
        held = tl.load(ids_ptr + t * TOPK + k + 0 * cols) >= 0  # the pair's id, a column each
        tot += tl.load(y_ptr + (t * TOPK + k) * H + cols, mask=ok & held, other=0.0)
    dtype = out_ptr.dtype.element_ty
    res = tl.load(res_ptr + t * H + cols, mask=ok, other=0.0)
    x = (tot.to(dtype).to(tl.float32) + res.to(tl.float32)).to(dtype)
    tl.store(res_ptr + t * H + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, (w * (xf * rstd)).to(dtype), mask=ok)


# ------------------------------------------------------------------------------------------------
# Host side: checks and launches (no host synchronisation anywhere)


def _shapes(x: torch.Tensor, topk_ids: torch.Tensor, w: ExpertWeights) -> tuple[int, ...]:
    """(T, H, K, E, I) after checking that the experts are the checkpoint's contiguous layout."""
    t, h = x.shape
    e, n1 = w.gate_up_blocks.shape[:2]
    i = n1 // 2
    if h % 32 or i % 32:
        raise ValueError(f"hidden {h} and intermediate {i} must be multiples of 32")
    want = {
        "gate_up_blocks": (e, n1, h // 32, 16),
        "gate_up_scales": (e, n1, h // 32),
        "down_blocks": (e, h, i // 32, 16),
        "down_scales": (e, h, i // 32),
        "gate_up_bias": (e, n1),
        "down_bias": (e, h),
    }
    for name, shape in want.items():
        tensor = getattr(w, name)
        if tuple(tensor.shape) != shape or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous {shape}, got {tuple(tensor.shape)}")
    return t, h, topk_ids.shape[1], e, i


def _strides(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[int, int, int, int]:
    """Expert and row strides of blocks and scales. Passed as ints, so Triton sees that a row's
    K/2 bytes start 16-byte aligned (K/2 = 1440 is a multiple of 16) and vectorizes."""
    return blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1)


def _combine_pairs(y: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, H] = the sum of each token's K rows of y [T * K, H] (`_combine`), the pairs of
    id -1 left out."""
    t, h = out.shape
    if t:
        _combine[(t, triton.cdiv(h, 1024))](y, topk_ids.contiguous().view(-1), out, h,
                                            TOPK=y.shape[0] // t, BLOCK_N=1024)


def _output(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """A new [T, H] tensor of x's dtype, or the caller's (checked: kernels write it densely)."""
    if out is None:
        return _empty(tuple(x.shape), x.dtype, x.device)
    if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {tuple(x.shape)} {x.dtype}, got {out.shape}")
    return out


def _dot_dtype(x: torch.Tensor) -> tl.dtype:
    """bf16 tensor-core operands on the GPU; fp32 in the interpreter, where bf16 dots are wrong."""
    return tl.bfloat16 if x.is_cuda else tl.float32


def _check_tiles(
    x: torch.Tensor, block_t: int, rows: tuple[int, ...], ks: tuple[int, ...]
) -> None:
    if any(n % 2 for n in rows) or any(k % 32 for k in ks):
        raise ValueError(f"row tiles must be even and K tiles multiples of 32: {rows}, {ks}")
    if x.is_cuda and (min(block_t, *rows) < 16 or min(ks) < 128):
        raise ValueError(
            f"tensor cores need row tiles >= 16 and K tiles >= 128 "
            f"(8 dots of K/8 >= 16), got {block_t}, {rows}, {ks}"
        )


def moe_prefill(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w: ExpertWeights,
    config: PrefillConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The prefill path: pairs sorted by expert on the device, grouped GEMMs, top-k combine."""
    out = _output(x, out)
    _combine_pairs(_prefill_pairs(x, topk_weights, topk_ids, w, config), topk_ids, out)
    return out


def _permute_columns(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """x [R, K] -> [R, KP], KP = K in whole K tiles (zero columns added): within each tile,
    column (block_k/4) jj + 2w + h holds x's column 8w + jj + 4h, so each pair phase jj of the
    grouped GEMMs reads one contiguous slice (`_permuted` says where a column goes)."""
    r, k = x.shape
    kp = triton.cdiv(k, block_k) * block_k
    xp = torch.nn.functional.pad(x, (0, kp - k))
    # [r, tiles, w, h, jj] -> [r, tiles, jj, w, h]
    return xp.view(r, kp // block_k, block_k // 8, 2, 4).permute(0, 1, 4, 2, 3).reshape(r, kp)


def _prefill_pairs(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   w: ExpertWeights, config: PrefillConfig | None) -> torch.Tensor:
    """Each (token, expert) pair's weighted expert output, y [T * K, H] fp32, by grouped GEMMs."""
    t, h, k, e, i = _shapes(x, topk_ids, w)
    cfg = config or prefill_config(x.shape[0], w.gate_up_blocks.shape[0], topk_ids.shape[1])
    _check_tiles(x, cfg.block_m, (cfg.block_n1, cfg.block_n2), (cfg.block_k,))
    pairs = t * k
    y = _empty((pairs, h), torch.float32, x.device)
    if t == 0:
        return y
    xp = _permute_columns(x, cfg.block_k)
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    bounds = torch.arange(e + 1, device=x.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds)  # [E+1]: first sorted row of each expert
    bk = cfg.block_k
    ip = triton.cdiv(i, bk) * bk
    act = _empty((pairs, ip), x.dtype, x.device)  # pair-permuted, as down reads it
    if ip > i:  # the padding: words w >= i/8 of the last K tile, at (bk/4) jj + 2w + h
        act.view(pairs, ip // bk, 4, bk // 8, 2)[:, -1, :, (i % bk) // 8:] = 0
    n_tiles = triton.cdiv(pairs, cfg.block_m) + e  # static bound on sum_e ceil(count_e / BLOCK_M)
    common = dict(E_PAD=triton.next_power_of_2(e), BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
                  DOT_DTYPE=_dot_dtype(x), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _prefill_gate_up[(n_tiles, triton.cdiv(2 * i, cfg.block_n1))](
        xp, order, offsets, w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias, act, e, h,
        xp.shape[1], 2 * i, ip, *_strides(w.gate_up_blocks, w.gate_up_scales), float(w.alpha),
        float(w.limit), TOPK=k, BLOCK_N=cfg.block_n1, **common)
    _prefill_down[(n_tiles, triton.cdiv(h, cfg.block_n2))](
        act, order, offsets, topk_weights.contiguous().view(-1), w.down_blocks, w.down_scales,
        w.down_bias, y, e, i, ip, h, *_strides(w.down_blocks, w.down_scales),
        BLOCK_N=cfg.block_n2, **common)
    return y


# ------------------------------------------------------------------------------------------------
# Pair GEMV: a few tokens. Every (token, expert) pair gets its own programs, so even one token
# fills the GPU: gate_up has pairs x 2I/BLOCK_N programs, down pairs x H/BLOCK_N. `_pair_gemv`
# multiplies in fp32; on a GPU its Gluon twin (`moe_gemv_gluon`) runs instead.


@dataclass(frozen=True)
class GemvConfig:
    """A program streams BLOCK_N rows of one expert, BLOCK_K values (BLOCK_K/2 bytes) of each
    row per step. The defaults are the best tile of the Gluon kernel's sweep at 20b shapes: 8 rows
    x 1024 values on one warp, 4 KB a step, 128 bytes a thread
    (bench/results/2026-11-24_h100_moe_gemv_gluon.txt). The Triton kernel (CPU interpreter, or a
    Triton without Gluon) was best at 8 x 512 on one warp; loading the next step ahead, into
    registers or through shared memory with Triton's pipeliner, made it slower, so its loop is
    not pipelined and `num_stages` changes nothing
    (bench/results/2026-11-23_h100_kernels_e5bac60.txt)."""

    block_n1: int = 8
    block_n2: int = 8
    block_k: int = 1024
    num_warps: int = 1
    num_stages: int = 4


# Up to this many tokens the pair GEMV runs. It reads an expert once for every token that picks
# it; from a few more tokens on, the grouped GEMMs, which read it once a token tile, are faster.
GEMV_MAX_TOKENS = 8


@triton.jit
def _e2m1_fp32(q, j: tl.constexpr):
    """Code j of each 32-bit word of eight E2M1 codes, as an fp32 equal to its value times
    2**-126: shifted to the top, arithmetic-shifted down so the sign lands on the fp32 sign bit
    and the exponent and mantissa bits at the bottom of the exponent field, then masked
    (0x81C00000). Exact: the code 0.5 is an fp32 subnormal, which Triton's fp32 math keeps."""
    return (((q << (28 - 4 * j)) >> 6) & -0x7E400000).to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0_fp32(s):
    """UE8M0 scale bytes as the fp32 powers of two 2**(s - 127) (s = 0 reads as 0)."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _pair_gemv(x_ptr, x_div, ids_ptr, q_ptr, s_ptr, b_ptr, wts_ptr, out_ptr, N, K,
               stride_qe, stride_q, stride_se, stride_s, alpha, limit,
               SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows of W_e @ x[pair // x_div] + b_e for pair = program 0 and e = ids[pair]; then the
    clamped SwiGLU into out [pairs, N/2] (gate_up), or the routing weight into out [pairs, N].

    Dequantization without a table (`_e2m1_fp32`: three integer ops a value); activations are
    pre-scaled by 2**64 so every product is normal; each word's scale multiplies elementwise,
    and the one reduction over K happens after the loop."""
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    if e < 0:  # held by another rank: nothing to read or write (`_combine` skips the pair)
        return
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    x_row = x_ptr + (pair // x_div).to(tl.int64) * K
    words = tl.arange(0, BLOCK_K // 8)
    r64 = rows.to(tl.int64)[:, None]
    qp = (q_ptr + e * stride_qe).to(tl.pointer_type(tl.int32)) + r64 * (stride_q // 4)
    sp = s_ptr + e * stride_se + r64 * stride_s
    acc = tl.zeros((BLOCK_N, BLOCK_K // 8), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kw = k0 // 8 + words
        ok = row_ok[:, None] & (kw < K // 8)[None, :]
        q = tl.load(qp + kw[None, :], mask=ok, other=0)
        sc = tl.load(sp + (kw // 4)[None, :], mask=ok, other=0)
        kk = k0 + tl.arange(0, BLOCK_K)
        xa = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32) * 2.0**64
        phase = _phases(xa[None, :], BLOCK_K)
        p = tl.zeros((BLOCK_N, BLOCK_K // 8), tl.float32)
        for j in tl.static_range(8):
            p += _e2m1_fp32(q, j) * phase[j]
        acc += p * _ue8m0_fp32(sc)
    h = tl.sum(acc, 1) * 2.0**62 + tl.load(b_ptr + e * N + rows, mask=row_ok, other=0.0).to(
        tl.float32
    )
    if SWIGLU:
        gate, up = tl.split(h.reshape(BLOCK_N // 2, 2))
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        half = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + pair.to(tl.int64) * (N // 2) + half,
                 ((up + 1) * gate * tl.sigmoid(alpha * gate)).to(out_ptr.dtype.element_ty),
                 mask=half < N // 2)
    else:
        wt = tl.load(wts_ptr + pair).to(tl.float32)
        tl.store(out_ptr + pair.to(tl.int64) * N + rows, h * wt, mask=row_ok)


def moe_gemv(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             w: ExpertWeights, config: GemvConfig | None = None,
             out: torch.Tensor | None = None, mma: MmaGemv | None = None) -> torch.Tensor:
    """The pair-GEMV path: x [T, H] -> [T, H]; three launches, no host synchronisation."""
    out = _output(x, out)
    _combine_pairs(_gemv_pairs(x, topk_weights, topk_ids, w, config, mma), topk_ids, out)
    return out


def _gemv_pairs(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                w: ExpertWeights, config: GemvConfig | None,
                mma: MmaGemv | None = None) -> torch.Tensor:
    """Each (token, expert) pair's weighted expert output, y [T * K, H] fp32, by pair GEMVs:
    `mma` (the tensor-core kernel, when given) for gate_up from GATE_UP_MIN_TOKENS and for down
    from `mma.down_min_tokens(w)` tokens on, each where it takes the shapes (a tensor-parallel
    rank's share too), else Gluon's (the Triton kernel in the interpreter)."""
    t, h, k, e, i = _shapes(x, topk_ids, w)
    cfg = config or GemvConfig()
    if cfg.block_k % 32 or cfg.block_k & (cfg.block_k - 1) or cfg.block_n1 % 2:
        raise ValueError(f"block_k must be a power of two >= 32 and block_n1 even: {cfg}")
    pairs = t * k
    y = _empty((pairs, h), torch.float32, x.device)
    if t == 0:
        return y
    ids = topk_ids.contiguous().view(-1)
    wts = topk_weights.contiguous().view(-1)
    gu = (w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias)
    dn = (w.down_blocks, w.down_scales, w.down_bias)
    act = _empty((pairs, i), torch.float32, x.device)
    gate_up_cores = mma is not None and t >= GATE_UP_MIN_TOKENS and mma.supports_gate_up(x, w)
    down_cores = mma is not None and t >= mma.down_min_tokens(w) and mma.supports_down(x, w)
    ids32 = ids.to(torch.int32) if gate_up_cores or down_cores else ids
    if gate_up_cores:
        mma.gate_up(x.contiguous(), k, ids32, *gu, wts, act, w.alpha, w.limit)
    else:
        _pair_gemv_cores(x.contiguous(), k, ids, gu, wts, act, 2 * i, h, w, cfg, cfg.block_n1,
                         swiglu=True)
    if down_cores:
        mma.down(act, ids32, *dn, wts, y, w.alpha, w.limit)
    else:
        _pair_gemv_cores(act, 1, ids, dn, wts, y, h, i, w, cfg, cfg.block_n2, swiglu=False)
    return y


def _grouped(x: torch.Tensor, w: ExpertWeights, mma: MmaGemv | None) -> bool:
    """Whether a step of x's static token count takes the grouped tensor-core GEMV."""
    return (mma is not None and GEMV_MAX_TOKENS < x.shape[0] <= GROUPED_MAX_TOKENS
            and mma.supports_grouped(x, w))


def _grouped_pairs(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   w: ExpertWeights, mma: MmaGemv) -> torch.Tensor:
    """y [T * K, H] fp32 as `_gemv_pairs` gives it, by the grouped tensor-core GEMV: the pairs
    sorted by expert on the device, no host synchronisation."""
    t, h, k, e, i = _shapes(x, topk_ids, w)
    pairs = t * k
    y = _empty((pairs, h), torch.float32, x.device)
    act = _empty((pairs, i), torch.float32, x.device)
    by_expert = mma.sort_pairs(topk_ids.reshape(-1).to(torch.int32).contiguous(), e)
    wts = topk_weights.contiguous().view(-1)
    mma.grouped(x.contiguous(), k, by_expert, w.gate_up_blocks, w.gate_up_scales,
                w.gate_up_bias, wts, act, w.alpha, w.limit, swiglu=True)
    mma.grouped(act, 1, by_expert, w.down_blocks, w.down_scales, w.down_bias, wts, y, w.alpha,
                w.limit, swiglu=False)
    return y


def _pair_gemv_cores(x: torch.Tensor, x_div: int, ids: torch.Tensor,
                     proj: tuple[torch.Tensor, torch.Tensor, torch.Tensor], wts: torch.Tensor,
                     out: torch.Tensor, n: int, kdim: int, w: ExpertWeights, cfg: GemvConfig,
                     block_n: int, swiglu: bool) -> None:
    """One projection's pair GEMV on the CUDA cores: Gluon's on a GPU that has it, else the
    Triton kernel (also the CPU interpreter's)."""
    if x.is_cuda and GLUON:
        pair_gemv_gluon(x, x_div, ids, *proj, wts, out, n, kdim, w.alpha, w.limit,
                        swiglu=swiglu, block_n=block_n, block_k=cfg.block_k,
                        num_warps=cfg.num_warps)
        return
    _pair_gemv[(ids.numel(), triton.cdiv(n, block_n))](
        x, x_div, ids, *proj, wts, out, n, kdim, *_strides(*proj[:2]), w.alpha, w.limit,
        SWIGLU=swiglu, BLOCK_N=block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)


def moe_triton(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w: ExpertWeights,
    out: torch.Tensor | None = None,
    gemv: GemvConfig | None = None,
    mma: MmaGemv | None = None,
) -> torch.Tensor:
    """Drop-in for `moe_torch`: x [T, H], topk_weights [T, K], topk_ids [T, K] -> [T, H];
    `gemv` configures the pair GEMV (default `GemvConfig()`), `mma` the tensor-core one.

    The path depends only on the static T, so a captured decode graph never changes path."""
    if x.shape[0] <= GEMV_MAX_TOKENS:
        return moe_gemv(x, topk_weights, topk_ids, w, gemv, out=out, mma=mma)
    if _grouped(x, w, mma):
        out = _output(x, out)
        _combine_pairs(_grouped_pairs(x, topk_weights, topk_ids, w, mma), topk_ids, out)
        return out
    return moe_prefill(x, topk_weights, topk_ids, w, out=out)


def moe_pairs_triton(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w: ExpertWeights,
    gemv: GemvConfig | None = None,
    mma: MmaGemv | None = None,
) -> torch.Tensor:
    """`moe_triton` before its top-k combine: each (token, expert) pair's weighted output,
    y [T * K, H] fp32 (pairs of id -1 not written), for a combine fused into what follows."""
    if x.shape[0] <= GEMV_MAX_TOKENS:
        return _gemv_pairs(x, topk_weights, topk_ids, w, gemv, mma)
    if _grouped(x, w, mma):
        return _grouped_pairs(x, topk_weights, topk_ids, w, mma)
    return _prefill_pairs(x, topk_weights, topk_ids, w, None)


def moe_norm_triton(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w: ExpertWeights,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gemv: GemvConfig | None = None,
    mma: MmaGemv | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Kernels.moe_then_norm`: `moe_triton`, whose top-k combine also adds the residual and
    takes the RMSNorm (one launch for what was two): (norm(moe + residual), moe + residual),
    the new residual written over `residual`. Same bits as `moe_triton` then `rms_norm_triton`."""
    if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
        raise ValueError(f"residual must be contiguous {tuple(x.shape)} {x.dtype}, "
                         f"got {tuple(residual.shape)} {residual.dtype}")
    y = moe_pairs_triton(x, topk_weights, topk_ids, w, gemv, mma)
    t, h = x.shape
    normed = _empty((t, h), x.dtype, x.device)
    if t:
        _combine_norm[(t,)](y, topk_ids.contiguous().view(-1), residual, norm_weight, normed, h,
                            eps, TOPK=topk_ids.shape[1],
                            BLOCK=triton.next_power_of_2(h), num_warps=8)
    return normed, residual
