"""Bad input, one class a row: each is sent to the live server, which must answer the expected
status with the OpenAI error shape naming the right field in "param" (never a 5xx, never a
dropped connection), and a normal 1-token completion must succeed right after it.

A row: method, path, headers, the body (raw bytes, or JSON made from a Python value; lone
surrogates in a Python str become \\udXXX escapes), the expected status (a tuple: any of them;
None: anything but a 5xx), and the expected param (ANY: not checked; a tuple: any of them).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.reliability.helpers import (
    ANY,
    CHAT,
    COMPLETIONS,
    KEY,
    MAX_N,
    MAX_REQUEST_TOKENS,
    MODEL,
    TIMEOUT,
    TRACKER,
    Api,
    Hang,
    Lost,
    check_error,
)

USER = [{"role": "user", "content": "hi"}]
DROP = object()  # chat()/cmpl(): leave the field out
NOBODY = object()  # a request without a body (GET)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _merge(base: dict, kw: dict) -> dict:
    out = dict(base)
    for k, v in kw.items():
        if v is DROP:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def chat(**kw: Any) -> dict:
    return _merge({"model": MODEL, "messages": USER, "max_tokens": 1}, kw)


def cmpl(**kw: Any) -> dict:
    return _merge({"model": MODEL, "prompt": "hi", "max_tokens": 1}, kw)


def with_json(body: dict, key: str, raw: str) -> bytes:
    """`body` as JSON with `key` set to the raw JSON text `raw` (for 1e999 and other values
    json.dumps cannot write)."""
    text = json.dumps({**body, key: "@@RAW@@"})
    return text.replace('"@@RAW@@"', raw).encode()


@dataclass
class Case:
    id: str
    body: Any
    status: int | tuple[int, ...] | None
    param: Any = ANY
    path: str = CHAT
    method: str = "POST"
    headers: dict | None = None
    code: Any = ANY
    contains: str | None = None
    auth: bool = True  # send "Authorization: Bearer KEY" (unless headers name one)
    ctype: str | None = "application/json"

    def content(self) -> bytes | None:
        if self.body is NOBODY:
            return None
        if isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode()


def C(id: str, body: Any, status: Any, param: Any = ANY, **kw: Any) -> Case:
    return Case(id, body, status, param, **kw)


def P(id: str, body: Any, status: Any, param: Any = ANY, **kw: Any) -> Case:
    return Case(id, body, status, param, path=COMPLETIONS, **kw)


DEEP = 10_000
CASES: list[Case] = [
    # -------------------------------------------------------------- malformed JSON
    C("json-garbage", b"{nope", 400),
    C("body-gzip-encoded", gzip.compress(json.dumps(chat()).encode()), 415,
      headers={"Content-Encoding": "gzip"}, code="unsupported_media_type",
      contains="send the request body uncompressed"),
    C("body-identity-encoded", chat(), 200, headers={"Content-Encoding": "identity"}),
    # a byte-order mark may lead JSON (RFC 8259 lets parsers ignore it): Python's hint before
    C("body-utf8-bom", b"\xef\xbb\xbf" + json.dumps(chat()).encode(), 200),
    # named, not shown as the parsed object (its dataclass repr had been the message)
    C("structured-outputs-two-kinds", chat(structured_outputs={"regex": "a", "choice": ["b"]}),
      400, "structured_outputs", contains="regex and choice are given"),
    C("json-empty-body", b"", 400),
    C("json-lone-brace", b"{", 400),
    C("json-truncated-chat", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"', 400),
    P("json-truncated-completion", b'{"prompt": "hi", "max_tokens": 1', 400),
    C("json-single-quotes", b"{'messages': [{'role': 'user', 'content': 'hi'}]}", 400),
    C("json-trailing-comma", b'{"messages": [{"role": "user", "content": "hi"}],}', 400),
    C("json-trailing-garbage", json.dumps(chat()).encode() + b" x", 400),
    C("json-two-objects", json.dumps(chat()).encode() * 2, 400),
    P("json-binary-bytes", b"\x00\x01\x02\x03", 400),
    C("json-bare-NaN", b"NaN", 400),
    C("json-unquoted-key", b"{messages: []}", 400),
    # -------------------------------------------------------------- not an object
    C("body-array", b"[1]", 400),
    C("body-string", b'"hello"', 400),
    C("body-number", b"5", 400),
    C("body-null", b"null", 400),
    C("body-true", b"true", 400),
    P("body-empty-array", b"[]", 400),
    P("body-array-of-requests", json.dumps([cmpl()]).encode(), 400),
    # -------------------------------------------------------------- 10,000-deep nesting
    C("deep-array-body", b"[" * DEEP + b"]" * DEEP, 400),
    C("deep-array-in-messages", b'{"messages": ' + b"[" * DEEP + b"]" * DEEP + b"}", 400),
    P("deep-object-in-prompt", b'{"prompt": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}", 400),
    C("deep-array-in-content", json.dumps(chat()).encode().replace(
        b'"content": "hi"', b'"content": ' + b"[" * DEEP + b"]" * DEEP), 400),
    # -------------------------------------------------------------- invalid UTF-8
    C("utf8-invalid-bytes", b'{"messages": [{"role": "user", "content": "\xff\xfe"}], "max_tokens": 1}', 400),
    P("utf8-overlong", b'{"prompt": "\xc0\xaf", "max_tokens": 1}', 400),
    P("utf8-encoded-surrogate", b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 1}', 400),
    P("utf8-truncated-sequence", b'{"prompt": "a\xe2\x82", "max_tokens": 1}', 400),
    # -------------------------------------------------------------- lone surrogates
    P("surrogate-in-prompt", cmpl(prompt="a\ud800b"), 400, "prompt"),
    P("surrogate-low-in-prompt", cmpl(prompt="a\udc00"), 400, "prompt"),
    P("surrogate-in-prompt-list", cmpl(prompt=["ok", "a\ud800"]), 400, "prompt"),
    C("surrogate-in-content", chat(messages=[{"role": "user", "content": "a\ud800b"}]), 400, "messages"),
    C("surrogate-in-content-part", chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]), 400, "messages"),
    C("surrogate-in-system", chat(messages=[{"role": "system", "content": "\ud83d"}, *USER]), 400, "messages"),
    C("surrogate-in-model", chat(model="a\ud800b"), (400, 404)),
    C("surrogate-in-tool-name", chat(tools=[{"type": "function", "function": {"name": "f\ud800"}}]), 400, "tools"),
    C("surrogate-in-stop", chat(stop="\ud800"), None),
    C("surrogate-in-unknown-field", chat(user="\ud800"), None),
    # -------------------------------------------------------------- model
    C("model-unknown-chat", chat(model="gpt-5"), 404, "model", code="model_not_found", contains="gpt-5"),
    P("model-unknown-completion", cmpl(model="other"), 404, "model", code="model_not_found"),
    C("model-not-a-string", chat(model=5), (400, 404), "model"),
    C("model-empty", chat(model=""), 200, None),  # the served model, as in vLLM
    # -------------------------------------------------------------- messages
    C("messages-missing", chat(messages=DROP), 400, "messages"),
    C("messages-null", chat(messages=None), 400, "messages"),
    C("messages-empty", chat(messages=[]), 400, "messages"),
    C("messages-string", chat(messages="hi"), 400, "messages"),
    C("messages-object", chat(messages={"role": "user", "content": "hi"}), 400, "messages"),
    C("messages-item-number", chat(messages=[5]), 400, "messages"),
    C("messages-item-string", chat(messages=["hi"]), 400, "messages"),
    C("messages-unknown-role", chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages", contains="robot"),
    C("messages-missing-role", chat(messages=[{"content": "x"}]), 400, "messages"),
    C("messages-role-number", chat(messages=[{"role": 5, "content": "x"}]), 400, "messages"),
    C("content-number", chat(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    C("content-object", chat(messages=[{"role": "user", "content": {"a": 1}}]), 400, "messages"),
    C("content-list-of-number", chat(messages=[{"role": "user", "content": [5]}]), 400, "messages"),
    C("content-image-part", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]),
        400, "messages", contains="image_url"),
    C("content-audio-part", chat(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]),
        400, "messages", contains="input_audio"),
    C("content-text-part-without-text", chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, "messages"),
    C("content-text-part-number", chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), 400, "messages"),
    C("assistant-tool-calls-not-list", chat(messages=[*USER, {"role": "assistant", "tool_calls": "x"}, *USER]), 400, "messages"),
    C("too-many-messages-for-context", chat(messages=[{"role": "user", "content": "hello there"}] * 2000),
        400, ("messages", "max_tokens"), code="context_length_exceeded"),
    # -------------------------------------------------------------- tools, tool_choice, reasoning
    C("tools-string", chat(tools="x"), 400, "tools"),
    C("tools-object", chat(tools={"type": "function", "function": {"name": "f"}}), 400, "tools"),
    C("tools-item-number", chat(tools=[5]), 400, "tools"),
    C("tool-without-function", chat(tools=[{"type": "function"}]), 400, "tools"),
    C("tool-function-without-name", chat(tools=[{"type": "function", "function": {}}]), 400, "tools"),
    C("tool-function-empty-name", chat(tools=[{"type": "function", "function": {"name": ""}}]), 400, "tools"),
    C("tool-function-name-number", chat(tools=[{"type": "function", "function": {"name": 5}}]), 400, "tools"),
    C("tool-parameters-string", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "oops"}}]), 400, "tools"),
    C("tool-type-not-function", chat(tools=[{"type": "code_interpreter"}]), 400, "tools"),
    C("tool-choice-unknown-string", chat(tool_choice="x", tools=TOOLS), 400, "tool_choice"),
    C("tool-choice-number", chat(tool_choice=5, tools=TOOLS), 400, "tool_choice"),
    C("tool-choice-unknown-function", chat(tool_choice={"type": "function", "function": {"name": "nope"}}, tools=TOOLS), 400, "tool_choice"),
    C("tool-choice-without-name", chat(tool_choice={"type": "function"}, tools=TOOLS), 400, "tool_choice"),
    C("reasoning-effort-unknown", chat(reasoning_effort="max"), 400, "reasoning_effort"),
    C("reasoning-effort-number", chat(reasoning_effort=5), 400, "reasoning_effort"),
    # -------------------------------------------------------------- sampling fields (chat)
    C("temperature-negative", chat(temperature=-1), 400, "temperature"),
    C("temperature-string", chat(temperature="hot"), 400, "temperature"),
    C("temperature-bool", chat(temperature=True), 400, "temperature"),
    C("temperature-1e999", with_json(chat(), "temperature", "1e999"), 400, "temperature"),
    C("temperature-NaN-literal", with_json(chat(), "temperature", "NaN"), 400, "temperature"),
    C("max-tokens-5000-digits", with_json(chat(), "max_tokens", "9" * 5000), 400, "max_tokens"),
    C("top-p-two", chat(top_p=2), 400, "top_p"),
    C("top-k-negative", chat(top_k=-5), 400, "top_k"),
    C("top-k-float", chat(top_k=1.5), 400, "top_k"),
    C("min-p-two", chat(min_p=2), 400, "min_p"),
    C("seed-string", chat(seed="x"), 400, "seed"),
    C("seed-2-pow-70", chat(seed=2**70), 400, "seed"),
    C("seed-float", chat(seed=1.5), 400, "seed"),
    C("presence-penalty-3", chat(presence_penalty=3), 400, "presence_penalty"),
    C("frequency-penalty-3", chat(frequency_penalty=3), 400, "frequency_penalty"),
    C("repetition-penalty-0", chat(repetition_penalty=0), 400, "repetition_penalty"),
    C("ignore-eos-string", chat(ignore_eos="yes"), 400, "ignore_eos"),
    C("n-zero", chat(n=0), 400, "n"),
    C("n-negative", chat(n=-1), 400, "n"),
    C("n-string", chat(n="2"), 400, "n"),
    C("n-float", chat(n=1.5), 400, "n"),
    C("n-above-max-n", chat(n=MAX_N + 1), 400, "n"),
    C("n-above-default-max-n", chat(n=129, stream=True), 400, "n"),
    C("max-tokens-zero", chat(max_tokens=0), 400, "max_tokens"),
    C("max-tokens-negative", chat(max_tokens=-1), 400, "max_tokens"),
    C("max-tokens-string", chat(max_tokens="5"), 400, "max_tokens"),
    C("max-tokens-float", chat(max_tokens=2.5), 400, "max_tokens"),
    C("max-tokens-beyond-context", chat(max_tokens=100_000), 400, "max_tokens", code="context_length_exceeded"),
    C("max-tokens-10-pow-30", chat(max_tokens=10**30), 400, "max_tokens"),
    C("max-completion-tokens-zero", chat(max_completion_tokens=0, max_tokens=DROP), 400, "max_completion_tokens"),
    C("min-tokens-above-max-tokens", chat(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    C("stop-number", chat(stop=5), 400, "stop"),
    C("stop-list-of-numbers", chat(stop=[1]), 400, "stop"),
    C("stop-empty-string", chat(stop=""), 400, "stop"),
    C("stop-list-with-empty-string", chat(stop=["a", ""]), 400, "stop"),
    C("logprobs-int-on-chat", chat(logprobs=1), 400, "logprobs"),
    C("logprobs-string-on-chat", chat(logprobs="yes"), 400, "logprobs"),
    C("top-logprobs-100", chat(logprobs=True, top_logprobs=100), 400, "top_logprobs"),
    C("top-logprobs-negative", chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    C("top-logprobs-without-logprobs", chat(top_logprobs=2), 400, "top_logprobs"),
    C("stream-string", chat(stream="yes"), 400, "stream"),
    C("stream-options-number", chat(stream=True, stream_options=5), 400, "stream_options"),
    C("stream-options-string", chat(stream=True, stream_options="x"), 400, "stream_options"),
    C("include-usage-string", chat(stream=True, stream_options={"include_usage": "yes"}), 400,
        ("stream_options", "include_usage", "stream_options.include_usage")),
    # -------------------------------------------------------------- sampling fields (completions)
    P("cmpl-temperature-negative", cmpl(temperature=-1), 400, "temperature"),
    P("cmpl-top-p-two", cmpl(top_p=2), 400, "top_p"),
    P("cmpl-max-tokens-zero", cmpl(max_tokens=0), 400, "max_tokens"),
    P("cmpl-max-tokens-beyond-context", cmpl(max_tokens=100_000), 400, "max_tokens", code="context_length_exceeded"),
    P("cmpl-n-zero", cmpl(n=0), 400, "n"),
    P("cmpl-n-above-max-n", cmpl(n=MAX_N + 1), 400, "n"),
    P("cmpl-n-times-max-tokens-above-limit", cmpl(n=4, max_tokens=MAX_REQUEST_TOKENS // 4 + 100, stream=True), 400, "max_tokens"),
    P("cmpl-stop-list-of-numbers", cmpl(stop=[1]), 400, "stop"),
    P("cmpl-seed-string", cmpl(seed="x"), 400, "seed"),
    # -------------------------------------------------------------- completions prompt
    P("prompt-missing", cmpl(prompt=DROP), 400, "prompt"),
    P("prompt-null", cmpl(prompt=None), 400, "prompt"),
    P("prompt-empty-string", cmpl(prompt=""), 400, "prompt"),
    P("prompt-empty-list", cmpl(prompt=[]), 400, "prompt"),
    P("prompt-list-of-empty-list", cmpl(prompt=[[]]), 400, "prompt"),
    P("prompt-number", cmpl(prompt=5), 400, "prompt"),
    P("prompt-object", cmpl(prompt={"a": 1}), 400, "prompt"),
    P("prompt-bool", cmpl(prompt=True), 400, "prompt"),
    P("prompt-mixed-str-int", cmpl(prompt=["a", 1]), 400, "prompt"),
    P("prompt-mixed-nested", cmpl(prompt=[[1], "a", 3]), 400, "prompt"),
    P("prompt-id-out-of-vocab", cmpl(prompt=[10**9]), 400, "prompt"),
    P("prompt-id-2-pow-70", cmpl(prompt=[2**70]), 400, "prompt"),
    P("prompt-id-negative", cmpl(prompt=[-1]), 400, "prompt"),
    P("prompt-id-bool", cmpl(prompt=[True, 1]), 400, "prompt"),
    P("prompt-id-float", cmpl(prompt=[1.5]), 400, "prompt"),
    P("prompt-nested-id-out-of-vocab", cmpl(prompt=[[1, 2], [10**9]]), 400, "prompt"),
    P("logprobs-100", cmpl(logprobs=100), 400, "logprobs"),
    P("logprobs-string", cmpl(logprobs="x"), 400, "logprobs"),
    P("logprobs-bool-on-completions", cmpl(logprobs=True), 400, "logprobs"),
    P("echo-with-logprobs-21", cmpl(echo=True, logprobs=21), 400, "logprobs"),
    P("echo-string", cmpl(echo="yes"), 400, "echo"),
    P("suffix", cmpl(suffix="x"), 400, "suffix"),
    P("best-of-not-n", cmpl(best_of=3), 400, "best_of"),
    # -------------------------------------------------------------- unsupported fields
    C("response-format-unknown-type", chat(response_format={"type": "xml"}), 400, "response_format"),
    C("response-format-schema-not-object", chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}), 400, "response_format"),
    C("response-format-unenforceable", chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}), 400, "response_format"),
    C("response-format-json-object-accepted", chat(response_format={"type": "json_object"}), 200),
    C("response-format-text-accepted", chat(response_format={"type": "text"}), 200),
    C("logit-bias-accepted", chat(logit_bias={"5": 10}), 200),
    P("cmpl-logit-bias-accepted", cmpl(logit_bias={"5": -100}), 200),
    C("logit-bias-key-not-an-id", chat(logit_bias={"five": 10}), 400, "logit_bias"),
    C("logit-bias-key-negative", chat(logit_bias={"-5": 10}), 400, "logit_bias"),
    C("logit-bias-key-leading-zero", chat(logit_bias={"05": 10, "5": -10}), 400, "logit_bias"),
    C("logit-bias-key-huge", chat(logit_bias={"9" * 40: 10}), 400, "logit_bias"),
    P("cmpl-logit-bias-out-of-vocab", cmpl(logit_bias={"999999999": 1}), 400, "logit_bias"),
    C("logit-bias-over-100", chat(logit_bias={"5": 100.5}), 400, "logit_bias"),
    C("logit-bias-nan", chat(logit_bias={"5": "NaN"}), 400, ANY),
    P("cmpl-allowed-ids-out-of-vocab", cmpl(allowed_token_ids=[1, 10**12]), 400, "allowed_token_ids"),
    P("cmpl-allowed-ids-accepted", cmpl(allowed_token_ids=[5, 6]), 200),
    C("bad-words-accepted", chat(bad_words=["the", "a b c"]), 200),
    P("cmpl-bad-words-blank", cmpl(bad_words=["ok", "  "]), 400, "bad_words"),
    C("bad-words-too-many", chat(bad_words=["w"] * 5000), 400, "bad_words"),
    C("logit-bias-empty-accepted", chat(logit_bias={}), 200),
    C("legacy-functions", chat(functions=[{"name": "f", "parameters": {"type": "object"}}]), 400, "functions"),
    C("legacy-function-call", chat(function_call="auto"), 400, "function_call"),
    C("audio", chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio"),
    C("modalities-audio", chat(modalities=["text", "audio"]), 400, "modalities"),
    C("prediction", chat(prediction={"type": "content", "content": "x"}), 400, "prediction"),
    # -------------------------------------------------------------- auth
    C("auth-missing", chat(), 401, auth=False),
    C("auth-wrong-key", chat(), 401, headers={"Authorization": "Bearer nope"}),
    C("auth-lowercase-bearer", chat(), 200, headers={"Authorization": f"bearer {KEY}"}),
    C("auth-uppercase-bearer", chat(), 200, headers={"Authorization": f"BEARER {KEY}"}),
    C("auth-key-without-scheme", chat(), 401, headers={"Authorization": KEY}),
    C("auth-basic-scheme", chat(), 401, headers={"Authorization": f"Basic {KEY}"}),
    C("auth-bearer-without-key", chat(), 401, headers={"Authorization": "Bearer"}),
    C("auth-key-prefix", chat(), 401, headers={"Authorization": f"Bearer {KEY[:-1]}"}),
    Case("unknown-v1-path-without-key", NOBODY, 401, method="GET", path="/v1/nothing", auth=False),
    Case("unknown-v1-path-with-key", NOBODY, 404, method="GET", path="/v1/nothing"),
    Case("unknown-v1-post-with-key", cmpl(), 404, path="/v1/foo/bar"),
    Case("unknown-root-path", NOBODY, 404, method="GET", path="/nothing", auth=False),
    # -------------------------------------------------------------- methods
    Case("get-chat-completions", NOBODY, 405, method="GET", path=CHAT),
    Case("get-completions", NOBODY, 405, method="GET", path=COMPLETIONS),
    Case("put-chat-completions", chat(), 405, method="PUT", path=CHAT),
    Case("delete-models", NOBODY, 405, method="DELETE", path="/v1/models"),
    Case("post-models", cmpl(), 405, path="/v1/models"),
    # -------------------------------------------------------------- content type and oddities
    # browsers send these to any origin without a preflight: refused, as FastAPI (vLLM) does
    C("content-type-text-plain", chat(), 415, ctype="text/plain"),
    C("content-type-form", chat(), 415, ctype="application/x-www-form-urlencoded"),
    C("content-type-multipart", chat(), 415, ctype="multipart/form-data; boundary=x"),
    C("content-type-missing", chat(), 200, ctype=None),
    C("content-type-json-charset", chat(), 200, ctype="application/json; charset=utf-8"),
    C("content-type-json-suffix", chat(), 200, ctype="application/vnd.api+json"),
    C("json-utf8-bom", b"\xef\xbb\xbf" + json.dumps(chat()).encode(), None),
    C("json-duplicate-keys", b'{"messages": 5, ' + json.dumps(chat()).encode()[1:], None),
    C("unknown-field-ignored", chat(user="u", whatever=[1]), 200),
    # completions' prompt count does not reach chat, where prompt is an unknown field
    C("chat-prompt-list-ignored", chat(prompt=["x"] * 50), 200),
    C("content-text-parts-accepted", chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]), 200),
    C("stream-accepted", chat(stream=True, stream_options={"include_usage": True}), 200),
    P("cmpl-best-of-equal-n-accepted", cmpl(n=2, best_of=2), 200),
]  # fmt: skip

IDS = [c.id for c in CASES]
assert len(IDS) == len(set(IDS)), "duplicate class ids"


def send(api: Api, case: Case) -> tuple[int, str]:
    """Sends the row; an event stream is read to its first event and left."""
    headers: dict[str, str] = {}
    if case.ctype is not None:
        headers["Content-Type"] = case.ctype
    if case.auth and not any(k.lower() == "authorization" for k in case.headers or {}):
        headers["Authorization"] = f"Bearer {KEY}"
    headers.update(case.headers or {})
    what = f"class {case.id}"
    try:
        with api.client.stream(
            case.method, case.path, content=case.content(), headers=headers, timeout=TIMEOUT
        ) as r:
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                text = next((ln for ln in r.iter_lines() if ln.startswith("data: ")), "")
            else:
                r.read()
                text = r.text
    except httpx.TimeoutException as e:
        TRACKER.hang(what)
        raise Hang(f"hang: {what}: no answer within {TIMEOUT} s ({e!r})") from None
    except httpx.TransportError as e:
        TRACKER.lose(what)
        raise Lost(f"{what}: the connection dropped, no answer ({e!r})") from None
    TRACKER.record(r.status_code, what)
    return r.status_code, text


def test_at_least_100_classes():
    assert len(CASES) >= 100, len(CASES)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bad_input_class(api: Api, case: Case) -> None:
    TRACKER.add_class()
    status, text = send(api, case)
    what = f"class {case.id}"
    assert status < 500, f"{what}: {status} (a 5xx), body {text[:300]!r}"
    if case.status is not None:
        allowed = case.status if isinstance(case.status, tuple) else (case.status,)
        assert status in allowed, f"{what}: status {status}, want {allowed}; body {text[:300]!r}"
    if status >= 400:
        check_error(status, text, param=case.param, code=case.code, contains=case.contains, what=what)
    api.ok_completion(what)
