"""A disconnect storm: streaming chat requests whose clients leave before reading anything, at
the response headers, or after the first chunk, and non-streaming ones abandoned mid-flight.
Afterwards nothing may run, wait or hold KV blocks (GET /metrics), and a normal request works.

A client that meets a full queue (429) tries again shortly, so that every storm request is
admitted at some point and then abandoned; those that leave before reading anything cannot know
and are sent once."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from tests.reliability.helpers import (
    CHAT,
    COMPLETIONS,
    MODEL,
    TIMEOUT,
    TRACKER,
    Api,
    Hang,
    auth_headers,
    http_request,
    wait_idle,
)

STREAMS = 30
ABANDONED = 8
MODES = ("leave-before-reading", "leave-at-headers", "leave-after-first-chunk")


def storm_body(i: int, stream: bool) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"storm request {i}: tell me a long story"}],
        "max_tokens": 50,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": stream,
    }


async def send_and_close(api: Api, path: str, body: dict, linger: float) -> str:
    """A raw connection that sends a whole request, waits `linger` s reading nothing, and
    closes."""
    reader, writer = await asyncio.open_connection(api.host, api.port)
    writer.write(http_request("POST", path, json.dumps(body).encode()))
    await writer.drain()
    await asyncio.sleep(linger)
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return "left"


async def stream_and_leave(api: Api, client: httpx.AsyncClient, i: int, mode: str) -> str:
    body = storm_body(i, stream=True)
    if mode == "leave-before-reading":
        return await send_and_close(api, CHAT, body, 0.0)
    what = f"storm stream {i} ({mode})"
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        async with client.stream("POST", CHAT, json=body, timeout=TIMEOUT) as r:
            TRACKER.record(r.status_code, what)
            if r.status_code == 429 and asyncio.get_running_loop().time() < deadline:
                await r.aread()
                await asyncio.sleep(0.05 + random.random() * 0.2)
                continue
            if r.status_code != 200:
                await r.aread()
                return f"{what}: {r.status_code} {r.text[:200]}"
            if mode == "leave-after-first-chunk":
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
            return "left"  # leaving the block closes the connection mid-stream


async def storm(api: Api) -> list:
    async with api.async_client(headers=auth_headers()) as client:

        async def guarded(coro, what: str):
            try:
                return await asyncio.wait_for(coro, TIMEOUT + 30)
            except asyncio.TimeoutError:
                TRACKER.hang(what)
                return Hang(f"hang: {what}")
            except (httpx.TransportError, OSError) as e:
                TRACKER.lose(what)
                return f"{what}: connection failed: {e!r}"

        tasks = [
            guarded(stream_and_leave(api, client, i, MODES[i % 3]), f"storm stream {i}")
            for i in range(STREAMS)
        ]
        tasks += [
            guarded(
                send_and_close(
                    api, CHAT if i % 2 else COMPLETIONS,
                    storm_body(i, stream=False) if i % 2 else {
                        "model": MODEL, "prompt": f"abandoned {i}", "max_tokens": 50,
                        "ignore_eos": True, "temperature": 1.0,
                    },
                    0.1 + random.random() * 0.7,
                ),
                f"abandoned non-streaming {i}",
            )
            for i in range(ABANDONED)
        ]  # fmt: skip
        return await asyncio.gather(*tasks)


def test_disconnect_storm_leaves_nothing_running(api: Api) -> None:
    before = wait_idle(api)
    results = asyncio.run(storm(api))
    bad = [r for r in results if r != "left"]
    assert not bad, f"storm requests that were not admitted and left: {bad[:5]}"
    after = wait_idle(api, deadline_s=30)
    aborted = after.get("tinyoss_requests_aborted_total", 0) - before.get(
        "tinyoss_requests_aborted_total", 0
    )
    assert aborted >= 1, "no request counted as aborted after a disconnect storm"
    api.ok_completion("the disconnect storm")
    wait_idle(api)
