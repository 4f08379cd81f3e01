"""The paged KV cache: one pool of blocks shared by all cache groups, and prefix caching.

gpt-oss alternates sliding-window (128) and full-attention layers. Layers with the same window
form a cache group, and each sequence has one block table per group. Block b of the pool is a
slice of the K/V tensors of every layer "slot": slot s holds the s-th layer of each group, so a
block serves whichever group allocated it (both groups of gpt-oss have the same layer count and
nothing is wasted). Sliding groups give back blocks that fell out of the window, so a long
context costs about half of what a naive cache needs.

Prefix caching: a full block is named by a hash of its tokens and of everything before it. Freed
blocks keep their contents and name in a least-recently-used queue until reused, so a later
request with the same prefix (system prompt, earlier turns) takes them instead of recomputing.
A request's cache salt (vLLM's `cache_salt`) seeds the first block's hash, so requests of
different salts never share a block (a client's isolation from the timing of others' hits).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from tinyoss.config import ModelConfig


@dataclass
class CacheLayout:
    """How layers map onto cache groups and onto the pool's per-slot K/V tensors."""

    windows: list[int]  # per group: tokens a query sees (0 = all)
    layer_group: list[int]  # per layer
    layer_slot: list[int]  # per layer: which K/V tensor pair holds it

    @classmethod
    def for_model(cls, config: ModelConfig, draft_layers: int = 0) -> CacheLayout:
        """The model's layers, then `draft_layers` full-attention layers of a draft model that
        keeps its K/V in the same blocks (EAGLE-3), numbered after the model's."""
        windows: list[int] = []
        layer_group, layer_slot = [], []
        per_group: dict[int, int] = {}
        for layer in range(config.num_hidden_layers + draft_layers):
            w = config.window(layer) if layer < config.num_hidden_layers else 0
            if w not in windows:
                windows.append(w)
            g = windows.index(w)
            layer_group.append(g)
            layer_slot.append(per_group.get(g, 0))
            per_group[g] = per_group.get(g, 0) + 1
        return cls(windows, layer_group, layer_slot)

    @property
    def num_slots(self) -> int:
        return max(self.layer_slot) + 1


def allocate_kv_tensors(
    layout: CacheLayout,
    num_blocks: int,
    block_size: int,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) views, [num_blocks, block_size, kv_heads, head_dim] each (NHD pages)."""
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    slots = [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(layout.num_slots)
    ]
    return [slots[s] for s in layout.layer_slot]


def kv_bytes_per_block(
    layout: CacheLayout, block_size: int, config: ModelConfig, dtype: torch.dtype
) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * layout.num_slots * block_size * config.num_key_value_heads * config.head_dim * elem


def blocks_needed(windows: list[int], block_size: int, num_tokens: int) -> int:
    """Blocks one sequence of `num_tokens` holds at its peak (all groups)."""
    full = -(-num_tokens // block_size)
    return sum(min(full, (w - 1) // block_size + 2) if w else full for w in windows)


@dataclass
class SeqBlocks:
    """A sequence's blocks: per group a table, and how many leading blocks it gave back."""

    tables: list[list[int]]
    dropped: list[int]
    hashes: list[bytes] = field(default_factory=list)  # hashes of its full blocks, in order
    named: int = 0  # leading full blocks already entered in the prefix cache
    seed: bytes = b""  # what the first block's hash starts from: its salt's hash, or nothing

    @classmethod
    def empty(cls, num_groups: int, salt: str | None = None) -> SeqBlocks:
        seed = b"" if salt is None else hashlib.blake2b(
            salt.encode(), digest_size=16, person=b"cache_salt"
        ).digest()  # never a block's hash: those are not personalized
        return cls([[] for _ in range(num_groups)], [0] * num_groups, seed=seed)


class KVCacheManager:
    """Allocates blocks to sequences, frees them, keeps freed full blocks findable by content."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        windows: list[int],
        enable_prefix_caching: bool = True,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.windows = windows
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_key: list[tuple[int, bytes] | None] = [None] * num_blocks
        self.cached: dict[tuple[int, bytes], int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hit_blocks = 0  # blocks reused from the prefix cache, over the cache's life

    # -- sizes ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_needed(self.windows, self.block_size, num_tokens)

    # -- hashing ----------------------------------------------------------------------------
    def block_hashes(self, token_ids: list[int], blocks: SeqBlocks, num_blocks: int) -> None:
        """Extend `blocks.hashes` to the first `num_blocks` full blocks of `token_ids`."""
        bs = self.block_size
        hashes = blocks.hashes
        for j in range(len(hashes), num_blocks):
            prev = hashes[-1] if hashes else blocks.seed
            chunk = array("q", token_ids[j * bs : (j + 1) * bs]).tobytes()
            hashes.append(hashlib.blake2b(prev + chunk, digest_size=16).digest())

    # -- allocation -------------------------------------------------------------------------
    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        key = self.block_key[block]
        if key is not None:  # evict its cached contents
            del self.cached[key]
            self.block_key[block] = None
        self.ref_count[block] = 1
        return block

    def _reuse(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if self.block_key[block] is None:
                self.free[block] = None
                self.free.move_to_end(block, last=False)  # nameless: reuse first
            else:
                self.free[block] = None

    def match_prefix(self, blocks: SeqBlocks, token_ids: list[int]) -> int:
        """Attach the longest cached prefix of `token_ids` to an empty sequence; returns its length.

        At least one token is always left to compute, so the model still produces logits. Sliding
        groups need only the blocks inside the window of the first token still to compute.
        """
        if not self.enable_prefix_caching:
            return 0
        usable = (len(token_ids) - 1) // self.block_size
        self.block_hashes(token_ids, blocks, usable)
        full_hits = 0
        for w_group, w in enumerate(self.windows):
            if not w:
                n = 0
                while n < usable and (w_group, blocks.hashes[n]) in self.cached:
                    n += 1
                usable = n
        for k in range(usable, 0, -1):
            first = self._first_needed(k * self.block_size)
            if all(
                (g, blocks.hashes[j]) in self.cached
                for g, w in enumerate(self.windows)
                if w
                for j in range(first[g], k)
            ):
                full_hits = k
                break
        if full_hits == 0:
            return 0
        first = self._first_needed(full_hits * self.block_size)
        for g in range(len(self.windows)):
            for j in range(first[g], full_hits):
                block = self.cached[(g, blocks.hashes[j])]
                self._reuse(block)
                blocks.tables[g].append(block)
            blocks.dropped[g] = first[g]
            self.hit_blocks += full_hits - first[g]
        blocks.named = full_hits
        return full_hits * self.block_size

    def _first_needed(self, position: int) -> list[int]:
        """Per group: the first block a query at `position` still reads."""
        return [max(0, position - w + 1) // self.block_size if w else 0 for w in self.windows]

    def trim_window(self, blocks: SeqBlocks, num_computed: int) -> None:
        """Give back sliding-group blocks no future query can see."""
        for g, first in enumerate(self._first_needed(num_computed)):
            while blocks.dropped[g] < first and blocks.tables[g]:
                self._release(blocks.tables[g].pop(0))
                blocks.dropped[g] += 1

    def _wants(self, blocks: SeqBlocks, num_tokens: int) -> int:
        total = -(-num_tokens // self.block_size)
        return sum(max(0, total - blocks.dropped[g] - len(t)) for g, t in enumerate(blocks.tables))

    def allocate(self, blocks: SeqBlocks, num_computed: int, num_new: int) -> bool:
        """Make room for `num_new` tokens after `num_computed`; False (nothing taken) if full."""
        self.trim_window(blocks, num_computed)
        if self._wants(blocks, num_computed + num_new) > self.num_free:
            return False
        total = -(-(num_computed + num_new) // self.block_size)
        for g, table in enumerate(blocks.tables):
            table.extend(self._take() for _ in range(total - blocks.dropped[g] - len(table)))
        return True

    def room_for_next_token(self, seqs: list[tuple[SeqBlocks, int]]) -> bool:
        """Whether every (blocks, num_computed) sequence can take one more token right now, as
        a decode step of all of them would allocate."""
        for blocks, num_computed in seqs:
            self.trim_window(blocks, num_computed)
        return sum(self._wants(b, n + 1) for b, n in seqs) <= self.num_free

    def max_new_tokens(self, blocks: SeqBlocks, num_computed: int, limit: int) -> int:
        """The most tokens (<= limit) that `allocate` could make room for right now."""
        self.trim_window(blocks, num_computed)
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._wants(blocks, num_computed + mid) <= self.num_free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def reserve(self, blocks: SeqBlocks, num_tokens: int) -> bool:
        """Full-attention tables extended to cover `num_tokens` tokens (an EAGLE-3 draft's
        lookahead, written past a step's last position); False, nothing taken, if full."""
        total = -(-num_tokens // self.block_size)
        full = [g for g, w in enumerate(self.windows) if not w]
        want = sum(max(0, total - blocks.dropped[g] - len(blocks.tables[g])) for g in full)
        if want > self.num_free:
            return False
        for g in full:
            table = blocks.tables[g]
            table.extend(self._take() for _ in range(total - blocks.dropped[g] - len(table)))
        return True

    def step_view(
        self, blocks: SeqBlocks, start: int, num_tokens: int
    ) -> tuple[list[list[int]], list[int], list[list[int]]]:
        """Per group: a copy of the block table up to the step's last position (a sequence may
        hold blocks beyond it, taken for drafted tokens that were rejected or for a draft
        model's lookahead), the first position it covers, and the cache slot of each position
        in [start, start + num_tokens)."""
        bs = self.block_size
        end = -(-(start + num_tokens) // bs)  # blocks that cover positions below the end
        tables = [list(t[: end - d]) for t, d in zip(blocks.tables, blocks.dropped)]
        firsts = [d * bs for d in blocks.dropped]
        slots = [
            [t[p // bs - d] * bs + p % bs for p in range(start, start + num_tokens)]
            for t, d in zip(blocks.tables, blocks.dropped)
        ]
        return tables, firsts, slots

    def free_all(self, blocks: SeqBlocks) -> None:
        for table in blocks.tables:
            for block in reversed(table):  # the tail is least likely to be shared: evict it first
                self._release(block)
            table.clear()
        blocks.dropped = [0] * len(self.windows)
        blocks.named = 0

    def forget_names(self, blocks: SeqBlocks, position: int) -> None:
        """Takes back the prefix-cache names of the blocks holding `position` onwards: their
        contents were never written (the step that was to write them failed)."""
        first = position // self.block_size
        for g, table in enumerate(blocks.tables):
            for j in range(max(first, blocks.dropped[g]), blocks.named):
                block = table[j - blocks.dropped[g]]
                key = self.block_key[block]
                if key is not None and self.cached.get(key) == block:
                    del self.cached[key]
                    self.block_key[block] = None
        blocks.named = min(blocks.named, first)

    def cache_full_blocks(self, blocks: SeqBlocks, token_ids: list[int], num_computed: int) -> None:
        """Name the blocks that are now full and computed, so later requests can find them."""
        if not self.enable_prefix_caching:
            return
        n_full = num_computed // self.block_size
        self.block_hashes(token_ids, blocks, n_full)
        for g, table in enumerate(blocks.tables):
            for j in range(max(blocks.dropped[g], blocks.named), n_full):
                block = table[j - blocks.dropped[g]]
                key = (g, blocks.hashes[j])
                if self.block_key[block] is None and key not in self.cached:
                    self.block_key[block] = key
                    self.cached[key] = block
        blocks.named = max(blocks.named, n_full)
