"""A smaller build of FlashInfer's SM90 CUTLASS fused MoE: only what gpt-oss on Hopper runs.

FlashInfer 0.7.2's `gen_cutlass_fused_moe_sm90_module` JIT-compiles ~248 CUDA sources (220
generated CUTLASS kernel files, every activation/weight dtype pair), each heavy file several GB
of compiler memory. tinyoss needs one pair, bf16 activations x MXFP4 weights (W4A16 group
scaling, `moe_cutlass`'s "w4a16"), and of its 184 GEMM tiles only those whose K tile divides
gpt-oss's padded K (2944 = 23 x 128): K tile 128, 44 kernels, plus the one FlashInfer launches
to size its workspace. This module builds that: 20 translation units (6 of them CUTLASS
kernels), minutes instead of the full build's hour, and plugs it into FlashInfer's own Python,
so `cutlass_fused_moe`, the weight interleave and the autotuner are unchanged.

Three files are tinyoss's: a copy of FlashInfer's binding whose runner selection keeps only
`CutlassMoeFCRunner<bf16, Fp4Type>` (the patch fails loudly if the source moves), a one-runner
instantiation file, and a stub file giving the other 139 tiles the dispatcher references a body
that raises (the autotuner skips tactics that raise; for gpt-oss's K they are never offered).
Everything else is FlashInfer's source and its kernel generator.

Built and verified on the H100 (tests/test_moe_cutlass_gpu.py; build time in
bench/results/2026-11-23_h100_moe_kernels_d4beb31.txt).
"""

from __future__ import annotations

import functools
from pathlib import Path

MODULE_NAME = "tinyoss_fused_moe_90_w4a16"
KERNELS_PER_FILE = 8  # FlashInfer's own grouping of generated kernels
MIXED_LAUNCHER = (
    "tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/"
    "moe_gemm_tma_ws_mixed_input_launcher.inl"
)
STUB_HEADER = "tinyoss_mixed_moe_stub.h"

_RUNNERS_BEGIN = (
    "    // keep consistent with cpp/tensorrt_llm/plugins/mixtureOfExperts/"
    "mixtureOfExpertsPlugin.cpp\n"
)
_RUNNERS_END = "    if (!mKernelRunner) {\n"
_ONE_RUNNER = """\
    // tinyoss reduced build: only bf16 activations x MXFP4 (uint8, W4A16 group scaling) on SM90.
    if (isWFP4A16Quant() && mActivationDtype == dl_bfloat16 && mOutputDtype == dl_bfloat16) {
      mInnerDimMultiplier = 2;
      mKernelRunner =
          std::make_shared<kernels::CutlassMoeFCRunner<__nv_bfloat16, kernels::Fp4Type>>();
    }
"""
_INSTANTIATION = """\
// tinyoss reduced build of cutlass_fused_moe_instantiation.cu: one runner only.
#include "cutlass_fused_moe_kernels.cuh"
#include "moe_kernels.h"

namespace tensorrt_llm::kernels::cutlass_kernels {
template class CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>;
INSTANTIATE_FINALIZE_MOE_ROUTING(__nv_bfloat16, __nv_bfloat16, __nv_bfloat16);
}  // namespace tensorrt_llm::kernels::cutlass_kernels
"""
_STUB = """\
// tinyoss reduced build: a body that raises for the SM90 mixed-input MoE GEMM launcher, explicitly
// instantiated for the tiles the dispatcher references but the build leaves out.
#pragma once
#include "cute/tensor.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass_extensions/epilogue_helpers.h"
#include "tensorrt_llm/common/assert.h"
#include "tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/moe_gemm_tma_ws_mixed_input_launcher.h"

namespace tensorrt_llm {
namespace kernels {
namespace cutlass_kernels_oss {
using namespace tensorrt_llm::kernels::cutlass_kernels;
#ifdef ENABLE_FP4
using SafeFP4 = Fp4Type;
#else
struct SafeFP4 {};
#endif
template <typename T, typename WeightType, typename GemmOutputType, typename EpilogueTag,
          typename CTAShape, typename ClusterShape, typename MainloopScheduleType,
          typename EpilogueScheduleType, cutlass::WeightOnlyQuantOp QuantOp,
          cutlass::gemm::collective::MixedInputScaleMode ScaleMode>
void sm90_generic_mixed_moe_gemm_kernelLauncher(
    GroupedGemmInput<T, WeightType, GemmOutputType, GemmOutputType> inputs,
    TmaWarpSpecializedGroupedGemmInput hopper_inputs, int sm_count_, size_t* workspace_size) {
  TLLM_THROW("tinyoss: this SM90 MXFP4 MoE GEMM tile is not compiled in the reduced build");
}
}  // namespace cutlass_kernels_oss
}  // namespace kernels
}  // namespace tensorrt_llm
"""  # noqa: E501 - a C++ #include path, which cannot be cut


def one_runner_binding(source: str) -> str:
    """FlashInfer's fused-MoE binding with its runner selection cut to bf16 x MXFP4."""
    if source.count(_RUNNERS_BEGIN) != 1 or source.count(_RUNNERS_END) != 1:
        raise RuntimeError(
            "FlashInfer's flashinfer_cutlass_fused_moe_binding.cu changed: tinyoss's reduced SM90 "
            "MoE build cannot find its runner selection; use --mxfp4-backend triton, or update "
            "tinyoss/kernels/moe_cutlass_sm90_build.py for this FlashInfer"
        )
    begin, end = source.index(_RUNNERS_BEGIN), source.index(_RUNNERS_END)
    return source[:begin] + _ONE_RUNNER + source[end:]


def keep_tile(cta: tuple[int, int, int], cluster: tuple[int, int, int], cooperative: bool) -> bool:
    """Whether a bf16 x MXFP4 tile is compiled for real. FlashInfer offers only tiles whose K
    divides the GEMM's K (gpt-oss: 2944 = 23 x 128, so K tile 128), each with one schedule
    (cooperative where it supports it, else ping-pong); 128x64x256 cooperative 1x1x1 is what
    FlashInfer launches to size its workspace."""
    m, n, k = cta
    if cta == (128, 64, 256) and cooperative and cluster == (1, 1, 1):
        return True
    cooperative_supported = m >= 128 and not (m == 128 and n >= 128 and k == 512)
    return k == 128 and cooperative == cooperative_supported


def _write(path: Path, text: str) -> Path:
    """Writes only on change, so the build does not redo an unchanged file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def _kernel_sources(out: Path) -> list[Path]:
    """FlashInfer's generator, for the bf16 x MXFP4 tiles: kept ones in files of 8 by M tile,
    the rest in one stub file."""
    from flashinfer.jit.gemm.cutlass import generate_kernels as gk
    from flashinfer.jit.gemm.cutlass.cutlass_library import DataType, KernelScheduleType

    ops = [
        op
        for op in gk.generate_sm90_mixed_type_grouped_gemm_operations(True)
        if op.act_type == DataType.bf16 and op.weight_type == gk.e2m1
    ]
    kept = {
        id(op)
        for op in ops
        if keep_tile(tuple(op.cta_shape), tuple(op.cga_shape),
                     op.mainloop_schedule == KernelScheduleType.TmaWarpSpecializedCooperative)
    }
    by_m: dict[int, list] = {}
    for op in ops:
        if id(op) in kept:
            by_m.setdefault(op.cta_shape[0], []).append(op)
    _write(out / STUB_HEADER, _STUB)  # found by the stub file's quoted include
    files = []
    for m, group in sorted(by_m.items()):
        for i in range(0, len(group), KERNELS_PER_FILE):
            path = out / f"w4a16_sm90_M{m}_group{i // KERNELS_PER_FILE}.generated.cu"
            gk.write_file([MIXED_LAUNCHER], group[i : i + KERNELS_PER_FILE], str(path))
            files.append(path)
    stubs = [op for op in ops if id(op) not in kept]
    if stubs:
        path = out / "w4a16_sm90_stubs.generated.cu"
        gk.write_file([STUB_HEADER], stubs, str(path))
        files.append(path)
    for old in out.glob("*.generated.cu"):
        if old not in files:
            old.unlink()
    return files


class _Module:
    """The loaded module, plus the one call FlashInfer's wrapper always makes that this build
    has nothing for (DeepGEMM's JIT include dirs: FP8 block scaling is not built)."""

    def __init__(self, module) -> None:
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)

    def set_deepgemm_jit_include_dirs(self, _dirs) -> None:
        pass


def jit_spec():
    """FlashInfer's JitSpec of the reduced module (same flags and defines as its SM90 build:
    shared headers change struct layouts with them, so every file must see the same set)."""
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.core import gen_jit_spec, sm90a_nvcc_flags
    from flashinfer.jit.cpp_ext import is_cuda_version_at_least

    csrc = jit_env.FLASHINFER_CSRC_DIR
    nv = csrc / "nv_internal"
    tk = nv / "tensorrt_llm/kernels/cutlass_kernels"
    out = jit_env.FLASHINFER_GEN_SRC_DIR / MODULE_NAME
    binding_src = csrc / "fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu"
    binding = _write(out / "tinyoss_w4a16_moe_binding.cu",
                     one_runner_binding(binding_src.read_text()))
    instantiation = _write(out / "tinyoss_w4a16_moe_instantiation.cu", _INSTANTIATION)
    sources = [
        binding,
        instantiation,
        *_kernel_sources(out / "kernels"),
        tk / "moe_gemm/moe_gemm_kernels_bf16_fp4.cu",  # MoeGemmRunner<bf16, Fp4, bf16>
        tk / "moe_gemm/moe_gemm_tma_warp_specialized_input.cu",
        tk / "moe_gemm/moe_gemm_mixed_utils.cu",  # the SM90 mixed-GEMM weight interleave
        nv / "tensorrt_llm/kernels/preQuantScaleKernel.cu",
        nv / "cpp/common/memoryUtils.cu",
        nv / "cpp/common/envUtils.cpp",
        nv / "cpp/common/logger.cpp",
        nv / "cpp/common/stringUtils.cpp",
        nv / "cpp/common/tllmException.cpp",
        tk / "cutlass_heuristic.cpp",
        nv / "tensorrt_llm/kernels/lora/lora.cpp",  # the runner references Lora_run
    ]
    flags = sm90a_nvcc_flags + [
        "-DCOMPILE_HOPPER_TMA_GEMMS",
        "-DCOMPILE_HOPPER_TMA_GROUPED_GEMMS",
        "-DENABLE_BF16",
        "-DENABLE_FP8",
        *(["-DENABLE_FP8_BLOCK_SCALE"] if is_cuda_version_at_least("12.8") else []),
        "-DENABLE_FP4",
        "-DUSING_OSS_CUTLASS_MOE_GEMM",
        "-DCUTLASS_ENABLE_GDC_FOR_SM90=1",
        "-DCUTLASS_MIXED_GEMM_FP4_FP8_PREPROCESSED_SIGNS=1",
    ]
    return gen_jit_spec(
        MODULE_NAME,
        sources,
        extra_cuda_cflags=flags,
        extra_cflags=[],
        extra_ldflags=[],  # no -lnvrtc: DeepGEMM's JIT is not built
        extra_include_paths=[
            nv,
            nv / "include",
            nv / "tensorrt_llm/cutlass_extensions/include",
            tk / "include",
            tk,
            csrc / "fused_moe/cutlass_backend",  # cutlass_fused_moe_kernels.cuh
        ],
        post_load_adapter=_Module,
    )


@functools.cache
def install() -> None:
    """Makes FlashInfer's SM90 CUTLASS MoE (`cutlass_fused_moe`, the weight interleave) load
    the reduced module. Idempotent; must run before FlashInfer first loads the module."""
    import flashinfer.fused_moe.core as core

    core.gen_cutlass_fused_moe_sm90_module = lambda use_fast_build=False: jit_spec()
    core.get_cutlass_fused_moe_module.cache_clear()
