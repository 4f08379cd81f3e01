"""The interleaved layout puts each logical word where `il_column` says, and the prefill GEMMs on
it give the product's pair outputs (interpreter on CPU, real on a GPU), with last groups of 1,
2 and 3 blocks and none."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from test_moe_triton import DEVICE, DTYPE, TOL, rel_err, small_weights  # noqa: E402

from bench.experiments.interleave.interleave import (  # noqa: E402
    il_columns, interleave, permute_columns_il, prefill_pairs_il)
from tinyoss.kernels import moe_triton as mt  # noqa: E402


@pytest.mark.parametrize("nblk", [4, 5, 6, 7, 90])
def test_every_word_lands_where_il_column_says(nblk):
    gen = torch.Generator().manual_seed(nblk)
    q = torch.randint(0, 256, (2, 3, nblk, 16), dtype=torch.uint8, generator=gen)
    qi = interleave(q)
    words, words_il = q.view(torch.int32).reshape(2, 3, -1), qi.view(torch.int32).reshape(2, 3, -1)
    cols = il_columns(32 * nblk)
    assert sorted(cols.tolist()) == list(range(32 * nblk))  # a permutation
    for c in range(0, 32 * nblk, 8):
        assert cols[c] % 8 == 0 and torch.equal(words_il[..., cols[c] // 8], words[..., c // 8])
        assert torch.equal(cols[c:c + 8], cols[c] + torch.arange(8))  # a word's codes stay put


def test_x_is_permuted_to_the_physical_columns():
    k = 224
    x = torch.arange(1, 2 * k + 1, dtype=torch.float32).view(2, k)
    xp = permute_columns_il(x)
    phys = torch.empty(k, dtype=torch.float32).view(1, k).repeat(2, 1)
    phys[:, il_columns(k)] = x
    assert torch.equal(xp, mt._permute_columns(phys, 128))


@pytest.mark.parametrize("h,i", [(128, 64), (224, 160), (192, 96)])
@pytest.mark.parametrize("t", [9, 40])
def test_interleaved_prefill_equals_the_product(t, h, i):
    gen = torch.Generator().manual_seed(t + h)
    w = small_weights(gen, 8, h, i)
    x = (torch.randn(t, h, generator=gen) * 2).to(DEVICE, DTYPE)
    ids = torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(t)]).to(DEVICE)
    wts = torch.softmax(torch.randn(t, 4, generator=gen), -1).to(DEVICE)
    cfg = mt.PrefillConfig(block_m=16, block_n1=32, block_n2=32, block_k=128, num_warps=4)
    ref = mt._prefill_pairs(x, wts, ids, w, cfg)
    out = prefill_pairs_il(x, wts, ids, w, interleave(w.gate_up_blocks),
                           interleave(w.down_blocks), cfg)
    assert rel_err(out, ref) < TOL
