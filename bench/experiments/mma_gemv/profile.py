"""One eager call of each MoE path at gpt-oss-20b shapes, for Nsight Compute to read: the
tensor-core pair kernels, the product's choice for the step (`_gemv_pairs`: at 1 token Gluon's
down) and its kernels grouped by expert (with `sort_pairs`) at each token count, plus the
grouped variants of pair_tiles.cu named by --variants.

    ncu --clock-control none -k regex:'group|pair_gemv' --section SpeedOfLight \
        --section Occupancy --section WarpStateStats \
        python bench/experiments/mma_gemv/profile.py --tokens 8,16,64
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.experiments.mma_gemv.sweep_pair import build  # noqa: E402
from bench.moe_kernels import call_sets, weights  # noqa: E402
from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels.hardware import capability  # noqa: E402
from tinyoss.kernels.moe_gemv_mma import load  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="8,16,64")
    p.add_argument("--variants", default="", help="pair_tiles.cu grouped variants, e.g. 130,140")
    args = p.parse_args()
    mma, why = load(capability())
    if mma is None:
        raise SystemExit(f"the tensor-core MoE GEMV cannot run here: {why}")
    lib = build() if args.variants else None
    h = i = 2880
    w = weights(0, 32, h, i)
    w = replace(w, gate_up_bias=w.gate_up_bias.bfloat16(), down_bias=w.down_bias.bfloat16())
    for t in map(int, args.tokens.split(",")):
        x, wts, ids, _ = call_sets(t, [w])[0]
        ids32 = ids.reshape(-1).to(torch.int32)
        flat = wts.reshape(-1).float().contiguous()
        act = torch.empty(t * 4, i, device="cuda")
        y = torch.empty(t * 4, h, device="cuda")
        print(f"T={t}: pair kernels, then grouped", flush=True)
        mma.gate_up(x, 4, ids32, w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias, flat, act,
                    w.alpha, w.limit)
        mma.down(act, ids32, w.down_blocks, w.down_scales, w.down_bias, flat, y, w.alpha,
                 w.limit)
        mt._gemv_pairs(x, flat.view(t, 4), ids, w, None, mma)
        mt._grouped_pairs(x, flat.view(t, 4), ids, w, mma)
        sid, order, groups = mma.sort_pairs(ids32, 32)
        for v in filter(None, args.variants.split(",")):
            gate = "gate_up" in lib.tinyoss_grouped_variant_name(int(v)).decode()
            b, s, bias = ((w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias) if gate else
                          (w.down_blocks, w.down_scales, w.down_bias))
            src, div, out = (x, 4, act) if gate else (act, 1, y)
            err = lib.tinyoss_grouped_variant(
                int(v), src.data_ptr(), div, groups.data_ptr(), groups.numel(), sid.data_ptr(),
                order.data_ptr(), sid.numel(), b.data_ptr(), s.data_ptr(), bias.data_ptr(),
                flat.data_ptr(), out.data_ptr(), b.shape[1], b.shape[2] * 32, b.stride(0),
                b.stride(1), s.stride(0), w.alpha, w.limit,
                torch.cuda.current_stream().cuda_stream)
            assert err == 0, (v, err)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
