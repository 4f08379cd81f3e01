"""MXFP4 mixture of experts on FlashInfer's CUTLASS fused MoE: a drop-in for `moe_torch`, reading
experts that `prepare_cutlass` re-laid out once, at load.

FlashInfer has one build per GPU generation (`hardware.cutlass_moe_variant`):

* "w4a16", Hopper SM90: bf16 activations x MXFP4 weights (`use_w4_group_scaling`). Its mixed-input
  GEMM needs K a multiple of 128, so hidden and intermediate sizes are zero-padded to multiples
  of 128 (gpt-oss: 2880 -> 2944), the activations padded to match and the output cropped.
  Weights go through `interleave_moe_weights_for_sm90_mixed_gemm` and scales through
  `interleave_moe_scales_for_sm90_mixed_gemm`; without them the output is garbage. FlashInfer's
  module is built reduced to this one case (`moe_cutlass_sm90_build`: 20 sources, not 248).
* "mxfp8", Blackwell-class (SM10x, SM11x, SM12x): activations quantized to MXFP8 on every call
  (`mxfp8_quantize`, swizzled scales) x MXFP4 weights whose scales go through
  `block_scale_interleave`; same padding.

Both read gate/up as two halves, [up; gate] (FlashInfer's SwiGLU takes the second half as the
gate), where the checkpoint interleaves rows (gate 2j, up 2j+1). gpt-oss's activation is
FlashInfer's SwiGLU with alpha 1.702, beta 1 (the "+1" on up) and limit 7, as float32 [E].

What is verified where: `relayout` (pure tensor work: de-interleave, padding) is tested on CPU
against `dequantize`. `flashinfer_layout` calls FlashInfer's CUDA re-layout kernels and is
GPU-verified only, through tests/test_moe_cutlass_gpu.py, which compares `moe_cutlass` with
`moe_torch`; that test is meant for an H100 (the "w4a16" path). The "mxfp8" path cannot run on any
machine this project has: it follows FlashInfer's own `prepare_cutlass_mxfp8_mxfp4_weights` and
`CutlassMxfp8Mxfp4Runner`, and is UNVERIFIED on hardware.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tinyoss.kernels import moe_cutlass_sm90_build
from tinyoss.kernels.moe_torch import ExpertWeights
from tinyoss.model.mxfp4 import BLOCK, SCALE_BIAS

ALIGN = 128  # both GEMMs' K (hidden, intermediate) must be a multiple of this


@dataclass
class Relayout:
    """One layer's experts in FlashInfer's row order, zero-padded, still in checkpoint MXFP4 form
    (blocks [..., K/32, 16], scales [..., K/32]). Ip, Hp: sizes rounded up to `ALIGN`."""

    fc1_blocks: torch.Tensor  # [E, 2Ip, Hp/32, 16] uint8: rows [up (Ip); gate (Ip)]
    fc1_scales: torch.Tensor  # [E, 2Ip, Hp/32] uint8
    fc1_bias: torch.Tensor  # [E, 2Ip]
    fc2_blocks: torch.Tensor  # [E, Hp, Ip/32, 16] uint8
    fc2_scales: torch.Tensor  # [E, Hp, Ip/32] uint8
    fc2_bias: torch.Tensor  # [E, Hp]


@dataclass
class CutlassExperts:
    """One layer's experts as `cutlass_fused_moe` reads them (see `prepare_cutlass`)."""

    variant: str  # "w4a16" or "mxfp8"
    fc1_weights: torch.Tensor
    fc2_weights: torch.Tensor
    quant_scales: list[torch.Tensor]
    fc1_bias: torch.Tensor  # [E, 2Ip] bf16
    fc2_bias: torch.Tensor  # [E, Hp] bf16
    alpha: torch.Tensor  # [E] float32
    beta: torch.Tensor  # [E] float32
    limit: torch.Tensor  # [E] float32
    hidden_size: int  # H before padding: the output columns kept
    max_num_tokens: int  # the autotuner profiles token counts up to this


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad(t: torch.Tensor, shape: tuple[int, ...], fill: int) -> torch.Tensor:
    """`t` in the leading corner of a new tensor of `shape` filled with `fill`."""
    out = t.new_full(shape, fill)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def relayout(w: ExpertWeights, align: int = ALIGN) -> Relayout:
    """Checkpoint layout -> [up; gate] halves, hidden and intermediate padded to `align`.

    Padding holds zero codes (so zero weights) under scale 1.0 (byte 127: no subnormal or NaN
    scale reaches a kernel) and zero biases: padded gate columns give SwiGLU(0, 0) = 0, which
    meets zero down-projection columns, and padded output columns come out 0 and are cropped.
    """
    e, two_i, groups_h, half = w.gate_up_blocks.shape
    i, h = two_i // 2, groups_h * BLOCK
    ip, hp = _round_up(i, align), _round_up(h, align)
    one = SCALE_BIAS

    def halves(t: torch.Tensor, tail: tuple[int, ...], fill: int) -> torch.Tensor:
        up = _pad(t[:, 1::2], (e, ip, *tail), fill)
        gate = _pad(t[:, 0::2], (e, ip, *tail), fill)
        return torch.cat((up, gate), dim=1)

    return Relayout(
        fc1_blocks=halves(w.gate_up_blocks, (hp // BLOCK, half), 0),
        fc1_scales=halves(w.gate_up_scales, (hp // BLOCK,), one),
        fc1_bias=halves(w.gate_up_bias, (), 0),
        fc2_blocks=_pad(w.down_blocks, (e, hp, ip // BLOCK, half), 0),
        fc2_scales=_pad(w.down_scales, (e, hp, ip // BLOCK), one),
        fc2_bias=_pad(w.down_bias, (e, hp), 0),
    )


def flashinfer_layout(
    r: Relayout, variant: str
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(fc1 weights, fc2 weights, quant_scales) in the byte layouts FlashInfer's kernels read.

    GPU-verified only: FlashInfer's re-layout kernels need CUDA; CPU tests stub this function.
    """
    w1, w2 = r.fc1_blocks.flatten(2), r.fc2_blocks.flatten(2)  # [E, rows, K/2] packed bytes
    if variant == "w4a16":
        moe_cutlass_sm90_build.install()
        from flashinfer.fused_moe import (
            interleave_moe_scales_for_sm90_mixed_gemm,
            interleave_moe_weights_for_sm90_mixed_gemm,
        )

        scales = [
            interleave_moe_scales_for_sm90_mixed_gemm(s, group_size=BLOCK).view(torch.int32)
            for s in (r.fc1_scales, r.fc2_scales)
        ]
        return (
            interleave_moe_weights_for_sm90_mixed_gemm(w1.contiguous(), "fp4"),
            interleave_moe_weights_for_sm90_mixed_gemm(w2.contiguous(), "fp4"),
            scales,
        )
    if variant == "mxfp8":
        from flashinfer import block_scale_interleave

        ones = torch.ones(w1.shape[0], dtype=torch.float32, device=w1.device)  # input scales
        s1, s2 = (block_scale_interleave(s.contiguous()).view(torch.int32)
                  for s in (r.fc1_scales, r.fc2_scales))
        return w1.contiguous().view(torch.int64), w2.contiguous().view(torch.int64), [
            s1, ones, s2, ones]
    raise ValueError(f"unknown CUTLASS MoE variant {variant!r}: 'w4a16' or 'mxfp8'")


LayoutFn = Callable[[Relayout, str], tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]


def prepare_cutlass(
    w: ExpertWeights, *, variant: str, max_num_tokens: int, layout: LayoutFn = flashinfer_layout
) -> CutlassExperts:
    """Once per layer, after loading: the checkpoint's experts -> `CutlassExperts`."""
    r = relayout(w)
    fc1, fc2, quant_scales = layout(r, variant)
    e, device = r.fc1_bias.shape[0], r.fc1_bias.device

    def per_expert(value: float) -> torch.Tensor:
        return torch.full((e,), value, dtype=torch.float32, device=device)

    return CutlassExperts(
        variant, fc1, fc2, quant_scales, r.fc1_bias.to(torch.bfloat16),
        r.fc2_bias.to(torch.bfloat16), per_expert(w.alpha), per_expert(1.0), per_expert(w.limit),
        w.down_blocks.shape[1], max_num_tokens,
    )


def moe_cutlass(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w: CutlassExperts
) -> torch.Tensor:
    """x [T, H] bf16, topk_weights [T, K] float32, topk_ids [T, K] -> [T, H] bf16 (as moe_torch)."""
    from flashinfer.fused_moe import cutlass_fused_moe

    t, h = x.shape
    hp = w.fc2_bias.shape[1]
    x = F.pad(x, (0, hp - h)) if hp != h else x.contiguous()
    if w.variant == "w4a16":
        moe_cutlass_sm90_build.install()
        act, extra = x, {"use_w4_group_scaling": True}
    else:
        from flashinfer import mxfp8_quantize

        act, sf = mxfp8_quantize(x, is_sf_swizzled_layout=True, alignment=BLOCK)
        extra = {"use_mxfp8_act_scaling": True, "input_sf": sf}
    out = torch.empty(t, hp, dtype=torch.bfloat16, device=x.device)
    cutlass_fused_moe(
        input=act,
        token_selected_experts=topk_ids.to(torch.int32).contiguous(),
        token_final_scales=topk_weights.float().contiguous(),
        fc1_expert_weights=w.fc1_weights,
        fc2_expert_weights=w.fc2_weights,
        output_dtype=torch.bfloat16,
        quant_scales=w.quant_scales,
        fc1_expert_biases=w.fc1_bias,
        fc2_expert_biases=w.fc2_bias,
        swiglu_alpha=w.alpha,
        swiglu_beta=w.beta,
        swiglu_limit=w.limit,
        output=out,
        tune_max_num_tokens=w.max_num_tokens,
        **extra,
    )
    return out[:, :h].contiguous() if hp != h else out


def autotuning() -> AbstractContextManager:
    """FlashInfer's autotuner, switched on: a call inside it profiles the CUTLASS tactics for
    every token bucket up to `max_num_tokens` and keeps the fastest for the process."""
    from flashinfer.autotuner import autotune

    return autotune(True)
