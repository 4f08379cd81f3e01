"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step has a token budget. Running sequences come first, oldest first, decodes before
unfinished prefills (decodes take one token, prefills a chunk), then waiting requests are
admitted in arrival order. The n sequences of a request (n > 1) wait while one of them
computes the prompt, then take its blocks from the prefix cache rather than compute and hold
their own; the requests queued behind them are admitted meanwhile.
While short requests wait to be admitted (their prompts together within 1 / NEWCOMER_SHARE of
the budget), an unfinished prefill's chunk leaves them room, so that their first tokens do not
wait for a long prompt's whole prefill; longer ones wait their turn, so long prompts are not
all prefilled at once, a slice each. While some sequence decodes, prefill chunks are sized by a
cost model to fit a time budget (`prefill_budget`, when set), so that a long prompt does not
stall the running streams.
When blocks run out, the newest running sequence is preempted: its blocks are freed (full ones
stay in the prefix cache) and it is recomputed later, so nothing is lost and nothing crashes.

The scheduler is the only user of the KV cache manager: it allocates, names full blocks for the
prefix cache, trims sliding windows, and writes every step down as a plain `StepPlan`.

With async scheduling a decode step can be planned before the previous one's tokens are known
(`chain`): each sequence's query is then the token the previous step samples, which the
executor takes on the device. A decode with drafted tokens (`Sequence.draft`, speculative
decoding) queries its last token and the drafts and samples at each. Steps chain only when
nothing could differ from running them one by one: every running sequence decodes, nobody
waits to be admitted, no sampler needs the previous token (penalties), nobody can reach its
length limit, and the cache has room.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass

from tinyoss.engine.kv_cache import KVCacheManager
from tinyoss.engine.sequence import Sequence, Status
from tinyoss.engine.step import NewSeq, ScheduledSeq, StepPlan

# Waiting prompts that fit in 1 / NEWCOMER_SHARE of the step's token budget, together, get room
# beside a running prefill's chunk (at most half of what the decodes left).
NEWCOMER_SHARE = 4


@dataclass(frozen=True)
class PrefillCost:
    """Seconds a prefill chunk of n tokens after `context` computed ones takes: per_token * n +
    per_key * n * (context + n / 2), attention reading the context and half the chunk."""

    per_token: float
    per_key: float

    def seconds(self, n: int, context: int) -> float:
        return n * (self.per_token + self.per_key * (context + n / 2))

    def tokens_within(self, seconds: float, context: int) -> int:
        """The longest chunk after `context` tokens that fits in `seconds`."""
        if seconds <= 0:
            return 0
        linear = self.per_token + self.per_key * context
        if self.per_key <= 0:
            return int(seconds / linear)
        half = self.per_key / 2  # half * n^2 + linear * n = seconds
        return int((math.sqrt(linear * linear + 4 * half * seconds) - linear) / (2 * half))


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # While some sequence decodes: the cost model and the seconds a step's prefill chunks
        # may take (None: the whole token budget). A long prompt then reaches the cache in
        # chunks short enough that running streams keep their pace (stall-free batching).
        self.prefill_budget: tuple[PrefillCost, float] | None = None
        self._dropped: list[int] = []  # finished sequences the executor still has state for
        # With an EAGLE-3 draft model: the positions it writes past a step (None: no draft).
        self.draft_lookahead: int | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and give back its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free_all(seq.blocks)
        if seq.announced:
            self._dropped.append(seq.seq_id)

    # -- planning ---------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step from what is known on the host (nothing may be in flight)."""
        picked: list[tuple[Sequence, int]] = []
        budget = self.max_num_batched_tokens
        cost, left = self.prefill_budget or (None, 0.0)  # seconds the prefill chunks may take
        if not any(s.num_tokens - s.num_computed == 1 for s in self.running):
            cost = None  # nobody decodes: nothing to stall
        first = True  # a step always makes some progress on a prefill

        def fitting(seq: Sequence, n: int) -> int:
            if cost is None:
                return n
            return min(n, max(cost.tokens_within(left, seq.num_computed), int(first)))

        preemptions = self.num_preemptions
        reserve = self._room_for_short_newcomers()
        # decodes first, then prefill chunks: a stream admitted after a long prompt keeps its
        # pace while that prompt is prefilled
        for seq in sorted(self.running, key=lambda s: s.num_tokens - s.num_computed > 1):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            want = seq.num_tokens - seq.num_computed
            chunk = want > 1  # a prefill chunk, not a decode
            want += len(seq.draft)  # drafted tokens to verify (a decode's)
            if chunk:
                want = fitting(seq, want)
                if reserve:  # leave the short waiting requests their room
                    want = min(want, max(budget - reserve, budget // 2, 1))
                if want == 0:
                    continue
            context = seq.num_computed
            n = self._fit(seq, min(want, budget))
            if n:
                picked.append((seq, n))
                budget -= n
                if chunk and cost is not None:
                    left, first = left - cost.seconds(n, context), False
        # a decode picked before a prefill chunk may have been preempted to make room for it
        picked = [(seq, n) for seq, n in picked if seq.status is Status.RUNNING]
        admit = self.num_preemptions == preemptions  # none admitted in a step that preempts
        room = len(self.running) < self.max_num_seqs
        # n > 1: a request's other sequences wait while one computes the prompt's blocks
        prefilling = {s.request_id for s in self.running if self._computes_shared_prompt(s)}
        at = 0  # the queue's head, past sequences waiting for a sibling's prompt blocks
        while (admit and at < len(self.waiting) and budget and room
               and (cost is None or left > 0 or first)):
            seq = self.waiting[at]
            if seq.request_id in prefilling:  # the requests behind it need not wait too
                at += 1
                continue
            if seq.num_computed == 0 and not seq.wants_prompt_logprobs:
                seq.num_computed = self.kv.match_prefix(seq.blocks, seq.token_ids)
            n = fitting(seq, min(seq.num_tokens - seq.num_computed, budget))
            if not self.running:
                n = self.kv.max_new_tokens(seq.blocks, seq.num_computed, n)
            if not n or not self.kv.allocate(seq.blocks, seq.num_computed, n):
                self.kv.free_all(seq.blocks)
                seq.num_computed = 0
                break
            del self.waiting[at]
            seq.status = Status.RUNNING
            if seq.scheduled_time is None:  # the first time: a preempted one keeps it (vLLM's)
                seq.scheduled_time = time.monotonic()
                # so are its cached tokens: after a preemption it finds its own blocks again
                seq.num_cached_prompt = min(seq.num_computed, seq.num_prompt)
            self.running.append(seq)
            picked.append((seq, n))
            budget -= n
            if self._computes_shared_prompt(seq):
                prefilling.add(seq.request_id)
            if cost is not None:
                left, first = left - cost.seconds(n, seq.num_computed), False
            room = len(self.running) < self.max_num_seqs
        return self._plan(picked) if picked else None

    def _computes_shared_prompt(self, seq: Sequence) -> bool:
        """Whether `seq` has yet to compute prompt blocks that its siblings would take from the
        prefix cache (named as its steps are planned: its siblings find them a step later)."""
        shareable = (seq.num_prompt - 1) // self.kv.block_size * self.kv.block_size
        return seq.num_computed < shareable and self.kv.enable_prefix_caching and not (
            seq.wants_prompt_logprobs
        )

    def _room_for_short_newcomers(self) -> int:
        """The tokens of the waiting requests at the queue's head whose prompts together fit
        in 1 / NEWCOMER_SHARE of the budget (0: none, or no room for more sequences)."""
        most, need = self.max_num_batched_tokens // NEWCOMER_SHARE, 0
        for seq in itertools.islice(self.waiting, max(0, self.max_num_seqs - len(self.running))):
            if need + seq.num_tokens > most:
                break
            need += seq.num_tokens
        return need

    def chain(self, plan: StepPlan) -> StepPlan | None:
        """The decode step of every running sequence, planned before `plan`'s tokens are known;
        None when chaining could change what runs (see the module docstring)."""
        running = self.running
        if len(plan.seqs) != len(running) or any(s.num_sampled != 1 for s in plan.seqs):
            return None  # a prefill still has chunks to go, or someone else is running
        if self.waiting and len(running) < self.max_num_seqs:
            return None  # admit the newcomers first
        ids = {s.seq_id for s in plan.seqs}
        if any(
            s.seq_id not in ids
            or s.params.needs_output_ids
            or s.num_output + s.num_pending >= s.max_tokens  # counting the token in flight
            or s.num_tokens >= self.max_model_len
            for s in running
        ):
            return None
        if len(running) > self.max_num_batched_tokens or not self.kv.room_for_next_token(
            [(s.blocks, s.num_computed) for s in running]
        ):
            return None
        for seq in running:
            allocated = self.kv.allocate(seq.blocks, seq.num_computed, 1)
            assert allocated, "room_for_next_token promised a block"
        return self._plan([(seq, 1) for seq in running], chained=True)

    def _plan(self, picked: list[tuple[Sequence, int]], chained: bool = False) -> StepPlan:
        """Writes the picked work down, then advances the sequences as if it had run (the cache
        holds it once the queued work runs)."""
        plan = StepPlan([], finished=self._dropped)
        self._dropped = []
        for seq, n in picked:
            begin = seq.num_computed
            if not seq.announced:
                seq.announced = True
                plan.new.append(
                    NewSeq(
                        seq.seq_id,
                        seq.params,
                        seq.token_ids[: seq.num_prompt],
                        seq.index,
                        seq.min_tokens_stop_ids,
                    )
                )
            tables, firsts, slots = self.kv.step_view(seq.blocks, begin, n)
            drafted = seq.draft[: max(0, begin + n - seq.num_tokens)]  # all that fitted
            seq.draft = []
            sampled = 1 + len(drafted) if begin + n >= seq.num_tokens else 0
            item = ScheduledSeq(
                seq.seq_id,
                begin,
                n,
                None if chained else seq.token_ids[begin : begin + n] + drafted,
                sampled,
                tables,
                firsts,
                slots,
            )
            if self.draft_lookahead is not None:
                self._draft_view(item, seq)
            if seq.wants_prompt_logprobs:
                # position p is predicted by row p - 1: this chunk's rows begin .. begin + n - 1
                # give positions begin + 1 .. begin + n (the first of the next chunk too)
                first = max(seq.num_prompt_logprobs + 1, begin + 1)
                last = min(begin + n, seq.num_prompt - 1)
                if first <= last:
                    item.prompt_logprobs = (first, last + 1)
                    item.prompt_targets = seq.token_ids[first : last + 1]
                    seq.num_prompt_logprobs = last
            plan.seqs.append(item)
            seq.num_computed += n
            seq.num_pending += sampled
            self.name_full_blocks(seq)
        return plan

    def _draft_view(self, item: ScheduledSeq, seq: Sequence) -> None:
        """What a draft model's passes after the step need beyond the target's plan: the next
        prompt token after a chunk, and room for `draft_lookahead` positions past the step in
        the full-attention blocks (where the cache is full, the lookahead's keys go nowhere:
        the drafts get worse, the output stays the same)."""
        end = item.start + item.num_tokens
        if end < seq.num_tokens and item.token_ids is not None:
            item.following = seq.token_ids[end]
        if item.num_sampled and self.draft_lookahead:
            ahead = min(end + self.draft_lookahead, self.max_model_len)
            if self.kv.reserve(seq.blocks, ahead):
                g = self.kv.windows.index(0)
                item.lookahead_blocks = seq.blocks.tables[g][len(item.block_tables[g]):]

    # -- after a step -----------------------------------------------------------------------
    def name_full_blocks(self, seq: Sequence) -> None:
        """Enter the sequence's full, computed blocks of known tokens in the prefix cache, before
        any trimming can give sliding-window blocks back (a later request reading them runs
        after the work that writes them: one stream)."""
        known = min(seq.num_computed, len(seq.token_ids))
        self.kv.cache_full_blocks(seq.blocks, seq.token_ids, known)

    def stepped(self, seq: Sequence, rejected: int = 0) -> None:
        """A running sequence's step results are in: `rejected` drafted positions roll back
        (their slots are written again later), then its blocks are named and its window
        trimmed."""
        seq.num_computed -= rejected
        seq.num_pending -= rejected
        self.name_full_blocks(seq)
        self.kv.trim_window(seq.blocks, seq.num_computed)

    def undo(self, plan: StepPlan, seqs: list[Sequence]) -> None:
        """A planned step that never ran (it failed at launch, nothing in flight): its
        sequences go back to waiting, in order, to be computed again; cache names given to
        blocks it would have written are taken back. What it told the executor (new and
        dropped sequences) is told again with the next plan: the launch may have failed
        before the executor took it in."""
        new = {n.seq_id for n in plan.new}
        self._dropped = plan.finished + self._dropped
        for item, seq in reversed(list(zip(plan.seqs, seqs))):
            seq.announced = seq.announced and seq.seq_id not in new
            self.kv.forget_names(seq.blocks, item.start)
            if item.prompt_logprobs is not None:
                seq.num_prompt_logprobs = item.prompt_logprobs[0] - 1
            if seq in self.running:
                self.running.remove(seq)
            self.kv.free_all(seq.blocks)
            seq.num_computed = seq.num_pending = 0
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)

    # -- allocation -------------------------------------------------------------------------
    def _fit(self, seq: Sequence, n: int) -> int:
        """Allocate for `n` tokens of a running sequence: a prefill chunk shrinks to what fits,
        otherwise newer sequences are preempted. Returns the tokens granted (0 if preempted)."""
        while True:
            if n > 1:
                n = self.kv.max_new_tokens(seq.blocks, seq.num_computed, n)
            if n and self.kv.allocate(seq.blocks, seq.num_computed, n):
                return n
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return 0
            n = max(n, 1)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free_all(seq.blocks)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
