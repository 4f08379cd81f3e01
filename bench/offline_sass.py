"""Compiles tinyoss's decode GEMV kernels for sm_90 on a machine without a GPU and reports what
the H100 would run: registers, spills, shared memory, and the SASS instruction mix of the K loop
(per weight, where the kernel streams MXFP4 or bf16 weights).

Triton compiles ahead of time for a named target with its bundled ptxas, so PTX syntax errors,
register pressure and unvectorized loads show up before any GPU time is spent. Arguments are
specialized as a launch on real tensors would be (pointers and ints divisible by 16).

    python bench/offline_sass.py [--kernel NAME] [--dump FILE]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinyoss.kernels import (linear_mxfp4_triton, linear_triton, moe_gemv_gluon,  # noqa: E402
                             moe_triton)

PTR, I32, F32 = "ptr", 2880, 1.0  # a pointer; an int divisible by 16; a float


def spec(fn, args: dict, constexprs: dict) -> ASTSource:
    """ASTSource with the signature and divisibility attributes a launch would give."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, str):
            sig[name] = value if value.startswith("*") else "*i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    if isinstance(fn, GluonJITFunction):
        return GluonASTSource(fn, sig, constexprs, attrs)
    return ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)


def kernels() -> dict:
    """name -> (jit function, example args, constexprs, launch options, weights per K step)."""
    experts = dict(ids_ptr="*i32", q_ptr="*u8", s_ptr="*u8", b_ptr="*bf16", wts_ptr="*fp32",
                   N=5760, K=2880, stride_qe=5760 * 1440, stride_q=1440, stride_se=5760 * 90,
                   stride_s=90, alpha=F32, limit=F32, x_div=4)
    pair = dict(experts, x_ptr="*bf16", out_ptr="*fp32")
    gv = moe_triton.GemvConfig()
    lin = dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*u8", b_ptr="*bf16", out_ptr="*bf16", M=1,
               N=201088, K=2880, stride_q=1440, stride_s=90)
    lv = linear_mxfp4_triton.gemv_config(1, 201088)
    bf = dict(x_ptr="*bf16", w_ptr="*bf16", s_ptr="*fp32", b_ptr="*bf16", out_ptr="*bf16", M=1,
              N=5120, K=2880)
    bv = linear_triton.gemv_config(1, 5120)
    fv = linear_triton.gemv_config(1, 5120, 1)
    pair_opts = dict(num_warps=gv.num_warps, num_stages=gv.num_stages)
    return {
        "pair_gemv": (moe_triton._pair_gemv, pair,
                      dict(SWIGLU=True, BLOCK_N=gv.block_n1, BLOCK_K=gv.block_k),
                      pair_opts,
                      gv.block_n1 * gv.block_k),
        "pair_gemv_gluon": (moe_gemv_gluon._pair_gemv_gluon, pair,
                            dict(SWIGLU=True, HALF_N=gv.block_n1 // 2, BLOCK_K=gv.block_k,
                                 WARPS=gv.num_warps), pair_opts, gv.block_n1 * gv.block_k),
        "linear_mxfp4": (linear_mxfp4_triton._gemv, lin,
                         dict(HAS_BIAS=False, BLOCK_M=1, BLOCK_N=lv.block_n, BLOCK_K=lv.block_k),
                         dict(num_warps=lv.num_warps, num_stages=lv.num_stages),
                         lv.block_n * lv.block_k),
        "linear_bf16": (linear_triton._gemv, bf,
                        dict(HAS_SCALE=False, HAS_BIAS=True, BLOCK_M=1, BLOCK_N=bv.block_n,
                             BLOCK_K=bv.block_k, STAGES=bv.num_stages),
                        dict(num_warps=bv.num_warps, num_stages=bv.num_stages),
                        bv.block_n * bv.block_k),
        "linear_fp8": (linear_triton._gemv, dict(bf, w_ptr="*fp8e4nv"),
                       dict(HAS_SCALE=True, HAS_BIAS=True, BLOCK_M=1, BLOCK_N=fv.block_n,
                            BLOCK_K=fv.block_k, STAGES=fv.num_stages),
                       dict(num_warps=fv.num_warps, num_stages=fv.num_stages),
                       fv.block_n * fv.block_k),
    }


def loop_mix(sass: str) -> tuple[collections.Counter, int]:
    """Opcode counts of the largest backward-branch loop in the SASS, and its length."""
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
    addr = [int(re.search(r"/\*([0-9a-f]{4,})\*/", ln).group(1), 16) for ln in lines]
    labels = {}
    for ln in sass.splitlines():
        m = re.match(r"\s*\.(L_x_\d+):", ln)
        if m:
            labels[m.group(1)] = None
    best = (0, 0)
    text = sass.splitlines()
    pos = {}  # label -> address of the next instruction
    for i, ln in enumerate(text):
        m = re.match(r"\s*\.(L_x_\d+):", ln)
        if m:
            nxt = next((t for t in text[i + 1:] if re.search(r"/\*[0-9a-f]{4}\*/", t)), None)
            if nxt:
                pos[m.group(1)] = int(re.search(r"/\*([0-9a-f]{4,})\*/", nxt).group(1), 16)
    for a, ln in zip(addr, lines):
        m = re.search(r"BRA\s+`\(\.(L_x_\d+)\)", ln)
        if m and m.group(1) in pos and pos[m.group(1)] < a and a - pos[m.group(1)] > best[1] - best[0]:
            best = (pos[m.group(1)], a)
    mix = collections.Counter()
    for a, ln in zip(addr, lines):
        if best[0] <= a <= best[1]:
            op = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_]+)*)", ln)
            if op:
                mix[op.group(1)] += 1
    return mix, sum(mix.values())


def compile_sass(name: str, entry: tuple | None = None) -> tuple[str, str]:
    """Kernel `name` of `kernels()` (or `entry`, in its form) compiled for sm_90: (resource
    usage line, SASS)."""
    fn, example, constexprs, opts, _ = entry or kernels()[name]
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    k = triton.compile(spec(fn, example, constexprs), target=GPUTarget("cuda", 90, 32),
                       options=opts)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / f"{name}.cubin"
        cubin.write_bytes(k.asm["cubin"])
        usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin], capture_output=True,
                               text=True).stdout.strip().splitlines()[-1].strip()
        sass = subprocess.run([tools / "nvdisasm", "-c", cubin], capture_output=True,
                              text=True).stdout
    return usage, sass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", default="all")
    p.add_argument("--dump", default=None, help="write the SASS of the (last) kernel here")
    args = p.parse_args()
    for name, entry in kernels().items():
        if args.kernel in ("all", name):
            report(name, entry, args.dump)


def report(name: str, entry: tuple, dump: str | None = None) -> None:
    """Compiles one kernel (`kernels()`'s form) and prints its resources and K-loop mix."""
    _, _, _, opts, weights = entry
    usage, sass = compile_sass(name, entry)
    if dump:
        Path(dump).write_text(sass)
    mix, total = loop_mix(sass)
    threads = 32 * opts["num_warps"]
    print(f"{name}: {usage}")
    print(f"  K loop: {total} instructions a thread a step, "
          f"{total * threads / weights:.2f} a weight")
    print("  " + ", ".join(f"{op} {n}" for op, n in mix.most_common(14)))


if __name__ == "__main__":
    main()
