"""The collectives of a tensor-parallel group: NCCL between GPUs, gloo between CPU processes.

Every rank calls the same collectives in the same order (the model's all-reduces and logit
gathers, the chained steps' token broadcast); on GPUs they are stream-ordered and captured in
the CUDA graphs like any kernel.

A decode step all-reduces a few kilobytes twice a layer, where NCCL's fixed cost per call
dominates. Small all-reduces (up to `FAST_MAX_BYTES`) can instead go through
- tinyoss's own one-shot (`kernels/all_reduce.cu`): each rank stores its rows into every rank's
  receive buffer (PyTorch symmetric memory), which marks what has not arrived with -0.0, so one
  launch and one trip over NVLink do it, with no barrier; it fuses the residual add and RMSNorm
  after the experts' all-reduce (`all_reduce_norm`) and, at up to `FAST_MAX_BYTES` of tokens,
  the experts' top-k combine too (`all_reduce_pairs_norm`). nvcc builds it in seconds;
- FlashInfer's TensorRT-LLM all-reduce: the same Lamport one-shot, also fused with the residual
  add and RMSNorm, whose first build takes minutes;
- PyTorch's symmetric memory: each rank copies its part into a buffer every rank can read over
  NVLink and sums the others' in one kernel (`one_shot_all_reduce_copy_out`, peer-to-peer loads,
  with barriers).
On 4x H200 at batch 1, 120b decodes at TP 2 at 507 tok/s with tinyoss's, 499 with FlashInfer's,
438 with symmetric memory (bench/results/2026-11-28_session35.md).
None uses NVLink multicast. Env TINYOSS_ALL_REDUCE picks: `nccl`, `custom`, `symm_mem`,
`flashinfer`, or `auto`: tinyoss's where its kernel builds (Hopper with nvcc), else FlashInfer's
where its kernels are already built (their first build takes minutes, so `auto` does not start
it), else symmetric memory, else NCCL; each fast path is checked against NCCL at start and the
choice is logged. All read the other GPUs' memory: where a pair of the group's GPUs has no
peer-to-peer path, `auto` takes NCCL (only NVLink hosts were measured; PCIe peer-to-peer is
allowed, untested). The fast paths serve one engine a process (PyTorch counts
symmetric-memory rendezvous per process): a later tensor-parallel engine in the same process
takes NCCL.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator
from typing import Callable

import torch
import torch.distributed as dist

from tinyoss.settings import Setting, resolve

log = logging.getLogger("tinyoss")

ALL_REDUCE_ENV = "TINYOSS_ALL_REDUCE"
ALL_REDUCE_CHOICES = ("auto", "nccl", "custom", "symm_mem", "flashinfer")


class GroupError(RuntimeError):
    """A collective (or a plan sent down to the workers) failed: a rank may be gone."""


@contextlib.contextmanager
def _collective() -> Iterator[None]:
    try:
        yield
    except RuntimeError as e:
        raise GroupError(str(e)) from e


def all_reduce_setting() -> Setting:
    """TINYOSS_ALL_REDUCE, checked (rank 0 checks it before starting any worker)."""
    return resolve("all-reduce", None, ALL_REDUCE_ENV, ALL_REDUCE_CHOICES)


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
        self._fast: _FastAllReduce | None = None
        self.all_reduce_choice = "nccl" if self._nccl else "gloo"  # use_fast_all_reduce's
        self.all_reduce(torch.zeros(1, device=device))  # the communicator, before any capture

    def use_fast_all_reduce(self, dtype: torch.dtype, hidden: int) -> str:
        """Chooses how small all-reduces of `dtype` rows of `hidden` run (before any CUDA graph
        is captured; every rank calls this at the same point); the choice, in words, is kept in
        `all_reduce_choice` and returned."""
        self.all_reduce_choice = self._choose_all_reduce(dtype, hidden)
        return self.all_reduce_choice

    def _choose_all_reduce(self, dtype: torch.dtype, hidden: int) -> str:
        setting = all_reduce_setting()
        if not self._nccl or setting.value == "nccl":
            return "nccl" if self._nccl else "gloo"
        want = setting.value
        if (no_peers := self._without_peer_access()) is not None:
            if setting.value != "auto":
                raise RuntimeError(f"all-reduce {setting.value} (from {setting.source}) reads "
                                   f"the other GPUs' memory, but {no_peers}; "
                                   "TINYOSS_ALL_REDUCE=nccl works without")
            return f"nccl ({no_peers})"
        if want == "auto":  # every rank must pick the same
            want = ("custom" if self.min(int(_custom_loads(self.device))) else
                    "flashinfer" if self.min(int(_flashinfer_built())) else "symm_mem")
        if self.min(int(not _symmetric_memory_used)) == 0:
            # PyTorch numbers its symmetric-memory rendezvous per process (FlashInfer's buffers
            # come from it too): a second engine in rank 0's process would count on from the
            # first while its new workers start at 0, and wait for ever (seen on the GPUs)
            if setting.value != "auto":
                raise RuntimeError(
                    f"all-reduce {setting.value} (from {setting.source}) serves one tensor-"
                    "parallel engine a process, and this process started one before; "
                    "TINYOSS_ALL_REDUCE=nccl serves any number")
            return "nccl (symmetric memory served an earlier engine of this process)"
        try:
            if want == "custom":
                self._fast = _CustomAllReduce(self, dtype, hidden)
            elif want == "flashinfer":
                self._fast = _FlashInferAllReduce(self, dtype, hidden)
            else:
                self._fast = _SymmMemAllReduce(self, dtype)
        except Exception as e:  # noqa: BLE001 - the fast path is optional unless forced
            if setting.value != "auto":
                raise RuntimeError(f"all-reduce {setting.value} (from {setting.source}) failed: "
                                   f"{e}; TINYOSS_ALL_REDUCE=nccl always works")
            log.warning("%s all-reduce unavailable (%s): NCCL for all", want, e)
        if setting.value == "auto" and self.min(int(self._fast is not None)) == 0:
            self._fast = None  # a rank without it: all take NCCL, or their collectives differ
            return "nccl"
        fused = ", fused with the residual add and RMSNorm" if self._fast.fuses_norm else ""
        hint = ""
        if want == "symm_mem" and setting.value == "auto":
            hint = ("; TINYOSS_ALL_REDUCE=flashinfer is faster, once FlashInfer's all-reduce is "
                    "built (minutes, once a machine)")
        return f"{self._fast.name} up to {FAST_MAX_BYTES // 1024} KiB{fused}, nccl above{hint}"

    def _without_peer_access(self) -> str | None:
        """Which GPUs of the group cannot read each other's memory (no NVLink or PCIe
        peer-to-peer path), in words, or None when all can: both fast paths load from the other
        ranks' buffers. The same answer on every rank."""
        own = torch.tensor([self.device.index], dtype=torch.long, device=self.device)
        devices = torch.empty(self.size, dtype=torch.long, device=self.device)
        with _collective():
            dist.all_gather_into_tensor(devices, own)
        cut = _unreachable_peer(self.device.index, devices.tolist())
        if self.min(int(cut is None)):
            return None
        return (f"GPU {self.device.index} cannot access GPU {cut} peer to peer" if cut is not None
                else "a pair of the group's GPUs cannot access each other peer to peer")

    def _fast_for(self, x: torch.Tensor) -> _FastAllReduce | None:
        fast = self._fast
        return fast if fast is not None and fast.fits(x) else None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (in place, or a new tensor)."""
        fast = self._fast_for(x)
        if fast is not None:
            return fast(x)
        with _collective():
            dist.all_reduce(x)
        return x

    def all_reduce_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float, norm: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """`norm` (an RMSNorm with `rms_norm_torch`'s contract) of the sum over ranks plus
        `residual`: (normed, new residual), in one kernel where the fast path fuses it."""
        fast = self._fast_for(x)
        if fast is not None and fast.fuses_norm:
            return fast.norm(x, residual, weight, eps)
        return norm(self.all_reduce(x), weight, eps, residual)

    def pairs_max_tokens(self) -> int:
        """The most tokens `all_reduce_pairs_norm` takes a call: 0 unless the fast path is
        tinyoss's own, which also sums the experts' pairs."""
        fast = self._fast
        return fast.max_tokens if isinstance(fast, _CustomAllReduce) else 0

    def all_reduce_pairs_norm(self, y: torch.Tensor, ids: torch.Tensor, residual: torch.Tensor,
                              weight: torch.Tensor, eps: float
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """`all_reduce_norm` of the experts' output still as their pairs' rows (y [T * K, H]
        fp32, ids [T, K]: the combine in the same launch); up to `pairs_max_tokens` tokens."""
        if not isinstance(self._fast, _CustomAllReduce) or \
                ids.shape[0] > self._fast.max_tokens or not self._fast.fits(residual):
            raise ValueError(f"{ids.shape[0]} tokens of pairs: more than pairs_max_tokens "
                             f"({self.pairs_max_tokens()}) or not the fast path's rows")
        return self._fast.pairs_norm(y, ids, residual, weight, eps)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, C] from every rank -> [T, size * C], rank 0's columns first."""
        with _collective():
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
        with _collective():
            dist.broadcast(x, 0)
        return x

    def min(self, value: int) -> int:
        """The smallest of the ranks' `value`s (e.g. KV cache blocks, so all ranks agree)."""
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        with _collective():
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        """Every rank at once, after its last step and with its CUDA graphs freed. NCCL's
        communicator is aborted rather than destroyed: its work is done (the device is synced)
        and abort never waits, where destroy hung on the GPUs with graphs captured."""
        if self._fast is not None and hasattr(self._fast, "close"):
            self._fast.close()
        if not dist.is_initialized():
            return
        if self._nccl:
            torch.cuda.synchronize(self.device)
            self.abort()
        else:
            dist.destroy_process_group()

    def abort(self) -> None:
        """Leaves the group without waiting for ranks that are gone."""
        if not dist.is_initialized():
            return
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - a backend that cannot abort (gloo): plain teardown
            dist.destroy_process_group()


def _probe(group: Group, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Small integers times (rank + 1): every sum exact in `dtype`, so any path must match."""
    x = torch.arange(math.prod(shape), device=group.device, dtype=torch.float32) % 7
    return (x * (group.rank + 1)).to(dtype).view(shape)


def _unreachable_peer(own: int, devices: list[int]) -> int | None:
    """The first of `devices` (the group's GPUs) that GPU `own` cannot read peer to peer."""
    return next((d for d in devices
                 if d != own and not torch.cuda.can_device_access_peer(own, d)), None)


def _custom_loads(device: torch.device) -> bool:
    """Whether tinyoss's all-reduce kernel builds (seconds, once a machine) and loads here."""
    from tinyoss.kernels import all_reduce, hardware

    kernel, why = all_reduce.load(hardware.capability(device))
    if kernel is None:
        log.info("tinyoss's all-reduce kernel is not used: %s", why)
    return kernel is not None


def _flashinfer_built() -> bool:
    """Whether FlashInfer's all-reduce kernels are prebuilt (an AOT artifact) here: `auto` takes
    them then, and does not start their build (minutes) itself. A JIT-built library does not
    count: FlashInfer loads it through ninja, which rebuilds it when the sources look newer (a
    restored JIT cache on a fresh GPU machine did, and both ranks waited minutes on its lock)."""
    try:
        from flashinfer.jit.comm import gen_trtllm_comm_module

        return gen_trtllm_comm_module().is_aot
    except Exception:  # noqa: BLE001 - no FlashInfer, or none for this GPU
        return False


# Whether this process made symmetric-memory buffers (either fast path): one engine a process
# can, see `Group.use_fast_all_reduce`
_symmetric_memory_used = False


def _uses_symmetric_memory() -> None:
    global _symmetric_memory_used
    _symmetric_memory_used = True


class _SymmMemAllReduce:
    """One-shot all-reduce through a symmetric-memory buffer; checked against NCCL at start."""

    name, fuses_norm = "symm_mem one-shot", False

    def __init__(self, group: Group, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        _uses_symmetric_memory()
        self.dtype = dtype
        self.numel = FAST_MAX_BYTES // torch.tensor([], dtype=dtype).element_size()
        self.group_name = dist.group.WORLD.group_name
        self.buffer = symm_mem.empty(self.numel, dtype=dtype, device=group.device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        probe = _probe(group, dtype, (3000,))
        want = probe.clone()
        with _collective():
            dist.all_reduce(want)
        got = self(probe)
        torch.cuda.synchronize(group.device)
        if not torch.equal(got, want):
            raise RuntimeError("its sum differs from NCCL's")

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.numel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(
            self.buffer[: x.numel()], x.reshape(-1), "sum", self.group_name, out.view(-1))
        return out


class _CustomAllReduce:
    """tinyoss's one-shot all-reduce of [T, hidden] bf16 rows (`kernels/all_reduce.cu`), alone
    or fused with the residual add and RMSNorm: each rank stores its rows into every rank's
    receive buffer (PyTorch symmetric memory) and sums what arrived in its own, in one launch.
    Checked against NCCL and the torch norm at start."""

    name, fuses_norm = "custom one-shot", True

    def __init__(self, group: Group, dtype: torch.dtype, hidden: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from tinyoss.kernels import all_reduce, hardware, rms_norm_torch

        kernel, why = all_reduce.load(hardware.capability(group.device))
        if kernel is None:
            raise RuntimeError(f"tinyoss's all-reduce kernel cannot run: {why}")
        if dtype != torch.bfloat16 or hidden % 8 or hidden > all_reduce.MAX_HIDDEN or \
                group.size not in all_reduce.RANKS:
            raise RuntimeError(f"it takes bf16 rows of a multiple of 8 up to "
                               f"{all_reduce.MAX_HIDDEN} over {all_reduce.RANKS} GPUs, not "
                               f"{dtype} rows of {hidden} over {group.size}")
        self.kernel, self.group, self.dtype, self.hidden = kernel, group, dtype, hidden
        # a block a row, all resident at once on any GPU (91 at gpt-oss's hidden size)
        self.max_tokens = max(1, min(128, FAST_MAX_BYTES // (hidden * dtype.itemsize)))
        self.slot = group.size * self.max_tokens * hidden // 8  # 16-byte vectors a slot
        _uses_symmetric_memory()
        group_name = dist.group.WORLD.group_name
        self.buffer = symm_mem.empty(3 * self.slot * 8, dtype=dtype, device=group.device)
        self.buffer.view(torch.int16).fill_(-0x8000)  # bf16 -0.0 everywhere: nothing arrived
        self.handle = symm_mem.rendezvous(self.buffer, group_name)
        self.peers = [self.handle.get_buffer(r, self.buffer.shape, dtype).data_ptr()
                      for r in range(group.size)]
        self.state = torch.zeros(3, dtype=torch.int32, device=group.device)
        torch.cuda.synchronize(group.device)
        with _collective():
            dist.barrier()  # every buffer filled before any rank stores into it
        _check_against_nccl(self, group, dtype, hidden, rms_norm_torch)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dtype == self.dtype and x.dim() == 2 and x.shape[1] == self.hidden
                and 1 <= x.shape[0] <= self.max_tokens and x.is_contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self.kernel(x, self.peers, self.group.rank, self.state, self.slot, out)
        return out

    def norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(sum + residual), sum + residual); the new residual over `residual`."""
        out = torch.empty_like(x)
        self.kernel(x, self.peers, self.group.rank, self.state, self.slot, out, residual,
                    weight.float().contiguous(), eps)
        return out, residual

    def pairs_norm(self, y: torch.Tensor, ids: torch.Tensor, residual: torch.Tensor,
                   weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`norm` of each token's sum of its expert pairs' rows y [T * K, H] fp32 (ids [T, K];
        pairs of id -1 left out), the sum rounded to bf16 as the experts' combine rounds it."""
        out = torch.empty_like(residual)
        self.kernel(y, self.peers, self.group.rank, self.state, self.slot, out, residual,
                    weight.float().contiguous(), eps, ids=ids.to(torch.int32).contiguous())
        return out, residual


def _check_against_nccl(fast: _CustomAllReduce | _FlashInferAllReduce, group: Group,
                        dtype: torch.dtype, hidden: int, rms_norm_torch: Callable) -> None:
    """The sum of small integers (exact in any order) as NCCL's, and the fused norm within
    bf16 rounding of the torch norm over NCCL's sum; raises otherwise."""
    probe = _probe(group, dtype, (3, hidden))
    want = probe.clone()
    with _collective():
        dist.all_reduce(want)
    residual = _probe(group, dtype, (3, hidden)).roll(1) / (group.rank + 1)
    weight = torch.linspace(0.5, 1.5, hidden, device=group.device)  # float32, as the model's
    got = fast(probe)
    normed, new_residual = fast.norm(probe, residual.clone(), weight, 1e-5)
    want_normed, want_residual = rms_norm_torch(want, weight, 1e-5, residual)
    torch.cuda.synchronize(group.device)
    if not torch.equal(got, want) or not torch.equal(new_residual, want_residual):
        raise RuntimeError("its sum differs from NCCL's")
    torch.testing.assert_close(normed, want_normed, rtol=2e-2, atol=2e-2)


class _FlashInferAllReduce:
    """FlashInfer's TensorRT-LLM one-shot all-reduce of [T, hidden] rows, alone or fused with
    the residual add and RMSNorm; checked against NCCL and the torch norm at start.

    The kernel reads the norm weight in the activations' dtype: the model's float32 weights
    (bf16 in the checkpoint, so exact) go in as a cached copy made on first use, which is an
    eager warm-up step, never inside a graph capture."""

    name, fuses_norm = "flashinfer one-shot", True

    def __init__(self, group: Group, dtype: torch.dtype, hidden: int) -> None:
        from flashinfer.comm import AllReduceFusionPattern
        from flashinfer.comm import trtllm_create_ipc_workspace_for_all_reduce_fusion as create
        from flashinfer.comm.trtllm_ar import get_trtllm_comm_module

        from tinyoss.kernels import rms_norm_torch

        self.group, self.dtype, self.hidden = group, dtype, hidden
        self.max_tokens = max(1, FAST_MAX_BYTES // (hidden * dtype.itemsize))
        self._patterns = AllReduceFusionPattern
        self._kernel = get_trtllm_comm_module().trtllm_allreduce_fusion  # the JIT build
        self._gammas: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # IPC buffers from PyTorch's symmetric memory (use_symm_dev_mem=False), which
        # TORCH_SYMM_MEM_DISABLE_MULTICAST keeps off multicast; the handles must stay alive.
        _uses_symmetric_memory()
        self._handles, self._ptrs, _ = create(
            group.rank, group.size, self.max_tokens, hidden, create_metadata=True,
            use_symm_dev_mem=False, use_fp32_lamport=dtype == torch.float32)
        _check_against_nccl(self, group, dtype, hidden, rms_norm_torch)
        self._gammas.clear()

    def _call(self, x: torch.Tensor, pattern: int, out: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, norm_out: torch.Tensor | None = None,
              gamma: torch.Tensor | None = None, eps: float | None = None) -> None:
        # the module's own entry: FlashInfer's public wrapper warns (deprecated) every call
        self._kernel(x, self.group.size, self.group.rank, x.shape[0], self.hidden, self._ptrs,
                     False, True, True, True, pattern,  # no PDL; one-shot; done at end; fp32
                     out, residual, residual, norm_out, None, None, gamma, eps, None, None)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dtype == self.dtype and x.dim() == 2 and x.shape[1] == self.hidden
                and x.shape[0] <= self.max_tokens and x.is_contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self._call(x, self._patterns.kAllReduce, out=out)
        return out

    def norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(sum + residual), sum + residual); the new residual over `residual`."""
        key = weight.data_ptr()
        if key not in self._gammas:  # (the weight, kept so that its address stays its own)
            self._gammas[key] = (weight, weight.to(self.dtype).contiguous())
        out = torch.empty_like(x)
        self._call(x, self._patterns.kARResidualRMSNorm, residual=residual, norm_out=out,
                   gamma=self._gammas[key][1], eps=eps)
        return out, residual

    def close(self) -> None:
        from flashinfer.comm import trtllm_destroy_ipc_workspace_for_all_reduce_fusion

        trtllm_destroy_ipc_workspace_for_all_reduce_fusion(self._handles)


_FastAllReduce = _SymmMemAllReduce | _CustomAllReduce | _FlashInferAllReduce
