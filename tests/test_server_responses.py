"""The Responses API (`/v1/responses`) end to end: a live server with the tiny model on the CPU,
its engine core scripted (tests/core_hooks.py) to reason and answer, or reason and call
get_weather, and the official `openai` client. The rendered prompts (TINYOSS_TEST_PROMPTS) show
what a request's input items became."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from tests.core_hooks import ANSWER, SLOW, WEATHER
from tests.test_server import KEY, MAX_LEN, scripted_server, wait_idle
from tinyoss import harmony
from tinyoss.server.protocol import APIError
from tinyoss.server.response_store import ResponseStore
from tinyoss.server.responses_api import Output, ResponseRun, translate

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
REASONING, ANSWER_TEXT = "Let me think.", "Hello there, Paris!"  # what the ANSWER script says


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with scripted_server(tmp_path_factory.mktemp("responses")) as served:
        yield served


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


def create(client, **kw):
    return client.responses.create(model="tiny", **kw)


def error(srv, body, status: int = 400, method: str = "POST", path: str = "") -> dict:
    r = httpx.request(
        method,
        srv.url + "/v1/responses" + path,
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---------------------------------------------------------------- answers


def test_a_stateless_client_asking_for_encrypted_reasoning_gets_it_plain(client):
    """Stateless clients (store: false) ask for reasoning.encrypted_content and send the
    reasoning items back; here they come as plain reasoning_text, and go back as they came."""
    r = create(client, input=ANSWER, store=False, include=["reasoning.encrypted_content"],
               max_output_tokens=64)
    reasoning = r.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content is None
    assert [c.text for c in reasoning.content] == [REASONING]
    again = create(client, input=[{"role": "user", "content": ANSWER},
                                  *[o.model_dump(exclude_none=True) for o in r.output],
                                  {"role": "user", "content": "And?"}],
                   store=False, include=["reasoning.encrypted_content"], max_output_tokens=8)
    assert again.status in ("completed", "incomplete")


def test_answer_items_usage_and_echo(srv, client):
    r = create(
        client,
        input=ANSWER,
        instructions="Be brief.",
        reasoning={"effort": "high"},
        max_output_tokens=64,
        metadata={"k": "v"},
    )
    prompt = srv.prompts()[-1]
    assert "Reasoning: high" in prompt and "# Instructions\n\nBe brief." in prompt
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert [o.type for o in r.output] == ["reasoning", "message"]
    reasoning, message = r.output
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", REASONING)]
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert message.status == "completed" and message.content[0].type == "output_text"
    assert r.output_text == ANSWER_TEXT and message.content[0].annotations == []
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": ANSWER}]
    encode = srv.tokenizer.encode
    assert r.usage.input_tokens == len(
        harmony.render_prompt(messages, encode, reasoning_effort="high")
    )
    assert r.usage.output_tokens_details.reasoning_tokens == len(encode(REASONING))
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens > len(encode(REASONING + ANSWER_TEXT))
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert r.usage.input_tokens_details.cache_write_tokens == 0
    # strictly, as the openai library's types define a response (every required field there)
    from openai.types.responses import Response
    assert Response.model_validate(r.model_dump(mode="json")) == r
    assert (r.instructions, r.max_output_tokens, r.metadata) == ("Be brief.", 64, {"k": "v"})
    assert r.reasoning.effort == "high" and r.text.format.type == "text"
    assert (r.temperature, r.top_p, r.tool_choice, r.tools) == (1.0, 1.0, "auto", [])
    assert r.store is True and r.parallel_tool_calls is True and r.previous_response_id is None
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()


def test_max_output_tokens_makes_it_incomplete(client):
    r = create(client, input=ANSWER, max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5
    assert [o.type for o in r.output] == ["reasoning"] and r.output[0].status == "incomplete"


def _squeezed(types: list[str]) -> list[str]:
    """Event types with runs of one delta type counted once."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and types[i - 1] == t)]


def test_stream_events_join_up_to_the_answer(srv, client):
    whole = create(client, input=ANSWER, max_output_tokens=64)
    events = list(create(client, input=ANSWER, max_output_tokens=64, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item = ["response.output_item.added", "response.content_part.added"]
    done = ["response.content_part.done", "response.output_item.done"]
    assert _squeezed([e.type for e in events]) == [
        "response.created", "response.in_progress",
        *item, "response.reasoning_text.delta", "response.reasoning_text.done", *done,
        *item, "response.output_text.delta", "response.output_text.done", *done,
        "response.completed",
    ]  # fmt: skip
    first, last = events[0].response, events[-1].response
    assert first.status == "in_progress" and first.output == [] and first.id == last.id
    deltas = lambda kind: "".join(e.delta for e in events if e.type == kind)  # noqa: E731
    assert deltas("response.reasoning_text.delta") == REASONING
    assert deltas("response.output_text.delta") == whole.output_text == last.output_text
    assert [e.output_index for e in events if e.type.endswith(".delta")][-1] == 1
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.id for i in added] == [o.id for o in last.output]
    assert last.usage.output_tokens == whole.usage.output_tokens
    assert last.status == "completed"
    assert client.responses.retrieve(last.id).output_text == ANSWER_TEXT

    with client.responses.stream(model="tiny", input=ANSWER, max_output_tokens=64) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == whole.output_text
    drop = {"id": True, "content": {"__all__": {"parsed"}}}  # ids differ; parsed: the helper's
    shape = lambda r: [o.model_dump(exclude=drop) for o in r.output]  # noqa: E731
    assert shape(final) == shape(whole)
    assert final.usage == whole.usage


def test_stream_sends_event_lines(srv):
    body = {"input": ANSWER, "max_output_tokens": 64, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", srv.url + "/v1/responses", json=body, headers=headers) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]
    assert "[DONE]" not in blocks[-1]


# ---------------------------------------------------------------- tools and conversations


def test_function_call_round_trip(srv, client):
    first = create(client, input=WEATHER, tools=TOOLS, max_output_tokens=64)
    assert [o.type for o in first.output] == ["reasoning", "function_call"]
    call = first.output[1]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert (call.name, call.arguments, call.status) == (
        "get_weather",
        '{"city":"Paris"}',
        "completed",
    )
    assert first.status == "completed" and first.tools[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    create(client, previous_response_id=first.id, input=[result], tools=TOOLS, max_output_tokens=8)
    continued = srv.prompts()[-1]
    assert "<|channel|>analysis<|message|>think<|end|>" in continued  # in the tool loop: kept
    assert (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city":"Paris"}<|call|>' in continued
    )
    assert (
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 21}'
        in continued
    )
    items = [{"role": "user", "content": WEATHER}]
    items += [o.model_dump(exclude_none=True) for o in first.output] + [result]
    create(client, input=items, tools=TOOLS, max_output_tokens=8)
    assert srv.prompts()[-1] == continued


def test_an_image_a_tool_returns_is_a_line_saying_it_is_not_shown(srv):
    """Codex's view_image and MCP tools return pictures in function_call_output: gpt-oss cannot
    see them, and a 400 failed the agent's turn; the model reads a line saying so instead (an
    image in a user message is still a 400: tests above)."""
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather",
            "arguments": '{"city":"Paris"}'}
    output = {"type": "function_call_output", "call_id": "c1", "output": [
        {"type": "input_text", "text": "the map: "},
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=",
         "detail": "auto"}]}
    r = httpx.post(srv.url + "/v1/responses", json={
        "input": [{"role": "user", "content": WEATHER}, call, output], "tools": TOOLS,
        "max_output_tokens": 8}, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    assert ("<|message|>the map: [an image: not shown, this model reads text only]<|end|>"
            in srv.prompts()[-1])


def test_previous_response_continues_the_conversation(srv, client):
    first = create(client, input=ANSWER, max_output_tokens=64)
    second = create(
        client, previous_response_id=first.id, input="And tomorrow?", max_output_tokens=8
    )
    prompt = srv.prompts()[-1]
    assert second.previous_response_id == first.id
    assert "<|start|>user<|message|>" + ANSWER in prompt and "And tomorrow?" in prompt
    assert "<|channel|>final<|message|>" + ANSWER_TEXT in prompt
    assert REASONING not in prompt  # the turn ended in an answer: its reasoning is dropped
    # a 400, as OpenAI's (the SDK's BadRequestError, which agent frameworks catch)
    with pytest.raises(openai.BadRequestError, match="resp_nope"):
        create(client, previous_response_id="resp_nope", input="hi")
    err = error(srv, {"previous_response_id": "resp_nope", "input": "hi"}, 400)
    assert err["param"] == "previous_response_id" and err["code"] == "previous_response_not_found"
    assert err["type"] == "invalid_request_error"


def test_a_large_body_is_checked_off_the_event_loop_with_the_same_answers(srv, client,
                                                                         monkeypatch):
    """A body past 1 MiB (here padded with JSON whitespace) is checked in a worker thread, with
    the stored conversation read before (200,000 items had held every other client for 1.4 s):
    it continues a previous response as a small body does, and a missing one or a bad field
    gets the same error."""
    import tinyoss.server.app as app_module

    where, real = [], app_module.translate

    def spy(*args):
        try:
            asyncio.get_running_loop()
            where.append("event loop")
        except RuntimeError:
            where.append("worker thread")
        return real(*args)

    monkeypatch.setattr(app_module, "translate", spy)
    first = create(client, input=ANSWER, max_output_tokens=64)
    pad = " " * (1 << 20)

    def post(body: dict) -> httpx.Response:
        return httpx.post(srv.url + "/v1/responses", content=json.dumps(body) + pad,
                          headers={"Authorization": f"Bearer {KEY}",
                                   "Content-Type": "application/json"}, timeout=60)

    r = post({"model": "tiny", "previous_response_id": first.id, "input": "And tomorrow?",
              "max_output_tokens": 8})
    assert r.status_code == 200, r.text
    prompt = srv.prompts()[-1]
    assert r.json()["previous_response_id"] == first.id
    assert "<|start|>user<|message|>" + ANSWER in prompt and "And tomorrow?" in prompt
    r = post({"previous_response_id": "resp_nope", "input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    r = post({"input": "hi", "stream": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
    assert where == ["event loop"] + ["worker thread"] * 2  # resp_nope: 400 from the store


def test_openai_s_routing_fields_are_echoed(client):
    """prompt_cache_key, safety_identifier and max_tool_calls come back as given (they were
    dropped); service_tier says the tier that served it."""
    r = create(client, input="hi", max_output_tokens=3, prompt_cache_key="k1",
               safety_identifier="u1", max_tool_calls=2, service_tier="auto",
               stream_options={"include_obfuscation": False})  # fmt: skip
    assert (r.prompt_cache_key, r.safety_identifier, r.max_tool_calls) == ("k1", "u1", 2)
    assert r.service_tier == "default"
    assert client.responses.retrieve(r.id).prompt_cache_key == "k1"


def test_get_delete_and_store_false(srv, client):
    r = create(client, input="hi", max_output_tokens=3)
    assert client.responses.retrieve(r.id).id == r.id
    # OpenAI's stream=true replays a background response; it had been ignored (JSON came)
    assert error(srv, None, 400, "GET", f"/{r.id}?stream=true")["param"] == "stream"
    assert httpx.get(srv.url + f"/v1/responses/{r.id}?stream=false",
                     headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    deleted = httpx.delete(
        srv.url + f"/v1/responses/{r.id}", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert deleted.json() == {"id": r.id, "object": "response.deleted", "deleted": True}
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(r.id)
    private = create(client, input="hi", max_output_tokens=3, store=False)
    assert private.status == "incomplete" and private.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(private.id)
    with pytest.raises(openai.BadRequestError):  # a 400 for previous_response_id, as OpenAI's
        create(client, input="hi", previous_response_id=private.id)
    assert httpx.get(srv.url + f"/v1/responses/{r.id}").status_code == 401


def test_with_storing_off_a_response_says_store_false(tmp_path):
    """--max-stored-responses 0 kept nothing yet echoed store: true; GET's 404 says why."""
    with scripted_server(tmp_path, max_stored_responses=0) as off:
        client = openai.OpenAI(base_url=off.url + "/v1", api_key=KEY, max_retries=0)
        r = create(client, input="hi", max_output_tokens=3)
        assert r.store is False
        events = list(create(client, input="hi", max_output_tokens=3, stream=True))
        assert {e.response.store for e in events if e.type.startswith("response.")
                and hasattr(e, "response")} == {False}  # fmt: skip
        for path in ("", "/input_items"):
            err = error(off, None, 404, "GET", f"/{r.id}{path}")
            assert "storing is off" in err["message"] and "newest 0" not in err["message"]


def test_input_items_list_the_conversation(srv, client):
    """GET /v1/responses/{id}/input_items (was a 404): the items the response was generated
    from, as OpenAI lists them (each with an id, a message's content as parts), newest first
    by default, in pages of `limit` after the item `after`."""
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": ANSWER}]}]  # fmt: skip
    first = create(client, input=items, max_output_tokens=64)
    second = create(client, previous_response_id=first.id, input="And?", max_output_tokens=8)
    listed = client.responses.input_items.list(second.id, order="asc")
    assert listed.object == "list" and listed.has_more is False
    assert [(i.type, getattr(i, "role", None)) for i in listed.data] == [
        ("message", "developer"), ("message", "user"), ("reasoning", None),
        ("message", "assistant"), ("message", "user"),
    ]  # fmt: skip
    assert [i.id for i in listed.data[2:4]] == [o.id for o in first.output]
    assert all(i.id and i.status == "completed" for i in listed.data)
    assert len({i.id for i in listed.data}) == 5
    assert (listed.first_id, listed.last_id) == (listed.data[0].id, listed.data[-1].id)
    assert [(p.type, p.text) for p in listed.data[0].content] == [("input_text", "Be brief.")]
    assert [(p.type, p.text) for p in listed.data[-1].content] == [("input_text", "And?")]
    assert listed.data[3].content[0].text == ANSWER_TEXT
    ids = [i.id for i in listed.data]
    again = client.responses.input_items.list(first.id, order="asc")  # the same items' ids
    assert [i.id for i in again.data] == ids[:2]
    page = client.responses.input_items.list(second.id, limit=2)
    assert [i.id for i in page.data] == ids[::-1][:2] and page.has_more
    assert [i.id for i in page] == ids[::-1]  # the client pages on with after=last_id
    after = client.responses.input_items.list(second.id, order="asc", after=ids[3])
    assert [i.id for i in after.data] == ids[4:] and not after.has_more
    with pytest.raises(openai.NotFoundError, match="resp_nope"):
        client.responses.input_items.list("resp_nope")
    for query, param in (("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order"),
                         ("after=msg_nope", "after")):  # fmt: skip
        err = error(srv, None, 400, "GET", f"/{second.id}/input_items?{query}")
        assert err["param"] == param, err


def test_output_text_logprobs_are_the_answers_tokens(client):
    """include message.output_text.logprobs (and top_logprobs) fill output_text's logprobs
    with the answer's tokens, as chat's logprobs.content (they were refused); left out: []."""
    kw = {"input": ANSWER, "max_output_tokens": 64, "top_logprobs": 2,
          "include": ["message.output_text.logprobs"]}  # fmt: skip
    r = create(client, **kw)
    part = r.output[1].content[0]
    assert [e.token for e in part.logprobs] == ["Hello", " there", ",", " Paris", "!"]
    assert bytes(b for e in part.logprobs for b in e.bytes).decode() == part.text
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in part.logprobs)
    assert r.top_logprobs == 2
    events = list(create(client, stream=True, **kw))
    deltas = [lp.token for e in events if e.type == "response.output_text.delta"
              for lp in e.logprobs]  # fmt: skip
    done = next(e for e in events if e.type == "response.output_text.done")
    added = [e.part for e in events if e.type == "response.content_part.added"]
    assert added[1].logprobs == []  # sent before any token (a list shared with later ones)
    assert deltas == [lp.token for lp in done.logprobs] == [e.token for e in part.logprobs]
    final = events[-1].response.output[1].content[0]
    assert [e.token for e in final.logprobs] == deltas
    alone = create(client, input=ANSWER, max_output_tokens=64, top_logprobs=1)
    assert len(alone.output[1].content[0].logprobs) == 5
    plain = create(client, input=ANSWER, max_output_tokens=64)
    assert plain.output[1].content[0].logprobs == [] and plain.top_logprobs == 0


def failed_requests(srv) -> float:
    """vLLM's count of requests that ended by an engine failure."""
    line = '{finished_reason="error",model_name="tiny"} '
    text = httpx.get(srv.url + "/metrics").text
    return float(next(ln.split()[-1] for ln in text.splitlines()
                      if ln.startswith("vllm:request_success_total") and line in ln))


def test_cancel_and_disconnect_abort_the_engine_request(srv, client, caplog):
    caplog.set_level("INFO", logger="tinyoss.server")
    failed = failed_requests(srv)
    slow = [{"role": "user", "content": m} for m in (SLOW, ANSWER)]  # 20 ms a scripted step
    events = iter(create(client, input=slow, stream=True))
    rid = next(events).response.id
    next(e for e in events if e.type == "response.reasoning_text.delta")
    assert srv.client.stats.num_requests_running == 1
    # deleting it while it runs would leave it running and beyond cancel's reach (a trial)
    err = error(srv, None, 400, "DELETE", f"/{rid}")
    assert "still in progress: cancel it" in err["message"] and err["param"] == "response_id"
    cancelled = client.responses.cancel(rid)
    assert cancelled.status == "cancelled"
    rest = list(events)
    last = rest[-1]
    assert last.type == "response.failed" and last.response.status == "cancelled"
    # the cancel's answer is the settled response (it had null usage and items in progress)
    assert cancelled.model_dump() == last.response.model_dump()
    assert last.response.usage is not None
    # the item the cancel cut short is closed in the stream, as a normal end closes it
    done = [e for e in rest if e.type == "response.output_item.done"]
    assert done and done[-1].item.status == "incomplete"
    assert [e.type for e in rest[-4:-1]] == ["response.reasoning_text.done",
                                             "response.content_part.done",
                                             "response.output_item.done"]
    # a cancel is an abort, not an engine failure, and the log line names the response (it had
    # counted as finished_reason "error", logged "the engine failed it" under a cmpl- id)
    assert failed_requests(srv) == failed
    assert f"aborted request {rid}: POST /v1/responses/{rid}/cancel" in caplog.messages
    # a response.failed says why (its error was null: a client reading error.message broke),
    # and is what the store keeps; no `error` event: nothing failed
    assert last.response.error.code == "cancelled" and "/cancel" in last.response.error.message
    assert "error" not in [e.type for e in rest]
    wait_idle(srv)
    assert client.responses.retrieve(rid).model_dump() == last.response.model_dump()
    err = error(srv, None, path=f"/{rid}/cancel")
    assert "only a response in progress can be cancelled" in err["message"]
    body = {"input": slow, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", srv.url + "/v1/responses", json=body, headers=headers) as r:
        data = (json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: "))
        rid = next(data)["response"]["id"]
        next(e for e in data if e["type"] == "response.reasoning_text.delta")
        assert srv.client.stats.num_requests_running == 1
    wait_idle(srv)
    gone = client.responses.retrieve(rid)
    assert gone.status == "cancelled" and gone.error.code == "cancelled"
    assert "closed the connection" in gone.error.message


@pytest.mark.parametrize(
    "extra",
    [
        {"text": {"format": {"type": "json_schema", "name": "out", "strict": True, "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}}}}, "input": "hi"},
        {"tool_choice": "required", "tools": TOOLS, "input": WEATHER},
        {"tool_choice": {"type": "function", "name": "get_weather"}, "tools": TOOLS,
         "input": WEATHER},
    ],
)  # fmt: skip
def test_structured_output_and_tool_choice_reach_parse_chat(srv, extra):
    body = {"max_output_tokens": 32, **extra}
    r = httpx.post(
        srv.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    if r.status_code == 400:  # parse_chat refused it, naming the Responses field
        assert r.json()["error"]["param"].split(".")[0] in ("text", "tool_choice", "tools")
        return
    assert r.status_code == 200, r.text
    if "tool_choice" in extra:
        assert "You must call" in srv.prompts()[-1]
        assert r.json()["tool_choice"] == extra["tool_choice"]
    else:
        assert r.json()["text"]["format"]["name"] == "out"


def test_hosted_tools_are_left_out_and_logged(srv, caplog):
    """Codex offers web_search beside its function tools; OpenAI's servers run it, this one
    cannot: the prompt carries the functions alone, the answer echoes them, and the log names
    the type once (it had been a 400 on every turn)."""
    tools = [{"type": "web_search", "external_web_access": False}, *TOOLS,
             {"type": "code_interpreter", "container": {"type": "auto"}}]
    with caplog.at_level("DEBUG", logger="tinyoss.server"):
        for _ in range(2):
            r = httpx.post(srv.url + "/v1/responses", json={
                "input": WEATHER, "tools": tools, "max_output_tokens": 8},
                headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
            assert r.status_code == 200, r.text
            assert [t["type"] for t in r.json()["tools"]] == ["function"] * len(TOOLS)
            prompt = srv.prompts()[-1]
            assert "get_weather" in prompt and "web_search" not in prompt
    warned = [m for m in caplog.messages if "left out of a /v1/responses prompt" in m]
    assert len(warned) <= 1 and "hosted tools left out: web_search, code_interpreter" in (
        caplog.text)  # fmt: skip


def test_a_codex_turn_streams_to_completed(srv):
    """The body Codex sends (openai/codex, codex-api's ResponsesApiRequest): developer and user
    items, a strict-false function tool beside web_search, reasoning summary "none" (an older
    Codex's spelling), include [], store false, prompt_cache_key; max_output_tokens is tiny's."""
    shell = {"type": "function", "name": "shell", "description": "Runs a command.",
             "strict": False, "parameters": {
                 "type": "object", "properties": {"command": {"type": "array", "items": {
                     "type": "string"}}}, "required": ["command"],
                 "additionalProperties": False}}
    body = {"model": "tiny", "instructions": "You are a coding agent.", "input": [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "<environment_context>cwd</environment_context>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]}],
        "tools": [shell, {"type": "web_search"}], "tool_choice": "auto",
        "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "none"},
        "store": False, "stream": True, "include": [], "prompt_cache_key": "k",
        "max_output_tokens": 8}
    r = httpx.post(srv.url + "/v1/responses", json=body,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert events[0]["type"] == "response.created", events[0]
    done = events[-1]
    assert done["type"] in ("response.completed", "response.incomplete"), done
    assert done["response"]["reasoning"]["summary"] == "none"
    assert [t["name"] for t in done["response"]["tools"]] == ["shell"]
    assert "usage" in done["response"] and done["response"]["store"] is False


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "body, param, words",
    [
        # tools the client runs but this server cannot offer (hosted ones are left out)
        ({"input": "hi", "tools": [{"type": "local_shell"}]}, "tools[0].type", "'function'"),
        ({"input": "hi", "tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type",
         "hosted ones such as web_search are left out"),
        ({"input": "hi", "background": True}, "background", "not supported"),
        # chat spellings were ignored: max_tokens left the answer unbounded
        ({"input": "hi", "max_tokens": 5}, "max_tokens", "give max_output_tokens"),
        ({"input": "hi", "response_format": {"type": "json_object"}}, "response_format",
         "give text.format"),
        ({"input": "hi", "messages": []}, "messages", "give the conversation as input"),
        ({"input": [{"type": "image_generation_call"}]}, "input[0].type", "not supported"),
        # a type that is no string (a list, an object) was a 500: unhashable in the lookup
        ({"input": [{"type": ["message"], "role": "user", "content": "x"}]}, "input[0].type",
         "must be message, function_call"),
        ({"input": [{"role": "user", "content": [{"type": {"t": 1}, "text": "x"}]}]},
         "input[0].content[0]", "must be"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "robot"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0]", "text only"),
        ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
         "input[0].call_id", "No tool call found"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "zz"}]},
         "input[0].encrypted_content", "not supported"),
        ({}, "input", "input is required"),
        ({"input": 3}, "input", "must be a string or a non-empty list of items"),
        ({"input": "hi", "temperature": "hot"}, "temperature", "temperature"),
        ({"input": "hi", "max_output_tokens": "many"}, "max_output_tokens", "max_output_tokens"),
        ({"input": "hi", "reasoning": {"effort": "minimal"}}, "reasoning.effort", "low"),
        ({"input": "hi", "reasoning": {"effort": ""}}, "reasoning.effort", "low"),  # was medium
        # OpenAI's fields with nothing to do here were accepted with any value (a trial)
        ({"input": "hi", "max_tool_calls": "x"}, "max_tool_calls", "integer"),
        ({"input": "hi", "max_tool_calls": 0}, "max_tool_calls", ">= 1"),
        ({"input": "hi", "service_tier": "gold"}, "service_tier", "'priority'"),
        ({"input": "hi", "stream_options": []}, "stream_options", "object"),
        ({"input": "hi", "prompt_cache_key": 5}, "prompt_cache_key", "string"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format.name",
         "text.format.name is required"),
        # a wrong type inside the format names its part (it had been text.format, whole)
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": 5, "schema": {}}}},
         "text.format.name", "text.format.name=5 is invalid: must be a string of 1 to 64"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a", "schema": [1]}}},
         "text.format.schema", "must be a JSON schema object"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a", "schema": {},
                                             "strict": "yes"}}},
         "text.format.strict", "must be a boolean"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format", '"json_schema"'),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}},
         "text.format.name", "text.format.name='a b' is invalid: must be 1 to 64 letters"),
        ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "x"}},
         "tool_choice", "naming one of the tools"),
        ({"input": "hi", "metadata": {"k": 1}}, "metadata", "metadata"),
        ({"input": "hi", "tools": [*TOOLS, *TOOLS]}, "tools[1]", "like tools[0]"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {
            "type": "array"}}]}, "tools[0].parameters", 'of type \'object\''),
        ({"input": "hi", "tools": [{"type": "function", "name": "get weather"}]}, "tools[0]",
         "a tool's name must be 1 to 64 letters"),
        ({"input": "hi", "stream": "yes"}, "stream", "bool"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": 1}]},
         "tools[0].parameters", "JSON schema"),
        # vLLM's and chat's fields were ignored too: refused by name, or passed on to chat
        ({"input": "hi", "reasoning_effort": "high"}, "reasoning_effort", "reasoning.effort"),
        ({"input": "hi", "chat_template_kwargs": {"reasoning_effort": "high"}},
         "chat_template_kwargs", "give reasoning.effort"),
        ({"input": "hi", "return_token_ids": True}, "return_token_ids", "not served here"),
        ({"input": "hi", "structured_outputs": {"regex": "a"}}, "structured_outputs",
         "give text.format"),
        ({"input": "hi", "logprobs": True}, "logprobs", "message.output_text.logprobs"),
        ({"input": "hi", "top_logprobs": 21}, "top_logprobs", "20"),
        ({"input": "hi", "ignore_eos": True}, "ignore_eos", "harmony's end tokens"),
        ({"input": "hi", "bad_words": ["x"]}, "bad_words", "chat completions and completions do"),
        ({"input": "hi", "return_tokens_as_token_ids": True}, "return_tokens_as_token_ids",
         "chat completions and completions do"),
        ({"input": "hi", "use_beam_search": True}, "use_beam_search", "beam search"),
        ({"input": "hi", "echo": True}, "echo", "not supported"),
        ({"input": "hi", "logit_bias": {"1": 2}}, "logit_bias", "not supported"),
        # a call's part is named by its function_call item (it had been the chat path
        # input[1].tool_calls[0].function.name); the second call of a turn by its own item
        ({"input": [{"role": "user", "content": "w"},
                    {"type": "function_call", "call_id": "c1", "name": "a b", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "x"}]},
         "input[1].name", "input[1].name is 'a b'"),
        ({"input": [{"role": "user", "content": "w"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call", "call_id": "c2", "name": "a b", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "x"},
                    {"type": "function_call_output", "call_id": "c2", "output": "x"}]},
         "input[2].name", "input[2].name is 'a b'"),
        ({"input": "hi", "top_k": -5}, "top_k", "top_k=-5 is invalid"),
        ({"input": "hi", "seed": "x"}, "seed", "an integer"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(srv, body, param, words):
    err = error(srv, body)
    assert err["param"] == param and words in err["message"], err


def test_context_length_names_the_responses_fields(srv):
    err = error(srv, {"input": "hi", "max_output_tokens": MAX_LEN})
    assert err["param"] == "max_output_tokens" and err["code"] == "context_length_exceeded"
    assert "in the input" in err["message"] and "messages" not in err["message"]


def test_a_streamed_input_beyond_the_context_is_a_failed_response(srv, client):
    """Streamed, the same refusal comes as a response that failed with that code, which Codex
    reads as a full context window (a 400 it reports as an invalid request); the openai client
    parses every event; nothing is stored."""
    body = {"input": "hi " * MAX_LEN, "stream": True, "max_output_tokens": 8}
    r = httpx.post(srv.url + "/v1/responses", json=body,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    names = [ln[7:] for ln in r.text.splitlines() if ln.startswith("event: ")]
    events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert names == [e["type"] for e in events] == [
        "response.created", "response.in_progress", "error", "response.failed"]
    assert [e["sequence_number"] for e in events] == [0, 1, 2, 3]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "context_length_exceeded"
    assert events[2]["param"] == "input"
    assert "reduce the length of the input" in events[2]["message"]
    with client.responses.create(model="tiny", stream=True, max_output_tokens=8,
                                 input="hi " * MAX_LEN) as stream:
        kinds = [e.type for e in stream]
    assert kinds[-1] == "response.failed"
    assert httpx.get(srv.url + f"/v1/responses/{failed['id']}",
                     headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    assert error(srv, {"input": "hi " * MAX_LEN})["code"] == "context_length_exceeded"  # 400


# ---------------------------------------------------------------- without a server


def test_the_store_evicts_the_least_recently_used():
    store = ResponseStore(2)
    runs = [
        SimpleNamespace(id=f"resp_{i}", status="completed", conversation=list) for i in range(3)
    ]
    store.put(runs[0], 10), store.put(runs[1], 10)
    store.get("resp_0")  # now the most recently used
    store.put(runs[2], 10)
    assert store.get("resp_0") is runs[0] and store.get("resp_2") is runs[2] and len(store) == 2
    with pytest.raises(APIError, match="not found") as e:
        store.get("resp_1")
    assert e.value.status == 404
    with pytest.raises(APIError) as e:
        store.get("resp_" + "x" * 5_000_000)
    assert len(str(e.value)) < 400  # the id clipped: a 5 MB id came back whole
    off = ResponseStore(0)
    off.put(runs[0], 10)
    with pytest.raises(APIError, match="storing is off") as e:
        off.conversation("resp_0")
    assert e.value.param == "previous_response_id"


def test_the_store_holds_a_bounded_number_of_bytes():
    """1000 responses of 16 MiB bodies each were 16 GB (a hostile-traffic trial): the store
    also keeps at most max_bytes of request bodies, the newest response always."""
    store = ResponseStore(1000, max_bytes=100)
    runs = [SimpleNamespace(id=f"resp_{i}", status="completed") for i in range(5)]
    for run in runs[:3]:
        store.put(run, 40)
    assert len(store) == 2 and store.bytes == 80  # resp_0 went to keep 100 bytes at most
    store.put(runs[3], 500)  # larger than the bound alone: kept, the others go
    assert len(store) == 1 and store.get("resp_3") is runs[3]
    store.put(runs[4], 30)
    assert len(store) == 1 and store.bytes == 30
    store.delete("resp_4")
    assert store.bytes == 0 and len(store) == 0


def test_the_store_counts_a_response_s_output_once_it_has_ended():
    """An ended response keeps its output items, their logprobs too (its request's reservation
    of --max-logprob-memory is given back): 1000 of them had been bounded by their bodies
    alone."""
    store = ResponseStore(1000, max_bytes=1000)
    runs = [SimpleNamespace(id=f"resp_{i}", status="completed", footprint=lambda: 700)
            for i in range(3)]  # fmt: skip
    store.put(runs[0], 100)
    store.put(runs[1], 100)
    runs[0].on_end(runs[0])
    assert store.bytes == 900 and len(store) == 2
    store.delete("resp_1")
    store.put(runs[2], 100)
    runs[2].on_end(runs[2])  # 1600 bytes: the least recently used goes
    assert len(store) == 1 and store.get("resp_2") is runs[2] and store.bytes == 800
    runs[0].on_end(runs[0])  # evicted: nothing to count
    assert store.bytes == 800


def test_a_response_in_progress_is_never_evicted():
    """A running response pushed out by newer ones could no longer be cancelled, fetched or
    continued, and was lost when it ended (a trial: 28 large stored requests during a stream).
    The oldest that have ended go instead; a running one goes once it has ended."""
    store = ResponseStore(2, max_bytes=100)
    runs = [SimpleNamespace(id=f"resp_{i}", status="in_progress", footprint=lambda: 0)
            for i in range(4)]  # fmt: skip
    store.put(runs[0], 10)
    runs[1].status = "completed"
    store.put(runs[1], 10)
    store.put(runs[2], 10)  # three kept is one too many: resp_1 (ended) goes, not resp_0
    assert [r.id for r in (store.get("resp_0"), store.get("resp_2"))] == ["resp_0", "resp_2"]
    with pytest.raises(APIError):
        store.get("resp_1")
    store.put(runs[3], 200)  # over both bounds, all in progress: kept until they end
    assert len(store) == 3
    runs[0].status = "completed"
    runs[0].on_end(runs[0])
    assert len(store) == 2 and store.held("resp_0") == 0
    with pytest.raises(APIError, match="newest 2 within 0 MiB") as e:
        store.get("resp_0")
    assert e.value.status == 404
    runs[2].status = "completed"
    runs[2].on_end(runs[2])
    assert len(store) == 1 and store.held("resp_3") == 200


def test_a_continuation_counts_the_items_it_keeps_alive(srv, client, monkeypatch):
    """A continuation shares the items of the responses it continues, which live as long as it
    does: it counts their bytes as its own. A chain of 10 MiB reasoning items had grown the
    server past the store's bound, its early responses evicted but their items still held."""
    counted = {}
    put = ResponseStore.put

    def spy(self, run, nbytes):
        counted[run.id] = nbytes
        put(self, run, nbytes)

    monkeypatch.setattr(ResponseStore, "put", spy)
    big = {"type": "reasoning", "summary": [],
           "content": [{"type": "reasoning_text", "text": "w" * 100_000}]}  # fmt: skip
    first = create(client, input=[big, {"role": "user", "content": "x"}], max_output_tokens=2)
    second = create(client, input="y", previous_response_id=first.id, max_output_tokens=2)
    third = create(client, input="z", previous_response_id=second.id, max_output_tokens=2)
    assert 100_000 < counted[first.id] < counted[second.id] < counted[third.id]


def test_a_function_call_needs_its_output_before_the_next_message():
    """As OpenAI: a function_call answered by no function_call_output before the next message
    (or the input's end) is a 400 naming the call; the model would read a conversation that
    skips the tool's answer."""
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    user = {"role": "user", "content": "And?"}
    for items, at in (([user, call, user], "the message at input[2]"),
                      ([user, call], "the input ends")):  # fmt: skip
        with pytest.raises(APIError) as e:
            translate({"input": items, "tools": TOOLS}, lambda _: [])
        assert e.value.param == "input[1]" and "'c1'" in e.value.message and at in e.value.message
    before = [user, call]  # a previous response that ended with the call
    with pytest.raises(APIError) as e:
        translate({"input": "And?", "previous_response_id": "resp_x", "tools": TOOLS},
                  lambda _: before)  # fmt: skip
    assert e.value.param == "previous_response_id"
    answered = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    translate({"input": [answered, user], "previous_response_id": "resp_x", "tools": TOOLS},
              lambda _: before)  # fmt: skip


def test_sampling_fields_reach_chat():
    """vLLM's sampling fields (it serves top_k, seed, repetition_penalty on /v1/responses) were
    ignored; values that ask for nothing pass."""
    given = {"top_k": 5, "min_p": 0.1, "seed": 7, "presence_penalty": 0.5,
             "frequency_penalty": 0.5, "repetition_penalty": 1.1, "min_tokens": 2,
             "cache_salt": "s"}  # fmt: skip
    req = translate({"input": "hi", **given, "bad_words": [], "use_beam_search": False,
                     "logit_bias": {}}, lambda _: [])  # fmt: skip
    assert {k: req.chat[k] for k in given} == given


def test_items_become_chat_messages():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "dropped"}]},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    req = translate({"input": items, "instructions": "Be kind.", "tools": TOOLS}, lambda _: [])
    assert req.chat["messages"] == [
        {"role": "developer", "content": "Be kind."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning": "r", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    assert req.origins == ["instructions", "input[0]", "input[2]", "input[4]", "input[6]"]
    assert req.chat["tools"][0]["function"]["name"] == "get_weather"
    renamed = req.renamed(APIError(400, "messages[3].content is bad", param="messages"))
    assert (renamed.message, renamed.param) == ("input[4].content is bad", "input")


def test_an_engine_failure_mid_stream_fails_the_response():
    class FailingRun:  # an engine run whose request fails at once
        streams: list = []
        rid = "resp_failing"

        async def updates(self):
            raise RuntimeError("out of memory on this prompt")
            yield

        def usage(self) -> dict:
            return {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3,
                    "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip

    async def events() -> list[dict]:
        req = translate({"input": "hi"}, lambda _: [])
        output = Output(SimpleNamespace(decode=lambda ids: ""))  # no token ever comes
        error_of = lambda e: APIError(503, str(e), code="out_of_memory")  # noqa: E731
        return [e async for e in ResponseRun(req, "tiny", FailingRun(), output, error_of).events()]

    got = asyncio.run(events())
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress", "error", "response.failed"
    ]  # fmt: skip
    assert [e["sequence_number"] for e in got] == [0, 1, 2, 3]
    assert got[2]["code"] == "out_of_memory" and "out of memory" in got[2]["message"]
    failed = got[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "out_of_memory"
    assert failed["usage"]["input_tokens"] == 3


def test_a_stored_body_is_counted_by_its_parsed_size():
    """The store's byte bound counts what a body holds once parsed, which JSON's length hides
    (5 million `{}` in 14 MB of JSON held ~300 MB): the footprint bounds the parsed objects'
    memory for bodies of many small values and of long text alike."""
    import json
    import tracemalloc

    from tinyoss.server.app import _footprint

    bodies = [
        '{"input": [{"role": "user", "content": "hi", "junk": [%s]}]}' % ",".join(["{}"] * 50000),
        '{"input": [%s]}' % ",".join(['"ab"'] * 50000),
        '{"input": [%s]}' % ",".join(["[1, 2.5, null]"] * 20000),
        '{"input": "%s"}' % ("x" * 1_000_000),
    ]
    for raw in bodies:
        helds = []
        for _ in range(3):  # the least of three: another thread's allocations count too
            tracemalloc.start()
            parsed = json.loads(raw)
            helds.append(tracemalloc.get_traced_memory()[0])
            tracemalloc.stop()
            del parsed
        held = min(helds)
        assert held > len(raw) // 2 and held <= _footprint(raw), (raw[:40], held, _footprint(raw))
    assert _footprint(bodies[0]) > 20 * len(bodies[0])  # mostly containers: far above length
