"""Times the pair-GEMV MoE path (tinyoss.kernels.moe_triton.moe_gemv) at gpt-oss-20b shapes
for a few tile configs and token counts, against the decode path, on one GPU (CUDA graphs,
rotating weight sets so L2 does not hold them)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels.moe_torch import ExpertWeights, moe_torch  # noqa: E402
from tinyoss.model.layout import TensorSpec  # noqa: E402
from tinyoss.model.synthetic import random_experts  # noqa: E402


def weights(seed: int, e: int, h: int, i: int) -> ExpertWeights:
    dev = torch.device("cuda")
    gb, gs = random_experts(TensorSpec("mlp.experts.gate_up_proj_blocks", (e, 2 * i, h // 32, 16),
                                       "U8"), seed, dev)
    db, ds = random_experts(TensorSpec("mlp.experts.down_proj_blocks", (e, h, i // 32, 16), "U8"),
                            seed, dev)
    return ExpertWeights(gb, gs, torch.randn(e, 2 * i, device=dev) * 0.1, db, ds,
                         torch.randn(e, h, device=dev) * 0.1)


def timed(fn, sets) -> float:
    """Median microseconds of one call, replayed from a CUDA graph over rotating sets."""
    fn(*sets[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in sets:
            fn(*args)
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200) * 1e3 / len(sets)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--configs", default="16/16/512/4/3,16/16/256/4/3,32/16/512/4/3,"
                   "16/16/512/8/4,8/8/512/4/3")  # block_n1/block_n2/block_k/warps/stages
    p.add_argument("--experts", type=int, default=32)
    args = p.parse_args()
    e, h, i = args.experts, 2880, 2880
    ws = [weights(s, e, h, i) for s in range(4)]
    for t in map(int, args.tokens.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(t)
        sets = []
        for w in ws:
            x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:4]
                               for _ in range(t)])
            wts = torch.softmax(torch.randn(t, 4, device="cuda", generator=gen), -1)
            sets.append((x, wts, ids, w))
        ref = moe_torch(*sets[0])
        mb = len(torch.unique(sets[0][2])) * (2 * i * h // 2 * 1.0625 + h * i // 2 * 1.0625) / 1e6
        row = [f"T={t:<3} hit-experts {mb:6.1f} MB"]
        for c in args.configs.split(","):
            n1, n2, k, warps, stages = map(int, c.split("/"))
            cfg = mt.GemvConfig(n1, n2, k, warps, stages)
            out = mt.moe_gemv(*sets[0], cfg)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            us = timed(lambda *a, cfg=cfg: mt.moe_gemv(*a, cfg), sets)
            row.append(f"{c}: {us:6.1f} us {mb / us * 1e3:5.0f} GB/s err {err:.1e}")
        us = timed(mt.moe_decode, sets)
        row.append(f"decode-path: {us:6.1f} us")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
