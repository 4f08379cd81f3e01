"""The decode GEMV at one row of x in two dimensions ([BLOCK_N, BLOCK_K] partial sums, x broadcast
over rows) instead of linear_triton._gemv's three ([BLOCK_M, BLOCK_N, BLOCK_K] for any M).
Compiled offline for sm_90 (`python bench/experiments/gemv_2d/gemv_2d.py`, no GPU needed), Triton
then reads the weights from shared memory 16 bytes a load (LDS.128) where the 3-D form reads
one value a load (LDS.U16 for bf16, LDS.U8 for FP8): 3.86 instructions a weight against 5.08 for
FP8, 4.69 against 5.03 for bf16, at 80-120 registers. Not timed yet: it goes into
linear_triton (for M = 1) only if `--bench` shows it faster on the GPU.

    python bench/experiments/gemv_2d/gemv_2d.py            # offline SASS (any machine)
    python bench/experiments/gemv_2d/gemv_2d.py --bench    # GPU: us and GB/s against _gemv
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


@triton.jit
def gemv_2d(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, HAS_SCALE: tl.constexpr,
            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """linear_triton._gemv's arguments (BLOCK_M and M unused: one row of x)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    wp = w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = tl.load(wp + k0, mask=row_ok[:, None] & (k0 + cols < K)[None, :], other=0.0)
        x = tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_SCALE:
        y *= tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


CASES = [("bf16", "*bf16", False, 8, 512), ("fp8", "*fp8e4nv", True, 8, 1024)]


def offline() -> None:
    import offline_sass

    from tinyoss.kernels import linear_triton as lt

    args = dict(x_ptr="*bf16", s_ptr="*fp32", b_ptr="*bf16", out_ptr="*bf16", M=1, N=5120,
                K=2880)
    for label, w, scale, bn, bk in CASES:
        for form, fn in (("3-D (engine)", lt._gemv), ("2-D", gemv_2d)):
            entry = (fn, dict(args, w_ptr=w),
                     dict(HAS_SCALE=scale, HAS_BIAS=True, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk,
                          STAGES=4), dict(num_warps=4, num_stages=4), bn * bk)
            offline_sass.report(f"{label} {form}", entry)


def bench() -> None:
    import torch

    from dense_gemv import SHAPES, graph_time
    from tinyoss.kernels import linear_triton as lt
    from tinyoss.model.quant_linear import quantize_fp8

    dev = torch.device("cuda")
    for name, (n, k) in SHAPES.items():
        sets = 4 if n < 100000 else 1
        ws = [torch.randn(n, k, device=dev).to(torch.bfloat16) * 0.02 for _ in range(sets)]
        x = torch.randn(1, k, device=dev).to(torch.bfloat16)
        for label, _, scale, bn, bk in CASES:
            qs = [quantize_fp8(w) for w in ws] if scale else [(w, None) for w in ws]
            mb = sum(q.numel() * q.element_size() for q, _ in qs) / sets / 1e6
            cfg = lt.GemvConfig(1, bn, bk, 4, 4)
            out = torch.empty(1, n, dtype=x.dtype, device=dev)

            def two_d(q, s):
                gemv_2d[(triton.cdiv(n, bn), 1)](
                    x, q, out if s is None else s, out, out, 1, n, k, HAS_SCALE=s is not None,
                    HAS_BIAS=False, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, STAGES=4, num_warps=4,
                    num_stages=4)
                return out

            ref = lt.linear_gemv(x, qs[0][0], None, cfg, scale=qs[0][1]).float()
            err = ((two_d(*qs[0]).float() - ref).norm() / ref.norm()).item()
            t3 = graph_time(lambda: [lt.linear_gemv(x, q, None, cfg, scale=s) for q, s in qs],
                            sets)
            t2 = graph_time(lambda: [two_d(q, s) for q, s in qs], sets)
            print(f"{name:8s} {label:5s} {mb:7.1f} MB  3-D {t3:7.1f} us {mb / t3 * 1e3:5.0f} GB/s"
                  f"  2-D {t2:7.1f} us {mb / t2 * 1e3:5.0f} GB/s  (2-D against 3-D {err:.0e})",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", action="store_true")
    if p.parse_args().bench:
        bench()
    else:
        os.environ.pop("TRITON_INTERPRET", None)
        offline()


if __name__ == "__main__":
    main()
