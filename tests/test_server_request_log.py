"""--enable-log-requests on the tiny server: one line a generation request once it has ended,
under the request's x-request-id, with its status, finish reasons, token counts, times and
client; never the prompt's text, unless --max-log-len asks for (at most) that many characters
of it; no line at all without the flag."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.core_hooks import SLOW
from tests.test_server import KEY, TINY, Served, environ, wait_healthy
from tinyoss.engine.builder import load_tokenizer
from tinyoss.engine.core_process import HOOK_ENV
from tinyoss.tools.make_checkpoint import ensure_tiny
from tinyoss.server.app import create_app
from tinyoss.server.request_log import RequestLog

HEADERS = {"Authorization": f"Bearer {KEY}"}
SECRET = "SECRET-PROMPT-TEXT"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    prompts = tmp_path_factory.mktemp("request_log") / "prompts.jsonl"
    prompts.touch()
    with environ(**{HOOK_ENV: "tests.core_hooks:scripted", "TINYOSS_TEST_PROMPTS": str(prompts)}):
        app = create_app(TINY, model_name="tiny", api_key=KEY, request_log=RequestLog())
        served = Served(app)
        wait_healthy(served)
        served.state = app.state.server
        yield served
        served.close()


@pytest.fixture
def lines(caplog):
    """The request lines logged so far (polled: a line comes once the answer is sent)."""
    caplog.set_level("INFO", logger="tinyoss.server")

    def get(request_id: str, count: int = 1) -> list[str]:
        deadline = time.monotonic() + 10
        while True:
            found = [m for m in caplog.messages if m.startswith(f"request {request_id}: ")]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.02)

    return get


def test_a_finished_request_logs_one_line_without_its_text(srv, lines, caplog):
    body = {"model": "tiny", "max_tokens": 3, "ignore_eos": True,
            "messages": [{"role": "user", "content": SECRET}]}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60,
                   headers={**HEADERS, "X-Request-Id": "my-req-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-req-1"
    usage = r.json()["usage"]
    [line] = lines("my-req-1")
    assert re.fullmatch(
        r"request my-req-1: POST /v1/chat/completions 200 finish=length "
        rf"prompt_tokens={usage['prompt_tokens']} completion_tokens=3 "
        rf"cached_tokens={usage['prompt_tokens_details']['cached_tokens']} "
        r"ttft=\d+\.\d{3}s time=\d+\.\d{3}s client=127\.0\.0\.1:\d+", line), line
    ttft, total = (float(x) for x in re.findall(r"=(\d+\.\d+)s", line))
    assert 0 < ttft <= total
    assert not any(SECRET in m for m in caplog.messages)  # nor the prompt in any other line


def test_refused_and_abandoned_requests_log_how_they_ended(srv, lines):
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": 5},
                   headers=HEADERS, timeout=60)
    assert r.status_code == 400
    [line] = lines(r.headers["x-request-id"])
    assert re.fullmatch(r"request req_\w+: POST /v1/completions 400 time=\d+\.\d{3}s "
                        r"client=127\.0\.0\.1:\d+", line), line
    body = {"model": "tiny", "prompt": SLOW, "max_tokens": 400, "n": 2, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=HEADERS) as r:
        request_id = r.headers["x-request-id"]
        assert next(r.iter_lines()).startswith("data: ")  # a token in, the client leaves
    [line] = lines(request_id)
    assert f"request {request_id}: POST /v1/completions 200 finish=abort,abort " in line, line


def test_max_log_len_shows_that_much_of_the_prompt(srv, lines, monkeypatch):
    monkeypatch.setattr(srv.state, "request_log", RequestLog(max_log_len=7))
    body = {"model": "tiny", "prompt": SECRET, "max_tokens": 1}
    r = httpx.post(srv.url + "/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200
    [line] = lines(r.headers["x-request-id"])
    assert line.endswith(" prompt='SECRET-'"), line


def test_max_log_len_counts_characters_not_tokens():
    """An emoji or a rare character is several byte tokens: as many tokens as characters cut
    the head short, into a U+FFFD that is not in the prompt."""
    tok, prompt = load_tokenizer(ensure_tiny()), "\U0001fae0" * 10 + " \U0001d518\U0001d52b"
    ids = tok.encode(prompt)
    assert len(ids) > 2 * len(prompt)
    for most in (0, 1, 5, 11, 12, 100):
        assert RequestLog(most).prompt_head(tok, ids) == prompt[:most]


def test_no_line_without_the_flag(srv, lines, monkeypatch):
    monkeypatch.setattr(srv.state, "request_log", None)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    r = httpx.post(srv.url + "/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200
    time.sleep(0.2)  # where a line would have come
    assert lines(r.headers["x-request-id"], count=0) == []
