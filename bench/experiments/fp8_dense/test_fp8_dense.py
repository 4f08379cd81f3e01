"""The FP8 experiment's quantizer and GEMV (CPU: Triton's interpreter; or a GPU).

    python -m pytest bench/experiments/fp8_dense
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.experiments.fp8_dense.fp8_dense import FP8_MAX, dequantize_fp8, fp8_gemv, quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_quantize_fp8_rounds_each_row_to_its_scale() -> None:
    """Scale = row absmax / 448 (the largest magnitude maps to 448 exactly); every weight within
    e4m3's rounding: 2**-4 of itself, or 2**-10 of the scale below the normal range; a zero row
    keeps scale 1. Chunked the same as whole."""
    torch.manual_seed(0)
    w = torch.randn(37, 96) * torch.logspace(-3, 2, 37)[:, None]
    w[5] = 0
    q, s = quantize_fp8(w, chunk=8)
    amax = w.abs().amax(1)
    assert torch.equal(s[amax > 0], (amax / FP8_MAX)[amax > 0]) and s[5] == 1
    assert q.float().abs().amax(1)[amax > 0].eq(FP8_MAX).all()
    err = (dequantize_fp8(q, s) - w).abs()
    assert (err <= torch.maximum(w.abs() * 2**-4, s[:, None] * 2**-10)).all()
    assert err[5].eq(0).all()
    q1, s1 = quantize_fp8(w)
    assert torch.equal(q1.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s1, s)


@pytest.mark.parametrize("m,n,k,bias", [(1, 40, 96, True), (3, 17, 200, False)])
def test_fp8_gemv_matches_the_dequantized_linear(m, n, k, bias) -> None:
    """Ragged rows and K (masked), 1 and 3 tokens, with and without bias: the fp32 sums of the
    dequantized weight, to fp32 rounding."""
    torch.manual_seed(m)
    w = torch.randn(n, k, device=DEVICE)
    q, s = quantize_fp8(w)
    x = torch.randn(m, k, device=DEVICE)
    b = torch.randn(n, device=DEVICE) if bias else None
    got = fp8_gemv(x, q, s, b, block_n=8, block_k=64, stages=2)
    want = F.linear(x, dequantize_fp8(q, s), b)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
