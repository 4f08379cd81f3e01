"""What one client may ask of the server: sizes, counts and timeouts, with their flags.

Each limit turns a request that would hog the server into a clear 4xx before any work is done
(413 for a body, 400 naming the field for n and tokens, 429 with Retry-After for a full queue),
and each timeout frees a connection a client holds without using it. `LogprobBudget` bounds the
memory that logprobs hold, all requests together (--max-logprob-memory). `limited_http` adds
the one timeout uvicorn lacks, request headers that never complete (slowloris, fresh idle
connections included), and answers requests beyond --max-connections with a JSON 503 (uvicorn's
own limit answers in plain text). `watchdog_timeout` is the one limit on the engine itself: a
core that stops stepping with requests waiting is restarted (`CoreClient`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tinyoss.config import option


WATCHDOG_MIN_S = 2.0  # twice the engine core's longest silence while it steps (core_process)


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = option("largest request body in bytes (413 beyond)", default=16 << 20)
    max_n: int = option("most choices (n) one request may ask for", default=128)
    max_request_tokens: int = option(
        "most tokens one request may generate in all: n x max_tokens (x prompts)", default=1 << 20
    )
    max_logprob_memory: float = option(
        "GiB of memory the logprobs of all requests in progress may hold: each request that keeps "
        "them for its answer reserves its worst case (400 beyond it all, 429 while it is taken)",
        default=4.0,
    )
    max_queued_requests: int = option(
        "requests that may wait beyond --max-num-seqs running ones (429 beyond)", default=1024
    )
    max_connections: int = option("most open connections (503 beyond)", default=2048)
    header_timeout: float = option(
        "seconds a connection may take to send its request headers, and to end a body the "
        "server answered without reading (a 413, say) before it is closed", default=10.0
    )
    max_header_bytes: int = option(
        "largest request line and headers in bytes (431 beyond)", default=64 << 10
    )
    body_timeout: float = option("seconds a request may take to send its body", default=30.0)
    timeout_keep_alive: float = option(
        "seconds an idle keep-alive connection stays open", default=5.0
    )
    watchdog_timeout: float = option(
        "seconds the engine core may go without a word while requests wait on it: past them it "
        "is deemed hung (a stuck GPU or step), killed and restarted, failing what was in flight "
        "(SGLang's --watchdog-timeout). It must exceed the longest single step (one prefill "
        "chunk: well under a second on a GPU, seconds on a CPU); inf turns it off",
        default=300.0,
    )

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"--{name.replace('_', '-')}={value} is invalid: must be > 0")
        if self.watchdog_timeout < WATCHDOG_MIN_S:
            raise ValueError(
                f"--watchdog-timeout={self.watchdog_timeout} is invalid: must be at least "
                f"{WATCHDOG_MIN_S:g} s (a stepping engine core says it is alive once a second), "
                f"and more than its longest single step; inf turns the watchdog off")


# What a generated token's logprobs hold in the server until its answer is sent, at the peak:
# the engine's entries, the answer's (chat's dicts, Responses' items, completions' lists) and
# their JSON, a sampled token's entry and each of its top_logprobs alternatives.
# tests/test_logprob_memory.py measures them (tracemalloc) and keeps these above.
TOKEN_ENTRY_BYTES = 2304
ALTERNATIVE_BYTES = 1472
# Tokens a choice of a stream may hold unsent before they count on the budget: a stream keeps no
# entry it has sent, so one whose client reads holds about a step's (or a harmony header's).
STREAM_WINDOW_TOKENS = 64


def logprob_bytes(num_tokens: int, top_logprobs: int) -> int:
    """The memory `num_tokens` tokens' logprobs take, with `top_logprobs` alternatives each."""
    return num_tokens * (TOKEN_ENTRY_BYTES + top_logprobs * ALTERNATIVE_BYTES)


class LogprobBudget:
    """Memory for logprobs, all requests together: `take` what a request may hold (False when
    that is more than is free), `give_back` once it no longer does."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0

    def take(self, nbytes: int) -> bool:
        if nbytes > self.total - self.used:
            return False
        self.used += nbytes
        return True

    def give_back(self, nbytes: int) -> None:
        self.used -= nbytes


def limited_http(limits: ServerLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, closing connections whose headers are not complete within
    --header-timeout seconds of connecting (or of the previous response), and those answered
    before their body arrived (413, 415, 404, 408) whose body is not complete within
    --header-timeout more (uvicorn kept them open while any byte came), answering 431 to
    headers beyond --max-header-bytes (httptools takes any size, and joins a long header in
    quadratic time: one 100 MB header held the event loop for seconds), and 503 beyond
    --max-connections (open connections, or requests in progress)."""

    class LimitedHttp(HttpToolsProtocol):
        _header_timer = None
        _unread_timer = None  # the body of a request already answered: its time to end
        _header_bytes = 0
        _body_done = True  # the request's body is read to its end (the next headers may come)

        def _arm(self) -> None:
            self._disarm()
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(limits.header_timeout, self._too_slow)

        def data_received(self, data: bytes) -> None:
            if self._header_timer is not None:  # headers still arriving
                # a read may hold the body too: count up to the blank line that ends them
                ends = [i for i in (data.find(b"\r\n\r\n"), data.find(b"\n\n")) if i >= 0]
                self._header_bytes += min(ends) if ends else len(data)
                if self._header_bytes > limits.max_header_bytes:
                    self._disarm()
                    self.transport.write(_HEADERS_TOO_LARGE)
                    self.transport.close()
                    return
            super().data_received(data)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            self._body_done = False
            most = limits.max_connections
            if len(self.connections) > most or len(self.tasks) >= most:
                app, self.app = self.app, _too_many_connections
                try:
                    super().on_headers_complete()
                finally:
                    self.app = app
            else:
                super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._body_done = True
            self._stop_unread()
            if self.cycle is not None and self.cycle.response_complete:
                self._next_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._body_done:
                self._next_headers()
            elif not self.transport.is_closing():
                # answered before its body arrived: the rest is read (and dropped) for a while,
                # so the client gets to read the answer, then the connection closes; a client
                # trickling a body nobody reads had held a connection for ever
                self._stop_unread()
                self._unread_timer = self.loop.call_later(limits.header_timeout, self._too_slow)

        def _stop_unread(self) -> None:
            if self._unread_timer is not None:
                self._unread_timer.cancel()
                self._unread_timer = None

        def _next_headers(self) -> None:
            """The next request's headers are counted and timed from here: once both the
            response and the request's body are complete. An error answered before the body
            arrived (404, 413, 401) had counted the rest of the body as the next headers: a
            431 and a reset for the request after it."""
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._stop_unread()
            super().connection_lost(exc)

    return LimitedHttp


def _error_response(status: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


_HEADERS_TOO_LARGE = _error_response(
    "431 Request Header Fields Too Large",
    "the request line and headers are larger than the server takes (--max-header-bytes)",
    "headers_too_large")


async def _too_many_connections(scope, receive, send) -> None:  # an ASGI app
    error = {
        "message": "the server has too many open connections (--max-connections); retry shortly",
        "type": "server_error",
        "param": None,
        "code": "too_many_connections",
    }
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"1"),
               (b"connection", b"close")]  # fmt: skip
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})
