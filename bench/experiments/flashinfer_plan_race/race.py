"""FlashInfer's plan race, shown on a GPU: two prefill steps planned while the stream is busy.

FlashInfer's `plan` writes the schedule into one pinned host buffer and queues its copy to the
GPU without waiting; a second plan before the GPU reached the first copy rewrites the buffer,
so the first step runs the second step's schedule. This runs two steps one at a time (the
reference), then both behind a ~10 ms sleep on the stream (tests/test_gpu.py's
`two_prefills_behind_a_busy_stream`): with `--raw` (the wrappers planned directly, as before
`PlanRing`) and without (through `PlanRing`). It prints whether each step's output equals the
reference; `--raw` may also die with an illegal memory access.

    python bench/experiments/flashinfer_plan_race/race.py          # through PlanRing
    python bench/experiments/flashinfer_plan_race/race.py --raw    # the wrappers themselves
"""

from __future__ import annotations

import argparse

import torch

from tests.test_gpu import two_prefills_behind_a_busy_stream
from tinyoss.kernels import attention_flashinfer as af


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--raw", action="store_true", help="plan the wrappers without PlanRing")
    p.add_argument("--sleep-cycles", type=int, default=20_000_000)
    args = p.parse_args()
    if args.raw:
        af.PlanRing.plan = lambda self, *a, **k: self.wrapper.plan(*a, **k)
    torch.manual_seed(0)
    hq, hk, d, bs, blocks = 64, 8, 64, 16, 512
    caches = [tuple(torch.randn(blocks + 1, bs, hk, d, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2)) for _ in range(2)]
    fi = af.FlashInferAttention(caches, [0, 1], [128, 0], hq, hk, d, bs, dummy_block=blocks,
                                max_num_tokens=4096, max_num_seqs=8, max_model_len=2048)
    want, got = two_prefills_behind_a_busy_stream(fi, (hq, hk, d, bs, blocks), args.sleep_cycles)
    for i, (w, g) in enumerate(zip(want, got)):
        print(f"{'raw wrappers' if args.raw else 'PlanRing'}: step {i} "
              f"{'equals' if torch.equal(w, g) else 'DIFFERS from'} the reference "
              f"(max |diff| {(w.float() - g.float()).abs().max().item():.3g})")


if __name__ == "__main__":
    main()
