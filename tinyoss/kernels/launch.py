"""How Triton kernels are launched: programmatic dependent launch (PDL) where the GPU has it.

A decode step is hundreds of short kernels in a row; between two of them the GPU drains one and
ramps up the next. With PDL (Hopper and newer) the next kernel is launched while the previous
one runs, loads what does not depend on it (weights), and waits in `gdc_wait` for its results.
Kernels that take part have a `USE_PDL` constexpr and start with `pdl_triton.pdl_start`: every
program waits before it reads any activation or writes anything, so a kernel never runs ahead
of one it depends on, however many kernels back. `select_backends` turns it on once at start-up
(and logs it).

L2 prefetch (Hopper and newer; `prefetch_triton`): a weight-streaming kernel given the weights
a later kernel reads pulls them into L2 at its end, so HBM keeps streaming while the short
kernels in between (rope, attention, norms) run. `select_backends` turns it on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_enabled = False
_prefetch = False
_prefetch_kind = 1
MAX_PREFETCH_REGIONS = 2


def enable_pdl(on: bool) -> None:
    global _enabled
    _enabled = on


def pdl_available(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_options(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel with a USE_PDL constexpr, on the device of `t`."""
    if _enabled and t.is_cuda:
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


def enable_prefetch(on: bool) -> None:
    global _prefetch
    _prefetch = on


def prefetch_available(device: torch.device) -> bool:
    """The bulk L2 prefetch instruction is Hopper's (sm_90) and newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def prefetch_options(tensors: Sequence[torch.Tensor], like: torch.Tensor) -> dict:
    """Kernel arguments naming up to two tensors to prefetch (`prefetch_triton.prefetch_regions`),
    or none: when prefetch is off, on CPU tensors, or for empty `tensors`. A hint only."""
    if len(tensors) > MAX_PREFETCH_REGIONS:
        raise ValueError(f"at most {MAX_PREFETCH_REGIONS} tensors to prefetch, got {len(tensors)}")
    if not (_prefetch and like.is_cuda):
        tensors = ()
    args: dict = {"PREFETCH": len(tensors), "PF_KIND": _prefetch_kind}
    for i in range(MAX_PREFETCH_REGIONS):
        t = tensors[i] if i < len(tensors) else like
        if i < len(tensors) and (not t.is_contiguous() or t.data_ptr() % 16):
            raise ValueError("a tensor to prefetch must be contiguous and 16-byte aligned")
        args[f"pf{i}_ptr"] = t
        args[f"pf{i}_bytes"] = t.numel() * t.element_size() if i < len(tensors) else 0
    return args
