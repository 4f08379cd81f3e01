"""The product's MoE kernels with their MMAs free to reorder (`asm` instead of `asm volatile`).

`mma()` and `mma_bf16()` in moe_gemv_mma.cu are `asm volatile`, which keeps every MMA in source
order: a scale block's chained MMAs and the next block's cannot interleave. This builds the
product's source with the two MMAs non-volatile (nothing else changed) and times the MoE paths
the engine takes at each token count, both builds in the same process, outputs compared bit for
bit (reordering independent MMAs changes no sum).

    python bench/experiments/pdl_smem/nonvolatile.py [--tokens 1,2,4,8,16,64]   # GPU (sm_90)
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
from tinyoss.kernels import moe_gemv_mma, moe_triton as mt, nvcc_build  # noqa: E402


def build(source: str, name: str) -> moe_gemv_mma.MmaGemv:
    tmp = Path(tempfile.mkdtemp())
    (tmp / f"{name}.cu").write_text(source)
    subprocess.run([nvcc_build.find_nvcc(), "-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17",
                    "-gencode=arch=compute_90a,code=sm_90a", str(tmp / f"{name}.cu"), "-o",
                    str(tmp / f"{name}.so")], check=True)
    return moe_gemv_mma.MmaGemv(ctypes.CDLL(str(tmp / f"{name}.so")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", default="1,2,4,8,16,64")
    args = p.parse_args()
    src = moe_gemv_mma.SOURCE.read_text()
    volatile_mma = '  asm volatile(\n      "mma.sync.aligned.m16n8k16'
    assert src.count(volatile_mma) == 2, "the product's two MMA helpers changed"
    libs = {"volatile": build(src, "base"),
            "free": build(src.replace(volatile_mma, '  asm(\n      "mma.sync.aligned.m16n8k16'),
                          "free")}
    ws = [replace(w, gate_up_bias=w.gate_up_bias.bfloat16(), down_bias=w.down_bias.bfloat16())
          for w in (weights(s, 32, 2880, 2880) for s in range(4))]
    print(torch.cuda.get_device_name(), flush=True)
    for t in map(int, args.tokens.split(",")):
        sets = [(x, wts, ids.to(torch.int32), w) for x, wts, ids, w in call_sets(t, ws)]
        path = mt._gemv_pairs if t <= mt.GEMV_MAX_TOKENS else mt._grouped_pairs
        outs, times = {}, {}
        for name, lib in libs.items():
            def run(lib=lib):
                return [path(x, wts, ids, w, None, lib) if path is mt._gemv_pairs
                        else path(x, wts, ids, w, lib) for x, wts, ids, w in sets]
            outs[name] = run()
            times[name] = timed(lambda run=run: run(), [()]) / len(sets)
        same = all(torch.equal(a, b) for a, b in zip(outs["volatile"], outs["free"]))
        print(f"T={t:<3} {path.__name__:<14} volatile {times['volatile']:7.2f} us  free "
              f"{times['free']:7.2f} us  ({times['free'] / times['volatile'] - 1:+.1%})  "
              f"same bits: {same}", flush=True)


if __name__ == "__main__":
    main()
