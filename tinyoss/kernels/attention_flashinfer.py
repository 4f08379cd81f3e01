"""Multi-group sink attention through FlashInfer, on the engine's paged KV cache (NVIDIA GPUs).

gpt-oss needs a sink logit per head in the softmax. FlashInfer's plain prefill and decode
wrappers silently ignore `sinks` on Hopper, so every call goes through
`BatchAttentionWithAttentionSinkWrapper`. Its sliding window is compiled into the kernel, so
layers are grouped by window and each cache group has its own wrappers: one for eager steps
(prefill, mixed batches) and one per CUDA-graph batch size (FlashInfer fixes the batch size of
a graph-mode wrapper). `plan()` runs once per step per group, always outside graph capture.
"""

from __future__ import annotations

import torch

from tinyoss.kernels.attention import AttentionMetadata
from tinyoss.kernels.layer_ops_triton import store_kv_triton

WORKSPACE_BYTES = 256 * 2**20


class FlashInferAttention:
    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        layer_groups: list[int],
        group_windows: list[int],
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dummy_block: int,
        max_num_tokens: int,
        max_blocks_per_seq: int,
        graph_sizes: list[int],
        backend: str = "fa2",
    ) -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self.kv_caches = kv_caches
        self.layer_groups = layer_groups
        self.group_windows = group_windows
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.block_size = block_size
        self.dummy_slot = dummy_block * block_size
        self.dummy_block = dummy_block
        self.scale = head_dim**-0.5
        self.backend = backend
        k0 = kv_caches[0][0]
        self.device, self.dtype = k0.device, k0.dtype
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.slots = [
            torch.full((max_num_tokens,), self.dummy_slot, dtype=torch.long, device=self.device)
            for _ in group_windows
        ]
        self.eager = [self._wrapper(g) for g in range(len(group_windows))]
        self.graph = {
            size: [self._wrapper(g, size, max_blocks_per_seq) for g in range(len(group_windows))]
            for size in graph_sizes
        }
        self.active = self.eager
        self.num_tokens = 0

    def _wrapper(self, group: int, graph_size: int | None = None, max_blocks: int = 0):
        window = self.group_windows[group]
        kwargs = {}
        if graph_size is not None:
            kwargs = dict(
                use_cuda_graph=True,
                qo_indptr_buf=torch.empty(graph_size + 1, dtype=torch.int32, device=self.device),
                paged_kv_indptr_buf=torch.empty(
                    graph_size + 1, dtype=torch.int32, device=self.device
                ),
                paged_kv_indices_buf=torch.empty(
                    graph_size * max_blocks, dtype=torch.int32, device=self.device
                ),
                paged_kv_last_page_len_buf=torch.empty(
                    graph_size, dtype=torch.int32, device=self.device
                ),
            )
        return self._flashinfer.BatchAttentionWithAttentionSinkWrapper(
            self.workspace,
            kv_layout="NHD",
            backend=self.backend,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            head_dim_qk=self.heads[2],
            head_dim_vo=self.heads[2],
            window_left=window - 1 if window else -1,
            **kwargs,
        )

    def plan(self, meta: AttentionMetadata, graph_size: int | None = None) -> None:
        """Plans every group for this step; with `graph_size`, pads the batch to that size."""
        query_lens, seq_lens = list(meta.query_lens), list(meta.seq_lens)
        pad = 0 if graph_size is None else graph_size - len(query_lens)
        query_lens += [1] * pad
        seq_lens += [1] * pad
        self.num_tokens = sum(query_lens)
        self.active = self.eager if graph_size is None else self.graph[graph_size]
        qo_indptr = _indptr(query_lens)
        hq, hk, d = self.heads
        for g, group in enumerate(meta.groups):
            tables = group.block_tables + [[self.dummy_block]] * pad
            starts = group.kv_starts + [0] * pad
            kv_lens = [s - k for s, k in zip(seq_lens, starts)]
            indices = torch.tensor([b for t in tables for b in t], dtype=torch.int32)
            last = [n - (len(t) - 1) * self.block_size for n, t in zip(kv_lens, tables)]
            window = self.group_windows[g]
            self.active[g].plan(
                qo_indptr,
                _indptr([len(t) for t in tables]),
                indices,
                torch.tensor(last, dtype=torch.int32),
                hq,
                hk,
                d,
                self.block_size,
                causal=True,
                window_left=window - 1 if window else -1,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
                sm_scale=self.scale,
            )
            n = group.slot_mapping.shape[0]
            self.slots[g][:n].copy_(group.slot_mapping, non_blocking=True)
            self.slots[g][n : self.num_tokens].fill_(self.dummy_slot)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor
    ) -> torch.Tensor:
        g = self.layer_groups[layer]
        k_cache, v_cache = self.kv_caches[layer]
        store_kv_triton(k_cache, v_cache, k, v, self.slots[g][: q.shape[0]])
        out = self.active[g].run(q.contiguous(), (k_cache, v_cache), sinks, self.scale)
        return out.view(q.shape[0], -1)


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out
