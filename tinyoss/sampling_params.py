"""Per-request sampling parameters (the vLLM / OpenAI surface).

Everything is validated here, once per request, so the batched sampler never has to check values
on the hot path and a bad request fails with a message that names the field.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

GREEDY_EPS = 1e-5  # temperatures below this sample greedily (as vLLM): x / T would overflow
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1  # what torch.Generator.manual_seed accepts, with room


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class ParamError(ValueError):
    """A value of field `name` that is refused: it must be `allowed` (or None, where
    `optional`). The message is in Python's words; the server words its own from the fields
    (a JSON client's null is the field left out, which gets its default)."""

    def __init__(self, name: str, value: object, allowed: str, optional: bool = False) -> None:
        self.name, self.value, self.allowed, self.optional = name, value, allowed, optional
        shown = repr(value)  # clipped: a 4,300-digit seed came back whole
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        super().__init__(f"{name}={shown} is invalid: must be "
                         f"{'None or ' if optional else ''}{allowed}")


def _check(name: str, value: object, ok: bool, allowed: str, optional: bool = False) -> None:
    if not ok:
        raise ParamError(name, value, allowed, optional)


@dataclass
class StructuredOutputs:
    """A grammar the output must follow (vLLM's `StructuredOutputsParams`): exactly one of a
    JSON schema (`json`, a dict or its text), any JSON object (`json_object`), a `regex`, a
    `choice` of strings, or a Lark `grammar` (llguidance's dialect: special tokens as
    `<|name|>`, `%json {schema}` blocks). The engine enforces it token by token
    (`engine/grammar.py`)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:  # (named, not shown: the whole object is no help)
            kinds = "json, json_object, regex, choice or grammar"
            raise ValueError(f"{' and '.join(given)} are given: give exactly one of {kinds}"
                             if given else f"none of {kinds} is given: give exactly one")
        _check("json", self.json, self.json is None or isinstance(self.json, (dict, str)),
               "a JSON schema (a dict, or its JSON text)")  # fmt: skip
        _check("json_object", self.json_object, isinstance(self.json_object, bool), "a bool")
        for name in ("regex", "grammar"):
            x = getattr(self, name)
            _check(name, x, x is None or isinstance(x, str) and x != "", "a non-empty string")
        c = self.choice
        _check("choice", c, c is None or isinstance(c, (list, tuple)) and bool(c)
               and all(isinstance(x, str) for x in c), "a non-empty list of strings")  # fmt: skip

    @property
    def kind(self) -> str:
        """What the constraint is, for messages: "JSON schema", "regex", ..."""
        if self.json is not None:
            return "JSON schema"
        return "JSON object" if self.json_object else "choice" if self.choice else (
            "regex" if self.regex is not None else "grammar")  # fmt: skip


@dataclass
class SamplingParams:
    """Checked on construction; `dataclasses.replace(p)` checks a copy again (the normalisation
    below is idempotent), which is how `LLM` catches fields changed after construction."""

    n: int = 1
    best_of: int | None = None  # vLLM's: only None or n (the n samples are the answer)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None  # -1: None, as vLLM's (the usual "no seed", which had seeded -1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to the context limit (the engine resolves it)
    min_tokens: int = 0  # end and stop tokens held back until then, unless a grammar has ended
    logprobs: int | None = None  # top logprobs per sampled token; 0 = only the sampled token's
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    cache_salt: str | None = None  # vLLM's: prompts of other salts share no prefix-cache block
    logit_bias: dict[int, float] | None = None  # OpenAI's: added to a token's logit, [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be sampled
    bad_words: list[str] | None = None  # vLLM's: words never generated (as vLLM tokenizes them)
    # their token ids, filled from bad_words by the front end (`bad_words_ids`) for the sampler
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's: only the prompt's last k tokens are used (-1: as many as leave room for max_tokens,
    # or for one token without it); None: a prompt too long for the context is refused
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        v = self
        _check("n", v.n, _is_int(v.n) and v.n >= 1, "an int >= 1")
        _check("best_of", v.best_of, v.best_of is None or _is_int(v.best_of) and v.best_of == v.n,
               f"n ({v.n}): tinyoss returns every sample, so best_of above n is not "
               "supported", optional=True)
        _check(
            "temperature",
            v.temperature,
            _is_real(v.temperature) and v.temperature >= 0,
            "a finite number >= 0 (0 = greedy)",
        )
        # [0, 1] as OpenAI's (vLLM refuses 0): 0 keeps only the most likely token
        _check("top_p", v.top_p, _is_real(v.top_p) and 0 <= v.top_p <= 1, "a number in [0, 1]")
        _check("top_k", v.top_k, _is_int(v.top_k) and v.top_k >= -1, "an int >= -1 (0 or -1 = off)")
        _check("min_p", v.min_p, _is_real(v.min_p) and 0 <= v.min_p <= 1, "a number in [0, 1]")
        if v.seed == -1 and _is_int(v.seed):
            self.seed = None
        seed_ok = v.seed is None or _is_int(v.seed) and _SEED_MIN <= v.seed <= _SEED_MAX
        _check("seed", v.seed, seed_ok, f"an int in [{_SEED_MIN}, {_SEED_MAX}]", optional=True)
        for name in ("presence_penalty", "frequency_penalty"):
            x = getattr(v, name)
            _check(name, x, _is_real(x) and -2 <= x <= 2, "a number in [-2, 2]")
        _check(
            "repetition_penalty",
            v.repetition_penalty,
            _is_real(v.repetition_penalty) and v.repetition_penalty > 0,
            "a finite number > 0",
        )
        stop = [v.stop] if isinstance(v.stop, str) else v.stop
        _check(
            "stop",
            v.stop,
            stop is None
            or isinstance(stop, (list, tuple))
            and all(isinstance(s, str) and s for s in stop),
            "a non-empty string or a list of them",
            optional=True,
        )
        ids = v.stop_token_ids
        _check(
            "stop_token_ids",
            ids,
            ids is None
            or isinstance(ids, (list, tuple))
            and all(_is_int(i) and i >= 0 for i in ids),
            "a list of ints >= 0",
            optional=True,
        )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check(name, getattr(v, name), isinstance(getattr(v, name), bool), "a bool")
        _check(
            "max_tokens",
            v.max_tokens,
            v.max_tokens is None or _is_int(v.max_tokens) and v.max_tokens >= 1,
            "an int >= 1",
            optional=True,
        )
        _check(
            "min_tokens", v.min_tokens, _is_int(v.min_tokens) and v.min_tokens >= 0, "an int >= 0"
        )
        _check(
            "min_tokens",
            v.min_tokens,
            v.max_tokens is None or v.min_tokens <= v.max_tokens,
            f"<= max_tokens ({v.max_tokens})",
        )
        for name in ("logprobs", "prompt_logprobs"):
            x = getattr(v, name)
            _check(
                name,
                x,
                x is None or _is_int(x) and 0 <= x <= MAX_LOGPROBS,
                f"an int in [0, {MAX_LOGPROBS}]",
                optional=True,
            )
        so = v.structured_outputs
        _check(
            "structured_outputs",
            so,
            so is None or isinstance(so, StructuredOutputs),
            "a StructuredOutputs",
            optional=True,
        )
        salt = v.cache_salt
        _check("cache_salt", salt, salt is None or isinstance(salt, str) and salt != "",
               "a non-empty string", optional=True)
        bias = v.logit_bias
        _check("logit_bias", bias, bias is None or isinstance(bias, dict) and all(
            _is_int(t) and t >= 0 and _is_real(b) and -100 <= b <= 100 for t, b in bias.items()),
            "a dict of token ids (ints >= 0) to numbers in [-100, 100]", optional=True)
        allowed = v.allowed_token_ids
        _check("allowed_token_ids", allowed, allowed is None or isinstance(allowed, (list, tuple))
               and bool(allowed) and all(_is_int(t) and t >= 0 for t in allowed),
               "a non-empty list of token ids (ints >= 0)", optional=True)
        _check("allowed_token_ids", allowed, allowed is None or so is None,
               "None with a structured output (structured_outputs, response_format or a "
               "forced tool call), whose grammar says which tokens may come", optional=True)
        words = v.bad_words
        _check("bad_words", words, words is None or isinstance(words, (list, tuple))
               and all(isinstance(w, str) and w.strip() for w in words),
               "a list of words (non-blank strings)", optional=True)
        seqs = v.bad_words_token_ids
        _check("bad_words_token_ids", seqs, seqs is None or isinstance(seqs, (list, tuple))
               and all(isinstance(q, (list, tuple)) and q and all(_is_int(t) and t >= 0 for t in q)
                       for q in seqs), "a list of non-empty lists of token ids", optional=True)
        keep = v.truncate_prompt_tokens
        _check("truncate_prompt_tokens", keep, keep is None or _is_int(keep) and (keep >= 1
               or keep == -1), "an int >= 1 (the prompt's last tokens kept), or -1 (as many as "
               "fit the context with max_tokens)", optional=True)
        self.bad_words = None if words is None else list(words)
        self.bad_words_token_ids = None if seqs is None else [list(q) for q in seqs]
        self.logit_bias = None if bias is None else {t: float(b) for t, b in bias.items()}
        self.allowed_token_ids = None if allowed is None else list(allowed)
        self.stop = list(stop or ())
        self.stop_token_ids = list(ids or ())
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            setattr(self, name, float(getattr(self, name)))

    def clone(self) -> SamplingParams:
        """A deep copy, as vLLM's `clone` (its lists and structured outputs are its own)."""
        return copy.deepcopy(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def needs_output_ids(self) -> bool:
        """Whether the sampler reads this request's generated tokens: penalties, or a bad word
        of several tokens (banned after its first ones)."""
        return self.needs_penalties or any(len(q) > 1 for q in self.bad_words_token_ids or ())

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


def bad_words_ids(params: SamplingParams, encode) -> SamplingParams:
    """`params` with `bad_words_token_ids` filled from `bad_words` by `encode` (text -> ids), as
    vLLM does: each word without its leading blanks, and after one space (the same word in the
    middle of a text), where that tokenizes differently in as many tokens."""
    if not params.bad_words:
        return params
    seqs: list[list[int]] = []
    for word in params.bad_words:
        bare = encode(word.lstrip())
        spaced = encode(" " + word.lstrip())
        seqs += [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
    return replace(params, bad_words_token_ids=[*(params.bad_words_token_ids or ()), *seqs])
