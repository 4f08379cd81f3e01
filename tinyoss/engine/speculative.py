"""Speculative decoding: drafted tokens checked by the target model in one step.

Before a step, a proposer drafts up to k tokens for each decoding sequence from what the host
knows. The step then feeds a sequence its last token and its drafts (k + 1 query tokens through
the same attention as a prefill chunk: each position sees its own sliding window and the sinks)
and scores every position. `verify` keeps the longest run of drafts the target agrees with and
adds one token of the target's own, so a step emits 1 to k + 1 tokens:

- a greedy row accepts a draft equal to its argmax (output identical to decoding without
  drafts);
- a sampled row accepts draft d with probability p(d) and, at the first rejection, samples from
  p without d, renormalised. The drafts here are deterministic (q(d) = 1), for which this is
  Leviathan et al.'s rejection sampling: the output distribution is exactly the target's.

The scheduler rolls rejected positions back (`Scheduler.stepped`): their cache slots are written
again later, and the prefix cache names only blocks of known tokens, never of drafts.

Speculation applies to requests that sample without per-token state: greedy or unseeded
sampling, without penalties, logprobs, min_tokens or a grammar; others decode one token a step
in the same batch. Steps chain (async scheduling) only while no running request can take
drafts: a proposer needs the previous tokens on the host.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from tinyoss.engine.sampler import SamplingBatch, race, scores
from tinyoss.sampling_params import SamplingParams

_METHODS = ("ngram", "eagle3")
# Drafts a step when the config names none: SGLang's and NVIDIA's published EAGLE-3 setting for
# gpt-oss (3 draft steps); also where a verify step costs least per token it may gain
# (bench/results/2026-11-24_h100_spec_decode.md).
DEFAULT_NUM_TOKENS = 3


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` keys: method, num_speculative_tokens, for n-gram lookup
    prompt_lookup_max / prompt_lookup_min (the longest and shortest suffix matched), for an
    EAGLE-3 draft its `model` (a folder)."""

    method: str
    num_speculative_tokens: int = DEFAULT_NUM_TOKENS
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """From a JSON object (text or dict); None when `value` is None. ValueError naming the
        key that is wrong."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError('speculative_config must be a JSON object such as {"method": '
                             '"ngram", "num_speculative_tokens": 3}')  # fmt: skip
        if value.get("method") not in _METHODS:
            raise ValueError(f"speculative_config method {value.get('method')!r} is not "
                             f"supported: give one of {', '.join(_METHODS)}")  # fmt: skip
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "model"}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"speculative_config has unsupported keys {unknown}: give "
                             f"{', '.join(sorted(known))}")  # fmt: skip
        config = cls(**value)
        if (config.method == "eagle3") != isinstance(config.model, str):
            raise ValueError('speculative_config needs "model" (the draft\'s folder) with method '
                             '"eagle3", and only then')  # fmt: skip
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1)):
            v = getattr(config, name)
            if not (isinstance(v, int) and v >= low):
                raise ValueError(f"speculative_config {name}={v!r} is invalid: an int >= {low}")
        lmax = config.prompt_lookup_max
        if not (isinstance(lmax, int) and lmax >= config.prompt_lookup_min):
            raise ValueError(f"speculative_config prompt_lookup_max={lmax!r} is invalid: an "
                             "int >= prompt_lookup_min")  # fmt: skip
        return config


class Proposer(Protocol):
    """Drafts the tokens likely to follow a sequence's known tokens (at most `limit`)."""

    def propose(self, token_ids: list[int], num_prompt: int, limit: int) -> list[int]: ...


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
    last n tokens (n from prompt_lookup_max down to prompt_lookup_min). No model, no GPU."""

    def __init__(self, n_max: int, n_min: int) -> None:
        self.n_max, self.n_min = n_max, n_min

    def propose(self, token_ids: list[int], num_prompt: int, limit: int) -> list[int]:
        if limit <= 0 or len(token_ids) < 2:
            return []
        hay = array("i", token_ids[:-1]).tobytes()  # C-speed search; the tail excluded
        for n in range(min(self.n_max, len(token_ids) - 1), self.n_min - 1, -1):
            needle = array("i", token_ids[-n:]).tobytes()
            end = len(hay)
            while (at := hay.rfind(needle, 0, end)) >= 0:
                if at % 4 == 0:  # aligned on a token
                    start = at // 4 + n
                    return token_ids[start : start + limit]
                end = at + len(needle) - 1
        return []


def make_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The host-side proposer; None for a draft model, which the executor runs."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
    return None


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request's tokens can be drafted (see the module docstring)."""
    return (
        params.seed is None
        and not params.needs_output_ids
        and params.logprobs is None
        and params.min_tokens == 0
        and params.structured_outputs is None
    )


def verify(logits: Tensor, batch: SamplingBatch, drafts: Tensor) -> tuple[Tensor, Tensor]:
    """Per scored row: the token to emit if the run of drafts stops at this row, and whether the
    row's draft (the next query token, `drafts[r]`, -1 for a sequence's last row) is accepted.
    A sequence emits its accepted drafts, then the token of its first rejected row (or of its
    last row when all are accepted)."""
    x = scores(logits, batch)
    has = drafts >= 0
    d = drafts.clamp_min(0)[:, None]
    if batch.all_greedy:
        tokens = x.argmax(-1)
        return tokens, has & (tokens == drafts)
    greedy = x.argmax(-1)
    p_draft = x.softmax(-1).gather(-1, d).squeeze(-1)
    accept = torch.rand_like(p_draft) < p_draft
    # the residual distribution after a rejection: p without the draft, renormalised
    recovered = race(x.scatter(-1, d, torch.where(has[:, None], float("-inf"), x.gather(-1, d))),
                     batch)  # fmt: skip
    if batch.greedy is not None:
        accept = torch.where(batch.greedy, greedy == drafts, accept)
        recovered = torch.where(batch.greedy, greedy, recovered)
    return recovered, has & accept
