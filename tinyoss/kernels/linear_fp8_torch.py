"""Reference linear layer on FP8 weights (e4m3, one fp32 scale a row): dequantize, then
`F.linear` in float32.

The oracle the Triton GEMV is tested against, and the CPU path. The weight is dequantized on
every call, so only the FP8 bytes stay in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fp8_linear_torch(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] float8 * scale [N, 1]).T + bias -> [M, N] in x.dtype, in
    float32 arithmetic as the kernel accumulates."""
    w = weight.float() * scale[:, None]
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)
