"""Where a profiled decode step's GPU time goes between kernels: reads a Chrome trace written by
`decode_latency.py --profile --trace FILE` and prints the time GPU work ran and the time the GPU
sat idle between it, the idle time by the pair of kernels on either side, and the GPU time by
kernel. Under the profiler the host runs slower, so gaps at step boundaries read larger than
in a plain run; gaps inside a CUDA graph do not depend on the host.

    python bench/trace_gaps.py trace.json [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import json
from dataclasses import dataclass, field


@dataclass
class Summary:
    span_us: float  # first start to last end
    busy_us: float  # sum of the events' durations
    idle_us: float  # time no event ran
    gaps: dict = field(default_factory=dict)  # (before, after) -> [idle us, count]
    kernels: dict = field(default_factory=dict)  # name -> [us, count]


def gpu_events(path: str) -> list[dict]:
    """The trace's GPU kernels, copies and memsets, in start order."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and e.get("ph") == "X"]
    return sorted(gpu, key=lambda e: e["ts"])


def short(name: str) -> str:
    """A kernel's name without its template arguments and parameters."""
    return name.split("(")[0].split("<")[0].replace("void ", "").strip()[-48:]


def summarize(events: list[dict]) -> Summary:
    """Busy and idle time of GPU events (start-ordered; overlapping events count once towards
    idle), the idle time by the kernels on either side, and each kernel's total time."""
    end = events[0]["ts"] + events[0]["dur"]
    out = Summary(span_us=max(e["ts"] + e["dur"] for e in events) - events[0]["ts"],
                  busy_us=sum(e["dur"] for e in events), idle_us=0.0)
    gaps: dict = collections.defaultdict(lambda: [0.0, 0])
    for prev, e in zip(events, events[1:]):
        if e["ts"] > end:
            gap = gaps[(short(prev["name"]), short(e["name"]))]
            gap[0] += e["ts"] - end
            gap[1] += 1
            out.idle_us += e["ts"] - end
        end = max(end, e["ts"] + e["dur"])
    kernels: dict = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        kernels[short(e["name"])][0] += e["dur"]
        kernels[short(e["name"])][1] += 1
    out.gaps, out.kernels = dict(gaps), dict(kernels)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    events = gpu_events(args.trace)
    s = summarize(events)
    print(f"{len(events)} GPU events over {s.span_us / 1000:.3f} ms: busy {s.busy_us / 1000:.3f} "
          f"ms, idle {s.idle_us / 1000:.3f} ms ({100 * s.idle_us / s.span_us:.1f}%)")
    print(f"idle time by the kernels on either side (top {args.top}):")
    for (a, b), (total, n) in sorted(s.gaps.items(), key=lambda x: -x[1][0])[: args.top]:
        print(f"  {total / 1000:8.3f} ms  {n:5d} gaps  avg {total / n:6.2f} us  {a} -> {b}")
    print("GPU time by kernel:")
    for name, (total, n) in sorted(s.kernels.items(), key=lambda x: -x[1][0])[: args.top + 10]:
        print(f"  {total / 1000:8.3f} ms  {n:5d} calls  avg {total / n:6.2f} us  {name}")


if __name__ == "__main__":
    main()
