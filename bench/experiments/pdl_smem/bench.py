"""The batch-1 MoE with down launched early (PDL), its weights in shared memory before it waits.

At one token gate_up (~16 us) and down (~12 us, Gluon's) take 28 us a layer for 12.4 us of
bytes, and down's rows cannot load before gate_up's launch ends. Here gate_up (the product's
streamed tiles) lets the next kernel launch at its start (`griddepcontrol.launch_dependents`);
down, launched with the programmatic-serialization attribute, copies every row of its program
into shared memory, then waits (`griddepcontrol.wait`) and only then reads gate_up's output.
Down's programs that fit beside gate_up's load during gate_up; the rest as gate_up's programs
end. Timed as gate_up + down chains in one CUDA graph over 4 weight sets, against the product's
pair (`moe_triton._gemv_pairs`), each chain's outputs checked against the product's after the
graph's replays.

    python bench/experiments/pdl_smem/bench.py            # GPU (sm_90, nvcc)
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
from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels import nvcc_build  # noqa: E402
from tinyoss.kernels.hardware import capability  # noqa: E402
from tinyoss.kernels.moe_gemv_mma import load  # noqa: E402

H = I = 2880


def build() -> ctypes.CDLL:
    nvcc = nvcc_build.find_nvcc()
    assert nvcc, "nvcc not found"
    out = Path(tempfile.mkdtemp()) / "pdl_smem.so"
    subprocess.run([nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17",
                    "-gencode=arch=compute_90a,code=sm_90a",
                    str(Path(__file__).with_name("pdl_smem.cu")), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    args = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_long, ctypes.c_float,
            ctypes.c_float, ctypes.c_void_p]
    lib.pdl_gate_up.argtypes = [ctypes.c_int] + args
    lib.pdl_down.argtypes = [ctypes.c_int, ctypes.c_int] + args
    lib.pdl_down_name.restype = ctypes.c_char_p
    return lib


def launch(fn, lead, x, x_div, ids, blocks, scales, bias, wts, out, w) -> None:
    err = fn(*lead, x.data_ptr(), x_div, ids.data_ptr(), ids.numel(), blocks.data_ptr(),
             scales.data_ptr(), bias.data_ptr(), wts.data_ptr(), out.data_ptr(), blocks.shape[1],
             blocks.shape[2] * 32, blocks.stride(0), blocks.stride(1), scales.stride(0),
             w.alpha, w.limit, torch.cuda.current_stream().cuda_stream)
    assert err == 0, f"launch failed: {err}"


def main() -> None:
    mma, why = load(capability())
    assert mma is not None, why
    lib = build()
    ws = [replace(w, gate_up_bias=w.gate_up_bias.bfloat16(), down_bias=w.down_bias.bfloat16())
          for w in (weights(s, 32, H, I) for s in range(4))]
    sets = []
    for x, wts, ids, w in call_sets(1, ws):
        sets.append(dict(x=x, wts2=wts, ids2=ids.to(torch.int32), w=w,
                         ids=ids.reshape(-1).to(torch.int32).contiguous(),
                         wts=wts.reshape(-1).float().contiguous(),
                         act=torch.empty(4, I, device="cuda"), y=torch.empty(4, H, device="cuda")))
    print(torch.cuda.get_device_name(), flush=True)

    def product(c):
        c["y"] = mt._gemv_pairs(c["x"], c["wts2"], c["ids2"], c["w"], None, mma)

    refs = []
    for c in sets:
        product(c)
        refs.append(c["y"].clone())

    def gate_up(v):
        def run(c):
            w = c["w"]
            launch(lib.pdl_gate_up, (v,), c["x"], 4, c["ids"], w.gate_up_blocks,
                   w.gate_up_scales, w.gate_up_bias, c["wts"], c["act"], w)
        return run

    def product_gate_up(c):
        w = c["w"]
        mma.gate_up(c["x"], 4, c["ids"], w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias,
                    c["wts"], c["act"], w.alpha, w.limit)

    def gluon_down(c):
        w = c["w"]
        mt._pair_gemv_cores(c["act"], 1, c["ids"], (w.down_blocks, w.down_scales, w.down_bias),
                            c["wts"], c["y"], H, I, w, mt.GemvConfig(), mt.GemvConfig().block_n2,
                            swiglu=False)

    def down(v, attr):
        def run(c):
            w = c["w"]
            launch(lib.pdl_down, (v, attr), c["act"], 1, c["ids"], w.down_blocks, w.down_scales,
                   w.down_bias, c["wts"], c["y"], w)
        return run

    def chain(*fns):
        return lambda: [f(c) for c in sets for f in fns]

    def report(name, fn, check=True):
        for c in sets:
            c["y"].zero_()
        us = timed(fn, [()]) / len(sets)
        errs = [((c["y"] - r).norm() / r.norm()).item() for c, r in zip(sets, refs)]
        tail = f"  err {max(errs):.1e}" if check else ""
        print(f"{name:<44} {us:7.2f} us{tail}", flush=True)
        return us

    report("gate_up alone (product)", chain(product_gate_up), check=False)
    report("gate_up alone (here, v0)", chain(gate_up(0)), check=False)
    report("gate_up alone (here, v1 trigger)", chain(gate_up(1)), check=False)
    report("gate_up alone (here, v2 trigger, S 2)", chain(gate_up(2)), check=False)
    report("Gluon down alone (product)", chain(gluon_down))
    names = [lib.pdl_down_name(v).decode() for v in range(lib.pdl_variants(1))]
    base = report("product: gate_up + Gluon down", chain(product))
    report("gate_up + down 0, attribute only", chain(gate_up(0), down(0, 1)))
    for v, name in enumerate(names):
        report(f"down {name} alone", chain(down(v, 0)))
        report(f"gate_up + down {name}, no PDL", chain(gate_up(0), down(v, 0)))
        for g in (1, 2):
            us = report(f"gate_up v{g} (trigger) + down {name}, PDL",
                        chain(gate_up(g), down(v, 1)))
            print(f"{'':<44} {us - base:+7.2f} us against the product", flush=True)

if __name__ == "__main__":
    main()
