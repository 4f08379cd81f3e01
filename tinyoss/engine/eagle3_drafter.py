"""EAGLE-3 drafting in the engine: after a step's tokens are chosen, the draft model proposes
the next k tokens of every sampling sequence, on the device, before the host sees anything.

The draft (`tinyoss.model.eagle3`) is one decoder layer over the target's residual stream at
three layers, which the target's forward pass leaves in `aux_hidden`. Its K/V live in the
target's paged cache as one more full-attention layer (`CacheLayout.for_model(...,
draft_layers=1)`): same blocks, same slots, same rollback; a prefix-cache hit finds the
draft's keys next to the target's. (Two approximations there, which change drafts, never output:
a block's last draft key depends on the token after the block, which a request sharing only the
block may not have; and blocks computed by steps in which no sequence could take drafts, where
the draft does not run, hold no draft keys.)

Pass 1 runs the draft over every token of the step with the attention plan the target's step
made: row i's input is the target's state at row i and the token after it, which is the next
query token, or, where the target chose one, the chosen token (a verify row's draft when it
was accepted, else the target's token). Rows after a sequence's first rejected draft get a
wrong token; their positions are written again by later steps. The row of each sequence's last
accepted position gives draft 1 (the argmax of the draft's logits, in target ids) and the state
fed back to the next pass.

Passes 2..k take one row per sequence at the following positions through the attention's
`decode_rows`: positions, cache slots and key ranges are computed on the device from the
acceptance, so nothing waits for the host, and all k - 1 of them replay as one CUDA graph per
batch size (`capture`). They write into the blocks the scheduler reserved past the step
(`ScheduledSeq.lookahead_blocks`); padded graph rows have no blocks and store nothing.

Drafts are greedy (q(d) = 1): `speculative.verify`'s rejection sampling stays exact.
"""

from __future__ import annotations

import logging

import torch

from tinyoss.engine.cuda_graphs import graph_sizes
from tinyoss.engine.step import StepPlan
from tinyoss.engine.transfer import to_device
from tinyoss.model.eagle3 import Eagle3Draft


log = logging.getLogger("tinyoss")


class Eagle3Drafter:
    def __init__(self, draft: Eagle3Draft, attention, layer: int, rope_cache: torch.Tensor,
                 num_tokens: int, block_size: int, full_group: int, max_model_len: int) -> None:
        self.draft = draft
        self.attention = attention
        self.layer = layer  # the draft layer's index in the attention's caches
        self.rope_cache = rope_cache  # the target's: the draft rotates as it does
        self.k = num_tokens
        self.block_size = block_size
        self.full_group = full_group
        self.max_model_len = max_model_len
        c, device = draft.config, rope_cache.device
        # no sink: exp(-inf) adds nothing to a softmax denominator
        self.sinks = torch.full((c.num_attention_heads,), float("-inf"), device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.static: dict[str, torch.Tensor] = {}

    def capture(self, max_num_seqs: int) -> None:
        """CUDA graphs of passes 2..k for each decode batch size: inputs and output in fixed
        buffers, one replay for all k - 1 one-token passes."""
        if self.k < 2:
            return
        sizes = graph_sizes(max_num_seqs)
        top, device = max(sizes), self.rope_cache.device
        width = -(-self.max_model_len // self.block_size) + 1
        weight = self.draft.fc.weight
        self.static = {
            "token": torch.zeros(top, dtype=torch.long, device=device),
            "position": torch.zeros(top, dtype=torch.long, device=device),
            "feedback": torch.zeros(top, self.draft.config.hidden_size, dtype=weight.dtype,
                                    device=device),
            "table": torch.zeros(top, width, dtype=torch.int32, device=device),
            "table_lens": torch.zeros(top, dtype=torch.long, device=device),  # 0: no blocks
            "drafts": torch.zeros(top, self.k - 1, dtype=torch.long, device=device),
        }
        pool = None
        on = torch.cuda.current_stream(device)  # the engine's, which replays them
        for size in sorted(sizes, reverse=True):
            self._replayed_passes(size)  # warm-up: compiles outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=on):
                self._replayed_passes(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(device)
        log.info("captured CUDA graphs of EAGLE-3 draft passes for batch sizes %s", sizes)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.draft.config.aux_layer_ids

    def propose(self, plan: StepPlan, input_ids: torch.Tensor, positions: torch.Tensor,
                aux: torch.Tensor, rows: list[int], chosen: torch.Tensor,
                accepted: torch.Tensor | None) -> torch.Tensor:
        """Drafts [S, k] (target token ids) for the S sampling sequences of a step, in plan
        order. input_ids, positions [T] and aux [T, 3H]: the step's tokens and the target's
        states; rows [R]: the flat row of each sampled row (a sequence's rows consecutive);
        chosen [R]: the token each sampled row is followed by if the sequence stops there;
        accepted [R]: whether a verify row's draft was accepted (None: one row a sequence)."""
        device = input_ids.device
        following, tables, seg = [], [], []  # seg: each sampled row's sequence
        for s in plan.seqs:
            assert s.token_ids is not None, "a drafting step is never chained"
            following += s.token_ids[1:] + [s.following]
            if s.num_sampled:
                seg += [len(tables)] * s.num_sampled
                tables.append(s.block_tables[self.full_group] + s.lookahead_blocks)
        width = max(len(t) for t in tables)
        host = torch.tensor(following + rows + seg + [len(t) for t in tables]
                            + [b for t in tables for b in t + [0] * (width - len(t))])
        flat = to_device(host, device)
        t, r, s = len(following), len(rows), len(tables)
        next_ids, row_index = flat[:t].clone(), flat[t : t + r]
        segment, table_lens = flat[t + r : t + 2 * r], flat[t + 2 * r : t + 2 * r + s]
        table = flat[t + 2 * r + s :].view(s, width).to(torch.int32)
        next_ids[row_index] = chosen
        if accepted is None:
            last = row_index
        else:  # each sequence's first row not accepted (its last row never is)
            candidates = torch.where(accepted, r, torch.arange(r, device=device))
            first = torch.full((s,), r, dtype=torch.long, device=device)
            last = row_index[first.scatter_reduce(0, segment, candidates, "amin")]

        draft = self.draft
        plan_attention = self._attend_planned
        normed, feedback = draft.forward(draft.combine(aux), next_ids, positions, plan_attention)
        token = draft.propose_ids(normed[last])
        position, feedback = positions[last], feedback[last]
        if self.k < 2:
            return token[:, None]
        size = min((n for n in self.graphs if n >= s), default=None)
        if size is None:
            rest = self._passes(token, position, feedback, table, table_lens)
            return torch.cat([token[:, None], rest], 1)
        st = self.static
        for name, value in (("token", token), ("position", position), ("feedback", feedback),
                            ("table_lens", table_lens)):
            st[name][:s].copy_(value)
        st["table_lens"][s:size].zero_()
        st["table"][:s, : table.shape[1]].copy_(table)
        self.graphs[size].replay()
        return torch.cat([token[:, None], st["drafts"][:s]], 1)

    def _passes(self, token: torch.Tensor, position: torch.Tensor, feedback: torch.Tensor,
                table: torch.Tensor, table_lens: torch.Tensor) -> torch.Tensor:
        """Passes 2..k from draft 1: drafts 2..k [S, k - 1]."""
        out = []
        for _ in range(self.k - 1):
            position = position + 1
            normed, feedback = self.draft.forward(feedback, token, position,
                                                  self._decode_rows(position, table, table_lens))
            token = self.draft.propose_ids(normed)
            out.append(token)
        return torch.stack(out, 1)

    def _replayed_passes(self, size: int) -> None:
        st = self.static
        st["drafts"][:size] = self._passes(st["token"][:size], st["position"][:size],
                                           st["feedback"][:size], st["table"][:size],
                                           st["table_lens"][:size])

    def _attend_planned(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor:
        """The draft layer over the step's tokens, with the attention's plan for the step."""
        return self.attention(self.layer, q, k, v, self.sinks, positions, self.rope_cache)

    def _decode_rows(self, position: torch.Tensor, table: torch.Tensor, table_lens: torch.Tensor):
        """The draft layer's attention for one token a sequence at `position`: its slot from
        the sequence's table, keys from position 0; a position past the blocks held (the cache
        was full, or the end of max_model_len) stores nothing and sees the keys it has."""
        bs = self.block_size
        block = position // bs
        held = (block < table_lens) & (position < self.max_model_len)
        ids = table.gather(1, block.clamp(max=table.shape[1] - 1)[:, None])[:, 0].long()
        slots = torch.where(held, ids * bs + position % bs, -1)
        end = torch.minimum(position + 1, table_lens * bs)
        ranges = torch.stack([torch.zeros_like(end), end], 1).to(torch.int32)
        rope_pos = position.clamp(max=self.rope_cache.shape[0] - 1)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
            return self.attention.decode_rows(self.layer, q, k, v, self.sinks, rope_pos,
                                              self.rope_cache, table, ranges, slots)

        return attend
