"""Times the Triton MoE paths (tinyoss.kernels.moe_triton) at gpt-oss shapes on one GPU.

For each token count T: the default dispatch (`moe_triton`), the pair GEMV with a few tile
configs (T <= --gemv-max), and the grouped GEMMs with a few token/row tiles, each against
`moe_torch` first. Calls replay from a CUDA graph over rotating weight sets so L2 does not hold
them; the table gives microseconds, the MB of experts hit and GB/s.

    python bench/moe_kernels.py --tokens 1,2,8,16,32,64,512
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels.moe_torch import ExpertWeights, moe_torch  # noqa: E402
from tinyoss.model.layout import TensorSpec  # noqa: E402
from tinyoss.model.synthetic import random_experts  # noqa: E402

# block_n1/block_n2/block_k/warps/stages; on a GPU the Gluon kernel runs them, which takes
# block_k 256-1024 (`moe_gemv_gluon.check`)
GEMV_CONFIGS = "8/8/1024/1/4,8/8/512/1/4,16/16/512/2/4,4/4/1024/1/4"
# block_m/warps[/block_n/block_k/stages]; block_n is one tile for both GEMMs, or n1:n2
GEMM_CONFIGS = "16/4,32/8,64/8,128/8"


def weights(seed: int, e: int, h: int, i: int) -> ExpertWeights:
    dev = torch.device("cuda")
    gate_up = TensorSpec("mlp.experts.gate_up_proj_blocks", (e, 2 * i, h // 32, 16), "U8")
    gb, gs = random_experts(gate_up, seed, dev)
    db, ds = random_experts(TensorSpec("mlp.experts.down_proj_blocks", (e, h, i // 32, 16), "U8"),
                            seed, dev)
    return ExpertWeights(gb, gs, torch.randn(e, 2 * i, device=dev) * 0.1, db, ds,
                         torch.randn(e, h, device=dev) * 0.1)


def call_sets(t: int, ws: list[ExpertWeights]) -> list[tuple]:
    """(x, topk weights, top-4 ids, experts) of T random bf16 tokens for each weight set."""
    gen = torch.Generator(device="cuda").manual_seed(t)
    sets = []
    for w in ws:
        e, h = w.gate_up_blocks.shape[0], w.down_blocks.shape[1]
        x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:4] for _ in range(t)])
        wts = torch.softmax(torch.randn(t, 4, device="cuda", generator=gen), -1)
        sets.append((x, wts, ids, w))
    return sets


def timed(fn, sets) -> float:
    """Median microseconds of one call, replayed from a CUDA graph over rotating sets."""
    fn(*sets[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in sets:
            fn(*args)
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200) * 1e3 / len(sets)


def candidates(t: int, e: int, args: argparse.Namespace) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = [("default", mt.moe_triton)]
    if t <= args.gemv_max:
        for c in args.gemv_configs.split(","):
            cfg = mt.GemvConfig(*map(int, c.split("/")))
            out.append((f"gemv {c}", lambda *a, cfg=cfg: mt.moe_gemv(*a, cfg)))
    base = mt.prefill_config(t, e, 4)
    for c in args.gemm_configs.split(","):
        block_m, warps, *rest = c.split("/")
        block_m, warps = int(block_m), int(warps)
        cfg = replace(base, block_m=block_m, num_warps=warps)
        if rest:  # block_n (both GEMMs, or gate_up:down), block_k, stages
            n, k, stages = rest
            n1, _, n2 = n.partition(":")
            cfg = replace(cfg, block_n1=int(n1), block_n2=int(n2 or n1), block_k=int(k),
                          num_stages=int(stages))
        out.append((f"gemm {c}", lambda *a, cfg=cfg: mt.moe_prefill(*a, cfg)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,2,8,16,32,64,512")
    p.add_argument("--experts", type=int, default=32, help="32: gpt-oss-20b, 128: 120b")
    p.add_argument("--gemv-max", type=int, default=16)
    p.add_argument("--gemv-configs", default=GEMV_CONFIGS)
    p.add_argument("--gemm-configs", default=GEMM_CONFIGS)
    args = p.parse_args()
    e, h, i = args.experts, 2880, 2880
    ws = [weights(s, e, h, i) for s in range(4)]
    expert_mb = (2 * i * h + h * i) * (0.5 + 1 / 32) / 1e6
    for t in map(int, args.tokens.split(",")):
        sets = call_sets(t, ws)
        ref = moe_torch(*sets[0])
        mb = len(torch.unique(sets[0][2])) * expert_mb
        row = [f"T={t:<4} experts hit {mb:6.1f} MB"]
        for name, fn in candidates(t, e, args):
            try:
                err = ((fn(*sets[0]).float() - ref.float()).norm() / ref.float().norm()).item()
            except (triton.runtime.errors.OutOfResources, ValueError) as exc:  # a tile not allowed
                row.append(f"{name}: {exc}")
                continue
            us = timed(fn, sets)
            row.append(f"{name}: {us:7.1f} us {mb / us * 1e3:5.0f} GB/s err {err:.0e}")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
