"""The weights-left dense GEMM gives the product's GEMM (interpreter on CPU in fp32, bf16 on a
GPU), K tails and row and token tails included."""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

from test_linear_mxfp4 import poison, weights  # noqa: E402, F401 (poison: NaN outputs)
from wleft_linear import Tiles, linear_gemm_wx  # noqa: E402

from tinyoss.kernels import linear_mxfp4_triton as lt  # noqa: E402
from tinyoss.kernels.linear_mxfp4_torch import mxfp4_linear_torch  # noqa: E402

CUDA = torch.cuda.is_available()


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.skipif(CUDA, reason="small fp32 cases run in the Triton interpreter")
@pytest.mark.parametrize("m,n,k", [(3, 40, 160), (17, 24, 96), (40, 48, 256)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_the_reference_in_the_interpreter(m, n, k, with_bias):
    blocks, scales, bias = weights(n, k, seed=m)
    bias = bias if with_bias else None
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m))
    out = linear_gemm_wx(x, blocks, scales, bias, Tiles(16, 16, 64, 4, 1))
    assert out.shape == (m, n) and not out.isnan().any()
    assert rel(out, mxfp4_linear_torch(x, blocks, scales, bias)) < 1e-5


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(5120, 2880), (2880, 4096)])
@pytest.mark.parametrize("m", [5, 64, 300])
def test_matches_the_product_on_the_gpu(n, k, m):
    blocks, scales, bias = weights(n, k, seed=m, device="cuda", std=0.02)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    bias = bias.to(torch.bfloat16)
    ref = mxfp4_linear_torch(x.float(), blocks, scales, bias)
    for t in (Tiles(), Tiles(64, 128, 128, 4, 3)):
        out = linear_gemm_wx(x, blocks, scales, bias, t)
        assert rel(out, ref) < 1e-2
        assert rel(out, lt.linear_gemm(x, blocks, scales, bias)) < 1e-2
