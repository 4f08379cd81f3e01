"""Random weights in the exact checkpoint layout, for synthetic checkpoints and dummy loading.

Small models get float experts quantized through `mxfp4.quantize` (realistic code statistics);
full-size ones get uniform random E2M1 codes with a scale matched to the wanted spread, which is
made in one pass on the target device.
"""

from __future__ import annotations

import math
import zlib
from typing import Iterator

import torch

from tinyoss.config import ModelConfig
from tinyoss.model import mxfp4
from tinyoss.model.layout import TensorSpec, checkpoint_tensors, synthetic_init

_TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "U8": torch.uint8,
}
_QUANTIZE_LIMIT = 1 << 24  # elements: below this, experts are quantized from float weights
_E2M1_RMS = math.sqrt(sum(v * v for v in mxfp4.FP4_VALUES[:8]) / 8)


def torch_dtype(safetensors_dtype: str) -> torch.dtype:
    return _TORCH_DTYPES[safetensors_dtype]


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return g


def random_experts(
    spec: TensorSpec, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) for a `*_blocks` spec [E, out, G, 16]."""
    gen = _generator(seed, spec.name, device)
    _, std = synthetic_init(spec.name, spec.shape)
    e, out, groups, _ = spec.shape
    if math.prod(spec.shape) * 2 <= _QUANTIZE_LIMIT:
        w = torch.randn(e, out, groups * 32, generator=gen, device=device) * std
        return mxfp4.quantize(w)
    blocks = torch.randint(0, 256, spec.shape, generator=gen, device=device, dtype=torch.uint8)
    exponent = round(math.log2(std / _E2M1_RMS)) + mxfp4.SCALE_BIAS
    scales = torch.randint(
        exponent - 1,
        exponent + 2,
        (e, out, groups),
        generator=gen,
        device=device,
        dtype=torch.int32,
    ).to(torch.uint8)
    return blocks, scales


def random_dense(spec: TensorSpec, seed: int, device: torch.device) -> torch.Tensor:
    gen = _generator(seed, spec.name, device)
    mean, std = synthetic_init(spec.name, spec.shape)
    t = torch.randn(spec.shape, generator=gen, device=device) * std + mean
    return t.to(torch_dtype(spec.dtype))


def synthetic_tensors(
    config: ModelConfig, seed: int = 0, device: torch.device | str = "cpu"
) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """Every checkpoint tensor with random contents, in checkpoint order, one at a time."""
    device = torch.device(device)
    pending_scales: dict[str, torch.Tensor] = {}
    for spec in checkpoint_tensors(config):
        if spec.name.endswith("_blocks"):
            blocks, scales = random_experts(spec, seed, device)
            pending_scales[spec.name.removesuffix("_blocks") + "_scales"] = scales
            yield spec, blocks
        elif spec.name in pending_scales:
            yield spec, pending_scales.pop(spec.name)
        else:
            yield spec, random_dense(spec, seed, device)
