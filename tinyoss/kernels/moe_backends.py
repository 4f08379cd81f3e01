"""Which kernel runs the MXFP4 experts (`--mxfp4-backend`): the one asked for, checked, or the
best one for the GPU at hand.

* torch: the reference (any device; slow on a GPU).
* triton: tinyoss's Triton kernels on the checkpoint layout (any CUDA GPU; the decode GEMV is
  their Gluon twin, `moe_gemv_gluon`, run so far on Hopper only).
* cutlass: FlashInfer's CUTLASS fused MoE (Hopper: bf16 x MXFP4; Blackwell-class: MXFP8 x MXFP4).

auto: no GPU -> torch; Hopper -> triton; Blackwell-class -> cutlass where it runs, else triton
(FlashInfer missing: a warning says so); any other GPU -> triton. A backend that was asked for
and cannot run stops start-up with the GPU and what would run instead: no silent fallback.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from tinyoss.config import MXFP4_BACKENDS
from tinyoss.kernels import Kernels
from tinyoss.kernels.hardware import (
    CUTLASS_MXFP8_MXFP4_MOE,
    CUTLASS_W4A16_MOE,
    Capability,
    capability,
    cutlass_moe_variant,
    family,
    is_blackwell_class,
    sm_name,
)
from tinyoss.settings import resolve

log = logging.getLogger("tinyoss")

ENV = "TINYOSS_MXFP4_BACKEND"
INSTALL_FLASHINFER = "the flashinfer package is not installed (pip install 'tinyoss[cuda]')"


@dataclass(frozen=True)
class Platform:
    """What the choice depends on, gathered once; tests build one by hand."""

    device_type: str  # "cuda" or "cpu"
    gpu_name: str = ""
    capability: Capability | None = None
    flashinfer: bool = False  # flashinfer.fused_moe imports
    dtype: torch.dtype = torch.bfloat16  # the engine's activations

    @classmethod
    def detect(cls, device: torch.device, dtype: torch.dtype) -> Platform:
        if device.type != "cuda":
            return cls(device.type, dtype=dtype)
        return cls("cuda", torch.cuda.get_device_name(device), capability(device),
                   _has_flashinfer_moe(), dtype)

    def describe(self) -> str:
        if self.capability is None:
            return f"no GPU ({self.device_type})"
        return f"{self.gpu_name} ({sm_name(self.capability)})"


@dataclass(frozen=True)
class MoEChoice:
    backend: str
    reason: str  # for the log: "auto: Hopper sm_90 -> triton", "env TINYOSS_MXFP4_BACKEND=..."
    degraded: bool = False  # auto settled for less than this GPU could run (log a warning)


def _has_flashinfer_moe() -> bool:
    try:
        import flashinfer.fused_moe  # noqa: F401
    except ImportError:
        return False
    return True


def _sms(caps: frozenset[Capability]) -> str:
    return ", ".join(sm_name(c) for c in sorted(caps))


def unavailable(backend: str, p: Platform) -> str | None:
    """Why `backend` cannot run on `p`, or None when it can."""
    if backend == "torch":
        return None
    if p.device_type != "cuda":
        return "it needs a CUDA GPU"
    if backend == "triton":
        return None
    if backend == "cutlass" and cutlass_moe_variant(p.capability) is None:
        return (
            f"FlashInfer's CUTLASS MXFP4 MoE has kernels for {_sms(CUTLASS_W4A16_MOE)} "
            f"(bf16 activations) and {_sms(CUTLASS_MXFP8_MXFP4_MOE)} (MXFP8 activations) only"
        )
    if not p.flashinfer:
        return INSTALL_FLASHINFER
    if p.dtype != torch.bfloat16:
        return f"it needs bfloat16 activations (dtype=bfloat16), not {_dtype_name(p.dtype)}"
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _auto(p: Platform) -> MoEChoice:
    if p.capability is None:
        return MoEChoice("torch", "auto: no GPU -> torch")
    gpu = f"{family(p.capability)} {sm_name(p.capability)}"
    if not is_blackwell_class(p.capability):
        return MoEChoice("triton", f"auto: {gpu} -> triton")
    why = unavailable("cutlass", p)
    if why is None:
        return MoEChoice("cutlass", f"auto: {gpu} -> cutlass")
    return MoEChoice("triton", f"auto: {gpu}, cutlass cannot run ({why}) -> triton", True)


def choose(requested: str | None, p: Platform) -> MoEChoice:
    """The backend for `p`: `requested` (None: env TINYOSS_MXFP4_BACKEND, else auto)."""
    setting = resolve("mxfp4 backend", requested, ENV, MXFP4_BACKENDS)
    if setting.value == "auto":
        choice = _auto(p)
        if setting.source.startswith("env"):
            choice = MoEChoice(choice.backend, f"{setting.source}; {choice.reason}",
                               choice.degraded)
        return choice
    why = unavailable(setting.value, p)
    if why is not None:
        runnable = [b for b in MXFP4_BACKENDS[1:] if unavailable(b, p) is None]
        raise ValueError(
            f"mxfp4 backend {setting.value!r} (from {setting.source}) cannot run on "
            f"{p.describe()}: {why}. Backends that run here: {', '.join(runnable)} "
            f"(auto picks {_auto(p).backend})"
        )
    source = "asked for" if setting.source == "argument" else setting.source
    return MoEChoice(setting.value, f"{source} -> {setting.value}")


def install(kernels: Kernels, backend: str, p: Platform, max_num_tokens: int) -> None:
    """Points `kernels` at `backend`; `max_num_tokens` bounds what its autotuner must cover."""
    if backend == "triton":
        from tinyoss.kernels.moe_triton import moe_norm_triton, moe_pairs_triton, moe_triton

        kernels.moe, kernels.moe_norm = moe_triton, moe_norm_triton
        kernels.moe_pairs = moe_pairs_triton
        if p.device_type == "cuda":
            from tinyoss.kernels.moe_gemv_mma import DOWN_MIN_TOKENS, GROUPED_MAX_TOKENS, load

            mma, why = load(p.capability)
            log.info("MoE GEMV on the tensor cores (down from 1 token a step on one GPU's "
                     "experts and TP 2's share, else from %d; grouped by expert up to %d): %s",
                     DOWN_MIN_TOKENS, GROUPED_MAX_TOKENS,
                     why if mma else f"no, {why}; the Gluon kernel and the grouped GEMMs run")
            if mma is not None:
                kernels.moe = functools.partial(moe_triton, mma=mma)
                kernels.moe_norm = functools.partial(moe_norm_triton, mma=mma)
                kernels.moe_pairs = functools.partial(moe_pairs_triton, mma=mma)
                backend = "triton+mma"
                # the dense layers' decode GEMVs too, where they are on the Triton kernels
                from tinyoss.kernels.linear_mxfp4_triton import mxfp4_linear
                from tinyoss.kernels.linear_triton import fp8_linear, linear_triton

                for name, fn in (("mxfp4_linear", mxfp4_linear), ("fp8_linear", fp8_linear),
                                 ("linear", linear_triton)):
                    if kernels.names[name] == "triton":
                        setattr(kernels, name, functools.partial(fn, mma=mma))
                        kernels.names[name] = "triton+mma"
    elif backend == "cutlass":
        from tinyoss.kernels.moe_cutlass import autotuning, moe_cutlass, prepare_cutlass

        variant = cutlass_moe_variant(p.capability)
        assert variant is not None, "install() runs only for a backend choose() accepted"
        kernels.moe = moe_cutlass
        kernels.prepare_experts = functools.partial(
            prepare_cutlass, variant=variant, max_num_tokens=max_num_tokens
        )
        kernels.moe_warmup = autotuning
    kernels.names["moe"] = backend
