"""Chooses the kernels and the attention backend for the device at hand, once, and logs why.

CPU: the torch reference everywhere. NVIDIA GPU: fused Triton kernels for the per-layer ops,
the MXFP4 MoE kernel `moe_backends` picks for the GPU, FlashInfer sink attention, and the bf16
dense layers (q/k/v, o, router, lm_head) at one token on the Triton decode GEMV (`linear_triton`,
cuBLAS above one token), which streams the weights faster than cuBLAS does at one token
(bench/results/2026-11-23_h100_kernels_e5bac60.txt). Env TINYOSS_DENSE_BACKEND (`triton` or
`torch`) forces one. Any choice can be forced (tests, debugging); a forced choice the machine
cannot run fails at start-up with the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tinyoss.config import ATTENTION_BACKENDS
from tinyoss.kernels import Kernels
from tinyoss.kernels.moe_backends import Platform, choose, install
from tinyoss.settings import resolve

log = logging.getLogger("tinyoss")

DENSE_BACKENDS = ("auto", "triton", "torch")
DENSE_ENV = "TINYOSS_DENSE_BACKEND"


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
    platform = platform or Platform.detect(device, dtype)
    moe = choose(mxfp4, platform)
    (log.warning if moe.degraded else log.info)("MXFP4 MoE backend: %s", moe.reason)
    on_gpu = device.type == "cuda"
    attention = choose_attention(device, attention, dtype)  # its errors before any build
    kernels = Kernels()
    if on_gpu:
        from tinyoss.kernels.layer_ops_triton import (
            norm_route_triton,
            rms_norm_triton,
            router_topk_triton,
        )
        from tinyoss.kernels.greedy_triton import greedy_pick_triton
        from tinyoss.kernels.linear_mxfp4_triton import mxfp4_linear
        from tinyoss.kernels.linear_triton import fp8_linear

        kernels.greedy_pick = greedy_pick_triton
        kernels.rms_norm, kernels.router_topk = rms_norm_triton, router_topk_triton
        kernels.mxfp4_linear, kernels.fp8_linear = mxfp4_linear, fp8_linear
        kernels.norm_route = norm_route_triton
        kernels.names.update(norm="triton", router="triton+norm", greedy="triton",
                             mxfp4_linear="triton", fp8_linear="triton")
    _dense(kernels, on_gpu)
    install(kernels, moe.backend, platform, max_num_tokens)
    choice = BackendChoice(kernels, attention)
    log.info("backends on %s: %s", _device_name(device), choice.describe())
    return choice


def choose_attention(device: torch.device, attention: str = "auto",
                     dtype: torch.dtype = torch.bfloat16) -> str:
    """"flashinfer" or "torch" for `attention` ("auto" or either) on this device and dtype;
    ValueError when the one asked for cannot run. Known before any kernel is built, so that
    FlashInfer's JIT builds can start early (`attention_flashinfer.Prebuild`)."""
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {attention!r} is not one of {ATTENTION_BACKENDS}")
    on_gpu = device.type == "cuda"
    if not on_gpu and attention == "flashinfer":
        raise ValueError(
            f"attention backend 'flashinfer' needs a CUDA GPU; this engine runs on {device}"
        )
    if attention == "auto" and on_gpu and dtype != torch.bfloat16:
        log.warning("attention runs on the slow torch path (no CUDA graphs): FlashInfer's sink "
                    "attention takes bfloat16, not %s", str(dtype).removeprefix("torch."))
        attention = "torch"
    elif attention == "auto":
        attention = "flashinfer" if on_gpu and _has_flashinfer() else "torch"
        if on_gpu and attention == "torch":
            log.warning(
                "flashinfer is not installed: attention runs on the slow torch path "
                "(pip install 'tinyoss[cuda]')"
            )
    elif attention == "flashinfer" and dtype != torch.bfloat16:
        raise ValueError(f"attention backend 'flashinfer' takes bfloat16, not "
                         f"{str(dtype).removeprefix('torch.')}: give dtype='bfloat16', or "
                         "attention_backend='torch' (slow)")
    elif attention == "flashinfer" and not _has_flashinfer():
        raise ValueError(
            "attention backend 'flashinfer' was asked for, but the flashinfer "
            "package is not installed (pip install 'tinyoss[cuda]')"
        )
    return attention


def _dense(kernels: Kernels, on_gpu: bool) -> None:
    """The bf16 dense layers: env TINYOSS_DENSE_BACKEND, else the Triton GEMV on a GPU."""
    setting = resolve("dense backend", None, DENSE_ENV, DENSE_BACKENDS)
    backend = setting.value if setting.value != "auto" else ("triton" if on_gpu else "torch")
    if backend == "triton" and not on_gpu:
        raise ValueError(f"dense backend 'triton' (from {setting.source}) needs a CUDA GPU")
    if backend == "triton":
        from tinyoss.kernels.linear_triton import linear_triton

        kernels.linear = linear_triton
    kernels.names["linear"] = backend


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
