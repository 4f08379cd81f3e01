"""Chooses the kernels and the attention backend for the device at hand, once, and logs why.

CPU: the torch reference everywhere. NVIDIA GPU: fused Triton kernels for the per-layer ops,
the MXFP4 MoE kernel `moe_backends` picks for the GPU, FlashInfer sink attention. Any choice can
be forced (tests, debugging); a forced choice the machine cannot run fails at start-up with the
reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tinyoss.kernels import Kernels
from tinyoss.kernels.moe_backends import Platform, choose, install

log = logging.getLogger("tinyoss")

ATTENTION_BACKENDS = ("auto", "flashinfer", "torch")


@dataclass
class BackendChoice:
    kernels: Kernels
    attention: str  # "flashinfer" or "torch"

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.kernels.names.items()]
        return ", ".join(parts + [f"attention={self.attention}"])


def select_backends(
    device: torch.device,
    attention: str = "auto",
    mxfp4: str | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_num_tokens: int = 8192,
    platform: Platform | None = None,
) -> BackendChoice:
    """`mxfp4` None: env TINYOSS_MXFP4_BACKEND, else auto; `max_num_tokens`: the most tokens one
    forward pass can hold (MoE autotuners must cover it); `platform`: detected when None."""
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {attention!r} is not one of {ATTENTION_BACKENDS}")
    platform = platform or Platform.detect(device, dtype)
    moe = choose(mxfp4, platform)
    (log.warning if moe.degraded else log.info)("MXFP4 MoE backend: %s", moe.reason)
    on_gpu = device.type == "cuda"
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
        from tinyoss.kernels.linear_mxfp4_triton import mxfp4_linear

        kernels.rms_norm, kernels.rope, kernels.router_topk = (
            rms_norm_triton,
            rope_triton,
            router_topk_triton,
        )
        kernels.mxfp4_linear = mxfp4_linear
        kernels.names.update(norm="triton", rope="triton", router="triton", mxfp4_linear="triton")
    install(kernels, moe.backend, platform, max_num_tokens)
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
