"""tinyoss's one-shot all-reduce (`all_reduce.cu`) for the small all-reduces of a tensor-parallel
decode step: rows of bf16 summed over the GPUs of one host in one launch that stores straight
into every GPU's receive buffer, optionally fused with the residual add and RMSNorm after it.

nvcc builds it in seconds on first use (`nvcc_build`), where FlashInfer's all-reduce takes
minutes to build; the buffers (PyTorch symmetric memory) and the check against NCCL are
`engine/comm.py`'s. Built for sm_90 (Hopper) only, the GPUs it was measured on.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from tinyoss.kernels import nvcc_build

SOURCE = Path(__file__).with_suffix(".cu")
RANKS = (2, 4, 8)  # what the kernel is instantiated for (tensor parallelism divides 8 KV heads)
MAX_HIDDEN = 8192  # a row is one block's 16-byte vectors, one a thread


class OneShot:
    """The built library's launch, with the argument checks the kernel relies on."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn = lib.tinyoss_all_reduce
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                            ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                            ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long,
                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                            ctypes.c_void_p]
        self.fn.restype = ctypes.c_int
        self.error_fn = lib.tinyoss_all_reduce_error
        self.error_fn.argtypes, self.error_fn.restype = [ctypes.c_int], ctypes.c_char_p

    def __call__(self, x: torch.Tensor, peers: list[int], rank: int, state: torch.Tensor,
                 slot: int, out: torch.Tensor, residual: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None, eps: float = 0.0,
                 ids: torch.Tensor | None = None) -> None:
        """out [rows, hidden] bf16 = the sum over ranks of x [rows, hidden] (bf16, contiguous),
        or, with `ids` (int32 [rows, topk]), of each row's topk pair rows of x (fp32
        [rows * topk, hidden]) whose id is not negative; with `residual` and `weight` (float32
        [hidden]) residual += that sum and out = its RMSNorm. `peers`: every rank's receive
        buffer (3 * `slot` 16-byte vectors, -0.0 before the first call), `state`: 3 int32 on
        this GPU, zero before the first call."""
        rows, hidden = out.shape
        if ids is not None and (ids.dtype != torch.int32 or ids.dim() != 2 or
                                ids.shape[0] != rows or not ids.is_contiguous()):
            raise ValueError(f"ids must be contiguous int32 [{rows}, topk], got {ids.dtype} "
                             f"{tuple(ids.shape)}")
        topk = 0 if ids is None else ids.shape[1]
        want = (torch.float32, (rows * topk, hidden)) if ids is not None else \
            (torch.bfloat16, (rows, hidden))
        if (x.dtype, tuple(x.shape)) != want or not x.is_contiguous() or \
                out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"x must be contiguous {want[0]} {want[1]} and out bf16, got x "
                             f"{x.dtype} {tuple(x.shape)}, out {out.dtype}")
        if residual is not None:
            if weight is None or weight.dtype != torch.float32 or not weight.is_contiguous() \
                    or weight.shape != (hidden,):
                raise ValueError(f"the fused norm needs a contiguous float32 weight [{hidden}]")
            if residual.shape != out.shape or residual.dtype != out.dtype or \
                    not residual.is_contiguous():
                raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not "
                                 f"match out {tuple(out.shape)} {out.dtype}")
        given = [t for t in (x, out, residual, weight, ids) if t is not None]
        if any(t.device != out.device for t in given) or state.device != out.device or \
                state.dtype != torch.int32 or state.numel() < 3:
            raise ValueError("x, out, residual, weight, ids and state (int32, 3 or more) must "
                             "be on one GPU")
        if any(t.data_ptr() % 16 for t in (x, out, residual, weight) if t is not None):
            raise ValueError("the all-reduce loads 16 bytes at a time: x, out, residual and "
                             "weight must start 16-byte aligned")
        ptrs = (ctypes.c_void_p * len(peers))(*peers)
        pointer = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        err = self.fn(pointer(x) if ids is None else None, pointer(x) if ids is not None else None,
                      pointer(ids), topk, rows, hidden, ptrs, len(peers), rank, state.data_ptr(),
                      slot, out.data_ptr(), pointer(residual), pointer(weight), eps,
                      torch.cuda.current_stream(out.device).cuda_stream)
        if err:
            raise RuntimeError(f"the one-shot all-reduce failed to launch: CUDA error {err}: "
                               f"{self.error_fn(err).decode()} (rows {rows}, hidden {hidden}, "
                               f"topk {topk}, {len(peers)} ranks)")


@functools.cache
def load(capability: tuple[int, int] | None) -> tuple[OneShot | None, str]:
    """(the kernel, how it was built) on a GPU of `capability`; (None, why not) otherwise."""
    if capability != (9, 0):
        return None, "it is built for sm_90 (Hopper) only"
    nvcc = nvcc_build.find_nvcc()
    if nvcc is None:
        return None, "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    try:
        return OneShot(ctypes.CDLL(str(nvcc_build.build(nvcc, SOURCE, "the all-reduce")))), \
            f"built with {nvcc}"
    except (OSError, RuntimeError) as e:
        return None, f"its build failed: {e}"
