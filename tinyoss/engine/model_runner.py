"""Turns a scheduled step into one forward pass: the flat batch, attention metadata, sampling.

Sequences' tokens go back to back into one flat batch with their positions; each cache group
gets block tables and the cache slot of every new token. Logits are computed only where needed
(each sampling sequence's last token, and prompt positions of requests asking for prompt
logprobs), then one batched sampler call picks every sequence's next token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyoss.engine.cuda_graphs import CudaGraphRunner
from tinyoss.engine.kv_cache import CacheLayout
from tinyoss.engine.sampler import Sampler, SamplingBatch, compute_logprobs
from tinyoss.engine.scheduler import Scheduled
from tinyoss.engine.sequence import TokenLogprob
from tinyoss.kernels.attention import AttentionMetadata, GroupMetadata
from tinyoss.model.gpt_oss import GptOssForCausalLM


@dataclass
class StepResult:
    sampled: dict[int, tuple[int, TokenLogprob | None]]  # index in the step -> token, logprob
    prompt_logprobs: dict[int, list[TokenLogprob]]  # index in the step -> new prompt entries


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata


def build_batch(
    scheduled: list[Scheduled], layout: CacheLayout, block_size: int, device: torch.device
) -> FlatBatch:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[list[int]] = [[] for _ in layout.windows]
    query_lens, seq_lens = [], []
    tables: list[list[list[int]]] = [[] for _ in layout.windows]
    starts: list[list[int]] = [[] for _ in layout.windows]
    for item in scheduled:
        seq, n = item.seq, item.num_tokens
        begin = seq.num_computed
        ids.extend(seq.token_ids[begin : begin + n])
        positions.extend(range(begin, begin + n))
        query_lens.append(n)
        seq_lens.append(begin + n)
        for g in range(len(layout.windows)):
            table, dropped = seq.blocks.tables[g], seq.blocks.dropped[g]
            tables[g].append(table)
            starts[g].append(dropped * block_size)
            slots[g].extend(
                table[p // block_size - dropped] * block_size + p % block_size
                for p in range(begin, begin + n)
            )
    groups = [
        GroupMetadata(tables[g], starts[g], torch.tensor(slots[g], dtype=torch.long, device=device))
        for g in range(len(layout.windows))
    ]
    return FlatBatch(
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(positions, dtype=torch.long, device=device),
        AttentionMetadata(query_lens, seq_lens, groups),
    )


class ModelRunner:
    def __init__(
        self,
        model: GptOssForCausalLM,
        attention,
        layout: CacheLayout,
        block_size: int,
        device: torch.device,
        graphs: CudaGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.attention = attention
        self.layout = layout
        self.block_size = block_size
        self.device = device
        self.graphs = graphs
        self.sampler = Sampler()

    @torch.inference_mode()
    def run(self, scheduled: list[Scheduled]) -> StepResult:
        batch = build_batch(scheduled, self.layout, self.block_size, self.device)
        result = StepResult({}, {})
        if self._graphable(scheduled):
            logits = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
            return self._sample(scheduled, list(range(len(scheduled))), logits, result)
        self.attention.plan(batch.meta)
        hidden = self.model(batch.input_ids, batch.positions, self.attention)
        rows, items = [], []
        start = 0
        for i, item in enumerate(scheduled):
            seq, n = item.seq, item.num_tokens
            if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt:
                result.prompt_logprobs[i] = self._prompt_logprobs(item, hidden[start : start + n])
            if item.samples:
                rows.append(start + n - 1)
                items.append(i)
            start += n
        if not rows:
            return result
        return self._sample(scheduled, items, self.model.compute_logits(hidden[rows]), result)

    def _graphable(self, scheduled: list[Scheduled]) -> bool:
        """Pure decode steps (one token per sequence, each sampling) replay a CUDA graph."""
        return (
            self.graphs is not None
            and self.graphs.bucket(len(scheduled)) is not None
            and all(s.num_tokens == 1 and s.samples for s in scheduled)
        )

    def _sample(
        self, scheduled: list[Scheduled], items: list[int], logits: torch.Tensor, result: StepResult
    ) -> StepResult:
        seqs = [scheduled[i].seq for i in items]
        out = self.sampler(logits, SamplingBatch.build(seqs, logits.shape[-1], logits.device))
        tokens = out.token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        for row, i in enumerate(items):
            k = scheduled[i].seq.params.logprobs
            entry = None
            if k is not None:
                top = list(zip(top_ids[row][:k], top_lps[row][:k])) if k and top_ids else []
                entry = TokenLogprob(tokens[row], logprobs[row], top)
            result.sampled[i] = (tokens[row], entry)
        return result

    def _prompt_logprobs(self, item: Scheduled, hidden: torch.Tensor) -> list[TokenLogprob]:
        """Logprobs of the prompt tokens that follow each position computed in this chunk."""
        seq = item.seq
        first = len(seq.prompt_logprobs)  # next prompt position without an entry
        begin = seq.num_computed
        last = min(begin + item.num_tokens, seq.num_prompt) - 1  # last prompt token predicted now
        rows = list(range(first - 1 - begin, last - begin))
        if not rows:
            return []
        targets = torch.tensor(seq.token_ids[first : last + 1], device=hidden.device)
        logits = self.model.compute_logits(hidden[rows])
        lp, top_ids, top_lps = compute_logprobs(logits, targets, seq.params.prompt_logprobs)
        lp, top_ids, top_lps = lp.tolist(), top_ids.tolist(), top_lps.tolist()
        return [
            TokenLogprob(t, lp[j], list(zip(top_ids[j], top_lps[j])))
            for j, t in enumerate(seq.token_ids[first : last + 1])
        ]
