"""`moe_cutlass` (FlashInfer's CUTLASS fused MoE) against `moe_torch` at gpt-oss-20b shapes
(32 experts, hidden = intermediate = 2880, top-4: the padded 2944 path), T in 1, 8, 64; then
autotuned and replayed in a CUDA graph, as the engine runs it.

Skipped without CUDA, without flashinfer, or on a GPU FlashInfer's CUTLASS MXFP4 MoE has no build
for. The first run JIT-builds FlashInfer's fused-MoE module for the GPU (SM90: tinyoss's reduced
build, 20 CUDA sources, ~6 minutes on 16 cores); later runs load it from ~/.cache/flashinfer.

Tolerance, ||cutlass - torch|| / ||torch|| (the reference runs in float32 on the same bf16 inputs):
"w4a16" (Hopper) 2e-2: bf16 activations and fp32 accumulation, the SwiGLU output rounded to bf16
before the second GEMM and the result to bf16 (~0.5% expected). "mxfp8" (Blackwell-class) 8e-2:
activations quantized to FP8 E4M3 with one scale per 32 values (~3-4% per element).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tinyoss.kernels.hardware import capability, cutlass_moe_variant, sm_name
from tinyoss.kernels.moe_torch import ExpertWeights, moe_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]

E, H, INTER, K = 32, 2880, 2880, 4
TOL = {"w4a16": 2e-2, "mxfp8": 8e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def setup():
    variant = cutlass_moe_variant()
    if variant is None:
        pytest.skip(f"FlashInfer has no CUTLASS MXFP4 MoE build for {sm_name(capability())}")
    from tinyoss.kernels.moe_cutlass import prepare_cutlass

    g = torch.Generator("cuda").manual_seed(0)
    dev = torch.device("cuda")

    def blocks(*shape):
        return torch.randint(0, 256, shape, generator=g, device=dev, dtype=torch.uint8)

    def scales(*shape):  # 2^-8 .. 2^-4: gate/up pre-activations of a few units, some clamped
        return torch.randint(119, 124, shape, generator=g, device=dev, dtype=torch.uint8)

    def bias(*shape):
        return (torch.randn(*shape, generator=g, device=dev) * 0.1).to(torch.bfloat16)

    w = ExpertWeights(blocks(E, 2 * INTER, H // 32, 16), scales(E, 2 * INTER, H // 32),
                      bias(E, 2 * INTER),
                      blocks(E, H, INTER // 32, 16), scales(E, H, INTER // 32), bias(E, H))
    prepared = prepare_cutlass(w, variant=variant, max_num_tokens=64)
    return variant, w, prepared


def _inputs(t: int, seed: int):
    g = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(t, H, generator=g, device="cuda").to(torch.bfloat16)
    top, ids = torch.randn(t, E, generator=g, device="cuda").topk(K, dim=-1)
    return x, torch.softmax(top, dim=-1), ids


@pytest.mark.parametrize("t", [1, 8, 64])
def test_cutlass_matches_torch(setup, t):
    from tinyoss.kernels.moe_cutlass import moe_cutlass

    variant, w, prepared = setup
    x, topk_weights, topk_ids = _inputs(t, seed=t)
    got = moe_cutlass(x, topk_weights, topk_ids, prepared)
    want = moe_torch(x, topk_weights, topk_ids, w)
    assert got.shape == (t, H) and got.dtype == torch.bfloat16
    assert torch.isfinite(got).all()
    assert _rel(got, want) < TOL[variant], _rel(got, want)


def test_cutlass_skips_pairs_held_by_another_rank(setup):
    """Expert parallelism hands the kernel the pairs whose experts another rank holds as id -1:
    FlashInfer's routing and finalize leave ids outside [0, E) out, as `moe_torch` does."""
    from tinyoss.kernels.moe_cutlass import moe_cutlass

    variant, w, prepared = setup
    x, topk_weights, topk_ids = _inputs(8, seed=11)
    away = torch.rand(topk_ids.shape, generator=torch.Generator().manual_seed(0)) < 0.5
    topk_ids = torch.where(away.cuda(), -1, topk_ids)
    got = moe_cutlass(x, topk_weights, topk_ids, prepared)
    want = moe_torch(x, topk_weights, topk_ids, w)
    assert _rel(got, want) < TOL[variant], _rel(got, want)


def test_every_expert_autotuned_and_in_a_cuda_graph(setup):
    from tinyoss.engine.builder import uniform_routing
    from tinyoss.kernels.moe_cutlass import autotuning, moe_cutlass

    variant, w, prepared = setup
    x, _, _ = _inputs(64, seed=7)
    ids = uniform_routing(64, K, E, x.device)  # every expert gets tokens
    weights = torch.full(ids.shape, 1 / K, device="cuda")
    with autotuning():
        moe_cutlass(x, weights, ids, prepared)
    want = moe_torch(x, weights, ids, w)
    eager = moe_cutlass(x, weights, ids, prepared)
    assert _rel(eager, want) < TOL[variant], _rel(eager, want)
    x8, w8, ids8 = _inputs(8, seed=8)
    moe_cutlass(x8, w8, ids8, prepared)  # warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_cutlass(x8, w8, ids8, prepared)
    x8.copy_(_inputs(8, seed=9)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, moe_torch(x8, w8, ids8, w)) < TOL[variant]
