"""The small fused Triton kernels against their torch twins (interpreter on CPU, real on GPU)."""

import pytest
import torch

from tinyoss.config import RopeConfig
from tinyoss.kernels import rms_norm_torch, router_topk_torch
from tinyoss.kernels import layer_ops_triton as lo
from tinyoss.kernels.attention import write_kv
from tinyoss.kernels.layer_ops_triton import (
    rms_norm_triton,
    rope_triton,
    router_topk_triton,
    store_kv_triton,
)
from tinyoss.model.rope import apply_rope, cos_sin_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}  # ||out - ref|| / ||ref||


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 2880), (5, 128)])
def test_rms_norm(dtype, rows, cols):
    x = torch.randn(rows, cols, device=DEVICE).to(dtype)
    res = torch.randn(rows, cols, device=DEVICE).to(dtype)
    w = 1 + 0.1 * torch.randn(cols, device=DEVICE)
    ref_out, ref_res = rms_norm_torch(x, w, 1e-5, res.clone())
    out, new_res = rms_norm_triton(x, w, 1e-5, res)
    assert torch.equal(new_res, ref_res) and new_res.data_ptr() == res.data_ptr()
    assert rel(out, ref_out) < TOL[dtype]
    out, same = rms_norm_triton(x, w, 1e-5)
    assert same is x and rel(out, rms_norm_torch(x, w, 1e-5)[0]) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_qkv_views(dtype):
    hq, hk, d, t = 16, 2, 64, 7
    cache = cos_sin_cache(RopeConfig(), d, 200000, torch.device(DEVICE))
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=DEVICE).to(dtype)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hk, d)
    positions = torch.tensor([0, 1, 5, 127, 4096, 65536, 131071], device=DEVICE)
    ref_q, ref_k = apply_rope(q.clone(), k.clone(), positions, cache)
    rope_triton(q, k, positions, cache)
    assert rel(q, ref_q) < TOL[dtype] and rel(k, ref_k) < TOL[dtype]


def test_store_kv_skips_padding():
    kc, vc = torch.zeros(4, 16, 2, 64, device=DEVICE), torch.zeros(4, 16, 2, 64, device=DEVICE)
    k, v = torch.randn(5, 2, 64, device=DEVICE), torch.randn(5, 2, 64, device=DEVICE)
    slots = torch.tensor([3, 17, -1, 63, 0], device=DEVICE)
    ref_k, ref_v = kc.clone(), vc.clone()
    write_kv(ref_k, ref_v, k, v, slots)
    store_kv_triton(kc, vc, k, v, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


TOPK_METHODS = {"ranks": 1 << 30, "argmax": 1}  # TOPK_ARGMAX_FROM that forces each


@pytest.mark.parametrize("method", TOPK_METHODS)
@pytest.mark.parametrize("experts", [8, 32, 128])
def test_router_topk(experts, method, monkeypatch):
    monkeypatch.setattr(lo, "TOPK_ARGMAX_FROM", TOPK_METHODS[method])
    logits = torch.randn(9, experts, device=DEVICE)
    w, ids = router_topk_triton(logits, 4)
    ref_w, ref_ids = router_topk_torch(logits, 4)
    assert torch.equal(ids.long(), ref_ids) and torch.allclose(w, ref_w, atol=1e-6)
    # expert parallelism: this rank holds experts [E/4, E/2); the others' pairs come as -1
    held = (experts // 4, experts // 2)
    w_held, ids_held = router_topk_triton(logits, 4, held)
    inside = (ref_ids >= held[0]) & (ref_ids < held[1])
    assert inside.any() and (~inside).any()
    assert torch.equal(ids_held.long(), torch.where(inside, ref_ids - held[0], -1))
    assert torch.equal(ids_held.long(), router_topk_torch(logits, 4, held)[1])
    assert torch.equal(w_held, w)  # the weights stay the softmax over all k


@pytest.mark.parametrize("method", TOPK_METHODS)
def test_router_topk_ties_and_minus_infinity(method, monkeypatch):
    """Equal logits go lowest expert first (as a stable sort puts them), -inf logits are picked
    like any other once the finite ones run out, and no expert is picked twice."""
    monkeypatch.setattr(lo, "TOPK_ARGMAX_FROM", TOPK_METHODS[method])
    ninf = float("-inf")
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, 0.5, 0.5, -3.0],
                           [ninf, 1.0, ninf, ninf, ninf, ninf, ninf, ninf],
                           [0.0] * 8], device=DEVICE)
    w, ids = router_topk_triton(logits, 4)
    order = torch.sort(-logits, dim=-1, stable=True).indices[:, :4]
    assert torch.equal(ids.long(), order)
    top = logits.gather(1, order)
    assert torch.allclose(w, torch.softmax(top, dim=-1), atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,hidden", [(1, 32, 2880), (3, 5, 96), (8, 128, 64),
                                                    (64, 8, 64), (16, 48, 64), (17, 48, 64)])
@pytest.mark.parametrize("method", TOPK_METHODS)
def test_norm_route_matches_unfused(dtype, tokens, experts, hidden, method, monkeypatch):
    """One launch for norm + router + top-k equals the three kernels in turn; twice in a row, so
    the tickets it leaves behind are checked too."""
    from tinyoss.kernels import Kernels
    from tinyoss.kernels.layer_ops_triton import norm_route_triton

    monkeypatch.setattr(lo, "TOPK_ARGMAX_FROM", TOPK_METHODS[method])
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    res = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    nw = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE)
    rw = (torch.randn(experts, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    rb = (0.1 * torch.randn(experts, generator=gen)).to(DEVICE, dtype)
    res0 = res.clone()
    held = (experts // 4, experts // 2 + 1)  # expert parallelism's ids (-1 outside)
    ref = Kernels().post_attention(x, res.clone(), nw, 1e-5, rw, rb, 4, held)
    assert (ref[3] < 0).any()
    kind = "many" if experts >= lo.TOPK_ARGMAX_FROM else "few"
    one_launch = tokens <= lo.NORM_ROUTE_MAX_TOKENS[kind]
    for _ in range(2):
        r = res if one_launch else res.clone()  # three launches write the residual in place
        out, new_res, weights, ids = norm_route_triton(x, r, nw, 1e-5, rw, rb, 4, held)
        assert torch.equal(new_res, ref[1]) and rel(out, ref[0]) < TOL[dtype]
        if dtype == torch.float32:  # bf16 logits may swap near-ties
            assert torch.equal(ids.long(), ref[3].long())
            torch.testing.assert_close(weights, ref[2], rtol=1e-5, atol=1e-6)
        else:
            assert (ids.long() == ref[3].long()).float().mean() > 0.7
    assert torch.equal(res, res0)  # one launch: read, never written (other programs read it)
