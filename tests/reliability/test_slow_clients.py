"""Slow and idle clients on raw sockets: the server must close a connection that has not sent
its request headers within --header-timeout (a half request line, nothing at all, headers
trickled a byte at a time), answer 408 or close one whose body has not arrived within
--body-timeout, and close an idle keep-alive connection after --timeout-keep-alive; all while
GET /health keeps answering within a second.

The scenarios run at once (a module fixture, in threads, under one /health watch); each test
then judges one of them."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from tests.reliability.helpers import (
    BODY_TIMEOUT,
    CHAT,
    HEADER_TIMEOUT,
    KEEP_ALIVE,
    MARGIN,
    Api,
    HealthWatch,
    RawResponse,
    check_error,
    connect,
    http_head,
    read_response,
    record_raw,
    wait_closed,
)

BODY = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
HEAD_1000 = http_head("POST", CHAT, {"Content-Type": "application/json", "Content-Length": "1000"})


def _trickle(sock, data: bytes, every: float, stop: threading.Event) -> None:
    """Sends `data` a byte every `every` s until stopped or the server closes."""
    for i in range(len(data)):
        if stop.wait(every):
            return
        try:
            sock.sendall(data[i : i + 1])
        except OSError:
            return


def _sends_then_waits(data: bytes):
    """A client that sends `data` (maybe nothing) and then nothing more."""

    def client(api: Api) -> RawResponse:
        sock = connect(api)
        if data:
            sock.sendall(data)
        try:
            return wait_closed(sock, HEADER_TIMEOUT + MARGIN + 3)
        finally:
            sock.close()

    return client


half_request_line = _sends_then_waits(b"POST /v1/chat/comp")
idle_fresh_connection = _sends_then_waits(b"")
headers_without_end = _sends_then_waits(
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app"
)


def _trickled(sock, data: bytes, limit: float, **wait) -> RawResponse:
    """`data` a byte every 0.3 s on `sock` until the server closes it (`wait_closed`)."""
    stop = threading.Event()
    thread = threading.Thread(target=_trickle, args=(sock, data, 0.3, stop), daemon=True)
    thread.start()
    try:
        return wait_closed(sock, limit, **wait)
    finally:
        stop.set()
        sock.close()
        thread.join(2)


def headers_trickled(api: Api) -> RawResponse:
    """A byte every 0.3 s: each read is recent, but the headers never complete in time."""
    return _trickled(connect(api), HEAD_1000, HEADER_TIMEOUT + MARGIN + 3)


def body_stalled(api: Api) -> RawResponse:
    """Content-Length 1000, 10 bytes of it, then nothing."""
    sock = connect(api)
    sock.sendall(HEAD_1000 + BODY[:10])
    try:
        return wait_closed(sock, BODY_TIMEOUT + MARGIN + 3, stop_on_status=True)
    finally:
        sock.close()


def body_trickled(api: Api) -> RawResponse:
    """Content-Length 1000, then a byte every 0.3 s: never complete within the timeout."""
    sock = connect(api)
    sock.sendall(HEAD_1000)
    return _trickled(sock, BODY, BODY_TIMEOUT + MARGIN + 3, stop_on_status=True)


def _answered_then_trickled(head: bytes):
    """A request the server answers without reading its body (413 for its Content-Length, 404
    for its path), whose body then comes a byte every 0.3 s: it had held its connection for as
    long as bytes came (a few such clients took every --max-connections slot, /health too)."""

    def client(api: Api) -> RawResponse:
        sock = connect(api)
        sock.sendall(head)
        return _trickled(sock, BODY * 4, HEADER_TIMEOUT + MARGIN + 3)

    return client


over_limit_trickled = _answered_then_trickled(http_head(
    "POST", CHAT, {"Content-Type": "application/json", "Content-Length": "99999999"}))
unknown_path_trickled = _answered_then_trickled(http_head(
    "POST", "/v1/nowhere", {"Content-Type": "application/json", "Content-Length": "1000"}))


def idle_keep_alive(api: Api) -> RawResponse:
    """One complete request on a keep-alive connection, then silence."""
    sock = connect(api)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    first = read_response(sock, 10)
    record_raw(first, "GET /health (keep-alive)")
    assert first.status == 200, f"GET /health on a raw socket: {first}"
    try:
        return wait_closed(sock, KEEP_ALIVE + MARGIN + 3)
    finally:
        sock.close()


# name -> (scenario, its timeout flag, the timeout, a 408 counts as the server's answer)
SCENARIOS: dict[str, tuple[Callable[[Api], RawResponse], str, float, bool]] = {
    "half-request-line": (half_request_line, "--header-timeout", HEADER_TIMEOUT, False),
    "idle-fresh-connection": (idle_fresh_connection, "--header-timeout", HEADER_TIMEOUT, False),
    "headers-without-end": (headers_without_end, "--header-timeout", HEADER_TIMEOUT, False),
    "headers-trickled": (headers_trickled, "--header-timeout", HEADER_TIMEOUT, False),
    "body-stalled": (body_stalled, "--body-timeout", BODY_TIMEOUT, True),
    "body-trickled": (body_trickled, "--body-timeout", BODY_TIMEOUT, True),
    "idle-keep-alive": (idle_keep_alive, "--timeout-keep-alive", KEEP_ALIVE, False),
    "413-then-body-trickled": (over_limit_trickled, "--header-timeout", HEADER_TIMEOUT, False),
    "404-then-body-trickled": (unknown_path_trickled, "--header-timeout", HEADER_TIMEOUT, False),
}


@pytest.fixture(scope="module")
def outcomes(api: Api) -> tuple[dict[str, RawResponse | BaseException], HealthWatch]:
    results: dict[str, RawResponse | BaseException] = {}

    def run(name: str) -> None:
        try:
            results[name] = SCENARIOS[name][0](api)
        except BaseException as e:  # noqa: BLE001 - reported by the scenario's test
            results[name] = e

    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in SCENARIOS]
    with HealthWatch(api, limit=1.0) as health:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    return results, health


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_slow_client_is_cut_off(api: Api, server, outcomes, name: str) -> None:
    _, flag, timeout, may_408 = SCENARIOS[name]
    r = outcomes[0].get(name)
    assert r is not None, f"{name}: the scenario did not finish"
    if isinstance(r, BaseException):
        raise r
    record_raw(r, f"slow client {name}")
    limit = timeout + MARGIN
    if r.status is not None:
        assert r.status < 500, f"{name}: answered {r.status}"
        check_error(r.status, r.text, what=f"{name}: the answer before closing")
    if may_408 and r.status == 408:
        assert r.elapsed <= limit, f"{name}: 408 only after {r.elapsed:.1f} s (limit {limit:g} s)"
    else:
        assert r.how in ("closed", "reset"), (
            f"{name}: still open after {r.elapsed:.1f} s ({flag} {timeout:g}, margin {MARGIN:g})"
            + (f"; it sent {r.status}" if r.status else "")
        )
        assert r.elapsed <= limit, (
            f"{name}: closed only after {r.elapsed:.1f} s (limit {limit:g} s)"
        )
    api.ok_completion(f"slow client {name}")


def test_health_answers_while_slow_clients_hang_on(outcomes) -> None:
    outcomes[1].check()
