"""The batch-1 MoE in one persistent launch (token_moe.cu) against the engine's two launches
(tensor-core gate_up, Gluon down), gpt-oss-20b shapes: errors of the pair outputs y [4, H]
against the engine's, microseconds a call replayed from CUDA graphs over 4 rotating weight sets.

    python bench/experiments/mma_gemv/token_bench.py
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.moe_kernels import call_sets, timed, weights  # noqa: E402
from tinyoss.kernels import moe_gemv_mma as mm  # noqa: E402
from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels.hardware import capability  # noqa: E402

P = ctypes.c_void_p
ARGS = [ctypes.c_int, P, P, ctypes.c_int, P, P, P, P, P, P, P, P, P, P, ctypes.c_int,
        ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_long, ctypes.c_long,
        ctypes.c_int, ctypes.c_long, ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int, P]


def build() -> ctypes.CDLL:
    out = Path(tempfile.mkdtemp()) / "token_moe.so"
    subprocess.run([mm._nvcc(), "-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17",
                    "-gencode=arch=compute_90a,code=sm_90a",
                    str(Path(__file__).with_name("token_moe.cu")), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.tinyoss_token_moe.argtypes, lib.tinyoss_token_moe.restype = ARGS, ctypes.c_int
    lib.tinyoss_token_moe_name.argtypes = [ctypes.c_int]
    lib.tinyoss_token_moe_name.restype = ctypes.c_char_p
    return lib


def main() -> None:
    mma, why = mm.load(capability())
    if mma is None:
        raise SystemExit(f"the tensor-core MoE GEMV cannot run here: {why}")
    lib = build()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas = sms // 4 * 4
    h = i = 2880
    ws = [weights(s, 32, h, i) for s in range(4)]
    ws = [replace(w, gate_up_bias=w.gate_up_bias.bfloat16(), down_bias=w.down_bias.bfloat16())
          for w in ws]
    sync = torch.zeros(8, dtype=torch.int32, device="cuda")
    sets = []
    for x, wts, ids, w in call_sets(1, ws):
        sets.append(dict(x=x, ids=ids.reshape(-1), w=w, wts=wts.reshape(-1).float().contiguous(),
                         act=torch.empty(4, 2, i, dtype=torch.half, device="cuda"),
                         y=torch.empty(4, h, device="cuda"),
                         ids32=ids.reshape(-1).to(torch.int32)))

    def engine(c):
        return mt._gemv_pairs(c["x"], c["wts"].view(1, 4), c["ids"].view(1, 4), c["w"], None, mma)

    def fused(c, v, mode=0):
        w, ids32 = c["w"], c["ids32"]
        gb, gs, db, ds = w.gate_up_blocks, w.gate_up_scales, w.down_blocks, w.down_scales
        err = lib.tinyoss_token_moe(
            v, c["x"].data_ptr(), ids32.data_ptr(), 4, gb.data_ptr(), gs.data_ptr(),
            w.gate_up_bias.data_ptr(), db.data_ptr(), ds.data_ptr(), w.down_bias.data_ptr(),
            c["wts"].data_ptr(), c["act"].data_ptr(), c["y"].data_ptr(), sync.data_ptr(),
            2 * i, h, i, gb.stride(0), gb.stride(1), gs.stride(0), db.stride(0), db.stride(1),
            ds.stride(0), w.alpha, w.limit, ctas, mode, torch.cuda.current_stream().cuda_stream)
        assert err == 0, (v, err)
        return c["y"]

    print(f"GPU {torch.cuda.get_device_name()}, {sms} SMs, {ctas} programs")
    ref = engine(sets[0]).clone()
    us = timed(lambda: [engine(c) for c in sets], [()]) / len(sets)
    print(f"engine (mma gate_up + Gluon down)   {us:7.2f} us")
    us = timed(lambda: [c["ids"].to(torch.int32) for c in sets], [()]) / len(sets)
    print(f"  of which the ids' int32 copy       {us:7.2f} us (the fused calls take int32 ids)")
    v = 0
    while name := lib.tinyoss_token_moe_name(v):
        out = fused(sets[0], v).clone()
        torch.cuda.synchronize()
        err = ((out - ref).norm() / ref.norm()).item()
        again = fused(sets[0], v).clone()  # the counters were reset: a second call agrees
        torch.cuda.synchronize()
        assert sync.abs().sum().item() == 0, sync
        us = timed(lambda v=v: [fused(c, v) for c in sets], [()]) / len(sets)
        same = torch.equal(out, again)
        print(f"fused {name.decode():<28} {us:7.2f} us  err {err:.1e}  repeat-equal {same}",
              flush=True)
        for mode, what in ((1, "gate_up only"), (2, "down only"), (3, "neither"),
                           (4, "not cooperative"), (9, "gate_up only, small smem"),
                           (11, "neither, small smem")):
            us = timed(lambda v=v, m=mode: [fused(c, v, m) for c in sets], [()]) / len(sets)
            print(f"      {what:<28} {us:7.2f} us", flush=True)
        v += 1


if __name__ == "__main__":
    main()
