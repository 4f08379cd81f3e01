"""Runs each MoE path once at gpt-oss-20b shapes and T tokens (for ncu: one launch per kernel)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.moe_gemv_sweep import weights  # noqa: E402
from tinyoss.kernels import moe_triton as mt  # noqa: E402

t = int(sys.argv[1]) if len(sys.argv) > 1 else 1
w = weights(0, 32, 2880, 2880)
x = torch.randn(t, 2880, device="cuda").to(torch.bfloat16)
ids = torch.stack([torch.randperm(32, device="cuda")[:4] for _ in range(t)])
wts = torch.softmax(torch.randn(t, 4, device="cuda"), -1)
for fn in (mt.moe_decode, mt.moe_gemv):
    fn(x, wts, ids, w)
torch.cuda.synchronize()
