"""Dense linear layers for decode in Triton: y = x @ W.T + b for a few rows of x, W bf16 or FP8
(e4m3 with a scale a row, `fp8_layers`).

At batch 1 a decode step reads every dense weight once (q/k/v, o, the router and lm_head are
~2.4 GB of gpt-oss-20b's ~3.7 GB a token), so these GEMVs are bandwidth-bound. A plain
CUDA-core GEMV streams each weight row once, through shared memory with Triton's pipeliner
(cp.async, a few K steps ahead), and reduces over K after the loop. At one row it reads the
weights faster than cuBLAS; loading the next K step into registers instead of shared memory was
slower (bench/dense_gemv.py; bench/results/2026-11-23_h100_kernels_e5bac60.txt). More rows of x
than GEMV_MAX_M go to torch (cuBLAS tensor-core GEMMs), where weights are reused. FP8 weights
take the same GEMV with their row scales applied once after K, up to FP8_GEMV_MAX_M rows (it
reads half the bytes cuBLAS's bf16 GEMM would), and above that a bf16 copy of a slice of rows at
a time for cuBLAS. Where the CUDA GEMV library (`moe_gemv_mma`, Hopper) loaded, its kernels take
some of these instead: its streaming CUDA-core GEMV every bf16 and FP8 layer at one row of x and
bf16 q/k/v and o at two (STREAM_ROWS), its tensor-core GEMV lm_head at a few more (MMA_ROWS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tinyoss.kernels.moe_gemv_mma import MmaGemv


# From two rows on cuBLAS is faster (bench/results/2026-11-23_h100_dense_gemv.txt).
GEMV_MAX_M = 1
FP8_GEMV_MAX_M = 8
# The tensor-core GEMV (`moe_gemv_mma`, Hopper: every row of x a column of the MMA, the weights
# read once) takes layers of at least MMA_MIN_N rows (lm_head) at these rows of x, in place of
# the paths above; it lost on q/k/v and o at every count and at 1 row everywhere
# (bench/results/2026-11-25_h100_dense_mma.md)
MMA_MIN_N = 16384
MMA_ROWS = {"bf16": range(2, 5), "fp8": range(2, 9)}
# The streaming CUDA-core GEMV (`moe_gemv_mma`: every weight load of a warp in flight at once)
# takes bf16 layers at these rows of x: every layer at one row (lm_head too: its kernel alone is
# 2% slower than the Triton GEMV's, the decode step 0.2-0.3% faster in two A/B runs), those of
# fewer than MMA_MIN_N rows (q/k/v, o) at two; q/k/v loses to cuBLAS from 4
# (bench/results/2026-11-26_session18.md). FP8 layers at one row, every layer too: against the
# Triton GEMV, q/k/v 8.9 us against 11.4, o 7.7 against 9.6, lm_head 212 against 213, a tie
# that keeps one rule (bench/results/2026-11-27_h100_fp8_stream.md); from 2 rows the kernel
# takes none (MMA_ROWS["fp8"] and the Triton GEMV)
STREAM_ROWS = {"bf16": range(1, 3), "fp8": range(1, 2)}
_FP8_SLICE = 8192  # rows of an FP8 weight dequantized at a time above FP8_GEMV_MAX_M


@dataclass(frozen=True)
class GemvConfig:
    """BLOCK_N rows of W by BLOCK_K columns a step for BLOCK_M tokens."""

    block_m: int = 1
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 4  # K steps in flight through shared memory (num_stages - 1 ahead)


def gemv_config(m: int, n: int, weight_bytes: int = 2) -> GemvConfig:
    """More tokens hold more partial sums in registers, hence a shorter K step; a K step reads
    1 KB of each weight row."""
    block_m = triton.next_power_of_2(max(1, min(m, FP8_GEMV_MAX_M if weight_bytes == 1
                                                   else GEMV_MAX_M)))
    return GemvConfig(block_m=block_m, block_k=max(32, 1024 // weight_bytes // block_m))


@triton.jit
def _gemv(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, HAS_SCALE: tl.constexpr,
          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Triton's pipeliner streams the weights through shared memory (cp.async), STAGES - 1 K
    steps ahead of the math; FP8 rows' scales multiply the sums once, after K."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    toks = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_ok = toks < M
    cols = tl.arange(0, BLOCK_K)
    wp = w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    xp = x_ptr + toks.to(tl.int64)[:, None] * K + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = tl.load(wp + k0, mask=row_ok[:, None] & (k0 + cols < K)[None, :], other=0.0)
        x = tl.load(xp + k0, mask=tok_ok[:, None] & (k0 + cols < K)[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, 2)
    if HAS_SCALE:
        y *= tl.load(s_ptr + rows, mask=row_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * N + rows[None, :],
             y.to(out_ptr.dtype.element_ty), mask=tok_ok[:, None] & row_ok[None, :])


def linear_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: GemvConfig | None = None,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in x.dtype, fp32 accumulation; an FP8
    weight's rows times `scale` [N] (fp32)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit")
    fp8 = weight.dtype == torch.float8_e4m3fn
    if (scale is not None) != fp8 or (fp8 and scale.shape != (n,)):
        raise ValueError(f"a {weight.dtype} weight {tuple(weight.shape)} with scale "
                         f"{None if scale is None else tuple(scale.shape)}: an FP8 weight takes "
                         f"a float32 scale a row, any other none")
    cfg = config or gemv_config(m, n, weight.element_size())
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _gemv[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))](
            x.contiguous(), weight.contiguous(), out if scale is None else scale,
            out if bias is None else bias, out, m, n, k, HAS_SCALE=scale is not None,
            HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, STAGES=cfg.num_stages, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    return out


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  mma: MmaGemv | None = None) -> torch.Tensor:
    """Drop-in for F.linear on 2-D x: with `mma` (the CUDA GEMV library), its streaming GEMV
    for STREAM_ROWS["bf16"] rows of the layers it takes (at two rows only those below MMA_MIN_N
    rows) and its tensor-core GEMV for MMA_ROWS["bf16"] rows of layers of MMA_MIN_N rows or
    more; else the Triton GEMV up to GEMV_MAX_M rows and cuBLAS above. The path depends only on
    the static row count and the layer, so a captured graph never changes path."""
    m = x.shape[0]
    if (mma is not None and m in STREAM_ROWS["bf16"] and (m == 1 or weight.shape[0] < MMA_MIN_N)
            and mma.supports_stream(x, weight, bias)):
        return mma.stream_linear(x, weight, bias)
    if (mma is not None and x.shape[0] in MMA_ROWS["bf16"] and weight.shape[0] >= MMA_MIN_N
            and mma.supports_linear(x, weight, None, bias)):
        return mma.linear(x, weight, bias)
    if x.shape[0] <= GEMV_MAX_M:
        return linear_gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None, mma: MmaGemv | None = None) -> torch.Tensor:
    """Drop-in for `fp8_linear_torch`: with `mma` (the CUDA GEMV library), its streaming GEMV
    for STREAM_ROWS["fp8"] rows (one) of the layers it takes and its tensor-core GEMV for
    MMA_ROWS["fp8"] rows of layers of MMA_MIN_N rows or more; else the Triton GEMV up to
    FP8_GEMV_MAX_M rows, above that cuBLAS on bf16 copies of _FP8_SLICE rows of the weight at a
    time (prefill). The path depends only on the static row count and the layer."""
    m = x.shape[0]
    if mma is not None and m in STREAM_ROWS["fp8"] and mma.supports_stream(x, weight, bias, scale):
        return mma.stream_linear(x, weight, bias, scale)
    if (mma is not None and m in MMA_ROWS["fp8"] and weight.shape[0] >= MMA_MIN_N
            and mma.supports_linear(x, weight, scale, bias)):
        return mma.linear(x, weight, bias, scale)
    if m <= FP8_GEMV_MAX_M:
        return linear_gemv(x, weight, bias, scale=scale)
    n = weight.shape[0]
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for r in range(0, n, _FP8_SLICE):
        w = (weight[r : r + _FP8_SLICE].to(torch.float32) * scale[r : r + _FP8_SLICE, None])
        out[:, r : r + _FP8_SLICE] = F.linear(
            x, w.to(x.dtype), None if bias is None else bias[r : r + _FP8_SLICE])
    return out
