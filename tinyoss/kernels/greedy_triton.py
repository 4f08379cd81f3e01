"""Each row's argmax and whether the row is finite, in one pass over the logits.

A step's plain greedy sampling needs argmax(logits) and the engine's NaN/Inf check needs to know
whether any logit is not finite: two passes over [B, 201088] float32 in torch (argmax, then a row
sum), and two copies to the host. Here programs (row, split) each take a contiguous chunk of a
row; the last program of a row to finish (a ticket, reset by it) merges the chunks, and writes
the token and the flag into one [2, B] int64 tensor that goes to the host in one copy.

The argmax is torch's: the first index of the largest value; a row of -inf takes 0. NaN counts
as not finite and never as the largest (torch would pick it; such a row fails its request, and
its token must still be a valid id: the next step may already be reading it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # logits a program loads a round
TARGET_PROGRAMS = 256  # (row, split) programs a launch the splits aim at: ~2 an H100 SM


@triton.jit(do_not_specialize=["B"])
def _pick_kernel(x_ptr, out_ptr, part_max_ptr, part_idx_ptr, part_bad_ptr, tickets_ptr, B, V,
                 stride, CHUNK: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                 BLOCK: tl.constexpr):
    b = tl.program_id(0)
    s = tl.program_id(1)
    lane = tl.arange(0, BLOCK)
    start = s * CHUNK
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = start + lane  # a lane that never sees more than -inf keeps its first index
    bad = tl.zeros([BLOCK], tl.int32)
    row = x_ptr + b.to(tl.int64) * stride
    for off in tl.range(start, start + CHUNK, BLOCK):
        idx = off + lane
        inside = idx < V
        v = tl.load(row + idx, mask=inside, other=float("-inf")).to(tl.float32)
        nan = v != v
        bad |= ((nan | (tl.abs(v) == float("inf"))) & inside).to(tl.int32)
        v = tl.where(nan, float("-inf"), v)
        take = v > best  # strict: a lane keeps the first of equal values
        best = tl.where(take, v, best)
        best_i = tl.where(take, idx, best_i)
    m = tl.max(best, 0)
    i = tl.min(tl.where(best == m, best_i, V), 0)
    worst = tl.max(bad, 0)
    if SPLITS == 1:
        tl.store(out_ptr + b, i.to(tl.int64))
        tl.store(out_ptr + B + b, (1 - worst).to(tl.int64))
    else:
        at = b * SPLITS + s
        tl.store(part_max_ptr + at, m)
        tl.store(part_idx_ptr + at, i)
        tl.store(part_bad_ptr + at, worst)
        tl.debug_barrier()  # the partials are stored before the ticket releases them
        ticket = tickets_ptr + b
        if tl.atomic_add(ticket, 1, sem="acq_rel") == SPLITS - 1:
            j = tl.arange(0, SPLITS_PAD)
            ok = j < SPLITS
            # read past L1: other programs wrote them
            pm = tl.load(part_max_ptr + b * SPLITS + j, mask=ok, other=float("-inf"),
                         cache_modifier=".cg")
            pi = tl.load(part_idx_ptr + b * SPLITS + j, mask=ok, other=V, cache_modifier=".cg")
            pb = tl.load(part_bad_ptr + b * SPLITS + j, mask=ok, other=0, cache_modifier=".cg")
            top = tl.max(pm, 0)
            tl.store(out_ptr + b, tl.min(tl.where(pm == top, pi, V), 0).to(tl.int64))
            tl.store(out_ptr + B + b, (1 - tl.max(pb, 0)).to(tl.int64))
            tl.atomic_xchg(ticket, 0)


_tickets: dict[torch.device, torch.Tensor] = {}


def _tickets_for(device: torch.device, rows: int) -> torch.Tensor:
    """A zeroed ticket a row, kept across calls (each merging program resets its own)."""
    t = _tickets.get(device)
    if t is None or t.numel() < rows:
        t = _tickets[device] = torch.zeros(max(rows, 64), dtype=torch.int32, device=device)
    return t


def splits_for(rows: int, vocab: int) -> tuple[int, int]:
    """(chunk, splits): whole BLOCKs a program, TARGET_PROGRAMS to twice that programs a
    launch. The rows count as the power of two at or below them: chunk and splits are
    constexprs (a runtime loop bound was 2-4x slower) and each value a compile on the step that
    first meets it, so a value of its own for each batch size would compile dozens of variants
    while serving; rounded down (not up), a row keeps at least as many programs."""
    bucket = 1 << (max(rows, 1).bit_length() - 1)
    want = max(1, min(TARGET_PROGRAMS // bucket, triton.cdiv(vocab, BLOCK)))
    chunk = triton.cdiv(triton.cdiv(vocab, want), BLOCK) * BLOCK
    return chunk, triton.cdiv(vocab, chunk)


def greedy_pick_triton(logits: torch.Tensor) -> torch.Tensor:
    """[2, B] int64: row 0 each row's argmax, row 1 whether the row is finite (1) or holds a NaN
    or an infinity (0). logits: [B, V], any float dtype, rows contiguous."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"greedy_pick takes [rows, vocab] logits with contiguous rows, not "
                         f"shape {tuple(logits.shape)} strides {logits.stride()}")
    b, v = logits.shape
    out = torch.empty(2, b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    chunk, splits = splits_for(b, v)
    parts = [torch.empty(b * splits, dtype=dt, device=logits.device)
             for dt in (torch.float32, torch.int32, torch.int32)] if splits > 1 else [out] * 3
    tickets = _tickets_for(logits.device, b) if splits > 1 else out
    _pick_kernel[(b, splits)](logits, out, *parts, tickets, b, v, logits.stride(0), CHUNK=chunk,
                              SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
                              BLOCK=BLOCK, num_warps=4)
    return out
