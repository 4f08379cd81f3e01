"""The chunked torch reference attention (`attend`: online softmax over bounded logits blocks,
masked blocks skipped) against the plain one-shot formula, in float64."""

import pytest
import torch

from tinyoss.kernels import attention
from tinyoss.kernels.attention import attend

ATOL = RTOL = 1e-5  # float32 result against the float64 oracle


def oracle(q, k, v, sinks, q_pos, k_pos, window, scale):
    """All [Hq, Tq, Tk] logits at once, the sink as one more softmax column dropped after."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    logits = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    logits = logits.masked_fill(~allowed, float("-inf"))
    sink = sinks.double()[:, None, None].expand(-1, q.shape[0], 1)
    probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


def inputs(q_len, seq_len, kv_start, hq, hk, d=16, sinks="random", seed=0):
    """A chunk of `q_len` queries ending at `seq_len`, keys from `kv_start` (as a sliding cache
    group holds them after dropping old blocks)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_len, hq, d, generator=g) * 2  # * 2: sharper softmaxes
    k = torch.randn(seq_len - kv_start, hk, d, generator=g)
    v = torch.randn(seq_len - kv_start, hk, d, generator=g)
    s = {"random": torch.randn(hq, generator=g) * 2, "none": torch.full((hq,), float("-inf")),
         "large": torch.full((hq,), 30.0)}[sinks]
    return q, k, v, s, torch.arange(seq_len - q_len, seq_len), torch.arange(kv_start, seq_len)


def spy_logits_blocks(monkeypatch) -> list[torch.Size]:
    """Shapes of the logits blocks `attend` makes: every other bmm (the other one is probs @ v)."""
    shapes, bmm = [], torch.bmm
    def spy(a, b):
        out = bmm(a, b)
        shapes.append(out.shape)
        return out
    monkeypatch.setattr(torch, "bmm", spy)
    return shapes


CASES = {  # (q_len, seq_len, kv_start, window, hq, hk)
    "decode": (1, 37, 0, 0, 8, 2),
    "decode window": (1, 37, 16, 16, 8, 2),
    "prefill": (45, 45, 0, 0, 8, 2),
    "prefill window": (45, 45, 0, 8, 6, 3),
    "prefill MHA": (29, 29, 0, 0, 4, 4),
    "continuation": (13, 70, 0, 0, 8, 1),
    "continuation window": (19, 70, 32, 24, 8, 2),
}
CHUNKS = {  # (QUERY_CHUNK, BLOCK_ELEMENTS per query head): None keeps the module's
    "default": None,
    "3x5": (3, 3 * 5),
    "7x4": (7, 7 * 4),
    "1x1": (1, 1),
}


@pytest.mark.parametrize("sinks", ["random", "none", "large"])
@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("case", CASES)
def test_attend_matches_oracle(case, chunks, sinks, monkeypatch):
    """Sizes that are no multiple of the chunks; tiny chunks give many blocks, skipped ones and
    rows of a block all masked (no sink: a running max of -inf, which must not make a NaN)."""
    q_len, seq_len, kv_start, window, hq, hk = CASES[case]
    if CHUNKS[chunks]:
        q_chunk, per_head = CHUNKS[chunks]
        monkeypatch.setattr(attention, "QUERY_CHUNK", q_chunk)
        monkeypatch.setattr(attention, "BLOCK_ELEMENTS", per_head * hq)
    args = (*inputs(q_len, seq_len, kv_start, hq, hk, sinks=sinks), window, 16**-0.5)
    out = attend(*args)
    assert out.dtype == torch.float32 and out.shape == args[0].shape
    torch.testing.assert_close(out.double(), oracle(*args), atol=ATOL, rtol=RTOL)


def test_blocks_skip_masked_keys(monkeypatch):
    """A windowed prefill computes only the keys near the diagonal, a causal one the lower
    triangle, no block exceeds BLOCK_ELEMENTS, and a decode step is a single block."""
    monkeypatch.setattr(attention, "QUERY_CHUNK", 4)
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", 8 * 4 * 6)
    shapes = spy_logits_blocks(monkeypatch)
    q, k, v, s, qp, kp = inputs(100, 100, 0, 8, 2)
    attend(q, k, v, s, qp, kp, 10, 0.25)
    logits = shapes[::2]
    assert all(sh.numel() <= 8 * 4 * 6 for sh in logits)
    in_window = sum(i + 3 - max(0, i - 9) + 1 for i in range(0, 100, 4))  # keys i - 9 .. i + 3
    assert sum(sh[-1] for sh in logits) == in_window
    shapes.clear()
    attend(q, k, v, s, qp, kp, 0, 0.25)
    assert sum(sh[-1] for sh in shapes[::2]) == sum(4 * i for i in range(1, 26))
    monkeypatch.undo()
    shapes = spy_logits_blocks(monkeypatch)
    attend(*inputs(1, 4096, 0, 64, 8), 0, 0.25)
    assert len(shapes) == 2


@pytest.mark.parametrize("window", [0, 128])
def test_long_prompt_in_bounded_blocks(window, monkeypatch):
    """6000 tokens at the module's chunk sizes: every logits block within BLOCK_ELEMENTS (all
    at once would be Hq * 6000^2), checked on a subsample of queries (ends and chunk edges)."""
    shapes = spy_logits_blocks(monkeypatch)
    t, hq, hk = 6000, 4, 2
    q, k, v, s, qp, kp = inputs(t, t, 0, hq, hk)
    out = attend(q, k, v, s, qp, kp, window, 0.25)
    assert len(shapes) > 2 and max(sh.numel() for sh in shapes[::2]) <= attention.BLOCK_ELEMENTS
    rows = torch.tensor([0, 1, 63, 64, 127, 128, 129, 1000, 2047, 2048, 4095, 5000, 5998, 5999])
    rows = torch.cat((rows, torch.randint(0, t, (30,), generator=torch.Generator().manual_seed(1))))
    ref = oracle(q[rows], k, v, s, qp[rows], kp, window, 0.25)
    torch.testing.assert_close(out[rows].double(), ref, atol=ATOL, rtol=RTOL)
