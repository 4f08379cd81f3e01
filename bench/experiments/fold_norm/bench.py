"""The layer boundary at one token a step, with and without the input norm folded into the q/k/v
GEMV (`Kernels.folds_norm`), on one GPU (sm_90, nvcc): each piece alone, then the boundary
(experts, residual add, norm, q/k/v) as the engine runs it, over 4 sets of gpt-oss-20b-shaped
weights (L2 holds none), replayed from CUDA graphs.

    python bench/experiments/fold_norm/bench.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from dense_gemv import graph_time  # noqa: E402
from tests.test_moe_triton import big_case  # noqa: E402
from tinyoss.kernels import moe_triton as mt  # noqa: E402
from tinyoss.kernels.hardware import capability  # noqa: E402
from tinyoss.kernels.layer_ops_triton import rms_norm_triton  # noqa: E402
from tinyoss.kernels.moe_gemv_mma import load  # noqa: E402

SETS = 4


def main() -> None:
    dev = torch.device("cuda")
    mma, why = load(capability(dev))
    assert mma is not None, why
    h, n_qkv = 2880, 5120
    cases = [big_case(100 + i, 1) for i in range(SETS)]
    wq = [(torch.randn(n_qkv, h, device=dev) * 0.02).to(torch.bfloat16) for _ in range(SETS)]
    bq = [torch.randn(n_qkv, device=dev).to(torch.bfloat16) for _ in range(SETS)]
    nw = torch.rand(h, device=dev) + 0.5
    res = (torch.randn(1, h, device=dev) * 3).to(torch.bfloat16)
    x = cases[0][0]

    def moe_norm():
        for xx, tw, ti, w in cases:
            mt.moe_norm_triton(x, tw, ti, w, res, nw, 1e-5, mma=mma)

    def moe_add():
        for xx, tw, ti, w in cases:
            mt.moe_add_triton(x, tw, ti, w, res, mma=mma)

    def norm_qkv():
        for w, b in zip(wq, bq):
            mma.stream_linear(rms_norm_triton(res, nw, 1e-5)[0], w, b)

    def qkv():
        for w, b in zip(wq, bq):
            mma.stream_linear(x, w, b)

    def qkv_norm():
        for w, b in zip(wq, bq):
            mma.stream_norm_linear(res, nw, 1e-5, w, b)

    def before():
        for (xx, tw, ti, w), wt, b in zip(cases, wq, bq):
            normed, _ = mt.moe_norm_triton(x, tw, ti, w, res, nw, 1e-5, mma=mma)
            mma.stream_linear(normed, wt, b)

    def after():
        for (xx, tw, ti, w), wt, b in zip(cases, wq, bq):
            mt.moe_add_triton(x, tw, ti, w, res, mma=mma)
            mma.stream_norm_linear(res, nw, 1e-5, wt, b)

    for label, fn in (("experts + add + norm (moe_norm_triton)", moe_norm),
                      ("experts + add (moe_add_triton)", moe_add),
                      ("q/k/v alone", qkv), ("norm kernel + q/k/v", norm_qkv),
                      ("q/k/v with its norm", qkv_norm),
                      ("boundary unfolded", before), ("boundary folded", after)):
        res.copy_(torch.randn_like(res))  # the residual grows with every replay otherwise
        print(f"{label:40s} {graph_time(fn, SETS):7.2f} us", flush=True)


if __name__ == "__main__":
    main()
