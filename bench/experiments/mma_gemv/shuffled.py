"""Expert weights shuffled at load so a warp reads 512 contiguous bytes a load, each lane the
words of its MMA fragments (pair_tiles.cu: pair_gemv_shuf, group_gemv_shuf, and the streamed
pair_gemv_stream_shuf, group_gemv_stream_shuf), against the
product's kernels on the checkpoint's layout: errors against the product's outputs, us a call
(CUDA-graph replays over 4 weight sets), at gpt-oss-20b shapes. Not yet run.

    python bench/experiments/mma_gemv/shuffled.py --tokens 1,2,4,8          # pair kernels
    python bench/experiments/mma_gemv/shuffled.py --grouped --tokens 16,32,64
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


def shuffle(blocks: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """blocks [E, N, K/32, 16] (uint8, the checkpoint's) -> the same bytes shuffled within each
    16-row tile: for each pair of scale blocks jb, each lane (g, t) in lane order, 16 bytes: word
    t of blocks 2jb and 2jb + 1 of MMA rows g and g + 8 ([g 2jb, g+8 2jb, g 2jb+1, g+8 2jb+1]).
    MMA rows g, g + 8 are tile rows 2g, 2g + 1 for gate_up (gate and up interleaved), g, g + 8
    for down."""
    e, n, nblk, _ = blocks.shape
    if n % 16 or nblk % 2:
        raise ValueError(f"rows in 16s and an even number of blocks expected, got {n}, {nblk}")
    words = blocks.contiguous().view(torch.int32).view(e, n // 16, 16, nblk, 4)
    perm = [2 * g for g in range(8)] + [2 * g + 1 for g in range(8)] if swiglu else list(range(16))
    w = words[:, :, perm].view(e, n // 16, 2, 8, nblk // 2, 2, 4)  # [E, tile, h, g, jb, bb, t]
    w = w.permute(0, 1, 4, 3, 6, 5, 2)  # [E, tile, jb, g, t, bb, h]
    return w.contiguous().view(torch.uint8).view(e, n, nblk, 16)


def main() -> None:
    from bench.experiments.mma_gemv.sweep_pair import build
    from bench.moe_kernels import call_sets, timed, weights
    from tinyoss.kernels import moe_gemv_mma as mm
    from tinyoss.kernels.hardware import capability

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--grouped", action="store_true")
    args = p.parse_args()
    mma, why = mm.load(capability())
    if mma is None:
        raise SystemExit(f"the tensor-core MoE GEMV cannot run here: {why}")
    lib = build()
    lib.tinyoss_shuf_variant.argtypes = [ctypes.c_int] + mm._ARGS
    lib.tinyoss_shuf_grouped_variant.argtypes = [ctypes.c_int] + mm._GROUPED_ARGS[1:]
    lib.tinyoss_shuf_variant_name.argtypes = [ctypes.c_int]
    lib.tinyoss_shuf_variant_name.restype = ctypes.c_char_p
    h = i = 2880
    ws = [weights(s, 32, h, i) for s in range(4)]
    ws = [replace(w, gate_up_bias=w.gate_up_bias.bfloat16(), down_bias=w.down_bias.bfloat16())
          for w in ws]
    shuf = [(shuffle(w.gate_up_blocks, True), shuffle(w.down_blocks, False)) for w in ws]
    ranges = (range(220, 240), range(250, 260)) if args.grouped else (range(200, 220),
                                                                       range(240, 250))
    variants = [v for r in ranges for v in r if lib.tinyoss_shuf_variant_name(v)]
    for t in map(int, args.tokens.split(",")):
        sets = []
        for k, (x, wts, ids, w) in enumerate(call_sets(t, ws)):
            ids32 = ids.reshape(-1).to(torch.int32)
            sets.append(dict(x=x, w=w, ids=ids32, gu=shuf[k][0], dn=shuf[k][1],
                             by_expert=mma.sort_pairs(ids32, 32),
                             wts=wts.reshape(-1).float().contiguous(),
                             act=torch.empty(t * 4, i, device="cuda"),
                             y=torch.empty(t * 4, h, device="cuda")))

        def run(c, gate: bool, v: int | None) -> torch.Tensor:
            w = c["w"]
            b, s, bias = ((w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias) if gate else
                          (w.down_blocks, w.down_scales, w.down_bias))
            x, div, out = (c["x"], 4, c["act"]) if gate else (c["act"], 1, c["y"])
            if v is None:  # the product on the checkpoint's layout
                if args.grouped:
                    mma.grouped(x, div, c["by_expert"], b, s, bias, c["wts"], out, w.alpha,
                                w.limit, gate)
                elif gate:
                    mma.gate_up(x, div, c["ids"], b, s, bias, c["wts"], out, w.alpha, w.limit)
                else:
                    mma.down(x, c["ids"], b, s, bias, c["wts"], out, w.alpha, w.limit)
                return out
            q = c["gu"] if gate else c["dn"]
            tail = (b.shape[1], b.shape[2] * 32, b.stride(0), b.stride(1), s.stride(0),
                    w.alpha, w.limit, torch.cuda.current_stream().cuda_stream)
            if args.grouped:
                sid, order, groups = c["by_expert"]
                err = lib.tinyoss_shuf_grouped_variant(
                    v, x.data_ptr(), div, groups.data_ptr(), groups.numel(), sid.data_ptr(),
                    order.data_ptr(), sid.numel(), q.data_ptr(), s.data_ptr(), bias.data_ptr(),
                    c["wts"].data_ptr(), out.data_ptr(), *tail)
            else:
                err = lib.tinyoss_shuf_variant(
                    v, x.data_ptr(), div, c["ids"].data_ptr(), c["ids"].numel(), q.data_ptr(),
                    s.data_ptr(), bias.data_ptr(), c["wts"].data_ptr(), out.data_ptr(), *tail)
            assert err == 0, (v, err)
            return out

        for gate in (True, False):
            for c in sets:
                run(c, True, None)  # down reads the product's gate_up output
            ref = run(sets[0], gate, None).clone()
            rows = [("product", None)] + [
                (lib.tinyoss_shuf_variant_name(v).decode(), v) for v in variants
                if ("gate_up" in lib.tinyoss_shuf_variant_name(v).decode()) == gate]
            for name, v in rows:
                out = run(sets[0], gate, v)
                err = ((out - ref).norm() / ref.norm()).item()
                us = timed(lambda v=v: [run(c, gate, v) for c in sets], [()]) / len(sets)
                what = "gate_up" if gate else "down"
                print(f"T={t:<2} {what:<7} {name:<40} {us:7.2f} us  err {err:.0e}", flush=True)


if __name__ == "__main__":
    main()
