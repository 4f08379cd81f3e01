"""FlashInfer's plan race, shown on a GPU: two prefill steps planned while the stream is busy.

FlashInfer's `plan` writes the schedule into one pinned host buffer and queues its copy to the
GPU without waiting; a second plan before the GPU reached the first copy rewrites the buffer,
so the first step runs the second step's schedule. This runs two steps one at a time (the
reference), then both behind a ~10 ms sleep on the stream: with `--raw` (the wrappers planned
directly, as before `PlanRing`) and without (through `PlanRing`). It prints whether each step's
output equals the reference; `--raw` may also die with an illegal memory access.

    python bench/experiments/flashinfer_plan_race/race.py          # through PlanRing
    python bench/experiments/flashinfer_plan_race/race.py --raw    # the wrappers themselves
"""

from __future__ import annotations

import argparse
import random

import torch

from tinyoss.kernels import attention_flashinfer as af
from tinyoss.kernels.attention import AttentionMetadata, GroupMetadata


def meta(query_lens, seq_lens, bs, blocks, rng) -> AttentionMetadata:
    free = list(range(blocks))
    rng.shuffle(free)
    groups = []
    for w in (128, 0):
        tables, starts, slots = [], [], []
        for q, n in zip(query_lens, seq_lens):
            first = max(0, n - q - w + 1) // bs if w else 0
            table = [free.pop() for _ in range(-(-n // bs) - first)]
            tables.append(table)
            starts.append(first * bs)
            slots += [table[p // bs - first] * bs + p % bs for p in range(n - q, n)]
        groups.append(GroupMetadata(tables, starts, torch.tensor(slots, device="cuda")))
    return AttentionMetadata(list(query_lens), list(seq_lens), groups)


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
    rng = random.Random(5)
    steps = []
    for q_lens, s_lens in (([300, 17, 129], [300, 17, 129]), ([64, 1, 200], [500, 90, 999])):
        t = sum(q_lens)
        qkv = [torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk)]
        pos = torch.tensor([p for ql, n in zip(q_lens, s_lens) for p in range(n - ql, n)],
                           device="cuda")
        steps.append((meta(q_lens, s_lens, bs, blocks, rng), qkv, pos))
    sinks = torch.randn(hq, device="cuda")
    rope = torch.randn(4096, d, device="cuda")

    def run_all(wait_each: bool) -> list[torch.Tensor]:
        outs = []
        for m, (q, k, v), pos in steps:
            fi.plan(m)
            outs.append(fi(1, q.clone(), k.clone(), v, sinks, pos, rope))
            if wait_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return outs

    run_all(True)
    want = run_all(True)
    torch.cuda._sleep(args.sleep_cycles)
    got = run_all(False)
    for i, (w, g) in enumerate(zip(want, got)):
        print(f"{'raw wrappers' if args.raw else 'PlanRing'}: step {i} "
              f"{'equals' if torch.equal(w, g) else 'DIFFERS from'} the reference "
              f"(max |diff| {(w.float() - g.float()).abs().max().item():.3g})")


if __name__ == "__main__":
    main()
