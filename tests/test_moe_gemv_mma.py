"""The tensor-core MoE GEMV's choices and layout, on CPU: where it can run, which shapes it
takes, that the pair GEMV hands it both projections, and the shuffled expert layout it reads
(word by word, and the grouped GEMMs reading it in the interpreter). Its numerics are tested on
the GPU (tests/test_moe_triton.py: against the Gluon kernel and `moe_torch`)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tinyoss.kernels import moe_gemv_mma as mm
from tinyoss.kernels import moe_triton as mt
from tinyoss.kernels.moe_torch import ExpertWeights, moe_torch
from tinyoss.model import mxfp4


@pytest.fixture(autouse=True)
def fresh_load():
    mm.load.cache_clear()
    yield
    mm.load.cache_clear()


def test_load_says_why_not(monkeypatch):
    assert mm.load(None) == (None, "it is built for sm_90 (Hopper) only")
    assert mm.load((10, 0))[0] is None
    monkeypatch.setattr(mm, "_nvcc", lambda: None)
    assert mm.load((9, 0)) == (None, "nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    mm.load.cache_clear()
    monkeypatch.setattr(mm, "_nvcc", lambda: "/no/nvcc")

    def fails(nvcc):
        raise RuntimeError("nvcc exploded")

    monkeypatch.setattr(mm, "_build", fails)
    kernels, why = mm.load((9, 0))
    assert kernels is None and why == "its build failed: nvcc exploded"
    mm.load.cache_clear()

    class OldDriver:  # built, but the driver is older than the toolkit
        def __init__(self, lib) -> None:
            pass

        def not_ready(self) -> str:
            return "CUDA error 35: CUDA driver version is insufficient for CUDA runtime version"

    monkeypatch.setattr(mm, "_build", lambda nvcc: "lib.so")
    monkeypatch.setattr(mm.ctypes, "CDLL", lambda path: None)
    monkeypatch.setattr(mm, "MmaGemv", OldDriver)
    kernels, why = mm.load((9, 0))
    assert kernels is None and why == (
        "built with /no/nvcc, but it does not load on this GPU and driver (CUDA error 35: CUDA "
        "driver version is insufficient for CUDA runtime version)")


@pytest.mark.skipif(mm._nvcc() is None, reason="needs nvcc")
def test_builds_into_the_cache_and_names_cuda_errors(tmp_path, monkeypatch):
    """nvcc builds the library into TINYOSS_CACHE once (the second call finds it); ctypes loads
    it, and it names CUDA's errors (without a GPU here, its kernels report why they cannot load)."""
    import ctypes

    monkeypatch.setenv("TINYOSS_CACHE", str(tmp_path))
    built = mm._build(mm._nvcc())
    assert built.parent == tmp_path / "kernels" and mm._build("/no/nvcc") == built
    kernels = mm.MmaGemv(ctypes.CDLL(str(built)))
    assert kernels.error(35).startswith("CUDA error 35: CUDA driver version is insufficient")
    if not torch.cuda.is_available():
        assert kernels.not_ready() is not None


def _experts(e: int, h: int, i: int, bias: torch.dtype) -> ExpertWeights:
    meta = torch.device("meta")
    return ExpertWeights(
        torch.empty(e, 2 * i, h // 32, 16, dtype=torch.uint8, device=meta),
        torch.empty(e, 2 * i, h // 32, dtype=torch.uint8, device=meta),
        torch.empty(e, 2 * i, dtype=bias, device=meta),
        torch.empty(e, h, i // 32, 16, dtype=torch.uint8, device=meta),
        torch.empty(e, h, i // 32, dtype=torch.uint8, device=meta),
        torch.empty(e, h, dtype=bias, device=meta))


def test_supports_gpt_oss_shapes_in_bf16_shuffled_only():
    x = torch.empty(4, 2880, dtype=torch.bfloat16, device="meta")
    w = _experts(32, 2880, 2880, torch.bfloat16)
    assert mm.MmaGemv.takes(w) and not mm.MmaGemv.supports(x, w)  # not shuffled yet
    shuffled = replace(w, shuffled=True)
    assert mm.MmaGemv.supports(x, shuffled)
    assert not mm.MmaGemv.supports(x.float(), shuffled)
    assert not mm.MmaGemv.takes(_experts(32, 2880, 2880, torch.float32))
    assert not mm.MmaGemv.takes(_experts(8, 96, 64, torch.bfloat16))
    assert not mm.MmaGemv.takes(_experts(8, 5760, 2880, torch.bfloat16))  # x staged for <= 2880
    wide = _experts(32, 2880, 2880, torch.bfloat16)
    wide.limit = 300.0  # SwiGLU outputs up to (limit + 1) * limit would not fit fp16
    assert not mm.MmaGemv.takes(wide)


@pytest.mark.parametrize("swiglu", [True, False])
def test_shuffle_gives_each_lane_its_fragment_words(swiglu: bool) -> None:
    """Tile T, block pair jb, lane (g, t), word k: word t of block 2jb + k % 2 of MMA row g
    (k < 2) or g + 8, MMA rows g / g + 8 being tile rows 2g / 2g + 1 for gate_up and g / g + 8
    for down; each tile's bytes stay in the tile (also across the chunks of experts
    it shuffles at a time)."""
    e, n, nblk = 6, 32, 6
    blocks = torch.randint(0, 256, (e, n, nblk, 16), dtype=torch.uint8)
    out = mm.shuffle_blocks(blocks, swiglu)
    assert out.shape == blocks.shape and out.dtype == torch.uint8
    words = blocks.view(torch.int32)  # [e, n, nblk, 4]
    for x in range(e):
        for tile in range(n // 16):
            got = out[x, 16 * tile : 16 * tile + 16].reshape(-1).view(torch.int32)
            for jb in range(nblk // 2):
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    la, lb = (2 * g, 2 * g + 1) if swiglu else (g, g + 8)
                    for k in range(4):
                        row = 16 * tile + (lb if k // 2 else la)
                        want = words[x, row, 2 * jb + k % 2, t]
                        assert got[(jb * 32 + lane) * 4 + k] == want
    with pytest.raises(ValueError, match="rows in 16s"):
        mm.shuffle_blocks(torch.zeros(1, 24, 4, 16, dtype=torch.uint8), True)
    with pytest.raises(ValueError, match="even number of scale blocks"):
        mm.shuffle_blocks(torch.zeros(1, 32, 3, 16, dtype=torch.uint8), True)


def _real_experts(gen: torch.Generator, e: int, h: int, i: int) -> ExpertWeights:
    gb, gs = mxfp4.quantize(torch.randn(e, 2 * i, h, generator=gen) * 0.4)
    db, ds = mxfp4.quantize(torch.randn(e, h, i, generator=gen) * 0.2)
    return ExpertWeights(gb, gs, torch.randn(e, 2 * i, generator=gen), db, ds,
                         torch.randn(e, h, generator=gen))


def test_prepare_shuffles_what_the_kernels_take(monkeypatch):
    """`prepare` shuffles the blocks of experts the kernels take (and marks them), leaves others
    as they are; either way the tensors outlive the parameters `Experts.prepare` empties."""
    gen = torch.Generator().manual_seed(3)
    w = _real_experts(gen, 4, 64, 64)
    params = [torch.nn.Parameter(getattr(w, f), requires_grad=False) for f in (
        "gate_up_blocks", "gate_up_scales", "gate_up_bias", "down_blocks", "down_scales",
        "down_bias")]
    w = ExpertWeights(*params)
    copies = [p.detach().clone() for p in params]
    kept = mm.MmaGemv.prepare(w)  # fp32 biases, K 64: not for these kernels
    assert not kept.shuffled
    monkeypatch.setattr(mm.MmaGemv, "takes", staticmethod(lambda w: True))
    shuffled = mm.MmaGemv.prepare(w)
    for p in params:
        p.data = p.data.new_empty(0)
    assert shuffled.shuffled
    assert torch.equal(shuffled.gate_up_blocks, mm.shuffle_blocks(copies[0], swiglu=True))
    assert torch.equal(shuffled.down_blocks, mm.shuffle_blocks(copies[3], swiglu=False))
    for got in (kept, shuffled):
        assert torch.equal(got.gate_up_scales, copies[1]) and torch.equal(got.down_bias, copies[5])
    assert torch.equal(kept.gate_up_blocks, copies[0]) and torch.equal(kept.down_blocks, copies[3])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors in Triton's interpreter; on a "
                    "GPU test_moe_triton.py runs the grouped GEMMs on shuffled experts")
def test_grouped_gemms_read_the_shuffled_layout():
    """The grouped GEMMs (prefill) on shuffled experts give what they give on the checkpoint's
    (to fp32 rounding: the K sums run in another order), over several row tiles and K tiles, on
    both row orders (gate_up and down); the torch MoE and the Gluon/Triton pair GEMV refuse
    shuffled experts rather than misread them."""
    gen = torch.Generator().manual_seed(5)
    e, h, i, t = 8, 128, 192, 20
    w = _real_experts(gen, e, h, i)
    ws = replace(w, gate_up_blocks=mm.shuffle_blocks(w.gate_up_blocks, True),
                 down_blocks=mm.shuffle_blocks(w.down_blocks, False), shuffled=True)
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:4] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 4, generator=gen), -1)
    cfg = mt.PrefillConfig(block_m=16, block_n1=64, block_n2=32, block_k=64)
    want = mt.moe_prefill(x, weights, ids, w, cfg)
    got = mt.moe_prefill(x, weights, ids, ws, cfg)
    assert ((got - want).norm() / want.norm()).item() < 1e-6  # sums in another order
    ref = moe_torch(x, weights, ids, w)
    assert ((want - ref).norm() / ref.norm()).item() < 1e-5
    with pytest.raises(ValueError, match="shuffled for the tensor-core MoE GEMV"):
        moe_torch(x, weights, ids, ws)
    with pytest.raises(ValueError, match="shuffled for the tensor-core MoE GEMV need it"):
        mt.moe_triton(x[:2], weights[:2], ids[:2], ws)


class _Recorder:
    """Stands in for the built kernels: records its calls, computes what they compute with the
    Triton pair GEMV it replaces."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    @staticmethod
    def supports(x, w) -> bool:
        return True

    def gate_up(self, x, x_div, ids, blocks, scales, bias, wts, act, alpha, limit):
        assert ids.dtype == torch.int32
        self.calls.append(("gate_up", ids.numel()))
        self._pair(x, x_div, ids, blocks, scales, bias, wts, act, alpha, limit, swiglu=True)

    def down(self, act, ids, blocks, scales, bias, wts, y, alpha, limit):
        self.calls.append(("down", ids.numel()))
        self._pair(act, 1, ids, blocks, scales, bias, wts, y, alpha, limit, swiglu=False)

    @staticmethod
    def _pair(x, x_div, ids, blocks, scales, bias, wts, out, alpha, limit, swiglu):
        n, k = blocks.shape[1], blocks.shape[2] * 32
        mt._pair_gemv[(ids.numel(), (n + 7) // 8)](
            x, x_div, ids, blocks, scales, bias, wts, out, n, k, *mt._strides(blocks, scales),
            alpha, limit, SWIGLU=swiglu, BLOCK_N=8, BLOCK_K=64, num_warps=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in runs Triton's interpreter "
                    "on CPU tensors; on a GPU test_moe_triton.py runs the real dispatch")
@pytest.mark.parametrize("t", [1, 2, mt.GEMV_MAX_TOKENS])
def test_pair_gemv_hands_both_projections_to_the_tensor_cores(t):
    gen = torch.Generator().manual_seed(t)
    e, h, i = 8, 64, 64
    gb, gs = mxfp4.quantize(torch.randn(e, 2 * i, h, generator=gen) * 0.4)
    db, ds = mxfp4.quantize(torch.randn(e, h, i, generator=gen) * 0.2)
    w = ExpertWeights(gb, gs, torch.randn(e, 2 * i, generator=gen), db, ds,
                      torch.randn(e, h, generator=gen))
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:4] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 4, generator=gen), -1)
    fake = _Recorder()
    out = mt.moe_triton(x, weights, ids, w, mma=fake)
    assert fake.calls == [("gate_up", 4 * t), ("down", 4 * t)]
    ref = moe_torch(x, weights, ids, w)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
