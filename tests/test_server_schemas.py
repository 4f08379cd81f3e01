"""The pydantic models of the HTTP API (`tinyoss/server/schemas.py`) against a live server on the
tiny model: wrong types are 400s naming the field's path, the server's real responses are
exactly what the response models describe (no field more, none missing), and /openapi.json is
a well-formed OpenAPI 3.1 document of the routes and their fields."""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any, get_args

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from tests.core_hooks import ANSWER, WEATHER
from tests.test_server import KEY, TINY, TOOLS, Served, environ, post, user, wait_healthy
from tests.test_structured_outputs import INFO
from tinyoss import harmony
from tinyoss.engine.core_process import HOOK_ENV
from tinyoss.server import protocol, schemas
from tinyoss.server.app import create_app
from tinyoss.server.protocol import APIError, parse_chat, parse_completion

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
HI = user("hi")
CALLED = {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """test_server.py's server, with its scripted replies (ANSWER, WEATHER): one per module."""
    prompts = tmp_path_factory.mktemp("schemas") / "prompts.jsonl"
    prompts.touch()
    with environ(**{HOOK_ENV: "tests.core_hooks:scripted", "TINYOSS_TEST_PROMPTS": str(prompts)}):
        served = Served(create_app(TINY, model_name="tiny", api_key=KEY))
        wait_healthy(served)
        yield served
        served.close()


def error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    exact(schemas.ErrorResponse, r.json())
    return err


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def exact(model: type[BaseModel], data: dict) -> BaseModel:
    """`data` as `model`, strictly, with no field that the model (or a nested one) lacks."""
    obj = model.model_validate(data, strict=True)
    stack: list[Any] = [(model.__name__, obj)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, BaseModel):
            assert not item.model_extra, f"{where}: fields the model lacks: {item.model_extra}"
            stack += [(f"{where}.{k}", getattr(item, k)) for k in type(item).model_fields]
        elif isinstance(item, list):
            stack += [(f"{where}[{i}]", x) for i, x in enumerate(item)]
    return obj


def events(r: httpx.Response) -> list[dict]:
    """A stream's events, checked to end with [DONE]."""
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# ---------------------------------------------------------------- (a) requests


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        # the cases test_server.py and test_server_tokenize.py check, with their params
        (CHAT, {"model": "tiny"}, "messages", "messages is required"),
        (CHAT, {"messages": HI, "n": "2"}, "n", "n='2' is invalid: must be an integer"),
        (CHAT, {"messages": HI, "tool_choice": "x"}, "tool_choice", "'required'"),
        (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "robot"),
        (CHAT, {"messages": HI, "reasoning_effort": "max"}, "reasoning_effort", "'high'"),
        (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 50}, "top_logprobs", "<= 20"),
        (CHAT, {"messages": HI, "thinking_token_budget": -1}, "thinking_token_budget", ">= 0"),
        (CMPL, {"prompt": [[1], "a", 3]}, "prompt", "token ids"),
        (CMPL, {"prompt": [[1, 2], "ab"]}, "prompt",  # mixed: refused as OpenAI and vLLM do
         "must be a string, a list of token ids (ints), a list of strings or a list of token-id"),
        ("/tokenize", {}, "prompt", "prompt is required"),
        ("/tokenize", {"prompt": [1, 2]}, "prompt", "must be a string"),
        ("/tokenize", {"messages": "hi"}, "messages", "must be a list"),
        ("/tokenize", {"messages": HI, "add_generation_prompt": "no"}, "add_generation_prompt",
         "boolean"),
        ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs", "boolean"),
        ("/tokenize", {"messages": HI, "continue_final_message": True},
         "messages[0].role", "must be the assistant's"),
        ("/tokenize", {"messages": HI, "chat_template": "{{ x }}"}, "chat_template",
         "harmony format"),
        ("/tokenize", {"messages": HI, "continue_final_message": 1}, "continue_final_message",
         "boolean"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "y"}, "add_special_tokens", "bool"),
        ("/detokenize", {"tokens": [1, 2.5]}, "tokens", "token ids (ints)"),
        ("/detokenize", {"tokens": [True]}, "tokens", "token ids (ints)"),
        ("/detokenize", {}, "tokens", "tokens is required"),
        # wrong types, named by their path
        (CHAT, {"messages": [{"role": "user", "content": 3}]}, "messages[0].content",
         "messages[0].content=3 is invalid: must be a string or a list of text parts"),
        (CHAT, {"messages": [*HI, {"role": "user"}, {"role": "user", "content": [{"text": "a"}]}]},
         "messages[2].content", "text parts"),
        (CHAT, {"messages": []}, "messages", "non-empty list"),
        (CHAT, {"messages": [{"content": "x"}]}, "messages[0].role", "required"),
        (CHAT, {"messages": [{"role": "assistant", "content": "a", "tool_calls": [
            {"function": {"name": "f", "arguments": 3}}]}]},
         "messages[0].tool_calls[0].function.arguments", "JSON text"),
        (CHAT, {"messages": HI, "temperature": "hot"}, "temperature",
         "temperature='hot' is invalid: must be a number"),
        (CHAT, {"messages": HI, "temperature": True}, "temperature", "a number"),
        (CHAT, {"messages": HI, "max_tokens": "5"}, "max_tokens", "an integer"),
        (CHAT, {"messages": HI, "max_completion_tokens": 5.0}, "max_completion_tokens", "integer"),
        (CHAT, {"messages": HI, "seed": True}, "seed", "an integer"),
        (CHAT, {"messages": HI, "stream": "yes"}, "stream", "stream='yes' is invalid: must be"),
        (CHAT, {"messages": HI, "stream": True, "stream_options": {"include_usage": "y"}},
         "stream_options.include_usage", "boolean"),
        (CHAT, {"messages": HI, "stream_options": []}, "stream_options", "an object"),
        (CMPL, {"prompt": "a", "stream": True, "stream_options": {"continuous_usage_stats": 1}},
         "stream_options.continuous_usage_stats", "boolean"),
        (CHAT, {"messages": HI, "stop": ["a", 1]}, "stop", "a string or a list of strings"),
        (CHAT, {"messages": HI, "tools": {"name": "f"}}, "tools", "must be a list"),
        (CHAT, {"messages": HI, "tools": [{"type": "function"}]}, "tools[0].function",
         "is required"),
        (CHAT, {"messages": HI, "tools": [{"function": {"name": ""}}]}, "tools[0].function.name",
         "non-empty string"),
        (CHAT, {"messages": HI, "tools": [*TOOLS, {"function": {"name": "f", "parameters": 1}}]},
         "tools[1].function.parameters", "an object"),
        # OpenAI's rule: the arguments are an object (a trial got bare 9 or [false] back)
        (CHAT, {"messages": HI, "tools": [{"function": {"name": "f", "parameters": {
            "type": "integer"}}}]}, "tools[0].function.parameters",
         "must be a JSON schema of type 'object' (a call's arguments are an object), got type "
         '"integer"'),
        (CHAT, {"messages": HI, "tools": [{"type": "web", "function": {"name": "f"}}]},
         "tools[0].type", "'function'"),
        (CHAT, {"messages": HI, "tools": [*TOOLS, *TOOLS]}, "tools[1]", "like tools[0]"),
        (CHAT, {"messages": HI, "tools": [{"function": {"name": "get weather"}}]}, "tools[0]",
         "'get weather': a tool's name must be 1 to 64 letters, digits, '_' or '-'"),
        (CHAT, {"messages": HI, "tools": [*TOOLS, {"function": {"name": "f<|end|>x"}}]},
         "tools[1]", "must be 1 to 64 letters"),
        (CHAT, {"messages": HI, "tools": [{"function": {"name": "f" * 65}}]}, "tools[0]",
         "1 to 64"),
        (CHAT, {"messages": HI, "response_format": "json"}, "response_format", "json_object"),
        (CHAT, {"messages": HI, "logprobs": 1}, "logprobs", "boolean"),
        (CMPL, {"prompt": "a", "logprobs": True}, "logprobs", "an integer"),
        (CMPL, {"prompt": "a", "echo": "yes"}, "echo", "boolean"),
        (CHAT, {"messages": HI, "echo": "yes"}, "echo", "boolean"),
        (CHAT, {"messages": HI, "use_beam_search": 1}, "use_beam_search", "boolean"),
        (CMPL, {"prompt": "a", "allowed_token_ids": [1.5]}, "allowed_token_ids", "token ids"),
        (CHAT, {"messages": HI, "bad_words": "x"}, "bad_words", "must be a list"),
        (CMPL, {"prompt": [1, "a"]}, "prompt", "token ids"),
        (CMPL, {"prompt": 5}, "prompt", "a string"),
        (CMPL, {"prompt": "a", "suffix": 3}, "suffix", "a string"),
        # what values mean is checked where they are used, as before
        (CHAT, {"messages": HI, "temperature": -1}, "temperature", "temperature=-1 is invalid"),
        (CHAT, {"messages": HI, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        (CHAT, {"messages": [{"role": "user", "content": None}]}, "messages[0].content",
         "messages[0].content is missing"),
        (CHAT, {"messages": HI, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "naming one of the tools"),
        (CHAT, {"messages": HI, "logit_bias": {"x1": 5}}, "logit_bias", "is not a token id"),
        (CHAT, {"messages": HI, "logit_bias": {"1": 101}}, "logit_bias", "[-100, 100]"),
        (CMPL, {"prompt": "a", "logit_bias": {"1": "5"}}, "logit_bias.1", "a number"),
        (CMPL, {"prompt": "a", "logit_bias": {str(10**8): 5}}, "logit_bias",
         "outside the vocabulary"),
        (CHAT, {"messages": HI, "allowed_token_ids": [10**8]}, "allowed_token_ids",
         "outside the vocabulary"),
        (CMPL, {"prompt": "a", "allowed_token_ids": []}, "allowed_token_ids", "non-empty list"),
        (CMPL, {"prompt": "a", "allowed_token_ids": [1], "structured_outputs": {"regex": "a"}},
         "allowed_token_ids", "with a structured output"),
        (CHAT, {"messages": HI, "continue_final_message": True, "add_generation_prompt": True},
         "continue_final_message", "Cannot set both `continue_final_message` and"),
        (CMPL, {"prompt": "a", "bad_words": [" "]}, "bad_words", "non-blank strings"),
        (CHAT, {"messages": HI, "bad_words": ["x"] * 1025}, "bad_words", "at most 1024"),
        (CMPL, {"prompt": [[]]}, "prompt", "prompt is empty"),
        # vLLM fields tinyoss does not serve are refused, never ignored
        (CMPL, {"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
         "not served with stream: true"),
        (CHAT, {"messages": HI, "prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
        (CMPL, {"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"),
        (CMPL, {"prompt": "a", "guided_choice": ["y"]}, "guided_choice", "structured_outputs"),
        # an error inside names its part (it had been the whole object's generic message)
        (CHAT, {"messages": HI, "structured_outputs": {"choice": [1, 2]}},
         "structured_outputs.choice[0]", "structured_outputs.choice[0]=1 is invalid: must be a "
         "string"),
        # json is an object or its text: the path had named pydantic's type (json.dict[str,any])
        (CHAT, {"messages": HI, "structured_outputs": {"json": 5}}, "structured_outputs.json",
         "must be a JSON schema: an object, or its JSON text"),
        (CMPL, {"prompt": "a", "structured_outputs": {"json": {}, "whitespace_pattern": " *"}},
         "structured_outputs.whitespace_pattern",
         "structured_outputs.whitespace_pattern is not supported: structured_outputs has no "
         "field 'whitespace_pattern'"),
        (CHAT, {"messages": HI, "guided_json": {}}, "guided_json", "give structured_outputs"),
        # the last two guided_* names had been ignored (a 200 without what they asked for)
        (CHAT, {"messages": HI, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern",
         "takes no whitespace pattern"),
        (CMPL, {"prompt": "a", "guided_whitespace_pattern": ""}, "guided_whitespace_pattern",
         "guided_* fields are gone"),
        (CHAT, {"messages": HI, "guided_options_request": {"guided_json": {}}},
         "guided_options_request", "give structured_outputs"),
        (CMPL, {"prompt": "a", "guided_options_request": {}}, "guided_options_request",
         "give structured_outputs"),
        ("/v1/responses", {"input": "hi", "guided_options_request": {}}, "guided_options_request",
         "give structured_outputs"),
        (CHAT, {"messages": HI, "skip_special_tokens": False}, "skip_special_tokens",
         "/v1/completions returns them as text"),
        (CMPL, {"prompt": "a", "stop_token_ids": [1, "2"]}, "stop_token_ids", "token ids"),
        (CHAT, {"messages": HI, "stop": ["ab"] * 65}, "stop",
         "stop holds 65 strings: at most 64 are served"),
        (CMPL, {"prompt": "a", "stop": "x" * 1025}, "stop", "longer than 1024 characters"),
        (CHAT, {"messages": HI, "stop_token_ids": [10**9]}, "stop_token_ids",
         "stop_token_ids [1000000000] is outside the vocabulary"),
        (CHAT, {"messages": HI, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        (CHAT, {"messages": HI, "stream_options": {"include_usage": True}}, "stream_options",
         "only allowed with stream: true"),
        (CMPL, {"prompt": "a", "stream": False, "stream_options": {}}, "stream_options",
         "only allowed with stream"),
        (CMPL, {"prompt": "a", "best_of": 3}, "best_of", "best_of equal to n"),
        ("/detokenize", {"tokens": [-1]}, "tokens", "outside the vocabulary"),
        # a tool result names its call, by an id an earlier call has (OpenAI requires it)
        (CHAT, {"messages": [*HI, CALLED, {"role": "tool", "content": "x"}]},
         "messages[2].tool_call_id", "messages[2].tool_call_id is required"),
        (CHAT, {"messages": [*HI, CALLED, {"role": "tool", "tool_call_id": "c2", "content": "x"}]},
         "messages[2].tool_call_id", "no earlier assistant tool call"),
        ("/tokenize", {"messages": [*HI, CALLED, {"role": "tool", "content": "x"}]},
         "messages[2].tool_call_id", "is required"),
        # OpenAI's rule for a schema's name
        (CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
            "name": "a b", "schema": {"type": "object"}}}}, "response_format.json_schema.name",
         "1 to 64 letters, digits, '_' or '-'"),
        (CMPL, {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x" * 65}}}, "response_format.json_schema.name", "1 to 64"),
        # a json_schema without a name (it had been "must be an object {name, schema}")
        (CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
            "schema": {}}}}, "response_format.json_schema.name", "is missing"),
        # a wrong type inside json_schema names its part (pydantic's union had stopped it at
        # response_format, with the whole expected shape)
        (CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
            "name": 5, "schema": {}}}}, "response_format.json_schema.name",
         "response_format.json_schema.name=5 is invalid: must be a string of 1 to 64 letters"),
        (CMPL, {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "strict": "yes"}}}, "response_format.json_schema.strict",
         "must be a boolean (true or false)"),
        (CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "schema": [1]}}}, "response_format.json_schema.schema",
         "response_format.json_schema.schema=[1] is invalid: must be a JSON schema object"),
        (CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "description": 3}}}, "response_format.json_schema.description",
         "must be a string"),
        (CMPL, {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": "s"}},
         "response_format.json_schema", 'must be {"name": N, "schema": SCHEMA}'),
        (CHAT, {"messages": HI, "response_format": {"type": "json_schema"}},
         "response_format.json_schema", "is required"),
        # OpenAI's fields with nothing to do here took any value (a trial)
        (CHAT, {"messages": HI, "user": {}}, "user", "string"),
        (CMPL, {"prompt": "a", "user": 5}, "user", "string"),
        (CHAT, {"messages": HI, "store": [1]}, "store", "bool"),
        (CHAT, {"messages": HI, "service_tier": 5}, "service_tier", "'priority'"),
        (CHAT, {"messages": HI, "metadata": {"k": 1}}, "metadata", "string values"),
        # the context-length error names the field given (it said max_tokens)
        (CHAT, {"messages": HI, "max_completion_tokens": 10**6}, "max_completion_tokens",
         "maximum context length"),
    ],
)  # fmt: skip
def test_errors_name_the_field(srv, path, body, param, words):
    err = error(post(srv, path, body))
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error" and "\n" not in err["message"]


@pytest.mark.parametrize("parse, body, param, words", [
    # SamplingParams' Python words ("must be None or an int >= 1") had reached JSON clients
    (parse_completion, {"prompt": "a", "max_tokens": -1}, "max_tokens",
     "max_tokens=-1 is invalid: must be an int >= 1"),
    (parse_completion, {"prompt": "a", "logprobs": 30}, "logprobs",
     "logprobs=30 is invalid: must be an int in [0, 20]"),
    (parse_chat, {"messages": HI, "cache_salt": ""}, "cache_salt",
     "cache_salt='' is invalid: must be a non-empty string"),
    (parse_completion, {"prompt": "a", "stop": ["a", ""]}, "stop",
     "stop=['a', ''] is invalid: must be a non-empty string or a list of them"),
    (parse_chat, {"messages": HI, "min_tokens": 9, "max_completion_tokens": 5}, "min_tokens",
     "min_tokens=9 is invalid: must be <= max_completion_tokens (5)"),
    # a JSON null (or true) inside a value was shown as Python's None (True)
    (parse_chat, {"messages": HI, "stop": ["a", None]}, "stop", "stop=['a', null] is invalid"),
    (parse_chat, {"messages": [{"role": None, "content": "x"}]}, "messages[0].role",
     "messages[0].role=null is invalid"),
    (parse_chat, {"messages": HI, "stream": True, "stream_options": {"include_usage": None}},
     "stream_options.include_usage", "include_usage=null is invalid: must be a boolean"),
    (parse_chat, {"messages": HI, "temperature": True}, "temperature",
     "temperature=true is invalid: must be a number"),
    (parse_chat, {"messages": HI, "response_format": {"type": "json_schema",
                                                      "json_schema": None}},
     "response_format.json_schema", "response_format.json_schema=null is invalid"),
    (parse_chat, {"messages": HI, "tool_choice": {"type": "function", "function": {
        "name": None}}}, "tool_choice", "{'name': null}"),
    # or said "not None" of a value left out (null): now "is missing", naming the part
    (parse_chat, {"messages": [{"role": "user", "content": None}]}, "messages[0].content",
     "messages[0].content is missing: a user message's content is a string or a list of text "
     "parts"),
    (parse_chat, {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     "messages[0].content[0].text", "messages[0].content[0].text is missing: a text part is"),
])  # fmt: skip
def test_errors_say_null_not_none(parse, body, param, words):
    with pytest.raises(APIError) as e:
        parse(body, INFO)
    assert e.value.param == param and words in e.value.message, e.value.message
    assert "None" not in e.value.message and "True" not in e.value.message


def test_a_null_in_structured_outputs_is_not_given():
    """As at the top level ({"regex": "a", "json_object": null} had been refused as
    "json_object=None is invalid: must be a bool")."""
    body = {"messages": HI, "structured_outputs": {"regex": "a", "json_object": None}}
    assert parse_chat(body, INFO).params.structured_outputs is not None


def test_null_is_not_given_and_unknown_fields_are_ignored(srv):
    nulls = dict.fromkeys(("temperature", "n", "stream", "stop", "tools", "tool_choice",
                           "reasoning_effort", "max_tokens", "logprobs", "seed", "user"))
    r = ok(post(srv, CHAT, {"messages": HI, "max_completion_tokens": 3, "whatever": [1], **nulls}))
    assert r["usage"]["completion_tokens"] <= 3
    body = {"prompt": "a", "max_tokens": None, "logprobs": None, "seed": 1, "x": {}}
    r = ok(post(srv, CMPL, body))
    assert r["usage"]["completion_tokens"] == 16  # the documented default
    assert schemas.CompletionRequest.model_fields["max_tokens"].default == 16


def test_unknown_fields_are_logged_once_a_name(srv, caplog):
    """vLLM logs the fields a request carries that it ignores; tinyoss dropped them in silence.
    A WARNING names each the first time, DEBUG after, so a typo shows once and traffic that
    repeats it cannot flood the log; fields it reads, or refuses, are never said ignored."""
    caplog.set_level("DEBUG", logger="tinyoss.server")
    name = f"x_{uuid.uuid4().hex[:12]}"  # new to this process whatever ran before
    known = {"request_id": "r", "priority": 0, "truncation_side": "left"}
    for path, body in ((CHAT, {"messages": HI, "max_tokens": 1, **known}),
                       (CMPL, {"prompt": "a", "max_tokens": 1, **known}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
                       ("/tokenize", {"prompt": "a"})):
        ok(post(srv, path, {**body, name: [1], "x_null": None}))
    said = [(r.levelno, r.getMessage()) for r in caplog.records if name in r.getMessage()]
    assert [level for level, _ in said] == [logging.WARNING] + [logging.DEBUG] * 3, said
    assert said[0][1].startswith("ignored fields of a request to /v1/chat/completions, which "
                                 f"tinyoss does not read: '{name}'; each name is logged once")
    assert [m.split(":")[0] for _, m in said[1:]] == [
        f"ignored fields of a request to {p}" for p in (CMPL, "/v1/responses", "/tokenize")]
    lines = [r.getMessage() for r in caplog.records if "ignored fields" in r.getMessage()]
    assert not any(f"'{k}'" in m for m in lines for k in [*known, "x_null"]), lines
    error(post(srv, CHAT, {"messages": HI, "guided_json": {}, name + "2": 1}))  # refused
    assert not any(name + "2" in r.getMessage() for r in caplog.records)


def test_made_up_field_names_cannot_flood_the_log(monkeypatch, caplog):
    """At most 16 names a line and _MAX_WARNED in all at WARNING; a name is escaped (no line
    break forges a log line) and clipped."""
    monkeypatch.setattr(protocol, "_warned", set())
    monkeypatch.setattr(protocol, "_MAX_WARNED", 20)
    caplog.set_level("DEBUG", logger="tinyoss.server")
    body = {"prompt": "a", **{f"f{i:03}": 1 for i in range(50)}, "a\nb" + "x" * 1000: 1}
    for _ in range(3):
        parse_completion(body, INFO)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and "(and 35 more: at DEBUG)" in warned[0], warned
    assert warned[0].split("read: ")[1].startswith("'a\\nb" + "x" * 61 + "...', 'f000'")
    assert "read: 'f015', 'f016', 'f017', 'f018' (and 47 more" in warned[1]  # 4 more: 20
    assert "later ones only at DEBUG" in warned[1]
    assert not any("\n" in r.getMessage() for r in caplog.records)
    assert len(protocol._warned) == 20


def test_the_request_models_mirror_the_code():
    """The Literals in the models are the values harmony and the protocol accept."""
    role = schemas.ChatMessage.model_fields["role"].annotation
    assert get_args(role) == harmony.ROLES
    effort = schemas.ChatCompletionRequest.model_fields["reasoning_effort"].annotation
    assert set(get_args(get_args(effort)[0])) == {"low", "medium", "high"}
    # parse_chat reads the body through the model: every field it reads is documented
    fields = schemas.ChatCompletionRequest.model_fields
    assert all(f.description for f in fields.values())
    for name in ("top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens",
                 "structured_outputs", "thinking_token_budget", "stream_options"):  # fmt: skip
        assert name in fields and fields[name].description


def test_validation_does_not_copy_the_text():
    """A 100 kB chat message is checked without copying its text (what keeps validation at
    microseconds; timed by no test: a loaded CI machine makes timings flaky)."""
    body = {"messages": [{"role": "user", "content": "x" * 100_000}], "temperature": 0.5}
    req = schemas.ChatCompletionRequest.model_validate(body)
    assert req.messages[0].content is body["messages"][0]["content"]


def test_parse_functions_keep_their_contract():
    """parse_chat / parse_completion take a dict (the Responses API calls parse_chat too)."""
    prep = parse_chat({"messages": HI, "stop": "x", "n": 2, "temperature": 0}, INFO)
    assert prep.content_stop == ["x"] and prep.params.n == 2 and prep.params.temperature == 0
    prep = parse_completion({"prompt": [[1, 2], [3]], "stream": True,
                             "stream_options": {"include_usage": True}}, INFO)  # fmt: skip
    assert prep.sources == [[1, 2], [3]] and prep.stream and prep.include_usage
    assert parse_completion({"prompt": ["ab", "c"]}, INFO).sources == [["ab"], ["c"]]
    with pytest.raises(APIError) as e:
        parse_chat({"messages": HI, "top_p": "1"}, INFO)
    assert (e.value.status, e.value.param) == (400, "top_p")


@pytest.mark.parametrize("field, value", [
    ("functions", []), ("function_call", "none"), ("audio", {}),
    ("prediction", {}), ("web_search_options", None), ("audio", None), ("logit_bias", {}),
    ("modalities", ["text"]), ("verbosity", "medium"),
])  # fmt: skip
def test_unsupported_fields_pass_when_they_ask_for_nothing(field, value):
    """An empty list or object (as JSON has them) asks for nothing: the check had compared
    values to (), which no JSON value equals."""
    assert parse_chat({"messages": HI, field: value}, INFO).params is not None


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}), ("audio", {"voice": "x"}),
    ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {}),
    ("modalities", ["text", "audio"]), ("modalities", []), ("function_call", "auto"),
    ("verbosity", "low"),  # as Responses refuses text.verbosity
])  # fmt: skip
def test_unsupported_fields_are_refused_when_they_ask(field, value):
    with pytest.raises(APIError) as e:
        parse_chat({"messages": HI, field: value}, INFO)
    assert (e.value.status, e.value.param) == (400, field)
    assert "is not supported" in e.value.message and "leave the field out" in e.value.message
    assert e.value.message.count("not supported") == 1, e.value.message  # said it twice
    assert e.value.message.count("leave") == 1, e.value.message  # verbosity's did


def test_logit_bias_and_allowed_token_ids_reach_the_engine():
    """OpenAI's logit_bias (token ids as string keys) and vLLM's allowed_token_ids had been
    refused; chat and completions now take them, as ints, to the sampler."""
    body = {"logit_bias": {"17": -100, "42": 2.5}, "allowed_token_ids": [17, 42, 9]}
    for params in (parse_chat({"messages": HI, **body}, INFO).params,
                   parse_completion({"prompt": "x", **body}, INFO).params):
        assert params.logit_bias == {17: -100.0, 42: 2.5}
        assert params.allowed_token_ids == [17, 42, 9]
    assert parse_chat({"messages": HI, "logit_bias": {}}, INFO).params.logit_bias is None
    for parse, body in ((parse_chat, {"messages": HI}), (parse_completion, {"prompt": "x"})):
        assert parse({**body, "bad_words": ["Paris", "a b"]}, INFO).params.bad_words == [
            "Paris", "a b"]


def test_cache_salt_reaches_the_engine():
    """vLLM's cache_salt had been ignored: the prefix cache was shared whatever the salt."""
    assert parse_chat({"messages": HI, "cache_salt": "a"}, INFO).params.cache_salt == "a"
    assert parse_completion({"prompt": "x", "cache_salt": "b"}, INFO).params.cache_salt == "b"
    for body in ({"messages": HI, "cache_salt": ""}, {"messages": HI, "cache_salt": 1}):
        with pytest.raises(APIError) as e:
            parse_chat(body, INFO)
        assert e.value.param == "cache_salt"


def test_a_refusal_part_of_an_assistant_message_is_its_text():
    """OpenAI's assistant messages may hold refusal parts: they had been refused as non-text."""
    said = [{"type": "refusal", "refusal": "I can't help with that."}]
    body = {"messages": [*HI, {"role": "assistant", "content": said}, *user("why?")]}
    segments = parse_chat(body, INFO).sources[0]
    at = segments.index("final")  # the past answer: <|channel|>final<|message|>text<|end|>
    assert segments[at + 2] == "I can't help with that."
    with pytest.raises(APIError) as e:  # a user's message holds no refusal
        parse_chat({"messages": user("x") + [{"role": "user", "content": said}]}, INFO)
    assert e.value.param == "messages[1].content[0]"


def test_an_assistant_message_refusal_field_is_its_text():
    """OpenAI's assistant message has a refusal field beside its content: it had been dropped
    (the past answer rendered empty) and any type taken."""
    said = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
    segments = parse_chat({"messages": [*HI, said, *user("why?")]}, INFO).sources[0]
    at = segments.index("final")
    assert segments[at + 2] == "I can't help with that."
    for bad, param in [({**said, "refusal": 3}, "messages[1].refusal"),
                       ({"role": "user", "content": "x", "refusal": "no"}, "messages[1].refusal")]:
        with pytest.raises(APIError) as e:
            parse_chat({"messages": [*HI, bad]}, INFO)
        assert e.value.param == param, e.value


# vLLM's fields that change the result, as a value that asks for it and one that does not
VLLM_SAMPLING = [("use_beam_search", True, False), ("logits_processors", ["m.P"], []),
                 ("structural_tag", '{"structures": []}', None)]
VLLM_CHAT = [("chat_template", "{{ messages }}", None), ("echo", True, False),
             ("documents", [{"title": "a", "text": "b"}], [])]


@pytest.mark.parametrize("path, field, asks, default", [
    *((CHAT, *case) for case in VLLM_SAMPLING + VLLM_CHAT),
    *((CMPL, *case) for case in VLLM_SAMPLING),
])  # fmt: skip
def test_vllm_fields_tinyoss_does_not_serve_are_refused(path, field, asks, default):
    """They were ignored: a 200 with an answer the client did not ask for."""
    parse, body = (parse_chat, {"messages": HI}) if path == CHAT else (parse_completion,
                                                                        {"prompt": "a"})
    assert parse({**body, field: default}, INFO).params is not None
    with pytest.raises(APIError) as e:
        parse({**body, field: asks}, INFO)
    assert (e.value.status, e.value.param) == (400, field)
    assert f"{field}=" in e.value.message and "is not supported" in e.value.message
    assert e.value.message.count("not supported") == 1, e.value.message  # said it twice
    assert e.value.message.count("leave") == 1, e.value.message  # verbosity's did


@pytest.mark.parametrize("path", [CHAT, CMPL])
def test_return_tokens_as_token_ids_is_taken(path):
    """vLLM's return_tokens_as_token_ids (a 400 before): true reaches the choices, false and
    null are the default; anything else is a 400 naming it."""
    parse, body = (parse_chat, {"messages": HI}) if path == CHAT else (parse_completion,
                                                                        {"prompt": "a"})
    field = "return_tokens_as_token_ids"
    assert parse({**body, "logprobs": 1 if path == CMPL else True, field: True},
                 INFO).tokens_as_ids is True
    assert parse({**body, field: True}, INFO).tokens_as_ids is True  # no logprobs: no effect
    for default in (False, None):
        assert parse({**body, field: default}, INFO).tokens_as_ids is False
    assert parse(body, INFO).tokens_as_ids is False
    with pytest.raises(APIError) as e:
        parse({**body, field: "yes"}, INFO)
    assert (e.value.status, e.value.param) == (400, field)


def test_priority_0_is_taken_and_any_other_is_refused(srv):
    """vLLM's priority: it was ignored (a 200 for a priority never applied); vLLM refuses any
    but 0 unless its priority scheduling is on, which tinyoss has none of."""
    for path, body in ((CHAT, {"messages": HI, "max_tokens": 1}),
                       (CMPL, {"prompt": "a", "max_tokens": 1}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 1})):
        ok(post(srv, path, {**body, "priority": 0}))
        for bad in (1, -5, 10**6):
            err = error(post(srv, path, {**body, "priority": bad}))
            assert err["param"] == "priority" and f"priority={bad} is not supported" in (
                err["message"]) and "first come, first served" in err["message"], err
        for bad in ("high", 0.0, True, [0]):
            err = error(post(srv, path, {**body, "priority": bad}))
            assert err["param"] == "priority" and "must be an integer" in err["message"], err


def system_text(body: dict) -> str:
    """The system message of the chat prompt `body` renders to."""
    segments = parse_chat({"messages": HI, **body}, INFO).sources[0]
    return segments[segments.index("system") + 2]  # system, <|message|>, its text


def test_chat_template_kwargs_set_gpt_oss_template_variables():
    """vLLM users set gpt-oss's reasoning_effort in chat_template_kwargs: it was ignored."""
    assert "Reasoning: medium" in system_text({})
    high = {"chat_template_kwargs": {"reasoning_effort": "high"}}
    assert "Reasoning: high" in system_text(high)
    assert "Reasoning: high" in system_text({**high, "reasoning_effort": "high"})
    assert "Reasoning: low" in system_text({"chat_template_kwargs": {"reasoning_effort": None},
                                            "reasoning_effort": "low"})  # fmt: skip
    me = system_text({"chat_template_kwargs": {"model_identity": "You are Tiny."}})
    assert me.startswith("You are Tiny.\n") and harmony.DEFAULT_IDENTITY not in me
    assert "Reasoning: medium" in system_text({"chat_template_kwargs": {"builtin_tools": []}})


@pytest.mark.parametrize("kwargs, top, param, words", [
    ({"reasoning_effort": "high"}, {"reasoning_effort": "low"},
     "chat_template_kwargs.reasoning_effort", "contradicts reasoning_effort='low'"),
    ({"reasoning_effort": "max"}, {}, "chat_template_kwargs.reasoning_effort", "'high'"),
    ({"model_identity": 3}, {}, "chat_template_kwargs.model_identity", "a string"),
    ({"builtin_tools": ["browser"]}, {}, "chat_template_kwargs.builtin_tools",
     "runs no browser or python tool"),
    ({"enable_thinking": False}, {}, "chat_template_kwargs.enable_thinking",
     "thinking_token_budget"),
    ({"tools": []}, {}, "chat_template_kwargs.tools", "give the top-level tools"),
    ({"custom": 1}, {}, "chat_template_kwargs.custom", "reads reasoning_effort, model_identity"),
])  # fmt: skip
def test_chat_template_kwargs_gpt_oss_does_not_read_are_refused(kwargs, top, param, words):
    with pytest.raises(APIError) as e:
        parse_chat({"messages": HI, "chat_template_kwargs": kwargs, **top}, INFO)
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message, e.value


def test_chat_template_kwargs_over_http(srv):
    """Chat and /tokenize render them alike (so /tokenize counts the chat's prompt)."""
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "high", "model_identity": "Tiny."}}
    count = ok(post(srv, "/tokenize", {"messages": HI, **kwargs}))["count"]
    assert count < ok(post(srv, "/tokenize", {"messages": HI}))["count"]
    answer = ok(post(srv, CHAT, {"messages": HI, "max_tokens": 1, **kwargs}))
    assert answer["usage"]["prompt_tokens"] == count
    err = error(post(srv, CHAT, {"messages": HI, "chat_template_kwargs": {"x": 1}}))
    assert err["param"] == "chat_template_kwargs.x"


def test_a_context_length_refusal_says_the_prompt_carries_tools_and_schema():
    """A schema or tools too large for the context: the refusal says the prompt carries them
    (it had blamed the messages alone, a two-word message here)."""
    import asyncio

    from tinyoss.engine.builder import load_tokenizer
    from tinyoss.server.protocol import tokenize

    big = {"enum": [f"v{i}" for i in range(3000)]}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": big}}
    tools = [{"type": "function", "function": {"name": "f", "description": "lorem " * 5000}}]
    for extra, words in (({"response_format": fmt}, "the response format's schema"),
                         ({"tools": tools}, "the tools' definitions")):
        prep = parse_chat({"messages": HI, **extra}, INFO)
        with pytest.raises(APIError) as e:
            asyncio.run(tokenize(prep, load_tokenizer(None), INFO))
        assert (e.value.param, e.value.code) == ("messages", "context_length_exceeded")
        assert e.value.message.endswith(f"The prompt carries {words} as well as the messages.")
    prep = parse_chat({"messages": HI}, INFO)
    assert prep.length_note == ""


def test_too_many_messages_are_refused_before_validation(monkeypatch):
    """More messages than the context can hold are refused at a glance, before validating
    each (220,000 developer messages took seconds holding the GIL): leading system and
    developer messages with text count a token each (they merge into one), later messages a
    whole message each; empty leading ones count nothing, so such a body is validated."""
    from tinyoss.server import protocol

    dev = {"role": "developer", "content": [{"type": "text", "text": "s"}]}
    validate = protocol.validate
    validated = []
    monkeypatch.setattr(protocol, "validate",
                        lambda *a, **k: validated.append(1) or validate(*a, **k))
    for messages in ([dev] * 5000 + HI, HI + [dev] * 1100):
        with pytest.raises(APIError) as e:
            parse_chat({"messages": messages}, INFO)
        assert not validated  # refused before the request model saw a message
        assert (e.value.param, e.value.code) == ("messages", "context_length_exceeded")
    empty = [{"role": "system", "content": ""}, {"role": "developer", "content": []}] * 2500
    assert parse_chat({"messages": empty + HI}, INFO).params is not None
    assert validated


# ---------------------------------------------------------------- (b) responses


def test_chat_responses_match_the_models(srv):
    body = {"messages": user(ANSWER), "max_tokens": 64, "logprobs": True, "top_logprobs": 2}
    answer = ok(post(srv, CHAT, body))
    exact(schemas.ChatCompletion, answer)
    message = answer["choices"][0]["message"]
    assert message["reasoning"] and message["content"] and "reasoning_content" not in message
    calls = ok(post(srv, CHAT, {"messages": user(WEATHER), "tools": TOOLS, "max_tokens": 64}))
    exact(schemas.ChatCompletion, calls)
    assert calls["choices"][0]["message"]["tool_calls"]
    for body in ({**body, "stream": True, "stream_options": {"include_usage": True}},
                 {"messages": user(WEATHER), "tools": TOOLS, "max_tokens": 64, "stream": True}):
        chunks = events(post(srv, CHAT, body))
        for chunk in chunks:
            exact(schemas.ChatCompletionChunk, chunk)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert deltas[0]["role"] == "assistant"
        assert any("reasoning" in d for d in deltas)
    assert any("tool_calls" in d for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_completion_responses_match_the_models(srv):
    body = {"prompt": ["Hello", "Hi there"], "n": 2, "max_tokens": 4, "logprobs": 2}
    answer = ok(post(srv, CMPL, body))
    exact(schemas.Completion, answer)
    assert len(answer["choices"]) == 4 and answer["choices"][0]["logprobs"]["tokens"]
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks = events(post(srv, CMPL, stream))
    for chunk in chunks:
        exact(schemas.CompletionChunk, chunk)
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    # one choice a chunk, as vLLM sends them (clients read choices[0]; several had shared one)
    assert all(len(c["choices"]) == 1 for c in chunks[:-1])
    assert {c["choices"][0]["index"] for c in chunks[:-1]} == {0, 1, 2, 3}
    chat = events(post(srv, CHAT, {"messages": HI, "n": 2, "max_tokens": 4, "stream": True}))
    assert all(len(c["choices"]) == 1 for c in chat)
    assert {c["choices"][0]["index"] for c in chat} == {0, 1}


def test_return_token_ids(srv):
    """vLLM's return_token_ids (it was ignored): the prompt's ids and each choice's, whole in an
    answer, the new ones in each stream chunk (the prompt's on the first)."""
    body = {"messages": user(ANSWER), "max_tokens": 64, "return_token_ids": True}
    prompt = ok(post(srv, "/tokenize", {"messages": user(ANSWER)}))["tokens"]
    answer = ok(post(srv, CHAT, body))
    exact(schemas.ChatCompletion, answer)
    ids = answer["choices"][0]["token_ids"]
    assert answer["prompt_token_ids"] == prompt and len(ids) == answer["usage"]["completion_tokens"]
    assert "<|channel|>final<|message|>Hello there, Paris!" in ok(post(
        srv, "/detokenize", {"tokens": ids}))["prompt"]  # fmt: skip
    chunks = events(post(srv, CHAT, {**body, "stream": True}))
    for chunk in chunks:
        exact(schemas.ChatCompletionChunk, chunk)
    assert [c.get("prompt_token_ids") for c in chunks] == [prompt] + [None] * (len(chunks) - 1)
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks), []) == ids

    hello = ok(post(srv, "/tokenize", {"prompt": "Hello"}))["tokens"]
    body = {"prompt": [hello, [1, 2, 3]], "n": 2, "max_tokens": 4, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    answer = ok(post(srv, CMPL, body))
    exact(schemas.Completion, answer)
    choices = answer["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [hello, hello, [1, 2, 3], [1, 2, 3]]
    assert all(len(c["token_ids"]) == 4 for c in choices)
    chunks = events(post(srv, CMPL, {**body, "stream": True}))
    for chunk in chunks:
        exact(schemas.CompletionChunk, chunk)
    for i in range(4):
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == i]
        assert mine[0]["prompt_token_ids"] == choices[i]["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert len(sum((c["token_ids"] for c in mine), [])) == 4
    plain = ok(post(srv, CMPL, {"prompt": "a", "max_tokens": 2}))["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_continuous_usage_stats(srv):
    """vLLM's stream_options.continuous_usage_stats (it was ignored, and bench/serve.py counts
    each chunk's tokens by it): with include_usage, every chunk carries the usage so far."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"messages": user(ANSWER), "max_tokens": 64, "stream": True, "stream_options": options}
    chunks = events(post(srv, CHAT, body))
    for chunk in chunks:
        exact(schemas.ChatCompletionChunk, chunk)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-2] == counts[-1] > 0
    assert chunks[-1]["choices"] == [] and len({c["usage"]["prompt_tokens"] for c in chunks}) == 1
    # the cached count: null in the opening chunk (sent before the engine says it), then one
    # value that never changes (it was 0 there and the real count after)
    again = events(post(srv, CHAT, body))  # the same prompt: found in the prefix cache
    for run in chunks, again:
        details = [c["usage"]["prompt_tokens_details"] for c in run]
        assert details[0] is None and None not in details[1:]
        assert len({d["cached_tokens"] for d in details[1:]}) == 1
    assert details[1]["cached_tokens"] > 0
    body = {"prompt": "a", "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {**options, "include_usage": False}}  # fmt: skip
    chunks = events(post(srv, CMPL, body))  # as in vLLM: no usage without include_usage
    assert all(c["choices"] and not c.get("usage") for c in chunks)
    body["stream_options"] = options
    chunks = events(post(srv, CMPL, body))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c["usage"] for c in chunks)
    # several prompts and choices: a chunk a choice, its usage its prompt's and its own tokens
    # (as vLLM counts it; it had counted every prompt and choice together)
    body = {"prompt": [[1, 2], [3, 4, 5]], "n": 2, "max_tokens": 4, "ignore_eos": True,
            "stream": True, "stream_options": options, "return_token_ids": True}
    chunks = events(post(srv, CMPL, body))
    made = [0] * 4
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        i = choice["index"]
        made[i] += len(choice["token_ids"] or [])
        usage = c["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (2 + i // 2, made[i])
        assert usage["total_tokens"] == 2 + i // 2 + made[i]
    assert made == [4] * 4
    assert {k: chunks[-1]["usage"][k] for k in ("prompt_tokens", "completion_tokens")} == {
        "prompt_tokens": 5, "completion_tokens": 16}  # each prompt once, as vLLM


@pytest.mark.parametrize("path, body", [
    (CHAT, {"messages": HI, "max_tokens": 3, "ignore_eos": True}),
    (CMPL, {"prompt": "a", "max_tokens": 3, "ignore_eos": True}),
])  # fmt: skip
def test_stream_options_include_the_usage_unless_told_not_to(srv, path, body):
    """As vLLM's StreamOptions: given at all, include_usage defaults to true (tinyoss had
    defaulted it to false, so `stream_options: {}` sent no usage chunk)."""
    body = {**body, "stream": True}
    for options in ({}, {"continuous_usage_stats": True}):
        chunks = events(post(srv, path, {**body, "stream_options": options}))
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        assert all(c["usage"] for c in chunks) == bool(options)  # continuous: on every chunk
    for options in ({"include_usage": False}, None):
        chunks = events(post(srv, path, {**body, "stream_options": options}))
        assert all(c["choices"] and not c.get("usage") for c in chunks), chunks


def test_an_empty_model_name_is_the_served_model(srv):
    """As vLLM: "" (as null or left out) asks for the served model (it was a 404)."""
    body = {"messages": HI, "max_tokens": 1, "model": "", "user": "u1", "store": False,
            "metadata": {"k": "v"}, "service_tier": "auto"}  # fmt: skip
    assert ok(post(srv, CHAT, body))["model"] == "tiny"


def test_other_responses_match_the_models(srv):
    tokens = ok(post(srv, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}))
    exact(schemas.TokenizeResponse, tokens)
    exact(schemas.TokenizeResponse, ok(post(srv, "/tokenize", {"messages": HI})))
    exact(schemas.DetokenizeResponse, ok(post(srv, "/detokenize", {"tokens": tokens["tokens"]})))
    headers = {"Authorization": f"Bearer {KEY}"}
    listed = exact(schemas.ModelList, ok(httpx.get(srv.url + "/v1/models", headers=headers)))
    one = exact(schemas.ModelCard, ok(httpx.get(srv.url + "/v1/models/tiny", headers=headers)))
    assert one == listed.data[0]  # the openai client's models.retrieve
    missing = error(httpx.get(srv.url + "/v1/models/gpt-5", headers=headers), 404)
    assert missing["code"] == "model_not_found" and "`gpt-5` does not exist" in missing["message"]
    error(httpx.get(srv.url + "/v1/models/tiny"), 401)
    exact(schemas.Health, ok(httpx.get(srv.url + "/health")))
    exact(schemas.Version, ok(httpx.get(srv.url + "/version")))
    error(post(srv, CHAT, {"messages": HI}, key=None), 401)
    error(post(srv, CHAT, {"messages": HI, "model": "gpt-5"}), 404)


@pytest.mark.parametrize("method, path, allow", [
    ("GET", CHAT, "POST"), ("PUT", CMPL, "POST"), ("POST", "/v1/models", "GET, HEAD"),
    ("POST", "/v1/responses/resp_x", "DELETE, GET, HEAD"),  # two routes share the path
    ("DELETE", "/ping", "GET, HEAD, POST"),
])  # fmt: skip
def test_a_405_says_which_methods_are_allowed(srv, method, path, allow):
    """RFC 9110: a 405 carries an Allow header; the error handler had dropped it."""
    r = httpx.request(method, srv.url + path, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and r.headers.get("allow") == allow
    assert error(r, 405)["message"].startswith(f"{path}: Method Not Allowed")


def test_a_drift_is_caught():
    """A field the server sent and the models lack fails the check (as a missing one does)."""
    detok = {"prompt": "x"}
    with pytest.raises(AssertionError, match="fields the model lacks"):
        exact(schemas.DetokenizeResponse, {**detok, "new": 1})
    with pytest.raises(ValueError):
        exact(schemas.TokenizeResponse, {"count": 1, "tokens": [1], "token_strs": None})


# ---------------------------------------------------------------- (c) /openapi.json

ROUTES = {
    "/v1/chat/completions": "post", "/v1/completions": "post", "/tokenize": "post",
    "/detokenize": "post", "/v1/models": "get", "/v1/models/{id}": "get", "/health": "get",
    "/version": "get", "/metrics": "get",
}  # fmt: skip


def resolve(doc: dict, ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node = doc
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def check_refs_and_schemas(doc: dict) -> None:
    """Every $ref resolves, and every component schema is a valid JSON schema (2020-12)."""
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "$ref" in node:
                resolve(doc, node["$ref"])
            stack += node.values()
        elif isinstance(node, list):
            stack += node
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_openapi_document(srv):
    r = httpx.get(srv.url + "/openapi.json")  # no API key needed, as /health
    doc = ok(r)
    assert r.headers["content-type"] == "application/json"
    assert doc["openapi"] == "3.1.0" and doc["info"]["title"] and doc["info"]["version"]
    for path, method in ROUTES.items():
        op = doc["paths"][path][method]
        assert "200" in op["responses"] and op["summary"]
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]
        assert {"400", "401", "404"} <= set(op["responses"])
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert "text/event-stream" in doc["paths"][path]["post"]["responses"]["200"]["content"]
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert doc["paths"]["/health"]["get"]["security"] == []
    check_refs_and_schemas(doc)
    # the documented fields
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"]
    for name in ("messages", "temperature", "top_k", "min_p", "repetition_penalty", "ignore_eos",
                 "min_tokens", "structured_outputs", "thinking_token_budget", "response_format",
                 "stream_options", "tools", "tool_choice", "reasoning_effort"):  # fmt: skip
        assert chat["properties"][name]["description"], name
    message = doc["components"]["schemas"]["AssistantMessage"]["properties"]
    assert {"reasoning", "reasoning_content", "tool_calls"} <= set(message)
    usage = doc["components"]["schemas"]["Usage"]["properties"]
    assert "prompt_tokens_details" in usage
    # the document describes the live responses too (as JSON schema, not only as pydantic)
    answer = ok(post(srv, CHAT, {"messages": user(ANSWER), "max_tokens": 64, "logprobs": True}))
    jsonschema.validate(answer, {"$ref": "#/components/schemas/ChatCompletion", **doc})
    bad = {**answer, "choices": [{"index": "0"}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, {"$ref": "#/components/schemas/ChatCompletion", **doc})


def test_openapi_hook_adds_routes():
    """The hook the Responses API uses: more paths and models, same components."""

    class Thing(BaseModel):
        name: str

    extra = {"/v1/things": {"get": {"responses": {"200": {"description": "OK", "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/Thing"}}}}}}}}  # fmt: skip
    doc = schemas.build_openapi(extra, extra_responses=(Thing,))
    assert "/v1/things" in doc["paths"] and "/v1/chat/completions" in doc["paths"]
    assert doc["components"]["schemas"]["Thing"]["properties"]["name"]["type"] == "string"


def test_openapi_documents_the_responses_api(srv):
    """/v1/responses and its routes by id, and live answers exactly as ResponseObject says."""
    doc = ok(httpx.get(srv.url + "/openapi.json"))
    check_refs_and_schemas(doc)
    routes = {"/v1/responses": ("post",), "/v1/responses/{id}": ("get", "delete"),
              "/v1/responses/{id}/cancel": ("post",),
              "/v1/responses/{id}/input_items": ("get",)}  # fmt: skip
    for path, methods in routes.items():
        for method in methods:
            op = doc["paths"][path][method]
            assert "200" in op["responses"] and "404" in op["responses"] and op["summary"]
    create = doc["paths"]["/v1/responses"]["post"]
    request = create["requestBody"]["content"]["application/json"]["schema"]
    assert request == {"$ref": "#/components/schemas/ResponseCreateRequest"}
    assert set(create["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert doc["paths"]["/v1/responses/{id}"]["parameters"][0]["in"] == "path"
    fields = doc["components"]["schemas"]["ResponseCreateRequest"]["properties"]
    assert "input" in doc["components"]["schemas"]["ResponseCreateRequest"]["required"]
    assert all(field["description"] for field in fields.values())
    assert all(f.description for f in schemas.ResponseCreateRequest.model_fields.values())

    def respond(body: dict) -> dict:
        answer = ok(post(srv, "/v1/responses", body))
        exact(schemas.ResponseObject, answer)
        jsonschema.validate(answer, {"$ref": "#/components/schemas/ResponseObject", **doc})
        return answer

    answer = respond({"input": ANSWER, "max_output_tokens": 64, "metadata": {"k": "v"}})
    assert [o["type"] for o in answer["output"]] == ["reasoning", "message"]
    lps = respond({"input": ANSWER, "max_output_tokens": 64, "top_logprobs": 1,
                   "include": ["message.output_text.logprobs"]})  # fmt: skip
    assert lps["output"][1]["content"][0]["logprobs"][0]["top_logprobs"]
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    calls = respond({"input": WEATHER, "tools": tools, "max_output_tokens": 64})
    assert calls["output"][-1]["type"] == "function_call"
    short = respond({"input": "hi", "max_output_tokens": 3, "reasoning": {"effort": "low"}})
    assert short["status"] == "incomplete" and short["incomplete_details"]
    headers = {"Authorization": f"Bearer {KEY}"}
    url = srv.url + "/v1/responses/" + answer["id"]
    exact(schemas.ResponseObject, ok(httpx.get(url, headers=headers)))
    listed = ok(httpx.get(url + "/input_items", headers=headers))
    exact(schemas.ResponseItemList, listed)
    jsonschema.validate(listed, {"$ref": "#/components/schemas/ResponseItemList", **doc})
    exact(schemas.ResponseDeleted, ok(httpx.delete(url, headers=headers)))
    error(httpx.get(url, headers=headers), 404)


OPERATION_IDS = {  # OpenAI's own names where its spec has the operation
    ("/v1/chat/completions", "post"): "createChatCompletion",
    ("/v1/completions", "post"): "createCompletion",
    ("/v1/responses", "post"): "createResponse",
    ("/v1/responses/{id}", "get"): "getResponse",
    ("/v1/responses/{id}", "delete"): "deleteResponse",
    ("/v1/responses/{id}/input_items", "get"): "listInputItems",
    ("/v1/responses/{id}/cancel", "post"): "cancelResponse",
    ("/v1/models", "get"): "listModels",
    ("/v1/models/{id}", "get"): "retrieveModel",
}
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def operations(doc: dict) -> dict[tuple[str, str], dict]:
    return {(path, m): op for path, item in doc["paths"].items()
            for m, op in item.items() if m in METHODS}  # fmt: skip


def keyless_and_keyed_docs() -> dict[bool, dict]:
    """/openapi.json of an app without an API key and of one with (no engine started: the
    app's lifespan does not run outside a `with`)."""
    from starlette.testclient import TestClient

    docs = {}
    for key in (None, KEY):
        r = TestClient(create_app(TINY, model_name="tiny", api_key=key)).get("/openapi.json")
        docs[key is not None] = ok(r)
    return docs


def test_openapi_every_route_and_operation_is_documented_once():
    """Every route of the app and method is an operation of the document, and back; each has
    an operationId, unique, OpenAI's where its spec has one; /ping takes GET and POST (vLLM)."""
    app = create_app(TINY, model_name="tiny")
    served = {(r.path.replace(":path}", "}"), m.lower()) for r in app.routes
              for m in r.methods - {"HEAD"}}  # fmt: skip
    for doc in keyless_and_keyed_docs().values():
        ops = operations(doc)
        assert set(ops) == served
        ids = [op["operationId"] for op in ops.values()]
        assert len(ids) == len(set(ids)) and all(ids), ids
        assert {k: ops[k]["operationId"] for k in OPERATION_IDS} == OPERATION_IDS
        assert {"get", "post"} <= set(doc["paths"]["/ping"])
        check_refs_and_schemas(doc)


def test_openapi_declares_the_bearer_key_only_when_the_server_has_one():
    """A client generated from the document must not ask for a key the server lacks."""
    docs = keyless_and_keyed_docs()
    keyed, keyless = docs[True], docs[False]
    assert keyed["security"] == [{"bearer": []}]
    assert keyed["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    ops = operations(keyed)
    assert ops[("/health", "get")]["security"] == [] == ops[("/ping", "post")]["security"]
    assert "401" in ops[("/v1/chat/completions", "post")]["responses"]
    assert "401" in ops[("/v1/responses/{id}", "get")]["responses"]
    assert "security" not in keyless and "securitySchemes" not in keyless["components"]
    assert "Error401" not in keyless["components"]["responses"]
    for where, op in operations(keyless).items():
        assert "security" not in op and "401" not in op["responses"], where
    # the rest is the same document
    assert set(operations(keyless)) == set(ops)
    assert keyless["components"]["schemas"] == keyed["components"]["schemas"]


def test_post_ping_answers_as_get_does(srv):
    for method in ("GET", "POST"):
        r = httpx.request(method, srv.url + "/ping")  # no key needed, as documented
        assert r.status_code == 200 and r.json() == ok(httpx.get(srv.url + "/health"))


def test_chat_answers_and_chunks_carry_one_system_fingerprint(srv):
    """OpenAI's system_fingerprint on every chat and completions answer and chunk (the usage
    chunk too), the same all the server's life; a hash of what may change the answers to one
    seed."""
    from dataclasses import replace

    from tinyoss.server.app import system_fingerprint

    answers, chunks = [], []
    for path, body in ((CHAT, {"messages": user(ANSWER), "max_tokens": 64}),
                       (CMPL, {"prompt": "Hello", "max_tokens": 8})):  # fmt: skip
        answers += [ok(post(srv, path, body)) for _ in range(2)]
        chunks += events(post(srv, path, {**body, "stream": True,
                                          "stream_options": {"include_usage": True}}))
    prints = {a["system_fingerprint"] for a in answers + chunks}
    assert prints == {system_fingerprint(TINY)} and not chunks[-1]["choices"]
    assert re.fullmatch(r"fp_[0-9a-f]{10}", system_fingerprint(TINY))
    for change in ({"dtype": "bfloat16"}, {"model": "openai/gpt-oss-20b"},
                   {"fp8_layers": "qkv"}):  # fmt: skip
        assert system_fingerprint(replace(TINY, **change)) != system_fingerprint(TINY), change
    assert system_fingerprint(replace(TINY, max_num_seqs=3)) == system_fingerprint(TINY)
