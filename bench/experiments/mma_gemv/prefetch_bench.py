"""Does prefetching the down weights into L2 from the gate_up kernel pay? The pair gate_up
kernel's variants 60-63 (pair_tiles.cu) each send their share of their pair's down weights to L2
with one bulk prefetch (and 61, 63 load their own weights first to evict), so down reads L2. Times
gate_up + down (Gluon's down and the tensor-core down) against the engine's pair path, with
errors against it, and gate_up alone; CUDA-graph replays over 4 rotating weight sets.

    python bench/experiments/mma_gemv/prefetch_bench.py --tokens 1,2,4
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.experiments.mma_gemv.sweep_pair import build  # noqa: E402
from bench.moe_kernels import call_sets, timed, weights  # noqa: E402
from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels.hardware import capability  # noqa: E402
from tinyoss.kernels.moe_gemv_gluon import pair_gemv_gluon  # noqa: E402
from tinyoss.kernels.moe_gemv_mma import load  # noqa: E402
from tinyoss.kernels.moe_triton import GemvConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,2,4")
    p.add_argument("--variants", default="60,61,62,63")
    args = p.parse_args()
    mma, why = load(capability())
    if mma is None:
        raise SystemExit(f"the tensor-core MoE GEMV cannot run here: {why}")
    lib = build()
    lib.tinyoss_set_prefetch.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                                         ctypes.c_long]
    h = i = 2880
    cfg = GemvConfig()
    ws = [weights(s, 32, h, i) for s in range(4)]
    ws = [replace(w, gate_up_bias=w.gate_up_bias.bfloat16(), down_bias=w.down_bias.bfloat16())
          for w in ws]
    for t in map(int, args.tokens.split(",")):
        sets = []
        for x, wts, ids, w in call_sets(t, ws):
            sets.append(dict(x=x, wts=wts, ids=ids.to(torch.int32), w=w,
                             flat=wts.reshape(-1).float().contiguous(),
                             act=torch.empty(t * 4, i, device="cuda"),
                             y=torch.empty(t * 4, h, device="cuda")))

        def engine(c):
            return mt._gemv_pairs(c["x"], c["wts"], c["ids"], c["w"], None, mma)

        def gate(c, v):
            w, ids = c["w"], c["ids"].view(-1)
            if v is None:
                mma.gate_up(c["x"], 4, ids, w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias,
                            c["flat"], c["act"], w.alpha, w.limit)
                return
            lib.tinyoss_set_prefetch(w.down_blocks.data_ptr(), w.down_blocks.stride(0),
                                     w.down_scales.data_ptr(), w.down_scales.stride(0))
            b, s = w.gate_up_blocks, w.gate_up_scales
            err = lib.tinyoss_pair_variant(
                v, c["x"].data_ptr(), 4, ids.data_ptr(), ids.numel(), b.data_ptr(), s.data_ptr(),
                w.gate_up_bias.data_ptr(), c["flat"].data_ptr(), c["act"].data_ptr(), 2 * i, h,
                b.stride(0), b.stride(1), s.stride(0), w.alpha, w.limit,
                torch.cuda.current_stream().cuda_stream)
            assert err == 0, (v, err)

        def down(c, gluon: bool):
            w, ids = c["w"], c["ids"].view(-1)
            if gluon:
                pair_gemv_gluon(c["act"], 1, ids, w.down_blocks, w.down_scales, w.down_bias,
                                c["flat"], c["y"], h, i, w.alpha, w.limit, swiglu=False,
                                block_n=cfg.block_n2, block_k=cfg.block_k,
                                num_warps=cfg.num_warps)
            else:
                mma.down(c["act"], ids, w.down_blocks, w.down_scales, w.down_bias, c["flat"],
                         c["y"], w.alpha, w.limit)
            return c["y"]

        ref = engine(sets[0]).clone()
        us = timed(lambda: [engine(c) for c in sets], [()]) / len(sets)
        print(f"T={t} engine pair path {us:6.1f} us", flush=True)
        for v in [None, *map(int, args.variants.split(","))]:
            name = "product gate_up" if v is None else lib.tinyoss_pair_variant_name(v).decode()
            us = timed(lambda v=v: [gate(c, v) for c in sets], [()]) / len(sets)
            row = [f"T={t} {name:<36} alone {us:6.1f}"]
            for gluon in (True, False):
                gate(sets[0], v)
                err = ((down(sets[0], gluon) - ref).norm() / ref.norm()).item()
                us = timed(lambda v=v, g=gluon: [(gate(c, v), down(c, g)) for c in sets],
                           [()]) / len(sets)
                row.append(f"+ {'gluon' if gluon else 'mma'} down {us:6.1f} (err {err:.0e})")
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
