"""The batch-1 MoE (one token's 4 experts: gate_up, SwiGLU, down) as one persistent launch whose
rows stream through a shared-memory ring read by the tensor-core pair decode (`moe_ring.cu`),
against the product's two launches (the tensor-core pair gate_up, Gluon's down: what a batch-1
step runs). Microseconds a call from CUDA graphs over 4 rotating weight sets; each output
against the product's.

    python bench/experiments/persistent_layer/moe_ring.py [--variants 7107,7207,6307]
"""

from __future__ import annotations

import argparse
import ctypes
import struct
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.moe_kernels import timed, weights  # noqa: E402
from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels.moe_gemv_mma import load  # noqa: E402

from ring_build import build_lib  # noqa: E402  (beside this file)

H = I = 2880
TRACED = {7107, 7207, 6307}  # variants with a traced build (+ 10000)


def build() -> ctypes.CDLL:
    lib = build_lib("moe_ring.cu")
    lib.moe_ring_launch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.moe_ring_trace.argtypes = [ctypes.c_void_p]
    assert lib.moe_ring_args_bytes() == 14 * 8 + 8
    return lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="7107,7207,6307,7307",
                   help="tiles at once x 1000 + warps a tile x 100 + slots")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--trace", action="store_true",
                   help="and a traced launch of each variant in TRACED: where its warps' time goes")
    args = p.parse_args()
    dev = torch.device("cuda")
    mma, why = load(torch.cuda.get_device_capability(dev))
    assert mma is not None, why
    lib = build()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    sets = []
    for seed in range(4):
        w = weights(seed, args.experts, H, I)
        w = replace(w, gate_up_bias=w.gate_up_bias.to(torch.bfloat16),
                    down_bias=w.down_bias.to(torch.bfloat16))
        x = torch.randn(1, H, device=dev, generator=gen).to(torch.bfloat16)
        ids = torch.randperm(args.experts, device=dev, generator=gen)[:4].to(torch.int32)
        wts = torch.softmax(torch.randn(1, 4, device=dev, generator=gen), -1)
        act = torch.empty(4, I, device=dev)
        hx = torch.empty(4 * 2 * (I // 8) * 4, dtype=torch.int32, device=dev)
        y = torch.empty(4, H, device=dev)
        count = torch.zeros(4 + 2, dtype=torch.int32, device=dev)  # + the epoch's two
        raw = struct.pack("14Qff", x.data_ptr(), ids.data_ptr(), wts.data_ptr(),
                          w.gate_up_blocks.data_ptr(), w.gate_up_scales.data_ptr(),
                          w.gate_up_bias.data_ptr(), w.down_blocks.data_ptr(),
                          w.down_scales.data_ptr(), w.down_bias.data_ptr(), act.data_ptr(),
                          hx.data_ptr(), y.data_ptr(), count.data_ptr(), count[4:].data_ptr(),
                          w.alpha, w.limit)
        sets.append(dict(w=w, x=x, ids=ids[None], wts=wts, y=y, act=act, count=count,
                         raw=ctypes.create_string_buffer(raw, len(raw))))
    mb = 4 * (2 * I + H) * (H // 32) * 17 / 1e6
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731

    def product(s):
        return mt._gemv_pairs(s["x"], s["wts"], s["ids"], s["w"], None, mma)

    def ring(variant):
        def run(s):
            err = lib.moe_ring_launch(ctypes.addressof(s["raw"]), variant, sms, stream())
            assert not err, f"launch failed: {err}"
        return run

    print(f"{torch.cuda.get_device_name()} | {sms} SMs | one token, 4 of {args.experts} experts,"
          f" {mb:.1f} MB a call (gate_up + down)", flush=True)
    us = timed(product, [(s,) for s in sets])
    print(f"  product (tensor-core gate_up + Gluon down)  {us:7.2f} us  {mb / us * 1e3:5.0f} GB/s",
          flush=True)
    for v in map(int, args.variants.split(",")):
        worst = 0.0
        for s in sets:
            want = product(s)
            ring(v)(s)
            torch.cuda.synchronize()
            err = ((s["y"] - want).norm() / want.norm()).item()
            worst = max(worst, err) if err == err else float("inf")
        us = timed(ring(v), [(s,) for s in sets])
        print(f"  ring, {v // 1000} tiles at once x {v // 100 % 10} warps a tile, {v % 100} slots"
              f"  {us:7.2f} us  "
              f"{mb / us * 1e3:5.0f} GB/s | y against the product's: {worst:.1e}", flush=True)
        assert worst < 1e-3, worst
        if args.trace and v in TRACED:
            trace(lib, v, sets[0], sms, stream())


def trace(lib: ctypes.CDLL, v: int, s: dict, sms: int, stream: int) -> None:
    """One traced launch of variant v: means over programs (us) of each consumer warp's time
    waiting for full slots, computing, waiting for down's x, and the producer's for free slots."""
    err = lib.moe_ring_launch(ctypes.addressof(s["raw"]), v + 10000, sms, stream)
    assert not err, f"launch failed: {err}"
    torch.cuda.synchronize()
    raw = torch.empty(264 * 33 * 4, dtype=torch.int64)
    assert not lib.moe_ring_trace(raw.data_ptr())
    t = raw.view(264, 33, 4)[:sms].double()
    ns = ((t[:, 32, 3] - t[:, 32, 2]) / (t[:, 32, 1] - t[:, 32, 0])).mean().item()
    nw = (v // 1000) * (v // 100 % 10)
    us = lambda x: x.mean().item() * ns / 1e3  # noqa: E731
    w = t[:, :nw]
    span = ((t[:, 32, 3] - t[:, 32, 2]) / 1e3)
    print(f"    trace ({ns:.3f} ns a cycle): a program's span {span.mean().item():.2f} us (max "
          f"{span.max().item():.2f}); a consumer warp: waiting for full slots {us(w[..., 0]):.2f},"
          f" computing {us(w[..., 1]):.2f}, waiting for down's x {us(w[..., 2]):.2f} us, "
          f"{w[..., 3].mean().item():.1f} tiles ({us(w[..., 1] / w[..., 3].clamp(min=1)):.2f} us"
          f" a tile); the producer waiting for free slots {us(t[:, nw, 0]):.2f} us", flush=True)


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):
        main()
