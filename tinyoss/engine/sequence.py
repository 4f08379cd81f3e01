"""One generation stream: its tokens, cache blocks, sampling state, text and stop checks.

A request with `n` > 1 becomes n sequences that share the prompt (and its cached blocks).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from tinyoss.engine.kv_cache import SeqBlocks
from tinyoss.sampling_params import SamplingParams
from tinyoss.tokenizer import IncrementalDetokenizer, Tokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """The sampled token's log-probability and the `top` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    """One sequence's output so far; `delta_*` hold what the last step added (for streaming)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Sequence:
    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        arrival: int,
        num_groups: int,
        tokenizer: Tokenizer | None,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.params = params
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.token_ids = list(prompt_token_ids)
        self.num_prompt = len(prompt_token_ids)
        self.num_computed = 0
        self.num_cached_prompt = 0
        self.status = Status.WAITING
        self.blocks = SeqBlocks.empty(num_groups)
        self.generator = _generator(params.seed, index, device)
        self.stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            self.stop_ids |= set(eos_token_ids)
        self.min_tokens_stop_ids = sorted(self.stop_ids | set(eos_token_ids))
        self.detok = (
            IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self.out = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self._text = ""  # all decoded text, including what is held back for stop strings
        self._emitted = 0  # characters of _text already in out.text

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def begin_step(self) -> None:
        self.out.delta_text = ""
        self.out.delta_token_ids = []
        self.out.delta_logprobs = []

    def append(self, token_id: int, logprob: TokenLogprob | None, max_model_len: int) -> None:
        """Add a sampled token, then decide whether the sequence is done."""
        self.token_ids.append(token_id)
        self.out.token_ids.append(token_id)
        self.out.delta_token_ids.append(token_id)
        if logprob is not None and self.out.logprobs is not None:
            self.out.logprobs.append(logprob)
            self.out.delta_logprobs.append(logprob)
        checking = self.num_output > self.params.min_tokens
        if checking and token_id in self.stop_ids:
            self._finish(
                "stop", token_id if token_id in (self.params.stop_token_ids or ()) else None
            )
            return
        if self.detok is not None:
            self._text += self.detok.add([token_id])
            if checking and self._check_stop_strings():
                return
        if self.num_output >= self.max_tokens or self.num_tokens >= max_model_len:
            self._finish("length", None)
        else:
            self._emit(len(self._text) - self._held_back())

    def abort(self) -> None:
        self._finish("abort", None)

    def _check_stop_strings(self) -> bool:
        stops = self.params.stop
        if not stops:
            return False
        window_start = max(0, self._emitted - max(len(s) for s in stops))
        hits = [(self._text.find(s, window_start), s) for s in stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        end = i + len(s) if self.params.include_stop_str_in_output else i
        self._text = self._text[:end]
        self._finish("stop", s, flush=False)
        return True

    def _held_back(self) -> int:
        """Length of the text tail that could still become a stop string."""
        longest = 0
        for s in self.params.stop or ():
            for n in range(min(len(s) - 1, len(self._text) - self._emitted), longest, -1):
                if self._text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, upto: int) -> None:
        if upto > self._emitted:
            piece = self._text[self._emitted : upto]
            self.out.text += piece
            self.out.delta_text += piece
            self._emitted = upto

    def _finish(self, reason: str, stop_reason: str | int | None, flush: bool = True) -> None:
        if flush and self.detok is not None:
            self._text += self.detok.flush()
        self._emit(len(self._text))
        self.out.finish_reason = reason
        self.out.stop_reason = stop_reason
        self.status = Status.FINISHED


def _generator(seed: int | None, index: int, device: torch.device) -> torch.Generator | None:
    """Per-sequence generator: a seeded request samples the same tokens in any batch."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed + index * 1_000_003)
    return g
