"""Structured outputs through `tinyoss serve` with the official openai client, on the tiny
model. Its weights are random, so every valid document below is the grammar's doing: 24 varied
schemas through chat's response_format and the Responses API's text.format, forced tool calls,
raw completions, and the 400s for what cannot be enforced."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.test_server import KEY, TINY, Served, post, wait_healthy
from tinyoss.server.app import create_app


def obj(required: dict, optional: dict | None = None) -> dict:
    """A closed object schema: `required` properties must appear, `optional` ones may."""
    return {"type": "object", "properties": {**required, **(optional or {})},
            "required": list(required), "additionalProperties": False}  # fmt: skip


def text(most: int, least: int = 0) -> dict:
    return {"type": "string", "minLength": least, "maxLength": most}


def integer(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


SCHEMAS = {
    "name": obj({"name": text(8, 1)}),
    "color": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "age": obj({"age": integer(0, 120)}),
    # multipleOf bounds the digits: the random model would write decimals without end
    "score": obj({"score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01}}),
    "flag": obj({"ok": {"type": "boolean"}}),
    "nested": obj({"user": obj({"id": integer(1, 999), "name": text(6)})}),
    "tags": obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                          "minItems": 1, "maxItems": 3}}),  # fmt: skip
    "numbers": obj({"values": {"type": "array", "items": integer(-5, 5), "maxItems": 4}}),
    "optional": obj({"id": integer(0, 9)}, {"note": text(5), "level": integer(1, 3)}),
    "nullable": obj({"x": {"type": ["string", "null"], "maxLength": 5}}),
    "any_of": obj({"v": {"anyOf": [integer(0, 9), {"enum": ["none"]}]}}),
    "const": obj({"kind": {"const": "point"}, "x": integer(-9, 9), "y": integer(-9, 9)}),
    "pairs": obj({"pairs": {"type": "array", "maxItems": 2,
                            "items": obj({"k": {"enum": ["p", "q"]}, "v": integer(0, 9)})}}),
    "deep": obj({"a": obj({"b": obj({"c": obj({"d": {"type": "boolean"}})})})}),
    "zip": obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "date": obj({"day": {"type": "string", "format": "date"}}),
    "top_array": {"type": "array", "items": integer(0, 5), "minItems": 2, "maxItems": 3},
    "top_enum": {"enum": ["yes", "no"]},
    "refs": {"$defs": {"p": obj({"n": integer(0, 3)})},
             **obj({"first": {"$ref": "#/$defs/p"}, "second": {"$ref": "#/$defs/p"}})},
    "code": obj({"code": text(4, 2)}),
    "exclusive": obj({"t": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 2,
                            "multipleOf": 0.25}}),
    "mixed": obj({"id": integer(0, 99), "label": text(6), "on": {"type": "boolean"},
                  "unit": {"enum": ["c", "f"]}}),  # fmt: skip
    "matrix": obj({"rows": {"type": "array", "maxItems": 2,
                            "items": {"type": "array", "items": integer(0, 1), "maxItems": 2}}}),
    "one_of": obj({"shape": {"oneOf": [obj({"r": integer(1, 9)}),
                                       obj({"w": integer(1, 9), "h": integer(1, 9)})]}}),
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                      "parameters": obj({"city": text(10, 1),
                                                         "unit": {"enum": ["c", "f"]}})}},
    {"type": "function", "function": {"name": "add",
                                      "parameters": obj({"a": integer(0, 99),
                                                         "b": integer(0, 99)})}},
]  # fmt: skip
ARGS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
BUDGET = {"thinking_token_budget": 8}  # bounds the random model's reasoning


@pytest.fixture(scope="module")
def srv():
    served = Served(create_app(TINY, model_name="tiny", api_key=KEY))
    wait_healthy(served)
    yield served
    served.close()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


def _chat(client, name: str, seed: int):
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": f"Give me {name}."}],
        response_format=fmt, max_tokens=250, seed=seed, extra_body=BUDGET,
    )  # fmt: skip


def test_chat_answers_follow_two_dozen_schemas(client):
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        replies = list(pool.map(lambda item: _chat(client, item[1], item[0]),
                                enumerate(SCHEMAS)))  # fmt: skip
    for name, reply in zip(SCHEMAS, replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    reasoned = [r.choices[0].message.model_extra.get("reasoning") for r in replies]
    assert sum(bool(r) for r in reasoned) >= 3  # reasoning came first, free, in several


def test_streamed_answer_equals_the_whole_one(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=250, seed=5,
              response_format={"type": "json_schema",
                               "json_schema": {"name": "m", "schema": SCHEMAS["mixed"]}},
              extra_body=BUDGET)  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        stream=True, **kw) if c.choices]  # fmt: skip
    assert "".join(parts) == whole
    jsonschema.validate(json.loads(whole), SCHEMAS["mixed"])


def test_an_empty_constrained_answer_is_an_empty_string(srv):
    """A constraint that allows only "" as the answer: the whole answer's content is "" as the
    stream's is (it was null, which OpenAI keeps for tool calls alone), with the reasoning
    before it free."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 64, "seed": 1,
            "structured_outputs": {"regex": "(?:)"}, **BUDGET}  # fmt: skip
    r = post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"]["reasoning"]
    assert choice["message"]["content"] == ""
    r = post(srv, "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "" == deltas[0]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_json_object_mode(client):
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "JSON"}], max_tokens=250, seed=1,
        response_format={"type": "json_object"}, extra_body={"thinking_token_budget": 0},
    )  # fmt: skip
    if reply.choices[0].finish_reason == "stop":  # an open object may outrun max_tokens
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls(client, choice):
    for seed in range(3):
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
            tool_choice=choice, max_tokens=200, seed=seed, extra_body=BUDGET,
        )  # fmt: skip
        c = reply.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        fn = c.message.tool_calls[0].function
        assert choice == "required" or fn.name == "add"
        jsonschema.validate(json.loads(fn.arguments), ARGS[fn.name])


def test_responses_text_format_and_tool_choice(client):
    resp = client.responses.create(
        model="tiny", input="Describe a point.", max_output_tokens=250,
        text={"format": {"type": "json_schema", "name": "point", "schema": SCHEMAS["const"]}},
        extra_body=BUDGET,
    )  # fmt: skip
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), SCHEMAS["const"])
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    resp = client.responses.create(model="tiny", input="add", tools=tools, extra_body=BUDGET,
                                   tool_choice={"type": "function", "name": "add"},
                                   max_output_tokens=200)  # fmt: skip
    (call,) = [item for item in resp.output if item.type == "function_call"]
    assert call.name == "add"
    jsonschema.validate(json.loads(call.arguments), ARGS["add"])


def test_completions_take_a_raw_grammar(srv, client):
    out = client.completions.create(
        model="tiny", prompt="A person:", max_tokens=120, seed=2,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}}},
    )  # fmt: skip
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMAS["nested"])
    r = post(srv, "/v1/completions", {"prompt": "Pick:", "max_tokens": 10,
                                      "structured_outputs": {"choice": ["left", "right"]}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("left", "right")


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "u", "schema": {"type": "array", "uniqueItems": True}}}},
         "response_format", "uniqueItems"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
         "response_format.json_schema.schema", "a JSON schema object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format.json_schema.name", "is missing"),
        ({"structured_outputs": {"grammar": "start: /a/"}}, "structured_outputs", "Lark"),
        ({"structured_outputs": {"json": {}}, "response_format": {"type": "json_object"}},
         "structured_outputs", "either"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp",
         "structured_outputs has no field 'regexp'"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "regex cannot be"),
        ({"structured_outputs": {"regex": "[^\\s\\S]+"}}, "structured_outputs",
         "regex matches no text"),
        ({"thinking_token_budget": -1}, "thinking_token_budget", ">= 0"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "not": {"required": ["a"]}}}}], "tool_choice": "required"},
         "tools[0].function.parameters", "not"),
    ],
)  # fmt: skip
def test_what_cannot_be_enforced_is_a_400_naming_it(srv, extra, param, words):
    r = post(srv, "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_a_grammar_beyond_the_parsers_limits_is_a_400(srv):
    """A rule of 3,000 alternatives passes every check before admission (the byte
    vocabulary's parser takes it) and fails at the first sampled token: a 400 naming the
    limit, not a 500, and the server answers the next request. (A choice of that many strings
    is refused at the check.)"""
    many = {"structured_outputs": {"grammar": "start: " + " | ".join(
        f'"w{i}"' for i in range(3000))}}
    r = post(srv, "/v1/completions", {"prompt": "Pick:", "max_tokens": 5, "structured_outputs":
                                      {"choice": [f"w{i}" for i in range(3000)]}})
    assert r.status_code == 400 and "at most 1999" in r.json()["error"]["message"], r.text
    r = post(srv, "/v1/completions", {"prompt": "Pick:", "max_tokens": 5, **many})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_grammar" and "max is 2000" in err["message"], err
    assert err["type"] == "invalid_request_error" and err["param"] == "structured_outputs", err
    r = post(srv, "/v1/completions", {"prompt": "Pick:", "max_tokens": 5, "stream": True, **many})
    events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    assert events[-1]["error"]["param"] == "structured_outputs", events  # streamed: the same
    r = post(srv, "/v1/completions", {"prompt": "Pick:", "max_tokens": 5,
                                      "structured_outputs": {"choice": ["left", "right"]}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("left", "right")
