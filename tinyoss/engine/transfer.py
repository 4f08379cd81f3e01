"""Host <-> device copies that never make the host wait for the GPU.

The engine launches a step and prepares the next while the GPU runs (`async_scheduling`), so a
copy in either direction must not synchronise the stream: host data goes up from pinned memory,
results come down into pinned memory with an event to wait on when they are needed. On the CPU
both are plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """Host-to-device copy that never waits for the stream: pinned memory + non_blocking."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class HostCopy:
    """Device tensors on their way to host memory; `wait()` returns them once they are there."""

    tensors: list[Tensor | None]
    done: torch.cuda.Event | None

    @classmethod
    def start(cls, tensors: list[Tensor | None]) -> HostCopy:
        if not any(t is not None and t.is_cuda for t in tensors):
            return cls(list(tensors), None)
        host = []
        for t in tensors:
            if t is None:
                host.append(None)
                continue
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.append(h.copy_(t, non_blocking=True))
        done = torch.cuda.Event()
        done.record()
        return cls(host, done)

    def wait(self) -> list[Tensor | None]:
        if self.done is not None:
            self.done.synchronize()
        return self.tensors
