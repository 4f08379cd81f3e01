"""Dense linear layers on MXFP4 weights in Triton: y = x @ W.T + b, W packed as in the checkpoint.

W [N, K] is `blocks` [N, K/32, 16] uint8 (two E2M1 codes a byte) and `scales` [N, K/32] uint8
(UE8M0), the layout `mxfp4.quantize` writes; no dequantized copy of W ever exists. The
dequantization tricks are `moe_triton`'s: the GEMV uses its pair GEMV's fp32 arithmetic, the
GEMM calls its `_mx_gemm_wx`.

Two paths, chosen by the static row count M (never by data). Nothing syncs with the host and
every grid has a static size, so decode steps that call them can be captured in CUDA graphs.

* GEMV (M <= GEMV_MAX_M, decode), memory-bound: on the CUDA cores, each program streams
  BLOCK_N rows of W once for its BLOCK_M tokens, BLOCK_K/2 contiguous bytes of each row per step
  (512 values = 256 bytes; coalesced 8-byte loads a thread in the sm_90 SASS, as the pair GEMV),
  and reduces over K once, after the loop. Few rows per program, so that even a 2880-row layer
  at batch 1 runs hundreds of programs.
  On Hopper with nvcc, `moe_gemv_mma`'s tensor-core pair kernel takes the layers it supports
  (K 2880: q/k/v, lm_head) instead (`mma`).
* GEMM (prefill): tiles dequantized to bf16 in registers as `tl.dot`'s left operand (the
  MoE prefill's `_mx_gemm_wx`: wgmma takes them from registers, and x, pair-permuted per K
  tile by one copy, goes to shared memory by cp.async untouched), fp32 accumulation; correct
  for any M.

Limits inherited from the tricks: activations below 2**64 in magnitude (GEMV) and scale bytes
up to 240 (GEMM); `mxfp4.quantize` of real weights stays far inside both. On CPU the kernels run
in the Triton interpreter with fp32 operands and match `mxfp4_linear_torch` to fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tinyoss.kernels.moe_gemv_mma import MmaGemv
from tinyoss.kernels.moe_triton import (_dot_dtype, _e2m1_fp32, _mx_gemm_wx, _permute_columns,
                                        _phases, _ue8m0_fp32)

GEMV_MAX_M = 4  # up to this many rows the CUDA-core GEMV runs, above it the tensor-core GEMM


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the GEMV. 16 rows x 512 values is 4 KB of W a step, 64 bytes a thread at two
    warps: the tile of moe_triton's pair GEMV, the best of its sweep at 20b shapes."""

    block_m: int = 1  # tokens sharing each weight tile (a power of two)
    block_n: int = 16
    block_k: int = 512
    num_warps: int = 2
    num_stages: int = 4


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of the GEMM: block_m tokens, block_n weight rows (wgmma's M, 64 a warpgroup), K
    tiles of 128 (moe_triton's `_mx_gemm_wx`: four pair-phase dots of 32)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3


def gemv_config(m: int, n: int) -> GemvConfig:
    """Default GEMV tiles: all M tokens share each weight tile (lm_head is read once, not M
    times); layers of few rows (qkv 5120, o 2880) take 4 rows a program, so that the grid has
    ~700-1300 programs to keep every SM's loads in flight. More tokens hold more activations in
    registers, hence a shorter K step."""
    block_m = triton.next_power_of_2(max(1, min(m, GEMV_MAX_M)))
    return GemvConfig(
        block_m=block_m, block_n=16 if n >= 16384 else 4, block_k=512 if block_m == 1 else 256
    )


def gemm_config(m: int) -> GemmConfig:
    """Default GEMM tiles: up to 64 rows (decode at batch 5-64) a token tile no taller than M
    needs (at least 16 for tensor cores) on 8 warps, as before the weights-left loop (not
    re-measured there); then the best of bench/experiments/linear_wleft's sweep at q/k/v and o
    shapes (bench/results/2026-11-27_session25.md): 64 tokens on 4 warps up to 128 rows, 128
    tokens on 8 beyond."""
    if m <= 64:
        return GemmConfig(block_m=max(16, triton.next_power_of_2(m)))
    if m <= 128:
        return GemmConfig(block_m=64, num_warps=4)
    return GemmConfig(block_m=128)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output comes from here, so tests can poison it."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _gemv(
    x_ptr, q_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_q, stride_s,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[toks, rows] = x[toks] @ W[rows].T (+ b[rows]), for this program's tokens and rows.

    As moe_triton's `_pair_gemv` (`_e2m1_fp32` dequantization, activations pre-scaled by 2**64,
    each word's scale elementwise, one reduction over K after the loop); the dequantized tile
    serves all BLOCK_M tokens."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    toks = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_ok = toks < M
    r64 = rows.to(tl.int64)[:, None]
    qp = q_ptr.to(tl.pointer_type(tl.int32)) + r64 * (stride_q // 4)
    sp = s_ptr + r64 * stride_s
    xp = x_ptr + toks.to(tl.int64)[:, None] * K
    words = tl.arange(0, BLOCK_K // 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 8), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kw = k0 // 8 + words
        ok = row_ok[:, None] & (kw < K // 8)[None, :]
        q = tl.load(qp + kw[None, :], mask=ok, other=0)
        sc = tl.load(sp + (kw // 4)[None, :], mask=ok, other=0)
        kk = k0 + tl.arange(0, BLOCK_K)
        xa = tl.load(xp + kk[None, :], mask=tok_ok[:, None] & (kk < K)[None, :], other=0.0)
        phase = _phases(xa.to(tl.float32) * 2.0**64, BLOCK_K)
        p = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 8), tl.float32)
        for j in tl.static_range(8):
            p += _e2m1_fp32(q, j)[None, :, :] * phase[j][:, None, :]
        acc += p * _ue8m0_fp32(sc)[None, :, :]
    y = tl.sum(acc, 2) * 2.0**62
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + toks.to(tl.int64)[:, None] * N + rows[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=tok_ok[:, None] & row_ok[None, :],
    )


@triton.jit
def _gemm(
    xp_ptr, q_ptr, s_ptr, b_ptr, out_ptr, M, N, K, KP, stride_q, stride_s,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of out = x @ W.T (+ b), x pair-permuted ([M, KP]). Token
    tiles are grid axis 0, so the programs that run together share a weight tile (read from L2,
    not DRAM, by all but one)."""
    toks = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_ok = toks < M
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.trans(_mx_gemm_wx(
        tl.zeros((BLOCK_N, BLOCK_M), tl.float32), xp_ptr, toks, tok_ok, KP, K, q_ptr, s_ptr,
        stride_q, stride_s, rows, row_ok, BLOCK_K, DOT_DTYPE,
    ))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + toks.to(tl.int64)[:, None] * N + rows[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=tok_ok[:, None] & row_ok[None, :],
    )


def _check(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> tuple[int, int]:
    """(M, N) after checking the packed layout (contiguous rows: the kernels read them as
    16-byte vectors) and that x and bias fit it."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}")
    n, groups = blocks.shape[:2] if blocks.dim() == 3 else (-1, -1)
    if (
        tuple(blocks.shape) != (n, groups, 16)
        or tuple(scales.shape) != (n, groups)
        or not (blocks.is_contiguous() and scales.is_contiguous())
    ):
        raise ValueError(
            f"blocks must be contiguous [N, K/32, 16] and scales [N, K/32], got "
            f"{tuple(blocks.shape)} and {tuple(scales.shape)}"
        )
    if x.dim() != 2 or x.shape[1] != 32 * groups:
        raise ValueError(f"x must be [M, {32 * groups}], got {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    return x.shape[0], n


def linear_gemv(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """The CUDA-core path for any M (fastest for a few rows): x [M, K] -> [M, N] in x.dtype."""
    m, n = _check(x, blocks, scales, bias)
    cfg = config or gemv_config(m, n)
    if cfg.block_k % 32 or cfg.block_k & (cfg.block_k - 1) or cfg.block_m & (cfg.block_m - 1):
        raise ValueError(f"block_k must be a power of two >= 32 and block_m one: {cfg}")
    out = _empty((m, n), x.dtype, x.device)
    if m == 0:
        return out
    # Row strides go in as ints, in bytes: Triton sees that a row's K/2 bytes start 16-byte
    # aligned (K/2 is a multiple of 16) and vectorizes. A missing bias passes a dummy pointer.
    _gemv[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))](
        x.contiguous(), blocks, scales, out if bias is None else bias, out, m, n, x.shape[1],
        blocks.stride(0), scales.stride(0), HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def linear_gemm(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The tensor-core path for any M (for prefill): x [M, K] -> [M, N] in x.dtype."""
    m, n = _check(x, blocks, scales, bias)
    cfg = config or gemm_config(m)
    if cfg.block_k % 32:
        raise ValueError(f"block_k must be a multiple of 32, got {cfg.block_k}")
    if x.is_cuda and (min(cfg.block_m, cfg.block_n) < 16 or cfg.block_k < 128):
        raise ValueError(f"tensor cores need M, N tiles >= 16 and K tiles >= 128: {cfg}")
    out = _empty((m, n), x.dtype, x.device)
    if m == 0:
        return out
    xp = _permute_columns(x.contiguous(), cfg.block_k)
    _gemm[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))](
        xp, blocks, scales, out if bias is None else bias, out, m, n, x.shape[1], xp.shape[1],
        blocks.stride(0), scales.stride(0), HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_DTYPE=_dot_dtype(x),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def mxfp4_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    mma: MmaGemv | None = None,
) -> torch.Tensor:
    """Drop-in for `mxfp4_linear_torch`: x [M, K] -> [M, N] in x.dtype, fp32 accumulation.
    `mma`: the tensor-core GEMV (Hopper), which takes the GEMV's steps where it supports the
    layer (`MmaGemv.supports_dense`).

    The path depends only on the static M, so a captured decode graph never changes path."""
    if x.shape[0] <= GEMV_MAX_M:
        if mma is not None and mma.supports_dense(x, blocks, scales, bias):
            return mma.dense(x, blocks, scales, bias)
        return linear_gemv(x, blocks, scales, bias)
    return linear_gemm(x, blocks, scales, bias)
