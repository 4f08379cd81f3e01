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
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                            ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int,
                            ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]
        self.fn.restype = ctypes.c_int
        self.error_fn = lib.tinyoss_all_reduce_error
        self.error_fn.argtypes, self.error_fn.restype = [ctypes.c_int], ctypes.c_char_p

    def __call__(self, x: torch.Tensor, peers: list[int], rank: int, state: torch.Tensor,
                 slot: int, out: torch.Tensor, residual: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None, eps: float = 0.0) -> None:
        """out = the sum of every rank's x [rows, hidden] (bf16, contiguous); with `residual`
        and `weight` (float32 [hidden]) residual += that sum and out = its RMSNorm. `peers`:
        every rank's receive buffer (3 * `slot` 16-byte vectors, -0.0 before the first call),
        `state`: 3 int32 on this GPU, zero before the first call."""
        rows, hidden = x.shape
        if residual is not None:
            if weight is None or weight.dtype != torch.float32 or not weight.is_contiguous():
                raise ValueError("the fused norm needs a contiguous float32 weight")
            if residual.shape != x.shape or residual.dtype != x.dtype or \
                    not residual.is_contiguous():
                raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not "
                                 f"match x {tuple(x.shape)} {x.dtype}")
        ptrs = (ctypes.c_void_p * len(peers))(*peers)
        err = self.fn(x.data_ptr(), rows, hidden, ptrs, len(peers), rank, state.data_ptr(), slot,
                      out.data_ptr(), residual.data_ptr() if residual is not None else None,
                      weight.data_ptr() if weight is not None else None, eps,
                      torch.cuda.current_stream(x.device).cuda_stream)
        if err:
            raise RuntimeError(f"the one-shot all-reduce failed to launch: CUDA error {err}: "
                               f"{self.error_fn(err).decode()} (rows {rows}, hidden {hidden}, "
                               f"{len(peers)} ranks)")


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
