"""The W-left prefill GEMMs (`wleft.py`) with the activations' columns permuted ahead of time, so
that each of the eight per-phase dots reads its x columns as one contiguous 16-column slice.

Why: with the weights on the left of `tl.dot` they reach wgmma from registers, but `wleft.py`
still splits each loaded x tile into eight column phases (k = 8w + j) in registers, and wgmma's
right operand must come from shared memory, so every phase is stored there by the threads (the
round trip moved from W to x, 2026-11-27_offline_prefill_wleft_sass.txt; 7-9% slower on the
GPU). Here x is permuted once, per 128-column tile: column 16j + i of a tile holds x's column
8i + j. Phase j of a tile is then columns 16j..16j+15, loaded as its own [M, 16] tile, which
Triton can copy global -> shared with cp.async and hand to wgmma untouched. The weights keep
the checkpoint's layout. gate_up takes x permuted by a gather before it (the engine's norm
could write it so); its epilogue writes the SwiGLU output already permuted for down. K is
padded to whole 128-column tiles (2880 -> 2944) with zero columns.

    python bench/experiments/prefill_wleft/xperm.py --sass                   # offline, sm_90
    python bench/experiments/prefill_wleft/xperm.py --tokens 512,2048,8192   # GPU: us a layer
    python -m pytest bench/experiments/prefill_wleft                         # CPU or GPU
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

from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels.moe_torch import ExpertWeights  # noqa: E402

TILE = 128  # the K tile the permutation is made for (the kernels' BLOCK_K)


def permute_columns(x: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """x [R, K] -> [R, KP] (KP: K rounded up to whole tiles, zero columns added): within each
    tile, column (tile/8) j + w holds x's column 8w + j."""
    r, k = x.shape
    kp = triton.cdiv(k, tile) * tile
    xp = torch.nn.functional.pad(x, (0, kp - k))
    return xp.view(r, kp // tile, tile // 8, 8).transpose(2, 3).reshape(r, kp)


@triton.jit
def _permuted(c, TILE: tl.constexpr):
    """Where column c of x lands in the permuted layout (`permute_columns`)."""
    r = c % TILE
    return c - r + (TILE // 8) * (r % 8) + r // 8


@triton.jit
def _mx_gemm_xperm(acc, xp_ptr, a_rows, a_ok, KP, K, q_ptr, s_ptr, stride_q, stride_s, rows,
                   row_ok, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   BF16_DEQ: tl.constexpr):
    """acc [N, M] + W[rows, :K] @ A[a_rows, :K].T, A given permuted ([*, KP], `permute_columns`):
    the product's dequantization and eight per-phase dots, each phase's x loaded as its own
    contiguous [M, BLOCK_K/8] tile. Loads are left to Triton's pipeliner (num_stages)."""
    a_off = a_rows.to(tl.int64)[:, None] * KP
    r = rows.to(tl.int64)[:, None]
    c = tl.arange(0, BLOCK_K // 8)
    for k0 in range(0, K, BLOCK_K):
        kw = k0 // 8 + c
        q = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + r * (stride_q // 4) + kw[None, :],
                    mask=row_ok[:, None] & (kw // 4 < K // 32)[None, :], other=0)
        kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(s_ptr + r * stride_s + kg[None, :],
                    mask=row_ok[:, None] & (kg < K // 32)[None, :], other=0)
        sc = ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
        sc = tl.broadcast_to(sc[:, :, None], (rows.shape[0], BLOCK_K // 32, 4))
        sc = sc.reshape(q.shape)
        if BF16_DEQ:  # each word's scale as a bf16 power of two
            sb = tl.where(s == 0, 0x40, s.to(tl.int32) << 7)  # 0: 2**-127, a subnormal
            sb = sb.to(tl.uint16).to(tl.bfloat16, bitcast=True)
            sb = tl.broadcast_to(sb[:, :, None], (rows.shape[0], BLOCK_K // 32, 4))
            sb = sb.reshape(q.shape)
        for j in tl.static_range(8):
            xj = tl.load(xp_ptr + a_off + (k0 + (BLOCK_K // 8) * j + c)[None, :],
                         mask=a_ok[:, None], other=0.0)
            if BF16_DEQ:
                # bf16 bits: the code's value times 2**-126 (0.5: a subnormal), times 2**126,
                # times the scale: exact in bf16 (every product has at most 2 significant bits)
                w = (((q << (28 - 4 * j)) >> 22) & 0x81C0).to(tl.uint16)
                w = w.to(tl.bfloat16, bitcast=True) * 2.0**126
                w = w.to(tl.bfloat16) * sb
            else:
                w = (((q << (28 - 4 * j)) >> 19) & 0x8E00).to(tl.uint16)
                w = w.to(tl.float16, bitcast=True).to(tl.float32) * sc
            if DOT_DTYPE == tl.float32:
                acc = tl.dot(w.to(tl.float32), tl.trans(xj.to(tl.float32)), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(w.to(DOT_DTYPE), tl.trans(xj.to(DOT_DTYPE)), acc)
    return acc


@triton.jit
def _prefill_gate_up_xperm(xp_ptr, order_ptr, off_ptr, q_ptr, s_ptr, b_ptr, act_ptr, E, H, HP,
                           N, IP, stride_qe, stride_q, stride_se, stride_s, alpha, limit,
                           TOPK: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           DOT_DTYPE: tl.constexpr, BF16_DEQ: tl.constexpr):
    e, row0, row_end = mt._tile_rows(off_ptr, tl.program_id(0), E, E_PAD, BLOCK_M)
    if row0 >= row_end:
        return
    m = row0 + tl.arange(0, BLOCK_M)
    ok = m < row_end
    tok = tl.load(order_ptr + m, mask=ok, other=0) // TOPK
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc_t = _mx_gemm_xperm(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), xp_ptr, tok, ok, HP, H,
                           q_ptr + e * stride_qe, s_ptr + e * stride_se, stride_q, stride_s,
                           rows, row_ok, BLOCK_K, DOT_DTYPE, BF16_DEQ)
    acc = tl.trans(acc_t)
    bias = tl.load(b_ptr + e * N + rows, mask=row_ok, other=0.0).to(tl.float32)
    y = mt._swiglu(acc + bias[None, :], alpha, limit, BLOCK_M, BLOCK_N)
    half = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    # down reads act permuted: each column where down's phases want it
    tl.store(act_ptr + m.to(tl.int64)[:, None] * IP + _permuted(half, BLOCK_K)[None, :],
             y.to(act_ptr.dtype.element_ty), mask=ok[:, None] & (half < N // 2)[None, :])


@triton.jit
def _prefill_down_xperm(act_ptr, order_ptr, off_ptr, wts_ptr, q_ptr, s_ptr, b_ptr, y_ptr, E, I,
                        IP, H, stride_qe, stride_q, stride_se, stride_s, E_PAD: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, BF16_DEQ: tl.constexpr):
    e, row0, row_end = mt._tile_rows(off_ptr, tl.program_id(0), E, E_PAD, BLOCK_M)
    if row0 >= row_end:
        return
    m = row0 + tl.arange(0, BLOCK_M)
    ok = m < row_end
    slot = tl.load(order_ptr + m, mask=ok, other=0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    acc_t = _mx_gemm_xperm(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), act_ptr, m, ok, IP, I,
                           q_ptr + e * stride_qe, s_ptr + e * stride_se, stride_q, stride_s,
                           rows, row_ok, BLOCK_K, DOT_DTYPE, BF16_DEQ)
    bias = tl.load(b_ptr + e * H + rows, mask=row_ok, other=0.0).to(tl.float32)
    wt = tl.load(wts_ptr + slot, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + slot.to(tl.int64)[None, :] * H + rows[:, None],
             (acc_t + bias[:, None]) * wt[None, :], mask=ok[None, :] & row_ok[:, None])


def prefill_pairs_xperm(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        w: ExpertWeights, cfg: mt.PrefillConfig | None = None,
                        bf16_deq: bool = False) -> torch.Tensor:
    """`moe_triton._prefill_pairs` on the kernels above: y [T * K, H] fp32. bf16_deq: the codes
    decoded to bf16 directly (else the product's fp16 -> fp32 -> bf16 path)."""
    t, h, k, e, i = mt._shapes(x, topk_ids, w)
    cfg = cfg or mt.prefill_config(x.shape[0], w.gate_up_blocks.shape[0], topk_ids.shape[1])
    assert cfg.block_k == TILE, "the permutation is made for 128-column K tiles"
    pairs = t * k
    y = torch.empty(pairs, h, dtype=torch.float32, device=x.device)
    xp = permute_columns(x.contiguous())
    hp, ip = xp.shape[1], triton.cdiv(i, TILE) * TILE
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    bounds = torch.arange(e + 1, device=x.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds)
    act = torch.empty(pairs, ip, dtype=x.dtype, device=x.device)
    if ip > i:  # zero padding: columns 8w + j >= i of the last tile sit at 16j + w
        act.view(pairs, ip // TILE, 8, TILE // 8)[:, -1, :, (i % TILE) // 8:].zero_()
    n_tiles = triton.cdiv(pairs, cfg.block_m) + e
    common = dict(E_PAD=triton.next_power_of_2(e), BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
                  DOT_DTYPE=mt._dot_dtype(x), BF16_DEQ=bf16_deq, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    _prefill_gate_up_xperm[(n_tiles, triton.cdiv(2 * i, cfg.block_n1))](
        xp, order, offsets, w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias, act, e, h, hp,
        2 * i, ip, *mt._strides(w.gate_up_blocks, w.gate_up_scales), float(w.alpha),
        float(w.limit), TOPK=k, BLOCK_N=cfg.block_n1, **common)
    _prefill_down_xperm[(n_tiles, triton.cdiv(h, cfg.block_n2))](
        act, order, offsets, topk_weights.contiguous().view(-1), w.down_blocks, w.down_scales,
        w.down_bias, y, e, i, ip, h, *mt._strides(w.down_blocks, w.down_scales),
        BLOCK_N=cfg.block_n2, **common)
    return y


def sass_report() -> None:
    """The product's, W-left's and this form's gate_up and down for sm_90 (no GPU): registers,
    spills, shared memory and the K loop's instruction mix (STS: threads storing an operand to
    shared memory; LDGSTS: cp.async; HGMMA: wgmma, with where its left operand comes from)."""
    from offline_sass import compile_sass, loop_mix
    from wleft import _prefill_down_left, _prefill_gate_up_left

    common = dict(order_ptr="*i64", off_ptr="*i64", q_ptr="*u8", s_ptr="*u8", b_ptr="*bf16",
                  E=32, stride_qe=5760 * 1440, stride_q=1440, stride_se=5760 * 90, stride_s=90)
    gate = dict(common, x_ptr="*bf16", act_ptr="*bf16", H=2880, N=5760, alpha=1.0, limit=1.0)
    down = dict(common, act_ptr="*bf16", wts_ptr="*fp32", y_ptr="*fp32", I=2880, H=2880)
    gate_p = dict(gate, xp_ptr="*bf16", HP=2944, IP=2944)
    down_p = dict(down, IP=2944)
    cx = dict(E_PAD=32, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, DOT_DTYPE=tl.bfloat16)
    opts = dict(num_warps=4, num_stages=3)
    for name, fn, args, extra in [
            ("gate_up (product: W right)", mt._prefill_gate_up, gate, dict(TOPK=4)),
            ("gate_up (W left)", _prefill_gate_up_left, gate, dict(TOPK=4)),
            ("gate_up (W left, x permuted)", _prefill_gate_up_xperm, gate_p,
             dict(TOPK=4, BF16_DEQ=False)),
            ("gate_up (W left, x permuted, bf16 decode)", _prefill_gate_up_xperm, gate_p,
             dict(TOPK=4, BF16_DEQ=True)),
            ("down (product: W right)", mt._prefill_down, down, {}),
            ("down (W left)", _prefill_down_left, down, {}),
            ("down (W left, x permuted)", _prefill_down_xperm, down_p, dict(BF16_DEQ=False)),
            ("down (W left, x permuted, bf16 decode)", _prefill_down_xperm, down_p,
             dict(BF16_DEQ=True))]:
        usage, sass = compile_sass(name, (fn, args, {**cx, **extra}, opts, 128 * 128))
        mix, total = loop_mix(sass)
        hgmma = sorted({ln.split(";")[0].split("*/")[-1].strip() for ln in sass.splitlines()
                        if "HGMMA" in ln})
        print(f"{name}: {usage}\n  K loop {total} instructions: "
              + ", ".join(f"{op} {n}" for op, n in mix.most_common(14)))
        for h in hgmma[:2]:
            print(f"  {h}")


def bench(tokens: list[int]) -> None:
    """us a layer (gate_up + down + sort, and here the permutation of x), the product against
    W-left with x permuted, 20b shapes, 4 weight sets."""
    from moe_kernels import call_sets, timed, weights

    h = i = 2880
    ws = [weights(s, 32, h, i) for s in range(4)]
    for t in tokens:
        sets = list(call_sets(t, ws))
        ref = mt._prefill_pairs(*sets[0], None)
        out = prefill_pairs_xperm(*sets[0])
        err = ((out - ref).norm() / ref.norm()).item()
        base = timed(lambda: [mt._prefill_pairs(*c, None) for c in sets], [()]) / len(sets)
        perm = timed(lambda: [prefill_pairs_xperm(*c) for c in sets], [()]) / len(sets)
        out = prefill_pairs_xperm(*sets[0], bf16_deq=True)
        err16 = ((out - ref).norm() / ref.norm()).item()
        b16 = timed(lambda: [prefill_pairs_xperm(*c, bf16_deq=True) for c in sets],
                    [()]) / len(sets)
        print(f"T={t:<5} product {base:9.1f} us  x permuted {perm:9.1f} us "
              f"({perm / base - 1:+.1%}, err {err:.1e})  + bf16 decode {b16:9.1f} us "
              f"({b16 / base - 1:+.1%}, err {err16:.1e})", flush=True)


def sweep(tokens: list[int]) -> None:
    """Tiles of the x-permuted, bf16-decode form (block_m tokens, block_n weight rows, stages,
    warps), us a layer, against the product's default in the same run."""
    from moe_kernels import call_sets, timed, weights

    ws = [weights(s, 32, 2880, 2880) for s in range(4)]
    tiles = [(64, 128, 3, 4), (64, 128, 4, 4), (128, 128, 3, 8), (64, 256, 3, 8),
             (128, 256, 3, 8), (32, 128, 4, 4)]
    for t in tokens:
        sets = list(call_sets(t, ws))
        base = timed(lambda: [mt._prefill_pairs(*c, None) for c in sets], [()]) / len(sets)
        line = [f"T={t:<5} product {base:8.1f}"]
        for bm, bn, st, nw in tiles:
            cfg = mt.PrefillConfig(block_m=bm, block_n1=bn, block_n2=bn, num_warps=nw,
                                   num_stages=st)
            try:
                us = timed(lambda: [prefill_pairs_xperm(*c, cfg, True) for c in sets],
                           [()]) / len(sets)
                line.append(f"{bm}x{bn}/s{st}/w{nw} {us:8.1f}")
            except Exception as e:  # noqa: BLE001 - a tile that does not fit: say so, go on
                line.append(f"{bm}x{bn}/s{st}/w{nw} {type(e).__name__}")
        print("  ".join(line), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sass", action="store_true", help="offline sm_90 report, no GPU")
    p.add_argument("--tokens", default="128,512,2048,8192")
    p.add_argument("--sweep", action="store_true", help="GPU: tiles of the bf16-decode form")
    args = p.parse_args()
    if args.sass:
        sass_report()
    elif args.sweep:
        sweep([int(t) for t in args.tokens.split(",")])
    else:
        bench([int(t) for t in args.tokens.split(",")])


if __name__ == "__main__":
    main()
