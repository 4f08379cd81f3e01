"""shuffled.py's layout, checked word by word against the checkpoint's (CPU).

    python -m pytest bench/experiments/mma_gemv/test_shuffle.py
"""

from __future__ import annotations

import pytest
import torch

from bench.experiments.mma_gemv.shuffled import shuffle


@pytest.mark.parametrize("swiglu", [True, False])
def test_each_lane_gets_its_fragment_words(swiglu: bool) -> None:
    """Tile T, block pair jb, lane (g, t), word k: word t of block 2jb + k // 2 of MMA row g
    (k even) or g + 8 (k odd), MMA rows g / g + 8 being tile rows 2g / 2g + 1 for gate_up and
    g / g + 8 for down; each tile's bytes stay in the tile."""
    e, n, nblk = 2, 32, 6
    blocks = torch.randint(0, 256, (e, n, nblk, 16), dtype=torch.uint8)
    out = shuffle(blocks, swiglu)
    assert out.shape == blocks.shape and out.dtype == torch.uint8
    words = blocks.view(torch.int32)  # [e, n, nblk, 4]
    for x in range(e):
        for tile in range(n // 16):
            got = out[x, 16 * tile : 16 * tile + 16].reshape(-1).view(torch.int32)
            for jb in range(nblk // 2):
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    la, lb = (2 * g, 2 * g + 1) if swiglu else (g, g + 8)
                    for k in range(4):
                        row = 16 * tile + (lb if k % 2 else la)
                        want = words[x, row, 2 * jb + k // 2, t]
                        assert got[(jb * 32 + lane) * 4 + k] == want


def test_refuses_shapes_it_cannot_tile() -> None:
    with pytest.raises(ValueError, match="rows in 16s"):
        shuffle(torch.zeros(1, 24, 4, 16, dtype=torch.uint8), True)
