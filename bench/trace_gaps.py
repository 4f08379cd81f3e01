"""Where a profiled decode step's GPU time goes between kernels: reads a Chrome trace written by
`decode_latency.py --profile --trace FILE` and prints, per step, the time kernels ran and the
idle gaps, the largest gaps with the kernels on either side, and the kernels outside the graph.

    python bench/trace_gaps.py trace.json [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import json


def kernels(path: str) -> list[dict]:
    """The trace's GPU kernels and copies, in start order (one stream at batch 1 decode)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and e.get("ph") == "X"]
    return sorted(gpu, key=lambda e: e["ts"])


def short(name: str) -> str:
    return name.split("(")[0].split("<")[0].replace("void ", "")[-48:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    ks = kernels(args.trace)
    span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
    busy = sum(k["dur"] for k in ks)
    gaps = []
    end = ks[0]["ts"] + ks[0]["dur"]
    for prev, k in zip(ks, ks[1:]):
        gap = k["ts"] - end
        if gap > 0:
            gaps.append((gap, short(prev["name"]), short(k["name"])))
        end = max(end, k["ts"] + k["dur"])
    idle = sum(g for g, _, _ in gaps)
    print(f"{len(ks)} GPU events over {span / 1000:.3f} ms: busy {busy / 1000:.3f} ms, "
          f"idle {idle / 1000:.3f} ms ({100 * idle / span:.1f}%)")
    pairs: dict = collections.defaultdict(lambda: [0.0, 0])
    for g, a, b in gaps:
        pairs[(a, b)][0] += g
        pairs[(a, b)][1] += 1
    print(f"idle time by the kernels on either side (top {args.top}):")
    for (a, b), (total, n) in sorted(pairs.items(), key=lambda x: -x[1][0])[: args.top]:
        print(f"  {total / 1000:8.3f} ms  {n:5d} gaps  avg {total / n:6.2f} us  {a} -> {b}")
    names: dict = collections.defaultdict(lambda: [0.0, 0])
    for k in ks:
        names[short(k["name"])][0] += k["dur"]
        names[short(k["name"])][1] += 1
    print("GPU time by kernel:")
    for name, (total, n) in sorted(names.items(), key=lambda x: -x[1][0])[: args.top + 10]:
        print(f"  {total / 1000:8.3f} ms  {n:5d} calls  avg {total / n:6.2f} us  {name}")


if __name__ == "__main__":
    main()
