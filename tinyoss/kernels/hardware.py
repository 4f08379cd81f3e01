"""What an NVIDIA GPU can run, from its compute capability: the one place that knows families.

Every helper takes an optional `(major, minor)` capability so tests can ask about any GPU; without
one it asks the current CUDA device (and answers False, or None, when there is none).

Families: Hopper is SM90. "Blackwell-class" is every Blackwell-generation part: SM10x (B200 sm_100,
B300 sm_103), SM11x (Thor sm_110) and SM12x (RTX 50 / RTX PRO sm_120, GB10 / DGX Spark sm_121).
All of them have FP4 tensor cores, but they do not share kernels: FlashInfer's CUTLASS MXFP4 MoE
has one build for Hopper (bf16 activations) and one for Blackwell-class (MXFP8 activations).
The tables below are read from FlashInfer 0.7.2 (`fused_moe/api.py`: `_CUTLASS_W4A16_ARCHS`,
`_CUTLASS_MXFP8_MXFP4_ARCHS`).
"""

from __future__ import annotations

import torch

Capability = tuple[int, int]

CUTLASS_W4A16_MOE = frozenset({(9, 0)})  # bf16 activations x MXFP4 weights
CUTLASS_MXFP8_MXFP4_MOE = frozenset({(10, 0), (10, 3), (10, 7), (11, 0), (12, 0), (12, 1)})

_FAMILIES = {7: "Volta/Turing", 8: "Ampere", 9: "Hopper", 10: "Blackwell", 11: "Blackwell",
             12: "Blackwell"}


def capability(device: torch.device | int | None = None) -> Capability | None:
    """The CUDA device's (major, minor), or None without a CUDA GPU."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def _cap(cap: Capability | None) -> Capability | None:
    return cap if cap is not None else capability()


def sm_name(cap: Capability) -> str:
    """(12, 1) -> "sm_121"."""
    return f"sm_{cap[0]}{cap[1]}"


def family(cap: Capability | None = None) -> str:
    """"Hopper", "Blackwell", "Ampere", "Ada", ... ("none" without a GPU, "unknown" past SM12x)."""
    cap = _cap(cap)
    if cap is None:
        return "none"
    if cap == (8, 9):
        return "Ada"
    return _FAMILIES.get(cap[0], "unknown" if cap[0] > 12 else "pre-Volta")


def is_hopper(cap: Capability | None = None) -> bool:
    cap = _cap(cap)
    return cap is not None and cap[0] == 9


def is_blackwell_class(cap: Capability | None = None) -> bool:
    """SM10x, SM11x and SM12x: datacenter Blackwell, Thor, consumer Blackwell and GB10 alike."""
    cap = _cap(cap)
    return cap is not None and cap[0] in (10, 11, 12)


def has_fp4_tensor_cores(cap: Capability | None = None) -> bool:
    """Native FP4 (E2M1) tensor-core math: the Blackwell generation, not Hopper or older."""
    return is_blackwell_class(cap)


def cutlass_moe_variant(cap: Capability | None = None) -> str | None:
    """Which FlashInfer CUTLASS MXFP4 MoE build serves this GPU: "w4a16" (Hopper: bf16
    activations), "mxfp8" (Blackwell-class: MXFP8 activations) or None (neither)."""
    cap = _cap(cap)
    if cap in CUTLASS_W4A16_MOE:
        return "w4a16"
    if cap in CUTLASS_MXFP8_MXFP4_MOE:
        return "mxfp8"
    return None
