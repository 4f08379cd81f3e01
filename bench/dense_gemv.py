"""Times the dense bf16 decode GEMV (tinyoss.kernels.linear_triton) against cuBLAS (F.linear) at
gpt-oss shapes, alone and as a chain of 24 layers (q/k/v then o) in one CUDA graph, on one GPU.
With --fp8 the GEMV reads the weights in FP8 (`fp8_layers`: e4m3, a scale a row) against cuBLAS
on bf16, errors against the dequantized weights, GB/s of the FP8 bytes.

    python bench/dense_gemv.py --m 1,2,4 --configs 8/512/4/3,16/256/4/3
    python bench/dense_gemv.py --fp8 --m 1,2,4,8 --configs 8/1024/4/4,16/512/4/4,8/2048/4/4
    python bench/dense_gemv.py [--fp8] --mma --m 1,2,4,8 --configs 8/1024/4/4   # tensor cores

--mma adds the tensor-core GEMV and the streaming CUDA-core GEMV (`moe_gemv_mma`, Hopper with
nvcc; `mma` and `stream` in the output) on the same weights (the streaming one at 1-2 rows of
bf16, 1 of FP8: `python bench/dense_gemv.py --fp8 --mma --m 1` is the comparison of
bench/results/2026-11-27_h100_fp8_stream.md on the product's kernels).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinyoss.kernels import linear_triton as lt  # noqa: E402
from tinyoss.model.quant_linear import quantize_fp8  # noqa: E402

SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "router": (32, 2880), "lm_head": (201088, 2880)}


def graph_time(fn, reps: int = 1) -> float:
    """Median microseconds of fn() replayed from a CUDA graph, divided by reps."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200) * 1e3 / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", default="1,2,4")
    p.add_argument("--configs", default="8/512/4/3,16/256/4/3,4/512/2/3,8/256/2/4",
                   help="block_n/block_k/warps/stages (K steps through shared memory), each "
                        "with block_m from gemv_config")
    p.add_argument("--fp8", action="store_true", help="the GEMV on FP8 weights")
    p.add_argument("--mma", action="store_true", help="also the tensor-core GEMV")
    args = p.parse_args()
    dev = torch.device("cuda")
    mma = None
    if args.mma:
        from tinyoss.kernels.hardware import capability
        from tinyoss.kernels.moe_gemv_mma import load

        mma, why = load(capability())
        if mma is None:
            raise SystemExit(f"the tensor-core GEMV cannot run here: {why}")
    for name, (n, k) in SHAPES.items():
        sets = 4 if n < 100000 else 1  # rotate weight sets so L2 does not hold them
        ws = [torch.randn(n, k, device=dev).to(torch.bfloat16) * 0.02 for _ in range(sets)]
        bs = [torch.randn(n, device=dev).to(torch.bfloat16) for _ in range(sets)]
        # what the GEMV reads: (weight, scale or None) a set
        qs = [quantize_fp8(w) for w in ws] if args.fp8 else [(w, None) for w in ws]
        mb = n * k * 2 / 1e6
        gemv_mb = (n * k + 4 * n) / 1e6 if args.fp8 else mb
        for m in map(int, args.m.split(",")):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            q0, s0 = qs[0]
            w0 = q0.float() * s0[:, None] if args.fp8 else ws[0].float()
            ref = F.linear(x.float(), w0, bs[0].float())
            row = [f"{name:8s} M={m} {mb:7.1f} MB"]
            us = graph_time(lambda: [F.linear(x, w, b) for w, b in zip(ws, bs)], sets)
            row.append(f"cublas {us:7.1f} us {mb / us * 1e3:5.0f} GB/s")
            for c in args.configs.split(","):
                bn, bk, nw, ns = map(int, c.split("/"))
                base = lt.gemv_config(m, n, 1 if args.fp8 else 2)
                cfg = lt.GemvConfig(base.block_m, bn, max(32, bk // base.block_m), nw, ns)
                out = lt.linear_gemv(x, q0, bs[0], cfg, scale=s0).float()
                err = ((out - ref).norm() / ref.norm()).item()
                us = graph_time(lambda cfg=cfg: [lt.linear_gemv(x, q, b, cfg, scale=s)
                                                 for (q, s), b in zip(qs, bs)], sets)
                row.append(f"{c}: {us:7.1f} us {gemv_mb / us * 1e3:5.0f} GB/s err {err:.0e}")
            if mma is not None and mma.supports_linear(x, q0, s0, bs[0]):
                out = mma.linear(x, q0, bs[0], s0).float()
                err = ((out - ref).norm() / ref.norm()).item()
                us = graph_time(lambda: [mma.linear(x, q, b, s) for (q, s), b in zip(qs, bs)],
                                sets)
                row.append(f"mma: {us:7.1f} us {gemv_mb / us * 1e3:5.0f} GB/s err {err:.0e}")
            if mma is not None and mma.supports_stream(x, q0, bs[0], s0):
                out = mma.stream_linear(x, q0, bs[0], s0).float()
                err = ((out - ref).norm() / ref.norm()).item()
                us = graph_time(lambda: [mma.stream_linear(x, q, b, s)
                                         for (q, s), b in zip(qs, bs)], sets)
                row.append(f"stream: {us:7.1f} us {gemv_mb / us * 1e3:5.0f} GB/s err {err:.0e}")
            print(" | ".join(row), flush=True)
    # A chain: 24 layers of qkv then o, as a decode step runs them.
    qkv = [torch.randn(5120, 2880, device=dev).to(torch.bfloat16) * 0.02 for _ in range(24)]
    o = [torch.randn(2880, 4096, device=dev).to(torch.bfloat16) * 0.02 for _ in range(24)]
    x = torch.randn(1, 2880, device=dev).to(torch.bfloat16)
    mb = 24 * (5120 * 2880 + 2880 * 4096) * 2 / 1e6

    def chain(fn) -> None:
        h = x
        for a, b in zip(qkv, o):
            h = fn(fn(h, a)[:, :4096], b)

    row = [f"chain 24 x (qkv, o) {mb:.0f} MB"]
    us = graph_time(lambda: chain(F.linear))
    row.append(f"cublas {us:7.1f} us {mb / us * 1e3:5.0f} GB/s")
    us = graph_time(lambda: chain(lambda h, w: lt.linear_gemv(h, w)))
    row.append(f"triton {us:7.1f} us {mb / us * 1e3:5.0f} GB/s")
    if mma is not None:
        us = graph_time(lambda: chain(lambda h, w: mma.linear(h.contiguous(), w)))
        row.append(f"mma {us:7.1f} us {mb / us * 1e3:5.0f} GB/s")
        us = graph_time(lambda: chain(lambda h, w: mma.stream_linear(h.contiguous(), w)))
        row.append(f"stream {us:7.1f} us {mb / us * 1e3:5.0f} GB/s")
    if args.fp8:
        fp8 = {id(w): quantize_fp8(w) for w in qkv + o}
        us = graph_time(lambda: chain(lambda h, w: lt.linear_gemv(h, fp8[id(w)][0],
                                                                  scale=fp8[id(w)][1])))
        row.append(f"triton fp8 {us:7.1f} us {mb / 2 / us * 1e3:5.0f} GB/s (of the FP8 bytes)")
        if mma is not None:
            us = graph_time(lambda: chain(lambda h, w: mma.linear(
                h.contiguous(), fp8[id(w)][0], scale=fp8[id(w)][1])))
            row.append(f"mma fp8 {us:7.1f} us {mb / 2 / us * 1e3:5.0f} GB/s")
            us = graph_time(lambda: chain(lambda h, w: mma.stream_linear(
                h.contiguous(), fp8[id(w)][0], scale=fp8[id(w)][1])))
            row.append(f"stream fp8 {us:7.1f} us {mb / 2 / us * 1e3:5.0f} GB/s")
    print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
