"""A layout for the experts in which x needs no column phases (groundwork, session 22).

In an mma.m16n8k16 (and per warp in wgmma's register A operand), lane (g, t) holds, for rows g
and g + 8, the k positions {2t, 2t + 1, 2t + 8, 2t + 9} of each k16 step. The decode kernels
(`moe_gemv_mma.cu`, `block_mma`, until session 34) gave lane t word t of a 32-code scale block,
took codes (0, 4), (1, 5) into one MMA and (2, 6), (3, 7) into the next, and staged x permuted
to match (now (0, 2), (1, 3), then (4, 6), (5, 7): SLOT below is the older order). Permuting
the 32 codes of every block once, at load, so that code j of word t is the code at the natural
k position `SLOT[t][j]` makes the same register decode meet x in its natural order: x could then
go from global to shared memory untouched (a prefill GEMM with the weights as wgmma's left
operand), and the decode kernels could stage x plainly. Rows and scales stay where they are.

`permute_blocks` is that permutation on checkpoint blocks [..., K/32, 16] (uint8, two codes a
byte, low nibble first); `fragment_dot` emulates the kernels' register decode on it against x
in natural order, for the test.
"""

from __future__ import annotations

import torch

# natural k position (within a 32-code block) of code j of word t
SLOT = [[2 * t, 2 * t + 8, 16 + 2 * t, 24 + 2 * t, 2 * t + 1, 2 * t + 9, 17 + 2 * t, 25 + 2 * t]
        for t in range(4)]


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] codes in storage order (low nibble first)."""
    return torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2)


def _bytes(codes: torch.Tensor) -> torch.Tensor:
    pairs = codes.unflatten(-1, (16, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def permute_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Checkpoint blocks -> the same blocks with code 8t + j = the code at natural k SLOT[t][j]."""
    order = torch.tensor([SLOT[t][j] for t in range(4) for j in range(8)])
    return _bytes(_codes(blocks)[..., order])


def fragment_dot(blocks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One row's block-by-block sums (codes as integers, no scales) the way the kernels' MMAs
    form them from permuted blocks [K/32, 16] and x [K] in natural order: for each lane t the
    MMA slots k = 2t, 2t + 1 take codes (0, 4) then (1, 5)... (`pair16<J>`: codes J and J + 4)."""
    codes = _codes(blocks).view(-1, 4, 8)  # [blocks, word t, code j]
    xb = x.view(-1, 32)
    out = torch.zeros(codes.shape[0], dtype=torch.float64)
    for t in range(4):
        for step, pairs in enumerate(((0, 1), (2, 3))):  # MMA 1: pair16<0>, <1>; MMA 2: <2>, <3>
            for slot, j in enumerate(pairs):  # a0/a2: k 2t(+1) then 2t + 8 (+1), step 16 apart
                base = 16 * step + 2 * t + 8 * slot
                out += codes[:, t, j].double() * xb[:, base].double()
                out += codes[:, t, j + 4].double() * xb[:, base + 1].double()
    return out
