"""Decode attention with sinks and sliding windows in Triton, planned entirely on the device.

A decode step has one query per sequence. FlashInfer's planner costs a few hundred microseconds
of host time per cache group and step, more than the attention itself at batch 1; this kernel
needs no plan: each step only copies the block tables and key ranges into fixed buffers (every
cache group's in one copy and one launch, `stage_decode_plan`), so it replays inside CUDA graphs
as is.

Flash-decoding in one launch: programs (sequence, KV head, split) each take one split of the
sequence's range for the KV head's group of query heads and write a partial softmax (max, sum,
weighted values); the last program of a (sequence, KV head) to finish (a ticket, reset by it)
merges the splits and adds the head's sink to the denominator: out = sum_s e^(m_s - M) acc_s
/ (sum_s e^(m_s - M) l_s + e^(sink - M)). A sliding window of at most MIN_SPLIT keys is one
split, which writes the output itself.

Each program sizes its sequence's splits from the sequence's own length (at least MIN_SPLIT
keys), so a 1k-token context gets the same parallelism in an engine sized for 128k tokens as in
one sized for 2k, and a graph replays for any lengths. The number of splits a sequence may take
falls with the batch (about TARGET_PROGRAMS programs a launch, at most MAX_SPLITS a sequence):
one program merges its sequence's splits alone, and many short splits cost more in merging and
launching than they gain in parallel reads.

Each program also applies the rotary embedding to its queries, and the program holding the
newest key rotates it and stores it and its value in the cache before reading the cache: the
rope and K/V-store launches of a decode step live here (what `rope_triton` and
`store_kv_triton` do for prefill, with the same arithmetic).

Several query rows of one sequence (a speculative verify step: the last token and its drafts,
each row its own position and key range) cannot store their keys here: a row would read its
predecessors' slots before their programs wrote them. Such steps rotate and store every row
first (`rope_triton`, `store_kv_triton`) and launch with `stored=True`, which only reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


MIN_SPLIT = 128  # keys per program at least: a sliding layer (128 keys) is one split
MAX_SPLITS = 32  # splits per sequence at most: one program merges them all
TARGET_PROGRAMS = 512  # (sequence, KV head, split) programs a launch the splits aim at
# Keys per inner step: a whole minimal split in one step (faster than 64 at every batch and
# length measured, bench/results/2026-11-26_h100_decode_attention_splits.md).
BLOCK_KV = 128
MERGE_CHUNK = 8  # splits whose partials the merging program loads in one round
STAGE_BLOCK_W = 1024  # block-table entries `_stage_kernel` copies a round


@triton.jit
def _rotated(ptr, rows, ok, d, cos, sin, HALF: tl.constexpr):
    """Rows [R, D] at ptr + rows * D + d rotated half-split (NeoX) in fp32 and rounded back to
    the tensor's dtype, as `layer_ops_triton._rotate_heads` does."""
    x = tl.load(ptr + rows[:, None] * (2 * HALF) + d[None, :], mask=ok[:, None], other=0.0)
    partner = tl.load(ptr + rows[:, None] * (2 * HALF) + ((d + HALF) % (2 * HALF))[None, :],
                      mask=ok[:, None], other=0.0).to(tl.float32)
    rot = tl.where((d < HALF)[None, :], -partner, partner)
    return (x.to(tl.float32) * cos[None, :] + rot * sin[None, :]).to(x.dtype)


@triton.jit
def _partial_kernel(q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, rope_ptr, tables_ptr,
                    ranges_ptr, m_ptr, l_ptr, acc_ptr, tickets_ptr, sinks_ptr, out_ptr, scale,
                    max_splits, num_splits, table_stride, q_stride, kv_stride, HK: tl.constexpr,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                    PAGE: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_KV: tl.constexpr,
                    MERGE_CHUNK: tl.constexpr, FINAL: tl.constexpr, STORED: tl.constexpr):
    """One split's partial softmax into m, l, acc, merged by the last split to finish; FINAL
    (every range fits one split): the attention output itself, sink included, into out.
    STORED: q is rotated and the new keys are in the cache already."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2)
    lo = tl.load(ranges_ptr + 2 * b)
    hi = tl.load(ranges_ptr + 2 * b + 1)
    # what needs only (b, h) goes out with the range, not a round trip after the split test
    d = tl.arange(0, D)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    rows = tl.arange(0, GROUP_PAD)
    heads = h * GROUP + rows
    sink = tl.load(sinks_ptr + heads, mask=rows < GROUP, other=0.0).to(tl.float32)
    cos = tl.load(rope_ptr + pos * D + d % (D // 2))
    sin = tl.load(rope_ptr + pos * D + D // 2 + d % (D // 2))
    # this sequence's split: num_splits of them at most, whole BLOCK_KV steps, MIN_SPLIT keys
    split = tl.maximum(MIN_SPLIT, tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_KV) * BLOCK_KV)
    start = lo + s * split
    if start >= hi:
        return
    end = tl.minimum(hi, start + split)
    if end == hi and not STORED:  # this split holds the newest key: rotate and store it
        one = tl.arange(0, 1)
        k_new = _rotated(kn_ptr + b * kv_stride + h * D, one, one >= 0, d, cos, sin, D // 2)
        v_new = tl.load(vn_ptr + b * kv_stride + h * D + one[:, None] * D + d[None, :])
        row = (slot * HK + h) * D + one[:, None] * D + d[None, :]
        keep = (row * 0 + slot) >= 0  # slot < 0: padding, not stored
        tl.store(k_ptr + row, k_new.to(k_ptr.dtype.element_ty), mask=keep)
        tl.store(v_ptr + row, v_new.to(v_ptr.dtype.element_ty), mask=keep)
        tl.debug_barrier()  # the stores reach the cache before this program reads it
    if STORED:
        q = tl.load(q_ptr + b * q_stride + heads[:, None] * D + d[None, :],
                    mask=(rows < GROUP)[:, None], other=0.0)
    else:
        q = _rotated(q_ptr + b * q_stride, heads, rows < GROUP, d, cos, sin, D // 2)
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_sum = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D), tl.float32)
    for k0 in range(start, end, BLOCK_KV):
        t = k0 + tl.arange(0, BLOCK_KV)
        ok = t < end
        block = tl.load(tables_ptr + b * table_stride + t // PAGE, mask=ok, other=0).to(tl.int64)
        row = (block * PAGE + t % PAGE) * HK + h
        k = tl.load(k_ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k.to(q.dtype))) * scale
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m = m_new
    valid = rows < GROUP
    dst = out_ptr + (b * HK * GROUP + heads)[:, None] * D + d[None, :]
    if FINAL:
        big = tl.maximum(m, sink)
        w = tl.exp(m - big)
        w = w / (w * l_sum + tl.exp(sink - big))
        tl.store(dst, (acc * w[:, None]).to(out_ptr.dtype.element_ty), mask=valid[:, None])
    else:
        base = (b * HK + h) * max_splits * GROUP_PAD
        idx = base + s * GROUP_PAD + rows
        tl.store(m_ptr + idx, m, mask=valid)  # the padding rows are never read
        tl.store(l_ptr + idx, l_sum, mask=valid)
        tl.store(acc_ptr + idx[:, None] * D + d[None, :], acc, mask=valid[:, None])
        tl.debug_barrier()  # every thread's partials are stored before the ticket releases them
        n = tl.cdiv(hi - lo, split)
        ticket = tickets_ptr + b * HK + h
        if tl.atomic_add(ticket, 1, sem="acq_rel") == n - 1:
            _merge(m_ptr, l_ptr, acc_ptr, base, n, rows, d, sink, dst, valid, GROUP_PAD, D,
                   MERGE_CHUNK)
            tl.atomic_xchg(ticket, 0)


@triton.jit
def _merge(m_ptr, l_ptr, acc_ptr, base, n, rows, d, sink, dst, valid, GROUP_PAD: tl.constexpr,
           D: tl.constexpr, CHUNK: tl.constexpr):
    """The n splits' partials at base (read past L1: other programs wrote them) into dst. The
    loads of CHUNK splits go out together (an unrolled inner loop, each split's rows in the
    same registers as the output's): a round trip to L2 per CHUNK splits, not per split, and no
    reduction across threads."""
    big = sink
    for s0 in range(0, n, CHUNK):
        for j in tl.static_range(CHUNK):
            at = base + (s0 + j) * GROUP_PAD + rows
            here = valid & (rows * 0 + s0 + j < n)
            big = tl.maximum(big, tl.load(m_ptr + at, mask=here, other=float("-inf"),
                                          cache_modifier=".cg"))
    denom = tl.exp(sink - big)
    num = tl.zeros((GROUP_PAD, D), tl.float32)
    for s0 in range(0, n, CHUNK):
        for j in tl.static_range(CHUNK):
            at = base + (s0 + j) * GROUP_PAD + rows
            here = valid & (rows * 0 + s0 + j < n)
            w = tl.exp(tl.load(m_ptr + at, mask=here, other=float("-inf"), cache_modifier=".cg")
                       - big)  # 0 past the n splits
            denom += w * tl.load(l_ptr + at, mask=here, other=0.0, cache_modifier=".cg")
            num += w[:, None] * tl.load(acc_ptr + at[:, None] * D + d[None, :],
                                        mask=here[:, None], other=0.0, cache_modifier=".cg")
    tl.store(dst, (num / denom[:, None]).to(dst.dtype.element_ty), mask=valid[:, None])


# One variant whatever the batch and table widths: these ints change from step to step (each new
# one a compile on an empty Triton cache, on the step that met it), and the tables are copied in
# rounds of a fixed STAGE_BLOCK_W.
@triton.jit(do_not_specialize=["n_slots", "pad_slot", "n_ids"])
def _stage_kernel(packed_ptr, slot_src_ptr, slot_src_stride, n_slots, pad_slot, slots_ptr,
                  slots_stride, tables_ptr, tables_stride_g, tables_stride_r, ranges_ptr,
                  ranges_stride_g, ids_src_ptr, pos_src_ptr, ids_dst_ptr, pos_dst_ptr, n_ids,
                  G: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program (row r, group g < G): row r's key range, block table and slot of group g into
    the fixed buffers (rows from n_slots on: the padding slot); program (r, G): token id and
    position r (r < n_ids) into the graph's inputs. `packed`: per group (width, offset of its
    tables), then every group's [rows, 2] ranges, then each group's [rows, width] tables."""
    r = tl.program_id(0)
    g = tl.program_id(1)
    if g == G:
        if r < n_ids:
            tl.store(ids_dst_ptr + r, tl.load(ids_src_ptr + r))
            tl.store(pos_dst_ptr + r, tl.load(pos_src_ptr + r))
    else:
        rows = tl.num_programs(0)
        width = tl.load(packed_ptr + 2 * g)
        at = tl.load(packed_ptr + 2 * g + 1) + r * width
        two = tl.arange(0, 2)
        rng = tl.load(packed_ptr + 2 * G + (g * rows + r) * 2 + two)
        tl.store(ranges_ptr + g * ranges_stride_g + 2 * r + two, rng)
        dst = tables_ptr + g * tables_stride_g + r.to(tl.int64) * tables_stride_r
        for c in range(0, width, BLOCK_W):
            cols = c + tl.arange(0, BLOCK_W)
            ok = cols < width
            tl.store(dst + cols, tl.load(packed_ptr + at + cols, mask=ok), mask=ok)
        src = slot_src_ptr + g * slot_src_stride + r
        slot = tl.load(src, mask=r < n_slots, other=0)
        tl.store(slots_ptr + g * slots_stride + r, tl.where(r < n_slots, slot, pad_slot))


def stage_decode_plan(ranges: list[list[tuple[int, int]]], tables: list[list[list[int]]],
                      slot_src: torch.Tensor, slot_src_stride: int, n_slots: int, pad_slot: int,
                      slots: torch.Tensor, tables_out: torch.Tensor, ranges_out: torch.Tensor,
                      inputs: tuple[torch.Tensor, ...] | None = None) -> None:
    """A decode step's plan for every cache group in one host-to-device copy and one launch:
    group g's key ranges [rows] and block tables [rows][*] (rows include any padding) into
    ranges_out [G, >= rows, 2] and tables_out [G, >= rows, max_blocks] (int32), its slots (slot
    g's n_slots real ones at slot_src + g * slot_src_stride, then pad_slot) into slots [G, *];
    `inputs` (token ids, positions, and the two buffers they go to) copied in the same launch.
    The per-group copies it replaces were ~10 small launches and copies a step."""
    g_count, rows = len(tables), len(tables[0])
    if rows == 0:
        return
    widths = [max(len(t) for t in group) for group in tables]
    header, body, offset = [], [], 2 * g_count + 2 * g_count * rows
    for group, width in zip(tables, widths):
        header += [width, offset]
        body += [b for t in group for b in t + [0] * (width - len(t))]
        offset += rows * width
    flat = header + [v for group in ranges for pair in group for v in pair] + body
    packed = torch.tensor(flat, dtype=torch.int32)
    if slots.is_cuda:  # pinned: the copy never waits for the stream
        packed = packed.pin_memory()
    packed = packed.to(slots.device, non_blocking=True)
    ids_src, pos_src, ids_dst, pos_dst = inputs if inputs is not None else (slots,) * 4
    _stage_kernel[(rows, g_count + 1)](
        packed, slot_src, slot_src_stride, n_slots, pad_slot, slots, slots.stride(0), tables_out,
        tables_out.stride(0), tables_out.stride(1), ranges_out, ranges_out.stride(0), ids_src,
        pos_src, ids_dst, pos_dst, 0 if inputs is None else ids_src.shape[0], G=g_count,
        BLOCK_W=STAGE_BLOCK_W)


class DecodeAttention:
    """Workspace for `max_batch` sequences of up to `max_len` keys; call once per layer."""

    def __init__(self, max_batch: int, max_len: int, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, device: torch.device) -> None:
        self.hk, self.group, self.d = num_kv_heads, num_qo_heads // num_kv_heads, head_dim
        self.group_pad = max(16, triton.next_power_of_2(self.group))  # tl.dot needs M >= 16
        self.max_splits = min(MAX_SPLITS, triton.cdiv(max_len, MIN_SPLIT))
        shape = (max_batch, num_kv_heads, self.max_splits, self.group_pad)
        self.m = torch.empty(shape, dtype=torch.float32, device=device)
        self.l_sum = torch.empty(shape, dtype=torch.float32, device=device)
        self.acc = torch.empty(*shape, head_dim, dtype=torch.float32, device=device)
        # Zeroed once; every launch leaves them zero (the merging program resets its own), so
        # CUDA graphs replay without a memset.
        self.tickets = torch.zeros(max_batch, num_kv_heads, dtype=torch.int32, device=device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 rope_cache: torch.Tensor, tables: torch.Tensor, ranges: torch.Tensor,
                 sinks: torch.Tensor, scale: float, window: int = 0,
                 stored: bool = False) -> torch.Tensor:
        """q [B, Hq, D], k and v [B, Hk, D] (one new token per sequence, not yet rotated; views
        into the q/k/v output are fine), slots [B] (their cache slots; < 0: not stored),
        positions [B], rope_cache [max_len, D] (cos | sin), tables [B, max_blocks] int32,
        ranges [B, 2] int32 (first and end key index within the table's tokens, the new key
        last; at most `window` keys when nonzero) -> out [B, Hq * D]. `stored`: q is rotated
        and k, v are in the cache (rows of one sequence in one launch)."""
        b = q.shape[0]
        page = k_cache.shape[1]
        assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and k.stride(0) == v.stride(0)
        assert q.stride(1) == k.stride(1) == v.stride(1) == self.d
        common = dict(HK=self.hk, GROUP=self.group, GROUP_PAD=self.group_pad, D=self.d)
        out = torch.empty(b, self.hk * self.group * self.d, dtype=q.dtype, device=q.device)
        final = 0 < window <= MIN_SPLIT
        splits = 1 if final else min(self.max_splits, max(1, TARGET_PROGRAMS // (b * self.hk)))
        _partial_kernel[(b, self.hk, splits)](
            q, k, v, k_cache, v_cache, slots, positions, rope_cache, tables, ranges, self.m,
            self.l_sum, self.acc, self.tickets, sinks, out, scale, self.max_splits, splits,
            tables.stride(0), q.stride(0), k.stride(0), PAGE=page, MIN_SPLIT=MIN_SPLIT,
            BLOCK_KV=BLOCK_KV, MERGE_CHUNK=MERGE_CHUNK, FINAL=final, STORED=stored, **common)
        return out
