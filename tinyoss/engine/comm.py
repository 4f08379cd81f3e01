"""The collectives of a tensor-parallel group: NCCL between GPUs, gloo between CPU processes.

Every rank calls the same collectives in the same order (the model's all-reduces and logit
gathers, the chained steps' token broadcast); on GPUs they are stream-ordered and captured in
the CUDA graphs like any kernel.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger("tinyoss")

# NVLink multicast (NVLS) stays off, here and in every process tinyoss starts: on shared hosts a
# program that uses it can put the GPUs out of service.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def disable_multicast() -> None:
    os.environ.update(NO_MULTICAST)


class Group:
    """This process's place in the group and its collectives."""

    def __init__(self, rank: int, size: int, device: torch.device, init_method: str) -> None:
        disable_multicast()
        self.rank, self.size, self.device = rank, size, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                **kwargs)
        self._nccl = backend == "nccl"
        self.all_reduce(torch.zeros(1, device=device))  # the communicator, before any capture

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, C] from every rank -> [T, size * C], rank 0's columns first."""
        if self._nccl:
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x.contiguous())
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x`, on every rank (in place)."""
        dist.broadcast(x, 0)
        return x

    def min(self, value: int) -> int:
        """The smallest of the ranks' `value`s (e.g. KV cache blocks, so all ranks agree)."""
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
