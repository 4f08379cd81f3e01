"""What the tensor-parallel all-reduce folded into kernels passes between them (the kernels and
how it works: `peer_sums.py`; the buffers: `engine/comm.py`). Kept free of Triton, which
`Kernels` must not need."""

from __future__ import annotations

from dataclasses import dataclass

import torch

EMPTY_BITS = -32768  # int16 view of -0.0 in bf16 or fp16: a slot not written yet


@dataclass(frozen=True)
class PeerSite:
    """One site's slots: `slots` [ranks, max_tokens, H] in this rank's memory, rank r writing
    [r]; `push` int64 [ranks], the address of this rank's block [me] in each rank's slots."""

    slots: torch.Tensor
    push: torch.Tensor

    @property
    def ranks(self) -> int:
        return self.slots.shape[0]

    def fits(self, tokens: int) -> bool:
        return 0 < tokens <= self.slots.shape[1]


@dataclass(frozen=True)
class PartialSums:
    """An activation [tokens, H] not yet summed over the ranks: each rank's part is in (or on
    its way to) its slot of `site`; the kernel that reads it sums them."""

    site: PeerSite
    tokens: int
