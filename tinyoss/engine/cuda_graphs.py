"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with padding.

A decode step at small batch is hundreds of short kernels; replaying them as one graph removes
the launch gaps. Graphs are captured largest first and share one memory pool. Each takes the
token ids and positions from static buffers; attention reads its plan (made outside the graph,
before every replay) from its own fixed buffers; the ids and positions go in with the plan's
launch. Padded rows attend to a dummy cache block, and
their logits are ignored.

With `rows=True` a runner replays speculative verify steps instead: a graph per count of query
tokens (each sequence's last token and its drafts), every token a row of the decode attention
kernel with its own key range, and logits for every token.
"""

from __future__ import annotations

import logging

import torch

from tinyoss.kernels.attention import AttentionMetadata, GroupMetadata
from tinyoss.model.gpt_oss import GptOssForCausalLM

log = logging.getLogger("tinyoss")


def graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (at most 256)."""
    limit = min(max_num_seqs, 256)
    sizes = [s for s in (1, 2, 4, 8) if s <= limit]
    sizes += list(range(16, limit + 1, 8))
    if sizes[-1] < limit:
        sizes.append(limit)
    return sizes


class CudaGraphRunner:
    def __init__(
        self,
        model: GptOssForCausalLM,
        attention,
        sizes: list[int],
        num_groups: int,
        device: torch.device,
        rows: bool = False,
    ) -> None:
        self.model = model
        self.rows = rows
        self.attention = attention
        self.sizes = sizes
        self.num_groups = num_groups
        top = max(sizes)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.logits = torch.zeros(top, model.config.vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.device = device

    def bucket(self, batch_size: int) -> int | None:
        return next((s for s in self.sizes if s >= batch_size), None)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        on = torch.cuda.current_stream(self.device)  # the engine's, which replays them
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        for size in sorted(self.sizes, reverse=True):
            meta = AttentionMetadata([], [], [GroupMetadata([], [], empty)] * self.num_groups)
            self.attention.plan(meta, graph_size=size, rows=self.rows)
            self._forward(size)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=on):
                self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        what = "verify steps of" if self.rows else "decode batch sizes"
        log.info("captured CUDA graphs for %s %s", what, self.sizes)

    def _forward(self, size: int) -> None:
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.attention)
        self.model.compute_logits(hidden, out=self.logits[:size])

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Logits [B, V] of a decode batch of B sequences (one new token each), or of B query
        tokens (`rows`)."""
        b = input_ids.shape[0]
        size = self.bucket(b)
        assert size is not None
        inputs = (input_ids.contiguous(), positions.contiguous(), self.input_ids, self.positions)
        self.attention.plan(meta, graph_size=size, rows=self.rows, inputs=inputs)
        self.graphs[size].replay()
        return self.logits[:b]
