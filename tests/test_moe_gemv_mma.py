"""The tensor-core MoE GEMV's choices, on CPU: where it can run, which shapes it takes, and that
the pair GEMV hands it gate_up from GATE_UP_MIN_TOKENS and down from `down_min_tokens` tokens on.
Its numerics are tested on the GPU (tests/test_moe_triton.py: against the Gluon kernel and
`moe_torch`)."""

from __future__ import annotations

import os

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


def test_supports_gpt_oss_shapes_in_bf16_only():
    x = torch.empty(4, 2880, dtype=torch.bfloat16, device="meta")
    assert mm.MmaGemv.supports_down(x, _experts(32, 2880, 2880, torch.bfloat16))
    assert not mm.MmaGemv.supports_down(x.float(), _experts(32, 2880, 2880, torch.bfloat16))
    assert not mm.MmaGemv.supports_down(x, _experts(32, 2880, 2880, torch.float32))
    small = torch.empty(4, 96, dtype=torch.bfloat16, device="meta")
    assert not mm.MmaGemv.supports_down(small, _experts(8, 96, 64, torch.bfloat16))
    big = torch.empty(4, 5760, dtype=torch.bfloat16, device="meta")  # x is staged for K <= 2880
    assert not mm.MmaGemv.supports_down(big, _experts(8, 5760, 2880, torch.bfloat16))
    assert not mm.MmaGemv.supports_down(x, _experts(8, 2880, 5760, torch.bfloat16))  # down's K
    wide = _experts(32, 2880, 2880, torch.bfloat16)
    wide.limit = 300.0  # SwiGLU outputs up to (limit + 1) * limit would not fit fp16
    assert not mm.MmaGemv.supports_down(x, wide)
    assert mm.MmaGemv.supports_grouped(x, _experts(32, 2880, 2880, torch.bfloat16))
    for ranks, blocks in ((2, 45), (4, 23), (8, 12)):  # a tensor-parallel rank's experts
        shard = _experts(32, 2880, 32 * blocks, torch.bfloat16)
        assert mm.MmaGemv.supports_gate_up(x, shard), ranks
        assert mm.MmaGemv.supports_down(x, shard), ranks  # the pair kernel cuts its last group
        assert mm.MmaGemv.supports_grouped(x, shard), ranks  # so does the grouped one
        # one token's down here (launched early behind gate_up) on TP 2's share, Gluon's on less
        assert mm.MmaGemv.down_min_tokens(shard) == (1 if ranks == 2 else 2), ranks
    assert mm.MmaGemv.down_min_tokens(_experts(32, 2880, 2880, torch.bfloat16)) == 1  # one GPU
    assert not mm.MmaGemv.supports_grouped(x, _experts(32, 2816, 2880, torch.bfloat16))


class _Recorder:
    """Stands in for the built kernels: records its calls, computes what they compute with the
    Triton pair GEMV it replaces."""

    def __init__(self, down: bool = True) -> None:
        self.calls: list[tuple[str, int]] = []
        self.takes_down = down

    @staticmethod
    def supports_gate_up(x, w) -> bool:
        return True

    def supports_down(self, x, w) -> bool:
        return self.takes_down

    down_min_tokens = staticmethod(mm.MmaGemv.down_min_tokens)

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
@pytest.mark.parametrize("takes_down", [True, False])
@pytest.mark.parametrize("t", [1, mm.DOWN_MIN_TOKENS, mt.GEMV_MAX_TOKENS])
def test_pair_gemv_hands_both_projections_to_the_tensor_cores(t, takes_down):
    """Each projection goes to the tensor cores where they take it (a tensor-parallel rank's
    down does not), the other to Gluon's kernel; the sum is the same."""
    gen = torch.Generator().manual_seed(t)
    e, h, i = 8, 64, 64
    gb, gs = mxfp4.quantize(torch.randn(e, 2 * i, h, generator=gen) * 0.4)
    db, ds = mxfp4.quantize(torch.randn(e, h, i, generator=gen) * 0.2)
    w = ExpertWeights(gb, gs, torch.randn(e, 2 * i, generator=gen), db, ds,
                      torch.randn(e, h, generator=gen))
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:4] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 4, generator=gen), -1)
    fake = _Recorder(down=takes_down)
    out = mt.moe_triton(x, weights, ids, w, mma=fake)
    want = [("gate_up", 4 * t)] * (t >= mm.GATE_UP_MIN_TOKENS)
    want += [("down", 4 * t)] * (t >= fake.down_min_tokens(w) and takes_down)
    assert fake.calls == want
    ref = moe_torch(x, weights, ids, w)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
