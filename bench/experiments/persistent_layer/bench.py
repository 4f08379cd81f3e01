"""Issue 18's next lever, measured before it is built: a decode step as one persistent launch
that streams every weight through a shared-memory ring filled ahead of the data dependencies,
against the same step as a CUDA graph of separate launches (the product's streaming GEMV and a
stand-in kernel). See chain.cu for the step.

    python bench/experiments/persistent_layer/bench.py [--layers 24] [--spins 4000,2000,1500]

Prints us a step and a layer for each, the bytes' time at the copy bandwidth measured in the same
run, and checks every GEMV phase of the persistent run against torch (fp32) on its own inputs.
"""

from __future__ import annotations

import argparse
import ctypes
import struct
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.decode_latency import copy_bandwidth  # noqa: E402
from tinyoss.kernels import moe_gemv_mma  # noqa: E402

from ring_build import build_lib  # noqa: E402  (beside this file)

HIDDEN, QKV, ATTN, GATE_UP, DOWN = 2880, 5120, 4096, 6112, 3056
# ring: (slots x KiB a slot, programs an SM)
# (an L: no counter, readers poll their x until no element is -0.0, Lamport's trick; D: and a
# quarter of each GEMV's rows claimed a chunk at a time by whichever program is free; 2: two
# rings, the experts' rows in one and q/k/v's and o's in the other)
RINGS = {"3x64K": (364, 1), "6x32K": (632, 1), "12x16K": (1216, 1), "3x32Kx2": (332, 2),
         "6x16Kx2": (616, 2), "3x64K L": (10364, 1), "6x32K L": (10632, 1),
         "12x16K L": (11216, 1), "6x32K LD": (30632, 1), "12x16K LD": (31216, 1),
         "12x16K L2": (51216, 1), "12x16K LD2": (71216, 1), "12x16K LF": (171216, 1),
         "12x16K LDF": (191216, 1), "12x16K LD2F": (231216, 1), "6x32K LDF": (190632, 1),
         "12x16K LDN": (351216, 1), "12x16K LDFX": (831216, 1), "6x32K LDFX": (830632, 1),
         "12x16K LDFW": (1471216, 1), "6x32K LDFW": (1470632, 1), "8x24K LDFW": (1470816, 1)}
NO_MATH = {"12x16K LDN"}  # N: consumers skip the math and write 0 (outputs not checked)
# the same with TRACE (chain.cu); F: fast consumers (four accumulator chains, unrolled by 4); X:
# and x in registers; W: sixteen consumer warps
TRACED = {"12x16K L": 91216, "12x16K LD": 111216, "12x16K LDF": 271216, "12x16K LDN": 431216,
          "12x16K LDFX": 911216, "12x16K LDFW": 1551216, "6x32K LDFW": 1550632}
KINDS = {True: ("q/k/v", "attention", "o", "norm+router", "gate_up", "down", "combine"),
         False: ("q/k/v", "attention", "o", "norm+router", "combine")}


def load_lib() -> ctypes.CDLL:
    lib = build_lib("chain.cu")
    lib.chain_launch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_void_p]
    lib.standin_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_void_p]
    lib.chain_error.restype = ctypes.c_char_p
    lib.chain_trace.argtypes = [ctypes.c_void_p]
    lib.chain_trace_dims.argtypes = [ctypes.c_void_p]
    assert lib.chain_phase_bytes() == 48
    return lib


def build_step(layers: int, spins: tuple[int, int, int], ctas: int, dev, with_moe: bool,
               dep: int = 1):
    """Phases (w, x, out, n, k, spin, ctas, dep, ring) of `layers` layers, the tensors they use (the
    second: every activation but the first input, in one buffer) and the last output."""
    g = torch.Generator(device=dev).manual_seed(0)

    def weight(n, k):
        return (torch.randn(n, k, device=dev, generator=g) / k**0.5).to(torch.bfloat16)

    h = torch.randn(HIDDEN, device=dev, generator=g).to(torch.bfloat16)
    sizes = [QKV, ATTN, HIDDEN, HIDDEN] + ([GATE_UP, DOWN] if with_moe else []) + [HIDDEN]
    arena = torch.empty(layers * sum(sizes), device=dev, dtype=torch.bfloat16)
    parts = iter(arena.split(sizes * layers))
    phases, keep = [], [h, arena]
    for _ in range(layers):
        qkv, attn, o, normed = next(parts), next(parts), next(parts), next(parts)
        up, down = (next(parts), next(parts)) if with_moe else (None, None)
        nxt = next(parts)
        w_qkv, w_o = weight(QKV, HIDDEN), weight(HIDDEN, ATTN)
        layer = [(w_qkv, h, qkv, QKV, HIDDEN, 0, 0, 0, 0),
                 (None, qkv, attn, ATTN, 0, spins[0], ctas, 0, 0),
                 (w_o, attn, o, HIDDEN, ATTN, 0, 0, 0, 0),
                 (None, o, normed, HIDDEN, 0, spins[1], ctas, 0, 0)]
        if with_moe:
            w_up, w_down = weight(GATE_UP, HIDDEN), weight(DOWN, HIDDEN)
            layer += [(w_up, normed, up, GATE_UP, HIDDEN, 0, 0, dep, 1),
                      (w_down, up, down, DOWN, HIDDEN, 0, 0, 0, 1),
                      (None, down, nxt, HIDDEN, 0, spins[2], ctas, 0, 0)]
            keep += [w_up, w_down]
        else:
            layer += [(None, normed, nxt, HIDDEN, 0, spins[2], ctas, 0, 0)]
        phases += layer
        keep += [w_qkv, w_o]
        h = nxt
    return phases, keep, h


def pack(phases, dev) -> torch.Tensor:
    raw = b"".join(struct.pack("QQQiiiiii", w.data_ptr() if w is not None else 0, x.data_ptr(),
                               out.data_ptr(), n, k, spin, ctas, dep, ring)
                   for w, x, out, n, k, spin, ctas, dep, ring in phases)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev)


def graph_us(fn, reps: int = 20) -> float:
    s = torch.cuda.current_stream()
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def trace_table(lib, ring: str, phases, table, done, arena, sms: int, with_moe: bool) -> None:
    """One traced launch of `ring`; prints where a layer's time goes, phase kind by phase kind,
    averaged over the layers but the first and the last (us)."""
    code, per_sm = RINGS[ring]
    arena.fill_(-0.0)
    done.zero_()
    assert not lib.chain_trace_clear()
    err = lib.chain_launch(table.data_ptr(), len(phases), done.data_ptr(), sms * per_sm,
                           TRACED[ring], torch.cuda.current_stream().cuda_stream)
    assert not err, lib.chain_error(err)
    torch.cuda.synchronize()
    dims = (ctypes.c_int * 3)()
    lib.chain_trace_dims(dims)
    progs, max_phases, fields = dims
    raw = torch.empty(progs * max_phases * fields, dtype=torch.int64)
    assert not lib.chain_trace(raw.data_ptr())
    t = raw.view(progs, max_phases, fields)[: sms * per_sm].double()
    c0, c1, g0, g1 = t[0, -1, 0], t[0, -1, 1], t[0, -1, 2], t[0, -1, 3]
    ns_per_cycle = ((g1 - g0) / (c1 - c0)).item()
    kinds = KINDS[with_moe]
    n, rows = len(kinds), {k: [] for k in kinds}
    end_last = None
    for p in range(len(phases)):
        took = t[:, p, 3] > 0  # the programs with a part in phase p
        tp = t[took, p]
        end = tp[:, 3].max().item()
        if end_last is not None and n <= p < len(phases) - n:
            cyc = lambda f: tp[:, f].mean().item() * ns_per_cycle / 1e3  # noqa: E731
            rows[kinds[p % n]].append([
                (end - end_last) / 1e3,                  # on the critical path
                (tp[:, 7].min().item() - end_last) / 1e3,  # first reader's x after the last writer
                (end - tp[:, 3].min().item()) / 1e3,     # last program's end after the first's
                cyc(0), cyc(1), cyc(2), cyc(4), cyc(5), cyc(6),
                ((tp[:, 1] - tp[:, 2]) / tp[:, 8].clamp(min=1)).mean().item() * ns_per_cycle,
                (tp[:, 8].mean() / tp[:, 9].clamp(min=1).mean()).item(), took.sum().item()])
        end_last = end
    print(f"  trace of ring {ring} ({ns_per_cycle:.3f} ns a cycle), us a phase, means over layers"
          " and programs:\n  | phase | critical path | x seen after last write | end spread |"
          " consumer: wait x | work | of it waiting data | producer: routing | issuing |"
          " of it ring full | ns a row of warp 0 not waiting | its rows a slot | programs |\n  |"
          + "---|" * 13, flush=True)
    total = 0.0
    for k, vals in rows.items():
        m = torch.tensor(vals).mean(0).tolist()
        total += m[0]
        print(f"  | {k} | " + " | ".join(f"{v:.2f}" for v in m[:-1]) + f" | {m[-1]:.0f} |")
    print(f"  | layer | {total:.2f} |" + " |" * 11, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--spins", default="4000,2000,1500",
                   help="ns: attention, norm + router, combine stand-ins")
    p.add_argument("--ctas", type=int, default=8, help="programs of a stand-in")
    p.add_argument("--rings", default=",".join(RINGS))
    p.add_argument("--no-dep", action="store_true",
                   help="let the ring load the expert-sized rows before the phase before them ends")
    p.add_argument("--trace", action="store_true",
                   help="and a traced launch of each ring in TRACED: where a layer's time goes")
    p.add_argument("--groups", default="",
                   help="';'-separated groupings, each the phase kinds that start a launch (e.g. "
                   "'attention,norm+router,combine'): the step as that many persistent launches "
                   "a layer, each prefetching only its own phases' rows")
    p.add_argument("--stream-only", action="store_true",
                   help="also one GEMV of 1 GB: the ring's bandwidth with no phase to wait for")
    args = p.parse_args()
    dev = torch.device("cuda")
    lib = load_lib()
    mma, why = moe_gemv_mma.load(torch.cuda.get_device_capability(dev))
    assert mma is not None, why
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bw = copy_bandwidth(dev) / 1e9
    print(f"{torch.cuda.get_device_name()} | {sms} SMs | copy {bw:.0f} GB/s | {args.layers} layers"
          f" | stand-ins {args.spins} ns on {args.ctas} programs", flush=True)
    cases = [(s, m) for s in (args.spins, "0,0,0") for m in (True, False)]
    for spins_s, with_moe in cases + ([("stream", None)] if args.stream_only else []):
        if spins_s == "stream":
            spins = ()
            w = (torch.randn(180_000, HIDDEN, device=dev) / HIDDEN**0.5).to(torch.bfloat16)
            h = torch.randn(HIDDEN, device=dev).to(torch.bfloat16)
            last = torch.empty(180_000, device=dev, dtype=torch.bfloat16)
            phases, keep = [(w, h, last, 180_000, HIDDEN, 0, 0, 0, 0)], [h, last]
            arena = last
        else:
            spins = tuple(int(s) for s in spins_s.split(","))
            phases, keep, last = build_step(args.layers, spins, args.ctas, dev, with_moe,
                                            dep=0 if args.no_dep else 1)
            arena = keep[1]
        table = pack(phases, dev)
        done = torch.zeros(1 + len(phases), dtype=torch.int32, device=dev)  # + DYN's claims
        mb = sum(w.numel() * 2 for w, *_ in phases if w is not None) / 1e6
        stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731

        def separate_direct(phases=phases):  # the product's GEMV writes out itself
            for w, x, out, n, k, spin, ctas, *_ in phases:
                if w is None:
                    err = lib.standin_launch(x.data_ptr(), out.data_ptr(), n, spin, ctas,
                                             stream())
                else:
                    err = mma.stream_fn(x.data_ptr(), 1, w.data_ptr(), None, out.data_ptr(),
                                        n, k, stream())
                assert not err, err

        def persistent(ring, starts=(0,), table=table, n_phases=len(phases), done=done,
                       arena=arena):
            bounds = list(zip(starts, list(starts[1:]) + [n_phases]))

            def run():
                code, per_sm = RINGS[ring]
                if code > 10000:  # Lamport: every activation unwritten
                    arena.fill_(-0.0)
                if code < 10000 or (code // 10000) & 2:  # the counter, or the claims
                    done.zero_()
                for a, b in bounds:  # phase a's claims at done[1 + a]
                    err = lib.chain_launch(table.data_ptr() + 48 * a, b - a,
                                           done.data_ptr() + 4 * a, sms * per_sm, code, stream())
                    assert not err, lib.chain_error(err)
            return run

        groupings = [("one launch", (0,))]
        for g in filter(None, args.groups.split(";")) if with_moe is not None else ():
            kinds = KINDS[with_moe]
            firsts = {kinds.index(k) for k in g.split(",") if k in kinds}
            starts = tuple(i for i in range(len(phases)) if i == 0 or i % len(kinds) in firsts)
            groupings.append((f"{len(firsts) or 1} launches a layer ({g})", starts))

        what = ("one GEMV of 180,000 rows (per layer: the whole)" if spins_s == "stream" else
                "q/k/v, o and expert-sized GEMVs" if with_moe else "q/k/v and o GEMVs")
        print(f"== {what}: {mb:.0f} MB a step, {mb / args.layers:.1f} MB a layer "
              f"({mb / bw * 1e3 / args.layers:.1f} us a layer at the copy bandwidth); "
              f"stand-ins {spins} ns", flush=True)
        separate_direct()
        torch.cuda.synchronize()
        ref = last.float().clone()
        us = graph_us(separate_direct)
        print(f"  separate launches      {us:8.1f} us a step {us / args.layers:6.2f} a layer"
              f" {mb / us * 1e3:6.0f} GB/s", flush=True)
        for ring, (label, starts) in [(r, g) for r in args.rings.split(",") for g in groupings]:
            arena.fill_(float("nan"))
            persistent(ring, starts)()
            torch.cuda.synchronize()
            worst = 0.0
            for w, x, out, n, k, *_ in ([] if ring in NO_MATH else phases):
                if w is not None:
                    want = w.float() @ x[:k].float()
                    err = ((out.float() - want).norm() / want.norm()).item()
                    worst = max(worst, err) if err == err else float("inf")
                else:
                    assert torch.equal(out, x[:n]), "a stand-in's copy differs"
            us = graph_us(persistent(ring, starts))
            end = (last.float() - ref).norm() / ref.norm()
            print(f"  persistent, ring {ring:6s} {us:8.1f} us a step {us / args.layers:6.2f}"
                  f" a layer {mb / us * 1e3:6.0f} GB/s | worst GEMV error {worst:.1e}, last"
                  f" output against the separate run {end:.1e} | {label}", flush=True)
            assert worst < 1e-2 or ring in NO_MATH
            if args.trace and ring in TRACED and with_moe is not None and len(starts) == 1:
                trace_table(lib, ring, phases, table, done, arena, sms, with_moe)


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):
        main()
