"""Do the bf16 decode GEMVs read faster when their weights were sent to L2 while a kernel that
reads little ran (attention, the norms)? gpt-oss-20b's q/k/v and o at one row of x, on the
streaming GEMV (`moe_gemv_mma.stream_linear`), 24 layers of distinct weights in one CUDA graph:

    layer: q/k/v GEMV -> a spin of ATT us (attention) -> o GEMV -> a spin of GAP us (norm, router)
           -> a read of MOE MB of other bytes (the experts) -> a spin

each without prefetch, with o's weights prefetched by the q/k/v GEMV's programs as they finish
(`prefetch`), by a separate prefetch launch, and with the next layer's q/k/v prefetched by o's
GEMV too. Prints microseconds a layer and what the two GEMVs alone take in each case.

    python bench/experiments/l2_prefetch/bench.py [--att 8] [--gap 4] [--moe 52]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from dense_gemv import graph_time  # noqa: E402
from tinyoss.kernels.moe_gemv_mma import load  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--att", type=float, default=8.0, help="us of the attention stand-in")
    p.add_argument("--gap", type=float, default=4.0, help="us of the norm/router stand-in")
    p.add_argument("--moe", type=float, default=52.0, help="MB the experts stand-in reads")
    p.add_argument("--layers", type=int, default=24)
    args = p.parse_args()
    dev = torch.device("cuda")
    mma, why = load(torch.cuda.get_device_capability(dev))
    assert mma is not None, why
    clock = getattr(torch.cuda.get_device_properties(dev), "clock_rate", 0) * 1e3  # Hz
    cycles = lambda us: int(us * 1e-6 * (clock or 1.755e9))  # noqa: E731
    L = args.layers
    g = torch.Generator(device=dev).manual_seed(0)
    wq = [torch.randn(5120, 2880, device=dev, generator=g).to(torch.bfloat16) * 0.02
          for _ in range(L)]
    bq = [torch.zeros(5120, device=dev, dtype=torch.bfloat16) for _ in range(L)]
    wo = [torch.randn(2880, 4096, device=dev, generator=g).to(torch.bfloat16) * 0.02
          for _ in range(L)]
    bo = [torch.zeros(2880, device=dev, dtype=torch.bfloat16) for _ in range(L)]
    moe = [torch.empty(int(args.moe * 1e6) // 4, dtype=torch.float32, device=dev)
           for _ in range(L)]
    x = torch.randn(1, 2880, device=dev).to(torch.bfloat16)
    y = torch.randn(1, 4096, device=dev).to(torch.bfloat16)

    def layer_chain(pf_o: str, pf_qkv: bool, only: str = "") -> None:
        for i in range(L):
            nxt = wq[(i + 1) % L] if pf_qkv else None
            if only in ("", "qkv"):
                mma.stream_linear(x, wq[i], bq[i], wo[i] if pf_o == "fused" else None)
            if pf_o == "launch":
                mma.prefetch(wo[i])
            torch.cuda._sleep(cycles(args.att))
            if only in ("", "o"):
                mma.stream_linear(y, wo[i], bo[i], nxt)
            torch.cuda._sleep(cycles(args.gap))
            if args.moe:
                moe[i].sum()  # reads the stand-in's bytes (a reduction: little else)
            torch.cuda._sleep(cycles(2.6))

    ref_o = mma.stream_linear(y, wo[0], bo[0])
    assert torch.equal(ref_o, mma.stream_linear(y, wo[0], bo[0], wq[1])), "prefetch changed o"
    base = graph_time(lambda: layer_chain("", False), L)
    print(f"a layer (us): att {args.att} gap {args.gap} moe {args.moe} MB", flush=True)
    print(f"  no prefetch                   {base:7.2f}", flush=True)
    for label, pf_o, pf_qkv in (("o by q/k/v's programs", "fused", False),
                                ("o by its own launch", "launch", False),
                                ("o fused + next q/k/v by o", "fused", True),
                                ("next q/k/v by o only", "", True)):
        t = graph_time(lambda: layer_chain(pf_o, pf_qkv), L)
        print(f"  {label:29s} {t:7.2f}  ({t - base:+.2f})", flush=True)
    # the stand-ins alone, to read what the GEMVs take
    none = graph_time(lambda: layer_chain("", False, only="none"), L)
    print(f"  stand-ins alone               {none:7.2f}", flush=True)


if __name__ == "__main__":
    main()
