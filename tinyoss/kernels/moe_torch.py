"""Reference mixture-of-experts on packed MXFP4 experts: plain torch, float32 arithmetic.

Each selected expert is dequantized on the fly, so the packed weights are all that stays in
memory. This is the oracle the fast kernels are tested against, and the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyoss.model.mxfp4 import dequantize


@dataclass
class ExpertWeights:
    """One layer's experts exactly as the checkpoint stores them ([E, out, in] rows)."""

    gate_up_blocks: torch.Tensor  # [E, 2I, H/32, 16] uint8, rows interleaved: gate 2j, up 2j+1
    gate_up_scales: torch.Tensor  # [E, 2I, H/32] uint8
    gate_up_bias: torch.Tensor  # [E, 2I]
    down_blocks: torch.Tensor  # [E, H, I/32, 16] uint8
    down_scales: torch.Tensor  # [E, H, I/32] uint8
    down_bias: torch.Tensor  # [E, H]
    alpha: float = 1.702
    limit: float = 7.0


def swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU on interleaved [.., 2I] gate/up columns -> [.., I]."""
    gate = gate_up[..., 0::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def expert_forward(x: torch.Tensor, w: ExpertWeights, e: int) -> torch.Tensor:
    """One expert on rows x [N, H] (float32) -> [N, H] float32, both biases included."""
    w1 = dequantize(w.gate_up_blocks[e], w.gate_up_scales[e])  # [2I, H]
    h = x @ w1.T + w.gate_up_bias[e].float()
    w2 = dequantize(w.down_blocks[e], w.down_scales[e])  # [H, I]
    return swiglu(h, w.alpha, w.limit) @ w2.T + w.down_bias[e].float()


def moe_torch(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w: ExpertWeights
) -> torch.Tensor:
    """x [T, H], topk_weights [T, K] float32, topk_ids [T, K] -> sum_k w_k * expert_k(x) [T, H].
    A pair of id -1 (its expert held by another rank, expert parallelism) adds nothing."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in topk_ids.unique().tolist():
        if e < 0:
            continue
        rows, slot = torch.where(topk_ids == e)
        y = expert_forward(xf[rows], w, e)
        out.index_add_(0, rows, y * topk_weights[rows, slot, None].float())
    return out.to(x.dtype)
