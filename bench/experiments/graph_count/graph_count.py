"""graph_count.cu's question through PyTorch's CUDA graphs: a graph of 170 launches of 12
distinct kernels (each streaming 4 MB), its replay time before and after the same kernels are
captured into 3 more small graphs (`small`) or 3 more copies of it (`again3`). `--kind triton`:
12 specializations of one Triton kernel; `--kind cuda`: graph_count.cu's kernels built into a
library and launched through ctypes (as tinyoss launches its tensor-core MoE). One variant a
process. Measured (2026-11-25_h100_grouped_stream.md, section 4): +19 to +31 us with either
kind, where graph_count.cu, capturing and instantiating with the CUDA API itself, saw nothing.

`--flags F` captures with keep_graph=True and instantiates every graph through the driver API
(cuGraphInstantiateWithFlags, cuGraphLaunch) with flags F (PyTorch's own: auto free on launch 1
| use node priority 8 = 9), to tell whether PyTorch's flags are what slows the graph, and to try
the fix tinyoss would make.

    for k in triton cuda; do for v in none small again3; do
        python bench/experiments/graph_count/graph_count.py --kind $k --variant $v; done; done
    for f in 0 1 8 9; do python bench/experiments/graph_count/graph_count.py \
        --kind triton --variant small --flags $f; done   # measured: all slow the same
    for v in idle alloc; do python bench/experiments/graph_count/graph_count.py \
        --kind triton --variant $v; done   # measured: +0.2 and +3.6 us
    CUDA_MODULE_LOADING=EAGER python bench/experiments/graph_count/graph_count.py \
        --kind triton --variant small   # measured: +17.8 us, as without it
    python bench/experiments/graph_count/graph_count.py --kind triton --variant small \
        --stream side
    for m in global thread_local relaxed; do for c in side current; do  # measured below
        python bench/experiments/graph_count/graph_count.py --kind triton --variant small \
            --stream side --capture-mode $m --capture-stream $c; done; done

The last: graph_count.cu captures in thread-local mode on the stream it replays on, where
torch.cuda.graph captures in global mode on a side stream of its own (its defaults). Measured
(2026-11-27_session28.md): the mode does not matter; captured on a side stream the graph slows
by 17-27 us after 3 small captures, captured on the stream it replays on it does not (the
engine's captures do that since 59c5335).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

FUNCS, NODES, N4 = 12, 170, 1 << 18


@triton.jit
def _work(in_ptr, out_ptr, n, F: tl.constexpr, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(in_ptr + offs, mask=offs < n, other=0.0) * (F + 1)
    total = tl.sum(acc)
    if total == 12345.0:  # keeps the loads
        tl.store(out_ptr + F, total)


def cuda_lib() -> ctypes.CDLL:
    src = Path(__file__).with_name("graph_count.cu").read_text()
    src += """
extern "C" void gc_launch(int f, const void* in, void* out, int n, void* stream) {
  static const auto k = table<0>(std::make_integer_sequence<int, FUNCS>{});
  k[f]<<<264, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const float4*>(in), static_cast<float*>(out), n);
}
"""
    src = src.replace("int main(", "int unused_main(")
    tmp = Path(tempfile.mkdtemp())
    (tmp / "gc.cu").write_text(src)
    subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90a", "-shared", "-Xcompiler",
                    "-fPIC", str(tmp / "gc.cu"), "-o", str(tmp / "gc.so")], check=True)
    lib = ctypes.CDLL(str(tmp / "gc.so"))
    lib.gc_launch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                              ctypes.c_void_p]
    return lib


class DriverGraph:
    """A graph PyTorch captured (keep_graph=True), instantiated and launched through the driver
    API with our own flags."""

    cuda = None

    def __init__(self, graph: torch.cuda.CUDAGraph, flags: int) -> None:
        if DriverGraph.cuda is None:
            DriverGraph.cuda = ctypes.CDLL("libcuda.so.1")
        self.graph, self.exec = graph, ctypes.c_void_p()
        err = self.cuda.cuGraphInstantiateWithFlags(
            ctypes.byref(self.exec), ctypes.c_void_p(graph.raw_cuda_graph()),
            ctypes.c_ulonglong(flags))
        assert err == 0, f"cuGraphInstantiateWithFlags: {err}"

    def replay(self) -> None:
        err = self.cuda.cuGraphLaunch(self.exec,
                                      ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        assert err == 0, f"cuGraphLaunch: {err}"


def replay_us(graph) -> float:
    out = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(50):
            graph.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000 / 50)
    return sorted(out)[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=("triton", "cuda"), required=True)
    p.add_argument("--variant", choices=("none", "small", "again3", "idle", "alloc"),
                   required=True, help="idle: sleep as long as `small` takes to capture, no "
                   "graphs (do clocks drop?); alloc: 3 x 64 MB allocated instead (new device "
                   "memory, as graph pools get)")
    p.add_argument("--flags", type=int, default=None,
                   help="instantiate through the driver API with these flags (PyTorch's: 9)")
    p.add_argument("--stream", choices=("default", "side"), default="default",
                   help="replay on the default stream or a stream of its own")
    p.add_argument("--capture-mode", choices=("global", "thread_local", "relaxed"),
                   default="global", help="torch.cuda.graph's capture_error_mode")
    p.add_argument("--capture-stream", choices=("side", "current"), default="side",
                   help="capture on torch.cuda.graph's own side stream (its default) or on the "
                   "stream the graph replays on, as graph_count.cu does (with --stream side: "
                   "the legacy default stream cannot capture)")
    args = p.parse_args()
    if args.stream == "side":
        torch.cuda.set_stream(torch.cuda.Stream())
    x = torch.zeros(8 * N4 * 4, device="cuda")
    out = torch.zeros(64, device="cuda")
    lib = cuda_lib() if args.kind == "cuda" else None

    def launch(node: int) -> None:
        f, part = node % FUNCS, x[(node % 8) * N4 * 4:]
        if lib is None:
            _work[(264,)](part, out, N4 * 4, F=f, BLOCK=1024)
        else:
            lib.gc_launch(f, part.data_ptr(), out.data_ptr(), N4,
                          torch.cuda.current_stream().cuda_stream)

    def capture(nodes: int):
        for n in range(nodes):  # compiles, outside the capture
            launch(n)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph(keep_graph=args.flags is not None)
        on = torch.cuda.current_stream() if args.capture_stream == "current" else None
        with torch.cuda.graph(g, stream=on, capture_error_mode=args.capture_mode):
            for n in range(nodes):
                launch(n)
        return g if args.flags is None else DriverGraph(g, args.flags)

    g0 = capture(NODES)
    before = [replay_us(g0), replay_us(g0)]
    extra = []
    if args.variant == "small":
        start = time.perf_counter()
        extra = [capture(FUNCS) for _ in range(3)]
        print(f"capturing 3 small graphs took {time.perf_counter() - start:.3f} s", flush=True)
    elif args.variant == "idle":
        time.sleep(0.05)  # of the order `small` prints for its captures
    elif args.variant == "alloc":
        held = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(3)]
        for t in held:
            t.zero_()
    elif args.variant == "again3":
        extra = [capture(NODES) for _ in range(3)]
    for g in extra:
        g.replay()
    torch.cuda.synchronize()
    after = [replay_us(g0), replay_us(g0)]
    how = (("torch" if args.flags is None else f"flags {args.flags}") + f" {args.stream}"
           + f" {args.capture_mode}/{args.capture_stream}")
    print(f"{args.kind:<6} {how:<30} {args.variant:<7} before {before[0]:7.1f} "
          f"{before[1]:7.1f} us  after {after[0]:7.1f} {after[1]:7.1f} us  "
          f"({after[0] - before[0]:+.1f})", flush=True)


if __name__ == "__main__":
    main()
