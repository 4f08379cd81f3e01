"""The Triton decode attention (sinks, windows, splits merged by the last one, paged blocks, the
rotary embedding and the K/V store of the new token) against the torch reference (`apply_rope`,
`write_kv`, `attend`), in the interpreter on CPU and for real on a GPU."""

import random

import pytest
import torch

from tinyoss.kernels import attention_decode_triton as adt
from tinyoss.kernels.attention import attend, write_kv
from tinyoss.model.rope import apply_rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOL = 1e-2 if DEVICE == "cuda" else 1e-5  # ||out - ref|| / ||ref||


@pytest.mark.parametrize("window,min_split,max_len,max_splits,target",
                         [(0, 64, 400, 64, 512), (128, 64, 400, 64, 512),
                          (128, 128, 400, 64, 512), (100, 128, 400, 64, 512),
                          (0, 512, 400, 64, 512), (128, 512, 400, 64, 512),
                          (0, 64, 131072, 64, 512), (0, 64, 131072, 4, 512),
                          (0, 64, 131072, 64, 24)])
@pytest.mark.parametrize("stored", [False, True])
def test_decode_attention_matches_reference(window, min_split, max_len, max_splits, target,
                                            stored, monkeypatch):
    """Several splits at these short lengths (min_split 64); a window within one split takes
    the one-split path; min_split 512: one split of several steps. Each sequence's splits come
    from its own length: as many in a workspace for 128k tokens as in one for 400, and longer
    ones where MAX_SPLITS, or the batch against TARGET_PROGRAMS (24 // (4 sequences x 2 heads)
    = 3), caps their number. q and the new k arrive unrotated (views into one q/k/v row, as
    the model passes them) at positions that are not the key indices; run twice, so the merge
    tickets must reset. `stored` (a verify step's rows): q comes rotated and the new keys are
    in the cache already, where the kernel must read them."""
    monkeypatch.setattr(adt, "MIN_SPLIT", min_split)
    monkeypatch.setattr(adt, "MAX_SPLITS", max_splits)
    monkeypatch.setattr(adt, "TARGET_PROGRAMS", target)
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
    slots = torch.tensor([t[(n - 1) // page] * page + (n - 1) % page
                          for t, n in zip(tables, kv_lens)], device=DEVICE)
    positions = torch.tensor([n - 1 + 37 * i for i, n in enumerate(kv_lens)], device=DEVICE)
    rope_cache = torch.randn(600, d, device=DEVICE)
    qkv = torch.randn(len(kv_lens), (hq + 2 * hk) * d, device=DEVICE).to(DTYPE)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(-1, hq, d), k.view(-1, hk, d), v.view(-1, hk, d)
    sinks = torch.randn(hq, device=DEVICE) * 2
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = apply_rope(q.float(), k.float(), positions, rope_cache)
    write_kv(ref_k_cache, ref_v_cache, ref_k, v, slots)
    if stored:
        k_cache.copy_(ref_k_cache)
        v_cache.copy_(ref_v_cache)
        q = ref_q.to(DTYPE)
    attention = adt.DecodeAttention(8, max_len, hq, hk, d, torch.device(DEVICE))
    assert attention.max_splits == min(adt.MAX_SPLITS, -(-max_len // min_split))
    for _ in range(2):
        attention.m.fill_(float("nan"))
        out = attention(q, k, v, k_cache, v_cache, slots, positions, rope_cache, table_t, ranges,
                        sinks, d ** -0.5, window, stored=stored)
        assert not attention.tickets.any()
        if not 0 < window <= min_split:  # the splits the 333-key sequence wrote partials for
            keys = int(ranges[3, 1] - ranges[3, 0])
            cap = min(attention.max_splits, target // (len(kv_lens) * hk))
            per_split = -(-keys // cap)
            split = max(min_split, -(-per_split // adt.BLOCK_KV) * adt.BLOCK_KV)
            written = attention.m[3, 0, :, 0].isfinite().sum().item()
            assert written == -(-keys // split)
            assert split == {4: 128, 24: 128}.get(min(max_splits, target), split)
        for i, n in enumerate(kv_lens):
            blocks_i = torch.tensor(tables[i], device=DEVICE)
            keys = ref_k_cache[blocks_i].flatten(0, 1)[:n]
            values = ref_v_cache[blocks_i].flatten(0, 1)[:n]
            ref = attend(ref_q[i:i + 1], keys, values, sinks, torch.tensor([n - 1], device=DEVICE),
                         torch.arange(n, device=DEVICE), window, d ** -0.5)
            got = out[i].view(hq, d).float()
            assert ((got - ref[0]).norm() / ref[0].norm()).item() < TOL, (i, n)
    stored = (k_cache.flatten(0, 1)[slots].float(), v_cache.flatten(0, 1)[slots])
    assert ((stored[0] - ref_k).norm() / ref_k.norm()).item() < TOL
    assert torch.equal(stored[1], v)
    untouched = torch.ones(blocks * page, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(k_cache.flatten(0, 1)[untouched], ref_k_cache.flatten(0, 1)[untouched])


def test_negative_slot_stores_nothing():
    """A sequence whose slot is < 0 (padding) leaves the cache as it was."""
    hq, hk, d, page = 16, 2, 64, 16
    k_cache = torch.randn(4, page, hk, d, device=DEVICE).to(DTYPE)
    v_cache = torch.randn(4, page, hk, d, device=DEVICE).to(DTYPE)
    before = (k_cache.clone(), v_cache.clone())
    q = torch.randn(1, hq, d, device=DEVICE).to(DTYPE)
    k = torch.randn(1, hk, d, device=DEVICE).to(DTYPE)
    v = torch.randn(1, hk, d, device=DEVICE).to(DTYPE)
    attention = adt.DecodeAttention(1, 64, hq, hk, d, torch.device(DEVICE))
    out = attention(q, k, v, k_cache, v_cache, torch.tensor([-1], device=DEVICE),
                    torch.tensor([5], device=DEVICE), torch.randn(64, d, device=DEVICE),
                    torch.tensor([[2]], dtype=torch.int32, device=DEVICE),
                    torch.tensor([[0, 6]], dtype=torch.int32, device=DEVICE),
                    torch.zeros(hq, device=DEVICE), d ** -0.5)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    assert out.isfinite().all()


@pytest.mark.parametrize("groups,spaced", [(2, True), (2, False), (1, True), (3, True),
                                           (3, False)])
@pytest.mark.parametrize("with_inputs", [False, True])
def test_stage_decode_plan_writes_what_the_copies_wrote(groups, spaced, with_inputs):
    """One copy and one launch put every group's key ranges, block tables (ragged, each into
    its row of the fixed [seqs, max_blocks] buffer) and slots (the real ones, then padding) where
    per-group copies put them, leave the rest of each buffer alone, and, given `inputs`, copy
    the token ids and positions too. `spaced`: the groups' slots side by side in one tensor, as
    build_batch makes them; else separate tensors (stacked first)."""
    from tinyoss.kernels.attention_flashinfer import _slot_source

    rng = random.Random(groups * 2 + spaced)
    real, pad, max_seqs, max_blocks, pad_slot = 3, 2, 8, 40, 999
    rows = real + pad
    tables = [[[rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))] for _ in range(real)]
              + [[7]] * pad for _ in range(groups)]
    ranges = [[(rng.randrange(0, 50), rng.randrange(50, 500)) for _ in range(rows)]
              for _ in range(groups)]
    flat = torch.tensor([rng.randrange(0, 10**6) for _ in range((groups + 2) * real)],
                        device=DEVICE)
    uneven = torch.arange(10**5, 10**5 + 30, device=DEVICE)  # steps 4, then 5, ...
    slot_views = [flat[(g + 1) * real:(g + 2) * real] if spaced
                  else uneven[g * (real + 1) + g * (g - 1) // 2:][:real] for g in range(groups)]
    src, stride = _slot_source(slot_views)
    assert (src.dim() == 1) == (spaced or groups <= 2)  # two points are always evenly apart
    slots = torch.full((groups, 16), -5, dtype=torch.long, device=DEVICE)
    tables_out = torch.full((groups, max_seqs, max_blocks), -1, dtype=torch.int32, device=DEVICE)
    ranges_out = torch.full((groups, max_seqs, 2), -1, dtype=torch.int32, device=DEVICE)
    ids_out = torch.full((8,), -3, dtype=torch.long, device=DEVICE)
    pos_out = torch.full((8,), -4, dtype=torch.long, device=DEVICE)
    inputs = (flat[:real], flat[real:2 * real], ids_out, pos_out) if with_inputs else None
    for _ in range(2):  # the same again changes nothing
        adt.stage_decode_plan(ranges, tables, src, stride, real, pad_slot, slots, tables_out,
                              ranges_out, inputs)
    for g in range(groups):
        width = max(len(t) for t in tables[g])  # as the copies did: rows padded with 0 to it
        for r in range(rows):
            t = tables[g][r]
            assert tables_out[g, r, :width].tolist() == t + [0] * (width - len(t))
            assert (tables_out[g, r, width:] == -1).all()
            assert tuple(ranges_out[g, r].tolist()) == ranges[g][r]
        assert (tables_out[g, rows:] == -1).all() and (ranges_out[g, rows:] == -1).all()
        assert slots[g, :real].tolist() == slot_views[g].tolist()
        assert slots[g, real:rows].tolist() == [pad_slot] * pad
        assert (slots[g, rows:] == -5).all()
    if with_inputs:
        assert ids_out[:real].tolist() == flat[:real].tolist()
        assert pos_out[:real].tolist() == flat[real:2 * real].tolist()
        assert (ids_out[real:] == -3).all() and (pos_out[real:] == -4).all()
    else:
        assert (ids_out == -3).all() and (pos_out == -4).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="Triton compiles kernels only on a GPU")
def test_staging_compiles_once_whatever_the_batch_and_table_widths():
    """The rows, slots and block-table widths change every step; each new value had been a
    compile (a stall on an empty Triton cache) of `_stage_kernel`."""
    rng = random.Random(0)
    compiled = adt._stage_kernel.device_caches[torch.cuda.current_device()][0]
    before = None
    # the engine's buffers: one size for every step (their strides never change)
    slots = torch.zeros((1, 64), dtype=torch.long, device=DEVICE)
    tables_out = torch.zeros((1, 64, 4096), dtype=torch.int32, device=DEVICE)
    ranges_out = torch.zeros((1, 64, 2), dtype=torch.int32, device=DEVICE)
    for real, width in ((1, 1), (1, 64), (2, 3), (3, 17), (16, 130), (5, 700), (40, 2050)):
        rows = real + 1
        tables = [[[rng.randrange(1, 500) for _ in range(width)] for _ in range(rows)]]
        ranges = [[(0, 16 * width)] * rows]
        src = torch.arange(real, device=DEVICE)
        slots.zero_()
        adt.stage_decode_plan(ranges, tables, src, 0, real, 999, slots, tables_out, ranges_out)
        assert tables_out[0, :rows, :width].tolist() == tables[0]
        assert slots[0, :rows].tolist() == list(range(real)) + [999]
        before = len(compiled) if before is None else before
        assert len(compiled) == before, list(compiled)
