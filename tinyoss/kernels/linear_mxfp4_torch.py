"""Reference linear layer on MXFP4 weights: dequantize, then `F.linear` in float32.

The oracle the Triton kernel is tested against, and the CPU path. The weight is dequantized on
every call, so only the packed bytes stay in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyoss.model.mxfp4 import dequantize


def mxfp4_linear_torch(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] @ W.T + bias -> [M, N] in x.dtype; W [N, K] is blocks [N, K/32, 16] and scales
    [N, K/32]. Float32 arithmetic, as the kernel accumulates."""
    w = dequantize(blocks, scales)
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)
