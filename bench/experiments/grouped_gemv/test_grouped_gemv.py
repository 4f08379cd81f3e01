"""The expert-grouped GEMV (tinyoss.kernels.moe_gemv_grouped) against `moe_torch` and against
the pair GEMV (`moe_triton._gemv_pairs`) it replaces.

Small shapes from tests/test_moe_triton.py (E = 8, H = 96, I = 64, top-4; K tiles of 64 leave H
ragged), fp32 in the Triton interpreter on CPU. Outputs and workspaces start as NaN, so a pair
row that no group wrote shows. Routings: experts repeated heavily across tokens, every pair on a
distinct expert (32 experts, T * 4 <= 32), every token on the same four experts.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.test_moe_triton import (  # noqa: E402
    DEVICE,
    DTYPE,
    TOL,
    TOPK,
    H,
    _poisoned,
    inputs,
    rel_err,
    small_weights,
)
from bench.experiments.grouped_gemv import moe_gemv_grouped as mg  # noqa: E402
from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels.moe_torch import moe_torch  # noqa: E402

# One row tile for gate_up (2I = 128 rows), two for down (H = 96: one ragged); two K tiles at
# H, one ragged. The interpreter pays per program, so the pair GEMV (the check, not the subject)
# gets one row tile and one K tile.
CFG = mg.GroupedGemvConfig(block_n1=128, block_n2=64, block_k=64)
GEMV = (mt.GemvConfig(block_n1=128, block_n2=128, block_k=128) if not torch.cuda.is_available()
        else mt.GemvConfig(block_n1=16, block_n2=16, block_k=512))  # the Gluon kernel's tiles
PAIR_TOL = 1e-6 if not torch.cuda.is_available() else 1e-3  # relative, pair vs grouped y


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(mt, "_empty", _poisoned)
    monkeypatch.setattr(mg, "_empty", _poisoned)


def case(kind: str, t: int, seed: int):
    """(x, weights, ids, w): 'repeat' draws each token's four experts from the first five (most
    experts shared by most tokens); 'distinct' gives the T*4 pairs distinct experts of 32;
    'same' routes every token to experts 5, 2, 7, 0 (in a per-token shuffled order)."""
    if kind == "repeat":
        return inputs(seed, t, allowed=5)
    gen = torch.Generator().manual_seed(seed)
    if kind == "distinct":
        w = small_weights(gen, e=32)
        ids = torch.randperm(32, generator=gen)[: t * TOPK].reshape(t, TOPK)
    else:
        w = small_weights(gen)
        base = torch.tensor([5, 2, 7, 0])
        ids = torch.stack([base[torch.randperm(TOPK, generator=gen)] for _ in range(t)])
    x = (torch.randn(t, H, generator=gen) * 2).to(DEVICE, DTYPE)
    weights = torch.softmax(torch.randn(t, TOPK, generator=gen), dim=-1)
    return x, weights.to(DEVICE), ids.to(DEVICE), w


def distinct(ids: torch.Tensor) -> int:
    return ids.unique().numel()


@pytest.mark.parametrize("t", [2, 3, 5, 8])
@pytest.mark.parametrize("kind", ["repeat", "distinct", "same"])
def test_grouped_matches_reference_and_pair_gemv(kind, t):
    x, weights, ids, w = case(kind, t, 500 + 10 * t + len(kind))
    want_groups = {"repeat": 5, "distinct": t * TOPK, "same": TOPK}[kind]
    assert distinct(ids) == want_groups
    y = mg.grouped_gemv_pairs(x, weights, ids, w, CFG)
    assert y.shape == (t * TOPK, H) and y.dtype == torch.float32 and not y.isnan().any()
    out = torch.full((t, H), float("nan"), dtype=DTYPE, device=DEVICE)
    mt._combine_pairs(y, ids, out)  # what `moe_gemv_grouped` ends with
    assert rel_err(out, moe_torch(x, weights, ids, w)) < TOL
    # pair by pair, the same y as the pair GEMV up to the order of the fp32 K sum
    y_pair = mt._gemv_pairs(x, weights, ids, w, GEMV)
    assert ((y - y_pair).norm(dim=1) <= PAIR_TOL * y_pair.norm(dim=1)).all()


def test_moe_gemv_grouped_writes_out():
    x, weights, ids, w = case("repeat", 2, 61)
    out = torch.full((2, H), float("nan"), dtype=DTYPE, device=DEVICE)
    got = mg.moe_gemv_grouped(x, weights, ids, w, out=out, config=CFG)
    assert got.data_ptr() == out.data_ptr()
    assert rel_err(out, moe_torch(x, weights, ids, w)) < TOL
    assert rel_err(mg.moe_gemv_grouped(x, weights, ids, w, config=CFG), out) < 1e-6


@pytest.mark.parametrize("variant", [{"phases": True}, {"padded": True}])
def test_variants_and_narrow_tiles(variant):
    """The `phases` activation loads and the `padded` all-rows-at-once product, with several
    row tiles in both GEMVs (four for gate_up, three for down), give the pair GEMV's y."""
    x, weights, ids, w = case("repeat", 3, 77)
    ref = mt._gemv_pairs(x, weights, ids, w, GEMV)
    cfg = mg.GroupedGemvConfig(block_n1=32, block_n2=32, block_k=64, **variant)
    assert rel_err(mg.grouped_gemv_pairs(x, weights, ids, w, cfg), ref) < PAIR_TOL


def test_combine_takes_y_as_is():
    """y lands at each pair's original index, so `_combine` (and `_combine_norm`) take it."""
    x, weights, ids, w = case("repeat", 3, 91)
    y = mg.grouped_gemv_pairs(x, weights, ids, w, CFG)
    out = torch.empty(3, H, dtype=DTYPE, device=DEVICE)
    mt._combine_pairs(y, ids, out)
    assert rel_err(out, moe_torch(x, weights, ids, w)) < TOL


def test_rejects_bad_tiles():
    x, weights, ids, w = case("repeat", 2, 3)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        mg.grouped_gemv_pairs(x, weights, ids, w, mg.GroupedGemvConfig(block_k=96))
