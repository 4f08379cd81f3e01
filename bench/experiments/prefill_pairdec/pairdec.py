"""The product's MoE prefill GEMMs (`moe_triton._mx_gemm_wx`) with two codes decoded a 32-bit op:
codes j and j + 4 of a word sit 16 bits apart, so one shift-and-mask pair puts both into the two
bf16 halves of one register (sign to bits 15 / 31, exponent and mantissa to 8..6 / 24..22), which
is the pair of adjacent k positions wgmma's register operand holds. A K tile is then four dots of
K = BLOCK_K/4 (pair phases jj = 0..3), and x is permuted so that pair phase jj is one contiguous
slice in that order: column (BLOCK_K/4) jj + 2w + h of a tile holds x's column 8w + jj + 4h.

Why: the product decodes one code at a time (shift, arithmetic shift, mask, pack: ~3 integer
ops a code besides the two packed multiplies), and offline its K loop is 739 instructions a
128-column step for 4 warps, more issue slots than the 16 wgmmas need: the prefill GEMMs are
bound by decoding. Prepared in session 23 without GPU time left:

    python bench/experiments/prefill_pairdec/pairdec.py --sass                   # offline, sm_90
    python bench/experiments/prefill_pairdec/pairdec.py --tokens 128,512,2048,8192   # GPU
    python -m pytest bench/experiments/prefill_pairdec                           # CPU or GPU
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


def permute_pairs(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """x [R, K] -> [R, KP] (K in whole tiles, zero columns added): within each tile, column
    (block_k/4) jj + 2w + h holds x's column 8w + jj + 4h (jj 0..3, w a word, h 0..1)."""
    r, k = x.shape
    kp = triton.cdiv(k, block_k) * block_k
    xp = torch.nn.functional.pad(x, (0, kp - k))
    # [r, tiles, w, h, jj] -> [r, tiles, jj, w, h]
    return xp.view(r, kp // block_k, block_k // 8, 2, 4).permute(0, 1, 4, 2, 3).reshape(r, kp)


@triton.jit
def _permuted_pairs(c, BLOCK_K: tl.constexpr):
    """Where column c of x lands in `permute_pairs`' layout."""
    r = c % BLOCK_K
    w = r // 8
    j = r % 8
    return c - r + (BLOCK_K // 4) * (j % 4) + 2 * w + j // 4


@triton.jit
def _mx_gemm_pairs(acc, xp_ptr, a_rows, a_ok, KP, K, q_ptr, s_ptr, stride_q, stride_s, rows,
                   row_ok, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """acc [N, M] + W[rows, :K] @ A[a_rows, :K].T, A in `permute_pairs`' layout ([*, KP])."""
    a_off = a_rows.to(tl.int64)[:, None] * KP
    r = rows.to(tl.int64)[:, None]
    c = tl.arange(0, BLOCK_K // 8)
    c2 = tl.arange(0, BLOCK_K // 4)
    for k0 in range(0, K, BLOCK_K):
        kw = k0 // 8 + c
        q = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + r * (stride_q // 4) + kw[None, :],
                    mask=row_ok[:, None] & (kw // 4 < K // 32)[None, :], other=0)
        kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(s_ptr + r * stride_s + kg[None, :],
                    mask=row_ok[:, None] & (kg < K // 32)[None, :], other=0).to(tl.int32)
        if DOT_DTYPE == tl.bfloat16:
            sc = tl.where(s == 0, 0x40, s << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            sc = ((s + 14) << 23).to(tl.float32, bitcast=True)
        # each word's scale, twice: both codes of a pair share it
        sc = tl.broadcast_to(sc[:, :, None, None], (rows.shape[0], BLOCK_K // 32, 4, 2))
        sc = sc.reshape(rows.shape[0], BLOCK_K // 4)
        for jj in tl.static_range(4):
            xj = tl.load(xp_ptr + a_off + (k0 + (BLOCK_K // 4) * jj + c2)[None, :],
                         mask=a_ok[:, None], other=0.0)
            if DOT_DTYPE == tl.bfloat16:
                # codes jj (bits 4jj..4jj+3) and jj + 4 (16 bits up) as the two bf16 halves
                if jj < 2:
                    em = (q << (6 - 4 * jj)) & 0x01C001C0
                else:
                    em = (q >> (4 * jj - 6)) & 0x01C001C0
                p = ((q << (12 - 4 * jj)) & -0x7FFF8000) | em  # 0x80008000 as an int32
                lo = (p & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
                hi = ((p >> 16) & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
                w = tl.join(lo, hi).reshape(rows.shape[0], BLOCK_K // 4)
                w = (w * 2.0**126).to(tl.bfloat16) * sc
                acc = tl.dot(w, tl.trans(xj.to(tl.bfloat16)), acc)
            else:
                lo = (((q << (28 - 4 * jj)) >> 19) & 0x8E00).to(tl.uint16)
                hi = (((q << (12 - 4 * jj)) >> 19) & 0x8E00).to(tl.uint16)
                w = tl.join(lo.to(tl.float16, bitcast=True).to(tl.float32),
                            hi.to(tl.float16, bitcast=True).to(tl.float32))
                w = w.reshape(rows.shape[0], BLOCK_K // 4) * sc
                acc = tl.dot(w, tl.trans(xj.to(tl.float32)), acc, input_precision="ieee")
    return acc


@triton.jit
def _gate_up_pairs(xp_ptr, order_ptr, off_ptr, q_ptr, s_ptr, b_ptr, act_ptr, E, H, HP, N, IP,
                   stride_qe, stride_q, stride_se, stride_s, alpha, limit, TOPK: tl.constexpr,
                   E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """`moe_triton._prefill_gate_up` on `_mx_gemm_pairs`."""
    e, row0, row_end = mt._tile_rows(off_ptr, tl.program_id(0), E, E_PAD, BLOCK_M)
    if row0 >= row_end:
        return
    m = row0 + tl.arange(0, BLOCK_M)
    ok = m < row_end
    tok = tl.load(order_ptr + m, mask=ok, other=0) // TOPK
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.trans(_mx_gemm_pairs(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), xp_ptr, tok, ok, HP,
                                  H, q_ptr + e * stride_qe, s_ptr + e * stride_se, stride_q,
                                  stride_s, rows, row_ok, BLOCK_K, DOT_DTYPE))
    bias = tl.load(b_ptr + e * N + rows, mask=row_ok, other=0.0).to(tl.float32)
    y = mt._swiglu(acc + bias[None, :], alpha, limit, BLOCK_M, BLOCK_N)
    half = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(act_ptr + m.to(tl.int64)[:, None] * IP + _permuted_pairs(half, BLOCK_K)[None, :],
             y.to(act_ptr.dtype.element_ty), mask=ok[:, None] & (half < N // 2)[None, :])


@triton.jit
def _down_pairs(act_ptr, order_ptr, off_ptr, wts_ptr, q_ptr, s_ptr, b_ptr, y_ptr, E, I, IP, H,
                stride_qe, stride_q, stride_se, stride_s, E_PAD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT_DTYPE: tl.constexpr):
    """`moe_triton._prefill_down` on `_mx_gemm_pairs`."""
    e, row0, row_end = mt._tile_rows(off_ptr, tl.program_id(0), E, E_PAD, BLOCK_M)
    if row0 >= row_end:
        return
    m = row0 + tl.arange(0, BLOCK_M)
    ok = m < row_end
    slot = tl.load(order_ptr + m, mask=ok, other=0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    acc = _mx_gemm_pairs(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), act_ptr, m, ok, IP, I,
                         q_ptr + e * stride_qe, s_ptr + e * stride_se, stride_q, stride_s, rows,
                         row_ok, BLOCK_K, DOT_DTYPE)
    bias = tl.load(b_ptr + e * H + rows, mask=row_ok, other=0.0).to(tl.float32)
    wt = tl.load(wts_ptr + slot, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + slot.to(tl.int64)[None, :] * H + rows[:, None],
             (acc + bias[:, None]) * wt[None, :], mask=ok[None, :] & row_ok[:, None])


def prefill_pairs_dec(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      w: ExpertWeights, cfg: mt.PrefillConfig | None = None) -> torch.Tensor:
    """`moe_triton._prefill_pairs` on the kernels above: y [T * K, H] fp32."""
    t, h, k, e, i = mt._shapes(x, topk_ids, w)
    cfg = cfg or mt.prefill_config(x.shape[0], w.gate_up_blocks.shape[0], topk_ids.shape[1])
    pairs, bk = t * k, cfg.block_k
    y = torch.empty(pairs, h, dtype=torch.float32, device=x.device)
    xp = permute_pairs(x.contiguous(), bk)
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    bounds = torch.arange(e + 1, device=x.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds)
    ip = triton.cdiv(i, bk) * bk
    act = torch.empty(pairs, ip, dtype=x.dtype, device=x.device)
    if ip > i:  # the padding: words w >= (i % bk) / 8 of the last K tile, in every pair phase
        act.view(pairs, ip // bk, 4, bk // 8, 2)[:, -1, :, (i % bk) // 8:] = 0
    n_tiles = triton.cdiv(pairs, cfg.block_m) + e
    common = dict(E_PAD=triton.next_power_of_2(e), BLOCK_M=cfg.block_m, BLOCK_K=bk,
                  DOT_DTYPE=mt._dot_dtype(x), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _gate_up_pairs[(n_tiles, triton.cdiv(2 * i, cfg.block_n1))](
        xp, order, offsets, w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias, act, e, h,
        xp.shape[1], 2 * i, ip, *mt._strides(w.gate_up_blocks, w.gate_up_scales),
        float(w.alpha), float(w.limit), TOPK=k, BLOCK_N=cfg.block_n1, **common)
    _down_pairs[(n_tiles, triton.cdiv(h, cfg.block_n2))](
        act, order, offsets, topk_weights.contiguous().view(-1), w.down_blocks, w.down_scales,
        w.down_bias, y, e, i, ip, h, *mt._strides(w.down_blocks, w.down_scales),
        BLOCK_N=cfg.block_n2, **common)
    return y


def sass_report() -> None:
    """The product's gate_up and down against this form for sm_90 (no GPU): registers, spills
    and the K loop's instruction mix."""
    from offline_sass import compile_sass, loop_mix

    common = dict(order_ptr="*i64", off_ptr="*i64", q_ptr="*u8", s_ptr="*u8", b_ptr="*bf16",
                  E=32, stride_qe=5760 * 1440, stride_q=1440, stride_se=5760 * 90, stride_s=90)
    gate = dict(common, xp_ptr="*bf16", act_ptr="*bf16", H=2880, HP=2944, N=5760, IP=2944,
                alpha=1.0, limit=1.0)
    down = dict(common, act_ptr="*bf16", wts_ptr="*fp32", y_ptr="*fp32", I=2880, IP=2944,
                H=2880)
    for bm, bn, nw in [(64, 128, 4), (128, 128, 8), (128, 256, 8)]:
        cx = dict(E_PAD=32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, DOT_DTYPE=tl.bfloat16)
        for name, fn, args, extra in [
                ("gate_up (product)", mt._prefill_gate_up, gate, dict(TOPK=4)),
                ("gate_up (pairs)", _gate_up_pairs, gate, dict(TOPK=4)),
                ("down (product)", mt._prefill_down, down, {}),
                ("down (pairs)", _down_pairs, down, {})]:
            usage, sass = compile_sass(name, (fn, args, {**cx, **extra},
                                              dict(num_warps=nw, num_stages=3), 128 * 128))
            mix, total = loop_mix(sass)
            print(f"{name} {bm}x{bn}/w{nw}: {usage.split(' CONSTANT')[0]}\n  K loop {total}: "
                  + ", ".join(f"{op} {n}" for op, n in mix.most_common(10)), flush=True)


def bench(tokens: list[int]) -> None:
    """us a layer (sort, permutation, gate_up, down), the product against this form, 20b
    shapes, 4 weight sets, both at the product's tiles."""
    from moe_kernels import call_sets, timed, weights

    ws = [weights(s, 32, 2880, 2880) for s in range(4)]
    for t in tokens:
        sets = list(call_sets(t, ws))
        ref = mt._prefill_pairs(*sets[0], None)
        err = ((prefill_pairs_dec(*sets[0]) - ref).norm() / ref.norm()).item()
        base = timed(lambda: [mt._prefill_pairs(*c, None) for c in sets], [()]) / len(sets)
        new = timed(lambda: [prefill_pairs_dec(*c) for c in sets], [()]) / len(sets)
        print(f"T={t:<5} product {base:9.1f} us  pair decode {new:9.1f} us "
              f"({new / base - 1:+.1%})  err against the product {err:.1e}", flush=True)


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
