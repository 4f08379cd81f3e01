"""OpenAI request bodies in, validated engine prompts and `SamplingParams` out.

Everything a request can get wrong is found here, before anything reaches the engine, so a bad
request is a 400 naming the field (SamplingParams' own messages) and never an engine error.
Unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tinyoss import harmony
from tinyoss.engine.core import EngineInfo
from tinyoss.sampling_params import SamplingParams
from tinyoss.tokenizer import Tokenizer

_SAMPLING = ("n", "temperature", "top_p", "top_k", "min_p", "seed")  # passed on as they are
_SAMPLING += ("presence_penalty", "frequency_penalty", "repetition_penalty")
_SAMPLING += ("ignore_eos", "min_tokens")  # vLLM's extensions
_EFFORTS = ("low", "medium", "high")


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


@dataclass
class Prepared:
    """One API request made ready: each prompt runs as one engine request with `params`."""

    prompts: list[list[int]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: list[str] | None = None  # completions: text put before each prompt's choices
    content_stop: list[str] = field(default_factory=list)  # chat: stop strings, on the answer


def parse_chat(body: dict, tokenizer: Tokenizer, info: EngineInfo) -> Prepared:
    messages = body.get("messages")
    ok = isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)
    _require(ok, "messages", "messages must be a non-empty list of message objects")
    tools = body.get("tools") or []
    ok = isinstance(tools, list) and all(_function_name(t) for t in tools)
    _require(ok, "tools", 'tools must be a list of {"type": "function", "function": {"name": N}}')
    choice = body.get("tool_choice")
    named = isinstance(choice, dict) and _function_name(choice) in map(_function_name, tools)
    _require(
        choice in (None, "auto", "none", "required") or named,
        "tool_choice",
        f"tool_choice={choice!r} is invalid: must be 'auto', 'none', 'required' or "
        '{"type": "function", "function": {"name": N}} naming one of the tools',
    )
    effort = body.get("reasoning_effort") or "medium"
    _require(
        effort in _EFFORTS,
        "reasoning_effort",
        f"reasoning_effort={effort!r} is invalid: must be one of {', '.join(_EFFORTS)}",
    )
    try:
        options = {"tools": tools, "tool_choice": choice or "auto", "reasoning_effort": effort}
        ids = harmony.render_prompt(messages, tokenizer.encode, **options)
    except KeyError as e:
        raise APIError(400, f"invalid messages: missing field {e}", param="messages") from e
    except (ValueError, TypeError, AttributeError) as e:
        raise APIError(400, f"invalid messages: {e}", param="messages") from e
    logprobs, top = _flag(body, "logprobs"), body.get("top_logprobs")
    _require(top is None or logprobs, "top_logprobs", "top_logprobs needs logprobs: true")
    max_tokens = body.get("max_completion_tokens")
    params = _sampling(
        body,
        max_tokens=body.get("max_tokens") if max_tokens is None else max_tokens,
        logprobs=(top or 0) if logprobs else None,
        stop=body.get("stop"),
    )
    stops, params.stop = params.stop, []
    _check_length(len(ids), params.max_tokens, info.max_model_len, "messages")
    return Prepared([ids], params, *_streaming(body), content_stop=stops)


def parse_completion(body: dict, tokenizer: Tokenizer, info: EngineInfo) -> Prepared:
    _require(not body.get("suffix"), "suffix", "suffix is not supported: gpt-oss has no FIM mode")
    echo = _flag(body, "echo")
    _require(
        not echo or body.get("logprobs") is None, "echo", "echo with logprobs is not supported"
    )
    max_tokens = body.get("max_tokens")
    params = _sampling(
        body,
        max_tokens=16 if max_tokens is None else max_tokens,
        logprobs=body.get("logprobs"),
        stop=body.get("stop"),
    )
    best_of = body.get("best_of")
    _require(
        best_of in (None, params.n),
        "best_of",
        f"best_of={best_of!r} is not supported: only best_of equal to n",
    )
    texts, prompts = [], []
    for p in _prompt_list(body.get("prompt")):
        ids = tokenizer.encode(p) if isinstance(p, str) else p
        _require(ids, "prompt", "prompt is empty: give at least one token")
        if min(ids) < 0 or max(ids) >= info.vocab_size:
            bad = next(t for t in ids if not 0 <= t < info.vocab_size)
            _require(False, "prompt", f"prompt token id [{bad}] is outside the vocabulary")
        _check_length(len(ids), params.max_tokens, info.max_model_len, "prompt")
        prompts.append(ids)
        if echo:
            texts.append(p if isinstance(p, str) else tokenizer.decode(p))
    return Prepared(prompts, params, *_streaming(body), echo=texts if echo else None)


def _require(ok: object, param: str, message: str) -> None:
    if not ok:
        raise APIError(400, message, param=param)


def _function_name(tool: Any) -> str | None:
    fn = tool.get("function") if isinstance(tool, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) and name else None


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    _require(value is None or isinstance(value, bool), name, f"{name}={value!r}: must be a bool")
    return bool(value)


def _streaming(body: dict) -> tuple[bool, bool]:
    options = body.get("stream_options") or {}
    _require(isinstance(options, dict), "stream_options", "stream_options must be an object")
    stream = _flag(body, "stream")
    return stream, stream and _flag(options, "include_usage")


def _sampling(body: dict, **fields: Any) -> SamplingParams:
    kwargs = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
    try:
        return SamplingParams(**kwargs, **fields)
    except ValueError as e:
        name = str(e).split("=", 1)[0]
        raise APIError(400, str(e), param=name if name.isidentifier() else None) from e


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and set(map(type, value)) == {int}  # C loops: the per-token path of every request
    )


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    ok = (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, str) or _is_ids(p) for p in prompt)
    )
    _require(ok, "prompt", "prompt must be a string or token ids, or a list of them")
    return prompt


def _check_length(num_prompt: int, max_tokens: int | None, max_model_len: int, what: str) -> None:
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    if num_prompt >= max_model_len:
        raise APIError(
            400,
            f"{head}your {what} resulted in {num_prompt} tokens, which leaves no room for the "
            f"completion. Please reduce the length of the {what}.",
            param=what,
            code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise APIError(
            400,
            f"{head}you requested {num_prompt + max_tokens} tokens ({num_prompt} in the {what}, "
            f"{max_tokens} in the completion). Please reduce the length of the {what} or "
            "completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
