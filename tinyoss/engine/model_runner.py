"""Turns a scheduled step into one forward pass: the flat batch, attention metadata, sampling.

Sequences' tokens go back to back into one flat batch with their positions; each cache group
gets block tables and the cache slot of every new token. Logits are computed only where needed
(each sampling sequence's last token, and prompt positions of requests asking for prompt
logprobs), then one batched sampler call picks every sequence's next token.

`launch` only queues work: the sampled tokens stay on the device, where the next step can take
them as its input ids before the host has seen them, and come back to the host in the
background (`LaunchedStep.result` waits for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyoss.engine.cuda_graphs import CudaGraphRunner
from tinyoss.engine.kv_cache import CacheLayout
from tinyoss.engine.sampler import Sampler, SamplingBatch, compute_logprobs
from tinyoss.engine.scheduler import Scheduled
from tinyoss.engine.sequence import TokenLogprob
from tinyoss.engine.transfer import HostCopy, to_device
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
    scheduled: list[Scheduled],
    layout: CacheLayout,
    block_size: int,
    device: torch.device,
    input_ids: torch.Tensor | None = None,
) -> FlatBatch:
    """The flat batch of a step. `input_ids` (on the device) replaces the token ids when they
    are not known on the host yet: a step launched before the previous one's tokens came back.
    Everything the host builds goes up in one non-blocking copy."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[list[int]] = [[] for _ in layout.windows]
    query_lens, seq_lens = [], []
    tables: list[list[list[int]]] = [[] for _ in layout.windows]
    starts: list[list[int]] = [[] for _ in layout.windows]
    for item in scheduled:
        seq, n = item.seq, item.num_tokens
        begin = seq.num_computed
        if input_ids is None:
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
    t = len(positions)
    flat = to_device(torch.tensor(ids + positions + sum(slots, []), dtype=torch.long), device)
    if input_ids is None:
        input_ids, flat = flat[:t], flat[t:]
    groups = [
        GroupMetadata(tables[g], starts[g], flat[(g + 1) * t : (g + 2) * t])
        for g in range(len(layout.windows))
    ]
    return FlatBatch(input_ids, flat[:t], AttentionMetadata(query_lens, seq_lens, groups))


@dataclass
class LaunchedStep:
    """A step whose GPU work is queued: its sampled tokens stay on the device (`tokens`, one row
    per sampling item, in `rows` order) for a next step to read, and travel to the host
    meanwhile; `result()` waits for them."""

    scheduled: list[Scheduled]
    rows: list[int]  # index in the step of each sampled row
    tokens: torch.Tensor | None  # [len(rows)] on the device
    host: HostCopy | None  # token ids, logprobs, top ids, top logprobs
    prompt_logprobs: dict[int, list[TokenLogprob]]

    def result(self) -> StepResult:
        out = StepResult({}, self.prompt_logprobs)
        if self.host is None:
            return out
        tokens, logprobs, top_ids, top_lps = (
            None if t is None else t.tolist() for t in self.host.wait()
        )
        for row, i in enumerate(self.rows):
            k = self.scheduled[i].seq.params.logprobs
            entry = None
            if k is not None:
                top = list(zip(top_ids[row][:k], top_lps[row][:k])) if k and top_ids else []
                entry = TokenLogprob(tokens[row], logprobs[row], top)
            out.sampled[i] = (tokens[row], entry)
        return out


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
    def launch(
        self, scheduled: list[Scheduled], input_ids: torch.Tensor | None = None
    ) -> LaunchedStep:
        """Queues the step's forward pass and sampling; nothing here waits for the GPU (prompt
        logprobs excepted). `input_ids`: as `build_batch` takes them."""
        batch = build_batch(scheduled, self.layout, self.block_size, self.device, input_ids)
        if self._graphable(scheduled):
            logits = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
            return self._sample(scheduled, list(range(len(scheduled))), logits, {})
        self.attention.plan(batch.meta)
        hidden = self.model(batch.input_ids, batch.positions, self.attention)
        rows, items, prompt = [], [], {}
        start = 0
        for i, item in enumerate(scheduled):
            seq, n = item.seq, item.num_tokens
            if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt:
                prompt[i] = self._prompt_logprobs(item, hidden[start : start + n])
            if item.samples:
                rows.append(start + n - 1)
                items.append(i)
            start += n
        if not rows:
            return LaunchedStep(scheduled, [], None, None, prompt)
        index = to_device(torch.tensor(rows), self.device)
        return self._sample(scheduled, items, self.model.compute_logits(hidden[index]), prompt)

    def _graphable(self, scheduled: list[Scheduled]) -> bool:
        """Pure decode steps (one token per sequence, each sampling) replay a CUDA graph."""
        return (
            self.graphs is not None
            and self.graphs.bucket(len(scheduled)) is not None
            and all(s.num_tokens == 1 and s.samples for s in scheduled)
        )

    def _sample(
        self,
        scheduled: list[Scheduled],
        items: list[int],
        logits: torch.Tensor,
        prompt: dict[int, list[TokenLogprob]],
    ) -> LaunchedStep:
        seqs = [scheduled[i].seq for i in items]
        out = self.sampler(logits, SamplingBatch.build(seqs, logits.shape[-1], logits.device))
        host = HostCopy.start([out.token_ids, out.logprobs, out.top_ids, out.top_logprobs])
        return LaunchedStep(scheduled, items, out.token_ids, host, prompt)

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
