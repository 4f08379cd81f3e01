"""Programmatic dependent launch (PDL): a step's next kernel placed on the SMs while this one runs.

In a CUDA graph of ~170 kernels a step (gpt-oss-20b at batch 1) each kernel boundary costs a
launch gap. A kernel launched with PDL may start before the one ahead of it ends: it waits
(`griddepcontrol.wait`) for that kernel to finish, its writes visible, before it touches memory,
then lets the next kernel launch (`griddepcontrol.launch_dependents`). So at most two kernels are
resident, the second's programs already placed when the first ends. (Letting the next launch
before the wait, as the first trials did, lets a whole chain launch at once and was 12-32% slower:
bench/results/2026-11-27_session31.md.)

Every kernel launched with the attribute must wait first, or it could read what the kernel ahead
has not written: the Triton kernels that take a `PDL` constexpr do, and so does every kernel of
moe_gemv_mma.cu. Kernels without it (torch's, FlashInfer's) launch as always and wait for the
whole kernel ahead, PDL or not.

Chosen once a process: on for CUDA GPUs of sm_90 or newer (griddepcontrol's first), off on the
CPU and under Triton's interpreter; env TINYOSS_PDL=off turns it off (A/B runs, debugging).
"""

from __future__ import annotations

import functools
import os

from tinyoss.settings import resolve

ENV = "TINYOSS_PDL"
CHOICES = ("auto", "on", "off")


@functools.cache
def enabled() -> bool:
    """Whether the step's kernels launch with PDL in this process."""
    import torch

    setting = resolve("programmatic dependent launch", None, ENV, CHOICES)
    supported = (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
                 and os.environ.get("TRITON_INTERPRET") != "1")
    if setting.value == "on" and not supported:
        raise ValueError(f"programmatic dependent launch (from {setting.source}) needs a CUDA GPU "
                         "of sm_90 or newer and no TRITON_INTERPRET; unset it")
    return supported and setting.value != "off"


def launch_args() -> dict[str, bool]:
    """A Triton launch's `PDL` constexpr and `launch_pdl` option, the same switch."""
    on = enabled()
    return {"PDL": on, "launch_pdl": on}
