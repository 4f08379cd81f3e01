"""The FP8 streaming GEMV (`fp8_stream.cu`) against the product's FP8 path at one row of x (the
Triton GEMV, `linear_triton.fp8_linear`) and the bf16 streaming GEMV on the same layer in bf16,
at gpt-oss-20b's q/k/v, o and lm_head shapes, on one GPU (sm_90, nvcc). Prepared in session 21
(no GPU time left); not yet run.

    python bench/experiments/fp8_stream/bench.py

Each kernel replays from a CUDA graph over 4 weight sets (L2 holds none; lm_head: 1). Errors are
against fp32 on the dequantized weights; bandwidth counts the weight bytes read.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from dense_gemv import graph_time  # noqa: E402
from tinyoss.kernels import linear_triton as lt  # noqa: E402
from tinyoss.kernels.hardware import capability  # noqa: E402
from tinyoss.kernels.moe_gemv_mma import load  # noqa: E402
from tinyoss.model.quant_linear import quantize_fp8  # noqa: E402

SOURCE = Path(__file__).with_name("fp8_stream.cu")
SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "lm_head": (201088, 2880)}


def build() -> ctypes.CDLL:
    out = Path(tempfile.mkdtemp()) / "fp8_stream.so"
    subprocess.run(["nvcc", "-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17",
                    "-gencode=arch=compute_90a,code=sm_90a", str(SOURCE), "-o", str(out)],
                   check=True)
    lib = ctypes.CDLL(str(out))
    lib.fp8_stream_gemv.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 5 + [
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return lib


def main() -> None:
    lib = build()
    dev = torch.device("cuda")
    mma, why = load(capability(dev))
    assert mma is not None, why
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)  # noqa: E731

    def fp8_stream(rows, x, q, s, b, out):
        rc = lib.fp8_stream_gemv(rows, x.data_ptr(), q.data_ptr(), s.data_ptr(),
                                 b.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1], stream())
        if rc:
            raise RuntimeError(f"fp8_stream_gemv returned {rc}")
        return out

    for name, (n, k) in SHAPES.items():
        sets = 1 if name == "lm_head" else 4
        ws = [(torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16) for _ in range(sets)]
        qs = [quantize_fp8(w) for w in ws]
        bs = [torch.randn(n, device=dev).to(torch.bfloat16) for _ in range(sets)]
        x = torch.randn(1, k, device=dev).to(torch.bfloat16)
        out = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
        q0, s0 = qs[0]
        ref = F.linear(x.float(), q0.float() * s0[:, None], bs[0].float())

        def err(y):
            return ((y.float() - ref).norm() / ref.norm()).item()

        mb8, mb16 = n * k / 1e6, n * k * 2 / 1e6
        t = graph_time(lambda: [lt.fp8_linear(x, q, s, b, mma=mma)
                                for (q, s), b in zip(qs, bs)], sets)  # fmt: skip
        print(f"{name:7s} FP8 product (Triton GEMV) {t:8.2f} us {mb8 / t * 1e3:5.0f} GB/s  "
              f"err {err(lt.fp8_linear(x, q0, s0, bs[0], mma=mma)):.1e}", flush=True)
        t = graph_time(lambda: [mma.stream_linear(x, w, b) for w, b in zip(ws, bs)], sets)
        print(f"{name:7s} bf16 streaming GEMV      {t:8.2f} us {mb16 / t * 1e3:5.0f} GB/s",
              flush=True)
        for rows in (2, 4, 8):
            e = err(fp8_stream(rows, x, q0, s0, bs[0], out))
            t = graph_time(lambda: [fp8_stream(rows, x, q, s, b, out)
                                    for (q, s), b in zip(qs, bs)], sets)  # fmt: skip
            print(f"{name:7s} FP8 stream, {rows} rows/warp  {t:8.2f} us "
                  f"{mb8 / t * 1e3:5.0f} GB/s  err {e:.1e}", flush=True)


if __name__ == "__main__":
    main()
