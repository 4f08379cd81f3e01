"""Tensor-core MoE GEMVs against the Gluon pair GEMV at gpt-oss-20b shapes on one GPU: the
product's pair kernel (tinyoss/kernels/moe_gemv_mma.cu, both projections at every token count;
the engine runs Gluon's down below DOWN_MIN_TOKENS) and this folder's expert-grouped variant
(grouped_gemv_mma.cu: up to 8 pairs of one expert share a program, one per column of B).
Errors against the Gluon kernel's fp32 pair outputs; microseconds of gate_up + down (no combine),
replayed from CUDA graphs over 4 rotating weight sets.

    python bench/experiments/mma_gemv/bench.py --tokens 1,2,4,8,16,64
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.moe_kernels import call_sets, timed, weights  # noqa: E402
from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels.hardware import capability  # noqa: E402
from tinyoss.kernels.moe_gemv_mma import load  # noqa: E402

DECL = """
void gate_up_grouped(torch::Tensor x, int64_t x_div, torch::Tensor sorted_ids,
                     torch::Tensor order, torch::Tensor q, torch::Tensor s, torch::Tensor bias,
                     torch::Tensor wts, torch::Tensor out, double alpha, double limit,
                     int64_t variant);
void down_grouped(torch::Tensor x, int64_t x_div, torch::Tensor sorted_ids, torch::Tensor order,
                  torch::Tensor q, torch::Tensor s, torch::Tensor bias, torch::Tensor wts,
                  torch::Tensor out, double alpha, double limit, int64_t variant);
"""
# grouped combinations: (gate_up variant, down variant), see grouped_gemv_mma.cu
GROUPED = {"g0": (0, 0), "g1": (1, 1), "g2": (1, 2), "g3": (3, 3), "g4": (4, 4)}


def build_grouped():
    here = Path(__file__).parent
    return load_inline("tinyoss_grouped_gemv_mma", cpp_sources=DECL,
                       cuda_sources=(here / "grouped_gemv_mma.cu").read_text(),
                       functions=["gate_up_grouped", "down_grouped"],
                       extra_include_paths=[str(here)],
                       extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,2,4,8,16,64")
    p.add_argument("--grouped", default="g0,g1,g2")
    p.add_argument("--parts", action="store_true", help="time the grouped kernels one at a time")
    args = p.parse_args()
    mma, why = load(capability())
    if mma is None:
        raise SystemExit(f"the tensor-core MoE GEMV cannot run here: {why}")
    ext = build_grouped() if args.grouped else None
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
                gub=w.gate_up_bias.float(), dnb=w.down_bias.float(),
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
                c["sid"], order = torch.sort(c["ids32"], stable=True)
                c["order"] = order.to(torch.int32)

            def part(c, which):
                w, sid, order = c["w"], c["sid"], c["order"]
                if which == "product gate_up":
                    mma.grouped(c["x"], 4, sid, order, w.gate_up_blocks, w.gate_up_scales,
                                w.gate_up_bias, c["flat_wts"], c["act"], w.alpha, w.limit, True)
                elif which == "product down":
                    mma.grouped(c["act"], 1, sid, order, w.down_blocks, w.down_scales,
                                w.down_bias, c["flat_wts"], c["y"], w.alpha, w.limit, False)
                elif which == "g3 gate_up":
                    ext.gate_up_grouped(c["x"], 4, sid, order, w.gate_up_blocks, w.gate_up_scales,
                                        c["gub"], c["flat_wts"], c["act"], w.alpha, w.limit, 3)
                elif which == "g3 down":
                    ext.down_grouped(c["act"], 1, sid, order, w.down_blocks, w.down_scales,
                                     c["dnb"], c["flat_wts"], c["y"], w.alpha, w.limit, 3)
                elif which == "torch.sort":
                    torch.sort(c["ids32"], stable=True)[1].to(torch.int32)
                else:
                    mma.sort_pairs(c["ids32"])

            for which in ("product gate_up", "g3 gate_up", "product down", "g3 down",
                          "torch.sort", "sort_pairs"):
                us = timed(each(lambda c, which=which: part(c, which)), [()]) / len(sets)
                print(f"T={t:<3} {which:<16} {us:6.1f} us", flush=True)
        for name in filter(None, args.grouped.split(",")):
            vg, vd = GROUPED[name]

            def grouped(c, vg=vg, vd=vd):
                w = c["w"]
                sid, order = torch.sort(c["ids32"], stable=True)
                order = order.to(torch.int32)
                ext.gate_up_grouped(c["x"], 4, sid, order, w.gate_up_blocks, w.gate_up_scales,
                                    c["gub"], c["flat_wts"], c["act"], w.alpha, w.limit, vg)
                ext.down_grouped(c["act"], 1, sid, order, w.down_blocks, w.down_scales,
                                 c["dnb"], c["flat_wts"], c["y"], w.alpha, w.limit, vd)
                return c["y"]

            err = (grouped(sets[0]) - ref).norm() / ref.norm()
            us = timed(each(grouped), [()]) / len(sets)
            row.append(f"grouped {name} (with the sort) {us:6.1f} us (err {err:.0e})")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
