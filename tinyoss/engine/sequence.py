"""One generation stream as the engine core sees it: token ids, cache blocks, stop conditions.

A request with `n` > 1 becomes n sequences that share the prompt (and its cached blocks). Text,
stop strings and detokenizing belong to the front end (`output_processor.py`); the core decides
only what needs no text: stop token ids, max_tokens and the context limit.
"""

from __future__ import annotations

import enum
import time

from tinyoss.engine.kv_cache import SeqBlocks
from tinyoss.sampling_params import SamplingParams
from tinyoss.tokenizer import RETURN as EOS_TOKEN_ID  # the tokenizer's eos_token, <|return|>


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        seq_id: int,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        num_groups: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.params = params
        self.max_tokens = max_tokens
        self.token_ids = list(prompt_token_ids)  # known tokens: prompt, then sampled
        self.num_prompt = len(prompt_token_ids)
        self.num_pending = 0  # tokens sampled by launched steps, not yet on the host
        self.num_computed = 0  # tokens whose K/V the launched steps write
        self.num_cached_prompt = 0
        self.num_prompt_logprobs = 0  # prompt positions whose logprobs are scheduled
        self.status = Status.WAITING
        self.announced = False  # the executor has its sampler state
        self.blocks = SeqBlocks.empty(num_groups, params.cache_salt)
        self.stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            self.stop_ids |= set(eos_token_ids)
        self.min_tokens_stop_ids = sorted(self.stop_ids | set(eos_token_ids))
        # vLLM's sampling_params.eos_token_id: the tokenizer's, none with ignore_eos
        self.eos_token_id = None if params.ignore_eos else EOS_TOKEN_ID
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.draft: list[int] = []  # tokens proposed to follow, verified by the next step
        # vLLM's QUEUED and first SCHEDULED times (time.monotonic, the core's clock), sent to
        # the front end once, with the sequence's first delta
        self.queued_time = time.monotonic()
        self.scheduled_time: float | None = None
        self.times_sent = False

    @property
    def num_tokens(self) -> int:
        """Tokens the sequence has, counting those sampled but not yet known."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def first_times(self) -> tuple[float, float] | None:
        """(queued, first scheduled) for the sequence's first delta once it has been
        scheduled; None after that (or before: nothing to tell yet)."""
        if self.times_sent or self.scheduled_time is None:
            return None
        self.times_sent = True
        return self.queued_time, self.scheduled_time

    def append(self, token_id: int, max_model_len: int) -> None:
        """Add a sampled token, then decide whether the sequence is done."""
        self.token_ids.append(token_id)
        self.num_pending -= 1
        # before min_tokens the sampler bans stop tokens unless a structured output's grammar
        # allows nothing else: then the grammar's end wins
        early = self.params.structured_outputs is not None
        if token_id in self.stop_ids and (self.num_output > self.params.min_tokens or early):
            # as vLLM's check_stop: the EOS first (it has no stop_reason, even where
            # stop_token_ids lists it too), then a stop_token_ids id (its own stop_reason).
            # vLLM adds the checkpoint's other end ids (generation_config.json's eos_token_id
            # but the EOS: <|endoftext|>, <|call|>) to stop_token_ids unless ignore_eos, so
            # they name themselves too, asked for or not
            self.finish("stop", None if token_id == self.eos_token_id else token_id)
        elif self.num_output >= self.max_tokens or len(self.token_ids) >= max_model_len:
            self.finish("length")

    def finish(self, reason: str, stop_reason: int | None = None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.status = Status.FINISHED
