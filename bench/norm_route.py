"""Times the decode step's norm + router + top-k launch (`layer_ops_triton.norm_route_triton`)
as a decode step runs it: LAYERS launches in one CUDA graph, each layer with its own router
weights, L2 flushed before each replay (the weights come from memory, as they do after a
layer's GEMVs), for router rows a program x warps a program, at gpt-oss-20b's 32 experts and
gpt-oss-120b's 128, the top-k by ranks (r) or by rounds of argmax (a). Prints microseconds a
layer.

    python bench/norm_route.py --tokens 1,8 --configs 2/4/r,2/4/a,4/8/a

`--launches both` times every step both ways, whatever NORM_ROUTE_MAX_TOKENS picks: in one
launch (the `one` column; each token's programs read the router rows again, from L2) and as the
norm, router GEMM and top-k in turn (`three`):

    python bench/norm_route.py --tokens 16,32,64 --configs 2/4/r,4/8/a --launches both
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.dense_gemv import graph_time  # noqa: E402
from tinyoss.kernels import layer_ops_triton as lo  # noqa: E402

HIDDEN, TOP_K, LAYERS = 2880, 4, 36


def layer_us(tokens: int, experts: int) -> float:
    """us a layer of LAYERS norm_route launches in one graph, with the module's constants."""
    dev = torch.device("cuda")
    layers = [dict(x=torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16),
                   residual=torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16),
                   norm_weight=torch.rand(HIDDEN, device=dev) + 0.5,
                   router_weight=torch.randn(experts, HIDDEN, device=dev,
                                             dtype=torch.bfloat16) / HIDDEN**0.5,
                   router_bias=torch.randn(experts, device=dev, dtype=torch.bfloat16))
              for _ in range(LAYERS)]

    def run() -> None:
        for a in layers:
            lo.norm_route_triton(a["x"], a["residual"], a["norm_weight"], 1e-5,
                                 a["router_weight"], a["router_bias"], TOP_K)

    return graph_time(run, LAYERS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,8")
    p.add_argument("--experts", default="32,128")
    p.add_argument("--configs", default="8/4/r,2/4/r,2/4/a,4/4/a,4/8/r,4/8/a,8/8/a",
                   help="router rows a program / warps a program / top-k by ranks or argmax")
    p.add_argument("--launches", choices=("product", "both"), default="product",
                   help="both: time each step in one launch and in three")
    args = p.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    product_max = dict(lo.NORM_ROUTE_MAX_TOKENS)
    ways = {"": product_max} if args.launches == "product" else {
        " one": dict.fromkeys(product_max, max(token_counts)),
        " three": dict.fromkeys(product_max, 0)}
    print(f"{torch.cuda.get_device_name()} | us a layer ({LAYERS} layers a graph, L2 flushed "
          f"before each replay) | product: {lo.NORM_ROUTE_TILES}, argmax from "
          f"{lo.TOPK_ARGMAX_FROM} experts")
    for experts in (int(e) for e in args.experts.split(",")):
        for tokens in token_counts:
            cells = []
            for cfg in args.configs.split(","):
                rows, warps, topk = cfg.split("/")
                lo.NORM_ROUTE_TILES = dict.fromkeys(("few", "many"), (int(rows), int(warps)))
                lo.TOPK_ARGMAX_FROM = 1 << 30 if topk == "r" else 1
                for way, max_tokens in ways.items():
                    lo.NORM_ROUTE_MAX_TOKENS = max_tokens
                    lo._tickets.clear()  # sized by NORM_ROUTE_MAX_TOKENS
                    cells.append(f"{cfg}{way} {layer_us(tokens, experts):6.2f}")
                lo.NORM_ROUTE_MAX_TOKENS = product_max
                lo._tickets.clear()
            print(f"experts {experts:3d} tokens {tokens}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
