"""Is anything compiled or planned on first use? Each workload runs twice on a fresh engine
whose Triton cache starts empty: the time of both runs, and how many kernels Triton compiled
during each (files added to its cache). A served first burst pays whatever the first run pays.

    python bench/first_use.py --model gpt-oss-20b --load-format dummy
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, prompts, prompt tokens, output tokens)
WORKLOADS = [
    ("burst 64 x 64 in, 64 out", 64, 64, 64),
    ("64 x 1024 in, 16 out", 64, 1024, 16),
    ("1 x 1000 in, 8 out", 1, 1000, 8),
    ("1 x 9000 in (chunked), 4 out", 1, 9000, 4),
    ("300 x 37 in, 8 out (past the largest graph)", 300, 37, 8),
]


def compiled(cache: Path) -> int:
    return sum(1 for _ in cache.rglob("*.json"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--max-model-len", type=int, default=16384)
    args = p.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="triton-cache-"))
    os.environ["TRITON_CACHE_DIR"] = str(cache)  # before Triton is imported

    from tinyoss import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, max_model_len=args.max_model_len,
              max_num_seqs=512)
    print(f"start-up: {time.perf_counter() - t0:.1f} s, {compiled(cache)} kernels compiled")
    rng = random.Random(0)
    for name, n, length, out in WORKLOADS:
        times, kernels = [], []
        for _ in range(2):
            prompts = [[rng.randrange(1000, 150000) for _ in range(length)] for _ in range(n)]
            params = SamplingParams(max_tokens=out, ignore_eos=True, temperature=0)
            before, t = compiled(cache), time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
            kernels.append(compiled(cache) - before)
        print(f"{name:45s} first {times[0]:7.3f} s ({kernels[0]} compiled), repeat "
              f"{times[1]:7.3f} s ({kernels[1]}): first/repeat {times[0] / times[1]:.2f}")


if __name__ == "__main__":
    main()
