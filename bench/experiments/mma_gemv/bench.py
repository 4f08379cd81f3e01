"""The MoE's tensor-core GEMVs against the Gluon pair GEMV and the grouped GEMMs at gpt-oss-20b
shapes on one GPU: the product's pair kernels (tinyoss/kernels/moe_gemv_mma.cu, both projections
at every token count; the engine runs Gluon's down below DOWN_MIN_TOKENS) and its kernel grouped
by expert (`moe_triton._grouped_pairs`, at every token count; the engine groups from
GEMV_MAX_TOKENS + 1 to GROUPED_MAX_TOKENS). Errors against the Gluon kernel's fp32 pair outputs;
microseconds of gate_up + down (no combine), replayed from CUDA graphs over 4 rotating weight
sets. `--parts` times the grouped kernels and the sorts one at a time.

    python bench/experiments/mma_gemv/bench.py --tokens 1,2,4,8,16,32,64
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
from tinyoss.kernels.moe_gemv_mma import load  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,2,4,8,16,64")
    p.add_argument("--parts", action="store_true", help="time the grouped kernels one at a time")
    args = p.parse_args()
    mma, why = load(capability())
    if mma is None:
        raise SystemExit(f"the tensor-core MoE GEMV cannot run here: {why}")
    h = i = 2880
    ws = [weights(s, 32, h, i) for s in range(4)]
    ws = [replace(w, gate_up_bias=w.gate_up_bias.bfloat16(), down_bias=w.down_bias.bfloat16())
          for w in ws]
    for t in map(int, args.tokens.split(",")):
        sets = []
        for x, wts, ids, w in call_sets(t, ws):
            pairs = ids.numel()
            sets.append(dict(
                x=x, wts=wts, ids=ids, ids32=ids.reshape(-1).to(torch.int32),
                flat_wts=wts.reshape(-1).float().contiguous(), w=w,
                act=torch.empty(pairs, i, device="cuda"), y=torch.empty(pairs, h, device="cuda")))

        def gluon(c):
            return mt._gemv_pairs(c["x"], c["wts"], c["ids"], c["w"], None)

        def pair_mma(c):
            w = c["w"]
            mma.gate_up(c["x"], 4, c["ids32"], w.gate_up_blocks, w.gate_up_scales,
                        w.gate_up_bias, c["flat_wts"], c["act"], w.alpha, w.limit)
            mma.down(c["act"], c["ids32"], w.down_blocks, w.down_scales, w.down_bias,
                     c["flat_wts"], c["y"], w.alpha, w.limit)
            return c["y"]

        def each(fn):
            return lambda: [fn(c) for c in sets]

        ref = gluon(sets[0]).clone()
        us = timed(each(gluon), [()]) / len(sets)
        row = [f"T={t:<3} gluon {us:6.1f} us"]
        err = (pair_mma(sets[0]) - ref).norm() / ref.norm()
        us = timed(each(pair_mma), [()]) / len(sets)
        row.append(f"pair mma {us:6.1f} us (err {err:.0e})")
        if t > mt.GEMV_MAX_TOKENS:  # where the engine runs the grouped GEMMs

            def gemms(c):
                return mt._prefill_pairs(c["x"], c["wts"], c["ids"], c["w"], None)

            err = (gemms(sets[0]) - ref).norm() / ref.norm()
            us = timed(each(gemms), [()]) / len(sets)
            row.append(f"grouped GEMMs {us:6.1f} us (err {err:.0e})")

        def product(c):  # also below GEMV_MAX_TOKENS, where the engine does not group
            return mt._grouped_pairs(c["x"], c["flat_wts"].view(t, 4), c["ids"], c["w"], mma)

        err = (product(sets[0]) - ref).norm() / ref.norm()
        us = timed(each(product), [()]) / len(sets)
        row.append(f"grouped mma (product) {us:6.1f} us (err {err:.0e})")
        if args.parts and t > mt.GEMV_MAX_TOKENS:  # the grouped kernels one at a time
            for c in sets:
                c["by_expert"] = mma.sort_pairs(c["ids32"], 32)

            def part(c, which):
                w, by_expert = c["w"], c["by_expert"]
                if which == "product gate_up":
                    mma.grouped(c["x"], 4, by_expert, w.gate_up_blocks, w.gate_up_scales,
                                w.gate_up_bias, c["flat_wts"], c["act"], w.alpha, w.limit, True)
                elif which == "product down":
                    mma.grouped(c["act"], 1, by_expert, w.down_blocks, w.down_scales,
                                w.down_bias, c["flat_wts"], c["y"], w.alpha, w.limit, False)
                elif which == "torch.sort":
                    torch.sort(c["ids32"], stable=True)[1].to(torch.int32)
                else:
                    mma.sort_pairs(c["ids32"], 32)

            for which in ("product gate_up", "product down", "torch.sort", "sort_pairs"):
                us = timed(each(lambda c, which=which: part(c, which)), [()]) / len(sets)
                print(f"T={t:<3} {which:<16} {us:6.1f} us", flush=True)
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
