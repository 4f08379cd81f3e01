"""Decode-sized all-reduces over the GPUs of one host, one process a GPU, as a tensor-parallel
decode step has them (gpt-oss: hidden 2880 in bf16, two a layer): which is fastest, and what
fusing the residual add and RMSNorm into the all-reduce saves.

- `nccl`: torch.distributed.all_reduce (NCCL, multicast off);
- `symm_mem`: tinyoss's one-shot through PyTorch's symmetric memory (`engine/comm.py`);
- `custom`: tinyoss's one-shot (`kernels/all_reduce.cu`: Lamport stores into every rank's
  buffer, built by nvcc in seconds), alone and fused with the residual add and RMSNorm
  (`custom fused`);
- `flashinfer`: FlashInfer's TensorRT-LLM all-reduce (Lamport one-shot over IPC buffers that
  PyTorch's symmetric memory allocates, no multicast), pattern kAllReduce (`engine/comm.py`);
- `+norm` rows: the all-reduce then tinyoss's Triton residual-add RMSNorm, against FlashInfer's
  fused kARResidualRMSNorm (`flashinfer fused`), what the MoE's all-reduce and the next layer's
  input norm would become.

Each is checked against an fp32 sum first, then timed as a CUDA graph of `--calls` calls (one
decode step's worth), replayed `--reps` times: microseconds a call on rank 0.

    python bench/experiments/all_reduce/bench.py --gpus 2 --tokens 1,2,4,8,16,64
"""

from __future__ import annotations

import argparse
import faulthandler
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tinyoss.engine.comm import (  # noqa: E402
    Group,
    _CustomAllReduce,
    _flashinfer_built,
    _FlashInferAllReduce,
    _SymmMemAllReduce,
    disable_multicast,
)

HIDDEN, EPS = 2880, 1e-5


def time_graph(fn, calls: int, reps: int) -> float:
    """Microseconds a call: `calls` calls captured in one graph, replayed `reps` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (reps * calls)


def worker(rank: int, args: argparse.Namespace, init: str) -> None:
    # a rank stuck in a rendezvous prints where, then exits (once it printed nothing in 90 s)
    faulthandler.dump_traceback_later(args.hang_s, exit=True)
    disable_multicast()
    device = torch.device("cuda", rank)
    group = Group(rank, args.gpus, device, init)
    from tinyoss.kernels.layer_ops_triton import rms_norm_triton

    tokens = [int(t) for t in args.tokens.split(",")]
    methods = {"nccl": lambda x: dist.all_reduce(x) or x}
    try:
        methods["symm_mem"] = _SymmMemAllReduce(group, torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"rank {rank}: symm_mem unavailable: {e!r}", flush=True)
    try:
        methods["custom"] = _CustomAllReduce(group, torch.bfloat16, HIDDEN)
    except Exception:  # noqa: BLE001
        print(f"rank {rank}: custom unavailable:\n{traceback.format_exc()}", flush=True)
    if not _flashinfer_built() and not args.build_flashinfer:
        print(f"rank {rank}: flashinfer left out: its all-reduce is not prebuilt "
              "(--build-flashinfer builds or refreshes it: minutes)", flush=True)
    else:
        try:
            methods["flashinfer"] = _FlashInferAllReduce(group, torch.bfloat16, HIDDEN)
        except Exception:  # noqa: BLE001
            print(f"rank {rank}: flashinfer unavailable:\n{traceback.format_exc()}", flush=True)
    # only what every rank has, or their collectives differ
    for name in ("symm_mem", "custom", "flashinfer"):
        if group.min(int(name in methods)) == 0:
            methods.pop(name, None)
    fused = {name: methods[name] for name in ("custom", "flashinfer") if name in methods}
    if rank == 0:
        print(f"{torch.cuda.get_device_name(device)} x {args.gpus}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}, torch {torch.__version__}; "
              f"us a call, graphs of {args.calls} calls", flush=True)
        print(f"| tokens | {' | '.join(methods)} | {' | '.join(m + ' +norm' for m in methods)}"
              f"{''.join(f' | {name} fused' for name in fused)} |", flush=True)
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    weight = torch.rand(HIDDEN, device=device, generator=torch.Generator(device=device)
                        .manual_seed(0)) + 0.5
    weight = weight.to(torch.bfloat16).float()  # float32 holding bf16 values, as the model's
    for t in tokens:
        x = torch.randn(t, HIDDEN, device=device, generator=gen).to(torch.bfloat16)
        residual = torch.randn(t, HIDDEN, device=device,
                               generator=torch.Generator(device=device).manual_seed(99))
        residual = residual.to(torch.bfloat16)  # the same on every rank, as in the model
        want = x.float()
        dist.all_reduce(want)
        row, errors = [], []
        for name, fn in methods.items():  # correctness, then time
            got = fn(x.clone()).float()
            errors.append(f"{name} {(got - want).abs().max().item():.3g}")
            buf = x.clone()
            row.append(time_graph(lambda: fn(buf.copy_(x)), args.calls, args.reps))
        for name, fn in methods.items():
            res = residual.clone()
            row.append(time_graph(lambda: rms_norm_triton(fn(x.clone()), weight, EPS, res),
                                  args.calls, args.reps))
        ref_norm, ref_res = rms_norm_triton(want.to(torch.bfloat16), weight, EPS,
                                            residual.clone())
        for name, fn in fused.items():
            norm, res_out = fn.norm(x.clone(), residual.clone(), weight, EPS)
            errors.append(f"{name} fused norm "
                          f"{(norm.float() - ref_norm.float()).abs().max().item():.3g} res "
                          f"{(res_out.float() - ref_res.float()).abs().max().item():.3g}")
            res = residual.clone()
            row.append(time_graph(lambda: fn.norm(x, res, weight, EPS), args.calls, args.reps))
        if rank == 0:
            print(f"| {t} | {' | '.join(f'{v:.1f}' for v in row)} |   max |err|: "
                  f"{', '.join(errors)}", flush=True)
    group.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--tokens", default="1,2,4,8,16,32,64")
    p.add_argument("--calls", type=int, default=48, help="calls a graph (gpt-oss-20b: 48)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--hang-s", type=float, default=120,
                   help="a rank still running after this many seconds prints its stack and exits")
    p.add_argument("--build-flashinfer", action="store_true",
                   help="build FlashInfer's all-reduce where it is not built (minutes)")
    args = p.parse_args()
    if args.gpus < 2:
        raise SystemExit(f"needs 2 or more GPUs; torch sees {torch.cuda.device_count()}")
    disable_multicast()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    mp.spawn(worker, args=(args, init), nprocs=args.gpus)


if __name__ == "__main__":
    main()
