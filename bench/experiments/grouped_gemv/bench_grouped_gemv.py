"""Times the expert-grouped MoE GEMV (moe_gemv_grouped.py beside this file) against the pair GEMV
(`moe_triton._gemv_pairs`, the Gluon kernel on a GPU) at gpt-oss shapes on one GPU.

Random MXFP4 experts (hidden 2880, intermediate 2880; 32 experts for gpt-oss-20b, 128 for 120b),
T tokens with random top-4 routing and with every token on the same four experts. Both paths
produce y [T*4, H] fp32 (gate_up + SwiGLU + down + routing weight, no combine); they are checked
against each other (max abs diff), then each is captured in a CUDA graph of several calls over
rotating weight sets (so L2 does not keep an expert between calls) and timed with CUDA events:
median microseconds of one call. GB/s counts the expert bytes each reads: the distinct experts
for the grouped GEMV, every pair's expert for the pair GEMV.

    python bench/experiments/grouped_gemv/bench_grouped_gemv.py
    python bench/experiments/grouped_gemv/bench_grouped_gemv.py --models 20b --tokens 4,8 \
        --configs 8/8/256/1/0,16/16/256/2/0
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tinyoss.kernels import moe_triton as mt  # noqa: E402
from bench.experiments.grouped_gemv.moe_gemv_grouped import GroupedGemvConfig, grouped_gemv_pairs  # noqa: E402
from tinyoss.kernels.moe_torch import ExpertWeights  # noqa: E402
from tinyoss.model.layout import TensorSpec  # noqa: E402
from tinyoss.model.synthetic import random_experts  # noqa: E402

MODELS = {"20b": 32, "120b": 128}
H = I = 2880
TOPK = 4


def weights(seed: int, e: int) -> ExpertWeights:
    dev = torch.device("cuda")
    gb, gs = random_experts(TensorSpec("mlp.experts.gate_up_proj_blocks",
                                       (e, 2 * I, H // 32, 16), "U8"), seed, dev)
    db, ds = random_experts(TensorSpec("mlp.experts.down_proj_blocks", (e, H, I // 32, 16), "U8"),
                            seed, dev)
    return ExpertWeights(gb, gs, torch.randn(e, 2 * I, device=dev) * 0.1, db, ds,
                         torch.randn(e, H, device=dev) * 0.1)


def expert_bytes(w: ExpertWeights) -> int:
    """Bytes of one expert: packed codes, scales and biases of gate_up and down."""
    parts = (w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias, w.down_blocks, w.down_scales,
             w.down_bias)
    return sum(p[0].numel() * p.element_size() for p in parts)


def routing(gen: torch.Generator, t: int, e: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk weights [T, 4] fp32, ids [T, 4]): 'random' top-4 of e per token, or 'same': one
    random set of four experts for every token (each token in its own order)."""
    if kind == "same":
        base = torch.randperm(e, device="cuda", generator=gen)[:TOPK]
        ids = torch.stack([base[torch.randperm(TOPK, device="cuda", generator=gen)]
                           for _ in range(t)])
    else:
        ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:TOPK]
                           for _ in range(t)])
    return torch.softmax(torch.randn(t, TOPK, device="cuda", generator=gen), -1), ids


def timed(fn, sets: list[tuple], iters: int, warmup: int) -> float:
    """Median microseconds of one call: a CUDA graph of one call per set, replayed `iters`
    times after `warmup` replays, each replay between two CUDA events."""
    for args in sets:
        fn(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in sets:
            fn(*args)
    for _ in range(warmup):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / len(sets)


def parse_configs(text: str) -> list[GroupedGemvConfig]:
    """block_n1/block_n2/block_k/num_warps[/phases[/padded[/prefetch]]] (flags 0|1, defaults
    those of `GroupedGemvConfig`), comma-separated."""
    out = []
    d = GroupedGemvConfig()
    for c in text.split(","):
        n1, n2, k, warps, *flags = map(int, c.split("/"))
        phases, padded, prefetch = [bool(f) for f in flags] + [d.phases, d.padded,
                                                               d.prefetch][len(flags):]
        out.append(GroupedGemvConfig(n1, n2, k, warps, phases, padded, prefetch))
    return out


def config_name(c: GroupedGemvConfig) -> str:
    return (f"{c.block_n1}/{c.block_n2}/{c.block_k}/{c.num_warps}/{int(c.phases)}/"
            f"{int(c.padded)}/{int(c.prefetch)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="20b,120b", help="comma-separated: 20b (32 experts), "
                   "120b (128 experts)")
    p.add_argument("--tokens", default="1,2,3,4,6,8")
    p.add_argument("--routings", default="random,same")
    p.add_argument("--configs", default=config_name(GroupedGemvConfig()),
                   help="grouped GEMV configs to time, comma-separated "
                   "block_n1/block_n2/block_k/num_warps[/phases[/padded[/prefetch]]] "
                   "(flags 0|1); default: the defaults")
    p.add_argument("--weight-sets", type=int, default=0,
                   help="rotating weight sets (default: 4 for 20b, 2 for 120b)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_grouped_gemv.py needs a CUDA GPU; none found, nothing timed.")
        return
    configs = parse_configs(args.configs)
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
          f"pair GEMV: {'Gluon' if mt.GLUON else 'Triton'} {mt.GemvConfig()}")
    print(f"{'model':>5} {'T':>2} {'routing':>7} {'experts':>7} {'config':>19} "
          f"{'pair us':>8} {'grp us':>8} {'ratio':>6} {'pair GB/s':>9} {'grp GB/s':>8} "
          f"{'max|diff|':>9}")
    for model in args.models.split(","):
        e = MODELS[model]
        n_sets = args.weight_sets or (4 if e <= 32 else 2)
        ws = [weights(args.seed + s, e) for s in range(n_sets)]
        nbytes = expert_bytes(ws[0])
        for t in map(int, args.tokens.split(",")):
            for kind in args.routings.split(","):
                gen = torch.Generator(device="cuda").manual_seed(args.seed * 1000 + t)
                sets = []
                for w in ws:
                    x = torch.randn(t, H, device="cuda", generator=gen).to(torch.bfloat16)
                    sets.append((x, *routing(gen, t, e, kind), w))
                n_exp = sum(torch.unique(s[2]).numel() for s in sets) / len(sets)
                pair_bytes = t * TOPK * nbytes

                def pair(*a):
                    return mt._gemv_pairs(*a, None)

                pair_us = timed(pair, sets, args.iters, args.warmup)
                y_pair = pair(*sets[0])
                for cfg in configs:
                    def grouped(*a, cfg=cfg):
                        return grouped_gemv_pairs(*a, cfg)

                    diff = (grouped(*sets[0]) - y_pair).abs().max().item()
                    grp_us = timed(grouped, sets, args.iters, args.warmup)
                    name = config_name(cfg)
                    print(f"{model:>5} {t:>2} {kind:>7} {n_exp:>7.1f} {name:>19} "
                          f"{pair_us:>8.1f} {grp_us:>8.1f} {pair_us / grp_us:>6.2f} "
                          f"{pair_bytes / pair_us / 1e3:>9.0f} "
                          f"{n_exp * nbytes / grp_us / 1e3:>8.0f} {diff:>9.2e}", flush=True)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
