"""The bf16 decode GEMV (`linear_triton`) against F.linear: in the Triton interpreter on CPU
(fp32, ragged N and K tiles) and at gpt-oss shapes on a GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tinyoss.kernels import linear_triton as lt

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.skipif(CUDA, reason="small fp32 cases run in the Triton interpreter")
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_f_linear(m: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 200, generator=gen), torch.randn(37, 200, generator=gen)
    b = torch.randn(37, generator=gen) if with_bias else None
    cfg = lt.GemvConfig(block_m=lt.gemv_config(m, 37).block_m, block_n=8, block_k=64)
    out = lt.linear_gemv(x, w, b, cfg)
    assert out.shape == (m, 37) and rel(out, F.linear(x, w, b)) < 1e-5


def test_dispatch_and_shape_errors() -> None:
    x, w = torch.randn(5, 64), torch.randn(16, 64)
    assert torch.allclose(lt.linear_triton(x, w), F.linear(x, w))  # above GEMV_MAX_M: torch
    with pytest.raises(ValueError, match="do not fit"):
        lt.linear_gemv(torch.randn(1, 65), w)


@gpu
@pytest.mark.parametrize("n,k", [(5120, 2880), (2880, 4096), (32, 2880), (201088, 2880)])
def test_gpt_oss_shapes_gpu(n: int, k: int) -> None:
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    b = torch.randn(n, device="cuda").to(torch.bfloat16)
    assert rel(lt.linear_gemv(x, w, b), F.linear(x.float(), w.float(), b.float())) < 1e-2


@gpu
@pytest.mark.parametrize("n,k", [(5120, 2880), (2880, 4096), (201088, 2880)])
@pytest.mark.parametrize("m", [1, 4])
def test_fp8_gpt_oss_shapes_gpu(n: int, k: int, m: int) -> None:
    """The FP8 GEMV (`fp8_layers`) against fp32 on the dequantized weights."""
    from tinyoss.model.quant_linear import quantize_fp8

    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    q, s = quantize_fp8(torch.randn(n, k, device="cuda") * 0.02)
    b = torch.randn(n, device="cuda").to(torch.bfloat16)
    want = F.linear(x.float(), q.float() * s[:, None], b.float())
    assert rel(lt.fp8_linear(x, q, s, b), want) < 1e-2


# -- the tensor-core GEMV (moe_gemv_mma) on dense layers ---------------------------------------


@pytest.mark.skipif(CUDA, reason="the unrouted cases run the Triton GEMV on CPU tensors, which "
                    "only the interpreter takes")
def test_tensor_core_gemv_takes_the_layers_it_supports() -> None:
    """bf16 or FP8 (with its row scales) weights of K and rows in 64s for 1-8 bf16 rows; not the
    router (32 rows), fp32 activations, FP8 without scales or bf16 with them, nor 9 rows; and
    `linear_triton` / `fp8_linear` hand it the rows in MMA_ROWS."""
    from tinyoss.kernels.moe_gemv_mma import MmaGemv

    meta = "meta"
    x = torch.empty(8, 2880, dtype=torch.bfloat16, device=meta)
    w = torch.empty(5120, 2880, dtype=torch.bfloat16, device=meta)
    q = torch.empty(5120, 2880, dtype=torch.float8_e4m3fn, device=meta)
    s = torch.empty(5120, dtype=torch.float32, device=meta)
    b = torch.empty(5120, dtype=torch.bfloat16, device=meta)
    assert MmaGemv.supports_linear(x, w, None, b) and MmaGemv.supports_linear(x[:1], w, None, None)
    assert MmaGemv.supports_linear(x, q, s, b)
    assert not MmaGemv.supports_linear(x, q, None, b) and not MmaGemv.supports_linear(x, w, s, b)
    assert not MmaGemv.supports_linear(torch.empty(9, 2880, dtype=torch.bfloat16, device=meta),
                                       w, None, b)
    assert not MmaGemv.supports_linear(x.float(), w, None, b)
    assert not MmaGemv.supports_linear(x, w[:32], None, None)  # the router

    class Recorder:
        def __init__(self) -> None:
            self.calls = []

        def supports_linear(self, x, weight, scale, bias) -> bool:
            return True

        def supports_stream(self, x, weight, bias) -> bool:
            return False

        def linear(self, x, weight, bias=None, scale=None):
            self.calls.append((x.shape[0], scale is not None))
            w = weight.float() * (1 if scale is None else scale[:, None])
            return F.linear(x.float(), w, None if bias is None else bias.float())

    gen = torch.Generator().manual_seed(3)
    wide = lt.MMA_MIN_N
    for m, n, fp8, routed in ((2, wide, False, True), (4, wide, False, True),
                              (9, wide, False, False), (2, 16, False, False),
                              (1, 16, False, False), (2, wide, True, True),
                              (8, wide, True, True)):
        x, w, b = (torch.randn(m, 64, generator=gen), torch.randn(n, 64, generator=gen),
                   torch.randn(n, generator=gen))
        fake = Recorder()
        if fp8:
            scale = torch.rand(n, generator=gen) + 0.5
            out, want = lt.fp8_linear(x, w, scale, b, mma=fake), F.linear(x, w * scale[:, None], b)
        else:
            out, want = lt.linear_triton(x, w, b, mma=fake), F.linear(x, w, b)
        assert rel(out, want) < 1e-5
        assert fake.calls == ([(m, fp8)] if routed else [])


@pytest.mark.skipif(CUDA, reason="the unrouted cases run the Triton GEMV on CPU tensors, which "
                    "only the interpreter takes")
def test_streaming_gemv_takes_the_rows_and_layers_it_supports() -> None:
    """1-2 contiguous bf16 rows of x, 16-byte aligned, K in 8s up to 4096 (q/k/v, o, lm_head
    and their tensor-parallel shares); not 3 rows, fp32, K 4104 or 2884, an unaligned view of x;
    and `linear_triton` hands it every layer at one row and those below MMA_MIN_N rows at two
    (lm_head keeps the tensor-core GEMV at 2-4; cuBLAS takes 3 rows of q/k/v)."""
    from tinyoss.kernels.moe_gemv_mma import MmaGemv

    ok = MmaGemv.supports_stream
    w = torch.empty(5120, 2880, dtype=torch.bfloat16)
    x = torch.empty(3, 2880, dtype=torch.bfloat16)
    b = torch.empty(5120, dtype=torch.bfloat16)
    assert ok(x[:1], w, b) and ok(x[:1], w, None) and ok(x[1:2], w, b) and ok(x[:2], w, b)
    for n, k in ((2880, 4096), (201088, 2880), (2560, 2880), (2880, 2048), (2880, 512)):
        assert ok(torch.empty(1, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16),
                  None), (n, k)
    assert not ok(x, w, b) and not ok(x[:1].float(), w.float(), None)
    for k in (4104, 2884):
        assert not ok(torch.empty(1, k, dtype=torch.bfloat16),
                      torch.empty(64, k, dtype=torch.bfloat16), None)
    assert not ok(torch.empty(2888, dtype=torch.bfloat16)[4:].view(1, 2884)[:, :2880], w, None)
    assert not ok(x[:1], w, b.float())

    class Recorder:
        def __init__(self) -> None:
            self.calls = []

        def supports_stream(self, x, weight, bias) -> bool:
            return MmaGemv.supports_stream(x, weight, bias)

        def stream_linear(self, x, weight, bias=None):
            self.calls.append(tuple(weight.shape))
            return F.linear(x.float(), weight.float(), bias).to(x.dtype)

        def supports_linear(self, x, weight, scale, bias) -> bool:
            return True

        def linear(self, x, weight, bias=None, scale=None):
            self.calls.append(("mma", x.shape[0]))
            return F.linear(x.float(), weight.float(), bias).to(x.dtype)

    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(lt.MMA_MIN_N, 64, generator=gen).to(torch.bfloat16)
    narrow = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    fake = Recorder()
    out = lt.linear_triton(x[:1], narrow, None, mma=fake)
    assert rel(out, F.linear(x[:1].float(), narrow.float())) < 1e-2
    for m in (1, 2, 3):
        lt.linear_triton(x[:m], wide, None, mma=fake)
        lt.linear_triton(x[:m], narrow, None, mma=fake)  # 3: cuBLAS
    wide_n = lt.MMA_MIN_N
    assert fake.calls == [(64, 64), (wide_n, 64), (64, 64), ("mma", 2), (64, 64), ("mma", 3)]


@gpu
@pytest.mark.parametrize("n,k", [(5120, 2880), (2880, 4096), (201088, 2880), (2560, 2880),
                                 (2880, 2048), (2880, 1024), (1441, 512), (7, 2880)])
@pytest.mark.parametrize("m", [1, 2])
def test_streaming_gemv_gpu(n: int, k: int, m: int, mma) -> None:
    """bf16 outputs against fp32 on the same bf16 values, each row of x on its own (the last
    one 1e3 times larger), bias or none, odd row counts and a tensor-parallel rank's K (2048,
    1024, 512), 1-2 rows of x; replayed from a CUDA graph on new inputs."""
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    x[-1] *= 1e3
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    b = torch.randn(n, device="cuda").to(torch.bfloat16)
    assert mma.supports_stream(x, w, b)
    out = mma.stream_linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    want = F.linear(x.float(), w.float(), b.float())
    assert all(rel(out[i], want[i]) < 1e-2 for i in range(m))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mma.stream_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    want = F.linear(x.float(), w.float())
    assert all(rel(out[i], want[i]) < 1e-2 for i in range(m))


@gpu
@pytest.mark.parametrize("n,k", [(5120, 2880), (2880, 4096), (201088, 2880)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_tensor_core_gemv_gpu(n: int, k: int, fp8: bool, m: int, mma) -> None:
    """bf16 outputs against fp32 on the (dequantized) weights, each row of x a column of the
    MMA, FP8 activations at x * 1e3 too (staged times a power of two a column); and replayed
    from a CUDA graph on new inputs."""
    from tinyoss.model.quant_linear import quantize_fp8

    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    x[-1] *= 1e3
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    b = torch.randn(n, device="cuda").to(torch.bfloat16)
    q, s = quantize_fp8(w.float()) if fp8 else (w, None)
    wf = q.float() * s[:, None] if fp8 else w.float()
    out = mma.linear(x, q, b, s)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert rel(out, F.linear(x.float(), wf, b.float())) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mma.linear(x, q, None, s)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, F.linear(x.float(), wf)) < 1e-2
