"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step has a token budget. Running sequences come first, oldest first (decodes take one
token, unfinished prefills take a chunk), then waiting requests are admitted in arrival order.
When blocks run out, the newest running sequence is preempted: its blocks are freed (full ones
stay in the prefix cache) and it is recomputed later, so nothing is lost and nothing crashes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tinyoss.engine.kv_cache import KVCacheManager
from tinyoss.engine.sequence import Sequence, Status


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int  # tokens computed this step, from seq.num_computed on
    # True when this step reaches the sequence's last token, so it samples the next one. Fixed
    # when scheduled: the engine advances num_computed as soon as the step is launched.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.seq.num_computed + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

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

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = self._fit(seq, min(seq.num_tokens - seq.num_computed, budget), out)
            if n:
                out.scheduled.append(Scheduled(seq, n))
                budget -= n
        while (
            self.waiting and budget and not out.preempted and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            if seq.num_computed == 0 and seq.prompt_logprobs is None:
                seq.num_computed = self.kv.match_prefix(seq.blocks, seq.token_ids)
                seq.num_cached_prompt = max(
                    seq.num_cached_prompt, min(seq.num_computed, seq.num_prompt)
                )
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.running:
                n = self.kv.max_new_tokens(seq.blocks, seq.num_computed, n)
            if not n or not self.kv.allocate(seq.blocks, seq.num_computed, n):
                self.kv.free_all(seq.blocks)
                seq.num_computed = 0
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append(Scheduled(seq, n))
            budget -= n
        return out

    def _fit(self, seq: Sequence, n: int, out: SchedulerOutput) -> int:
        """Allocate for `n` tokens of a running sequence: a prefill chunk shrinks to what fits,
        otherwise newer sequences are preempted. Returns the tokens granted (0 if preempted)."""
        while True:
            if n > 1:
                n = self.kv.max_new_tokens(seq.blocks, seq.num_computed, n)
            if n and self.kv.allocate(seq.blocks, seq.num_computed, n):
                return n
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return 0
            n = max(n, 1)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free_all(seq.blocks)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1
