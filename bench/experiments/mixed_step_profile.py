"""Where the time of a mixed step goes: N streams decoding plus one prefill chunk of n tokens.

    python bench/experiments/mixed_step_profile.py --model gpt-oss-20b --load-format dummy

For each chunk size: the step's wall time (synchronized), the host time until the executor's
launch returns (no sync), and the GPU time of the step (CUDA events), medians over the steps of
one prompt; then the profiler's top host ops for one step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--max-steps", type=int, default=48)
    p.add_argument("--profile-chunk", type=int, default=64)
    p.add_argument("--rows", type=int, default=25, help="profiler rows shown")
    p.add_argument("--max-prefill-graph-tokens", type=int, default=1024)
    args = p.parse_args()

    import torch

    from bench.step_timer import StepTimer, start_streams
    from tinyoss import LLM, SamplingParams
    from tinyoss.engine.core import CoreRequest

    llm = LLM(args.model, load_format=args.load_format, max_model_len=40000,
              kv_cache_tokens=args.streams * 40000 + 2 * args.prompt_len + 8192,
              max_prefill_graph_tokens=args.max_prefill_graph_tokens)
    core, rng = llm.engine, random.Random(0)
    ids = lambda n: [rng.randrange(1000, 150000) for _ in range(n)]  # noqa: E731
    start_streams(core, args.streams, 1024, 30000, rng)
    timer = StepTimer(core)
    sched = core.scheduler
    full = sched.max_num_batched_tokens
    for n in args.chunks:
        sched.max_num_batched_tokens = args.streams + n
        core.add(CoreRequest(f"long{n}", ids(args.prompt_len), SamplingParams(max_tokens=1)))
        timer.clear()
        for _ in range(args.max_steps):
            _, deltas = timer.step()
            if any(d.request_id == f"long{n}" and d.finish_reason for d in deltas):
                break
        walls, gpus, hosts = zip(*timer.times())
        core.abort(f"long{n}")
        core.step()
        med = lambda v: 1e3 * statistics.median(v[2:])  # noqa: E731
        print(f"chunk {n:5d} + {args.streams} decodes: wall {med(walls):7.2f} ms, host launch "
              f"{med(hosts):7.2f} ms, cuda events {med(gpus):7.2f} ms over {len(walls)} steps",
              flush=True)
    sched.max_num_batched_tokens = args.streams + args.profile_chunk
    core.add(CoreRequest("prof", ids(args.prompt_len), SamplingParams(max_tokens=1)))
    for _ in range(4):
        core.step()
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            core.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))
    sched.max_num_batched_tokens = full


if __name__ == "__main__":
    main()
