"""Programmatic dependent launch with the weights loaded before the wait: does a chain of decode
GEMVs lose less time between kernels when each kernel starts streaming its weights while the one
before it finishes?

    python bench/experiments/pdl_prefetch/bench.py [--capture-stream current]

A GEMV's weights do not depend on the kernel before it, only x does. Each GEMV here loads its
first PRE K steps of weights into registers, waits for the previous kernel
(griddepcontrol.wait), then reads x; it lets the next kernel launch
(griddepcontrol.launch_dependents) where TRIGGERS says. Chains, all in one CUDA graph: 24 x (q/k/v, o) and 24 x (q/k/v, small, o, small), where
`small` is an elementwise kernel standing in for attention and the norms.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _gemv_pdl(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              STAGES: tl.constexpr, PDL: tl.constexpr, PRE: tl.constexpr, TRIG: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    wp = w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    if PRE >= 1:
        w0 = tl.load(wp, mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
    if PRE >= 2:
        w1 = tl.load(wp + BLOCK_K, mask=row_ok[:, None] & (BLOCK_K + cols < K)[None, :],
                     other=0.0)
    if PDL:
        if TRIG == 0:
            gdc_launch_dependents()
        gdc_wait()
        if TRIG == 1:
            gdc_launch_dependents()
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    if PRE >= 1:
        acc += tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :] * w0.to(
            tl.float32)
    if PRE >= 2:
        acc += tl.load(x_ptr + BLOCK_K + cols, mask=BLOCK_K + cols < K, other=0.0).to(
            tl.float32)[None, :] * w1.to(tl.float32)
    for k0 in tl.range(PRE * BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        w = tl.load(wp + k0, mask=row_ok[:, None] & (k0 + cols < K)[None, :], other=0.0)
        x = tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0)
        acc += x.to(tl.float32)[None, :] * w.to(tl.float32)
    if PDL and TRIG == 2:
        gdc_launch_dependents()
    tl.store(out_ptr + rows, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _small(x_ptr, out_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr, TRIG: tl.constexpr):
    if PDL:
        if TRIG == 0:
            gdc_launch_dependents()
        gdc_wait()
        if TRIG != 0:
            gdc_launch_dependents()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + i, mask=i < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, (v * 0.5 + 0.01).to(out_ptr.dtype.element_ty), mask=i < N)


def gemv(x, w, pdl, pre, trig, block_n=8, block_k=512, warps=4, stages=4):
    n, k = w.shape
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    _gemv_pdl[(triton.cdiv(n, block_n),)](x, w, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
                                          STAGES=stages, PDL=pdl, PRE=pre, TRIG=trig,
                                          num_warps=warps,
                                          num_stages=stages, launch_pdl=pdl)
    return out


def small(x, pdl, trig, programs=16):
    out = torch.empty_like(x)
    block = triton.next_power_of_2(triton.cdiv(x.numel(), programs))
    _small[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), BLOCK=block, PDL=pdl,
                                             TRIG=trig, launch_pdl=pdl)
    return out


CAPTURE_ON_REPLAY_STREAM = False  # --capture-stream current
# Where each kernel lets the next one launch (griddepcontrol.launch_dependents): 0 before its own
# wait (the first runs' placement: every kernel of the chain can then launch at once, each
# waiting, holding SM slots), 1 right after its wait, 2 after its main loop (the GEMV's; the small
# kernel's after its wait).
TRIGGERS = (0, 1, 2)


def graph_time(fn) -> float:
    """The chain's time in one graph replayed on the current stream; captured on torch's side
    stream (its default) or, with --capture-stream current, on the stream it replays on (the
    side stream cost +17..27 us a replay once several graphs existed:
    bench/results/2026-11-27_session28.md, which this script's first runs had)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    on = torch.cuda.current_stream() if CAPTURE_ON_REPLAY_STREAM else None
    with torch.cuda.graph(graph, stream=on):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=300) * 1e3


def main() -> None:
    global CAPTURE_ON_REPLAY_STREAM
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capture-stream", choices=("side", "current"), default="side")
    CAPTURE_ON_REPLAY_STREAM = p.parse_args().capture_stream == "current"
    dev = torch.device("cuda")
    torch.manual_seed(0)
    qkv = [torch.randn(5120, 2880, device=dev).to(torch.bfloat16) * 0.02 for _ in range(24)]
    o = [torch.randn(2880, 4096, device=dev).to(torch.bfloat16) * 0.02 for _ in range(24)]
    x0 = torch.randn(2880, device=dev).to(torch.bfloat16)
    mb = 24 * (5120 * 2880 + 2880 * 4096) * 2 / 1e6
    print(f"{torch.cuda.get_device_name()} | chain of 24 layers, {mb:.0f} MB of weights")

    def chain(pdl, pre, trig, gap, cfg):
        h = x0
        for a, b in zip(qkv, o):
            h = gemv(h, a, pdl, pre, trig, *cfg)[:4096]
            if gap:
                h = small(h, pdl, trig)
            h = gemv(h, b, pdl, pre, trig, *cfg)
            if gap:
                h = small(h, pdl, trig)
        return h

    for cfg in [(8, 512, 4, 4), (8, 256, 4, 6), (16, 256, 4, 4)]:
        for gap in (False, True):
            ref = chain(False, 0, 0, gap, cfg).float()
            print(f"cfg {cfg} gap {gap}:", flush=True)
            runs = [(False, 0, 0)] + [(True, pre, trig) for trig in TRIGGERS for pre in (0, 1, 2)]
            for pdl, pre, trig in runs:
                got = chain(pdl, pre, trig, gap, cfg).float()
                same = torch.equal(got, ref)
                us = graph_time(lambda: chain(pdl, pre, trig, gap, cfg))
                print(f"  pdl={int(pdl)} trig={trig} pre={pre} {us:6.1f} us"
                      f" {mb / us * 1e3:5.0f} GB/s{'' if same else ' DIFFERENT'}", flush=True)


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):  # a stream that may capture (not the default)
        sys.exit(main())
