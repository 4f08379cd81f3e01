"""Piecewise CUDA graphs for steps that hold prefill tokens: everything but attention replays.

Run eagerly, a step with a prefill chunk is bound by the host, not the GPU: each of its
hundreds of launches (GEMMs, Triton kernels, the MoE's sort) costs the host tens of
microseconds, so a small chunk next to running decodes takes as long as a large one. Attention
cannot join a graph here (FlashInfer's prefill plan changes with the batch's shape), so the
forward pass is captured in pieces split at each attention call, as vLLM does: piece 0 (the
embedding, the first norm, layer 0's q/k/v projection), piece i (layer i-1's o_proj, norm,
router and experts, layer i's q/k/v), and the last piece, ending with the final norm. Between
the pieces attention runs eagerly on the step's real tokens.

One set of pieces per token count (`sizes`); a step pads up to the next one. Padded rows carry
stale ids and activations through the pieces; attention never reads them and their hidden
states are never used. q, k and v leave each piece through fixed buffers (shared by every
layer: they are consumed before the next piece runs), so the pieces keep no per-layer tensors.
"""

from __future__ import annotations

import logging

import torch

from tinyoss.kernels.attention import AttentionMetadata
from tinyoss.model.gpt_oss import GptOssForCausalLM

log = logging.getLogger("tinyoss")


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Token counts a graph set is captured for, up to max_tokens: powers of two and the
    midpoints between them up to 1024 (1, 2, 3, 4, 6, 8, 12, 16, 24, ...), then every 256, so
    padding wastes at most a third of a step and a fifth of a large one. Small sizes matter:
    padded rows are routed to experts like real ones, and up to 8 tokens the MoE runs its GEMV
    (a 4-token verify step padded to 16 ran the grouped GEMMs at 4.6x a decode step)."""
    sizes, p = [], 1
    while p <= min(max_tokens, 1024):
        sizes += [s for s in (p, p * 3 // 2) if s <= min(max_tokens, 1024)]
        p *= 2
    return sorted(set(sizes)) + list(range(1280, max_tokens + 1, 256))


class _Pieces:
    """One token count's graphs, the (layer, sinks) of the attention call after each but the
    last, and the last piece's output."""

    def __init__(self) -> None:
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[tuple[int, torch.Tensor]] = []
        self.hidden: torch.Tensor | None = None


class _Splitter:
    """The attention backend the model calls while it is captured: each call ends the current
    graph (after copying q, k and v to the fixed buffers) and starts the next; what it returns
    is the fixed buffer the real attention fills at replay. With `pieces` None it only runs the
    model (the warm-up before a capture)."""

    def __init__(self, runner: PiecewiseGraphRunner, pieces: _Pieces | None, size: int) -> None:
        self.runner, self.pieces, self.size = runner, pieces, size

    def begin(self) -> None:
        assert self.pieces is not None
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.runner.pool)
        self.pieces.graphs.append(graph)

    def end(self) -> None:
        assert self.pieces is not None
        self.pieces.graphs[-1].capture_end()

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor, positions: torch.Tensor,
                 rope_cache: torch.Tensor) -> torch.Tensor:
        r, n = self.runner, self.size
        r.q[:n].copy_(q)
        r.k[:n].copy_(k)
        r.v[:n].copy_(v)
        if self.pieces is not None:
            self.end()
            self.pieces.calls.append((layer, sinks))
            self.begin()
        return r.out[:n]


class PiecewiseGraphRunner:
    def __init__(self, model: GptOssForCausalLM, attention, sizes: list[int],
                 device: torch.device) -> None:
        self.model = model
        self.attention = attention
        self.sizes = sorted(sizes)
        c = model.config
        top = max(sizes)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        dtype = model.model.embed_tokens.weight.dtype
        heads = (c.num_attention_heads, c.num_key_value_heads)
        self.q = torch.zeros(top, heads[0], c.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(top, heads[1], c.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(top, heads[1], c.head_dim, dtype=dtype, device=device)
        self.out = torch.zeros(top, c.q_size, dtype=dtype, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.pieces: dict[int, _Pieces] = {}
        self.device = device

    def bucket(self, num_tokens: int) -> int | None:
        return next((s for s in self.sizes if s >= num_tokens), None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, so the smaller sets reuse the pool's memory. On the current stream:
        the engine's, which replays them (`Executor.stream`)."""
        for size in sorted(self.sizes, reverse=True):
            self._forward(_Splitter(self, None, size), size)  # compiles outside the capture
            torch.cuda.synchronize(self.device)
            pieces = _Pieces()
            splitter = _Splitter(self, pieces, size)
            splitter.begin()
            pieces.hidden = self._forward(splitter, size)
            splitter.end()
            self.pieces[size] = pieces
        torch.cuda.synchronize(self.device)
        log.info("captured piecewise CUDA graphs for prefill and mixed steps of %s tokens",
                 self.sizes)

    def _forward(self, splitter: _Splitter, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], splitter)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, H] of a step of T tokens (T <= max(sizes)): the pieces of its
        size replayed, attention between them run on the T real tokens."""
        t = input_ids.shape[0]
        size = self.bucket(t)
        assert size is not None, f"no graph holds {t} tokens"
        pieces = self.pieces[size]
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        self.attention.plan(meta)
        rope, positions = self.model.rope_cache, self.positions[:t]
        pieces.graphs[0].replay()
        for (layer, sinks), graph in zip(pieces.calls, pieces.graphs[1:]):
            out = self.attention(layer, self.q[:t], self.k[:t], self.v[:t], sinks, positions,
                                 rope)
            self.out[:t].copy_(out)
            graph.replay()
        assert pieces.hidden is not None
        return pieces.hidden[:t]
