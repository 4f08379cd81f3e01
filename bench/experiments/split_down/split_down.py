"""The batch-1 MoE down GEMV split over K across programs (Gluon), against the product's.

At one token a step the engine's down is Gluon's pair GEMV (`moe_gemv_gluon`): 4 pairs x 360
one-warp programs, each 8 rows over K = 2880 in 3 steps of 1024 values, ~12.2 us for 17.6 MB
(1.44 TB/s; gate_up reaches 1.88). Here each program takes 1/SPLITS of K with its steps
unrolled (every load issued before the math) and writes a partial row; the combine, which
reads the pairs' rows anyway, sums SPLITS x TOPK rows instead of TOPK, in a fixed order (no
atomics: the same bits every run). `split_down` writes rows (token, split, slot), so the
product's `_combine_norm` sums them with TOPK = SPLITS * TOPK over ids repeated per split.

    python bench/experiments/split_down/split_down.py            # GPU (Hopper)
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tinyoss.kernels.moe_gemv_gluon import _phases, _tile, _words  # noqa: E402


@gluon.jit
def _down_split(x_ptr, ids_ptr, q_ptr, s_ptr, b_ptr, wts_ptr, out_ptr, N, stride_qe, stride_q,
                stride_se, stride_s, K: gl.constexpr, TOPK: gl.constexpr,
                SPLITS: gl.constexpr, HALF_N: gl.constexpr, BLOCK_K: gl.constexpr,
                WARPS: gl.constexpr):
    """Program (pair, row tile, split): rows of W_e[:, split's K] @ x[pair][split's K], times
    the routing weight (plus the bias in split 0), into out row (token, split, slot)."""
    W: gl.constexpr = BLOCK_K // 8
    L3: gl.constexpr = gl.BlockedLayout([1, 4, 8], [32 // (W // 4), W // 4, 1],
                                        [WARPS, 1, 1], [2, 1, 0])
    LQ: gl.constexpr = gl.SliceLayout(2, L3)
    LX: gl.constexpr = gl.SliceLayout(0, L3)
    STEPS: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    PER: gl.constexpr = (STEPS + SPLITS - 1) // SPLITS
    pair = gl.program_id(0)
    s = gl.program_id(2)
    e = gl.load(ids_ptr + pair).to(gl.int64)
    if e < 0:
        return
    i = gl.arange(0, HALF_N, layout=gl.SliceLayout(1, LQ))
    ra = gl.program_id(1) * 2 * HALF_N + i
    rb = ra + HALF_N
    ok_a, ok_b = ra < N, rb < N
    x_row = x_ptr + pair.to(gl.int64) * K
    words = gl.arange(0, W, layout=gl.SliceLayout(0, LQ))
    xo = gl.arange(0, W, layout=gl.SliceLayout(1, LX))[:, None] * 8 + gl.arange(
        0, 8, layout=gl.SliceLayout(0, LX))[None, :]
    qp = (q_ptr + e * stride_qe).to(gl.pointer_type(gl.int32))
    sp = s_ptr + e * stride_se
    acc_a = gl.zeros([HALF_N, W], gl.float32, LQ)
    acc_b = gl.zeros([HALF_N, W], gl.float32, LQ)
    for st in gl.static_range(PER):
        k0 = (s * PER + st) * BLOCK_K
        kw = k0 // 8 + words
        qa, sa = _tile(qp, sp, ra, ok_a, kw, K, stride_q // 4, stride_s)
        qb, sb = _tile(qp, sp, rb, ok_b, kw, K, stride_q // 4, stride_s)
        xv = gl.load(x_row + k0 + xo, mask=k0 + xo < K, other=0.0).to(gl.float32) * 2.0**64
        x0, x1, x2, x3, x4, x5, x6, x7 = _phases(xv, gl.SliceLayout(0, LQ))
        acc_a += _words(qa, sa, x0, x1, x2, x3, x4, x5, x6, x7)
        acc_b += _words(qb, sb, x0, x1, x2, x3, x4, x5, x6, x7)
    first = s == 0
    bias = b_ptr + e * N
    ha = gl.sum(acc_a, axis=1) * 2.0**62 + gl.load(bias + ra, mask=ok_a & first, other=0.0).to(
        gl.float32)
    hb = gl.sum(acc_b, axis=1) * 2.0**62 + gl.load(bias + rb, mask=ok_b & first, other=0.0).to(
        gl.float32)
    wt = gl.load(wts_ptr + pair).to(gl.float32)
    row = ((pair // TOPK) * SPLITS + s) * TOPK + pair % TOPK
    gl.store(out_ptr + row.to(gl.int64) * N + ra, ha * wt, mask=ok_a)
    gl.store(out_ptr + row.to(gl.int64) * N + rb, hb * wt, mask=ok_b)


def split_down(act: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor, wts: torch.Tensor, out: torch.Tensor, topk: int, splits: int,
               block_n: int, block_k: int, warps: int) -> None:
    """act [pairs, I] fp32, ids/wts [pairs] -> out [pairs * splits, H] fp32 (rows by token,
    split, slot)."""
    n, k = blocks.shape[1], act.shape[1]
    _down_split[(ids.numel(), triton.cdiv(n, block_n), splits)](
        act, ids, blocks, scales, bias, wts, out, n, blocks.stride(0), blocks.stride(1),
        scales.stride(0), scales.stride(1), K=k, TOPK=topk, SPLITS=splits,
        HALF_N=block_n // 2, BLOCK_K=block_k, WARPS=warps, num_warps=warps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1")
    p.add_argument("--splits", default="1,2,3")
    p.add_argument("--tiles", default="8/1024/1,8/512/1,16/512/2,8/256/1,16/1024/2",
                   help="block_n/block_k/warps")
    args = p.parse_args()
    from bench.moe_kernels import call_sets, timed, weights
    from tinyoss.kernels import moe_triton as mt
    from tinyoss.kernels.hardware import capability
    from tinyoss.kernels.moe_gemv_mma import load

    mma, _ = load(capability())
    h = i = 2880
    ws = [weights(s, 32, h, i) for s in range(4)]
    ws = [replace(w, gate_up_bias=w.gate_up_bias.bfloat16(), down_bias=w.down_bias.bfloat16())
          for w in ws]  # the engine's dtypes (the tensor-core kernel takes only these)
    eps = 1e-5
    norm_w = torch.rand(h, device="cuda", dtype=torch.bfloat16)
    print(torch.cuda.get_device_name(), flush=True)
    for t in map(int, args.tokens.split(",")):
        sets = []
        for x, wts, ids, w in call_sets(t, ws):
            pairs = ids.numel()
            flat = ids.reshape(-1).contiguous()
            act = torch.randn(pairs, i, device="cuda") * 0.5
            sets.append(dict(x=x, ids=flat, ids32=flat.to(torch.int32), w=w, act=act,
                             wts=wts.reshape(-1).float().contiguous(),
                             res=torch.randn(t, h, device="cuda").bfloat16()))

        def product_down(c):
            w, y = c["w"], torch.empty(c["ids"].numel(), h, device="cuda")
            mt._pair_gemv_cores(c["act"], 1, c["ids"],
                                (w.down_blocks, w.down_scales, w.down_bias), c["wts"], y, h, i,
                                w, mt.GemvConfig(), 8, swiglu=False)
            return y

        def product_mma_down(c):
            w, y = c["w"], torch.empty(c["ids"].numel(), h, device="cuda")
            mma.down(c["act"], c["ids32"], w.down_blocks, w.down_scales, w.down_bias, c["wts"],
                     y, w.alpha, w.limit)
            return y

        def combine(c, y, splits):
            ids = c["ids"].view(t, 1, 4).expand(t, splits, 4).reshape(-1).contiguous()
            normed = torch.empty(t, h, device="cuda", dtype=torch.bfloat16)
            mt._combine_norm[(t,)](y, ids, c["res"], norm_w, normed, h, eps,
                                   TOPK=4 * splits, BLOCK=4096, num_warps=8)
            return normed

        def each(fn):
            return lambda: [fn(c) for c in sets]

        ref = product_down(sets[0])
        ref_sum = ref.view(t, 4, h).sum(1)
        us = timed(each(product_down), [()]) / len(sets)
        both = timed(each(lambda c: combine(c, product_down(c), 1)), [()]) / len(sets)
        print(f"T={t} product Gluon down {us:6.2f} us; + combine_norm {both:6.2f} us", flush=True)
        us = timed(each(product_mma_down), [()]) / len(sets)
        err = ((product_mma_down(sets[0]) - ref).norm() / ref.norm()).item()
        print(f"T={t} product mma down   {us:6.2f} us (err {err:.0e})", flush=True)
        for splits, tile in itertools.product(map(int, args.splits.split(",")),
                                              args.tiles.split(",")):
            bn, bk, warps = map(int, tile.split("/"))
            if 2880 // bk < splits - 1:
                continue

            def run(c, splits=splits, bn=bn, bk=bk, warps=warps):
                w = c["w"]
                y = torch.empty(c["ids"].numel() * splits, h, device="cuda")
                split_down(c["act"], c["ids"], w.down_blocks, w.down_scales, w.down_bias,
                           c["wts"], y, 4, splits, bn, bk, warps)
                return y

            try:
                got = run(sets[0]).view(t, splits, 4, h).sum((1, 2))
            except Exception as exc:  # a tile the layout cannot take
                print(f"T={t} split {splits} tile {tile}: {type(exc).__name__}: {exc}"[:200])
                continue
            err = ((got - ref_sum).norm() / ref_sum.norm()).item()
            us = timed(each(run), [()]) / len(sets)
            both = timed(each(lambda c, run=run, splits=splits: combine(c, run(c), splits)),
                         [()]) / len(sets)
            print(f"T={t} split {splits} tile {tile:<10} {us:6.2f} us; + combine_norm "
                  f"{both:6.2f} us (err {err:.0e})", flush=True)


if __name__ == "__main__":
    main()
