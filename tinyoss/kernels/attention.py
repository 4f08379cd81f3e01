"""What an attention backend is told about a batch, and the torch reference backend.

The KV cache is paged: each cache group (layers sharing one attention window) gives every
sequence a table of blocks of `block_size` tokens, NHD layout ([blocks, block_size, kv_heads,
head_dim]) so FlashInfer reads it without a copy. Sliding-window groups drop blocks that fell out
of the window, so a table starts at `kv_starts[i]`, not at position 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyoss.model.rope import apply_rope


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
    q [Tq, Hq, D], k/v [Tk, Hk, D] -> [Tq, Hq, D] float32.
    """
    tq, hq, d = q.shape
    hk = k.shape[1]
    qg = q.float().view(tq, hk, hq // hk, d)
    logits = torch.einsum("qhgd,khd->hgqk", qg, k.float()) * scale
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    logits = logits.masked_fill(~allowed, float("-inf"))
    sink = sinks.float().view(hk, hq // hk, 1, 1).expand(hk, hq // hk, tq, 1)
    probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())
    return out.reshape(tq, hq, d)
