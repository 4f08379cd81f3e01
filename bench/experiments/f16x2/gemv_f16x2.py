"""The f16x2 MXFP4 GEMVs: the MoE pair GEMV and the dense MXFP4 GEMV of tinyoss with two fp16
products an instruction (`mxfp4_dot_triton`), on activations packed as fp16 pairs.

An experiment, out of the product since the Gluon pair GEMV (bench/experiments/README.md). The
kernels are those tinyoss shipped behind TINYOSS_EXPERIMENTAL=f16x2; the host functions stand
alone (the top-k combine is a torch sum). Runs from the repository root:

    python -m bench.experiments.f16x2.gemv_f16x2 --tokens 1,2,4,8   # GPU: against moe_gemv
    python -m bench.experiments.f16x2.gemv_f16x2 --sass             # no GPU: sm_90 SASS report
    python -m pytest bench/experiments/f16x2                         # interpreter or GPU tests
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from bench.experiments.f16x2.mxfp4_dot_triton import (ACT_EBITS, EXP_BIAS, group_dot,
                                                      group_scale, load_groups, pack_pairs,
                                                      pair_position, use_asm)
from tinyoss.kernels import linear_mxfp4_triton as lt
from tinyoss.kernels import moe_triton as mt
from tinyoss.kernels.moe_torch import ExpertWeights

# The pair GEMV's tiles, the best of its sweep at 20b shapes
# (bench/results/2026-11-23_h100_moe_kernels_d4beb31.txt)
TILES = mt.GemvConfig(block_n1=16, block_n2=16, block_k=512, num_warps=2)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output and workspace comes from here, so tests can poison them."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _pair_gemv_f16x2(xp_ptr, xe_ptr, x_div, ids_ptr, q_ptr, s_ptr, b_ptr, wts_ptr, out_ptr, N,
                     K, stride_qe, stride_q, stride_se, stride_s, alpha, limit,
                     SWIGLU: tl.constexpr, X_EBITS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """Rows of W_e @ x[pair // x_div] + b_e for pair = program 0 and e = ids[pair]; then the
    clamped SwiGLU into out [pairs, N/2] as packed fp16 pairs (scaled by 2**(EXP_BIAS -
    ACT_EBITS), what the down projection reads), or the routing weight into out [pairs, N] fp32.

    x comes packed (`pack_pairs`): pairs [*, K/2] int32 and per-group ebits [*, K/32] from
    xe_ptr, or the constant X_EBITS when nonzero."""
    pair = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    e = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = (pair // x_div).to(tl.int64)
    xp_row = xp_ptr + x_row * (K // 2)
    r64 = rows.to(tl.int64)[:, None]
    qp = (q_ptr + e * stride_qe).to(tl.pointer_type(tl.int32)) + r64 * (stride_q // 4)
    sp = s_ptr + e * stride_se + r64 * stride_s
    acc = tl.zeros((BLOCK_N, BLOCK_K // 32), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g, g_ok, q, sc = load_groups(qp, sp, row_ok, k0, K, BLOCK_K)
        if X_EBITS:
            ebits = X_EBITS
        else:
            ebits = tl.load(xe_ptr + x_row * (K // 32) + g, mask=g_ok, other=0)[None, :]
        acc += group_dot(q, xp_row, g, g_ok, ASM) * group_scale(sc, ebits)
    h = tl.sum(acc, 1) + tl.load(b_ptr + e * N + rows, mask=row_ok, other=0.0).to(tl.float32)
    if SWIGLU:
        gate, up = tl.split(h.reshape(BLOCK_N // 2, 2))
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1) * gate * tl.sigmoid(alpha * gate) * 2.0 ** (EXP_BIAS - ACT_EBITS)
        half = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out16 = out_ptr.to(tl.pointer_type(tl.float16)) + pair.to(tl.int64) * (N // 2)
        tl.store(out16 + pair_position(half), act.to(tl.float16), mask=half < N // 2)
    else:
        wt = tl.load(wts_ptr + pair).to(tl.float32)
        tl.store(out_ptr + pair.to(tl.int64) * N + rows, h * wt, mask=row_ok)


@triton.jit
def _gemv_f16x2(
    xp_ptr, xe_ptr, q_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_q, stride_s,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ASM: tl.constexpr,
):
    """out[toks, rows] = x[toks] @ W[rows].T (+ b[rows]), for this program's tokens and rows.

    x comes packed (`pack_pairs`); each weight tile is loaded once for the BLOCK_M tokens and
    multiplied two products an instruction (`group_dot`), one reduction over K after the loop."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tok0 = tl.program_id(1) * BLOCK_M
    r64 = rows.to(tl.int64)[:, None]
    qp = q_ptr.to(tl.pointer_type(tl.int32)) + r64 * (stride_q // 4)
    sp = s_ptr + r64 * stride_s
    ms = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g, g_ok, q, sc = load_groups(qp, sp, row_ok, k0, K, BLOCK_K)
        for m in tl.static_range(BLOCK_M):
            tok = tl.minimum(tok0 + m, M - 1).to(tl.int64)  # past M: a valid row, not stored
            ebits = tl.load(xe_ptr + tok * (K // 32) + g, mask=g_ok, other=0)[None, :]
            part = group_dot(q, xp_ptr + tok * (K // 2), g, g_ok, ASM) * group_scale(sc, ebits)
            acc += tl.where(ms[:, None] == m, tl.sum(part, 1)[None, :], 0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    toks = tok0 + ms
    tl.store(
        out_ptr + toks.to(tl.int64)[:, None] * N + rows[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(toks < M)[:, None] & row_ok[None, :],
    )


def moe_gemv_f16x2(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   w: ExpertWeights, config: mt.GemvConfig = TILES) -> torch.Tensor:
    """What `moe_triton.moe_gemv` computes, x [T, H] -> [T, H]: x packed, the f16x2 pair GEMVs
    for gate_up (SwiGLU written packed) and down, then each token's top-k rows summed."""
    t, h = x.shape
    k = topk_ids.shape[1]
    n1 = w.gate_up_blocks.shape[1]
    i = n1 // 2
    pairs = t * k
    y = _empty((pairs, h), torch.float32, x.device)
    if t == 0:
        return y.view(t, h).to(x.dtype)
    ids = topk_ids.contiguous().view(-1)
    wts = topk_weights.contiguous().view(-1)
    xp, xe = pack_pairs(x)
    act = _empty((pairs, i // 2), torch.int32, x.device)  # fp16 pairs
    launch = {"BLOCK_K": config.block_k, "ASM": use_asm(x), "num_warps": config.num_warps,
              "num_stages": config.num_stages}
    gu = (w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias)
    dn = (w.down_blocks, w.down_scales, w.down_bias)
    _pair_gemv_f16x2[(pairs, triton.cdiv(n1, config.block_n1))](
        xp, xe, k, ids, *gu, wts, act, n1, h, *_strides(*gu[:2]), w.alpha, w.limit,
        SWIGLU=True, X_EBITS=0, BLOCK_N=config.block_n1, **launch)
    _pair_gemv_f16x2[(pairs, triton.cdiv(h, config.block_n2))](
        act, act, 1, ids, *dn, wts, y, h, i, *_strides(*dn[:2]), w.alpha, w.limit,
        SWIGLU=False, X_EBITS=ACT_EBITS.value, BLOCK_N=config.block_n2, **launch)
    return y.view(t, k, h).sum(1).to(x.dtype)


def _strides(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[int, int, int, int]:
    return blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1)


def linear_gemv_f16x2(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                      bias: torch.Tensor | None = None,
                      config: lt.GemvConfig | None = None) -> torch.Tensor:
    """What `linear_mxfp4_triton.linear_gemv` computes, x [M, K] -> [M, N] in x.dtype (blocks
    [N, K/32, 16] and scales [N, K/32] contiguous), on the f16x2 dot."""
    m, n = x.shape[0], blocks.shape[0]
    cfg = config or lt.gemv_config(m, n)
    out = _empty((m, n), x.dtype, x.device)
    if m:
        _gemv_f16x2[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))](
            *pack_pairs(x), blocks, scales, out if bias is None else bias, out, m, n, x.shape[1],
            blocks.stride(0), scales.stride(0), HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ASM=use_asm(x), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    return out


def sass_specs() -> dict:
    """The kernels in `bench/offline_sass.py`'s form: name -> (jit function, example args,
    constexprs, launch options, weights per K step), at gpt-oss-20b shapes."""
    pair = dict(xp_ptr="*i32", xe_ptr="*i32", x_div=4, ids_ptr="*i32", q_ptr="*u8", s_ptr="*u8",
                b_ptr="*bf16", wts_ptr="*fp32", out_ptr="*i32", N=5760, K=2880,
                stride_qe=5760 * 1440, stride_q=1440, stride_se=5760 * 90, stride_s=90,
                alpha=1.0, limit=1.0)
    lin = dict(xp_ptr="*i32", xe_ptr="*i32", q_ptr="*u8", s_ptr="*u8", b_ptr="*bf16",
               out_ptr="*bf16", M=1, N=201088, K=2880, stride_q=1440, stride_s=90)
    lv = lt.gemv_config(1, 201088)
    return {
        "pair_gemv_f16x2": (_pair_gemv_f16x2, pair,
                            dict(SWIGLU=True, X_EBITS=0, BLOCK_N=TILES.block_n1,
                                 BLOCK_K=TILES.block_k, ASM=True),
                            dict(num_warps=TILES.num_warps, num_stages=TILES.num_stages),
                            TILES.block_n1 * TILES.block_k),
        "linear_mxfp4_f16x2": (_gemv_f16x2, lin,
                               dict(HAS_BIAS=False, BLOCK_M=1, BLOCK_N=lv.block_n,
                                    BLOCK_K=lv.block_k, ASM=True),
                               dict(num_warps=lv.num_warps, num_stages=lv.num_stages),
                               lv.block_n * lv.block_k),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--sass", action="store_true", help="compile for sm_90 and report, no GPU")
    args = p.parse_args()
    if args.sass:
        from bench import offline_sass

        for name, spec in sass_specs().items():
            offline_sass.report(name, spec)
        return
    from bench.moe_kernels import call_sets, timed, weights
    from tinyoss.kernels.moe_torch import moe_torch

    ws = [weights(s, 32, 2880, 2880) for s in range(4)]  # gpt-oss-20b's experts
    for t in map(int, args.tokens.split(",")):
        sets = call_sets(t, ws)
        ref = moe_torch(*sets[0]).float()
        row = [f"T={t:<3}"]
        for name, fn in (("moe_gemv", mt.moe_gemv), ("f16x2", moe_gemv_f16x2)):
            err = ((fn(*sets[0]).float() - ref).norm() / ref.norm()).item()
            row.append(f"{name} {timed(fn, sets):7.1f} us err {err:.0e}")
        print(" | ".join(row), flush=True)

if __name__ == "__main__":
    main()
