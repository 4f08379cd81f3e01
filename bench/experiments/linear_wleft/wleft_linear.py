"""The dense MXFP4 layers' prefill GEMM (`linear_mxfp4_triton.linear_gemm`, behind
`--mxfp4-layers all`) on the MoE's weights-left K loop (`moe_triton._mx_gemm_wx`, the product's
MoE prefill since session 23): the weights decoded straight to bf16 as wgmma's register operand,
x phase-permuted per K tile (`moe_triton._permute_columns`) so that it reaches shared memory by
cp.async untouched. The product's dense GEMM still puts the weights on the right of `tl.dot`
(`_mx_gemm`), which on the MoE measured 11-14% slower (`bench/results/2026-11-27_session23.md`).
Here the permutation is a separate copy of x (the MoE's gate_up writes down's input permuted;
a dense layer's producer, the norm or attention, would have to for the copy to go).

Why it may pay: with `--mxfp4-layers all` TTFT at 1k tokens is 48 ms against 34 ms with bf16
dense layers (H100, 041cc38, `2026-11-27_h100_roofline_041cc38.jsonl`).

    python bench/experiments/linear_wleft/wleft_linear.py --rows 128,512,2048,8192   # GPU
    python -m pytest bench/experiments/linear_wleft                                  # CPU or GPU
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tinyoss.kernels import linear_mxfp4_triton as lt  # noqa: E402
from tinyoss.kernels import moe_triton as mt  # noqa: E402


@dataclass(frozen=True)
class Tiles:
    block_m: int = 128  # tokens (the dot's N)
    block_n: int = 128  # weight rows (the dot's M: 64 a warpgroup)
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3


@triton.jit
def _gemm_wx(xp_ptr, q_ptr, s_ptr, b_ptr, out_ptr, M, N, K, KP, stride_q, stride_s,
             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of out = x @ W.T (+ b), x phase-permuted ([M, KP])."""
    toks = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_ok = toks < M
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.trans(mt._mx_gemm_wx(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), xp_ptr, toks, tok_ok,
                                  KP, K, q_ptr, s_ptr, stride_q, stride_s, rows, row_ok, BLOCK_K,
                                  DOT_DTYPE))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * N + rows[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=tok_ok[:, None] & row_ok[None, :])


def linear_gemm_wx(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None = None, tiles: Tiles = Tiles()) -> torch.Tensor:
    """`lt.linear_gemm` on the weights-left loop: x [M, K] -> [M, N] in x.dtype."""
    m, n = lt._check(x, blocks, scales, bias)
    out = lt._empty((m, n), x.dtype, x.device)
    if m == 0:
        return out
    xp = mt._permute_columns(x.contiguous(), tiles.block_k)
    _gemm_wx[(triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))](
        xp, blocks, scales, out if bias is None else bias, out, m, n, x.shape[1], xp.shape[1],
        blocks.stride(0), scales.stride(0), HAS_BIAS=bias is not None, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_DTYPE=mt._dot_dtype(x),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


TILES = "128/128/8/3,64/128/4/3,128/256/8/3,256/128/8/2"  # block_m/block_n/warps/stages


def bench(rows: list[int], layers: list[str], tiles: list[Tiles]) -> None:
    """us a call against the product's GEMM, weights rotating past L2, in a CUDA graph."""
    sys.path.insert(0, str(ROOT / "bench"))
    from linear_mxfp4_sweep import SHAPES, random_weight, sets_for
    from moe_kernels import timed

    from tinyoss.model.quant_linear import quantize_weight

    for layer in layers:
        n, k = SHAPES[layer]
        gen = torch.Generator(device="cuda").manual_seed(0)
        packed = [quantize_weight(random_weight(n, k, gen))
                  for _ in range(sets_for(n * (k // 2 + k // 32)))]
        bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            sets = [(x, b, s, bias) for b, s in packed]
            ref = lt.linear_gemm(*sets[0]).float()
            base = timed(lt.linear_gemm, sets)
            row = [f"{layer:<7} M={m:<5} product {base:8.1f} us"]
            for t in tiles:
                try:
                    got = linear_gemm_wx(*sets[0], tiles=t).float()
                except triton.runtime.errors.OutOfResources as exc:
                    row.append(f"{t.block_m}/{t.block_n}/{t.num_warps}/{t.num_stages}: {exc}")
                    continue
                err = ((got - ref).norm() / ref.norm()).item()
                us = timed(lambda *a, t=t: linear_gemm_wx(*a, tiles=t), sets)
                row.append(f"{t.block_m}/{t.block_n}/{t.num_warps}/{t.num_stages}: {us:8.1f} us "
                           f"({us / base - 1:+.1%}) err {err:.0e}")
            print(" | ".join(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="128,512,2048,8192")
    p.add_argument("--layers", default="qkv,o")
    p.add_argument("--tiles", default=TILES, help="block_m/block_n/warps/stages, K tiles of 128")
    args = p.parse_args()
    tiles = [Tiles(bm, bn, 128, w, s) for bm, bn, w, s in
             (map(int, c.split("/")) for c in args.tiles.split(","))]
    bench([int(r) for r in args.rows.split(",")], args.layers.split(","), tiles)


if __name__ == "__main__":
    main()
