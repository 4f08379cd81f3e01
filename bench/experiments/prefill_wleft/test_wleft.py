"""The W-left prefill GEMMs give the product's pair outputs (interpreter on CPU, real on a GPU)."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

from test_moe_triton import PREFILL, TOL, inputs, rel_err  # noqa: E402
import torch  # noqa: E402
from wleft import prefill_pairs_left  # noqa: E402
from xperm import permute_columns, prefill_pairs_xperm  # noqa: E402

from tinyoss.kernels import moe_triton as mt  # noqa: E402


@pytest.mark.parametrize("seed,t", [(3, 9), (4, 40)])
def test_w_left_equals_the_product(seed, t):
    x, weights, ids, w = inputs(seed, t)
    ref = mt._prefill_pairs(x, weights, ids, w, PREFILL)
    out = prefill_pairs_left(x, weights, ids, w, PREFILL)
    assert rel_err(out, ref) < TOL


# The interpreter's bf16 flushes subnormals and misreads 2**126 (CPU: 0x0040 -> 0, 1 * 2**126
# -> -2): the bf16 decode is checked on a GPU only.
BF16_DEQ = [False, pytest.param(True, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the interpreter's bf16 arithmetic is not the GPU's"))]


@pytest.mark.parametrize("bf16_deq", BF16_DEQ, ids=["fp32-decode", "bf16-decode"])
@pytest.mark.parametrize("seed,t", [(3, 9), (4, 40)])
def test_permuted_x_equals_the_product(seed, t, bf16_deq):
    x, weights, ids, w = inputs(seed, t)
    ref = mt._prefill_pairs(x, weights, ids, w, PREFILL)
    out = prefill_pairs_xperm(x, weights, ids, w, replace(PREFILL, block_k=128), bf16_deq)
    assert rel_err(out, ref) < TOL


def test_the_permutation_puts_each_phase_in_one_slice():
    x = torch.arange(1, 3 * 200 + 1, dtype=torch.float32).view(3, 200)
    xp = permute_columns(x)
    assert xp.shape == (3, 256)
    for c in range(256):
        tile, r = divmod(c, 128)
        want = x[:, c] if c < 200 else torch.zeros(3)  # past K: zero padding
        assert torch.equal(xp[:, tile * 128 + 16 * (r % 8) + r // 8], want)
