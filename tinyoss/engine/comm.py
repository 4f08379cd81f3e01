"""The collectives of a tensor-parallel group: NCCL between GPUs, gloo between CPU processes.

Every rank calls the same collectives in the same order (the model's all-reduces and logit
gathers, the chained steps' token broadcast); on GPUs they are stream-ordered and captured in
the CUDA graphs like any kernel.

A decode step all-reduces a few kilobytes twice a layer, where NCCL's fixed cost per call
dominates. Small all-reduces can instead go through PyTorch's symmetric memory: each rank
copies its part into a buffer every rank can read over NVLink and sums the others' in one
kernel (`one_shot_all_reduce_copy_out`, peer-to-peer loads, no multicast). Env
TINYOSS_ALL_REDUCE picks: `nccl`, `symm_mem`, or `auto` (symmetric memory for messages up to
`FAST_MAX_BYTES` where it starts and sums right, NCCL otherwise); the choice is logged.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from tinyoss.settings import resolve

log = logging.getLogger("tinyoss")

ALL_REDUCE_ENV = "TINYOSS_ALL_REDUCE"
FAST_MAX_BYTES = 512 * 1024  # a decode step of up to ~90 tokens at hidden size 2880 in bf16

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
        self._fast: _SymmMemAllReduce | None = None
        self.all_reduce(torch.zeros(1, device=device))  # the communicator, before any capture

    def use_fast_all_reduce(self, dtype: torch.dtype) -> str:
        """Chooses how small all-reduces of `dtype` run (before any CUDA graph is captured;
        every rank calls this at the same point). Returns the choice, for the log."""
        choices = ("auto", "nccl", "symm_mem")
        setting = resolve("all-reduce", None, ALL_REDUCE_ENV, choices)
        if not self._nccl or setting.value == "nccl":
            return "nccl" if self._nccl else "gloo"
        try:
            self._fast = _SymmMemAllReduce(self, dtype)
        except Exception as e:  # noqa: BLE001 - the fast path is optional unless forced
            if setting.value == "symm_mem":
                raise RuntimeError(f"all-reduce symm_mem (from {setting.source}) failed: {e}")
            log.warning("symmetric-memory all-reduce unavailable (%s): NCCL for all", e)
            return "nccl"
        return f"symm_mem one-shot up to {FAST_MAX_BYTES // 1024} KiB, nccl above"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (in place, or a new tensor)."""
        fast = self._fast
        if fast is not None and x.dtype == fast.dtype and x.numel() <= fast.numel:
            return fast(x)
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


class _SymmMemAllReduce:
    """One-shot all-reduce through a symmetric-memory buffer; checked against NCCL at start."""

    def __init__(self, group: Group, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.dtype = dtype
        self.numel = FAST_MAX_BYTES // torch.tensor([], dtype=dtype).element_size()
        self.name = dist.group.WORLD.group_name
        self.buffer = symm_mem.empty(self.numel, dtype=dtype, device=group.device)
        symm_mem.rendezvous(self.buffer, self.name)
        probe = torch.arange(3000, device=group.device, dtype=torch.float32) % 7
        probe = (probe * (group.rank + 1)).to(dtype)
        want = probe.clone()
        dist.all_reduce(want)
        got = self(probe)
        torch.cuda.synchronize(group.device)
        if not torch.equal(got, want):
            raise RuntimeError("its sum differs from NCCL's")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(
            self.buffer[: x.numel()], x.reshape(-1), "sum", self.name, out.view(-1))
        return out
