"""The front end's half of a request: engine deltas -> text, stop strings, outputs.

The engine core sends what each sequence gained in a step (token ids, logprobs, a finish
reason). Here they are detokenized incrementally and checked for stop strings, and each step
yields a fresh `RequestOutput` carrying that step's deltas; the cumulative token ids and text
grow in place. Every call costs O(what the step added), never O(output so far).

A stop string found here ends the sequence at once; the caller tells the core to drop it
(`process` returns those sequences), and tokens the core produced meanwhile are ignored.

A processor made with `windowed=True` (the server's) keeps each sequence's logprobs in a
`LogprobWindow`: its consumer releases the entries it has taken, so what is held is what it has
not taken yet, not the whole output.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace

from tinyoss.engine.core import RequestError, SeqDelta
from tinyoss.engine.step import TokenLogprob
from tinyoss.sampling_params import SamplingParams
from tinyoss.tokenizer import IncrementalDetokenizer, Tokenizer


class LogprobWindow:
    """A sequence's logprobs indexed by position, like the list of them all, for a consumer
    that takes each entry once: `release(upto)` drops the entries before `upto`, which can no
    longer be read."""

    def __init__(self) -> None:
        self.start = 0  # the position of entries[0]
        self.entries: list[TokenLogprob] = []

    def __len__(self) -> int:
        return self.start + len(self.entries)

    def __getitem__(self, at: int | slice) -> TokenLogprob | list[TokenLogprob]:
        if isinstance(at, slice):
            begin, end, step = at.indices(len(self))
            if begin < self.start and begin < end:
                raise IndexError(f"logprobs before position {self.start} were released")
            return self.entries[begin - self.start : end - self.start : step]
        at = at + len(self) if at < 0 else at
        if not self.start <= at < len(self):
            raise IndexError(f"logprob position {at} is outside [{self.start}, {len(self)})")
        return self.entries[at - self.start]

    def __iadd__(self, entries: list[TokenLogprob]) -> LogprobWindow:
        self.entries += entries
        return self

    @property
    def held(self) -> int:
        """Entries not released."""
        return len(self.entries)

    def release(self, upto: int) -> None:
        """Drops the entries before position `upto` (those that have arrived)."""
        drop = min(upto, len(self)) - self.start
        if drop > 0:
            del self.entries[:drop]
            self.start += drop


@dataclass
class CompletionOutput:
    """One sequence after a step. `delta_*` hold what the step added; `text` and
    `cumulative_logprob` are as of this step; `token_ids` and `logprobs` are the whole output
    so far, shared with later outputs of the same sequence (copying them each step would cost
    the whole output every step: slice them by `len` of an earlier step's, or copy them, to keep
    a snapshot); from a windowed processor `logprobs` is a `LogprobWindow`
    whose consumer releases what it has taken, and `delta_logprobs` is empty (outputs waiting
    for a reader that is behind would hold on to entries the window let go)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | LogprobWindow | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list, repr=False)  # the text, as it came
    # how many pieces and logprob entries there were at this step (the lists grow later)
    upto: tuple[int, int] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.upto is None:
            lps = self.logprobs if isinstance(self.logprobs, list) else ()
            self.upto = (len(self.pieces), len(lps))

    @property
    def text(self) -> str:
        return "".join(self.pieces[: self.upto[0]])

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the sampled tokens' logprobs as of this step (None without
        logprobs, or from a windowed processor, which lets entries go)."""
        if not isinstance(self.logprobs, list):
            return None
        return float(sum(e.logprob for e in self.logprobs[: self.upto[1]]))

    def __repr__(self) -> str:  # the text first, as vLLM's shows it
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, "
                f"token_ids={self.token_ids!r}, finish_reason={self.finish_reason!r}, "
                f"stop_reason={self.stop_reason!r})")

    def finished(self) -> bool:
        """A method, as vLLM's (`c.finished()`); the request's `RequestOutput.finished` is a
        field."""
        return self.finish_reason is not None


@dataclass
class RequestStateStats:
    """vLLM's RequestStateStats, its engine-core timestamps: when the core took the request,
    when it first scheduled it (the earliest of its n sequences; preemptions do not move it),
    and when its first and its latest tokens were made, on the core's time.monotonic clock
    (None until then). The differences are vLLM's request phases (queue, prefill, decode).
    Also vLLM's front-end fields scripts read: the tokens generated so far (all n sequences)
    and the seconds from the request's arrival to its first token (0.0 until then)."""

    queued_ts: float | None = None
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    num_generation_tokens: int = 0
    first_token_latency: float = 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    error: RequestError | None = None  # why it failed (its outputs' finish_reason: "error")
    metrics: RequestStateStats | None = None  # as of the latest output (it is shared, as vLLM's)


class StopStrings:
    """Finds stop strings in streamed text. The last (longest stop - 1) characters are held
    back, since they could still begin one (as vLLM does), so a feed costs O(new text). Text
    passed on unwatched (`skip`: before min_tokens) is looked back into as vLLM does: a stop
    string that begins there and ends in watched text still stops (its head already shown)."""

    def __init__(self, stops: list[str], include: bool = False) -> None:
        self.stops, self.include = stops, include
        self.keep = max(len(s) for s in stops) - 1
        self.pending = ""
        self.shown = ""  # the last `keep` characters passed on

    def skip(self, text: str) -> str:
        """`text` passed on without watching it (it may begin a stop string that ends later)."""
        self._show(text)
        return text

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to pass on, the stop string found or None): a stop string that ends in
        text not passed on yet."""
        self.pending += text
        both, seen = self.shown + self.pending, len(self.shown)
        hits = [(i, s) for s in self.stops
                if (i := both.find(s, max(0, seen - len(s) + 1))) >= 0]
        if hits:
            i, s = min(hits)
            out = both[seen : max(seen, i + len(s) if self.include else i)]
            self.pending = self.shown = ""
            return out, s
        cut = max(0, len(self.pending) - self.keep)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self._show(out)
        return out, None

    def _show(self, text: str) -> None:
        self.shown = (self.shown + text)[-self.keep:] if self.keep else ""

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


class _Seq:
    """Front-end state of one sequence."""

    def __init__(
        self, index: int, tokenizer: Tokenizer, params: SamplingParams, windowed: bool
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        stops = params.stop or []
        self.stops = StopStrings(stops, params.include_stop_str_in_output) if stops else None
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | LogprobWindow | None = None
        if params.logprobs is not None:
            self.logprobs = LogprobWindow() if windowed else []
        self.pieces: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_cached = 0

    def output(self, index: int, text: str = "", ids=(), lps=()) -> CompletionOutput:
        return CompletionOutput(
            index, self.token_ids, self.logprobs, self.finish_reason, self.stop_reason, text,
            list(ids), list(lps), self.pieces,
        )

    def apply(self, d: SeqDelta) -> tuple[str, bool]:
        """Takes a delta in; returns the new text and whether a stop string ended it. A delta of
        several tokens (a speculative step's accepted drafts and the token after them) is taken
        a token at a time where stop strings are watched: the tokens after the one a stop string
        ends in are dropped, as a step at a time would never have made them."""
        if self.stops is None or len(d.token_ids) < 2:
            return self._apply(d)
        texts, last = [], len(d.token_ids) - 1
        for i, token in enumerate(d.token_ids):
            text, stopped = self._apply(replace(
                d, token_ids=[token], logprobs=d.logprobs[i : i + 1] if d.logprobs else None,
                finish_reason=d.finish_reason if i == last else None,
                stop_reason=d.stop_reason if i == last else None))
            texts.append(text)
            if stopped:
                break
        return "".join(texts), stopped

    def _apply(self, d: SeqDelta) -> tuple[str, bool]:
        self.token_ids += d.token_ids
        if self.logprobs is not None and d.logprobs:
            self.logprobs += d.logprobs
        self.num_cached = d.num_cached_tokens
        ids = d.token_ids
        if d.finish_reason == "stop" and ids and not self.include_stop:
            # the core stops on a stop token (an end token or stop_token_ids), its last: its text
            # is left out, as a stop string's is (vLLM's detokenizer does so, even where special
            # tokens are shown: skip_special_tokens false); it stays in token_ids and logprobs
            ids = ids[:-1]
        text = self.detok.add(ids)
        stopped = False
        if self.stops is not None and len(self.token_ids) > self.min_tokens:
            text, hit = self.stops.feed(text)
            if hit is not None:
                self.finish_reason, self.stop_reason, stopped = "stop", hit, True
        elif self.stops is not None:
            text = self.stops.skip(text)
        if d.finish_reason is not None and not stopped:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
            tail = self.detok.flush()
            if self.stops is not None:
                more, hit = self.stops.feed(tail)
                tail = more if hit is not None else more + self.stops.flush()
                if hit is not None:
                    self.finish_reason, self.stop_reason = "stop", hit
            text += tail
        if text:
            self.pieces.append(text)
        return text, stopped


class _Request:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        arrival_time: float,
        windowed: bool,
    ) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.seqs = [_Seq(i, tokenizer, params, windowed) for i in range(params.n)]
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.error: RequestError | None = None
        self.metrics = RequestStateStats()

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def output(self, changed: dict[int, CompletionOutput]) -> RequestOutput:
        outputs = [changed.get(i) or s.output(i) for i, s in enumerate(self.seqs)]
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, outputs, self.finished,
            self.prompt_logprobs, min(s.num_cached for s in self.seqs), self.arrival_time,
            self.first_token_time, self.error, self.metrics,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, windowed: bool = False) -> None:
        """`windowed`: each sequence's logprobs are a `LogprobWindow` (see the module's
        docstring)."""
        self.tokenizer, self.windowed = tokenizer, windowed
        self._token_text = functools.lru_cache(maxsize=4096)(lambda t: tokenizer.decode([t]))
        self.requests: dict[str, _Request] = {}

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.requests[request_id] = _Request(
            request_id, prompt, prompt_token_ids, params, self.tokenizer,
            time.monotonic() if arrival_time is None else arrival_time, self.windowed,
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forgets a request, marking what is unfinished as aborted; its last output."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for s in request.seqs:
            if s.finish_reason is None:
                s.finish_reason = "abort"
        return request.output({})

    def stop(self, request_id: str, index: int, reason: str) -> RequestOutput | None:
        """Ends a sequence at a stop its caller found (chat's stop strings, which look at the
        answer alone); the request's last output if that finished it (it is then forgotten).
        The core must drop the sequence."""
        request = self.requests.get(request_id)
        if request is None or request.seqs[index].finish_reason is not None:
            return None
        request.seqs[index].finish_reason, request.seqs[index].stop_reason = "stop", reason
        if not request.finished:
            return None
        del self.requests[request_id]
        return request.output({})

    def process(
        self, deltas: list[SeqDelta], step_time: float | None = None
    ) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """(the outputs of the requests that changed, the sequences a stop string ended: the
        core must drop them). `step_time`: when the core had the step's results, on its clock
        (default: now, for a core in this process)."""
        changed: dict[str, dict[int, CompletionOutput]] = {}
        stopped: list[tuple[str, int]] = []
        now = time.monotonic()
        step_time = now if step_time is None else step_time
        for d in deltas:
            request = self.requests.get(d.request_id)
            if request is None:
                continue
            seq = request.seqs[d.index]
            if seq.finish_reason is not None:  # ended by a stop string: later tokens are dropped
                continue
            request.error = request.error or d.error
            if d.times is not None:
                stats, (queued, scheduled) = request.metrics, d.times
                stats.queued_ts = queued
                stats.scheduled_ts = min(scheduled, stats.scheduled_ts or scheduled)
            if not self.windowed:  # the LLM's outputs: vLLM's Logprob.decoded_token
                for lp in (*(d.logprobs or ()), *(d.prompt_logprobs or ())):
                    if lp is not None:
                        lp.decode = self._token_text
            if d.prompt_logprobs and request.prompt_logprobs is not None and d.index == 0:
                request.prompt_logprobs += d.prompt_logprobs
            had = len(seq.token_ids)
            text, by_stop = seq.apply(d)
            request.metrics.num_generation_tokens += len(seq.token_ids) - had
            if d.token_ids:
                request.metrics.last_token_ts = step_time
                if request.first_token_time is None:
                    request.first_token_time = now
                    request.metrics.first_token_ts = step_time
                    request.metrics.first_token_latency = now - request.arrival_time
            if by_stop and d.finish_reason is None:
                stopped.append((d.request_id, d.index))
            changed.setdefault(d.request_id, {})[d.index] = seq.output(
                d.index, text, d.token_ids, () if self.windowed else d.logprobs or ()
            )
        outputs = []
        for request_id, seqs in changed.items():
            request = self.requests[request_id]
            outputs.append(request.output(seqs))
            if request.finished:
                del self.requests[request_id]
        return outputs, stopped
