"""Mixed steps of many sizes: N decoding streams plus a long prompt prefilled in chunks of
random sizes (1 .. max), to find a token count or context at which a kernel fails (run with
CUDA_LAUNCH_BLOCKING=1 to name the kernel). Prints each step's shape and time.

    CUDA_LAUNCH_BLOCKING=1 python bench/experiments/chunk_sweep.py --model gpt-oss-20b \
        --load-format dummy --prompts 2
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--long-len", type=int, default=32768)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-chunk", type=int, default=8192)
    p.add_argument("--sizes", type=int, nargs="*", default=[], help="chunk sizes to try first")
    args = p.parse_args()

    import torch

    from tinyoss import LLM, SamplingParams
    from tinyoss.engine.core import CoreRequest

    llm = LLM(args.model, load_format=args.load_format, max_model_len=args.long_len + 4096,
              kv_cache_tokens=args.long_len * 2 + args.streams * 8192,
              max_num_batched_tokens=args.max_chunk + args.streams)
    core, rng = llm.engine, random.Random(0)
    ids = lambda n: [rng.randrange(1000, 150000) for _ in range(n)]  # noqa: E731
    decode = SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0)
    for i in range(args.streams):
        core.add(CoreRequest(f"s{i}", ids(1024), decode))
    while core.scheduler.waiting or any(s.num_computed < s.num_prompt
                                        for s in core.scheduler.running):
        core.step()
    sizes = list(args.sizes)
    for k in range(args.prompts):
        core.add(CoreRequest(f"long{k}", ids(args.long_len), SamplingParams(max_tokens=1)))
        done = False
        while not done:
            n = sizes.pop(0) if sizes else rng.choice(
                [rng.randint(1, 64), rng.randint(65, 2048), rng.randint(2049, args.max_chunk)])
            core.scheduler.max_num_batched_tokens = args.streams + n
            seq = next((s for s in core.scheduler.running if s.request_id == f"long{k}"), None)
            context = seq.num_computed if seq else 0
            t0 = time.perf_counter()
            deltas = core.step()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) * 1e3
            print(f"prompt {k} context {context:6d} chunk {n:5d} step {dt:7.1f} ms", flush=True)
            done = any(d.request_id == f"long{k}" and d.token_ids for d in deltas)
    print("no fault")


if __name__ == "__main__":
    main()
