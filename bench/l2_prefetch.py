"""Does L2 prefetch pay? Times, on one GPU and replayed from CUDA graphs over rotating weight
sets (so L2 starts cold), a q/k/v GEMV, a gap of short kernels (as rope and attention are),
then the o_proj GEMV: without prefetch, and with the q/k/v GEMV prefetching o_proj's weights
by each prefetch kind (`prefetch_triton.prefetch_share`); also o_proj alone cold and hot, and
the MoE pair GEMV (T=1) with gate_up prefetching the experts' down weights.

    python bench/l2_prefetch.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinyoss.kernels import launch  # noqa: E402
from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels.layer_ops_triton import rms_norm_triton  # noqa: E402
from tinyoss.kernels.linear_triton import linear_gemv  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_kernels import weights as expert_weights  # noqa: E402

KINDS = {0: "none", 1: "bulk", 2: "lines", 3: "lines evict_last"}


def graph_us(fn, n: int) -> float:
    """Median microseconds of one of n calls captured in one graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=300) * 1e3 / n


def set_kind(kind: int) -> None:
    launch.enable_prefetch(kind > 0)
    launch._prefetch_kind = max(kind, 1)


def main() -> None:
    dev = torch.device("cuda")
    sets = 6
    bf = torch.bfloat16
    x = torch.randn(1, 2880, device=dev).to(bf)
    a = torch.randn(1, 4096, device=dev).to(bf)
    nw = torch.ones(2880, device=dev)
    qkv = [(torch.randn(5120, 2880, device=dev) * 0.02).to(bf) for _ in range(sets)]
    o = [(torch.randn(2880, 4096, device=dev) * 0.02).to(bf) for _ in range(sets)]

    def gap() -> None:
        for _ in range(4):
            rms_norm_triton(x, nw, 1e-5)

    def chain() -> None:
        for wq, wo in zip(qkv, o):
            linear_gemv(x, wq, prefetch=(wo,))
            gap()
            linear_gemv(a, wo)

    set_kind(0)
    print(f"o_proj alone, cold: {graph_us(lambda: [linear_gemv(a, w) for w in o], sets):6.1f} us")
    print(f"o_proj alone, hot:  {graph_us(lambda: [linear_gemv(a, o[0]) for _ in o], sets):6.1f} us")
    print(f"gap alone:          {graph_us(lambda: [gap() for _ in o], sets):6.1f} us")
    for kind, name in KINDS.items():
        set_kind(kind)
        print(f"qkv + gap + o, prefetch {name:17s}: {graph_us(chain, sets):6.1f} us", flush=True)

    ws = [expert_weights(s, 32, 2880, 2880) for s in range(4)]
    gen = torch.Generator(device=dev).manual_seed(0)
    args = []
    for w in ws:
        ids = torch.randperm(32, device=dev, generator=gen)[:4].view(1, 4)
        wts = torch.softmax(torch.randn(1, 4, device=dev, generator=gen), -1)
        args.append((x, wts, ids, w))
    for kind, name in KINDS.items():
        set_kind(kind)
        us = graph_us(lambda: [mt.moe_gemv(*arg) for arg in args], len(args))
        print(f"MoE T=1 (gate_up, down, combine), prefetch {name:17s}: {us:6.1f} us", flush=True)
    set_kind(0)


if __name__ == "__main__":
    main()
