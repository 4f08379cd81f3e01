"""The MoE prefill GEMMs reading the experts shuffled into MMA-fragment order (session 11's
layout, `bench/experiments/mma_gemv/shuffled.py`), on which the decode GEMVs were 3-11% faster
but the grouped GEMMs of the time (weights on the right of `tl.dot`) lost 22-48%.

With the weights on the left (the product's `moe_triton._mx_gemm_wx` since e249404), a lane's
16 shuffled bytes (word t of blocks 2jb and 2jb + 1 of MMA rows g and g + 8) are exactly the
words its part of wgmma's register operand needs for a 128-column K tile, if the dot's 16
positions of a code phase are ordered p = 8 jb + 2t + bb for word w = 8 jb + 4 bb + t (bb: the
block of the pair). So: load each 16-row tile's 1 KB per K tile contiguously ([tiles, 256]
words), reshape it to [tiles, jb, g, t, bb, h] and permute it to [rows, p]; decode the eight
phases as the product does; and permute x's columns to the same p order (column 16 j + p of a
tile holds x's column 8 w(p) + j). Whether Triton keeps that permutation inside each thread's
registers is what the offline SASS says. Prepared in session 23 without GPU time left:

    python bench/experiments/prefill_shuffled/shuffled_prefill.py --sass                # offline
    python bench/experiments/prefill_shuffled/shuffled_prefill.py --tokens 128,512,2048,8192
    python -m pytest bench/experiments/prefill_shuffled                                 # CPU/GPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.experiments.mma_gemv.shuffled import shuffle  # noqa: E402
from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels.moe_torch import ExpertWeights  # noqa: E402

TILE = 128  # the K tile (two block pairs jb)


def permute_columns(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] -> [R, KP] (whole 128-column tiles, zero columns added): column 16 j + p of a
    tile holds x's column 8 w + j, p = 8 jb + 2 t + bb for w = 8 jb + 4 bb + t."""
    r, k = x.shape
    kp = triton.cdiv(k, TILE) * TILE
    xp = torch.nn.functional.pad(x, (0, kp - k))
    # in-tile column 64 jb + 32 bb + 8 t + j -> [j, jb, t, bb]
    return xp.view(r, kp // TILE, 2, 2, 4, 8).permute(0, 1, 5, 2, 4, 3).reshape(r, kp)


@triton.jit
def _permuted(c):
    """Where column c of x lands in `permute_columns`' layout."""
    r = c % 128
    return c - r + 16 * (r % 8) + 8 * (r // 64) + 2 * ((r // 8) % 4) + (r // 32) % 2


@triton.jit
def _mx_gemm_shuf(acc, xp_ptr, a_rows, a_ok, KP, K, q_ptr, s_ptr, stride_s, row0, N,
                  BN: tl.constexpr, SWIGLU_ROWS: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """acc [BN, M] + W[row0 : row0 + BN, :K] @ A[a_rows, :K].T; W's rows shuffled (`shuffle`),
    row0 a multiple of 16; A in `permute_columns`' layout ([*, KP])."""
    a_off = a_rows.to(tl.int64)[:, None] * KP
    rows = row0 + tl.arange(0, BN)
    row_ok = rows < N
    # word of (row, p) within its tile's 512-byte block pair: lane (g, t) at 16 (4 g + t), the
    # block bb at 2 bb, the MMA row half h at h; the block pair jb = p // 8 at 128 words
    rr = tl.arange(0, BN) % 16
    if SWIGLU_ROWS:  # gate_up: MMA rows g, g + 8 are tile rows 2g, 2g + 1
        g, h = rr // 2, rr % 2
    else:  # down: MMA rows g, g + 8 are tile rows g, g + 8
        g, h = rr % 8, rr // 8
    c = tl.arange(0, 16)
    jbp, tp, bbp = c // 8, (c // 2) % 4, c % 2
    word = ((tl.arange(0, BN) // 16).to(tl.int64) * (K * 2) + 16 * g + h)[:, None] \
        + (128 * jbp + 4 * tp + 2 * bbp)[None, :]
    qw = q_ptr.to(tl.pointer_type(tl.int32)) + (row0 // 16).to(tl.int64) * (K * 2) + word
    r = rows.to(tl.int64)[:, None]
    for k0 in range(0, K, 128):
        ok = row_ok[:, None] & (k0 // 64 + jbp < K // 64)[None, :]
        q = tl.load(qw + (k0 // 64) * 128, mask=ok, other=0)  # [rows, p]
        # each position's scale (block 2 jb + bb), loaded where the position is: a broadcast
        # and reshape of [rows, 4] would put the decoded tile in another layout
        kg = k0 // 32 + 2 * jbp + bbp
        s = tl.load(s_ptr + r * stride_s + kg[None, :],
                    mask=row_ok[:, None] & (kg < K // 32)[None, :], other=0).to(tl.int32)
        if DOT_DTYPE == tl.bfloat16:
            sc = tl.where(s == 0, 0x40, s << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            sc = ((s + 14) << 23).to(tl.float32, bitcast=True)
        for j in tl.static_range(8):
            xj = tl.load(xp_ptr + a_off + (k0 + 16 * j + c)[None, :], mask=a_ok[:, None],
                         other=0.0)
            if DOT_DTYPE == tl.bfloat16:
                w = (((q << (28 - 4 * j)) >> 22) & 0x81C0).to(tl.uint16)
                w = (w.to(tl.bfloat16, bitcast=True) * 2.0**126).to(tl.bfloat16) * sc
                acc = tl.dot(w, tl.trans(xj.to(tl.bfloat16)), acc)
            else:
                w = (((q << (28 - 4 * j)) >> 19) & 0x8E00).to(tl.uint16)
                w = w.to(tl.float16, bitcast=True).to(tl.float32) * sc
                acc = tl.dot(w, tl.trans(xj.to(tl.float32)), acc, input_precision="ieee")
    return acc


@triton.jit
def _gate_up_shuf(xp_ptr, order_ptr, off_ptr, q_ptr, s_ptr, b_ptr, act_ptr, E, H, HP, N, IP,
                  stride_qe, stride_se, stride_s, alpha, limit, TOPK: tl.constexpr,
                  E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_DTYPE: tl.constexpr):
    """`moe_triton._prefill_gate_up` on `_mx_gemm_shuf`."""
    e, row0, row_end = mt._tile_rows(off_ptr, tl.program_id(0), E, E_PAD, BLOCK_M)
    if row0 >= row_end:
        return
    m = row0 + tl.arange(0, BLOCK_M)
    ok = m < row_end
    tok = tl.load(order_ptr + m, mask=ok, other=0) // TOPK
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.trans(_mx_gemm_shuf(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), xp_ptr, tok, ok, HP,
                                 H, q_ptr + e * stride_qe, s_ptr + e * stride_se, stride_s,
                                 pid_n * BLOCK_N, N, BLOCK_N, True, DOT_DTYPE))
    bias = tl.load(b_ptr + e * N + rows, mask=row_ok, other=0.0).to(tl.float32)
    y = mt._swiglu(acc + bias[None, :], alpha, limit, BLOCK_M, BLOCK_N)
    half = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(act_ptr + m.to(tl.int64)[:, None] * IP + _permuted(half)[None, :],
             y.to(act_ptr.dtype.element_ty), mask=ok[:, None] & (half < N // 2)[None, :])


@triton.jit
def _down_shuf(act_ptr, order_ptr, off_ptr, wts_ptr, q_ptr, s_ptr, b_ptr, y_ptr, E, I, IP, H,
               stride_qe, stride_se, stride_s, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """`moe_triton._prefill_down` on `_mx_gemm_shuf`."""
    e, row0, row_end = mt._tile_rows(off_ptr, tl.program_id(0), E, E_PAD, BLOCK_M)
    if row0 >= row_end:
        return
    m = row0 + tl.arange(0, BLOCK_M)
    ok = m < row_end
    slot = tl.load(order_ptr + m, mask=ok, other=0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    acc = _mx_gemm_shuf(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), act_ptr, m, ok, IP, I,
                        q_ptr + e * stride_qe, s_ptr + e * stride_se, stride_s,
                        tl.program_id(1) * BLOCK_N, H, BLOCK_N, False, DOT_DTYPE)
    bias = tl.load(b_ptr + e * H + rows, mask=row_ok, other=0.0).to(tl.float32)
    wt = tl.load(wts_ptr + slot, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + slot.to(tl.int64)[None, :] * H + rows[:, None],
             (acc + bias[:, None]) * wt[None, :], mask=ok[None, :] & row_ok[:, None])


def prefill_pairs_shuf(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       w: ExpertWeights, gate_up_shuf: torch.Tensor, down_shuf: torch.Tensor,
                       cfg: mt.PrefillConfig | None = None) -> torch.Tensor:
    """`moe_triton._prefill_pairs` on the shuffled experts (`shuffle(blocks, swiglu)`)."""
    t, h, k, e, i = mt._shapes(x, topk_ids, w)
    cfg = cfg or mt.prefill_config(x.shape[0], w.gate_up_blocks.shape[0], topk_ids.shape[1])
    assert cfg.block_k == TILE and cfg.block_n1 % 16 == 0 and cfg.block_n2 % 16 == 0
    pairs = t * k
    y = torch.empty(pairs, h, dtype=torch.float32, device=x.device)
    xp = permute_columns(x.contiguous())
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    bounds = torch.arange(e + 1, device=x.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds)
    ip = triton.cdiv(i, TILE) * TILE
    act = torch.empty(pairs, ip, dtype=x.dtype, device=x.device)
    if ip > i:  # zero the columns past i, wherever they land
        pad = torch.arange(i, ip)
        r = pad % TILE
        at = pad - r + 16 * (r % 8) + 8 * (r // 64) + 2 * ((r // 8) % 4) + (r // 32) % 2
        act[:, at.to(x.device)] = 0
    n_tiles = triton.cdiv(pairs, cfg.block_m) + e
    common = dict(E_PAD=triton.next_power_of_2(e), BLOCK_M=cfg.block_m,
                  DOT_DTYPE=mt._dot_dtype(x), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _gate_up_shuf[(n_tiles, triton.cdiv(2 * i, cfg.block_n1))](
        xp, order, offsets, gate_up_shuf, w.gate_up_scales, w.gate_up_bias, act, e, h,
        xp.shape[1], 2 * i, ip, gate_up_shuf.stride(0), w.gate_up_scales.stride(0),
        w.gate_up_scales.stride(1), float(w.alpha), float(w.limit), TOPK=k,
        BLOCK_N=cfg.block_n1, **common)
    _down_shuf[(n_tiles, triton.cdiv(h, cfg.block_n2))](
        act, order, offsets, topk_weights.contiguous().view(-1), down_shuf, w.down_scales,
        w.down_bias, y, e, i, ip, h, down_shuf.stride(0), w.down_scales.stride(0),
        w.down_scales.stride(1), BLOCK_N=cfg.block_n2, **common)
    return y


def sass_report() -> None:
    """The product's gate_up and down against these on the shuffled experts, sm_90, no GPU:
    registers, spills and the K loop's instruction mix (STS / LDS / BAR: shared memory)."""
    from offline_sass import compile_sass, loop_mix

    common = dict(order_ptr="*i64", off_ptr="*i64", q_ptr="*u8", s_ptr="*u8", b_ptr="*bf16",
                  E=32, stride_qe=5760 * 1440, stride_se=5760 * 90, stride_s=90)
    gate = dict(common, xp_ptr="*bf16", act_ptr="*bf16", H=2880, HP=2944, N=5760, IP=2944,
                alpha=1.0, limit=1.0)
    down = dict(common, act_ptr="*bf16", wts_ptr="*fp32", y_ptr="*fp32", I=2880, IP=2944,
                H=2880)
    for bm, bn, nw in [(64, 128, 4), (128, 128, 8)]:
        cx = dict(E_PAD=32, BLOCK_M=bm, BLOCK_N=bn, DOT_DTYPE=tl.bfloat16)
        for name, fn, args, extra in [
                ("gate_up (product)", mt._prefill_gate_up, dict(gate, stride_q=1440),
                 dict(TOPK=4, BLOCK_K=128)),
                ("gate_up (shuffled)", _gate_up_shuf, gate, dict(TOPK=4)),
                ("down (product)", mt._prefill_down, dict(down, stride_q=1440),
                 dict(BLOCK_K=128)),
                ("down (shuffled)", _down_shuf, down, {})]:
            usage, sass = compile_sass(name, (fn, args, {**cx, **extra},
                                              dict(num_warps=nw, num_stages=3), 128 * 128))
            mix, total = loop_mix(sass)
            shared = {op: n for op, n in mix.items() if op.startswith(("STS", "LDS", "BAR"))}
            print(f"{name} {bm}x{bn}/w{nw}: {usage.split(' CONSTANT')[0]}\n  K loop {total}: "
                  + ", ".join(f"{op} {n}" for op, n in mix.most_common(10))
                  + f"\n  shared memory: {shared}", flush=True)


def bench(tokens: list[int]) -> None:
    """us a layer (sort, permutation, gate_up, down), the product against these on the
    shuffled experts, 20b shapes, 4 weight sets, the product's tiles."""
    from moe_kernels import call_sets, timed, weights

    ws = [weights(s, 32, 2880, 2880) for s in range(4)]
    shuf = {id(w): (shuffle(w.gate_up_blocks, True), shuffle(w.down_blocks, False)) for w in ws}
    for t in tokens:
        sets = list(call_sets(t, ws))
        ref = mt._prefill_pairs(*sets[0], None)
        err = ((prefill_pairs_shuf(*sets[0], *shuf[id(sets[0][3])]) - ref).norm()
               / ref.norm()).item()
        base = timed(lambda: [mt._prefill_pairs(*c, None) for c in sets], [()]) / len(sets)
        new = timed(lambda: [prefill_pairs_shuf(*c, *shuf[id(c[3])]) for c in sets],
                    [()]) / len(sets)
        print(f"T={t:<5} product {base:9.1f} us  shuffled {new:9.1f} us ({new / base - 1:+.1%})"
              f"  err against the product {err:.1e}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sass", action="store_true", help="offline sm_90 report, no GPU")
    p.add_argument("--tokens", default="128,512,2048,8192")
    args = p.parse_args()
    if args.sass:
        sass_report()
    else:
        bench([int(t) for t in args.tokens.split(",")])


if __name__ == "__main__":
    main()
