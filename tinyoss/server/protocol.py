"""OpenAI request bodies in, validated engine prompts and `SamplingParams` out.

Everything a request can get wrong is found here, before anything reaches the engine, so a bad
request is a 400 naming the field and never an engine error. Types are checked first, by the
pydantic models of `schemas.py` (`validate`: the error names the field's path); what values
mean is checked after, where they are used (SamplingParams' ranges, harmony's rules for
messages, the grammar's for schemas). Unknown fields are ignored, as OpenAI-compatible servers
do (and logged, as vLLM logs them: `note_ignored`), but fields whose meaning tinyoss does not
implement are refused by name (`_UNSUPPORTED`): a client must never get a 200 for something it
asked for and did not get. `response_format`,
vLLM's `structured_outputs`, `tool_choice` "required" or named, and `thinking_token_budget`
become one grammar over the reply (`harmony_grammar.py`); on /v1/completions the grammar is the
raw text's.

Parsing is two steps. `parse_chat` / `parse_completion` check the body and render each prompt
to segments (special ids and text) at string speed; `tokenize` then encodes the text in pieces,
yielding to the event loop between them, and stops as soon as a prompt is longer than the
context: a 10 MB prompt costs neither the loop nor the CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tinyoss import harmony
from tinyoss.engine.core import EngineInfo, truncate_prompt
from tinyoss.engine.grammar import check as check_grammar
from tinyoss.harmony_grammar import ConstraintError, answer_constraint, chat_constraint
from tinyoss.sampling_params import ParamError, SamplingParams
from tinyoss.server.schemas import (
    ChatCompletionRequest,
    ChatInput,
    CompletionRequest,
    DetokenizeRequest,
    ResponseFormatJsonSchema,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from tinyoss.tokenizer import Tokenizer

_SAMPLING = ("n", "temperature", "top_p", "top_k", "min_p", "seed")  # passed on as they are
_SAMPLING += ("presence_penalty", "frequency_penalty", "repetition_penalty")
_SAMPLING += ("ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output")
_SAMPLING += ("skip_special_tokens", "cache_salt")  # the last six: vLLM's extensions
_SAMPLING += ("bad_words", "truncate_prompt_tokens")  # vLLM's too
log = logging.getLogger("tinyoss.server")
MAX_TOKEN_CHARS = 128  # the longest o200k token: a text needs at least len / 128 tokens
MAX_REQUEST_ID_CHARS = 256  # of a body's request_id, which names the answer (chatcmpl-<id>)
_REQUEST_ID = re.compile(rf"[\x20-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")  # printable ASCII
_MESSAGE_TOKENS = 4  # the fewest tokens a message renders to: <|start|>role<|message|><|end|>
_PROBE_CHARS = 1 << 19  # of a longer uncut text, encoded first (~1 s): refused if it is too long
_CUT_SLACK = 64  # tokens a head encoded alone may have more than in the whole text (its cut)
_PIECE_CHARS = 1 << 15  # text encoded between two yields to the event loop (a few ms)

# Fields with a meaning tinyoss does not implement: refused, never ignored. `None` and the
# listed values, which ask for nothing, pass (`web_search_options: {}` asks for a search).
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "logit_bias": (({},), "the Responses API takes none (chat completions and completions do)"),
    "functions": (([],), "`tools` replaced it"),
    "function_call": (("none",), "`tool_choice` replaced it"),
    "audio": (({},), "gpt-oss reads and writes text"),
    "modalities": ((["text"],), "gpt-oss reads and writes text only"),
    "prediction": (({},), "tinyoss takes no predicted outputs (its speculative decoding "
                          "drafts its own)"),
    "web_search_options": ((), "tinyoss runs no web search"),
    "verbosity": (("medium",), "gpt-oss has no verbosity control (give 'medium', or ask for "
                               "brevity in the messages)"),
    "prompt_logprobs": ((), "the Responses API takes none (vLLM's field of chat completions "
                            "and completions, which take it)"),
    **{f"guided_{kind}": ((), "vLLM's guided_* fields are gone: give structured_outputs (json, "
                              "regex, choice, grammar) or response_format")
       for kind in ("json", "regex", "choice", "grammar", "decoding_backend",
                    "options_request")},
    "guided_whitespace_pattern": ((), "vLLM's guided_* fields are gone, and tinyoss takes no "
                                      "whitespace pattern: its JSON has one space after ',' and "
                                      "':' and no other whitespace"),
    # vLLM's sampling and output fields
    "bad_words": (([],), "the Responses API takes none (chat completions and completions do)"),
    "allowed_token_ids": ((), "the Responses API takes none (vLLM's field of chat completions "
                              "and completions, which take it)"),
    "truncate_prompt_tokens": ((), "the Responses API takes none (vLLM's field of chat "
                                   "completions and completions, which take it)"),
    "use_beam_search": ((False,), "tinyoss has no beam search: n samples choices "
                                  "independently"),
    "priority": ((0,), "tinyoss schedules first come, first served, as vLLM does without "
                       "--scheduling-policy priority: only 0 is taken"),
    "logits_processors": (([],), "tinyoss runs no custom logits processors"),
    "return_tokens_as_token_ids": ((False,), "the Responses API takes none (chat completions "
                                             "and completions do)"),
    "structural_tag": ((), "tinyoss enforces no structural tags: give structured_outputs or "
                           "response_format"),
    # chat only: its text is the harmony parser's, its prompt harmony's
    "skip_special_tokens": ((True,), "chat parses the special tokens into reasoning, content "
                                     "and tool calls; /v1/completions returns them as text"),
    "chat_template": ((), "tinyoss renders gpt-oss's harmony format itself"),
    "add_generation_prompt": ((True,), "the Responses API takes none (chat completions and "
                                       "/tokenize do)"),
    "continue_final_message": ((False,), "the Responses API takes none (chat completions and "
                                         "/tokenize do)"),
    "echo": ((False,), "a chat reply never repeats the last message (/v1/completions echoes "
                       "the prompt)"),
    "documents": (([],), "gpt-oss's chat template reads no documents: put their text in a "
                         "message"),
}  # fmt: skip
_VLLM_SAMPLING = ("use_beam_search", "logits_processors", "structural_tag", "priority")
_COMPLETION_UNSUPPORTED = (*_VLLM_SAMPLING,
                           *(name for name in _UNSUPPORTED if name.startswith("guided_")))
# chat and completions take them
_TOKEN_FIELDS = ("logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
                 "prompt_logprobs", "return_tokens_as_token_ids")
_ENDING_FIELDS = ("add_generation_prompt", "continue_final_message")  # chat and /tokenize
_CHAT_UNSUPPORTED = tuple(name for name in _UNSUPPORTED
                          if name not in _TOKEN_FIELDS + _ENDING_FIELDS)
# What a pydantic error type says a value must be (the rest: pydantic's own words).
_MUST = {
    "either": "{expected}",
    "literal_error": "one of {expected}",
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "a boolean (true or false)",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "greater_than_equal": ">= {ge}",
    "less_than_equal": "<= {le}",
    "too_short": "a list of at least {min_length} items",
    "string_too_short": "a string of at least {min_length} characters",
    "empty_too_short": "a non-empty list",  # min_length 1
    "empty_string_too_short": "a non-empty string",
}
Model = TypeVar("Model", bound=BaseModel)


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"  # as OpenAI's
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


@dataclass
class Prepared:
    """One API request made ready: each prompt runs as one engine request with `params`.
    `sources` are the prompts as segments (special ids and text); `tokenize` fills `prompts`."""

    sources: list[list[harmony.Segment]]
    what: str  # the field a prompt comes from: "messages" or "prompt"
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # the usage so far on every chunk
    echo: list[str] | None = None  # completions: text put before each prompt's choices
    echo_scores: bool = False  # the prompt logprobs are echo's with logprobs, not prompt_logprobs
    # completions' echo with max_tokens 0: the prompt alone, as OpenAI's API and vLLM give it
    # (the engine samples one token, which the answer leaves out)
    prompt_only: bool = False
    return_token_ids: bool = False  # answer with the prompts' and the choices' token ids
    # vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:<id>", not by its
    # text, which may be part of a character or another token's text too
    tokens_as_ids: bool = False
    content_stop: list[str] = field(default_factory=list)  # chat: stop strings, on the answer
    content_stop_kept: bool = False  # chat: the answer keeps the stop string that ended it
    reasoning: bool = True  # chat: the answer carries the reasoning (vLLM's include_reasoning)
    # a raw prompt's text names special tokens ("<|start|>"), read as those tokens as vLLM
    # reads them; chat text never does
    special_names: bool = False
    prompts: list[list[int]] = field(default_factory=list)
    max_tokens_field: str = "max_tokens"  # as the client spelled it (max_completion_tokens)
    # chat: said after a context-length refusal, where tools or a schema are in the prompt too
    length_note: str = ""
    # chat: the channel of the assistant message the prompt leaves open (continue_final_message),
    # whose text the reply goes on with
    channel: str | None = None
    # the end truncate_prompt_tokens cuts (vLLM's truncation_side): "left" keeps the last tokens
    truncation_side: str = "left"
    # vLLM's request_id: the id the answer shows (after chatcmpl- or cmpl-), unless the
    # X-Request-Id header gives one; never the engine's key, which stays unique
    request_id: str | None = None
    # the field whose constraint made the grammar, named by a grammar that fails only once the
    # engine follows it (a schema no value can satisfy, found expanding it)
    grammar_field: str | None = None


def parse_chat(body: dict, info: EngineInfo) -> Prepared:
    """A chat body as one engine request. The model checks the types; the renderer and the
    grammar then take the JSON's own dicts (strict validation changes no value), and
    SamplingParams the numbers as sent (its messages quote them: temperature=-1, not -1.0)."""
    messages = body.get("messages")
    if (isinstance(messages, list) and len(messages) * _MESSAGE_TOKENS > info.max_model_len
            and not _truncates(body)):
        # refused before validating them all (400,000 messages: seconds, holding the GIL)
        if (least := _least_tokens(messages)) > info.max_model_len:
            _too_long(f"at least {least}", info.max_model_len, "messages")
    req = validate(ChatCompletionRequest, body)
    refuse_unsupported(body, _CHAT_UNSUPPORTED)
    segments = _render_chat(req, body)
    needs = "top_logprobs needs logprobs: true"
    _require(req.top_logprobs is None or req.logprobs, "top_logprobs", needs)
    budget = req.thinking_token_budget
    _require(budget is None or budget <= info.max_model_len, "thinking_token_budget",
             f"thinking_token_budget={budget} is more than max_model_len "
             f"({info.max_model_len}) tokens")
    try:
        grammar = chat_constraint(
            answer_constraint(body.get("response_format"), body.get("structured_outputs")),
            tools=body.get("tools"),
            tool_choice=body.get("tool_choice") or req.tool_choice,
            thinking_token_budget=req.thinking_token_budget,
            answer_from="structured_outputs" if "structured_outputs" in body else "response_format",
        )
    except ConstraintError as e:
        raise APIError(400, str(e), param=e.param) from e
    add_generation_prompt, continued = _ending(body)
    if grammar is not None and not add_generation_prompt:
        param = _constraint_field(body)
        how = ("continue_final_message: true (the reply goes on inside the last message)"
               if continued else "add_generation_prompt: false (the model writes the reply's "
               "header itself)")
        _require(False, param, f"{param} cannot be enforced with {how}: its grammar is of a "
                               "reply that starts a new assistant message; leave one of them out")
    max_tokens = req.max_completion_tokens
    params = _sampling(
        body,
        info.vocab_size,
        # an error names the field the client gave
        spelled={} if max_tokens is None else {"max_tokens": "max_completion_tokens"},
        max_tokens=req.max_tokens if max_tokens is None else max_tokens,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        prompt_logprobs=_prompt_logprobs(req),
        stop=req.stop,
        structured_outputs=grammar,
    )
    if not params.ignore_eos:  # whatever the checkpoint's generation_config.json lists
        params.stop_token_ids += [t for t in harmony.STOP_TOKENS if t not in params.stop_token_ids]
    stops, params.stop = params.stop, []
    carried = [name for name, given in (("the tools' definitions", req.tools),
                                        ("the response format's schema",
                                         getattr(req.response_format, "type", None)
                                         == "json_schema")) if given]
    note = (f" The prompt carries {' and '.join(carried)} as well as the messages."
            if carried else "")
    if not _truncates(body):
        with _noted(note):
            _check_chars([segments], info.max_model_len, "messages")
    note_ignored(req, "/v1/chat/completions")
    return Prepared([segments], "messages", params, *_streaming(req), content_stop=stops,
                    length_note=note,
                    grammar_field=None if grammar is None else _constraint_field(body),
                    channel=harmony.continued_channel(body["messages"]) if continued else None,
                    content_stop_kept=params.include_stop_str_in_output,
                    truncation_side=req.truncation_side or "left",
                    request_id=_request_id(req.request_id),
                    return_token_ids=bool(req.return_token_ids), reasoning=req.include_reasoning,
                    tokens_as_ids=bool(req.return_tokens_as_token_ids),
                    max_tokens_field="max_tokens" if max_tokens is None
                    else "max_completion_tokens")


def _path_in(message: str, field: str) -> str:
    """The path a check's message starts with (`messages[0].content[1]`), where it names a
    place inside `field`; else `field`."""
    path = _PATH.match(message)
    return path.group(0) if path and path.group(0).startswith(field) else field


_PATH = re.compile(r"[a-z_]+(?:\[\d+\]|\.[a-z_]+)*")


def _render_chat(req: ChatInput, body: dict) -> list[harmony.Segment]:
    """The chat body's messages (with its tools, tool_choice, reasoning_effort and
    chat_template_kwargs) rendered to harmony segments: the one path of /v1/chat/completions
    and /tokenize. `req` has checked the types; harmony's checks (shared with the offline
    `LLM`) are what roles may hold."""
    messages, tools = body["messages"], body.get("tools") or []
    choice = body.get("tool_choice") or req.tool_choice  # the JSON's, or the default
    for param, check in (
        ("messages", lambda: harmony.check_messages(messages)),
        ("tools", lambda: harmony.check_tools(tools)),
        ("tool_choice", lambda: harmony.check_tool_choice(choice, tools)),
    ):
        try:
            check()
        except ValueError as e:
            raise APIError(400, str(e), param=_path_in(str(e), param)) from e
    for i, m in enumerate(messages):  # OpenAI's rule; harmony (offline chat) takes a name too
        at = f"messages[{i}].tool_call_id"
        _require(m["role"] != "tool" or m.get("tool_call_id") is not None, at,
                 f"{at} is required: a tool message answers the assistant's tool call of that id")
    add_generation_prompt, continued = _ending(body)
    options = {"tools": tools, "tool_choice": choice, **_template_options(req, body),
               "add_generation_prompt": add_generation_prompt,
               "continue_final_message": continued}
    if isinstance(req.response_format, ResponseFormatJsonSchema):
        options["response_format"] = body["response_format"]["json_schema"]
    try:
        segments = harmony.render_segments(messages, **options)
    except RecursionError as e:
        raise APIError(400, "the tool schemas are nested too deeply", param="tools") from e
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise APIError(400, f"invalid messages: {e}", param=_path_in(str(e), "messages")) from e
    return segments


def _ending(body: dict) -> tuple[bool, bool]:
    """add_generation_prompt and continue_final_message, read as vLLM reads them: both sent
    true is a 400 (its validator's words); continue_final_message true with
    add_generation_prompt left out takes that as false, since the prompt cannot do both."""
    continued = body.get("continue_final_message") is True
    given = body.get("add_generation_prompt")
    _require(not (continued and given), "continue_final_message", harmony.BOTH_ENDINGS)
    return (not continued) if given is None else given, continued


def _constraint_field(body: dict) -> str:
    """The field whose constraint made a chat request's grammar."""
    if body.get("structured_outputs") is not None:
        return "structured_outputs"
    if (body.get("response_format") or {}).get("type") in ("json_object", "json_schema"):
        return "response_format"
    choice = body.get("tool_choice")
    return "tool_choice" if choice == "required" or isinstance(choice, dict) else (
        "thinking_token_budget")


_TEMPLATE_HINTS = {"enable_thinking": "gpt-oss always reasons: lower reasoning_effort, or set "
                                      "thinking_token_budget (0: no reasoning)"}


def _template_options(req: ChatInput, body: dict) -> dict[str, Any]:
    """Harmony's options from reasoning_effort and vLLM's chat_template_kwargs, where vLLM users
    set gpt-oss's reasoning_effort. A key gpt-oss's template does not read would go unread: a
    400 naming it."""
    options: dict[str, Any] = {"reasoning_effort": req.reasoning_effort}
    kwargs = req.chat_template_kwargs
    if kwargs is None:
        return options
    for key, value in (kwargs.model_extra or {}).items():
        where = f"chat_template_kwargs.{key[:64]}"
        hint = _TEMPLATE_HINTS.get(key) or (
            f"give the top-level {key}" if key in type(req).model_fields
            else "it reads reasoning_effort, model_identity and builtin_tools")  # fmt: skip
        _require(value is None, where, f"{where} is not read by gpt-oss's chat template: {hint}")
    tools = "chat_template_kwargs.builtin_tools"
    _require(not kwargs.builtin_tools, tools,
             f"{tools}={harmony.short_repr(kwargs.builtin_tools)} is not supported: tinyoss runs "
             "no browser or python tool; offer functions as tools")  # fmt: skip
    effort, top = kwargs.reasoning_effort, body.get("reasoning_effort")
    if effort is not None:
        _require(top in (None, effort), "chat_template_kwargs.reasoning_effort",
                 f"chat_template_kwargs.reasoning_effort={harmony.short_repr(effort)} contradicts "
                 f"reasoning_effort={harmony.short_repr(top)}: give one of them")  # fmt: skip
        options["reasoning_effort"] = effort
    if kwargs.model_identity is not None:
        options["model_identity"] = kwargs.model_identity
    return options


def parse_completion(body: dict, info: EngineInfo) -> Prepared:
    """A completions body: one engine request per prompt (read as parse_chat reads its body)."""
    req = validate(CompletionRequest, body)
    refuse_unsupported(body, _COMPLETION_UNSUPPORTED)
    _require(not req.suffix, "suffix", "suffix is not supported: gpt-oss has no FIM mode")
    try:
        grammar = answer_constraint(body.get("response_format"), body.get("structured_outputs"))
        if grammar is not None:
            check_grammar(grammar)
    except ConstraintError as e:
        raise APIError(400, str(e), param=e.param) from e
    except ValueError as e:
        param = "structured_outputs" if "structured_outputs" in body else "response_format"
        raise APIError(400, f"{param}: {e}", param=param) from e
    _require(req.max_tokens != 0 or req.echo, "max_tokens",
             "max_tokens=0 is taken only with echo: true (the prompt alone, as OpenAI's API "
             "gives it); ask for at least 1 token")
    prompt_only = bool(req.echo) and req.max_tokens == 0
    params = _sampling(
        body,
        info.vocab_size,
        max_tokens=1 if prompt_only else req.max_tokens,
        logprobs=req.logprobs,
        # echo with logprobs: the prompt's too, as vLLM gives them (lm-evaluation-harness)
        prompt_logprobs=_prompt_logprobs(req, req.logprobs if req.echo else None),
        stop=req.stop,
        structured_outputs=grammar,
    )
    _require(
        req.best_of in (None, params.n),
        "best_of",
        f"best_of={req.best_of} is not supported: only best_of equal to n",
    )
    sources: list[list[harmony.Segment]] = []
    for p in prompt_list(req.prompt):
        _require(p, "prompt", "prompt is empty: give at least one token")
        if isinstance(p, list) and (min(p) < 0 or max(p) >= info.vocab_size):
            bad = next(t for t in p if not 0 <= t < info.vocab_size)
            _require(False, "prompt", f"prompt token id [{bad}] is outside the vocabulary")
        sources.append([p] if isinstance(p, str) else p)
    if not _truncates(body):
        _check_chars(sources, info.max_model_len, "prompt")
    texts = [s[0] if isinstance(s[0], str) else None for s in sources] if req.echo else None
    note_ignored(req, "/v1/completions")
    return Prepared(sources, "prompt", params, *_streaming(req), echo=texts,
                    echo_scores=req.prompt_logprobs is None and params.prompt_logprobs is not None,
                    prompt_only=prompt_only, truncation_side=req.truncation_side or "left",
                    grammar_field=None if grammar is None else (
                        "structured_outputs" if body.get("structured_outputs") is not None
                        else "response_format"),
                    request_id=_request_id(req.request_id),
                    return_token_ids=bool(req.return_token_ids), special_names=True,
                    tokens_as_ids=bool(req.return_tokens_as_token_ids))


def parse_tokenize(body: dict, info: EngineInfo) -> tuple[Prepared, bool]:
    """/tokenize's body: {"prompt": text} or {"messages": [...]} (rendered as a chat request
    renders them, so the count is its prompt_tokens); and whether to return token strings."""
    messages = body.get("messages")
    _require(
        body.get("prompt") is None or messages is None,
        "messages",
        "give either prompt (text) or messages (a chat), not both",
    )
    req: TokenizeChatRequest | TokenizeCompletionRequest
    if messages is not None:
        req = validate(TokenizeChatRequest, body)
        refuse_unsupported(body, ("chat_template",))
        segments, what = _render_chat(req, body), "messages"
    else:  # add_special_tokens is checked, and changes nothing: gpt-oss has no BOS or EOS
        req = validate(TokenizeCompletionRequest, body)
        segments, what = [req.prompt], "prompt"
    _check_chars([segments], info.max_model_len, what)
    prep = Prepared([segments], what, SamplingParams(max_tokens=None),
                    special_names=what == "prompt")
    note_ignored(req, "/tokenize")
    return prep, bool(req.return_token_strs)


def parse_detokenize(body: dict, info: EngineInfo) -> list[int]:
    """/detokenize's body: {"tokens": [ids]}, each id in the vocabulary."""
    req = validate(DetokenizeRequest, body)
    tokens = req.tokens
    bad = next((t for t in tokens if not 0 <= t < info.vocab_size), None)
    _require(
        bad is None,
        "tokens",
        f"token id {bad} is outside the vocabulary (0..{info.vocab_size - 1})",
    )
    note_ignored(req, "/detokenize")
    return tokens


def _segments(prep: Prepared, source: list[harmony.Segment],
              tokenizer: Tokenizer) -> Iterator[harmony.Segment]:
    """A prompt's segments, a raw prompt's text split at its special-token names."""
    for segment in source:
        if prep.special_names and isinstance(segment, str):
            yield from tokenizer.split_special(segment)
        else:
            yield segment


async def tokenize(prep: Prepared, tokenizer: Tokenizer, info: EngineInfo) -> None:
    """Encodes `prep`'s prompts into `prep.prompts`, in pieces of a few ms each with the event
    loop running between them; refuses a prompt as soon as it cannot fit the context, unless
    its request truncates it (vLLM's truncate_prompt_tokens: then it is encoded whole, within
    --max-request-bytes, and cut to its last tokens, or its first with truncation_side
    "right")."""
    with _noted(prep.length_note):
        await _tokenize(prep, tokenizer, info)


@contextlib.contextmanager
def _noted(note: str) -> Iterator[None]:
    """A context-length refusal raised inside, with `note` after its message."""
    try:
        yield
    except APIError as e:
        if not note or e.code != "context_length_exceeded":
            raise
        raise APIError(e.status, e.message + note, param=e.param, code=e.code) from None


async def _tokenize(prep: Prepared, tokenizer: Tokenizer, info: EngineInfo) -> None:
    cut = prep.params.truncate_prompt_tokens is not None
    limit = sys.maxsize if cut else info.max_model_len
    for source in prep.sources:
        ids: list[int] = []
        for segment in _segments(prep, source, tokenizer):
            if isinstance(segment, int):
                ids.append(segment)
                continue
            for piece in tokenizer.pieces(segment, _PIECE_CHARS):
                if len(piece) > 2 * _PIECE_CHARS:  # text with no place to cut (digits, CJK,
                    # minified code): seconds for megabytes, in a thread with the GIL released
                    if len(piece) > _PROBE_CHARS:  # first its head: enough to refuse it?
                        head = await asyncio.to_thread(tokenizer.encode_released,
                                                       piece[:_PROBE_CHARS])
                        if len(ids) + len(head) - _CUT_SLACK >= limit:
                            _too_long(f"at least {len(ids) + len(head) - _CUT_SLACK}",
                                      info.max_model_len, prep.what)
                    ids += await asyncio.to_thread(tokenizer.encode_released, piece)
                else:
                    ids += tokenizer.encode(piece)
                if len(ids) >= limit:
                    _too_long(f"at least {len(ids)}", info.max_model_len, prep.what)
                if len(segment) > _PIECE_CHARS:
                    await asyncio.sleep(0)
        if cut:
            try:
                ids = truncate_prompt(ids, prep.params, info.max_model_len,
                                      prep.truncation_side)
            except ValueError as e:
                raise APIError(400, str(e), param="truncate_prompt_tokens") from e
        _check_length(len(ids), prep.params.max_tokens, info.max_model_len, prep.what,
                      prep.max_tokens_field)
        prep.prompts.append(ids)
    if prep.echo is not None:  # what the model read: a cut prompt's kept tokens, as its
        # usage and echo's logprobs (and their text_offsets) count them
        prep.echo = [
            text if text is not None and not cut else tokenizer.decode(ids)
            for text, ids in zip(prep.echo, prep.prompts)
        ]


def validate(model: type[Model], body: dict) -> Model:
    """`body` as `model`, or a 400 naming the first wrong field by its path (messages[0].content)
    in one sentence: what it holds and what it must be."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
    path = path or "the request body"
    if err["type"] == "missing":
        field = model.model_fields.get(path)
        what = field.description if field is not None else None
        hint = f": {what[0].lower()}{what[1:].rstrip('.')}" if what else ""
        raise APIError(400, f"{path} is required{hint}", param=path)
    kind, msg, ctx = err["type"], err["msg"], err.get("ctx", {})
    if kind == "extra_forbidden":  # (a typo, or vLLM's structured_outputs.whitespace_pattern)
        parent, _, name = path.rpartition(".")
        raise APIError(400, f"{path} is not supported: {parent} has no field {name!r}",
                       param=path)
    if kind in ("too_short", "string_too_short") and ctx["min_length"] == 1:
        kind = "empty_" + kind
    must = "must be " + _MUST[kind].format(**ctx) if kind in _MUST else msg
    text = f"{path}={harmony.short_repr(err['input'])} is invalid: {must[0].lower()}{must[1:]}"
    raise APIError(400, text, param=path)


# Unknown top-level fields are logged as vLLM warns of them ("present in the request but
# ignored"): a WARNING the first time a name is seen in this process, DEBUG after, so that a
# client's typo shows once and traffic repeating it cannot flood the log. Names made up by the
# thousand cannot either: at most _MAX_WARNED names are ever warned of, _MAX_LISTED a request,
# each clipped to _MAX_NAME_CHARS.
_MAX_WARNED, _MAX_LISTED, _MAX_NAME_CHARS = 1024, 16, 64
_warned: set[str] = set()
_warned_lock = threading.Lock()  # bodies that can carry a grammar are parsed in worker threads


def note_ignored(req: BaseModel, where: str) -> None:
    """Logs the top-level fields of `req` (a request to `where`) that nothing reads."""
    extra = req.model_extra
    if not extra:
        return
    names = sorted({_field_name(k) for k in extra})
    with _warned_lock:
        room = min(_MAX_LISTED, _MAX_WARNED - len(_warned))
        new = [n for n in names if n not in _warned][:max(0, room)]
        _warned.update(new)
        full = len(_warned) >= _MAX_WARNED
    shown = ", ".join(names)
    if not new:
        log.debug("ignored fields of a request to %s: %s", where, shown)
        return
    rest = f" (and {len(names) - len(new)} more: at DEBUG)" if len(names) > len(new) else ""
    log.warning("ignored fields of a request to %s, which tinyoss does not read: %s%s; each "
                "name is logged once at this level%s", where, ", ".join(new), rest,
                f" (the first {_MAX_WARNED} names: later ones only at DEBUG)" if full else "")
    if rest:
        log.debug("ignored fields of a request to %s: %s", where, shown)


def _field_name(name: str) -> str:
    """A client's field name as the log shows it: quoted, escaped (no line break can forge a
    log line) and clipped."""
    clipped = name if len(name) <= _MAX_NAME_CHARS else name[:_MAX_NAME_CHARS] + "..."
    return ascii(clipped)


def _require(ok: object, param: str, message: str) -> None:
    if not ok:
        raise APIError(400, message, param=param)


def refuse_unsupported(body: dict, names: tuple[str, ...] = tuple(_UNSUPPORTED)) -> None:
    """400 naming the first of `names` whose value asks for something: a harmless value
    matches in JSON's terms, its type too ([] is not {}, false is not 0). /v1/responses reads
    none of them, so it refuses them all."""
    for name in names:
        value = body.get(name)
        harmless, why = _UNSUPPORTED[name]
        _require(
            value is None or any(value == h and type(value) is type(h) for h in harmless),
            name,
            f"{name}={harmony.short_repr(value)} is not supported: {why}; leave the field out",
        )


def _request_id(given: str | None) -> str | None:
    """vLLM's request_id, checked: it goes into the answer's id, chunks and log lines, so it
    is short, printable ASCII text (no line break to forge a log line with)."""
    _require(given is None or _REQUEST_ID.fullmatch(given), "request_id",
             f"request_id={harmony.short_repr(given)} is invalid: must be 1 to "
             f"{MAX_REQUEST_ID_CHARS} printable ASCII characters (the answer's id is "
             "chatcmpl-<request_id>, or cmpl-<request_id> on /v1/completions)")
    return given


def _streaming(req: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool, bool]:
    """stream, include_usage (a last chunk of usage), continuous_usage_stats (usage on every
    chunk: vLLM's, which its benchmarks use to count each chunk's tokens; as in vLLM, only
    with include_usage). As vLLM reads them, stream_options given at all (`{}` too) include
    the usage unless include_usage is false: clients written for vLLM count on that chunk."""
    stream, options = bool(req.stream), req.stream_options
    _require(stream or options is None, "stream_options",
             "stream_options is only allowed with stream: true")
    if options is None:
        return stream, False, False
    return stream, options.include_usage, options.include_usage and options.continuous_usage_stats


MAX_STOPS, MAX_STOP_CHARS = 64, 1024  # each stop string is searched for at every token


def _sampling(body: dict, vocab_size: int, spelled: dict[str, str] | None = None,
              **fields: Any) -> SamplingParams:
    """The body's sampling fields and `fields` as SamplingParams; a refused value is a 400
    naming its field, as the client spelled it (`spelled`: ours -> theirs)."""
    kwargs = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
    stop = fields.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    _require(len(stops) <= MAX_STOPS, "stop",
             f"stop holds {len(stops)} strings: at most {MAX_STOPS} are served")
    _require(all(len(s) <= MAX_STOP_CHARS for s in stops), "stop",
             f"a stop string is longer than {MAX_STOP_CHARS} characters")
    words = body.get("bad_words") or []
    _require(len(words) <= MAX_STOPS * 16, "bad_words",
             f"bad_words holds {len(words)} words: at most {MAX_STOPS * 16} are served")
    _require(all(len(w) <= MAX_STOP_CHARS for w in words), "bad_words",
             f"a bad word is longer than {MAX_STOP_CHARS} characters")
    if body.get("logit_bias"):  # JSON keys are strings: token ids, as OpenAI takes them
        keys = [k for k in body["logit_bias"] if not re.fullmatch(r"0|[1-9][0-9]{0,17}", k)]
        _require(not keys, "logit_bias",
                 f"logit_bias key {harmony.short_repr(keys[0] if keys else '')} is not a token "
                 f"id: its keys are token ids as strings, such as \"1734\"")
        kwargs["logit_bias"] = {int(k): b for k, b in body["logit_bias"].items()}
    if body.get("allowed_token_ids") is not None:
        kwargs["allowed_token_ids"] = body["allowed_token_ids"]
    for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
        bad = [t for t in kwargs.get(name) or () if not 0 <= t < vocab_size]
        _require(not bad, name,
                 f"{name} [{bad[0] if bad else ''}] is outside the vocabulary (0 to "
                 f"{vocab_size - 1})")
    try:
        return SamplingParams(**kwargs, **fields)
    except ParamError as e:  # in the API's words: a value as JSON, no Python None
        text = f"{e.name}={harmony.short_repr(e.value)} is invalid: must be {e.allowed}"
        for ours, theirs in (spelled or {}).items():
            text = re.sub(rf"\b{ours}\b", theirs, text)
        raise APIError(400, text, param=(spelled or {}).get(e.name, e.name)) from e


def _prompt_logprobs(req: ChatCompletionRequest | CompletionRequest,
                     echoed: int | None = None) -> int | None:
    """vLLM's prompt_logprobs (else what completions' echo with logprobs needs), refused with
    stream as vLLM refuses it."""
    _require(req.prompt_logprobs is None or not req.stream, "prompt_logprobs",
             "prompt_logprobs are not served with stream: true (as in vLLM): ask without "
             "streaming, or use completions' echo with logprobs, which streams")
    return echoed if req.prompt_logprobs is None else req.prompt_logprobs


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """The prompts: a string or token ids is one, a list of them is each (types checked)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return prompt


def _truncates(body: dict) -> bool:
    """Whether the request cuts its prompt to fit (so no length is refused before that)."""
    return body.get("truncate_prompt_tokens") is not None


def _check_chars(sources: list[list[harmony.Segment]], max_model_len: int, what: str) -> None:
    """Refuses, before any tokenizing, text too long for the context whatever its tokens."""
    for source in sources:
        chars = sum(len(s) for s in source if isinstance(s, str))
        if chars > max_model_len * MAX_TOKEN_CHARS:
            _too_long(f"at least {chars // MAX_TOKEN_CHARS}", max_model_len, what)


def _least_tokens(messages: list) -> int:
    """Tokens `messages` render to at least, from a glance at each: the leading system and
    developer messages merge into harmony's one developer message (an empty one adds nothing,
    one with text at least a token), every later one is a message of its own."""
    lead = 0
    while (lead < len(messages) and isinstance(messages[lead], dict)
           and messages[lead].get("role") in ("system", "developer")):
        lead += 1
    merged = sum(_has_text(m.get("content")) for m in messages[:lead])
    return merged + (len(messages) - lead) * _MESSAGE_TOKENS


def _has_text(content: Any) -> bool:
    """Whether a message's content (a string or text parts) holds any text."""
    if isinstance(content, list):
        return any(isinstance(p, dict) and isinstance(p.get("text"), str) and p["text"] != ""
                   for p in content)
    return isinstance(content, str) and content != ""


def _too_long(tokens: str, max_model_len: int, what: str) -> None:
    raise APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, your {what} "
        f"resulted in {tokens} tokens. Please reduce the length of the {what}.",
        param=what,
        code="context_length_exceeded",
    )


def _check_length(num_prompt: int, max_tokens: int | None, max_model_len: int, what: str,
                  field: str = "max_tokens") -> None:
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
            param=field,
            code="context_length_exceeded",
        )
