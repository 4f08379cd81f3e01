"""The one-token MoE with down launched early (PDL), its weights in shared memory before it waits.

At one token gate_up (~16 us) and down (~12 us, Gluon's) took 28 us a layer for 12.4 us of bytes,
and down's rows could not load before gate_up's launch ended. The product now lets the next kernel
launch at gate_up's start (`griddepcontrol.launch_dependents`, TRIG) and launches down_resident
with the programmatic-serialization attribute: it copies every row of its program into shared
memory, then waits (`griddepcontrol.wait`) and only then reads gate_up's output. Down's programs
that fit beside gate_up's load during gate_up; the rest as gate_up's programs end. Timed here as
gate_up + down chains in one CUDA graph over 4 weight sets, against gate_up + Gluon's down (the
product before), outputs checked against it, at one GPU's intermediate size and a tensor-parallel
rank's (`--intermediate 1440,736`: TP 2 and 4, where gate_up is the register kernel).

    python bench/experiments/pdl_smem/bench.py [--intermediate 2880,1440,736]   # GPU (sm_90)
"""

from __future__ import annotations

import argparse
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
from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels import nvcc_build  # noqa: E402

H = 2880


def build() -> ctypes.CDLL:
    nvcc = nvcc_build.find_nvcc()
    assert nvcc, "nvcc not found"
    out = Path(tempfile.mkdtemp()) / "pdl_smem.so"
    subprocess.run([nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17",
                    "-gencode=arch=compute_90a,code=sm_90a",
                    str(Path(__file__).with_name("pdl_smem.cu")), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.pdl_gate_up.argtypes = [i, i, p, i, p, i, p, p, p, p, p, i, i, ctypes.c_long, i,
                                ctypes.c_long, f, f, p]
    lib.pdl_down.argtypes = [i, p, p, i, p, p, p, p, p, i, i, ctypes.c_long, i, ctypes.c_long, p]
    lib.pdl_down_name.restype = ctypes.c_char_p
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--intermediate", default="2880,1440,736")
    ap.add_argument("--tokens", default="1", help="tokens a step (above 1: one GPU's K only, "
                    "against the product's tensor-core down)")
    args = ap.parse_args()
    from tinyoss.kernels.hardware import capability
    from tinyoss.kernels.moe_gemv_mma import load

    mma, why = load(capability())
    assert mma is not None, why
    lib = build()
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    print(torch.cuda.get_device_name(), flush=True)
    names = [lib.pdl_down_name(v).decode() for v in range(lib.pdl_down_variants())]
    cases = [(1, i) for i in map(int, args.intermediate.split(","))] + [
        (t, 2880) for t in map(int, args.tokens.split(",")) if t > 1]
    for t, inter in cases:
        pairs = 4 * t
        shape = ((0 if inter == 2880 else 1 if 2 * inter >= 2880 else 2) if t == 1
                 else 3 if pairs <= 8 else 4)
        ws = [replace(w, gate_up_bias=w.gate_up_bias.bfloat16(),
                      down_bias=w.down_bias.bfloat16())
              for w in (weights(s, 32, H, inter) for s in range(4))]
        sets = [dict(x=x, w=w, ids=ids.reshape(-1).to(torch.int32).contiguous(),
                     wts=wts.reshape(-1).float().contiguous(),
                     act=torch.empty(pairs, inter, device="cuda"),
                     y=torch.empty(pairs, H, device="cuda"))
                for x, wts, ids, w in call_sets(t, ws)]

        def gate_up(trig):
            def run(c):
                w = c["w"]
                err = lib.pdl_gate_up(
                    trig, shape, c["x"].data_ptr(), 4, c["ids"].data_ptr(), pairs,
                    w.gate_up_blocks.data_ptr(), w.gate_up_scales.data_ptr(),
                    w.gate_up_bias.data_ptr(), c["wts"].data_ptr(), c["act"].data_ptr(),
                    w.gate_up_blocks.shape[1], H, w.gate_up_blocks.stride(0),
                    w.gate_up_blocks.stride(1), w.gate_up_scales.stride(0), w.alpha, w.limit,
                    stream())
                assert err == 0, err
            return run

        def gluon_down(c):  # before: Gluon's at one token, the tensor-core kernels above
            w = c["w"]
            if t > 1:
                mma.down(c["act"], c["ids"], w.down_blocks, w.down_scales, w.down_bias, c["wts"],
                         c["y"], w.alpha, w.limit)
                return
            mt._pair_gemv_cores(c["act"], 1, c["ids"], (w.down_blocks, w.down_scales,
                                                        w.down_bias), c["wts"], c["y"], H,
                                inter, w, mt.GemvConfig(), mt.GemvConfig().block_n2,
                                swiglu=False)

        def down(v):
            def run(c):
                w = c["w"]
                err = lib.pdl_down(v, c["act"].data_ptr(), c["ids"].data_ptr(), pairs,
                                   w.down_blocks.data_ptr(), w.down_scales.data_ptr(),
                                   w.down_bias.data_ptr(), c["wts"].data_ptr(), c["y"].data_ptr(),
                                   H, inter, w.down_blocks.stride(0), w.down_blocks.stride(1),
                                   w.down_scales.stride(0), stream())
                assert err == 0, err
            return run

        def chain(*fns):
            return lambda: [f(c) for c in sets for f in fns]

        refs = []
        for c in sets:
            gate_up(0)(c)
            gluon_down(c)
            refs.append(c["y"].clone())

        def report(name, fn, check=True):
            for c in sets:
                c["y"].zero_()
            us = timed(fn, [()]) / len(sets)
            errs = [((c["y"] - r).norm() / r.norm()).item() for c, r in zip(sets, refs)]
            tail = f"  err {max(errs):.1e}" if check else ""
            print(f"T={t} I={inter:<5} {name:<46} {us:7.2f} us{tail}", flush=True)
            return us

        report("gate_up alone", chain(gate_up(0)), check=False)
        report("gate_up alone, trigger", chain(gate_up(1)), check=False)
        report("down alone (before)", chain(gluon_down))
        base = report("gate_up + down (before)", chain(gate_up(0), gluon_down))
        for v, name in enumerate(names):
            report(f"down {name} alone", chain(down(v)))
            report(f"gate_up + down {name}, no trigger", chain(gate_up(0), down(v)))
            us = report(f"gate_up (trigger) + down {name}", chain(gate_up(1), down(v)))
            print(f"{'':<52} {us - base:+7.2f} us against before", flush=True)


if __name__ == "__main__":
    main()
