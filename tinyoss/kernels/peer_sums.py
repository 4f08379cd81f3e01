"""The tensor-parallel all-reduce folded into the kernels on either side of it.

At a decode step's sizes an all-reduce is a launch of its own that mostly waits (two a layer).
Here the kernel that makes a rank's partial sums (the o_proj GEMV, the experts' combine) writes
them straight into a slot of every rank's memory over NVLink, and the kernel that needs the sum
(the norm + router, the combine's norm) waits for each rank's slot in its own memory and adds
them in rank order, so every rank gets the same bits. A slot reads -0.0 (bits 0x8000) until
written: writers store -0.0 as +0.0, and the reader resets what it read to -0.0 (TensorRT-LLM's
Lamport one-shot all-reduce marks data the same way). Two sites, one after attention and one
after the experts, alternate, so a rank can be at most one site ahead of another and never
writes a slot its owner has not yet read; any other collective between them only adds order.
The buffers are made and wired by `engine/comm.py` (`Group.peer_sites`); on one device several
sets of slots stand in for ranks in the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyoss.kernels.peer_sites import EMPTY_BITS, PeerSite

_EMPTY = tl.constexpr(EMPTY_BITS)


@triton.jit
def peer_push(push_ptr, t, cols, ok, part, H, RANKS: tl.constexpr):
    """Row t of this rank's partial sums (`part`, 16-bit floats at `cols`) into its slot of every
    rank, -0.0 stored as +0.0 (-0.0 marks an empty slot)."""
    bits = part.to(tl.int16, bitcast=True)
    part = tl.where(bits == _EMPTY, tl.zeros_like(bits), bits).to(part.dtype, bitcast=True)
    for q in tl.static_range(RANKS):
        dst = tl.load(push_ptr + q).to(tl.pointer_type(part.dtype))
        tl.store(dst + t * H + cols, part, mask=ok)


@triton.jit
def peer_sum(slots_ptr, stride, t, cols, ok, H, RANKS: tl.constexpr, BLOCK: tl.constexpr):
    """Row t summed over the ranks' slots in rank order (fp32), each slot waited for until its
    rank has written it (volatile loads: peers write this memory over NVLink)."""
    tot = tl.zeros((BLOCK,), tl.float32)
    for r in tl.static_range(RANKS):
        p = slots_ptr + r * stride + t * H + cols
        v = tl.load(p, mask=ok, other=0.0, volatile=True)
        while tl.max(tl.where(ok & (v.to(tl.int16, bitcast=True) == _EMPTY), 1, 0),
                     axis=0) > 0:
            v = tl.load(p, mask=ok, other=0.0, volatile=True)
        tot += v.to(tl.float32)
    return tot


@triton.jit
def peer_reset(slots_ptr, stride, t, cols, ok, H, RANKS: tl.constexpr, BLOCK: tl.constexpr):
    """Row t of every rank's slot marked empty again, once every reader of it has read."""
    empty = tl.full((BLOCK,), _EMPTY, tl.int16).to(slots_ptr.dtype.element_ty, bitcast=True)
    for r in tl.static_range(RANKS):
        tl.store(slots_ptr + r * stride + t * H + cols, empty, mask=ok)


def empty_slots(ranks: int, max_tokens: int, hidden: int, dtype: torch.dtype,
                device: torch.device | str) -> torch.Tensor:
    """Slots [ranks, max_tokens, hidden] all marked empty (for tests; the engine's live in
    symmetric memory, `engine/comm.py`)."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"peer sums hold bf16 or fp16 values, not {dtype}")
    slots = torch.empty(ranks, max_tokens, hidden, dtype=dtype, device=device)
    slots.view(torch.int16).fill_(EMPTY_BITS)
    return slots


def local_sites(ranks: int, max_tokens: int, hidden: int, dtype: torch.dtype,
                device: torch.device | str) -> list[PeerSite]:
    """One site for each of `ranks` stand-in ranks on one device, wired as the engine wires
    real ranks: rank q's push table points at block [q] of every stand-in's slots."""
    slots = [empty_slots(ranks, max_tokens, hidden, dtype, device) for _ in range(ranks)]
    return [PeerSite(s, torch.tensor([o[q].data_ptr() for o in slots], dtype=torch.int64,
                                     device=device))
            for q, s in enumerate(slots)]


def sum_ranks(parts: list[torch.Tensor]) -> torch.Tensor:
    """What the kernels compute from the ranks' parts [T, H]: the fp32 sum in rank order."""
    tot = torch.zeros_like(parts[0], dtype=torch.float32)
    for p in parts:
        tot += p.float()
    return tot

