"""Chooses the kernels and the attention backend for the device at hand, once, and logs why.

CPU: the torch reference everywhere. NVIDIA GPU: fused Triton kernels for the per-layer ops,
Triton MXFP4 MoE, FlashInfer sink attention. Any choice can be forced (tests, debugging); a
forced choice the machine cannot run fails at start-up with the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tinyoss.kernels import Kernels

log = logging.getLogger("tinyoss")

ATTENTION_BACKENDS = ("auto", "flashinfer", "torch")
MOE_BACKENDS = ("auto", "triton", "torch")


@dataclass
class BackendChoice:
    kernels: Kernels
    attention: str  # "flashinfer" or "torch"

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.kernels.names.items()]
        return ", ".join(parts + [f"attention={self.attention}"])


def select_backends(
    device: torch.device, attention: str = "auto", moe: str = "auto"
) -> BackendChoice:
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {attention!r} is not one of {ATTENTION_BACKENDS}")
    if moe not in MOE_BACKENDS:
        raise ValueError(f"MoE backend {moe!r} is not one of {MOE_BACKENDS}")
    on_gpu = device.type == "cuda"
    if not on_gpu and moe == "triton":
        raise ValueError(f"MoE backend 'triton' needs a CUDA GPU; this engine runs on {device}")
    if not on_gpu and attention == "flashinfer":
        raise ValueError(
            f"attention backend 'flashinfer' needs a CUDA GPU; this engine runs on {device}"
        )
    kernels = Kernels()
    if on_gpu:
        from tinyoss.kernels.layer_ops_triton import (
            rms_norm_triton,
            rope_triton,
            router_topk_triton,
        )

        kernels.rms_norm, kernels.rope, kernels.router_topk = (
            rms_norm_triton,
            rope_triton,
            router_topk_triton,
        )
        kernels.names.update(norm="triton", rope="triton", router="triton")
    if moe == "triton" or (moe == "auto" and on_gpu):
        from tinyoss.kernels.moe_triton import moe_triton

        kernels.moe = moe_triton
        kernels.names["moe"] = "triton"
    if attention == "auto":
        attention = "flashinfer" if on_gpu and _has_flashinfer() else "torch"
        if on_gpu and attention == "torch":
            log.warning(
                "flashinfer is not installed: attention runs on the slow torch path "
                "(pip install 'tinyoss[cuda]')"
            )
    elif attention == "flashinfer" and not _has_flashinfer():
        raise ValueError(
            "attention backend 'flashinfer' was asked for, but the flashinfer "
            "package is not installed (pip install 'tinyoss[cuda]')"
        )
    choice = BackendChoice(kernels, attention)
    log.info("backends on %s: %s", _device_name(device), choice.describe())
    return choice


def _has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
