"""The prefill GEMMs on the shuffled experts give the product's pair outputs (interpreter on
CPU, real on a GPU), with K tails (a last K tile of one block pair) on both projections."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from shuffled_prefill import permute_columns, prefill_pairs_shuf, shuffle  # noqa: E402
from test_moe_triton import DEVICE, DTYPE, TOL, rel_err, small_weights  # noqa: E402

from tinyoss.kernels import moe_triton as mt  # noqa: E402


@pytest.mark.parametrize("h,i", [(192, 64), (128, 128)])
@pytest.mark.parametrize("t", [9, 40])
def test_shuffled_prefill_equals_the_product(t, h, i):
    gen = torch.Generator().manual_seed(t + h)
    w = small_weights(gen, 8, h, i)
    x = (torch.randn(t, h, generator=gen) * 2).to(DEVICE, DTYPE)
    ids = torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(t)]).to(DEVICE)
    wts = torch.softmax(torch.randn(t, 4, generator=gen), -1).to(DEVICE)
    cfg = mt.PrefillConfig(block_m=16, block_n1=32, block_n2=32, block_k=128, num_warps=4)
    ref = mt._prefill_pairs(x, wts, ids, w, cfg)
    out = prefill_pairs_shuf(x, wts, ids, w, shuffle(w.gate_up_blocks, True),
                             shuffle(w.down_blocks, False), cfg)
    assert rel_err(out, ref) < TOL


def test_the_permutation_matches_the_kernel_positions():
    x = torch.arange(1, 3 * 200 + 1, dtype=torch.float32).view(3, 200)
    xp = permute_columns(x)
    for col in range(xp.shape[1]):
        tile, r = divmod(col, 128)
        jb, bb, tt, j = r // 64, (r // 32) % 2, (r // 8) % 4, r % 8
        want = x[:, col] if col < 200 else torch.zeros(3)
        assert torch.equal(xp[:, tile * 128 + 16 * j + 8 * jb + 2 * tt + bb], want)
