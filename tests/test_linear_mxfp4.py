"""Triton MXFP4 linear (GEMV and GEMM paths) against the `mxfp4_linear_torch` reference.

On CPU the kernels run in the Triton interpreter in fp32 and agree with the reference to fp32
rounding (~1e-7 relative measured; TOL 1e-5). Small shapes with ragged tails: N = 40 against
row tiles of 16, K = 160 against K tiles of 64, M = 3 and 17 against token tiles of 4 and 16.
Outputs start as NaN, so a row nobody wrote shows. The GPU tests (skipped without CUDA) run the
real gpt-oss shapes in bf16, and one decode-size call inside a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tinyoss.kernels import linear_mxfp4_triton as lt
from tinyoss.kernels.linear_mxfp4_torch import mxfp4_linear_torch
from tinyoss.model import mxfp4

CUDA = torch.cuda.is_available()
# The small fp32 cases check kernel logic in the interpreter; on a GPU the real shapes below run.
interpreter = pytest.mark.skipif(CUDA, reason="small fp32 cases run in the Triton interpreter")
TOL = 1e-5  # ||out - ref|| / ||ref||, fp32 in the interpreter
GPU_TOL = 1e-2  # bf16 activations and outputs
N, K = 40, 160
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

SMALL = {
    "gemv": lambda x, b, s, bias: lt.linear_gemv(
        x, b, s, bias, lt.GemvConfig(block_m=4, block_n=16, block_k=64)
    ),
    "gemv_m1": lambda x, b, s, bias: lt.linear_gemv(
        x, b, s, bias, lt.GemvConfig(block_m=1, block_n=16, block_k=64)
    ),
    "gemm": lambda x, b, s, bias: lt.linear_gemm(
        x, b, s, bias, lt.GemmConfig(block_m=16, block_n=16, block_k=64, num_warps=4)
    ),
    "default": lt.mxfp4_linear,
}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(
        lt,
        "_empty",
        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device),
    )


def weights(
    n: int, k: int, seed: int = 0, device: str = "cpu", std: float = 0.05
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks, scales, bias) of a random [n, k] weight quantized with `mxfp4.quantize`."""
    gen = torch.Generator(device).manual_seed(seed)  # made where used: lm_head's is 579M values
    blocks, scales = mxfp4.quantize(torch.randn(n, k, generator=gen, device=device) * std)
    return blocks, scales, torch.randn(n, generator=gen, device=device)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@interpreter
@pytest.mark.parametrize("path", sorted(SMALL))
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_reference(path: str, m: int, with_bias: bool) -> None:
    blocks, scales, bias = weights(N, K, seed=m)
    bias = bias if with_bias else None
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(100 + m))
    out = SMALL[path](x, blocks, scales, bias)
    ref = mxfp4_linear_torch(x, blocks, scales, bias)
    assert out.shape == (m, N) and out.dtype == x.dtype
    assert not out.isnan().any()
    assert rel(out, ref) < TOL


@interpreter
@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_wide_dynamic_range(path: str) -> None:
    """Tiny weights (scale bytes far below 127) and large activations keep full precision."""
    blocks, scales, bias = weights(N, K, std=1e-4)
    x = 300 * torch.randn(2, K, generator=torch.Generator().manual_seed(5))
    ref = mxfp4_linear_torch(x, blocks, scales, bias)
    out = SMALL[path](x, blocks, scales, bias)
    assert rel(out, ref) < TOL


def test_no_rows() -> None:
    blocks, scales, bias = weights(N, K)
    assert lt.mxfp4_linear(torch.empty(0, K), blocks, scales, bias).shape == (0, N)


def test_bad_shapes_name_the_tensor() -> None:
    blocks, scales, bias = weights(N, K)
    with pytest.raises(ValueError, match="x must be"):
        lt.mxfp4_linear(torch.randn(1, K + 32), blocks, scales, bias)
    with pytest.raises(ValueError, match="bias must be"):
        lt.mxfp4_linear(torch.randn(1, K), blocks, scales, bias[1:])
    with pytest.raises(ValueError, match="scales"):
        lt.mxfp4_linear(torch.randn(1, K), blocks, scales[1:], bias)
    with pytest.raises(TypeError, match="uint8"):
        lt.mxfp4_linear(torch.randn(1, K), blocks.int(), scales, bias)


def test_default_tiles() -> None:
    """All decode tokens share each weight tile; small layers get more, narrower programs."""
    assert lt.gemv_config(1, 201088) == lt.GemvConfig(block_m=1, block_n=16, block_k=512)
    assert lt.gemv_config(3, 2880).block_m == 4 and lt.gemv_config(3, 2880).block_n == 4
    assert lt.gemm_config(5).block_m == 16 and lt.gemm_config(100).num_warps == 4
    assert lt.gemm_config(5000).block_m == 128


# -- GPU: real shapes, bf16 ------------------------------------------------------------------

REAL = {"qkv": (5120, 2880), "o": (2880, 4096), "lm_head": (201088, 2880)}


@gpu
@pytest.mark.parametrize("layer", sorted(REAL))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 64, 300])
def test_real_shapes_gpu(layer: str, m: int) -> None:
    n, k = REAL[layer]
    blocks, scales, bias = weights(n, k, seed=m, device="cuda", std=0.02)
    bias = bias.to(torch.bfloat16) if layer != "lm_head" else None
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    out = lt.mxfp4_linear(x, blocks, scales, bias)
    ref = mxfp4_linear_torch(x.float(), blocks, scales, bias)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel(out, ref) < GPU_TOL


@gpu
@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_both_paths_any_m_gpu(path: str) -> None:
    blocks, scales, bias = weights(2880, 2880, device="cuda", std=0.02)
    fn = {"gemv": lt.linear_gemv, "gemm": lt.linear_gemm}[path]
    for m in (1, 5, 33):
        x = torch.randn(m, 2880, device="cuda").to(torch.bfloat16)
        ref = mxfp4_linear_torch(x.float(), blocks, scales, bias)
        assert rel(fn(x, blocks, scales, bias.to(torch.bfloat16)), ref) < GPU_TOL


@gpu
def test_cuda_graph_replay_gpu() -> None:
    blocks, scales, bias = weights(5120, 2880, device="cuda", std=0.02)
    bias = bias.to(torch.bfloat16)
    x = torch.randn(1, 2880, device="cuda").to(torch.bfloat16)
    eager = lt.mxfp4_linear(x, blocks, scales, bias)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lt.mxfp4_linear(x, blocks, scales, bias)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, mxfp4_linear_torch(x.float(), blocks, scales, bias)) < GPU_TOL
    assert not torch.equal(out, eager)


# -- the tensor-core GEMV (moe_gemv_mma) on dense layers ---------------------------------------


@pytest.mark.skipif(CUDA, reason="CPU tensors through the Triton kernels: the interpreter's")
def test_tensor_core_gemv_takes_the_layers_it_supports() -> None:
    """q/k/v and lm_head (K 2880, rows in 64s, bf16) go to `mma.dense` up to GEMV_MAX_M rows;
    o (K 4096), fp32 activations or biases, and prefill-sized M stay on the Triton kernels
    (on CPU: the interpreter runs those)."""
    from tinyoss.kernels.moe_gemv_mma import MmaGemv

    meta = "meta"
    x = torch.empty(1, 2880, dtype=torch.bfloat16, device=meta)
    qkv = (torch.empty(5120, 90, 16, dtype=torch.uint8, device=meta),
           torch.empty(5120, 90, dtype=torch.uint8, device=meta))
    bias = torch.empty(5120, dtype=torch.bfloat16, device=meta)
    assert MmaGemv.supports_dense(x, *qkv, bias) and MmaGemv.supports_dense(x, *qkv, None)
    assert not MmaGemv.supports_dense(x.float(), *qkv, bias)
    assert not MmaGemv.supports_dense(x, *qkv, bias.float())
    o = (torch.empty(2880, 128, 16, dtype=torch.uint8, device=meta),
         torch.empty(2880, 128, dtype=torch.uint8, device=meta))
    assert not MmaGemv.supports_dense(torch.empty(1, 4096, dtype=torch.bfloat16, device=meta),
                                      *o, None)

    class Recorder:
        def __init__(self, supported: bool) -> None:
            self.supported, self.calls = supported, []

        def supports_dense(self, x, blocks, scales, bias) -> bool:
            return self.supported

        def dense(self, x, blocks, scales, bias):
            self.calls.append(x.shape[0])
            return mxfp4_linear_torch(x, blocks, scales, bias)

    blocks, scales, bias = weights(N, K)
    for m, supported, want in ((1, True, [1]), (lt.GEMV_MAX_M, True, [lt.GEMV_MAX_M]),
                               (lt.GEMV_MAX_M + 1, True, []), (1, False, [])):
        fake = Recorder(supported)
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
        out = lt.mxfp4_linear(x, blocks, scales, bias, mma=fake)
        assert fake.calls == want and out.dtype == x.dtype and out.shape == (m, N)
        assert rel(out, mxfp4_linear_torch(x, blocks, scales, bias)) < TOL


@gpu
@pytest.mark.parametrize("layer", ["qkv", "lm_head"])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_tensor_core_gemv_real_shapes_gpu(layer: str, m: int, mma) -> None:
    """bf16 outputs within one bf16 step of the fp32 reference on the bf16 activations (x is
    staged exactly, codes decode exactly, sums in fp32, one rounding), with and without bias;
    through `mxfp4_linear`, also replayed from a CUDA graph on new inputs."""
    n, k = REAL[layer]
    blocks, scales, bias = weights(n, k, seed=m, device="cuda", std=0.02)
    bias = bias.to(torch.bfloat16) if layer == "qkv" else None
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ref = mxfp4_linear_torch(x.float(), blocks, scales, bias)
    got = mma.dense(x, blocks, scales, bias)
    assert got.dtype == torch.bfloat16
    # a bf16 step at |ref|, 2**(exponent - 7): at most one off, plus fp32 summation order
    # near zero
    step = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    assert ((got.float() - ref).abs() <= step + 1e-6 * ref.abs().max()).all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lt.mxfp4_linear(x, blocks, scales, bias, mma=mma)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16
    assert rel(out, mxfp4_linear_torch(x.float(), blocks, scales, bias)) < GPU_TOL
