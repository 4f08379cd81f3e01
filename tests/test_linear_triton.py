"""The bf16 decode GEMV (`linear_triton`) against F.linear: in the Triton interpreter on CPU
(fp32, ragged N and K tiles) and at gpt-oss shapes on a GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tinyoss.kernels import linear_triton as lt

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.skipif(CUDA, reason="small fp32 cases run in the Triton interpreter")
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_f_linear(m: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 200, generator=gen), torch.randn(37, 200, generator=gen)
    b = torch.randn(37, generator=gen) if with_bias else None
    cfg = lt.GemvConfig(block_m=lt.gemv_config(m, 37).block_m, block_n=8, block_k=64)
    out = lt.linear_gemv(x, w, b, cfg)
    assert out.shape == (m, 37) and rel(out, F.linear(x, w, b)) < 1e-5


def test_dispatch_and_shape_errors() -> None:
    x, w = torch.randn(5, 64), torch.randn(16, 64)
    assert torch.allclose(lt.linear_triton(x, w), F.linear(x, w))  # above GEMV_MAX_M: torch
    with pytest.raises(ValueError, match="do not fit"):
        lt.linear_gemv(torch.randn(1, 65), w)


@gpu
@pytest.mark.parametrize("n,k", [(5120, 2880), (2880, 4096), (32, 2880), (201088, 2880)])
def test_gpt_oss_shapes_gpu(n: int, k: int) -> None:
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    b = torch.randn(n, device="cuda").to(torch.bfloat16)
    assert rel(lt.linear_gemv(x, w, b), F.linear(x.float(), w.float(), b.float())) < 1e-2


@gpu
@pytest.mark.parametrize("n,k", [(5120, 2880), (2880, 4096), (201088, 2880)])
@pytest.mark.parametrize("m", [1, 4])
def test_fp8_gpt_oss_shapes_gpu(n: int, k: int, m: int) -> None:
    """The FP8 GEMV (`fp8_layers`) against fp32 on the dequantized weights."""
    from tinyoss.model.quant_linear import quantize_fp8

    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    q, s = quantize_fp8(torch.randn(n, k, device="cuda") * 0.02)
    b = torch.randn(n, device="cuda").to(torch.bfloat16)
    want = F.linear(x.float(), q.float() * s[:, None], b.float())
    assert rel(lt.fp8_linear(x, q, s, b), want) < 1e-2
