"""How the grouped tensor-core MoE GEMV's time depends on its number of groups (GPU only).

The grouped kernels (`moe_gemv_mma.cu`) cut an expert's pairs into groups of up to 8, and each
group reads and decodes the expert's rows again: at 64 tokens of gpt-oss-20b (256 pairs over 32
experts, ~8 a expert) random routing makes ~45 groups where 32 would hold them. This times
gate_up and down at T tokens for three routings of the same pair count:

- balanced: every expert gets T * 4 / E pairs (the fewest groups);
- random: 4 distinct experts a token, uniform (what bench/moe_kernels.py and decode_latency use);
- skewed: 4 distinct experts a token drawn with weights 1 / (rank + 1) (a few popular experts,
  as trained routers have).

If time follows the group count, groups of 16 (two MMA column tiles a decoded weight fragment)
would pay at batch 64.

    python bench/experiments/group16/balance.py --tokens 16,32,64 --experts 32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dataclasses import replace  # noqa: E402

from moe_kernels import timed, weights  # noqa: E402

from tinyoss.kernels.moe_gemv_mma import load  # noqa: E402


def routing(mode: str, t: int, e: int, gen: torch.Generator) -> torch.Tensor:
    """top-4 expert ids [t, 4], distinct a token."""
    if mode == "balanced":
        return (torch.arange(t)[:, None] * 4 + torch.arange(4)[None, :]) % e
    if mode == "random":
        return torch.stack([torch.randperm(e, generator=gen)[:4] for _ in range(t)])
    p = 1.0 / (torch.arange(e, dtype=torch.float32) + 1)
    perm = torch.randperm(e, generator=gen)  # which experts are popular
    return perm[torch.multinomial(p.expand(t, e), 4, replacement=False, generator=gen)]


def groups_of(ids: torch.Tensor, size: int) -> int:
    counts = torch.bincount(ids.reshape(-1))
    return int(((counts + size - 1) // size).sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="16,32,64")
    p.add_argument("--experts", type=int, default=32)
    args = p.parse_args()
    mma, why = load(torch.cuda.get_device_capability())
    if mma is None:
        raise SystemExit(f"the tensor-core kernels do not run here: {why}")
    e, h, i = args.experts, 2880, 2880
    ws = [weights(s, e, h, i) for s in range(4)]
    ws = [replace(w, gate_up_bias=w.gate_up_bias.bfloat16(), down_bias=w.down_bias.bfloat16())
          for w in ws]  # the kernels take the checkpoint's bf16 biases
    for t in map(int, args.tokens.split(",")):
        for mode in ("balanced", "random", "skewed"):
            gen = torch.Generator().manual_seed(t)
            sets = []
            for w in ws:
                ids = routing(mode, t, e, gen).to("cuda", torch.int32)
                x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
                wts = torch.softmax(torch.randn(t, 4, device="cuda"), -1).reshape(-1)
                act = torch.empty(t * 4, i, device="cuda")
                y = torch.empty(t * 4, h, device="cuda")
                sets.append((x, ids, wts, act, y, w))

            def gate_up(x, ids, wts, act, y, w):
                by = mma.sort_pairs(ids.reshape(-1), e)
                mma.grouped(x, 4, by, w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias, wts,
                            act, w.alpha, w.limit, swiglu=True)

            def both(x, ids, wts, act, y, w):
                by = mma.sort_pairs(ids.reshape(-1), e)
                mma.grouped(x, 4, by, w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias, wts,
                            act, w.alpha, w.limit, swiglu=True)
                mma.grouped(act, 1, by, w.down_blocks, w.down_scales, w.down_bias, wts, y,
                            w.alpha, w.limit, swiglu=False)

            def sort_only(x, ids, wts, act, y, w):
                mma.sort_pairs(ids.reshape(-1), e)

            ids0 = sets[0][1].cpu()
            distinct = len(torch.unique(ids0))
            s_us, g_us, b_us = (timed(f, sets) for f in (sort_only, gate_up, both))
            print(f"T={t:<3} E={e} {mode:<8} distinct {distinct:3d} groups8 {groups_of(ids0, 8):3d}"
                  f" groups16 {groups_of(ids0, 16):3d} | sort {s_us:6.1f} us, gate_up "
                  f"{g_us - s_us:6.1f}, down {b_us - g_us:6.1f}", flush=True)


if __name__ == "__main__":
    main()
