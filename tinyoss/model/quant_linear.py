"""Dense layers quantized at load time (`mxfp4_layers`, `fp8_layers`): fewer bytes per token.

gpt-oss ships its experts in MXFP4 and everything else in bf16. At batch 1 a decode step reads
every dense weight once, so q/k/v, o and lm_head in MXFP4 (4.25 bits a weight instead of 16)
nearly halve what gpt-oss-20b reads per token; in FP8 (e4m3 and one fp32 scale a row, 8 bits)
they read half of bf16's bytes for a small fraction of MXFP4's error. The quantization is
online and lossy (round to nearest: `mxfp4.quantize`, blocks of 32 along the input dimension;
`quantize_fp8`, each row over its largest magnitude); biases stay as loaded.
`bench/mxfp4_quality.py` measures what each costs in logits.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from tinyoss.kernels import Kernels
from tinyoss.model import mxfp4
from tinyoss.model.gpt_oss import GptOssForCausalLM

log = logging.getLogger("tinyoss")

_QUANTIZE_CHUNK = 1 << 22  # weights quantized at a time: bounds the temporaries (~200 MB)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`mxfp4.quantize` of w [N, K] on its device, a few thousand rows at a time: (blocks
    [N, K/32, 16], scales [N, K/32]) without the ~20x temporaries of one call on lm_head."""
    n, k = w.shape
    if k % mxfp4.BLOCK:
        raise ValueError(f"MXFP4 needs in_features to be a multiple of 32, got {k}")
    blocks = torch.empty(n, k // mxfp4.BLOCK, 16, dtype=torch.uint8, device=w.device)
    scales = torch.empty(n, k // mxfp4.BLOCK, dtype=torch.uint8, device=w.device)
    step = max(1, _QUANTIZE_CHUNK // k)
    for r in range(0, n, step):
        blocks[r : r + step], scales[r : r + step] = mxfp4.quantize(w[r : r + step])
    return blocks, scales


FP8_MAX = 448.0  # float8 e4m3fn's largest finite magnitude


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8 e4m3fn [N, K], fp32 scale [N]) on its device: each row divided by its
    largest magnitude / 448 and rounded to nearest (an all-zero row gets scale 1), a few
    thousand rows at a time."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    step = max(1, _QUANTIZE_CHUNK // k)
    for r in range(0, n, step):
        rows = w[r : r + step].float()
        s = rows.abs().amax(dim=1) / FP8_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[r : r + step] = (rows / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        scale[r : r + step] = s
    return q, scale


class MXFP4Linear(nn.Module):
    """A bias-optional linear layer whose weight [N, K] is held packed: blocks [N, K/32, 16] and
    scales [N, K/32] (uint8, the checkpoint's expert layout). The kernel comes from `Kernels`."""

    def __init__(
        self,
        blocks: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        self.out_features, groups = scales.shape
        self.in_features = groups * mxfp4.BLOCK
        self.register_buffer("blocks", blocks)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        self.kernels = kernels

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernels: Kernels) -> MXFP4Linear:
        """Quantizes `linear`'s weight on its device (`quantize_weight`)."""
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(*quantize_weight(linear.weight.detach()), bias, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.mxfp4_linear(
            x.reshape(-1, self.in_features), self.blocks, self.scales, self.bias
        )
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mxfp4"


class FP8Linear(nn.Module):
    """A bias-optional linear layer whose weight [N, K] is held as float8 e4m3 with one fp32
    scale a row (`quantize_fp8`). The kernel comes from `Kernels`."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self.kernels = kernels

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernels: Kernels) -> FP8Linear:
        """Quantizes `linear`'s weight on its device (`quantize_fp8`)."""
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(*quantize_fp8(linear.weight.detach()), bias, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.fp8_linear(
            x.reshape(-1, self.in_features), self.weight, self.scale, self.bias
        )
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8"


FORMATS = {"mxfp4": MXFP4Linear, "fp8": FP8Linear}


def _targets(model: GptOssForCausalLM, layers: tuple[str, ...],
             fmt: str) -> list[tuple[str, nn.Module]]:
    """(attribute path, parent module) of every nn.Linear the chosen layers name."""
    found = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for name, attr in (("qkv", "qkv_proj"), ("o", "o_proj")):
            if name in layers:
                found.append((f"model.layers.{i}.self_attn.{attr}", attn))
    if "lm_head" in layers:
        if model.config.tie_word_embeddings:
            raise ValueError(
                f"{fmt}_layers 'lm_head' needs an untied lm_head, but this model ties it to the "
                "input embeddings (tie_word_embeddings), which must stay bf16 for the lookup"
            )
        found.append(("lm_head", model))
    return found


def quantize_layers(model: GptOssForCausalLM, layers: tuple[str, ...],
                    fmt: str = "mxfp4") -> int:
    """Swaps the chosen dense layers (names from `parse_mxfp4_layers` or `parse_fp8_layers`)
    for `MXFP4Linear` or `FP8Linear` (`fmt`), one at a time, freeing each bf16 weight; logs what
    changed and returns the bytes saved."""
    if not layers:
        return 0
    t0 = time.perf_counter()
    before = after = 0
    for path, parent in _targets(model, layers, fmt):
        attr = path.rsplit(".", 1)[-1]
        linear = getattr(parent, attr)
        quantized = FORMATS[fmt].from_linear(linear, model.kernels)
        setattr(parent, attr, quantized)
        before += linear.weight.numel() * linear.weight.element_size()
        after += sum(b.numel() * b.element_size() for name, b in quantized.named_buffers()
                     if name != "bias")
        del linear
    torch.cuda.empty_cache()  # hand the freed weights back, so the KV cache sizing sees them
    log.info(
        "quantized %s to %s in %.1f s: weights %.3f GB -> %.3f GB (%.3f GB saved; the "
        "experts are MXFP4 as shipped)",
        ", ".join(layers),
        fmt.upper(),
        time.perf_counter() - t0,
        before / 1e9,
        after / 1e9,
        (before - after) / 1e9,
    )
    return before - after
