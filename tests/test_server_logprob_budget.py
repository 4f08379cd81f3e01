"""The logprob memory budget (--max-logprob-memory) end to end: a live tiny server with a small
budget, its core scripted (tests/core_hooks.py: SLOW prompts take 20 ms a step, NAN ones fail).

A request that keeps its logprobs for its answer reserves its worst case when it starts: beyond
the whole budget it is a 400 naming the fields and the largest max_tokens that fits, beyond what
is free a 429 with Retry-After, and the reservation is given back however the request ends. A
stream keeps no logprobs it has sent, so it is neither refused nor throttled; one whose client
stops reading is cut off once what it has not sent outgrows the budget."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.core_hooks import ANSWER, NAN, SLOW
from tests.test_server import KEY, MAX_LEN, post, scripted_server, wait_idle
from tinyoss.sampling_params import SamplingParams
from tinyoss.server.app import _check_limits, _gib, _logprob_reservation
from tinyoss.server.limits import STREAM_WINDOW_TOKENS, LogprobBudget, ServerLimits, logprob_bytes
from tinyoss.server.protocol import APIError, Prepared

K = 5  # top_logprobs of most requests here
FITS = 120  # tokens at top_logprobs K that the budget holds
BUDGET = FITS * logprob_bytes(1, K)
HOLD = 80  # max_tokens of a request that holds the budget: two such do not fit
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    limits = ServerLimits(max_logprob_memory=BUDGET / 2**30)
    folder = tmp_path_factory.mktemp("budget")
    with scripted_server(folder, "tests.core_hooks:scripted_faults", limits=limits) as served:
        served.budget = served.state.logprobs
        assert served.budget.total == BUDGET
        # small send buffers (connections inherit them), so that a client that does not read
        # holds up its stream after a few steps, not after megabytes
        for server in served.server.servers:
            for sock in server.sockets:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        yield served


def chat(max_tokens: int | None = None, k: int = K, prompt: str = "hi", **kw) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "logprobs": True,
            "top_logprobs": k, "ignore_eos": True, **kw}  # fmt: skip
    return body if max_tokens is None else {**body, "max_tokens": max_tokens}


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def wait_released(srv, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while srv.budget.used and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.budget.used == 0


def wait_reserved(srv, nbytes: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while srv.budget.used != nbytes and time.monotonic() < deadline:
        time.sleep(0.005)
    assert srv.budget.used == nbytes


class Holder:
    """A request of `body` to `path` in a thread, keeping the budget while it runs."""

    def __init__(self, srv, path: str, body: dict, timeout: float = 60) -> None:
        self.response: httpx.Response | Exception | None = None
        self.thread = threading.Thread(target=self._run, args=(srv, path, body, timeout))
        self.thread.start()

    def _run(self, srv, path: str, body: dict, timeout: float) -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        try:
            self.response = httpx.post(srv.url + path, json=body, headers=headers,
                                       timeout=timeout)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the test looks at it
            self.response = e

    def join(self) -> httpx.Response | Exception | None:
        self.thread.join(60)
        return self.response


def gauges(srv) -> dict[str, float]:
    """The logprob budget's two series on /metrics."""
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("tinyoss_logprob_memory_")}  # fmt: skip


def stream_lines(srv, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line.startswith("data: ")]


# ---------------------------------------------------------------- refused: 400


def test_a_request_beyond_the_whole_budget_is_a_400_that_says_what_fits(srv):
    err = error_of(post(srv, CHAT, chat(max_tokens=200)), 400)
    assert err["param"] == "max_tokens" and err["type"] == "invalid_request_error"
    message = err["message"]
    for part in ("top_logprobs=5 with max_tokens=200", "200 tokens x 6 entries",
                 "--max-logprob-memory", f"max_tokens of at most {FITS} at top_logprobs=5",
                 "fewer top_logprobs", "stream the answer"):  # fmt: skip
        assert part in message, message
    # no max_tokens: counted at the context left
    err = error_of(post(srv, CHAT, chat()), 400)
    assert err["param"] == "max_tokens" and "with no max_tokens (up to the" in err["message"]
    assert f"at most {FITS} at" in err["message"]
    # completions: its field is logprobs; n choices of each prompt count
    body = {"prompt": "hi", "logprobs": K, "max_tokens": HOLD, "n": 2}
    err = error_of(post(srv, COMPLETIONS, body), 400)
    assert err["param"] == "max_tokens", err
    assert f"logprobs=5 with max_tokens={HOLD}" in err["message"]
    assert "2 choices x" in err["message"]
    assert f"at most {FITS // 2} at logprobs=5" in err["message"]
    # so many choices that no max_tokens fits: the field to lower is top_logprobs (or n)
    err = error_of(post(srv, CHAT, chat(max_tokens=1, k=20, n=128)), 400)
    assert err["param"] == "top_logprobs" and "fewer top_logprobs or fewer choices" in \
        err["message"]  # fmt: skip
    assert srv.budget.used == 0


def test_prompt_logprobs_beyond_the_budget_name_their_field(srv):
    """Prompt logprobs stay to the end of a request, streamed or not: beyond the budget a 400
    names prompt_logprobs (or echo's logprobs, which ask for them), with no hint to stream.
    The engine's copy counts, and each completions choice's (with echo and logprobs, twice)."""
    ids = list(range(1000, 1070))  # 70 tokens x 6 entries, twice: more than FITS
    err = error_of(post(srv, COMPLETIONS, {"prompt": ids, "max_tokens": 1,
                                           "prompt_logprobs": K}), 400)
    assert err["param"] == "prompt_logprobs", err
    for part in ("prompt_logprobs may hold", "70 tokens x 6 entries", "--max-logprob-memory",
                 "streaming does not help", "fewer prompt_logprobs", "shorter prompt"):
        assert part in err["message"], err["message"]
    assert "fewer choices" not in err["message"]
    short = {"prompt": ids[:30], "max_tokens": 1, "prompt_logprobs": K}
    answer = post(srv, COMPLETIONS, short)  # 30 x 2 copies: fits
    assert answer.status_code == 200 and len(answer.json()["choices"][0]["prompt_logprobs"]) == 30
    err = error_of(post(srv, COMPLETIONS, {**short, "n": 4}), 400)  # 30 x 5 copies
    assert err["param"] == "prompt_logprobs" and "fewer choices" in err["message"]
    echo = {"prompt": ids[:30], "max_tokens": 1, "echo": True, "logprobs": K, "n": 3}
    err = error_of(post(srv, COMPLETIONS, echo), 400)  # 30 x 7 copies
    assert err["param"] == "logprobs" and "echo with logprobs" in err["message"], err
    assert srv.budget.used == 0


def test_a_response_beyond_the_budget_names_its_own_fields(srv):
    """A response keeps its logprobs even streamed (its last events carry them all): no hint
    to stream."""
    for stream in (False, True):
        body = {"input": "hi", "top_logprobs": K, "max_output_tokens": 200, "stream": stream}
        err = error_of(post(srv, RESPONSES, body), 400)
        assert err["param"] == "max_output_tokens", err
        message = err["message"]
        assert "top_logprobs=5 with max_output_tokens=200" in message
        assert f"max_output_tokens of at most {FITS} at top_logprobs=5" in message
        assert "stream" not in message


def test_the_default_budget_takes_top_logprobs_20_without_max_tokens_on_a_131k_context():
    """The reverted attempt (08ed8ae) counted logprobs on --max-request-tokens, which counts a
    request without max_tokens at the whole context: top_logprobs >= 7 became a 400 on
    gpt-oss's 131,072 tokens."""
    limits = ServerLimits()
    prep = Prepared([], "messages", SamplingParams(logprobs=20, max_tokens=None),
                    prompts=[[1] * 100])  # fmt: skip
    _check_limits(prep, limits, 131072, keep_logprobs=True)
    need = _logprob_reservation(prep, 131072, keep=True)
    assert need == logprob_bytes(131072 - 100, 20)
    assert LogprobBudget(_gib(limits.max_logprob_memory)).take(need)
    # two choices kept are a 400; streamed, they keep none they have sent: nothing reserved
    prep.params = SamplingParams(logprobs=20, n=2, max_tokens=None)
    with pytest.raises(APIError) as e:
        _check_limits(prep, limits, 131072, keep_logprobs=True)
    assert e.value.status == 400 and "--max-logprob-memory" in e.value.message
    _check_limits(prep, limits, 131072, keep_logprobs=False)
    assert _logprob_reservation(prep, 131072, keep=False) == 0


# ---------------------------------------------------------------- busy: 429, then 200


def test_a_429_while_the_budget_is_held_becomes_a_200_once_the_holder_finishes(srv):
    holder = Holder(srv, CHAT, chat(max_tokens=HOLD, prompt=SLOW))
    wait_reserved(srv, logprob_bytes(HOLD, K))
    assert gauges(srv) == {"tinyoss_logprob_memory_used_bytes": logprob_bytes(HOLD, K),
                           "tinyoss_logprob_memory_limit_bytes": BUDGET}  # /metrics shows it
    r = post(srv, CHAT, chat(max_tokens=HOLD))
    err = error_of(r, 429)
    assert r.headers["retry-after"] == "1" and err["code"] == "too_many_requests"
    assert "--max-logprob-memory" in err["message"] and "retry shortly" in err["message"]
    r = post(srv, COMPLETIONS, {"prompt": "hi", "logprobs": K, "max_tokens": HOLD})
    assert r.status_code == 429  # completions too
    # a stream of the same (or beyond the whole budget) is not throttled: it keeps none it sent
    lines = stream_lines(srv, CHAT, chat(max_tokens=FITS + 10))
    assert lines[-1] == "data: [DONE]" and not any('"error"' in ln for ln in lines)
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len((c["choices"][0]["logprobs"] or {}).get("content") or ())
               for c in chunks if c["choices"]) > 0  # fmt: skip
    assert holder.join().status_code == 200  # success: given back once the answer is sent
    wait_released(srv)
    assert post(srv, CHAT, chat(max_tokens=HOLD)).status_code == 200
    wait_released(srv)


# ---------------------------------------------------------------- given back on every ending


def test_a_client_that_leaves_gives_its_reservation_back(srv):
    holder = Holder(srv, CHAT, chat(max_tokens=HOLD, prompt=SLOW), timeout=0.5)
    assert isinstance(holder.join(), httpx.ReadTimeout)
    wait_idle(srv)
    wait_released(srv)


def test_an_engine_failure_gives_its_reservation_back(srv):
    err = error_of(post(srv, CHAT, chat(max_tokens=HOLD, prompt=NAN)), 500)
    assert err["code"] == "non_finite_logits"
    wait_released(srv)
    body = {"prompt": NAN, "logprobs": K, "max_tokens": HOLD, "stream": True}
    lines = stream_lines(srv, COMPLETIONS, body)
    assert "non_finite_logits" in lines[-2] and lines[-1] == "data: [DONE]"
    wait_released(srv)


@pytest.mark.parametrize("how", ["cancel", "disconnect", "end"])
def test_a_response_gives_its_reservation_back(srv, how):
    """Streamed: a response keeps its logprobs, so it reserves; cancelled, left by its client,
    or ended, it gives them back."""
    slow = [{"role": "user", "content": m} for m in (SLOW, ANSWER)]  # 20 ms a scripted step
    body = {"input": slow, "top_logprobs": K, "max_output_tokens": HOLD, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", srv.url + RESPONSES, json=body, headers=headers, timeout=60) as r:
        data = (json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: "))
        rid = next(data)["response"]["id"]
        assert srv.budget.used == _reserved_by_a_response(srv)
        if how == "cancel":
            assert post(srv, f"{RESPONSES}/{rid}/cancel", None).status_code == 200
        if how != "disconnect":
            assert list(data)[-1]["type"] == {"cancel": "response.failed",
                                              "end": "response.completed"}[how]  # fmt: skip
    wait_released(srv)
    wait_idle(srv)


def _reserved_by_a_response(srv) -> int:
    """What a response of HOLD tokens reserves (its prompt leaves at least that much room)."""
    return logprob_bytes(HOLD, K)


# ---------------------------------------------------------------- a stream not read


def test_a_stream_whose_client_stops_reading_is_cut_off_within_the_budget(srv):
    """Its unsent logprobs had piled up for as long as the engine ran. Past
    STREAM_WINDOW_TOKENS tokens a choice they take from the budget as they grow; when the
    budget has no more, the stream is cut off (an error event once its client reads)."""
    n, max_tokens = 4, MAX_LEN - 160  # the chat prompt's harmony takes some of the context
    body = json.dumps(chat(max_tokens=max_tokens, k=20, n=n, stream=True)).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing
    sock.connect(("127.0.0.1", int(srv.url.rsplit(":", 1)[1])))
    try:
        sock.sendall(
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        most, deadline = 0, time.monotonic() + 60
        time.sleep(0.5)  # the request is in the core
        while srv.client.processor.requests and time.monotonic() < deadline:
            most = max(most, srv.budget.used)
            time.sleep(0.002)
        assert not srv.client.processor.requests  # aborted, its client still not reading
        assert most <= BUDGET
        received = b""
        sock.settimeout(30)
        while not received.endswith(b"0\r\n\r\n"):  # the chunked body's end
            more = sock.recv(1 << 16)
            assert more, received[-500:]
            received += more
    finally:
        sock.close()
    text = received.decode(errors="replace")
    assert "logprob_memory_full" in text and "the stream was cut off" in text
    assert "data: [DONE]" in text
    # cut off long before its end: fewer tokens than its choices would have generated
    assert text.count('"finish_reason": "length"') == 0
    wait_released(srv)
    wait_idle(srv)
    assert STREAM_WINDOW_TOKENS * n < n * max_tokens  # the window alone would not have cut it
