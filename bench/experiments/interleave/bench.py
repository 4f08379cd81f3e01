"""The decode pair GEMVs and the prefill GEMMs on word-interleaved experts (`interleave.py`)
against the product's on the checkpoint's rows, same process, gpt-oss-20b shapes, 4 rotating
weight sets replayed from CUDA graphs (us a call; errors against the product's outputs).

    python bench/experiments/interleave/bench.py --tokens 1,2,4,8 [--only "gate_up U..."]
    python bench/experiments/interleave/bench.py --prefill 128,512,2048,8192
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

from bench.experiments.interleave.interleave import interleave, prefill_pairs_il  # noqa: E402
from bench.moe_kernels import call_sets, timed, weights  # noqa: E402
from tinyoss.kernels import moe_gemv_mma as mm  # noqa: E402
from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels.hardware import capability  # noqa: E402
from tinyoss.kernels.moe_gemv_gluon import pair_gemv_gluon  # noqa: E402

H = I = 2880


def build() -> ctypes.CDLL:
    out = Path(tempfile.mkdtemp()) / "il_pair.so"
    subprocess.run([mm._nvcc(), "-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17",
                    "-gencode=arch=compute_90a,code=sm_90a",
                    str(Path(__file__).with_name("il_pair.cu")), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.tinyoss_il_variant.argtypes = [ctypes.c_int] + mm._ARGS
    lib.tinyoss_il_variant.restype = ctypes.c_int
    lib.tinyoss_il_variant_name.argtypes = [ctypes.c_int]
    lib.tinyoss_il_variant_name.restype = ctypes.c_char_p
    return lib


def decode(tokens: list[int], only: str) -> None:
    mma, why = mm.load(capability())
    if mma is None:
        raise SystemExit(f"the tensor-core MoE GEMV cannot run here: {why}")
    lib = build()
    ws = [weights(s, 32, H, I) for s in range(4)]
    ws = [replace(w, gate_up_bias=w.gate_up_bias.bfloat16(), down_bias=w.down_bias.bfloat16())
          for w in ws]
    il = {id(w): (interleave(w.gate_up_blocks), interleave(w.down_blocks)) for w in ws}
    variants = [v for v in range(64) if lib.tinyoss_il_variant_name(v)]
    if only:
        variants = [v for v in variants if any(o in lib.tinyoss_il_variant_name(v).decode()
                                               for o in only.split(","))]
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731

    def call(fn, c, gate: bool, blocks: torch.Tensor, *variant) -> torch.Tensor:
        w = c["w"]
        s, bias = (w.gate_up_scales, w.gate_up_bias) if gate else (w.down_scales, w.down_bias)
        x, div, out, n, k = ((c["x"], 4, c["act"], 2 * I, H) if gate else
                             (c["act"], 1, c["y"], H, I))
        err = fn(*variant, x.data_ptr(), div, c["ids"].data_ptr(), c["ids"].numel(),
                 blocks.data_ptr(), s.data_ptr(), bias.data_ptr(), c["wts"].data_ptr(),
                 out.data_ptr(), n, k, blocks.stride(0), blocks.stride(1), s.stride(0),
                 float(w.alpha), float(w.limit), stream())
        assert err == 0, (variant, err)
        return out

    def gluon_down(c) -> torch.Tensor:
        w = c["w"]
        pair_gemv_gluon(c["act"], 1, c["ids"].long(), w.down_blocks, w.down_scales, w.down_bias,
                        c["wts"], c["y"], H, I, w.alpha, w.limit, swiglu=False, block_n=8,
                        block_k=1024, num_warps=1)
        return c["y"]

    for t in tokens:
        sets = []
        for x, wts, ids, w in call_sets(t, ws):
            pairs = ids.numel()
            sets.append(dict(x=x, ids=ids.reshape(-1).to(torch.int32), w=w,
                             wts=wts.reshape(-1).float().contiguous(),
                             act=torch.empty(pairs, I, device="cuda"),
                             y=torch.empty(pairs, H, device="cuda")))
        rows = [("product gate_up", True, lambda c: call(mma.gate_up_fn, c, True,
                                                         c["w"].gate_up_blocks)),
                ("product down (mma)", False, lambda c: call(mma.down_fn, c, False,
                                                             c["w"].down_blocks)),
                ("product down (Gluon)", False, gluon_down)]
        for v in variants:
            name = lib.tinyoss_il_variant_name(v).decode()
            gate = "gate_up" in name
            rows.append((name, gate, lambda c, v=v, gate=gate: call(
                lib.tinyoss_il_variant, c, gate, il[id(c["w"])][0 if gate else 1], v)))
        c0 = sets[0]
        ref_act = rows[0][2](c0).clone()
        for c in sets:
            rows[0][2](c)  # down reads the product's gate_up output
        ref_y = rows[1][2](c0).clone()
        for name, gate, fn in rows:
            if not gate:
                for c in sets:
                    rows[0][2](c)
            out = fn(c0)
            ref = ref_act if gate else ref_y
            err = ((out - ref).norm() / ref.norm()).item()
            us = timed(lambda fn=fn: [fn(c) for c in sets], [()]) / len(sets)
            print(f"T={t:<2} {name:<34} {us:7.2f} us  err {err:.0e}", flush=True)


def prefill(tokens: list[int]) -> None:
    ws = [weights(s, 32, H, I) for s in range(4)]
    il = {id(w): (interleave(w.gate_up_blocks), interleave(w.down_blocks)) for w in ws}
    for t in tokens:
        sets = list(call_sets(t, ws))
        ref = mt._prefill_pairs(*sets[0], None)
        err = ((prefill_pairs_il(*sets[0], *il[id(sets[0][3])]) - ref).norm()
               / ref.norm()).item()
        base = timed(lambda: [mt._prefill_pairs(*c, None) for c in sets], [()]) / len(sets)
        new = timed(lambda: [prefill_pairs_il(*c, *il[id(c[3])]) for c in sets],
                    [()]) / len(sets)
        print(f"T={t:<5} product {base:9.1f} us  interleaved {new:9.1f} us "
              f"({new / base - 1:+.1%})  err against the product {err:.1e}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="")
    p.add_argument("--prefill", default="")
    p.add_argument("--only", default="", help="variants whose name holds one of these")
    args = p.parse_args()
    if args.prefill:
        prefill([int(t) for t in args.prefill.split(",")])
    if args.tokens:
        decode([int(t) for t in args.tokens.split(",")], args.only)


if __name__ == "__main__":
    main()
