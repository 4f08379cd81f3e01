"""GPU sink attention on the engine's paged KV cache: FlashInfer for prefill, Triton for decode.

gpt-oss needs a sink logit per head in the softmax. FlashInfer's plain prefill and decode
wrappers silently ignore `sinks` on Hopper, so prefill and mixed steps go through
`BatchAttentionWithAttentionSinkWrapper`, one per cache group (its sliding window is compiled
into the kernel), planned once per step from a ring of pinned buffers (`PlanRing`: FlashInfer's
own single buffer raced with the host running ahead of the GPU). Pure decode steps (one query
per sequence, the steps CUDA graphs replay) use `DecodeAttention`, which needs no host-side plan
at all: planning only copies block tables and key ranges into fixed buffers, and it also applies
the rotary embedding and stores the new K/V rows (no separate launches for them). Verify steps
under CUDA graphs (`rows=True`: a few query rows per sequence) run it too, one row each with its
own key range, after a rope and a K/V-store launch.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext

import torch

from tinyoss.kernels.attention import AttentionMetadata
from tinyoss.kernels.attention_decode_triton import DecodeAttention, stage_decode_plan
from tinyoss.kernels.layer_ops_triton import rope_triton, store_kv_triton

WORKSPACE_BYTES = 256 * 2**20
PLAN_BUFFERS = 3  # pinned schedule buffers a wrapper plans from in turn


class PlanRing:
    """A FlashInfer wrapper planned from a ring of pinned host buffers.

    `plan` writes the step's schedule into the wrapper's one pinned host buffer and queues its
    copy to the GPU (cudaMemcpyAsync) without waiting for it. The host runs ahead of the GPU
    (async scheduling; a tensor-parallel worker runs ahead up to its collectives), so the next
    plan could rewrite that buffer before the GPU copied it, and a step would run another step's
    schedule: an illegal memory access (seen on two GPUs; the race mini-sglang and vLLM met
    too). Here each plan writes the next buffer of a ring, and a buffer is written again only
    once the copy that read it is done (an event recorded after the plan)."""

    def __init__(self, wrapper: object, size: int = PLAN_BUFFERS) -> None:
        first = getattr(wrapper, "_pin_memory_int_workspace_buffer", None)
        if not isinstance(first, torch.Tensor):
            raise RuntimeError(
                f"{type(wrapper).__name__} has no pinned schedule buffer where FlashInfer "
                "0.7 keeps it (_pin_memory_int_workspace_buffer): this FlashInfer plans "
                "differently from the one tinyoss was verified with; install "
                "flashinfer-python 0.7.2")
        self.wrapper = wrapper
        self.buffers = [first] + [_pinned_like(first) for _ in range(size - 1)]
        self.copied: list[torch.cuda.Event | None] = [None] * size
        self.turn = 0

    def plan(self, *args, **kwargs) -> None:
        i, self.turn = self.turn, (self.turn + 1) % len(self.buffers)
        if self.copied[i] is not None:
            self.copied[i].synchronize()  # the GPU has read what this buffer last held
        self.wrapper._pin_memory_int_workspace_buffer = self.buffers[i]
        self.wrapper.plan(*args, **kwargs)
        self.copied[i] = torch.cuda.Event()
        self.copied[i].record()  # after the plan's copy, on the same (current) stream

    def run(self, *args, **kwargs) -> torch.Tensor:
        return self.wrapper.run(*args, **kwargs)


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


def _sink_wrapper(workspace: torch.Tensor, dtype: torch.dtype, head_dim: int, window: int,
                  backend: str) -> object:
    """FlashInfer's sink-attention wrapper for one window (0: none). Its constructor builds
    (first time on a machine) and loads the variant's JIT module."""
    import flashinfer

    return flashinfer.BatchAttentionWithAttentionSinkWrapper(
        workspace, kv_layout="NHD", backend=backend, q_data_type=dtype, kv_data_type=dtype,
        head_dim_qk=head_dim, head_dim_vo=head_dim, window_left=window - 1 if window else -1)


class Prebuild:
    """FlashInfer's JIT builds of the sink-attention variants (one a window), started at once in
    the background. On a machine that has not built them, each takes tens of seconds, and the
    wrappers would otherwise build them one after the other once the KV cache exists, after the
    weights load and the MoE warms up; started early and side by side, they overlap that and
    each other. Daemon threads: a start that fails elsewhere does not wait for them."""

    def __init__(self, device: torch.device, dtype: torch.dtype, head_dim: int,
                 windows: list[int], backend: str = "fa2") -> None:
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._build, daemon=True, name=f"flashinfer-{w}",
                                         args=(device, dtype, head_dim, w, backend))
                        for w in dict.fromkeys(windows)]
        for t in self.threads:
            t.start()

    def _build(self, device: torch.device, dtype: torch.dtype, head_dim: int, window: int,
               backend: str) -> None:
        try:
            with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
                _sink_wrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device), dtype,
                              head_dim, window, backend)
        except BaseException as e:  # noqa: BLE001 - raised again by wait(), where it was
            self.errors.append(e)

    def wait(self) -> None:
        """Returns once every build is done; raises the first build's error, as constructing
        the wrapper would have."""
        for t in self.threads:
            t.join()
        if self.errors:
            raise self.errors[0]


class FlashInferAttention:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layer_groups: list[int],
                 group_windows: list[int], num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dummy_block: int, max_num_tokens: int, max_num_seqs: int,
                 max_model_len: int, backend: str = "fa2") -> None:
        self.kv_caches = kv_caches
        self.layer_groups = layer_groups
        self.group_windows = group_windows
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.block_size = block_size
        self.dummy_block = dummy_block
        self.scale = head_dim ** -0.5
        k0 = kv_caches[0][0]
        self.device, self.dtype = k0.device, k0.dtype
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill = [PlanRing(_sink_wrapper(workspace, self.dtype, head_dim, w, backend))
                        for w in group_windows]
        # each group's slots, block tables and key ranges: views of one tensor a kind, so a
        # decode step's plan is one copy and one launch for every group (stage_decode_plan)
        groups = len(group_windows)
        self.all_slots = torch.full((groups, max(max_num_tokens, max_num_seqs)),
                                    dummy_block * block_size, dtype=torch.long, device=self.device)
        max_blocks = -(-max_model_len // block_size) + 1
        self.all_tables = torch.zeros(groups, max_num_seqs, max_blocks, dtype=torch.int32,
                                      device=self.device)
        self.all_ranges = torch.zeros(groups, max_num_seqs, 2, dtype=torch.int32,
                                      device=self.device)
        self.slots, self.tables, self.ranges = (list(t) for t in (self.all_slots,
                                                                   self.all_tables,
                                                                   self.all_ranges))
        self.decode_attention = DecodeAttention(max_num_seqs, max_model_len, num_qo_heads,
                                                num_kv_heads, head_dim, self.device)
        self.decoding = False
        self.stored = False  # decode kernel after a separate K/V store (`rows`)

    def plan(self, meta: AttentionMetadata, graph_size: int | None = None,
             rows: bool = False, inputs: tuple[torch.Tensor, ...] | None = None) -> None:
        """Prepares every group for this step; `graph_size` pads a decode batch to that size;
        `rows`: each query token is a row of the decode kernel (a verify step's graph), and
        `graph_size` counts rows. `inputs` (a decode graph's token ids and positions, and the
        buffers they go to) travel with a decode step's plan, in the same launch."""
        num_rows = sum(meta.query_lens) if rows else meta.num_seqs
        pad = (graph_size or num_rows) - num_rows
        self.decoding = graph_size is not None or all(q == 1 for q in meta.query_lens)
        self.stored = rows
        all_ranges, all_tables = [], []
        for g, group in enumerate(meta.groups):
            kv_lens = [s - k for s, k in zip(meta.seq_lens, group.kv_starts)]
            tables = group.block_tables
            if rows:  # row i of a sequence's q tokens sees keys up to its own position
                kv_lens = [n - (q - 1 - i) for n, q in zip(kv_lens, meta.query_lens)
                           for i in range(q)]
                tables = [t for t, q in zip(tables, meta.query_lens) for _ in range(q)]
            kv_lens = kv_lens + [1] * pad
            tables = tables + [[self.dummy_block]] * pad
            if self.decoding:
                window = self.group_windows[g]
                all_ranges.append([(max(0, n - window) if window else 0, n) for n in kv_lens])
                all_tables.append(tables)
                continue
            n = group.slot_mapping.shape[0]
            self.slots[g][:n].copy_(group.slot_mapping, non_blocking=True)
            self._plan_prefill(g, meta.query_lens, kv_lens, tables)
        if self.decoding:
            src, stride = _slot_source([group.slot_mapping for group in meta.groups])
            stage_decode_plan(all_ranges, all_tables, src, stride, src.shape[-1],
                              self.dummy_block * self.block_size, self.all_slots,
                              self.all_tables, self.all_ranges, inputs)

    def _plan_prefill(self, g: int, query_lens: list[int], kv_lens: list[int],
                      tables: list[list[int]]) -> None:
        hq, hk, d = self.heads
        window = self.group_windows[g]
        indices = torch.tensor([b for t in tables for b in t], dtype=torch.int32)
        last = [n - (len(t) - 1) * self.block_size for n, t in zip(kv_lens, tables)]
        self.prefill[g].plan(
            _indptr(query_lens), _indptr([len(t) for t in tables]), indices,
            torch.tensor(last, dtype=torch.int32), hq, hk, d, self.block_size, causal=True,
            window_left=window - 1 if window else -1, q_data_type=self.dtype,
            kv_data_type=self.dtype, sm_scale=self.scale)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor, positions: torch.Tensor,
                 rope_cache: torch.Tensor) -> torch.Tensor:
        """As `TorchAttention`: q/k not yet rotated. A decode step rotates and stores inside
        the attention launch; prefill rotates q and k in place, stores, then runs FlashInfer."""
        g = self.layer_groups[layer]
        k_cache, v_cache = self.kv_caches[layer]
        t = q.shape[0]
        if self.decoding:
            if self.stored:
                q, k = rope_triton(q, k, positions, rope_cache)
                store_kv_triton(k_cache, v_cache, k, v, self.slots[g][:t])
            return self.decode_attention(q, k, v, k_cache, v_cache, self.slots[g][:t],
                                         positions, rope_cache, self.tables[g][:t],
                                         self.ranges[g][:t], sinks, self.scale,
                                         self.group_windows[g], stored=self.stored)
        q, k = rope_triton(q, k, positions, rope_cache)
        store_kv_triton(k_cache, v_cache, k, v, self.slots[g][:t])
        out = self.prefill[g].run(q.contiguous(), (k_cache, v_cache), sinks, self.scale)
        return out.view(t, -1)

    def decode_rows(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    sinks: torch.Tensor, positions: torch.Tensor, rope_cache: torch.Tensor,
                    tables: torch.Tensor, ranges: torch.Tensor,
                    slots: torch.Tensor) -> torch.Tensor:
        """As `TorchAttention.decode_rows`: the decode kernel on tables, key ranges and slots
        the caller computed on the device (no plan; capturable in a CUDA graph)."""
        k_cache, v_cache = self.kv_caches[layer]
        return self.decode_attention(q, k, v, k_cache, v_cache, slots, positions, rope_cache,
                                     tables, ranges, sinks, self.scale,
                                     self.group_windows[self.layer_groups[layer]])


def _slot_source(slots: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Every group's slots as one base and a stride between groups: build_batch puts them
    side by side in one tensor (stride = its length); otherwise they are stacked first."""
    n, base = slots[0].shape[0], slots[0]
    step = slots[1].data_ptr() - base.data_ptr() if len(slots) > 1 else 0
    if step % base.element_size() == 0 and all(
            s.shape == (n,) and s.dtype == base.dtype and s.is_contiguous()
            and s.data_ptr() - base.data_ptr() == g * step for g, s in enumerate(slots)):
        return base, step // base.element_size()
    return torch.stack(slots), n


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out
