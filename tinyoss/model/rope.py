"""YaRN rotary embedding of gpt-oss, computed as transformers computes it (fp32 tables).

Half-split (NeoX) rotation; the YaRN attention factor multiplies both cos and sin, so q.k logits
grow by its square. The table is [max_len, head_dim] = cat(cos, sin), the layout FlashInfer's
`apply_rope_with_cos_sin_cache` reads, so a GPU kernel can use the same table.
"""

from __future__ import annotations

import math

import torch

from tinyoss.config import RopeConfig


def yarn_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """The per-dimension inverse frequencies and the attention scaling factor."""
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    inv_extrapolation = 1.0 / pos_freqs
    if not rope.yarn:
        return inv_extrapolation, 1.0
    inv_interpolation = 1.0 / (rope.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = (
        inv_interpolation * (1 - extrapolation_factor) + inv_extrapolation * extrapolation_factor
    )
    scaling = 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
    return inv_freq, scaling


def cos_sin_cache(
    rope: RopeConfig, head_dim: int, max_len: int, device: torch.device
) -> torch.Tensor:
    """[max_len, head_dim] float32: cos in the first half, sin in the second, both scaled."""
    inv_freq, scaling = yarn_inv_freq(rope, head_dim)
    positions = torch.arange(max_len, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    return (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * scaling).to(device)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] at `positions` [T]; returns new tensors."""
    cos, sin = cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
