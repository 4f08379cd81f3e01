"""Fault injection through the test-only core hook (hooks.py): a fault of one request fails
that request with a clear error and nothing else (out of memory on its prefill: 503
out_of_memory; NaN logits: 500 non_finite_logits, and never a NaN in JSON); a fault of the
engine (a step that raises) fails what was in flight with 503 engine_unavailable, and the core
restarts. No request hangs, and a normal request succeeds after each."""

from __future__ import annotations

import asyncio
import json
import time

from tests.reliability.helpers import CHAT, COMPLETIONS, MODEL, Api, auth_headers, check_error
from tests.reliability.hooks import CRASH, NAN, OOM


def _error(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text[:300]
    return check_error(r.status_code, r.text, code=code)


def _no_constants(name: str) -> None:
    raise AssertionError(f"{name} in JSON: not valid JSON, and no client parses it")


def _chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, **extra}  # fmt: skip


def _others_meanwhile(api: Api, fault: dict, status: int, n: int = 3) -> tuple:
    """The faulty request among `n` normal ones, all at once; the normal ones must succeed."""

    async def run():
        async with api.async_client() as client:
            normal = {"model": MODEL, "prompt": "fine", "max_tokens": 4, "ignore_eos": True}
            calls = [api.arequest(client, "POST", CHAT, json=fault, allow_5xx=True,
                                  what=f"fault {status}")]  # fmt: skip
            calls += [
                api.arequest(client, "POST", COMPLETIONS, json=normal, what="beside a fault")
                for _ in range(n)
            ]
            return await asyncio.gather(*calls)

    bad, *good = asyncio.run(run())
    for r in good:
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"]["completion_tokens"] == 4
    return bad


def test_out_of_memory_on_a_prefill_fails_only_that_request(api: Api):
    r = _others_meanwhile(api, _chat(f"{OOM} a long prompt " * 20), 503)
    err = _error(r, 503, code="out_of_memory")
    assert "out of memory while computing" in err["message"]
    api.ok_completion("an out-of-memory prefill")
    assert api.get("/health", auth=False).status_code == 200


def test_nan_logits_fail_only_that_request_and_never_reach_json(api: Api):
    r = _others_meanwhile(api, _chat(f"{NAN} hi", logprobs=True, top_logprobs=2), 500)
    err = _error(r, 500, code="non_finite_logits")
    assert "not finite" in err["message"]
    with api.client.stream(
        "POST", CHAT, json=_chat(f"{NAN} hi", stream=True, logprobs=True),
        headers=auth_headers(),
    ) as s:  # fmt: skip
        assert s.status_code == 200
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    api.tracker.record(200, "nan stream")
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e, parse_constant=_no_constants) for e in events[:-1]]
    assert payloads[-1]["error"]["code"] == "non_finite_logits"
    api.ok_completion("NaN logits")


def test_a_step_that_raises_restarts_the_engine(api: Api):
    r = api.post(CHAT, _chat(f"{CRASH} hi"), allow_5xx=True, what="engine fault")
    err = _error(r, 503, code="engine_unavailable")
    assert "injected engine fault" in err["message"]
    deadline = time.monotonic() + 90
    while api.get("/health", auth=False, allow_5xx=True).status_code != 200:
        assert time.monotonic() < deadline, "the engine core did not come back"
        time.sleep(0.2)
    api.ok_completion("an engine restart")

