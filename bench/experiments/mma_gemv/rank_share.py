"""The MoE at a tensor-parallel rank's share (intermediate units 2880, 1440, 736 at TP 1, 2, 4).
Up to 8 tokens: down by Gluon's pair GEMV (the engine's below DOWN_MIN_TOKENS) over a few tiles
against the tensor-core pair kernel. From 9 tokens (--grouped): both projections grouped by
expert on the tensor cores against the grouped GEMMs (`moe_prefill`'s, what a rank's share
took before the grouped kernels cut their K tail). Microseconds a call from CUDA graphs over 4
rotating weight sets; errors against Gluon's.

    python bench/experiments/mma_gemv/rank_share.py --tp 1,2,4 --tokens 1,2,4
    python bench/experiments/mma_gemv/rank_share.py --tp 1,2,4 --tokens 16,32,64 --grouped
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.moe_kernels import call_sets, timed, weights  # noqa: E402
from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels.hardware import capability  # noqa: E402
from tinyoss.kernels.moe_gemv_gluon import pair_gemv_gluon  # noqa: E402
from tinyoss.kernels.moe_gemv_mma import load  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", default="1,2,4")
    p.add_argument("--tokens", default="1,2,4")
    p.add_argument("--grouped", action="store_true", help="9-64 tokens: grouped kernels")
    args = p.parse_args()
    mma, why = load(capability())
    if mma is None:
        raise SystemExit(f"the tensor-core MoE GEMV cannot run here: {why}")
    h = 2880
    for tp in map(int, args.tp.split(",")):
        i = -(-2880 // tp // 32) * 32
        ws = [weights(s, 32, h, i) for s in range(4)]
        ws = [replace(w, gate_up_bias=w.gate_up_bias.bfloat16(), down_bias=w.down_bias.bfloat16())
              for w in ws]
        for t in map(int, args.tokens.split(",")):
            if args.grouped:
                grouped(mma, ws, tp, i, t)
                continue
            sets = []
            for x, wts, ids, w in call_sets(t, ws):
                pairs = ids.numel()
                act = torch.empty(pairs, i, device="cuda")
                ids32 = ids.reshape(-1).to(torch.int32)
                flat = wts.reshape(-1).float().contiguous()
                mma.gate_up(x, 4, ids32, w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias,
                            flat, act, w.alpha, w.limit)
                sets.append(dict(x=x, ids=ids.reshape(-1), ids32=ids32, wts=flat, w=w, act=act,
                                 y=torch.empty(pairs, h, device="cuda")))

            def gluon_down(c, bn=8, bk=1024, warps=1):
                w = c["w"]
                pair_gemv_gluon(c["act"], 1, c["ids"], w.down_blocks, w.down_scales, w.down_bias,
                                c["wts"], c["y"], h, i, w.alpha, w.limit, swiglu=False,
                                block_n=bn, block_k=bk, num_warps=warps)
                return c["y"]

            def mma_down(c):
                w = c["w"]
                mma.down(c["act"], c["ids32"], w.down_blocks, w.down_scales, w.down_bias,
                         c["wts"], c["y"], w.alpha, w.limit)
                return c["y"]

            def each(fn, **kw):
                return lambda: [fn(c, **kw) for c in sets]

            ref = gluon_down(sets[0]).clone()
            row = [f"TP {tp} K {i} T={t}"]
            for bn, bk, warps in ((8, 1024, 1), (4, 1024, 1), (16, 1024, 1), (8, 512, 1),
                                  (16, 512, 2), (8, 256, 1)):
                if bk > i:
                    continue
                got = gluon_down(sets[0], bn, bk, warps)
                err = ((got - ref).norm() / ref.norm()).item()
                us = timed(each(gluon_down, bn=bn, bk=bk, warps=warps), [()]) / len(sets)
                row.append(f"gluon down {bn}x{bk}/{warps}w {us:5.1f} us ({err:.0e})")
            err = ((mma_down(sets[0]) - ref).norm() / ref.norm()).item()
            us = timed(each(lambda c: mma_down(c)), [()]) / len(sets)
            row.append(f"mma down {us:5.1f} us ({err:.0e})")
            print(" | ".join(row), flush=True)


def grouped(mma, ws, tp: int, i: int, t: int) -> None:
    sets = call_sets(t, ws)
    x, wts, ids, w = sets[0]
    ref = mt._gemv_pairs(x, wts, ids, w, None)
    row = [f"TP {tp} K {i} T={t}"]
    for name, fn in (("grouped mma", lambda x, wts, ids, w: mt._grouped_pairs(x, wts, ids, w, mma)),
                     ("grouped GEMMs", lambda x, wts, ids, w: mt._prefill_pairs(x, wts, ids, w,
                                                                                 None))):
        err = ((fn(x, wts, ids, w) - ref).norm() / ref.norm()).item()
        us = timed(fn, sets)
        row.append(f"{name} {us:6.1f} us ({err:.0e})")
    print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
