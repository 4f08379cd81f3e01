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

        def supports_stream(self, x, weight, bias, scale=None) -> bool:
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


def test_fp8_streaming_gemv_takes_one_row_of_the_layers_it_supports(monkeypatch) -> None:
    """FP8 weights (e4m3) with a contiguous fp32 scale a row, one bf16 row of x, K in 16s up to
    4096 (q/k/v, o, lm_head, a tensor-parallel rank's K); not 2 rows, K 2888 (8s only), 4112 or
    8, no scale, a scale of the wrong shape or dtype, a bf16 weight with a scale, an fp32 bias.
    `fp8_linear` hands it one row of every layer it takes (lm_head too), the tensor-core GEMV
    lm_head at 2-8 rows, and the Triton GEMV the rest up to FP8_GEMV_MAX_M; the path for a row
    count and layer is the same whatever x holds (a captured graph never changes path)."""
    from tinyoss.kernels.linear_fp8_torch import fp8_linear_torch
    from tinyoss.kernels.moe_gemv_mma import MmaGemv

    ok = MmaGemv.supports_stream
    fp8, bf16, f32 = torch.float8_e4m3fn, torch.bfloat16, torch.float32
    x = torch.empty(2, 2880, dtype=bf16)
    q, s, b = (torch.empty(5120, 2880, dtype=fp8), torch.empty(5120, dtype=f32),
               torch.empty(5120, dtype=bf16))
    assert ok(x[:1], q, b, s) and ok(x[:1], q, None, s) and ok(x[1:], q, b, s)
    for n, k in ((2880, 4096), (201088, 2880), (2560, 2880), (2880, 2048), (7, 16)):
        assert ok(torch.empty(1, k, dtype=bf16), torch.empty(n, k, dtype=fp8), None,
                  torch.empty(n, dtype=f32)), (n, k)
    assert not ok(x, q, b, s)  # 2 rows
    for k in (2888, 4112, 8):
        assert not ok(torch.empty(1, k, dtype=bf16), torch.empty(64, k, dtype=fp8), None,
                      torch.empty(64, dtype=f32)), k
    assert not ok(x[:1], q, b, None) and not ok(x[:1], q, b, s[:-1])
    assert not ok(x[:1], q, b, s[:, None]) and not ok(x[:1], q, b, s.to(bf16))
    assert not ok(x[:1], torch.empty(5120, 2880, dtype=bf16), b, s)
    assert not ok(x[:1], q, b.float(), s) and not ok(x[:1].float(), q, b, s)
    assert not ok(torch.empty(2888, dtype=bf16)[4:].view(1, 2884)[:, :2880], q, None, s)

    calls = []

    class Recorder:
        def supports_stream(self, x, weight, bias, scale=None) -> bool:
            return MmaGemv.supports_stream(x, weight, bias, scale)

        def stream_linear(self, x, weight, bias=None, scale=None):
            calls.append("stream")
            return fp8_linear_torch(x, weight, scale, bias)

        def supports_linear(self, x, weight, scale, bias) -> bool:
            return True

        def linear(self, x, weight, bias=None, scale=None):
            calls.append("mma")
            return fp8_linear_torch(x, weight, scale, bias)

    def triton_gemv(x, weight, bias=None, config=None, scale=None):
        calls.append("triton")
        return fp8_linear_torch(x, weight, scale, bias)

    monkeypatch.setattr(lt, "linear_gemv", triton_gemv)
    gen = torch.Generator().manual_seed(7)

    def layer(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w = torch.randn(n, k, generator=gen).to(fp8)
        return w, torch.rand(n, generator=gen) + 0.5, torch.randn(n, generator=gen).to(bf16)

    narrow, wide, k40 = layer(64, 64), layer(lt.MMA_MIN_N, 64), layer(64, 40)
    for (w, sc, bias), m, path in (
            (narrow, 1, "stream"), (wide, 1, "stream"), (k40, 1, "triton"),
            (narrow, 2, "triton"), (wide, 2, "mma"), (wide, 8, "mma"), (narrow, 8, "triton"),
            (wide, 9, None)):  # 9 rows: cuBLAS on bf16 slices
        k = w.shape[1]  # the path does not depend on what x holds
        for x in (torch.randn(m, k, generator=gen).to(bf16), torch.zeros(m, k, dtype=bf16)):
            calls.clear()
            out = lt.fp8_linear(x, w, sc, bias, mma=Recorder())
            assert out.shape == (m, w.shape[0])
            assert rel(out, fp8_linear_torch(x.float(), w, sc, bias)) < 1e-2
            assert calls == ([path] if path else []), (w.shape, m, calls)
    calls.clear()
    lt.fp8_linear(torch.randn(1, 64, generator=gen).to(bf16), *narrow[:2], None, mma=None)
    assert calls == ["triton"]  # no library: the Triton GEMV


@gpu
@pytest.mark.parametrize("n,k", [(5120, 2880), (2880, 4096), (201088, 2880), (1441, 2880),
                                 (2561, 1040), (13, 4096), (7, 16)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fp8_streaming_gemv_gpu(n: int, k: int, with_bias: bool, mma) -> None:
    """The FP8 streaming GEMV against `fp8_linear_torch` (fp32) and against its dequantize-then-
    F.linear in fp64 (exact here) on q/k/v, o and lm_head shapes, rows not in the 8s a block
    takes, K of a partly used last load (1040, 2880) and 16 (one 16-byte vector a row); and
    `fp8_linear` at one row takes it.

    Tolerance against fp64, per output: the kernel's fp32 value v sums exact products (e4m3 and
    bf16 are exact in fp32) in at most 128 FMAs a lane, 5 shuffle adds, then the scale and the
    bias: within 135 * 2**-24 < 2**-16.9 of sum|x_k w_k| + |b|; the bf16 output is v rounded
    to nearest, at most 2**-8 |v| off. So |out - ref| <= 2**-8 |ref| + 2**-15 (sum|x_k w_k| +
    |b|), with margin. Against fp32 `fp8_linear_torch`: rtol 1e-2, atol 1e-2. Replayed from a
    CUDA graph on a new x, the same."""
    from tinyoss.kernels.linear_fp8_torch import fp8_linear_torch
    from tinyoss.model.quant_linear import quantize_fp8

    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    q, s = quantize_fp8(torch.randn(n, k, device="cuda") * 0.02)
    b = torch.randn(n, device="cuda").to(torch.bfloat16) if with_bias else None
    w64 = q.float().double() * s.double()[:, None]
    b64 = None if b is None else b.double()

    def check(out: torch.Tensor) -> None:
        assert out.dtype == torch.bfloat16 and out.shape == (1, n)
        torch.testing.assert_close(out.float(), fp8_linear_torch(x.float(), q, s, b),
                                   rtol=1e-2, atol=1e-2)
        x64 = x.double()
        ref = F.linear(x64, w64, b64)
        mag = F.linear(x64.abs(), w64.abs(), None if b64 is None else b64.abs())
        err = (out.double() - ref).abs()
        bound = 2**-8 * ref.abs() + 2**-15 * mag
        assert (err <= bound).all(), f"worst {(err - bound).max().item():.3g} over the bound"

    assert mma.supports_stream(x, q, b, s)
    out = mma.stream_linear(x, q, b, s)
    check(out)
    assert torch.equal(lt.fp8_linear(x, q, s, b, mma=mma), out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mma.stream_linear(x, q, b, s)
    x.copy_(torch.randn_like(x) * 100)
    graph.replay()
    torch.cuda.synchronize()
    check(out)


@gpu
def test_fp8_streaming_gemv_refuses_gpu(mma) -> None:
    """K not in 16s, K above 4096 and a scale of the wrong shape fail `supports_stream` (so
    `fp8_linear` takes the Triton GEMV), and the library's entry refuses such K itself,
    returning cudaErrorInvalidValue (1) without writing the output."""
    from tinyoss.model.quant_linear import quantize_fp8

    for k in (2888, 4112):
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        q, s = quantize_fp8(torch.randn(64, k, device="cuda"))
        assert not mma.supports_stream(x, q, None, s)
        out = torch.full((1, 64), 7.0, dtype=torch.bfloat16, device="cuda")
        err = mma.fp8_stream_fn(x.data_ptr(), q.data_ptr(), s.data_ptr(), None, out.data_ptr(),
                                64, k, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert err == 1 and (out == 7).all()
        want = F.linear(x.float(), q.float() * s[:, None])
        assert rel(lt.fp8_linear(x, q, s, None, mma=mma), want) < 1e-2
    x = torch.randn(1, 2880, device="cuda").to(torch.bfloat16)
    q, s = quantize_fp8(torch.randn(64, 2880, device="cuda"))
    assert mma.supports_stream(x, q, None, s)
    assert not mma.supports_stream(x, q, None, s[:-1]) and not mma.supports_stream(x, q, None,
                                                                                   s[:, None])


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
