"""The small per-layer kernels of the GPU path, each one launch instead of a chain of torch ops.

At batch 1 a decode step is hundreds of tiny kernels, and each costs a few microseconds however
little it does; fusing the norm with the residual add, the rotary embedding of q and k, the K/V
store, and the router's top-k + softmax removes most of them. At decode the norm after attention,
the router and its top-k are one launch (`norm_route_triton`). Each has a torch twin of the same
signature (in the model and kernels packages) that tests compare against, also on CPU through
the Triton interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl



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
):
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
):
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
        )
    return q, k


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_stride, v_stride, ROW: tl.constexpr,
):
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
        )


# From this many experts (a power of two) the top-k is K rounds of argmax instead of ranks: at
# 128 experts the ranks' 128 x 128 comparisons cost ~1.3 us, at 32 ranks stay ~0.3 us faster
# (bench/norm_route.py; bench/results/2026-11-27_h100_norm_route.md)
TOPK_ARGMAX_FROM = 64


@triton.jit
def _held(ids, first, end):
    """Expert ids as this rank holds them: id - first inside [first, end), else -1 (expert
    parallelism: a pair whose expert another rank holds, which the MoE kernels skip)."""
    return tl.where((ids >= first) & (ids < end), ids - first, -1)


@triton.jit
def _topk_softmax(x, e, n, w_ptr, ids_ptr, row, first, end, K: tl.constexpr,
                  BLOCK_E: tl.constexpr, ARGMAX_FROM: tl.constexpr):
    """The K largest of x [BLOCK_E] (its first n real; lowest index among equals), softmax over
    them, stored in order, their ids as `_held` gives them. Few experts: each expert's rank is
    how many beat it (three reductions, not two per pick, but BLOCK_E**2 comparisons); many: K
    rounds of argmax."""
    if BLOCK_E < ARGMAX_FROM:
        beats = (x[None, :] > x[:, None]) | ((x[None, :] == x[:, None]) & (e[None, :] < e[:, None]))
        rank = tl.sum(beats.to(tl.int32), axis=1)
        top = rank < K
        p = tl.where(top, tl.exp(x - tl.max(x, axis=0)), 0.0)
        tl.store(w_ptr + row * K + rank, p / tl.sum(p, axis=0), mask=top)
        tl.store(ids_ptr + row * K + rank, _held(e, first, end), mask=top)
    else:
        j = tl.arange(0, K)
        vals = tl.zeros((K,), tl.float32)
        ids = tl.zeros((K,), tl.int32)
        free = e < n
        for i in tl.static_range(K):
            m = tl.max(tl.where(free, x, float("-inf")), axis=0)
            pick = tl.min(tl.where(free & (x == m), e, BLOCK_E), axis=0)
            vals = tl.where(j == i, m, vals)
            ids = tl.where(j == i, pick, ids)
            free = free & (e != pick)
        p = tl.exp(vals - tl.max(vals, axis=0))
        tl.store(w_ptr + row * K + j, p / tl.sum(p, axis=0))
        tl.store(ids_ptr + row * K + j, _held(ids, first, end))


@triton.jit
def _router_topk_kernel(
    logits_ptr, w_ptr, ids_ptr, n_experts, first, end, K: tl.constexpr, BLOCK_E: tl.constexpr,
    ARGMAX_FROM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * n_experts + e, mask=e < n_experts, other=float("-inf")).to(
        tl.float32
    )
    _topk_softmax(x, e, n_experts, w_ptr, ids_ptr, row, first, end, K, BLOCK_E, ARGMAX_FROM)


def router_topk_triton(logits: torch.Tensor, k: int, held: tuple[int, int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row, softmax over those k: (weights fp32 [T, k], ids int32 [T, k]); with
    `held` ([first, end), expert parallelism) the ids as `router_topk_torch` gives them."""
    t, e = logits.shape
    first, end = held or (0, e)
    assert triton.next_power_of_2(k) == k, "top-k must be a power of two"
    logits = logits.contiguous()
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int32, device=logits.device)
    if t:
        _router_topk_kernel[(t,)](logits, weights, ids, e, first, end, K=k,
                                  BLOCK_E=triton.next_power_of_2(e), ARGMAX_FROM=TOPK_ARGMAX_FROM)
    return weights, ids


# Router rows a program (E / rows programs a token; each also normalizes the token's x) and its
# warps, for fewer than TOPK_ARGMAX_FROM experts and for more: the fastest of a sweep
# (bench/norm_route.py; bench/results/2026-11-27_h100_norm_route.md)
NORM_ROUTE_TILES = {"few": (2, 4), "many": (4, 8)}
# Up to this many tokens the norm after attention, the router and its top-k are one launch;
# above, three launches cost less than every token's programs reading the router rows again.
# At 128 experts that turns sooner than at 32: on an H200 one launch took 4.8-8.6 us a layer at
# 16-64 tokens and 32 experts against 10.4-12.3, and at 128 experts 9.2 against 13.0 at 16
# tokens but 14.3 against 13.4 at 32 (bench/norm_route.py --launches both;
# bench/results/2026-11-28_session36.md).
NORM_ROUTE_MAX_TOKENS = {"few": 64, "many": 16}


@triton.jit
def _norm_route_kernel(
    x_ptr, res_ptr, out_ptr, res_out_ptr, nw_ptr, rw_ptr, rb_ptr, logits_ptr, count_ptr, w_ptr,
    ids_ptr, n_cols, n_experts, eps, first, end, EPB: tl.constexpr, K: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr, ARGMAX_FROM: tl.constexpr,
):
    """Program (t, g): norm(x + res) of token t (every program of t computes it, program 0
    stores it and the new residual), router logits of experts g*EPB.. into logits [T, E]; the
    last program of t to finish (a ticket in count [t], reset by it) takes the top-k."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    ex = g * EPB + tl.arange(0, EPB)
    ex_ok = ex < n_experts
    # the router rows first: they do not wait for the norm
    wr = tl.load(rw_ptr + ex.to(tl.int64)[:, None] * n_cols + cols[None, :],
                 mask=ex_ok[:, None] & mask[None, :], other=0.0)
    rb = tl.load(rb_ptr + ex, mask=ex_ok, other=0.0)
    x = tl.load(x_ptr + t * n_cols + cols, mask=mask, other=0.0)
    x = (x.to(tl.float32)
         + tl.load(res_ptr + t * n_cols + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = (tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32) * (xf * rstd)).to(x.dtype)
    if g == 0:
        tl.store(res_out_ptr + t * n_cols + cols, x, mask=mask)
        tl.store(out_ptr + t * n_cols + cols, y, mask=mask)
    logit = tl.sum(wr.to(tl.float32) * y.to(tl.float32)[None, :], axis=1) + rb.to(tl.float32)
    # rounded as the router's output is in the unfused path (a linear layer in x's dtype)
    tl.store(logits_ptr + t * n_experts + ex, logit.to(x.dtype).to(tl.float32), mask=ex_ok)
    tl.debug_barrier()  # every thread's logit is stored before the ticket releases them
    if tl.atomic_add(count_ptr + t, 1, sem="acq_rel") == tl.num_programs(1) - 1:
        e = tl.arange(0, BLOCK_E)
        v = tl.load(logits_ptr + t * n_experts + e, mask=e < n_experts, other=float("-inf"),
                    cache_modifier=".cg")
        _topk_softmax(v, e, n_experts, w_ptr, ids_ptr, t, first, end, K, BLOCK_E, ARGMAX_FROM)
        tl.atomic_xchg(count_ptr + t, 0)


_tickets: dict[torch.device, torch.Tensor] = {}


def _ticket_counters(device: torch.device) -> torch.Tensor:
    """Zeroed once per device; every launch leaves them zero again (the last program resets
    its token's), so CUDA graphs replay without a memset."""
    if device not in _tickets:
        _tickets[device] = torch.zeros(max(NORM_ROUTE_MAX_TOKENS.values()), dtype=torch.int32,
                                       device=device)
    return _tickets[device]


def norm_route_triton(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    router_weight: torch.Tensor, router_bias: torch.Tensor, k: int,
    held: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `Kernels.post_attention`'s unfused path: (norm(x + residual),
    x + residual, top-k weights fp32, ids int32, as `router_topk_triton` gives them for
    `held`). One launch for up to NORM_ROUTE_MAX_TOKENS
    tokens; more go through the three kernels in turn. The residual is returned new (other
    programs of a token still read the old one)."""
    t, h = x.shape
    kind = "many" if triton.next_power_of_2(router_weight.shape[0]) >= TOPK_ARGMAX_FROM else "few"
    if t > NORM_ROUTE_MAX_TOKENS[kind]:
        x, residual = rms_norm_triton(x, norm_weight, eps, residual)
        weights, ids = router_topk_triton(torch.nn.functional.linear(x, router_weight,
                                                                     router_bias), k, held)
        return x, residual, weights, ids
    assert triton.next_power_of_2(k) == k, "top-k must be a power of two"
    e = router_weight.shape[0]
    first, end = held or (0, e)
    x, residual = x.contiguous(), residual.contiguous()
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    weights = torch.empty(t, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, k, dtype=torch.int32, device=x.device)
    if t:
        block_e = triton.next_power_of_2(e)
        rows, warps = NORM_ROUTE_TILES[kind]
        epb = min(rows, block_e)
        _norm_route_kernel[(t, triton.cdiv(e, epb))](
            x, residual, out, res_out, norm_weight, router_weight, router_bias, logits,
            _ticket_counters(x.device), weights, ids, h, e, eps, first, end, EPB=epb, K=k,
            BLOCK=triton.next_power_of_2(h), BLOCK_E=block_e, ARGMAX_FROM=TOPK_ARGMAX_FROM,
            num_warps=warps)
    return out, res_out, weights, ids
