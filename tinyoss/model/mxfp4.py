"""MXFP4 (OCP microscaling FP4) packing, as stored in gpt-oss checkpoints.

A row of K values is stored as K/32 blocks of 16 bytes (`*_blocks`, uint8 [..., K/32, 16]) and one
UE8M0 scale per block (`*_scales`, uint8 [..., K/32], value 2**(s - 127)). Each byte holds two
E2M1 codes: the LOW nibble is the even element, the HIGH nibble the odd one; bit 3 is the sign.
"""

from __future__ import annotations

import torch

BLOCK = 32
SCALE_BIAS = 127
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[..., G, 16] uint8 blocks and [..., G] uint8 scales -> [..., G * 32] values of `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 shapes do not match: blocks {tuple(blocks.shape)} needs [..., G, 16] and "
            f"scales [..., G], got scales {tuple(scales.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)  # [..., G, 32], low nibble first
    exp = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(lut[codes], exp.unsqueeze(-1))
    return out.flatten(-2).to(dtype)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float values -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]).

    The shared exponent is the smallest power of two with amax / 2**e <= 6, so nothing clips;
    each value then rounds to the nearest E2M1 magnitude, a tie going to the smaller one.
    """
    if x.shape[-1] % BLOCK:
        raise ValueError(
            f"MXFP4 needs the last dimension to be a multiple of {BLOCK}, got {x.shape[-1]}"
        )
    g = x.float().unflatten(-1, (-1, BLOCK))  # [..., G, 32]
    amax = g.abs().amax(dim=-1)
    exp = torch.ceil(torch.log2(amax / 6.0)).nan_to_num(0.0, neginf=0.0, posinf=0.0)
    exp = exp.clamp(-SCALE_BIAS, 127)
    scaled = g / torch.exp2(exp).unsqueeze(-1)
    magnitudes = torch.tensor(FP4_VALUES[:8], dtype=torch.float32, device=x.device)
    # argmin takes the first of equal distances: a tie goes to the smaller magnitude.
    idx = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    codes = idx | ((scaled < 0) & (idx > 0)).to(idx.dtype) << 3
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exp + SCALE_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()
