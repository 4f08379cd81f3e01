"""The pair-decode prefill GEMMs give the product's pair outputs (interpreter on CPU, real on a
GPU), and the permutation puts each pair phase in one slice."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

from pairdec import permute_pairs, prefill_pairs_dec  # noqa: E402
from test_moe_triton import PREFILL, TOL, inputs, rel_err  # noqa: E402

from tinyoss.kernels import moe_triton as mt  # noqa: E402


@pytest.mark.parametrize("block_k", [64, 128])
@pytest.mark.parametrize("seed,t", [(3, 9), (4, 40)])
def test_pair_decode_equals_the_product(seed, t, block_k):
    if torch.cuda.is_available() and block_k < 128:
        pytest.skip("tensor cores need K tiles of 128")
    x, weights, ids, w = inputs(seed, t)
    cfg = replace(PREFILL, block_k=block_k)
    ref = mt._prefill_pairs(x, weights, ids, w, cfg)
    assert rel_err(prefill_pairs_dec(x, weights, ids, w, cfg), ref) < TOL


def test_each_pair_phase_is_one_slice():
    x = torch.arange(1, 3 * 200 + 1, dtype=torch.float32).view(3, 200)
    for bk in (64, 128):
        xp = permute_pairs(x, bk)
        for c in range(xp.shape[1]):
            tile, r = divmod(c, bk)
            w, j = divmod(r, 8)
            want = x[:, c] if c < 200 else torch.zeros(3)
            assert torch.equal(xp[:, tile * bk + (bk // 4) * (j % 4) + 2 * w + j // 4], want)
