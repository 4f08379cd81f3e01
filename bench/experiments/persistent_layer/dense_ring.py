"""A batch-1 bf16 GEMV (q/k/v, o) through a shared-memory ring consumed on the tensor cores
(`dense_ring.cu`), alone and after a stand-in wait while its ring fills, against the product's
streaming CUDA-core GEMV (`dense_gemv_stream`). Microseconds a call from CUDA graphs over 4
rotating weight sets; each output against torch in fp32.

    python bench/experiments/persistent_layer/dense_ring.py [--variants 12/12/480/1,..] \
        [--delay 4000]

`ring after a wait - wait` is what the GEMV adds to the step when the phase before it (attention)
takes the wait: the product's GEMV adds its whole time.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.moe_kernels import timed  # noqa: E402
from tinyoss.kernels.moe_gemv_mma import load  # noqa: E402

from ring_build import build_lib  # noqa: E402  (beside this file)

SHAPES = {"q/k/v": (5120, 2880), "o": (2880, 4096)}
# consumer warps / slots / K chunk (values; one bulk copy a row) / mode (bit 0: the MMAs, else
# none; bits 1-2: 0 rows padded by 16 bytes, 1 rows 128-byte aligned, 2 tiled: a unit of 16 rows
# x the chunk contiguous in memory, one copy, swizzled), a shape's variants
VARIANTS = {
    "q/k/v": "12/12/480/1,6/6/960/0,10/10/576/4,10/10/576/5,6/6/960/4,6/6/960/5,16/16/320/4,"
             "16/16/320/5",
    "o": "12/12/512/1,6/6/1024/0,12/12/512/4,12/12/512/5,6/6/1024/4,6/6/1024/5,16/16/256/4,"
         "16/16/256/5"}
LAYOUTS = ("", ", ALIGNED", ", TILED")


def tiled(w: torch.Tensor, ck: int) -> torch.Tensor:
    """w [N, K] as dense_ring.cu's TILED units: [N / 16][K / ck][16][ck], each row's 16-byte
    chunks XOR-swizzled within 128 bytes by the row's index in its tile."""
    n, k = w.shape
    t = w.view(n // 16, 16, k // ck, ck // 64, 8, 8).permute(0, 2, 1, 3, 4, 5)
    r, p = torch.arange(16, device=w.device), torch.arange(8, device=w.device)
    idx = (p[None, :] ^ (r[:, None] & 7)).view(1, 1, 16, 1, 8, 1).expand(t.shape)
    return t.gather(4, idx).contiguous().view(n, k)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="", help="warps/slots/chunk/math,... for every shape "
                   "(default: VARIANTS, a list a shape)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="of " + ",".join(SHAPES))
    p.add_argument("--delay", type=int, default=4000, help="ns of the stand-in wait")
    args = p.parse_args()
    dev = torch.device("cuda")
    mma, why = load(torch.cuda.get_device_capability(dev))
    assert mma is not None, why
    lib = build_lib("dense_ring.cu")
    lib.dense_ring_launch.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 8 + [
        ctypes.c_void_p]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    print(f"{torch.cuda.get_device_name()} | {sms} SMs | stand-in wait {args.delay} ns", flush=True)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        gen = torch.Generator(device=dev).manual_seed(n)
        sets = [((torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(torch.bfloat16),
                 torch.randn(k, device=dev, generator=gen).to(torch.bfloat16),
                 torch.empty(n, device=dev, dtype=torch.bfloat16)) for _ in range(4)]
        mb = n * k * 2 / 1e6

        def product(w, x, out, n=n, k=k):
            err = mma.stream_fn(x.data_ptr(), 1, w.data_ptr(), None, out.data_ptr(), n, k,
                                stream())
            assert not err, err

        us = timed(product, sets)
        print(f"== {name} [{n}, {k}], {mb:.1f} MB: the product's streaming GEMV {us:6.2f} us "
              f"({mb / us * 1e3:.0f} GB/s)", flush=True)
        for spec in (args.variants or VARIANTS[name]).split(","):
            v = tuple(map(int, spec.split("/")))

            layout = v[3] >> 1
            wt = {w.data_ptr(): tiled(w, v[2]) for w, _, _ in sets} if layout == 2 else {}

            def ring(w, x, out, v=v, delay=0, n=n, k=k, wt=wt):
                err = lib.dense_ring_launch(wt.get(w.data_ptr(), w).data_ptr(), x.data_ptr(),
                                            out.data_ptr(), n, k, delay, *v, sms, stream())
                assert not err, f"launch of {v} failed: {err}"

            worst = 0.0
            for w, x, out in sets:
                ring(w, x, out)
                torch.cuda.synchronize()
                want = w.float() @ x.float()
                worst = max(worst, ((out.float() - want).norm() / want.norm()).item())
            alone = timed(ring, sets)
            waited = timed(lambda w, x, out, v=v: ring(w, x, out, v, args.delay), sets)
            rows_a_copy = 16 if layout == 2 else 1
            copies = n * k // v[2] / sms / rows_a_copy
            print(f"  ring, {v[0]} consumer warps, {v[1]} slots, {v[2] * 2 * rows_a_copy} B a copy "
                  f"({copies:.0f} copies an SM){'' if v[3] & 1 else ', NO MATH'}"
                  f"{LAYOUTS[layout]}: alone {alone:6.2f} "
                  f"us ({mb / alone * 1e3:.0f} GB/s); after the wait {waited:6.2f} us, - wait = "
                  f"{waited - args.delay / 1e3:6.2f} | error against fp32 {worst:.1e}",
                  flush=True)
            assert worst < 1e-2 or not v[3] & 1, worst


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):
        main()
