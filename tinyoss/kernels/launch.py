"""How Triton kernels are launched: programmatic dependent launch (PDL) where the GPU has it.

A decode step is hundreds of short kernels in a row; between two of them the GPU drains one and
ramps up the next. With PDL (Hopper and newer) the next kernel is launched while the previous
one runs, loads what does not depend on it (weights), and waits in `gdc_wait` for its results.
Kernels that take part have a `USE_PDL` constexpr and start with `pdl_triton.pdl_start`: every
program waits before it reads any activation or writes anything, so a kernel never runs ahead
of one it depends on, however many kernels back. `select_backends` turns it on once at start-up
(and logs it).
"""

from __future__ import annotations

import torch

_enabled = False


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
