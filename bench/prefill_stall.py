"""How much a long prompt stalls running streams: the inter-token latency of N decoding
sequences alone, then while a long prompt is admitted, and that prompt's time to first token.

    python bench/prefill_stall.py --model gpt-oss-20b --load-format dummy --budgets 0 50

One engine per --decode-step-budget-ms value (0: prefill chunks take the whole step budget).
Each engine step gives every running stream one token, so a step's time is their ITL.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(args: argparse.Namespace, budget: float) -> dict:
    import torch

    from bench.step_timer import StepTimer, start_streams
    from tinyoss import LLM, SamplingParams
    from tinyoss.engine.core import CoreRequest

    stream_len = 1024 + args.alone_steps + 2048
    llm = LLM(args.model, load_format=args.load_format,
              max_model_len=max(args.long_len, stream_len) + 64,
              kv_cache_tokens=args.long_len + args.streams * stream_len + 4096,
              decode_step_budget_ms=budget,
              max_prefill_graph_tokens=args.max_prefill_graph_tokens)
    core, rng = llm.engine, random.Random(0)
    ids = lambda n: [rng.randrange(1000, 150000) for _ in range(n)]  # noqa: E731
    start_streams(core, args.streams, 1024, stream_len - 1024, rng)
    timer = StepTimer(core)
    step = timer.step
    alone = [step()[0] for _ in range(args.alone_steps)]
    timer.clear()
    core.add(CoreRequest("long", ids(args.long_len), SamplingParams(max_tokens=1)))
    during, chunks, start = [], [], time.perf_counter()

    def computed() -> int:  # the long prompt's tokens in the cache
        seqs = core.scheduler.running + list(core.scheduler.waiting)
        return next((s.num_computed for s in seqs if s.request_id == "long"), args.long_len)

    while True:
        before = computed()
        dt, deltas = step()
        during.append(dt)
        chunks.append((before, computed() - before))
        if any(d.request_id == "long" and d.token_ids for d in deltas):
            break
    ttft = time.perf_counter() - start
    times = timer.times()
    for i in range(args.streams):
        core.abort(f"s{i}")
    while core.has_work():
        core.step()
    llm = core = None  # free the engine before the next one is built
    gc.collect()
    torch.cuda.empty_cache()
    ms = lambda v: round(1e3 * v, 2)  # noqa: E731
    return {
        "budget_ms": budget,
        "alone": {"p50": ms(statistics.median(alone)), "p99": ms(percentile(alone, 0.99)),
                  "max": ms(max(alone))},
        "during": {"p50": ms(statistics.median(during)), "p99": ms(percentile(during, 0.99)),
                   "max": ms(max(during)), "steps": len(during)},
        "long_ttft_s": round(ttft, 3),
        "slowest": [  # (ms, GPU ms, launch ms, context, chunk) of the slowest steps
            (ms(during[i]), ms(times[i][1]), ms(times[i][2]), *chunks[i])
            for i in sorted(range(len(during)), key=during.__getitem__)[-3:][::-1]
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--streams", type=int, default=8, help="decoding sequences (1024 in)")
    p.add_argument("--long-len", type=int, default=32768, help="the long prompt's tokens")
    p.add_argument("--alone-steps", type=int, default=200, help="steps timed without it")
    p.add_argument("--max-prefill-graph-tokens", type=int, default=2048,
                   help="engine option: the largest step replayed from piecewise graphs")
    p.add_argument("--budgets", type=float, nargs="+", default=[0, 50],
                   help="decode_step_budget_ms values, one engine each")
    args = p.parse_args()
    for budget in args.budgets:
        r = measure(args, budget)
        print(f"budget {budget:g} ms | {args.streams} streams alone: ITL p50 {r['alone']['p50']} "
              f"p99 {r['alone']['p99']} max {r['alone']['max']} ms | while a "
              f"{args.long_len}-token prompt is admitted: p50 {r['during']['p50']} p99 "
              f"{r['during']['p99']} max {r['during']['max']} ms over {r['during']['steps']} "
              f"steps | its TTFT {r['long_ttft_s']} s | slowest (ms, GPU ms, host launch ms, context, "
              f"chunk): "
              f"{r['slowest']}", flush=True)


if __name__ == "__main__":
    main()
