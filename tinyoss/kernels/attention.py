"""What an attention backend is told about a batch, and the torch reference backend.

The KV cache is paged: each cache group (layers sharing one attention window) gives every
sequence a table of blocks of `block_size` tokens, NHD layout ([blocks, block_size, kv_heads,
head_dim]) so FlashInfer reads it without a copy. Sliding-window groups drop blocks that fell out
of the window, so a table starts at `kv_starts[i]`, not at position 0.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import torch

from tinyoss.model.rope import apply_rope

# `attend` makes logits a block at a time: at most BLOCK_ELEMENTS float32 values (1 MiB, cache
# sized: larger blocks timed slower on the CPU) over at most QUERY_CHUNK queries. A decode step
# with 64 query heads stays a single block up to 4096 keys.
BLOCK_ELEMENTS = 1 << 18
QUERY_CHUNK = 64


@dataclass
class GroupMetadata:
    block_tables: list[list[int]]  # per sequence: the blocks it still holds, oldest first
    kv_starts: list[int]  # per sequence: position of the first token in its first block
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each token


@dataclass
class AttentionMetadata:
    query_lens: list[int]  # tokens of each sequence in this batch
    seq_lens: list[int]  # each sequence's length once this batch is in the cache
    groups: list[GroupMetadata]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class TorchAttention:
    """Reference paged attention with sinks and sliding windows, in float32 (CPU or GPU)."""

    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        layer_groups: list[int],
        windows: list[int],
        scale: float,
    ) -> None:
        self.kv_caches = kv_caches
        self.layer_groups = layer_groups
        self.windows = windows
        self.scale = scale
        self.meta: AttentionMetadata | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
        positions: torch.Tensor, rope_cache: torch.Tensor,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] (q and k not yet rotated), sinks [Hq], positions [T],
        rope_cache [max_len, D] -> [T, Hq * D]; rotates q and k (`apply_rope`) and stores k/v in
        the cache first."""
        meta = self.meta
        assert meta is not None, "plan() must run before attention"
        q, k = apply_rope(q, k, positions, rope_cache)
        group = meta.groups[self.layer_groups[layer]]
        k_cache, v_cache = self.kv_caches[layer]
        write_kv(k_cache, v_cache, k, v, group.slot_mapping)
        window = self.windows[layer]
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens)):
            blocks = torch.tensor(group.block_tables[i], dtype=torch.long, device=q.device)
            kv_len = seq_len - group.kv_starts[i]
            keys = k_cache[blocks].flatten(0, 1)[:kv_len]
            values = v_cache[blocks].flatten(0, 1)[:kv_len]
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            k_pos = torch.arange(group.kv_starts[i], seq_len, device=q.device)
            o = attend(
                q[start : start + q_len], keys, values, sinks, q_pos, k_pos, window, self.scale
            )
            out[start : start + q_len] = o.flatten(1).to(out.dtype)
            start += q_len
        return out

    def decode_rows(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
        positions: torch.Tensor, rope_cache: torch.Tensor, tables: torch.Tensor,
        ranges: torch.Tensor, slots: torch.Tensor,
    ) -> torch.Tensor:
        """One query per row, planned by device tensors instead of `plan` (an EAGLE-3 draft's
        own decode passes, whose positions the host never sees): tables [B, W] (a full-attention
        table, from position 0), ranges [B, 2] (the keys' first and end position, the new key
        last), slots [B] (< 0: not stored)."""
        q, k = apply_rope(q, k, positions, rope_cache)
        k_cache, v_cache = self.kv_caches[layer]
        write_kv(k_cache, v_cache, k, v, slots)
        bs = k_cache.shape[1]
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        for i, (lo, hi) in enumerate(ranges.tolist()):
            blocks = tables[i, : -(-hi // bs)].long()
            keys = k_cache[blocks].flatten(0, 1)[lo:hi]
            values = v_cache[blocks].flatten(0, 1)[lo:hi]
            k_pos = torch.arange(lo, hi, device=q.device)
            o = attend(q[i : i + 1], keys, values, sinks, positions[i : i + 1], k_pos,
                       self.windows[layer], self.scale)
            out[i] = o.flatten().to(out.dtype)
        return out


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new keys/values at their slots; slot -1 marks padding that must not be stored."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Causal (optionally windowed) GQA with one sink logit per query head, in float32.

    p_j = exp(l_j) / (exp(sink) + sum_k exp(l_k)): the sink joins the denominator only.
    q [Tq, Hq, D], k/v [Tk, Hk, D], positions ascending -> [Tq, Hq, D] float32.
    A long prompt's [Tq, Tk] logits would need many GB, so they are made one bounded block at a
    time with an online softmax; keys that no query of a chunk may see are never computed, so a
    windowed prompt costs O(Tq * window). A decode step or a short prompt is a single block.
    """
    tq, hq, d = q.shape
    hk = k.shape[1]
    group = hq // hk
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [Hk, Tk, D], made float32 a block at a time
    sink = sinks.float().view(hk, 1, group)  # the running max before any key
    sink_total = (sink - _finite(sink)).exp()  # exp(sink - max): 1, or 0 without a sink
    q_chunk = max(1, min(tq, QUERY_CHUNK))
    k_chunk = max(1, BLOCK_ELEMENTS // (hq * q_chunk))
    qp, kp = q_pos.tolist(), k_pos.tolist()
    out = torch.empty(tq, hk, group, d, dtype=torch.float32, device=q.device)
    for i0 in range(0, tq, q_chunk):
        i1 = min(i0 + q_chunk, tq)
        n = i1 - i0
        qc = (q[i0:i1].float() * scale).view(n, hk, group, d).transpose(0, 1).reshape(hk, -1, d)
        m, total, acc = sink, sink_total, None  # running max, denominator, numerator
        j_begin = bisect_right(kp, qp[i0] - window) if window else 0
        j_end = bisect_right(kp, qp[i1 - 1])
        for j0 in range(j_begin, j_end, k_chunk):
            j1 = min(j0 + k_chunk, j_end)
            logits = torch.bmm(qc, kh[:, j0:j1].float().transpose(1, 2)).view(hk, n, group, -1)
            # a block wholly inside every query's causal window needs no mask
            if kp[j1 - 1] > qp[i0] or (window and kp[j0] <= qp[i1 - 1] - window):
                allowed = k_pos[None, j0:j1] <= q_pos[i0:i1, None]
                if window:
                    allowed &= k_pos[None, j0:j1] > q_pos[i0:i1, None] - window
                logits.masked_fill_(~allowed[None, :, None, :], float("-inf"))
            m_new = torch.maximum(m, logits.amax(-1))
            shift = _finite(m_new)
            alpha = (m - shift).exp()
            probs = logits.sub_(shift[..., None]).exp_()
            total = total * alpha + probs.sum(-1)
            pv = torch.bmm(probs.flatten(1, 2), vh[:, j0:j1].float()).view(hk, n, group, d)
            acc = pv if acc is None else acc.mul_(alpha[..., None]).add_(pv)
            m = m_new
        assert acc is not None, "every query sees at least its own key"
        out[i0:i1] = acc.div_(total[..., None]).transpose(0, 1)
    return out.view(tq, hq, d)


def _finite(m: torch.Tensor) -> torch.Tensor:
    """The running max, -inf (nothing seen yet, no sink) as 0: exp(-inf - m) is 0, not NaN."""
    return m.masked_fill(m.isneginf(), 0.0)
