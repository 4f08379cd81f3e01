"""The OpenAI Responses API (`/v1/responses`) on top of the chat path.

A Responses request is translated into a chat-completions body (input items to messages with
`reasoning` and `tool_calls`, function tools to chat tools, `text.format` to `response_format`,
...) and checked and rendered by `protocol.parse_chat`, so every check and feature of chat
applies alike; errors are renamed back to the Responses fields. Generated tokens go through
the harmony parser into output items (reasoning, message, function_call) in the order the model
wrote them, and into the stream events that build them. Responses are kept in a bounded LRU
store (`response_store.py`) for GET (of a response, and of its input items) and
`previous_response_id`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tinyoss import harmony
from tinyoss.engine.core_client import OutputStream
from tinyoss.engine.output_processor import CompletionOutput
from tinyoss.engine.step import TokenLogprob
from tinyoss.server.choices import release, token_logprob
from tinyoss.server.protocol import APIError, note_ignored, refuse_unsupported, validate
from tinyoss.server.schemas import ResponseCreateRequest
from tinyoss.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("tinyoss.server")

_EFFORTS = ("low", "medium", "high")
# `include` values naming items this server never produces: asking for them is harmless.
_VACUOUS_INCLUDES = (
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    # stateless clients (store: false) ask for it; reasoning comes back as plain reasoning_text,
    # which they send back as it came
    "reasoning.encrypted_content",
)
_LOGPROBS = "message.output_text.logprobs"  # output_text's logprobs: the answer's tokens'
# What a stored response holds, as `footprint` counts it: the response's own fields, and each
# logprob entry of its output text (a token's, and each of its alternatives');
# tests/test_logprob_memory.py measures them
_RESPONSE_BYTES = 16384
_ENTRY_BYTES = 640
_ALTERNATIVE_BYTES = 448
# chat fields (in parse_chat's errors) -> the Responses fields they came from
_RENAMES = (
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("reasoning_effort", "reasoning.effort"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    (".function.parameters", ".parameters"),
    ("messages", "input"),
)
_MESSAGE_PATH = re.compile(r"\bmessages\[(\d+)\]")
# a chat tool call's field -> its function_call item's
_CALL_PATH = re.compile(r"\bmessages\[(\d+)\]\.tool_calls\[(\d+)\](?:\.function)?(\.\w+)?")
_CALL_FIELDS = {".id": ".call_id"}
# id prefixes of the items of each type, in output and in input_items' listing
_PREFIX = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_",
           "function_call_output": "fco_"}  # fmt: skip
_MOST_LISTED = 100  # OpenAI's bound on input_items' limit


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _need(ok: object, param: str, message: str) -> None:
    if not ok:
        raise APIError(400, message, param=param)


# ---------------------------------------------------------------- the request


@dataclass
class ResponsesRequest:
    """A Responses request made into a chat body, with what the response repeats of it."""

    chat: dict  # the chat-completions body that parse_chat checks and renders
    origins: list[str]  # where each chat message came from: input[i], instructions, ...
    call_origins: list[list[str]]  # each message's tool calls': the function_call items
    input: list[dict]  # the conversation's input items: the previous response's, then these
    echo: dict  # request fields the response object repeats
    stream: bool
    store: bool

    def renamed(self, e: APIError) -> APIError:
        """parse_chat's error, naming the Responses field (and input item) instead of chat's."""

        def call(m: re.Match) -> str:
            i, k = int(m[1]), int(m[2])
            if i >= len(self.call_origins) or k >= len(self.call_origins[i]):
                return m[0]
            return self.call_origins[i][k] + _CALL_FIELDS.get(m[3] or "", m[3] or "")

        def rename(text: str) -> str:
            text = _CALL_PATH.sub(call, text)
            text = _MESSAGE_PATH.sub(
                lambda m: self.origins[int(m[1])] if int(m[1]) < len(self.origins) else m[0], text
            )
            for chat, ours in _RENAMES:
                text = re.sub(rf"(?<![\w.]){re.escape(chat)}\b", ours, text)
            return text

        param = rename(e.param) if e.param else None
        return APIError(e.status, rename(e.message), param=param, code=e.code, headers=e.headers)


# Chat completions' spellings that /v1/responses does not read: refused by name, since a body
# carrying them (a max_tokens left unbounded, JSON mode silently off) would get another answer
# than its sender expects
_CHAT_FIELDS = {
    "messages": "give the conversation as input",
    "max_tokens": "give max_output_tokens",
    "max_completion_tokens": "give max_output_tokens",
    "response_format": "give text.format",
    "n": "a request makes one response",
    "stop": "stop sequences are not supported here (use /v1/chat/completions)",
    "reasoning_effort": "give reasoning.effort",
    "chat_template_kwargs": "give reasoning.effort",
    "structured_outputs": "give text.format",
    "logprobs": f'give include: ["{_LOGPROBS}"] (and top_logprobs for alternatives)',
    "return_token_ids": "token ids are not served here (use /v1/chat/completions)",
    "ignore_eos": "a response ends at harmony's end tokens (use /v1/chat/completions)",
    "stop_token_ids": "a response ends at harmony's end tokens (use /v1/chat/completions)",
}
# Chat's sampling fields (vLLM's), passed on as they are
_SAMPLING = ("top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "min_tokens", "cache_salt")


def translate(body: dict, previous: Callable[[str], list[dict]]) -> ResponsesRequest:
    """Checks a Responses body and makes it a chat body; `previous(id)` is the conversation
    (input and output items) of a stored response, or raises its 404. The model checks the
    types; what follows checks what the values mean here, and reads the JSON's own dicts (strict
    validation changes no value), which the response repeats as they were sent."""
    req = validate(ResponseCreateRequest, body)
    _need(
        not req.background,
        "background",
        "background=true is not supported: a response runs while its request is open; leave "
        "background out (or false), and stream to see it as it is generated",
    )
    for name, why in (
        ("conversation", "conversations are not supported: use previous_response_id"),
        ("prompt", "prompt templates are not supported: send instructions and input"),
    ):
        _need(body.get(name) is None, name, f"{name} is not supported: {why}")
    for name, why in _CHAT_FIELDS.items():  # ignored, they would change the answer unseen
        _need(name not in body, name, f"{name} is a chat completions field, not one of "
              f"/v1/responses: {why}")
    refuse_unsupported(body)
    _need(
        req.truncation in (None, "disabled"),
        "truncation",
        f"truncation={harmony.short_repr(req.truncation)} is not supported: an input longer "
        "than the context is a 400; leave truncation out (or 'disabled')",
    )
    _check_include(req.include or [])
    effort, summary = _reasoning(body.get("reasoning") or {})
    fmt = _text_format(body.get("text") or {})
    _note_hosted([t.type for t in req.tools or () if t.type != "function"])
    tools = [{"type": "function", "name": t.name, "description": t.description,
              "parameters": t.parameters, "strict": t.strict}
             for t in req.tools or () if t.type == "function"]  # fmt: skip
    choice = _tool_choice(body.get("tool_choice"), tools)

    items = [(f"input[{i}]", item) for i, item in enumerate(_input(body["input"]))]
    earlier = previous(req.previous_response_id) if req.previous_response_id is not None else []
    conversation = [("previous_response_id", item) for item in earlier] + items
    messages, origins, call_origins = _messages(conversation)
    if req.instructions:
        messages.insert(0, {"role": "developer", "content": req.instructions})
        origins.insert(0, "instructions")
        call_origins.insert(0, [])
    _need(messages, "input", "input holds no message: give the model something to answer")

    chat: dict[str, Any] = {"messages": messages, "reasoning_effort": effort}
    if tools:
        chat["tools"] = [{"type": "function", "function": _chat_function(t)} for t in tools]
    if choice is not None:
        chat["tool_choice"] = (
            {"type": "function", "function": {"name": choice["name"]}}
            if isinstance(choice, dict)
            else choice
        )
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"),
                         ("temperature", "temperature"), ("top_p", "top_p"),
                         ("thinking_token_budget", "thinking_token_budget"),
                         *((name, name) for name in _SAMPLING)):  # fmt: skip
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if _LOGPROBS in (req.include or ()) or req.top_logprobs:  # top_logprobs: asks for them too
        chat["logprobs"], chat["top_logprobs"] = True, req.top_logprobs or 0
    if fmt["type"] == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt["type"] == "json_object":
        chat["response_format"] = {"type": "json_object"}

    echo = {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": effort, "summary": summary},
        "store": req.store is not False,
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
        "text": {"format": fmt, "verbosity": "medium"},
        "tool_choice": "auto" if choice is None else choice,
        "tools": tools,
        "top_logprobs": req.top_logprobs or 0,
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
        "user": req.user,
        "max_tool_calls": req.max_tool_calls,
        "prompt_cache_key": req.prompt_cache_key,
        "safety_identifier": req.safety_identifier,
    }
    stream, store = bool(req.stream), echo["store"]
    note_ignored(req, "/v1/responses")
    return ResponsesRequest(chat, origins, call_origins, [item for _, item in conversation], echo,
                            stream, store)


_hosted_noted: set[str] = set()  # hosted tool types logged at WARNING (each once a process)


def _note_hosted(types: list[str]) -> None:
    """Logs the hosted tools a request offered, which the prompt leaves out (schemas'
    HOSTED_TOOLS): at WARNING once a type, then at DEBUG."""
    new = sorted(set(types) - _hosted_noted)
    _hosted_noted.update(new)
    if new:
        log.warning("tools of types %s left out of a /v1/responses prompt: hosted tools are not "
                    "served here (only function tools); each type is logged once at this level",
                    ", ".join(new))
    elif types:
        log.debug("hosted tools left out: %s", ", ".join(types))


def _check_include(include: list[str]) -> None:
    for i, value in enumerate(include):
        _need(
            value in _VACUOUS_INCLUDES or value == _LOGPROBS,
            f"include[{i}]",
            f"include[{i}]={harmony.short_repr(value)} is not a known include value",
        )


def _reasoning(reasoning: dict) -> tuple[str, str | None]:
    effort = reasoning.get("effort")
    effort = "medium" if effort is None else effort
    _need(
        effort in _EFFORTS,
        "reasoning.effort",
        f"reasoning.effort={harmony.short_repr(effort)} is not supported: gpt-oss's efforts are "
        "low, medium and high (low is the least)",
    )
    return effort, reasoning.get("summary", reasoning.get("generate_summary"))


def _text_format(text: dict) -> dict:
    _need(
        text.get("verbosity") in (None, "medium"),
        "text.verbosity",
        f"text.verbosity={harmony.short_repr(text.get('verbosity'))} is not supported: gpt-oss "
        "has no verbosity control; leave it out (or 'medium')",
    )
    return text.get("format") or {"type": "text"}


def _chat_function(tool: dict) -> dict:
    keys = ("name", "description", "parameters", "strict")
    return {k: tool[k] for k in keys if tool[k] is not None}


def _tool_choice(choice: str | dict | None, tools: list[dict]) -> str | dict | None:
    """The choice as the response repeats it; a named function must be one of the tools."""
    if not isinstance(choice, dict):
        return choice
    names = ", ".join(t["name"] for t in tools) or "none are given"
    _need(
        choice["name"] in [t["name"] for t in tools],
        "tool_choice",
        f"tool_choice={harmony.short_repr(choice)} is invalid: must be "
        f'{{"type": "function", "name": N}} naming one of the tools ({names})',
    )
    return {"type": "function", "name": choice["name"]}


# ---------------------------------------------------------------- input items to messages


def _input(value: str | list[dict]) -> list[dict]:
    """The input items (a string is one user message); reasoning must come as plain text. An
    item without an id gets one, as input_items lists it: the responses that continue this one
    share the item, and so its id."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    for i, item in enumerate(value):
        _need(
            item.get("type") != "reasoning" or item.get("encrypted_content") is None,
            f"input[{i}].encrypted_content",
            f"input[{i}].encrypted_content is not supported: send the reasoning as content "
            '[{"type": "reasoning_text", "text": ...}], as this server returns it',
        )
        if not isinstance(item.get("id"), str):
            item["id"] = _new_id(_PREFIX[item.get("type", "message")])
    return value


# what the model reads for an image a tool returned (schemas' ToolImagePart)
IMAGE_NOT_SHOWN = "[an image: not shown, this model reads text only]"


def _text(content: str | list[dict]) -> str:
    """The text of a string or of text parts (the model checked their types)."""
    if isinstance(content, str):
        return content
    return "".join(p["refusal"] if p["type"] == "refusal" else
                   IMAGE_NOT_SHOWN if p["type"] == "input_image" else p["text"] for p in content)


def _messages(items: list[tuple[str, dict]]) -> tuple[list[dict], list[str], list[list[str]]]:
    """Chat messages of (path, item) pairs, the path each message came from, and each one's
    tool calls' paths (for errors that name a call's part). Reasoning goes
    on the assistant message after it (harmony keeps it only before a tool call of the turn in
    progress); function calls join the assistant message before them, as harmony renders one
    turn: a commentary preamble, then the calls."""
    messages: list[dict] = []
    origins: list[str] = []
    call_origins: list[list[str]] = []
    calls: set[str] = set()
    waiting: dict[str, str] = {}  # call id -> where its function_call is, until its output
    reasoning: list[str] = []

    def answered(at: str) -> None:
        """Refuses a message (or the input's end) while a function call has no output yet,
        as OpenAI does: the model would read a conversation that skips the tool's answer."""
        for call_id, where in waiting.items():
            raise APIError(400, f"No tool output found for function call {call_id!r} (at "
                           f"{where}): its function_call_output must come before {at}",
                           param=where)  # fmt: skip

    def add(message: dict, at: str) -> None:
        if message["role"] == "assistant" and reasoning:
            message["reasoning"] = "\n".join(reasoning)
        reasoning.clear()  # reasoning before a user or tool message has nowhere to go
        messages.append(message)
        origins.append(at)
        call_origins.append([])

    for at, item in items:
        kind = item.get("type", "message")
        if kind == "reasoning":
            text = _text(item.get("content") or []) or "\n\n".join(
                p["text"] for p in item.get("summary") or ()
            )
            if text:
                reasoning.append(text)
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            calls.add(item["call_id"])
            waiting[item["call_id"]] = at
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                add({"role": "assistant", "content": None, "tool_calls": [call]}, at)
            call_origins[-1].append(at)
        elif kind == "function_call_output":
            _need(
                item["call_id"] in calls,
                f"{at}.call_id" if at != "previous_response_id" else at,
                f"No tool call found for function call output with call_id {item['call_id']!r}: "
                "a function_call_output must follow its function_call (in the input, or in "
                "the previous response)",
            )
            waiting.pop(item["call_id"], None)
            text = _text(item["output"])
            add({"role": "tool", "tool_call_id": item["call_id"], "content": text}, at)
        else:
            answered(f"the message at {at}")
            text = _text(item["content"])
            add({"role": item["role"], "content": text}, at)
    answered("the input ends")
    return messages, origins, call_origins


# ---------------------------------------------------------------- output items and events


class Cancelled(Exception):
    """Put into a running response's engine streams by POST /v1/responses/{id}/cancel."""


def _cancelled(why: str) -> dict:
    """A cancelled response's error. OpenAI's stream has no cancelled event: such a stream ends
    with response.failed, whose clients read `error.message` (it was null)."""
    return {"code": "cancelled", "message": f"the response was cancelled: {why}"}


@dataclass
class Item:
    """One output item as it is generated; `render` gives its API form."""

    type: str  # reasoning | message | function_call
    id: str
    text: list[str] = field(default_factory=list)  # reasoning, answer, or the call's arguments
    name: str = ""
    call_id: str = ""
    status: str = "in_progress"
    logprobs: list[dict] = field(default_factory=list)  # a message's, when asked for

    def render(self, opening: bool = False) -> dict:
        text = "".join(self.text)
        if self.type == "function_call":
            return {"id": self.id, "type": "function_call", "call_id": self.call_id,
                    "name": self.name, "arguments": text, "status": self.status}  # fmt: skip
        content = [] if opening else [self.part(text)]
        if self.type == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content,
                    "status": self.status}  # fmt: skip
        return {"id": self.id, "type": "message", "role": "assistant", "status": self.status,
                "content": content}  # fmt: skip

    def part(self, text: str) -> dict:
        """A content part; its logprobs are a copy (the events of an update go out after it)."""
        if self.type == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": list(self.logprobs)}  # fmt: skip


_DELTA = {"reasoning": "response.reasoning_text.delta", "message": "response.output_text.delta"}
_DONE = {"reasoning": "response.reasoning_text.done", "message": "response.output_text.done"}


class Output:
    """Generated tokens to output items through the harmony parser; used as the engine run's one
    choice. `update` returns the stream events (without sequence numbers) of what it adds."""

    def __init__(self, tokenizer: Tokenizer, logprobs: bool = False) -> None:
        self.tokenizer = tokenizer
        self.parser = harmony.HarmonyStreamParser(
            tokenizer.decode, detokenizer=lambda: IncrementalDetokenizer(tokenizer)
        )
        self.logprobs = logprobs  # output_text's logprobs: the message text's tokens'
        self._lps: list[TokenLogprob] | None = None  # the engine's, of every token so far
        self.items: list[Item] = []
        self.open: Item | None = None
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self._had: set[str] = set()  # item types with text in an earlier item

    def update(self, out: CompletionOutput) -> list[dict]:
        events: list[dict] = []
        if self.finish_reason is not None:
            return events
        self._lps = out.logprobs if self.logprobs else None
        for token in out.token_ids[self.num_tokens :]:
            self.num_tokens += 1
            for d in self.parser.add(token):
                events += self._add(d)
        if out.finished():
            for d in self.parser.finish():
                events += self._add(d)
            events += self.close("incomplete" if out.finish_reason == "length" else "completed")
            self.finish_reason = out.finish_reason
        # the engine's entries are in the items now, but for those the parser still holds
        release(self._lps, len(out.token_ids) if out.finished() else self.parser.holding)
        return events

    def close(self, status: str) -> list[dict]:
        """Ends the open item: its done events."""
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        at = {"item_id": item.id, "output_index": self.items.index(item)}
        text = "".join(item.text)
        done = {"type": "response.output_item.done", "output_index": at["output_index"],
                "item": item.render()}  # fmt: skip
        if item.type == "function_call":
            return [{"type": "response.function_call_arguments.done", **at, "arguments": text},
                    done]  # fmt: skip
        extra = {"logprobs": list(item.logprobs)} if item.type == "message" else {}
        return [
            {"type": _DONE[item.type], **at, "content_index": 0, "text": text, **extra},
            {"type": "response.content_part.done", **at, "content_index": 0,
             "part": item.part(text)},
            done,
        ]  # fmt: skip

    def _start(self, item: Item) -> list[dict]:
        events = self.close("completed")
        self.items.append(item)
        self.open = item
        at = len(self.items) - 1
        events.append({"type": "response.output_item.added", "output_index": at,
                       "item": item.render(opening=True)})  # fmt: skip
        if item.type != "function_call":
            events.append(
                {
                    "type": "response.content_part.added",
                    "item_id": item.id,
                    "output_index": at,
                    "content_index": 0,
                    "part": item.part(""),
                }
            )
        return events

    def _add(self, d: harmony.Delta) -> list[dict]:
        if d.kind == "tool_call":
            return self._start(Item("function_call", _new_id("fc_"), name=d.name, call_id=d.id))
        events: list[dict] = []
        kind = {"reasoning": "reasoning", "content": "message"}.get(d.kind, "function_call")
        text = d.text
        if self.open is None or self.open.type != kind:
            events += self._start(Item(kind, _new_id(_PREFIX[kind])))
            if kind in self._had:  # the parser's "\n" between messages of one kind: a new item
                text = text.removeprefix("\n")
        self._had.add(kind)
        item = self.open
        if text:
            item.text.append(text)
            at = {"item_id": item.id, "output_index": len(self.items) - 1}
            if kind == "function_call":
                events.append({"type": "response.function_call_arguments.delta", **at,
                               "delta": text})  # fmt: skip
            else:
                extra = {}
                if kind == "message":  # the logprobs of the text's tokens, when asked for
                    lps, tok = self._lps, self.tokenizer
                    new = [] if lps is None else [token_logprob(tok, lps[at]) for at in d.tokens]
                    item.logprobs += new
                    extra = {"logprobs": new}
                events.append({"type": _DELTA[kind], **at, "content_index": 0, "delta": text,
                               **extra})  # fmt: skip
        return events


def _listed(item: dict) -> dict:
    """An input item as input_items lists it: with its type and status, and a message's text as
    one part (input_text, or output_text for the assistant's)."""
    listed = {**item, "type": item.get("type", "message"), "status": item.get("status") or
              "completed"}  # fmt: skip
    if listed["type"] == "message" and isinstance(item["content"], str):
        part = {"type": "input_text", "text": item["content"]}
        if item["role"] == "assistant":
            part = {"type": "output_text", "text": item["content"], "annotations": []}
        listed["content"] = [part]
    return listed


class EngineRun(Protocol):
    """What a response needs of the server's `Run`."""

    rid: str  # the response's id
    streams: list[OutputStream]

    def updates(self) -> AsyncIterator[list[Any]]: ...

    def usage(self) -> dict: ...


def _response(id: str, created_at: int, model: str, echo: dict, status: str = "in_progress",
              error: dict | None = None, output: list[dict] | None = None,
              usage: dict | None = None, completed_at: int | None = None) -> dict:
    """A response object (OpenAI's fields, in its order)."""
    return {
        "id": id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "completed_at": completed_at,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output or [],
        "service_tier": "default",
        "truncation": "disabled",
        **echo,
        "usage": usage,
    }


def refused_events(req: ResponsesRequest, model: str, err: APIError) -> list[dict]:
    """A streamed response refused before it ran, as the events of one that failed: for an
    input beyond the context, which agents read as a full context window only from a
    response.failed of that code (Codex; a 400 it reports as an invalid request). Nothing is
    stored."""
    rid, now = _new_id("resp_"), int(time.time())
    started = _response(rid, now, model, req.echo)
    error = {"code": err.code, "message": err.message}
    failed = _response(rid, now, model, req.echo, "failed", error)
    events = [("response.created", {"response": started}),
              ("response.in_progress", {"response": started}),
              ("error", {**error, "param": err.param}),
              ("response.failed", {"response": failed})]  # fmt: skip
    return [{"type": kind, **fields, "sequence_number": i}
            for i, (kind, fields) in enumerate(events)]


class ResponseRun:
    """One response: its engine run while it lasts, then its items and usage (what the store
    keeps). `events` streams it; `drain` runs it to its end for a whole answer."""

    def __init__(
        self,
        req: ResponsesRequest,
        model: str,
        run: EngineRun,
        output: Output,
        error_of: Callable[[Exception], APIError],
    ) -> None:
        self.id, self.model, self.created_at = run.rid, model, int(time.time())
        self.echo, self.input = req.echo, req.input
        self.run: EngineRun | None = run
        self.output: Output | None = output
        self.items = output.items
        self.error_of = error_of
        self.status = "in_progress"
        self.error: dict | None = None
        self.completed_at: int | None = None
        self.usage: dict | None = None
        self._seq = 0
        self.on_end: Callable[[ResponseRun], None] | None = None  # once its run is over
        self.ended = asyncio.Event()  # set once its run is over

    def footprint(self) -> int:
        """About the bytes it holds but for its input: its own fields, and its output items'
        text and logprob entries (a dict of a token's text, bytes and logprob, with a list of
        such dicts, its alternatives)."""
        nbytes = _RESPONSE_BYTES
        for item in self.items:
            nbytes += 256 + sum(64 + 4 * len(text) for text in item.text)
            nbytes += sum(_ENTRY_BYTES + _ALTERNATIVE_BYTES * len(e["top_logprobs"])
                          for e in item.logprobs)  # fmt: skip
        return nbytes

    def snapshot(self) -> dict:
        """The response object as it stands."""
        return _response(self.id, self.created_at, self.model, self.echo, self.status,
                         self.error, [item.render() for item in self.items], self.usage,
                         self.completed_at)  # fmt: skip

    def conversation(self) -> list[dict]:
        """Input and output items, for a request that continues from this response."""
        return self.input + [item.render() for item in self.items]

    def input_items(
        self, after: str | None, limit: str | None, order: str | None, include: list[str]
    ) -> dict:
        """GET /v1/responses/{id}/input_items: the items the response was generated from (those
        of the response it continues, then its input), a page of them as OpenAI lists them."""
        _need(
            limit is None or limit.isdecimal() and 1 <= int(limit) <= _MOST_LISTED,
            "limit",
            f"limit={harmony.short_repr(limit)} is invalid: must be 1 to {_MOST_LISTED}",
        )
        _need(
            order in (None, "asc", "desc"),
            "order",
            f"order={harmony.short_repr(order)} is invalid: must be 'asc' or 'desc' (newest first, "
            "the default)",
        )
        _check_include(include)
        items = self.input if order == "asc" else self.input[::-1]
        start = 0
        if after is not None:
            start = next((i + 1 for i, item in enumerate(items) if item["id"] == after), -1)
            _need(start >= 0, "after", f"after={harmony.short_repr(after)} is not the id of an "
                  f"input item of response {self.id!r}")  # fmt: skip
        end = start + int(limit or 20)
        data = [_listed(item) for item in items[start:end]]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": end < len(items),
        }

    def cancel(self) -> None:
        """Aborts the response in progress (its engine requests end at once)."""
        if self.status != "in_progress" or self.run is None:
            raise APIError(
                400,
                f"response {self.id!r} is {self.status}: only a response in progress can be "
                "cancelled",
                param="response_id",
            )
        self.status = "cancelled"
        self.error = _cancelled(f"POST /v1/responses/{self.id}/cancel")
        for stream in self.run.streams:
            stream.fail(Cancelled("cancelled"))

    async def drain(self, until_gone: Callable[[], Awaitable[bool]]) -> dict | None:
        """Runs the response to its end with `until_gone` (False: the client left, None)."""
        try:
            if not await until_gone():
                return None
        except Cancelled:
            pass
        except Exception as e:
            self._end(e)
            raise
        finally:
            self._end()
        return self.snapshot()

    async def events(self) -> AsyncIterator[dict]:
        """The stream events, each with its sequence number, in the order OpenAI sends them."""
        yield self._event("response.created", response=self.snapshot())
        yield self._event("response.in_progress", response=self.snapshot())
        error: Exception | None = None
        closing: list[dict] = []
        try:
            async with contextlib.aclosing(self.run.updates()) as updates:
                async for changed in updates:
                    for events in changed:
                        for event in events:
                            yield self._event(**event)
        except Exception as e:  # the engine failed, or the response was cancelled
            error = e
        finally:
            closing = self._end(error)  # a client that left: cancelled
        for event in closing:  # the done events of an item cut short
            yield self._event(**event)
        if self.status == "failed":
            yield self._event("error", **{k: self.error[k] for k in ("code", "message")},
                              param=None)  # fmt: skip
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
        yield self._event(kind.get(self.status, "response.failed"), response=self.snapshot())

    def _event(self, type: str, **fields: Any) -> dict:
        event = {"type": type, **fields, "sequence_number": self._seq}
        self._seq += 1
        return event

    def _end(self, error: Exception | None = None) -> list[dict]:
        """Settles the status once the engine run is over; drops the run (the store keeps only
        the items and the usage). The done events of the item it cut short, if any."""
        output, run = self.output, self.run
        if output is None or run is None:
            return []
        finish = output.finish_reason
        if self.status == "cancelled" or isinstance(error, Cancelled):
            self.status = "cancelled"  # by cancel(), which set the error
        elif error is not None:
            err = self.error_of(error)
            self.status, self.error = "failed", {"code": err.code or "server_error",
                                                 "message": err.message}  # fmt: skip
        elif finish in ("stop", "length"):
            self.status = "completed" if finish == "stop" else "incomplete"
        elif finish is None or finish == "abort":
            self.status = "cancelled"
            self.error = _cancelled("its client closed the connection before it ended")
        else:
            self.status = "failed"
            self.error = {"code": "server_error", "message": f"generation ended: {finish}"}
        if self.status == "completed":
            self.completed_at = int(time.time())
        closing = output.close("incomplete")  # nothing once the output finished
        usage = run.usage()
        cached = (usage["prompt_tokens_details"] or {"cached_tokens": 0})["cached_tokens"]
        self.usage = {
            "input_tokens": usage["prompt_tokens"],
            # nothing is written to a cache that is billed apart: 0, as OpenAI's types need it
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": output.parser.reasoning_tokens},
            "total_tokens": usage["total_tokens"],
        }
        self.run = self.output = None
        self.ended.set()
        if self.on_end is not None:
            self.on_end(self)
        return closing
