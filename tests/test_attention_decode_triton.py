"""The Triton decode attention (sinks, windows, splits, paged blocks) against the torch reference
`attend`, in the interpreter on CPU and for real on a GPU."""

import random

import pytest
import torch

from tinyoss.kernels import attention_decode_triton as adt
from tinyoss.kernels.attention import attend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOL = 2e-2 if DEVICE == "cuda" else 1e-5  # ||out - ref|| / ||ref||


@pytest.mark.parametrize("window,min_split",
                         [(0, 64), (128, 64), (128, 128), (100, 128), (0, 512), (128, 512)])
def test_decode_attention_matches_reference(window, min_split, monkeypatch):
    """Several splits at these short lengths (min_split 64); a window within one split takes
    the one-launch path; min_split 512: one split of several steps (as real lengths give)."""
    monkeypatch.setattr(adt, "MIN_SPLIT", min_split)
    rng = random.Random(window)
    hq, hk, d, page, blocks = 16, 2, 64, 16, 64
    kv_lens = [1, 70, 200, 333]
    k_cache = torch.randn(blocks, page, hk, d, device=DEVICE).to(DTYPE)
    v_cache = torch.randn(blocks, page, hk, d, device=DEVICE).to(DTYPE)
    free = list(range(blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // page))] for n in kv_lens]
    width = max(map(len, tables))
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                           device=DEVICE)
    ranges = torch.tensor([(max(0, n - window) if window else 0, n) for n in kv_lens],
                          dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(kv_lens), hq, d, device=DEVICE).to(DTYPE)
    sinks = torch.randn(hq, device=DEVICE) * 2
    attention = adt.DecodeAttention(8, 400, hq, hk, d, torch.device(DEVICE))
    assert attention.split == min_split and (attention.max_splits > 1 or min_split > 400)
    out = attention(q, k_cache, v_cache, table_t, ranges, sinks, d ** -0.5, window)
    for i, n in enumerate(kv_lens):
        blocks_i = torch.tensor(tables[i], device=DEVICE)
        keys = k_cache[blocks_i].flatten(0, 1)[:n]
        values = v_cache[blocks_i].flatten(0, 1)[:n]
        ref = attend(q[i:i + 1], keys, values, sinks, torch.tensor([n - 1], device=DEVICE),
                     torch.arange(n, device=DEVICE), window, d ** -0.5)
        got = out[i].view(hq, d).float()
        assert ((got - ref[0]).norm() / ref[0].norm()).item() < TOL, (i, n)
