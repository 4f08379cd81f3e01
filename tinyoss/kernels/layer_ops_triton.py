"""The small per-layer kernels of the GPU path, each one launch instead of a chain of torch ops.

At batch 1 a decode step is hundreds of tiny kernels, and each costs a few microseconds however
little it does; fusing the norm with the residual add, the rotary embedding of q and k, the K/V
store, and the router's top-k + softmax removes most of them. Each has a torch twin of the same
signature (in the model and kernels packages) that tests compare against, also on CPU through
the Triton interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyoss.kernels.launch import pdl_options
from tinyoss.kernels.pdl_triton import pdl_start


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    out_ptr,
    res_out_ptr,
    w_ptr,
    n_cols,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = (
            x.to(tl.float32)
            + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        ).to(x.dtype)  # the sum rounds to the activation dtype, as in torch
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (w * (xf * rstd)).to(x.dtype), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rms_norm_torch`; the new residual is written over `residual` in place."""
    x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty_like(x)
    res_out = residual if residual is not None else x
    _add_rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        out,
        res_out,
        weight,
        cols,
        eps,
        HAS_RES=residual is not None,
        BLOCK=triton.next_power_of_2(cols),
        **pdl_options(x),
    )
    return out, res_out


@triton.jit
def _rotate_heads(ptr, n_heads, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = heads < n_heads
    p = ptr + heads * (2 * HALF) + d
    x1 = tl.load(p, mask=mask, other=0.0)
    x2 = tl.load(p + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(p, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(p + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    q_stride,
    k_stride,
    n_q_heads,
    n_k_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * 2 * HALF + d)[None, :]
    sin = tl.load(cache_ptr + pos * 2 * HALF + HALF + d)[None, :]
    _rotate_heads(q_ptr + t * q_stride, n_q_heads, cos, sin, HALF, BLOCK_H)
    _rotate_heads(k_ptr + t * k_stride, n_k_heads, cos, sin, HALF, BLOCK_H)


def rope_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hk, D] in place (views into the qkv output are fine)."""
    t, hq, d = q.shape
    hk = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and q.stride(1) == d and k.stride(1) == d
    if t:
        _rope_kernel[(t,)](
            q,
            k,
            positions,
            cache,
            q.stride(0),
            k.stride(0),
            hq,
            hk,
            HALF=d // 2,
            BLOCK_H=triton.next_power_of_2(max(hq, hk)),
            **pdl_options(q),
        )
    return q, k


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_stride, v_stride, ROW: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    cols = tl.arange(0, ROW)
    if slot >= 0:
        k = tl.load(k_ptr + t * k_stride + cols)
        v = tl.load(v_ptr + t * v_stride + cols)
        tl.store(kc_ptr + slot * ROW + cols, k.to(kc_ptr.dtype.element_ty))
        tl.store(vc_ptr + slot * ROW + cols, v.to(vc_ptr.dtype.element_ty))


def store_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as `attention.write_kv`: one launch stores both K and V rows."""
    t, hk, d = k.shape
    row = hk * d
    assert triton.next_power_of_2(row) == row, "kv_heads * head_dim must be a power of two"
    assert k.stride(1) == d and v.stride(1) == d and k.stride(2) == 1 and v.stride(2) == 1
    if t:
        _store_kv_kernel[(t,)](
            k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ROW=row,
            **pdl_options(k),
        )


@triton.jit
def _router_topk_kernel(
    logits_ptr, w_ptr, ids_ptr, n_experts, K: tl.constexpr, BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * n_experts + e, mask=e < n_experts, other=float("-inf")).to(
        tl.float32
    )
    ks = tl.arange(0, K)
    vals = tl.zeros((K,), dtype=tl.float32)
    ids = tl.zeros((K,), dtype=tl.int32)
    for i in tl.static_range(K):
        m = tl.max(x, axis=0)
        idx = tl.min(tl.where(x == m, e, BLOCK_E), axis=0)  # lowest index among equals
        vals = tl.where(ks == i, m, vals)
        ids = tl.where(ks == i, idx, ids)
        x = tl.where(e == idx, float("-inf"), x)
    p = tl.exp(vals - tl.max(vals, axis=0))
    tl.store(w_ptr + row * K + ks, p / tl.sum(p, axis=0))
    tl.store(ids_ptr + row * K + ks, ids)


def router_topk_triton(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row, softmax over those k: (weights fp32 [T, k], ids int32 [T, k])."""
    t, e = logits.shape
    assert triton.next_power_of_2(k) == k, "top-k must be a power of two"
    logits = logits.contiguous()
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int32, device=logits.device)
    if t:
        _router_topk_kernel[(t,)](logits, weights, ids, e, K=k, BLOCK_E=triton.next_power_of_2(e),
                                  **pdl_options(logits))
    return weights, ids
