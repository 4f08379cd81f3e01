"""Times the MXFP4 dense-layer kernels (tinyoss.kernels.linear_mxfp4_triton) at gpt-oss-20b
shapes against bf16 `F.linear` (cuBLAS), for a few GEMV tile configs and row counts, on one GPU
(CUDA graphs, rotating weight sets so that L2 does not hold them).

    python bench/linear_mxfp4_sweep.py --rows 1,2,4,8,64 --configs 1/16/512/2/4,1/4/512/2/4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.moe_kernels import timed  # noqa: E402
from tinyoss.kernels import linear_mxfp4_triton as lt  # noqa: E402
from tinyoss.kernels.linear_mxfp4_torch import mxfp4_linear_torch  # noqa: E402
from tinyoss.model.quant_linear import quantize_weight  # noqa: E402

SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "lm_head": (201088, 2880)}  # [N, K]
L2_BYTES = 50 * 2**20


def sets_for(nbytes: int) -> int:
    """Weight sets that together overflow L2 twice, so every call reads its weight from DRAM."""
    return max(1, -(-2 * L2_BYTES // nbytes))


def random_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, k, device="cuda", generator=gen).mul_(0.02).to(torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", default="qkv,o,lm_head")
    p.add_argument("--rows", default="1,2,4,8,64")
    p.add_argument("--configs", default="1/16/512/2/4,1/4/512/2/4,1/8/512/2/4,4/4/256/2/4",
                   help="GEMV tiles: block_m/block_n/block_k/warps/stages")
    args = p.parse_args()
    for layer in args.layers.split(","):
        n, k = SHAPES[layer]
        mx_bytes = n * (k // 2 + k // 32)
        gen = torch.Generator(device="cuda").manual_seed(0)
        dense = [random_weight(n, k, gen) for _ in range(sets_for(n * k * 2))]
        packed = [quantize_weight(random_weight(n, k, gen)) for _ in range(sets_for(mx_bytes))]
        bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            ref = mxfp4_linear_torch(x, *packed[0], bias).float()
            us = timed(F.linear, [(x, w, bias) for w in dense])
            row = [f"{layer:<7} M={m:<4} bf16 {us:7.1f} us {n * k * 2 / us / 1e3:5.0f} GB/s"]
            sets = [(x, b, s, bias) for b, s in packed]
            us = timed(lt.mxfp4_linear, sets)
            row.append(f"default {us:7.1f} us {mx_bytes / us / 1e3:5.0f} GB/s")
            for c in args.configs.split(",") if m <= lt.GEMV_MAX_M else ():
                cfg = lt.GemvConfig(*map(int, c.split("/")))
                err = (lt.linear_gemv(*sets[0], cfg).float() - ref).norm() / ref.norm()
                us = timed(lambda *a, cfg=cfg: lt.linear_gemv(*a, cfg), sets)
                row.append(f"{c}: {us:7.1f} us {mx_bytes / us / 1e3:5.0f} GB/s err {err:.0e}")
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
