"""What crosses between the scheduler and the executor: plain, picklable data.

The scheduler decides a step and writes it down as a `StepPlan` (token ids, positions, block
tables and cache slots, which rows sample); the executor runs it and answers with a
`StepResult`. Neither holds the other's objects, so an executor could live in another process
(tensor parallelism) and a test can script one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tinyoss.sampling_params import SamplingParams


@dataclass(frozen=True)
class Logprob:
    """vLLM's entry of a position's logprobs dict. `rank` is 1 for the most likely token;
    `decoded_token` the token's own text (a token that ends inside a UTF-8 character shows
    U+FFFD), as vLLM's detokenizer gives it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class TokenLogprob:
    """The sampled token's log-probability and the `top` most likely alternatives.

    Read as vLLM's logprobs are (a position is a dict {token id: Logprob}, the sampled token
    first, then the top ones), so code written for vLLM runs unchanged: `lp[token_id].logprob`,
    `lp.items()`, `max(lp.values(), key=...)`."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # the token's rank in the distribution (1: the most likely)
    # token id -> its text, set where the outputs are made (the `LLM`'s processor); not sent
    # between processes
    decode: Callable[[int], str] | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        """Without `decode` (a processor's), but with the texts it gives the entries: an output
        pickled to another process keeps its `decoded_token`s."""
        state = {**self.__dict__, "decode": None}
        if self.decode is not None:
            ids = [self.token_id, *(t for t, _ in self.top)]
            state["texts"] = {t: self.decode(t) for t in ids}
        return state

    def __setstate__(self, state: dict) -> None:
        texts = state.pop("texts", None)
        self.__dict__.update(state)
        if texts is not None:
            self.decode = texts.get

    def _entries(self) -> dict[int, Logprob]:
        ranks = {t: r for r, (t, _) in reversed(list(enumerate(self.top, 1)))}
        rank = self.rank if self.rank is not None else ranks.get(self.token_id)
        text = self.decode or (lambda t: None)
        entries = {self.token_id: Logprob(self.logprob, rank, text(self.token_id))}
        for t, lp in self.top:
            if t not in entries:
                entries[t] = Logprob(lp, ranks[t], text(t))
        return entries

    def __getitem__(self, token_id: int) -> Logprob:
        return self._entries()[token_id]

    def __iter__(self):
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())

    def __contains__(self, token_id: object) -> bool:
        return token_id in self._entries()

    def keys(self):
        return self._entries().keys()

    def values(self):
        return self._entries().values()

    def items(self):
        return self._entries().items()

    def get(self, token_id: int, default: Logprob | None = None) -> Logprob | None:
        return self._entries().get(token_id, default)


@dataclass
class NewSeq:
    """A sequence the executor has not seen yet: what its sampler state is made from."""

    seq_id: int
    params: SamplingParams
    prompt_token_ids: list[int]
    index: int  # within its request: a seeded request's sequences draw different noise
    min_tokens_stop_ids: list[int]  # masked until min_tokens outputs


@dataclass
class ScheduledSeq:
    """One sequence's part of a step: query tokens at positions [start, start + num_tokens)."""

    seq_id: int
    start: int
    num_tokens: int
    # The query tokens; None when they are the tokens the previous step sampled for this
    # sequence, which the executor takes on the device (a step launched before they are known).
    token_ids: list[int] | None
    # Logit rows at the end of the query that are sampled: 1 when the step reaches the last
    # known token, else 0. Room for k + 1 when a step verifies k drafted tokens.
    num_sampled: int
    block_tables: list[list[int]]  # per cache group: the blocks the sequence still holds
    block_starts: list[int]  # per cache group: the first position its table covers
    slots: list[list[int]]  # per cache group: the cache slot of each query token
    # Prompt positions [begin, end) whose next-token logprobs this step computes (or None).
    prompt_logprobs: tuple[int, int] | None = None
    prompt_targets: list[int] = field(default_factory=list)  # the tokens those predict
    # For an EAGLE-3 draft model: the prompt token after a chunk that ends inside the prompt
    # (-1 when the step samples the next token), and the full-attention blocks the sequence
    # holds past the step's table, where the draft writes its lookahead.
    following: int = -1
    lookahead_blocks: list[int] = field(default_factory=list)


@dataclass
class StepPlan:
    seqs: list[ScheduledSeq]
    new: list[NewSeq] = field(default_factory=list)  # before the step: create sampler state
    finished: list[int] = field(default_factory=list)  # before the step: drop sampler state

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_decode(self) -> bool:
        """One sampled token per sequence: a step CUDA graphs can replay."""
        return all(s.num_tokens == 1 and s.num_sampled == 1 for s in self.seqs)


@dataclass
class StepResult:
    """Per sequence that sampled: its new tokens, with logprobs where asked for; `failed`: the
    sequences whose logits were not finite (NaN/Inf), which must not go on."""

    sampled: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)  # failed: (code, why)
    drafts: dict[int, list[int]] = field(default_factory=dict)  # a draft model's proposals
