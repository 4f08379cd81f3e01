"""Why does the batch-1 decode graph replay ~55 us slower once more graphs are captured?
(bench/results/2026-11-25_h100_mma_tiles.md, section 3: any third graph holding the model's
kernels does it, piecewise or not; an unrelated graph does not.) One variant a process: build
gpt-oss-20b (random weights) without piecewise graphs, prefill 1024 tokens, time the decode
graph's replays, do the variant's extra captures, plan attention for the real sequence again,
time them again. gemv_xN and moe_xN put one layer's dense GEMVs or its MoE into N small
graphs: with N = 3 either costs the whole decode graph as much as 3 more decode graphs do
(bench/results/2026-11-25_h100_grouped_mma.md, section 2).

    python bench/experiments/graph_gaps.py --variant decode_xN --count 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tinyoss import LLM, SamplingParams  # noqa: E402
from tinyoss.engine.core import CoreRequest  # noqa: E402
from tinyoss.engine.cuda_graphs import CudaGraphRunner  # noqa: E402
from tinyoss.engine.piecewise_graphs import (  # noqa: E402
    PiecewiseGraphRunner,
    _Pieces,
    _Splitter,
)

VARIANTS = ("none", "pieces", "pieces_same_pool", "pieces_unsplit", "decode_again",
            "decode_xN", "many_small", "pieces_then_recapture", "gemv_xN", "moe_xN")


def replay_ms(graph: torch.cuda.CUDAGraph, n: int = 50) -> str:
    out = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            graph.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / n)
    return " ".join(f"{v:.4f}" for v in out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--count", type=int, default=25, help="graphs the *_xN variants capture")
    args = p.parse_args()
    llm = LLM("gpt-oss-20b", load_format="dummy", max_num_seqs=1, max_model_len=2048,
              enable_prefix_caching=False, max_prefill_graph_tokens=0)
    engine = llm.engine
    ex = engine.executor
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    engine.add(CoreRequest("r", [1] * 1024, params))
    while any(s.num_computed < s.num_prompt for r in engine.requests.values() for s in r):
        engine.step()
    torch.cuda.synchronize()
    decode = ex.graphs.graphs[1]
    print(f"{args.variant}: before {replay_ms(decode)} ms", flush=True)
    v, dev = args.variant, ex.device
    keep = []
    if v.startswith("pieces"):
        runner = PiecewiseGraphRunner(ex.model, ex.attention, [1], dev)
        if v == "pieces_same_pool":
            runner.pool = decode.pool()
        runner.capture()
        keep.append(runner)
    elif v == "pieces_unsplit":  # the runner's kernels and copies, in one graph
        runner = PiecewiseGraphRunner(ex.model, ex.attention, [1], dev)
        pieces = _Pieces()
        splitter = _Unsplit(runner, pieces, 1)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream), torch.inference_mode():
            splitter.begin()
            runner._forward(splitter, 1)
            splitter.end()
        torch.cuda.current_stream(dev).wait_stream(stream)
        keep.append(pieces)
    elif v in ("decode_again", "decode_xN"):
        for _ in range(1 if v == "decode_again" else args.count):
            again = CudaGraphRunner(ex.model, ex.attention, [1], ex.num_groups, dev)
            again.capture()
            keep.append(again)
    elif v in ("gemv_xN", "moe_xN"):  # one kernel family of the decode graph, in N graphs
        layer = ex.model.model.layers[0]
        h = torch.zeros(1, ex.model.config.hidden_size, dtype=torch.bfloat16, device=dev)
        ids = torch.arange(4, device=dev).view(1, 4)
        wts = torch.full((1, 4), 0.25, device=dev)

        def call() -> None:
            if v == "gemv_xN":
                layer.self_attn.qkv_proj(h)
                layer.self_attn.o_proj(torch.zeros(1, ex.model.config.q_size, dtype=h.dtype,
                                                   device=dev))
            else:
                layer.mlp.experts(h, wts, ids)

        with torch.inference_mode():
            call()
            for _ in range(args.count):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    call()
                keep.append(g)
    elif v == "many_small":
        x = torch.zeros(64, device=dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(1500):
                x.add_(1.0)
        keep.append(g)
    engine.step()  # plans attention for the real sequence again (a capture plans an empty one)
    torch.cuda.synchronize()
    print(f"{v}: after {replay_ms(decode)} ms", flush=True)
    if v == "pieces_then_recapture":
        again = CudaGraphRunner(ex.model, ex.attention, [1], ex.num_groups, dev)
        again.capture()
        print(f"{v}: a decode graph captured after {replay_ms(again.graphs[1])} ms", flush=True)
    if v == "decode_again":
        print(f"{v}: the second decode graph {replay_ms(keep[0].graphs[1])} ms", flush=True)
        engine.step()
        print(f"{v}: the first, planned again {replay_ms(decode)} ms", flush=True)
    engine.close()


class _Unsplit(_Splitter):
    """Copies q, k and v like the runner's splitter, but keeps one graph."""

    def __call__(self, layer, q, k, v, sinks, positions, rope_cache):
        r, n = self.runner, self.size
        r.q[:n].copy_(q)
        r.k[:n].copy_(k)
        r.v[:n].copy_(v)
        return r.out[:n]


if __name__ == "__main__":
    main()
