"""The prefill grouped GEMMs (`moe_triton._prefill_gate_up` / `_prefill_down`) with the weights
as the left operand of `tl.dot`: acc^T [N, M] = W [N, K] @ x^T [K, M], transposed once in the
epilogue.

Why: the product computes acc [M, N] = x [M, K] @ W^T, so the weights it dequantizes in
registers are the right operand, which Hopper's wgmma reads from shared memory: every K step
stores the dequantized tile to shared memory and reads it back. wgmma takes its left operand
from registers, so with W on the left the dequantized weights could go straight in; OpenAI's
triton_kernels puts them there for its MXFP4 matmul on Hopper
(bench/results/2026-11-27_triton_kernels_mxfp4_research.md). That is also what a prefill GEMM
on experts shuffled into MMA-fragment order would need (session 11 lost 22-48% with W on the
right). Prepared in session 22 without a GPU:

    python bench/experiments/prefill_wleft/wleft.py --sass            # offline, sm_90 SASS mix
    python bench/experiments/prefill_wleft/wleft.py --tokens 512,2048,8192   # GPU: us a layer
    python -m pytest bench/experiments/prefill_wleft                  # CPU (interpreter) or GPU
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


@triton.jit
def _mx_gemm_left(acc, a_ptr, a_rows, a_ok, K, q_ptr, s_ptr, stride_q, stride_s, rows, row_ok,
                  BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """acc [N, M] + W[rows, :K] @ A[a_rows, :K].T: `moe_triton._mx_gemm` with the operands
    swapped (same loads, same dequantization, same eight per-phase dots)."""
    a_off = a_rows.to(tl.int64)[:, None] * K
    nxt = mt._mx_load(a_ptr, a_off, a_ok, K, q_ptr, s_ptr, stride_q, stride_s, rows, row_ok, 0,
                      BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        a, q, s = nxt
        nxt = mt._mx_load(a_ptr, a_off, a_ok, K, q_ptr, s_ptr, stride_q, stride_s, rows, row_ok,
                          k0 + BLOCK_K, BLOCK_K)
        phase = mt._phases(a.to(DOT_DTYPE), BLOCK_K)
        sc = ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
        sc = tl.broadcast_to(sc[:, :, None], (rows.shape[0], BLOCK_K // 32, 4))
        sc = sc.reshape(q.shape)
        for j in tl.static_range(8):
            w = (((q << (28 - 4 * j)) >> 19) & 0x8E00).to(tl.uint16)
            w = w.to(tl.float16, bitcast=True).to(tl.float32) * sc
            if DOT_DTYPE == tl.float32:
                acc = tl.dot(w, tl.trans(phase[j]), acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(DOT_DTYPE), tl.trans(phase[j]), acc)
    return acc


@triton.jit
def _prefill_gate_up_left(x_ptr, order_ptr, off_ptr, q_ptr, s_ptr, b_ptr, act_ptr, E, H, N,
                          stride_qe, stride_q, stride_se, stride_s, alpha, limit,
                          TOPK: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          DOT_DTYPE: tl.constexpr):
    e, row0, row_end = mt._tile_rows(off_ptr, tl.program_id(0), E, E_PAD, BLOCK_M)
    if row0 >= row_end:
        return
    r = row0 + tl.arange(0, BLOCK_M)
    ok = r < row_end
    tok = tl.load(order_ptr + r, mask=ok, other=0) // TOPK
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc_t = _mx_gemm_left(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), x_ptr, tok, ok, H,
                          q_ptr + e * stride_qe, s_ptr + e * stride_se, stride_q, stride_s, rows,
                          row_ok, BLOCK_K, DOT_DTYPE)
    acc = tl.trans(acc_t)
    bias = tl.load(b_ptr + e * N + rows, mask=row_ok, other=0.0).to(tl.float32)
    y = mt._swiglu(acc + bias[None, :], alpha, limit, BLOCK_M, BLOCK_N)
    half = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(act_ptr + r.to(tl.int64)[:, None] * (N // 2) + half[None, :],
             y.to(act_ptr.dtype.element_ty), mask=ok[:, None] & (half < N // 2)[None, :])


@triton.jit
def _prefill_down_left(act_ptr, order_ptr, off_ptr, wts_ptr, q_ptr, s_ptr, b_ptr, y_ptr, E, I,
                       H, stride_qe, stride_q, stride_se, stride_s, E_PAD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_DTYPE: tl.constexpr):
    e, row0, row_end = mt._tile_rows(off_ptr, tl.program_id(0), E, E_PAD, BLOCK_M)
    if row0 >= row_end:
        return
    r = row0 + tl.arange(0, BLOCK_M)
    ok = r < row_end
    slot = tl.load(order_ptr + r, mask=ok, other=0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    acc_t = _mx_gemm_left(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), act_ptr, r, ok, I,
                          q_ptr + e * stride_qe, s_ptr + e * stride_se, stride_q, stride_s, rows,
                          row_ok, BLOCK_K, DOT_DTYPE)
    bias = tl.load(b_ptr + e * H + rows, mask=row_ok, other=0.0).to(tl.float32)
    wt = tl.load(wts_ptr + slot, mask=ok, other=0.0).to(tl.float32)
    # stored transposed: no layout conversion of the accumulator
    tl.store(y_ptr + slot.to(tl.int64)[None, :] * H + rows[:, None],
             (acc_t + bias[:, None]) * wt[None, :], mask=ok[None, :] & row_ok[:, None])


def prefill_pairs_left(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       w: ExpertWeights, cfg: mt.PrefillConfig | None = None) -> torch.Tensor:
    """`moe_triton._prefill_pairs` on the kernels above: y [T * K, H] fp32."""
    t, h, k, e, i = mt._shapes(x, topk_ids, w)
    cfg = cfg or mt.prefill_config(x.shape[0], w.gate_up_blocks.shape[0], topk_ids.shape[1])
    pairs = t * k
    y = torch.empty(pairs, h, dtype=torch.float32, device=x.device)
    x = x.contiguous()
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    bounds = torch.arange(e + 1, device=x.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds)
    act = torch.empty(pairs, i, dtype=x.dtype, device=x.device)
    n_tiles = triton.cdiv(pairs, cfg.block_m) + e
    common = dict(E_PAD=triton.next_power_of_2(e), BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
                  DOT_DTYPE=mt._dot_dtype(x), num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    _prefill_gate_up_left[(n_tiles, triton.cdiv(2 * i, cfg.block_n1))](
        x, order, offsets, w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias, act, e, h, 2 * i,
        *mt._strides(w.gate_up_blocks, w.gate_up_scales), float(w.alpha), float(w.limit),
        TOPK=k, BLOCK_N=cfg.block_n1, **common)
    _prefill_down_left[(n_tiles, triton.cdiv(h, cfg.block_n2))](
        act, order, offsets, topk_weights.contiguous().view(-1), w.down_blocks, w.down_scales,
        w.down_bias, y, e, i, h, *mt._strides(w.down_blocks, w.down_scales),
        BLOCK_N=cfg.block_n2, **common)
    return y


def sass_report() -> None:
    """Both forms of gate_up and down compiled for sm_90 (no GPU needed): registers, shared
    memory, and the K loop's instruction mix (STS/LDS: the shared-memory round trip; HGMMA:
    wgmma, whose SASS says where its left operand comes from)."""
    from offline_sass import compile_sass, loop_mix

    common = dict(order_ptr="*i64", off_ptr="*i64", q_ptr="*u8", s_ptr="*u8", b_ptr="*bf16",
                  E=32, stride_qe=5760 * 1440, stride_q=1440, stride_se=5760 * 90, stride_s=90)
    gate = dict(common, x_ptr="*bf16", act_ptr="*bf16", H=2880, N=5760, alpha=1.0, limit=1.0)
    down = dict(common, act_ptr="*bf16", wts_ptr="*fp32", y_ptr="*fp32", I=2880, H=2880)
    cx = dict(E_PAD=32, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, DOT_DTYPE=tl.bfloat16)
    opts = dict(num_warps=4, num_stages=3)
    for name, fn, args, extra in [
            ("gate_up (product: W right)", mt._prefill_gate_up, gate, dict(TOPK=4)),
            ("gate_up (W left)", _prefill_gate_up_left, gate, dict(TOPK=4)),
            ("down (product: W right)", mt._prefill_down, down, {}),
            ("down (W left)", _prefill_down_left, down, {})]:
        usage, sass = compile_sass(name, (fn, args, {**cx, **extra}, opts, 128 * 128))
        mix, total = loop_mix(sass)
        hgmma = sorted({ln.split(";")[0].split("*/")[-1].strip() for ln in sass.splitlines()
                        if "HGMMA" in ln})
        print(f"{name}: {usage}\n  K loop {total} instructions: "
              + ", ".join(f"{op} {n}" for op, n in mix.most_common(12)))
        for h in hgmma[:3]:
            print(f"  {h}")


def bench(tokens: list[int]) -> None:
    """us a layer (gate_up + down + sort), product against W-left, 20b shapes, 4 weight sets."""
    from moe_kernels import call_sets, timed, weights

    h = i = 2880
    ws = [weights(s, 32, h, i) for s in range(4)]
    for t in tokens:
        sets = list(call_sets(t, ws))
        ref = mt._prefill_pairs(*sets[0], None)
        out = prefill_pairs_left(*sets[0])
        err = ((out - ref).norm() / ref.norm()).item()
        base = timed(lambda: [mt._prefill_pairs(*c, None) for c in sets], [()]) / len(sets)
        left = timed(lambda: [prefill_pairs_left(*c) for c in sets], [()]) / len(sets)
        print(f"T={t:<5} product {base:9.1f} us  W-left {left:9.1f} us  "
              f"({left / base - 1:+.1%})  err {err:.1e}", flush=True)


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
