"""Tiles of the tensor-core pair GEMV (pair_tiles.cu: the product kernel with other U, KSPLIT
and TILES choices, and a variant streamed through shared memory with cp.async), gate_up and down
timed apart, against the Gluon kernel's halves, at gpt-oss-20b shapes. Errors against the
product kernel's output; microseconds a call replayed from CUDA graphs over 4 rotating weight
sets.

    python bench/experiments/mma_gemv/sweep_pair.py --tokens 1,2,4,8
    python bench/experiments/mma_gemv/sweep_pair.py --grouped [--only streamed] --tokens 16,32,64
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
from tinyoss.kernels import moe_gemv_mma as mm  # noqa: E402
from tinyoss.kernels.hardware import capability  # noqa: E402
from tinyoss.kernels.moe_gemv_gluon import pair_gemv_gluon  # noqa: E402
from tinyoss.kernels.moe_triton import GemvConfig  # noqa: E402


def build() -> ctypes.CDLL:
    out = Path(tempfile.mkdtemp()) / "pair_tiles.so"
    subprocess.run([mm._nvcc(), "-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17",
                    "-gencode=arch=compute_90a,code=sm_90a",
                    str(Path(__file__).with_name("pair_tiles.cu")), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.tinyoss_pair_variant.argtypes = [ctypes.c_int] + mm._ARGS
    lib.tinyoss_pair_variant.restype = ctypes.c_int
    lib.tinyoss_pair_variant_name.argtypes = [ctypes.c_int]
    lib.tinyoss_pair_variant_name.restype = ctypes.c_char_p
    lib.tinyoss_grouped_variant.argtypes = [ctypes.c_int] + mm._GROUPED_ARGS[1:]  # as swiglu
    lib.tinyoss_grouped_variant.restype = ctypes.c_int
    lib.tinyoss_grouped_variant_name.argtypes = [ctypes.c_int]
    lib.tinyoss_grouped_variant_name.restype = ctypes.c_char_p
    return lib


def sweep_grouped(lib: ctypes.CDLL, mma: mm.MmaGemv, tokens: list[int], only: str) -> None:
    """The grouped kernel's row tiles, gate_up and down apart, against the product's (errors
    against its outputs), the pairs sorted once outside the timing."""
    h = i = 2880
    ws = [weights(s, 32, h, i) for s in range(4)]
    ws = [replace(w, gate_up_bias=w.gate_up_bias.bfloat16(), down_bias=w.down_bias.bfloat16())
          for w in ws]
    variants = [v for v in range(100, 200) if lib.tinyoss_grouped_variant_name(v)
                and only in lib.tinyoss_grouped_variant_name(v).decode()]
    for t in tokens:
        sets = []
        for x, wts, ids, w in call_sets(t, ws):
            by_expert = mma.sort_pairs(ids.reshape(-1).to(torch.int32), 32)
            sets.append(dict(x=x, w=w, by_expert=by_expert,
                             wts=wts.reshape(-1).float().contiguous(),
                             act=torch.empty(t * 4, i, device="cuda"),
                             y=torch.empty(t * 4, h, device="cuda")))

        def run(c, gate: bool, variant: int | None) -> torch.Tensor:
            w = c["w"]
            b, s, bias = ((w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias) if gate else
                          (w.down_blocks, w.down_scales, w.down_bias))
            x, div, out = (c["x"], 4, c["act"]) if gate else (c["act"], 1, c["y"])
            if variant is None:
                mma.grouped(x, div, c["by_expert"], b, s, bias, c["wts"], out, w.alpha, w.limit,
                            gate)
                return out
            sid, order, groups = c["by_expert"]
            err = lib.tinyoss_grouped_variant(
                variant, x.data_ptr(), div, groups.data_ptr(), groups.numel(), sid.data_ptr(),
                order.data_ptr(), sid.numel(), b.data_ptr(), s.data_ptr(), bias.data_ptr(),
                c["wts"].data_ptr(), out.data_ptr(), b.shape[1], b.shape[2] * 32, b.stride(0),
                b.stride(1), s.stride(0), w.alpha, w.limit,
                torch.cuda.current_stream().cuda_stream)
            assert err == 0, (variant, err)
            return out

        for gate in (True, False):
            if only and not any(("gate_up" in lib.tinyoss_grouped_variant_name(v).decode())
                                == gate for v in variants):
                continue
            for c in sets:
                run(c, True, None)  # down reads the product's gate_up output
            ref = run(sets[0], gate, None).clone()
            rows = [("product", None)] + [
                (lib.tinyoss_grouped_variant_name(v).decode(), v) for v in variants
                if ("gate_up" in lib.tinyoss_grouped_variant_name(v).decode()) == gate]
            for name, v in rows:
                out = run(sets[0], gate, v)
                err = ((out - ref).norm() / ref.norm()).item()
                us = timed(lambda v=v: [run(c, gate, v) for c in sets], [()]) / len(sets)
                what = "gate_up" if gate else "down"
                print(f"T={t:<2} {what:<7} {name:<28} {us:7.2f} us  err {err:.0e}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--grouped", action="store_true", help="the grouped kernel's tiles instead")
    p.add_argument("--only", default="",
                   help="variants whose name holds one of these (comma-separated)")
    p.add_argument("--intermediate", type=int, default=2880,
                   help="intermediate units (a tensor-parallel rank's share: 1440 at TP 2, "
                        "736 at TP 4): gate_up's rows are twice this, down's K this")
    args = p.parse_args()
    mma, why = mm.load(capability())
    if mma is None:
        raise SystemExit(f"the tensor-core MoE GEMV cannot run here: {why}")
    lib = build()
    if args.grouped:
        sweep_grouped(lib, mma, [int(t) for t in args.tokens.split(",")], args.only)
        return
    variants = [v for v in range(128) if lib.tinyoss_pair_variant_name(v)]
    if args.only:
        variants = [v for v in variants if any(o in lib.tinyoss_pair_variant_name(v).decode()
                                               for o in args.only.split(","))]
    h, i = 2880, args.intermediate
    ws = [weights(s, 32, h, i) for s in range(4)]
    ws = [replace(w, gate_up_bias=w.gate_up_bias.bfloat16(), down_bias=w.down_bias.bfloat16())
          for w in ws]
    cfg = GemvConfig()
    for t in map(int, args.tokens.split(",")):
        sets = []
        for x, wts, ids, w in call_sets(t, ws):
            pairs = ids.numel()
            sets.append(dict(x=x, ids=ids.reshape(-1).to(torch.int32), w=w,
                             wts=wts.reshape(-1).float().contiguous(),
                             act=torch.empty(pairs, i, device="cuda"),
                             y=torch.empty(pairs, h, device="cuda")))

        def gate(c, variant=None):
            w = c["w"]
            if variant is None:
                pair_gemv_gluon(c["x"], 4, c["ids"].long(), w.gate_up_blocks, w.gate_up_scales,
                                w.gate_up_bias, c["wts"], c["act"], 2 * i, h, w.alpha, w.limit,
                                swiglu=True, block_n=cfg.block_n1, block_k=cfg.block_k,
                                num_warps=cfg.num_warps)
                return c["act"]
            b, s = w.gate_up_blocks, w.gate_up_scales
            err = lib.tinyoss_pair_variant(
                variant, c["x"].data_ptr(), 4, c["ids"].data_ptr(), c["ids"].numel(),
                b.data_ptr(), s.data_ptr(), w.gate_up_bias.data_ptr(), c["wts"].data_ptr(),
                c["act"].data_ptr(), 2 * i, h, b.stride(0), b.stride(1), s.stride(0), w.alpha,
                w.limit, torch.cuda.current_stream().cuda_stream)
            if err:
                raise ValueError(f"variant {variant}: error {err} at this shape")
            return c["act"]

        def down(c, variant=None):
            w = c["w"]
            if variant is None:
                pair_gemv_gluon(c["act"], 1, c["ids"].long(), w.down_blocks, w.down_scales,
                                w.down_bias, c["wts"], c["y"], h, i, w.alpha, w.limit,
                                swiglu=False, block_n=cfg.block_n2, block_k=cfg.block_k,
                                num_warps=cfg.num_warps)
                return c["y"]
            b, s = w.down_blocks, w.down_scales
            err = lib.tinyoss_pair_variant(
                variant, c["act"].data_ptr(), 1, c["ids"].data_ptr(), c["ids"].numel(),
                b.data_ptr(), s.data_ptr(), w.down_bias.data_ptr(), c["wts"].data_ptr(),
                c["y"].data_ptr(), h, i, b.stride(0), b.stride(1), s.stride(0), w.alpha,
                w.limit, torch.cuda.current_stream().cuda_stream)
            if err:
                raise ValueError(f"variant {variant}: error {err} at this shape")
            return c["y"]

        c0 = sets[0]
        ref_act = gate(c0, 0).clone()
        ref_y = down(c0, 20).clone()
        rows = [("gluon gate_up", lambda c: gate(c), None), ("gluon down", lambda c: down(c), None)]
        for v in variants:
            name = lib.tinyoss_pair_variant_name(v).decode()
            fn = (lambda c, v=v: gate(c, v)) if "gate_up" in name else (lambda c, v=v: down(c, v))
            rows.append((name, fn, v))
        for name, fn, v in rows:
            is_gate = "gate_up" in name
            if not is_gate:  # down reads act: the product's gate_up output for set 0
                for c in sets:
                    gate(c, 0)
            try:
                out = fn(c0)
            except ValueError as e:  # tiles that do not divide this shape
                print(f"T={t:<2} {name:<36} n/a ({e})", flush=True)
                continue
            ref = ref_act if is_gate else ref_y
            err = ((out - ref).norm() / ref.norm()).item()
            us = timed(lambda: [fn(c) for c in sets], [()]) / len(sets)
            print(f"T={t:<2} {name:<36} {us:7.2f} us  err {err:.0e}", flush=True)


if __name__ == "__main__":
    main()
