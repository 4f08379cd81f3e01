"""The MoE GEMVs on tensor cores (`moe_gemv_mma.cu`) on Hopper: the pair kernels for steps of
1 to `moe_triton.GEMV_MAX_TOKENS` tokens (decode, batched decode, speculative verify) and the
kernel grouped by expert above that, up to GROUPED_MAX_TOKENS.

The same pair kernel also takes the dense layers quantized to MXFP4 at load (`--mxfp4-layers`)
whose K is 2880 (q/k/v, lm_head) at decode, in place of the CUDA-core Triton GEMV (`dense`, bf16
out);
and `linear` runs bf16 or FP8 dense layers for 1-8 rows of x, each a column of the MMA (the
weights read once), which `linear_triton` takes for lm_head from 2 rows, where it measured
faster (bench/results/2026-11-25_h100_dense_mma.md). `stream_linear`, the library's CUDA-core
kernels, takes bf16 layers at one row of x and q/k/v and o at two, and FP8 layers at one row:
every weight load of a warp in flight at once, faster there than the Triton GEMV's
shared-memory pipeline and cuBLAS (bench/results/2026-11-26_session18.md; FP8:
bench/results/2026-11-27_h100_fp8_stream.md).

The Gluon pair GEMV spends ~5 instructions a weight on the CUDA cores. These kernels decode a
word of eight codes into four fp16 pairs with 11 integer operations in the pair kernels (16 in
the grouped ones, where the cheaper decode needs more registers) and leave the products to
`mma.sync`. gate_up runs here from 1 token a step, down from `down_min_tokens`: 1 on one GPU's
K and on TP 2's share, where one token's down is launched early behind gate_up (programmatic
dependent launch) and copies its weight rows into shared memory while gate_up runs
(bench/experiments/pdl_smem); 2 on narrower shares, where at 1 token Gluon's down is faster.
The library picks the tile by the step's pairs; above 8 pairs, and at one token on one GPU's
rows, gate_up streams its rows through shared memory (bench/results/2026-11-25_h100_mma_tiles.md;
at one token with the L2 fetching 256 bytes a miss), and so does down at 2 and at 5-8 tokens on
one GPU's K (bench/results/2026-11-28_session33.md).
Above GEMV_MAX_TOKENS the pairs are sorted by expert and cut into groups of up to 8 pairs of one
expert (one launch, `sort_pairs`); a program takes a group, one pair a column of the MMA,
reading the expert's rows once for them: faster than the grouped GEMMs (which dequantize to
bf16) up to GROUPED_MAX_TOKENS, and exact where those round to bf16. Above 16 tokens down
streams its rows through shared memory like the pair gate_up (more bytes in flight than
register loads; bench/results/2026-11-25_h100_grouped_mma.md and _grouped_stream.md). Products
agree with the fp32 Gluon kernel's to ~3e-7.

It is CUDA C++: nvcc builds it once a machine into a small shared library (no PyTorch headers,
a few seconds), cached by the source's hash under TINYOSS_CACHE (~/.cache/tinyoss), loaded with
ctypes and launched on PyTorch's current stream, so CUDA graphs capture it. Without nvcc, or on
a GPU other than sm_90, `load` says why and the Gluon kernel and the grouped GEMMs run instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from tinyoss.kernels import nvcc_build
from tinyoss.kernels.moe_torch import ExpertWeights

log = logging.getLogger("tinyoss")

GATE_UP_MIN_TOKENS = 1
DOWN_MIN_TOKENS = 2  # on TP 4's and 8's shares: at 1 token Gluon's down is faster
RESIDENT_MIN_K = 1440  # down's K from which one token's down runs here (TP 2's share)
GROUPED_MAX_TOKENS = 64  # measured faster than the grouped GEMMs up to here
GROUPED_ROWS = (192, 320, 192)  # rows a program: grouped gate_up (else 64), down, streamed down
SOURCE = Path(__file__).with_suffix(".cu")
_ARGS = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
         ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_long, ctypes.c_float,
         ctypes.c_float, ctypes.c_void_p]
_GROUPED_ARGS = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                 ctypes.c_void_p, ctypes.c_void_p, *_ARGS[3:]]


class SortedPairs(NamedTuple):
    """The pairs sorted by expert for the grouped kernels (int32 all): `sorted_ids` their expert
    ids in order, `order` the pair at each sorted position, `groups[g]` = start | count << 16
    for the g-th run of up to 8 pairs of one expert from sorted position start (-1 past the last
    group)."""

    sorted_ids: torch.Tensor
    order: torch.Tensor
    groups: torch.Tensor


class MmaGemv:
    """The built library's two launches, with the argument checks the kernels rely on."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.gate_up_fn, self.down_fn = lib.tinyoss_gate_up_mma, lib.tinyoss_down_mma
        for fn in (self.gate_up_fn, self.down_fn):
            fn.argtypes, fn.restype = _ARGS, ctypes.c_int
        self.grouped_fn = lib.tinyoss_grouped_mma
        self.grouped_fn.argtypes, self.grouped_fn.restype = _GROUPED_ARGS, ctypes.c_int
        self.sort_fn = lib.tinyoss_sort_pairs
        self.sort_fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        self.sort_fn.restype = ctypes.c_int
        self.dense_fn = lib.tinyoss_dense_mma
        self.dense_fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_void_p]
        self.dense_fn.restype = ctypes.c_int
        self.dense_gemv_fn = lib.tinyoss_dense_gemv_mma
        self.dense_gemv_fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                       ctypes.c_void_p]
        self.dense_gemv_fn.restype = ctypes.c_int
        self.stream_fn = lib.tinyoss_dense_gemv_stream
        self.stream_fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_void_p]
        self.stream_fn.restype = ctypes.c_int
        self.fp8_stream_fn = lib.tinyoss_fp8_gemv_stream
        self.fp8_stream_fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_int, ctypes.c_void_p]
        self.fp8_stream_fn.restype = ctypes.c_int
        self.ready_fn, self.error_fn = lib.tinyoss_mma_ready, lib.tinyoss_mma_error
        self.ready_fn.argtypes, self.ready_fn.restype = [], ctypes.c_int
        self.error_fn.argtypes, self.error_fn.restype = [ctypes.c_int], ctypes.c_char_p

    def error(self, err: int) -> str:
        """CUDA's name for an error code the library returned."""
        return f"CUDA error {err}: {self.error_fn(err).decode()}"

    def not_ready(self) -> str | None:
        """Why the kernels cannot load on this GPU and driver, or None when they can."""
        err = self.ready_fn()
        return self.error(err) if err else None

    @staticmethod
    def supports_gate_up(x: torch.Tensor, w: ExpertWeights) -> bool:
        """bf16 activations and biases, rows in 64s, K 2880 (gpt-oss's hidden size: every
        tile's K steps divide it, and x is staged for at most that), SwiGLU outputs that fit
        fp16 (|act| <= (limit + 1) * limit). A tensor-parallel rank's share of the rows too."""
        return (x.dtype == w.gate_up_bias.dtype == w.down_bias.dtype == torch.bfloat16
                and w.gate_up_blocks.shape[1] % 64 == 0 and w.gate_up_blocks.shape[2] * 32 == 2880
                and (w.limit + 1) * w.limit < 6e4)

    @staticmethod
    def supports_down(x: torch.Tensor, w: ExpertWeights) -> bool:
        """`supports_gate_up`, and down's K (the intermediate size) in whole scale blocks up to
        2880: a tensor-parallel rank's share too (45, 23 or 12 blocks at TP 2, 4, 8, where the
        pair kernel cuts its last load group)."""
        return (MmaGemv.supports_gate_up(x, w) and w.down_blocks.shape[1] % 64 == 0
                and 0 < w.down_blocks.shape[2] * 32 <= 2880)

    @staticmethod
    def down_min_tokens(w: ExpertWeights) -> int:
        """Tokens a step from which down runs here: 1 from RESIDENT_MIN_K (the early-launched
        resident down: one GPU's K, TP 2's share), else DOWN_MIN_TOKENS."""
        return 1 if w.down_blocks.shape[2] * 32 >= RESIDENT_MIN_K else DOWN_MIN_TOKENS

    @staticmethod
    def supports_grouped(x: torch.Tensor, w: ExpertWeights) -> bool:
        """Both projections (`supports_down`: a tensor-parallel rank's share too, where gate_up
        rows not in 192s take 64-row programs and down's K in no whole load groups cuts the
        last one), down's rows in GROUPED_ROWS, and x's rows 16-byte aligned (read 8 values a
        load)."""
        return (MmaGemv.supports_down(x, w) and x.data_ptr() % 16 == 0
                and w.down_blocks.shape[1] % GROUPED_ROWS[1] == 0
                and w.down_blocks.shape[1] % GROUPED_ROWS[2] == 0)

    @staticmethod
    def supports_dense(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None) -> bool:
        """A dense MXFP4 layer these kernels take: bf16 x [M, 2880] and bias, rows in 64s,
        contiguous blocks and scales (q/k/v and lm_head of gpt-oss; o, K 4096, is faster on the
        Triton GEMV)."""
        n, nblk = blocks.shape[:2]
        return (x.dtype == torch.bfloat16 and x.dim() == 2 and nblk * 32 == 2880 == x.shape[1]
                and n % 64 == 0 and blocks.is_contiguous() and scales.is_contiguous()
                and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())))

    def dense(self, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] bf16 @ W.T (+ bias) -> [M, N] bf16 (fp32 sums, rounded once), W the MXFP4
        `blocks` [N, K/32, 16] and `scales` [N, K/32] (`supports_dense`): each row of x is a
        pair of one expert."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.bfloat16, device=x.device)
        if x.shape[0] == 0:
            return out
        err = self.dense_fn(x.data_ptr(), x.shape[0], blocks.data_ptr(), scales.data_ptr(),
                            None if bias is None else bias.data_ptr(), out.data_ptr(),
                            blocks.shape[0], blocks.shape[1] * 32, blocks.stride(0),
                            torch.cuda.current_stream(x.device).cuda_stream)
        if err:
            raise RuntimeError(f"the tensor-core MXFP4 GEMV failed to launch: {self.error(err)} "
                               f"(N {blocks.shape[0]}, K {blocks.shape[1] * 32}, "
                               f"rows {x.shape[0]})")
        return out

    @staticmethod
    def supports_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                        bias: torch.Tensor | None) -> bool:
        """A bf16 or FP8 (e4m3, fp32 `scale` a row) dense layer `linear` takes: bf16 x of 1-8
        contiguous rows, K in 64s, rows in 64s (q/k/v, o and lm_head of gpt-oss; not the
        router's 32)."""
        n, k = weight.shape
        fp8 = weight.dtype == torch.float8_e4m3fn
        return (x.dtype == torch.bfloat16 and x.dim() == 2 and 1 <= x.shape[0] <= 8
                and x.shape[1] == k and k % 64 == 0 and n % 64 == 0 and weight.is_contiguous()
                and (fp8 or weight.dtype == torch.bfloat16)
                and (scale is not None) == fp8
                and (scale is None or (scale.dtype == torch.float32 and scale.is_contiguous()))
                and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ W.T (* scale) (+ bias) -> [M, N] bf16 for 1-8 rows of x
        (`supports_linear`): each row a column of the MMA, the weights read once for all."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16, device=x.device)
        err = self.dense_gemv_fn(int(scale is not None), x.data_ptr(), x.shape[0],
                                 weight.data_ptr(), None if scale is None else scale.data_ptr(),
                                 None if bias is None else bias.data_ptr(), out.data_ptr(),
                                 weight.shape[0], weight.shape[1],
                                 torch.cuda.current_stream(x.device).cuda_stream)
        if err:
            raise RuntimeError(f"the tensor-core dense GEMV failed to launch: {self.error(err)} "
                               f"({tuple(weight.shape)} {weight.dtype}, rows {x.shape[0]})")
        return out

    @staticmethod
    def supports_stream(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        scale: torch.Tensor | None = None) -> bool:
        """A dense layer `stream_linear` takes: a contiguous 2-D weight of at least one row,
        bf16 with 1-2 rows of x and K in 8s from 8 to 4096, or FP8 (e4m3, `scale` one fp32 value
        a row) with one row of x and K in 16s from 16 to 4096 (a 16-byte load holds 8 or 16
        weights); contiguous bf16 rows of x; x and the weight 16-byte aligned; a bias of one
        bf16 value a row or none; all on x's device."""
        if weight.dim() != 2:
            return False
        n, k = weight.shape
        fp8 = weight.dtype == torch.float8_e4m3fn
        per_load, max_rows = (16, 1) if fp8 else (8, 2)

        def a_row_each(t: torch.Tensor, dtype: torch.dtype) -> bool:
            return (t.dtype == dtype and t.shape == (n,) and t.is_contiguous()
                    and t.device == x.device)

        return ((fp8 or weight.dtype == torch.bfloat16) and x.dtype == torch.bfloat16
                and x.dim() == 2 and 1 <= x.shape[0] <= max_rows and x.shape[1] == k
                and x.is_contiguous() and weight.is_contiguous() and n >= 1
                and k % per_load == 0 and per_load <= k <= 4096 and x.device == weight.device
                and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
                and (scale is not None) == fp8
                and (scale is None or a_row_each(scale, torch.float32))
                and (bias is None or a_row_each(bias, torch.bfloat16)))

    def stream_linear(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None,
                      scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ W.T (* scale) (+ bias) -> [M, N] bf16 (`supports_stream`: 1-2 rows of x
        for bf16 W, one for FP8 W and its row scales) on the CUDA cores, fp32 sums, every weight
        load of a warp in flight at once, the weights read once."""
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16, device=x.device)
        b = None if bias is None else bias.data_ptr()
        stream = torch.cuda.current_stream(x.device).cuda_stream
        if scale is None:
            err = self.stream_fn(x.data_ptr(), x.shape[0], weight.data_ptr(), b, out.data_ptr(),
                                 weight.shape[0], weight.shape[1], stream)
        else:
            err = self.fp8_stream_fn(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), b,
                                     out.data_ptr(), weight.shape[0], weight.shape[1], stream)
        if err:
            raise RuntimeError(f"the streaming dense GEMV failed to launch: {self.error(err)} "
                               f"({tuple(weight.shape)} {weight.dtype}, rows {x.shape[0]})")
        return out

    def sort_pairs(self, ids: torch.Tensor, experts: int) -> SortedPairs:
        """int32 expert ids [pairs] (each below `experts`, or -1 for a pair another rank holds:
        those sort first and their groups' programs return) sorted as a stable `torch.sort`
        sorts them, with their groups, in one launch."""
        if ids.dtype != torch.int32 or not ids.is_contiguous() or not 0 < ids.numel() <= 4096:
            raise ValueError(f"1 to 4096 contiguous int32 ids expected, got {ids.dtype} "
                             f"{tuple(ids.shape)}")
        pairs = ids.numel()
        # an id's n pairs make ceil(n / 8) <= n // 8 + 1 groups; the ids: experts and -1
        groups = torch.empty(min(pairs, pairs // 8 + experts + 1), dtype=torch.int32,
                             device=ids.device)
        sorted_ids, order = torch.empty_like(ids), torch.empty_like(ids)
        err = self.sort_fn(ids.data_ptr(), pairs, sorted_ids.data_ptr(), order.data_ptr(),
                           groups.data_ptr(), groups.numel(),
                           torch.cuda.current_stream(ids.device).cuda_stream)
        if err:
            raise RuntimeError(f"sorting the MoE pairs failed to launch: {self.error(err)}")
        return SortedPairs(sorted_ids, order, groups)

    def grouped(self, x: torch.Tensor, x_div: int, by_expert: SortedPairs,
                blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor,
                wts: torch.Tensor, out: torch.Tensor, alpha: float, limit: float,
                swiglu: bool) -> None:
        """The pairs sorted by expert (`sort_pairs`): gate_up (`swiglu`: out [pairs, N/2] =
        SwiGLU(W_e x[pair // x_div] + b_e)) or down (out [pairs, N] = wts[pair] * (W_e x[pair] +
        b_e)), e the pair's expert."""
        if any(t.dtype != torch.int32 for t in by_expert):
            raise ValueError(f"sorted pairs must be int32, got {[t.dtype for t in by_expert]}")
        if x.data_ptr() % 16:
            raise ValueError("x must start 16-byte aligned")
        lead = (by_expert.groups.data_ptr(), by_expert.groups.numel(),
                by_expert.sorted_ids.data_ptr())
        self._launch(functools.partial(self.grouped_fn, int(swiglu)), x, x_div, by_expert.order,
                     blocks, scales, bias, wts, out, alpha, limit, lead)

    def gate_up(self, x: torch.Tensor, x_div: int, ids: torch.Tensor, blocks: torch.Tensor,
                scales: torch.Tensor, bias: torch.Tensor, wts: torch.Tensor, act: torch.Tensor,
                alpha: float, limit: float) -> None:
        """act [pairs, N/2] fp32 = SwiGLU(W_e x[pair // x_div] + b_e), e = ids[pair]."""
        self._launch(self.gate_up_fn, x, x_div, ids, blocks, scales, bias, wts, act, alpha,
                     limit)

    def down(self, act: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor,
             scales: torch.Tensor, bias: torch.Tensor, wts: torch.Tensor, y: torch.Tensor,
             alpha: float, limit: float) -> None:
        """y [pairs, N] fp32 = wts[pair] * (W_e act[pair] + b_e)."""
        self._launch(self.down_fn, act, 1, ids, blocks, scales, bias, wts, y, alpha, limit)

    def _launch(self, fn, x, x_div, ids, blocks, scales, bias, wts, out, alpha, limit,
                lead: tuple = ()) -> None:
        """fn(x, x_div, *lead, ids, pairs, ...) on the current stream: `ids` the pairs' expert
        ids, or for the grouped kernel their sorted order (`lead` its groups and sorted ids)."""
        if ids.dtype != torch.int32 or bias.dtype != torch.bfloat16 or wts.dtype != torch.float32:
            raise ValueError(f"ids int32, bias bfloat16 and weights float32 expected, got "
                             f"{ids.dtype}, {bias.dtype}, {wts.dtype}")
        for name, t in (("x", x), ("ids", ids), ("blocks", blocks), ("scales", scales),
                        ("bias", bias), ("weights", wts), ("out", out)):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        pairs, n, k = ids.numel(), blocks.shape[1], blocks.shape[2] * 32
        if pairs == 0:
            return
        err = fn(x.data_ptr(), x_div, *lead, ids.data_ptr(), pairs, blocks.data_ptr(),
                 scales.data_ptr(), bias.data_ptr(), wts.data_ptr(), out.data_ptr(), n, k,
                 blocks.stride(0), blocks.stride(1), scales.stride(0), alpha, limit,
                 torch.cuda.current_stream(x.device).cuda_stream)
        if err:
            raise RuntimeError(f"the tensor-core MoE GEMV failed to launch: {self.error(err)} "
                               f"(N {n}, K {k}, pairs {pairs})")


def _nvcc() -> str | None:
    return nvcc_build.find_nvcc()


def _build(nvcc: str) -> Path:
    return nvcc_build.build(nvcc, SOURCE, "the tensor-core MoE GEMV")


@functools.cache
def load(capability: tuple[int, int] | None) -> tuple[MmaGemv | None, str]:
    """(the kernels, why) on a GPU of `capability`; (None, why not) when they cannot run."""
    if capability != (9, 0):
        return None, "it is built for sm_90 (Hopper) only"
    nvcc = _nvcc()
    if nvcc is None:
        return None, "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    try:
        kernels = MmaGemv(ctypes.CDLL(str(_build(nvcc))))
    except (OSError, RuntimeError) as e:
        return None, f"its build failed: {e}"
    if why := kernels.not_ready():
        return None, f"built with {nvcc}, but it does not load on this GPU and driver ({why})"
    return kernels, f"built with {nvcc}"
