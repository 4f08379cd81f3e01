"""Shared pieces of the reliability suite: the limits the server runs with, the counters every
response goes through, an HTTP client that counts, raw-socket HTTP, and /health and /metrics
watchers.

Every request of the suite goes through `TRACKER`: a response with a 5xx status (unless a test
expects one, e.g. --max-connections' 503), a request that ran past its timeout (a hang), and a
request that got no answer (connection dropped) or more than one are counted, and the session
fails at the end when any 5xx or hang was seen (conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

KEY = "reliability-key"
MODEL = "tiny"
MAX_MODEL_LEN = 512
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TIMEOUT = 30.0  # every request's limit: past it, a request is a counted hang

# The limits the suite's server is started with (conftest.py); small, so that tests can reach
# them. MAX_REQUEST_BYTES stays above 5 MB: a 5 MB prompt must reach the context-length check.
MAX_NUM_SEQS = 2
MAX_QUEUED = 2
MAX_N = 8
MAX_REQUEST_TOKENS = 1000
MAX_REQUEST_BYTES = 6_000_000
MAX_CONNECTIONS = 64
HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 2.0
KEEP_ALIVE = 1.0
MARGIN = 2.0  # slack on a 2-core CI machine for a timeout to fire and the close to arrive

# flag -> value, in the order given to `tinyoss serve`
SERVER_FLAGS: dict[str, str] = {
    "--max-num-seqs": str(MAX_NUM_SEQS),
    "--max-queued-requests": str(MAX_QUEUED),
    "--max-n": str(MAX_N),
    "--max-request-tokens": str(MAX_REQUEST_TOKENS),
    "--max-request-bytes": str(MAX_REQUEST_BYTES),
    "--max-connections": str(MAX_CONNECTIONS),
    "--header-timeout": str(HEADER_TIMEOUT),
    "--body-timeout": str(BODY_TIMEOUT),
    "--timeout-keep-alive": str(KEEP_ALIVE),
}


# ------------------------------------------------------------------------------------ counters


@dataclass
class Tracker:
    """Counts of the whole session; thread-safe (tests use threads and event loops)."""

    classes: int = 0  # malformed-input classes tried
    responses: int = 0
    server_errors: int = 0  # 5xx not expected by the test
    expected_5xx: int = 0
    hangs: int = 0  # requests past their timeout
    lost: int = 0  # requests that got no answer (connection dropped, no status)
    duplicated: int = 0  # requests answered more than once (two [DONE], two finish reasons...)
    events: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def used(self) -> bool:
        return bool(self.responses or self.hangs or self.lost or self.classes)

    def _event(self, text: str) -> None:
        if len(self.events) < 200:
            self.events.append(text)

    def record(self, status: int, what: str, *, allow_5xx: bool = False) -> None:
        with self.lock:
            self.responses += 1
            if status >= 500:
                if allow_5xx:
                    self.expected_5xx += 1
                else:
                    self.server_errors += 1
                    self._event(f"{status} from {what}")

    def hang(self, what: str) -> None:
        with self.lock:
            self.hangs += 1
            self._event(f"hang: {what}")

    def lose(self, what: str) -> None:
        with self.lock:
            self.lost += 1
            self._event(f"lost: {what}")

    def duplicate(self, what: str) -> None:
        with self.lock:
            self.duplicated += 1
            self._event(f"duplicated: {what}")

    def add_class(self) -> None:
        with self.lock:
            self.classes += 1

    def summary(self) -> str:
        return (
            f"reliability: classes tried {self.classes}, responses {self.responses}, "
            f"5xx {self.server_errors} (+{self.expected_5xx} expected), hangs {self.hangs}, "
            f"lost {self.lost}, duplicated {self.duplicated}"
        )


TRACKER = Tracker()


class Hang(AssertionError):
    pass


class Lost(AssertionError):
    pass


# ------------------------------------------------------------------------------ error bodies

ANY = object()  # "not checked"


def error_type(status: int) -> str | None:
    if 400 <= status < 500:  # OpenAI's type for 401 and 404 too
        return "invalid_request_error"
    return None  # 5xx: not pinned


def check_error(
    status: int,
    text: str,
    *,
    param: Any = ANY,
    code: Any = ANY,
    contains: str | None = None,
    what: str = "",
) -> dict:
    """Asserts the OpenAI error shape {"error": {message, type, param, code}} and its fields;
    `param`/`code` may be a value, a tuple of allowed values, or ANY."""
    where = f"{what}: status {status}, body {text[:300]!r}"
    try:
        body = json.loads(text)
    except ValueError:
        raise AssertionError(f"error body is not JSON; {where}") from None
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"no error object; {where}"
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, f"error keys {sorted(err)}; {where}"
    assert isinstance(err["message"], str) and err["message"], f"message not a str; {where}"
    assert isinstance(err["type"], str), f"type not a str; {where}"
    assert err["param"] is None or isinstance(err["param"], str), f"param type; {where}"
    assert err["code"] is None or isinstance(err["code"], str), f"code type; {where}"
    want_type = error_type(status)
    if want_type is not None:
        assert err["type"] == want_type, f"type {err['type']!r}, want {want_type!r}; {where}"
    for name, want in (("param", param), ("code", code)):
        if want is ANY:
            continue
        allowed = want if isinstance(want, tuple) else (want,)
        got = err[name]
        if name == "param" and isinstance(got, str):  # a path within the field names it too
            got = next((a for a in allowed if a and got.startswith((a + "[", a + "."))), got)
        assert got in allowed, f"{name} {err[name]!r}, want {' or '.join(map(repr, allowed))}; {where}"
    if contains is not None:
        assert contains in err["message"], f"message does not name {contains!r}; {where}"
    return err


# ------------------------------------------------------------------------------ HTTP clients


def _no_pool() -> httpx.Limits:
    # a fresh connection per request: the server closes idle keep-alive connections after 1 s,
    # and reusing one as it closes would read as a dropped request
    return httpx.Limits(max_keepalive_connections=0, max_connections=200)


def auth_headers(key: str | None = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


class Api:
    """httpx against the live server; every answer and failure goes through TRACKER."""

    def __init__(self, url: str, tracker: Tracker = TRACKER) -> None:
        self.url, self.tracker = url, tracker
        self.host, port = url.removeprefix("http://").split(":")
        self.port = int(port)
        self.client = httpx.Client(base_url=url, timeout=TIMEOUT, limits=_no_pool())

    def close(self) -> None:
        self.client.close()

    def async_client(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=TIMEOUT, limits=_no_pool(), **kw)

    @staticmethod
    def _args(json_body: Any, content: Any, headers: dict | None, auth: bool) -> dict:
        h = dict(auth_headers() if auth else {})
        h.update(headers or {})
        kw: dict[str, Any] = {"headers": h}
        if content is not None:
            kw["content"] = content
        elif json_body is not None:
            kw["content"] = json.dumps(json_body).encode()
            h.setdefault("Content-Type", "application/json")
        return kw

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | str | None = None,
        headers: dict | None = None,
        auth: bool = True,
        timeout: float = TIMEOUT,
        allow_5xx: bool = False,
        what: str | None = None,
    ) -> httpx.Response:
        what = what or f"{method} {path}"
        kw = self._args(json, content, headers, auth)
        with self._answered(what, timeout):
            r = self.client.request(method, path, timeout=timeout, **kw)
        self.tracker.record(r.status_code, what, allow_5xx=allow_5xx)
        return r

    @contextlib.contextmanager
    def _answered(self, what: str, timeout: float):
        """A request that got no answer is counted: a hang past `timeout`, else lost."""
        try:
            yield
        except (httpx.TimeoutException, asyncio.TimeoutError) as e:
            self.tracker.hang(what)
            raise Hang(f"hang: {what} got no answer within {timeout} s ({e!r})") from None
        except httpx.TransportError as e:
            self.tracker.lose(what)
            raise Lost(f"no answer to {what}: connection dropped ({e!r})") from None

    def post(self, path: str, body: Any, **kw: Any) -> httpx.Response:
        return self.request("POST", path, json=body, **kw)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.request("GET", path, **kw)

    def ok_completion(self, why: str = "") -> dict:
        """A normal 1-token completion must succeed (after `why`)."""
        what = f"normal 1-token completion after {why}" if why else "normal 1-token completion"
        r = self.post(COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 1}, what=what)
        assert r.status_code == 200, f"{what}: status {r.status_code}, body {r.text[:300]!r}"
        body = r.json()
        assert len(body["choices"]) == 1 and body["usage"]["completion_tokens"] <= 1, body
        return body

    async def arequest(
        self,
        client: httpx.AsyncClient,
        method: str,
        path: str,
        *,
        json: Any = None,
        headers: dict | None = None,
        auth: bool = True,
        timeout: float = TIMEOUT,
        allow_5xx: bool = False,
        what: str | None = None,
    ) -> httpx.Response:
        what = what or f"{method} {path}"
        kw = self._args(json, None, headers, auth)
        with self._answered(what, timeout):
            r = await asyncio.wait_for(
                client.request(method, path, timeout=timeout, **kw), timeout + 5
            )
        self.tracker.record(r.status_code, what, allow_5xx=allow_5xx)
        return r

    async def apost_until_admitted(
        self,
        client: httpx.AsyncClient,
        path: str,
        body: dict,
        *,
        what: str,
        deadline_s: float = 60.0,
    ) -> tuple[httpx.Response, int]:
        """POSTs `body`, again after each 429 (the queue is full: the suite's server admits
        MAX_NUM_SEQS + MAX_QUEUED at a time), until another answer; returns it and the 429s."""
        deadline, rejected = time.monotonic() + deadline_s, 0
        while True:
            r = await self.arequest(client, "POST", path, json=body, what=what)
            if r.status_code != 429 or time.monotonic() > deadline:
                return r, rejected
            rejected += 1
            await asyncio.sleep(0.05 + random.random() * 0.15)


# -------------------------------------------------------------------------- raw-socket HTTP


@dataclass
class RawResponse:
    status: int | None  # None: the connection closed (or was reset) before a status line
    headers: dict[str, str]
    body: bytes
    how: str  # "answered", "closed", "reset", "timeout"
    elapsed: float

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


def connect(api: Api, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection((api.host, api.port), timeout=timeout)


def http_head(
    method: str, path: str, headers: dict[str, str] | None = None, *, auth: bool = True
) -> bytes:
    h = {"Host": "127.0.0.1", **(auth_headers() if auth else {}), **(headers or {})}
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in h.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def http_request(method: str, path: str, body: bytes, headers: dict | None = None) -> bytes:
    h = {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}
    return http_head(method, path, h) + body


def _dechunk(data: bytes) -> tuple[bytes, bool]:
    out, pos = b"", 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            return out, False
        size = int(data[pos:end].split(b";")[0] or b"0", 16)
        if size == 0:
            return out, True
        if len(data) < end + 2 + size + 2:
            return out, False
        out += data[end + 2 : end + 2 + size]
        pos = end + 2 + size + 2


def read_response(sock: socket.socket, timeout: float, started: float | None = None) -> RawResponse:
    """Reads one HTTP/1.1 response (or the connection's end) within `timeout` seconds."""
    start = time.monotonic() if started is None else started
    deadline = time.monotonic() + timeout
    buf, how = b"", "timeout"

    def more() -> bytes | None:
        nonlocal how
        left = deadline - time.monotonic()
        if left <= 0:
            how = "timeout"
            return None
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            how = "timeout"
            return None
        except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError):
            how = "reset"
            return None
        if not data:
            how = "closed"
            return None
        return data

    while b"\r\n\r\n" not in buf:
        data = more()
        if data is None:
            return RawResponse(None, {}, buf, how, time.monotonic() - start)
        buf += data
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    match = re.match(r"HTTP/1\.[01] (\d{3})", lines[0])
    status = int(match.group(1)) if match else None
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        want = int(headers["content-length"])
        while len(rest) < want and (data := more()) is not None:
            rest += data
        body = rest[:want]
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        body, done = _dechunk(rest)
        while not done and (data := more()) is not None:
            rest += data
            body, done = _dechunk(rest)
    else:
        while (data := more()) is not None:
            rest += data
        body = rest
    return RawResponse(status, headers, body, "answered", time.monotonic() - start)


def _complete(buf: bytes) -> bool:
    """Whether `buf` holds a whole response with a Content-Length (or headers only, without)."""
    if b"\r\n\r\n" not in buf:
        return False
    head, rest = buf.split(b"\r\n\r\n", 1)
    match = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    return match is None or len(rest) >= int(match.group(1))


def wait_closed(sock: socket.socket, limit: float, *, stop_on_status: bool = False) -> RawResponse:
    """Waits up to `limit` s for the server to close `sock`; collects what it sent first (a 408,
    say). `how` is "closed"/"reset" when it did, "timeout" when the socket was still open, and
    "answered" when `stop_on_status` and a complete 408 arrived (whether or not it closed)."""
    start = time.monotonic()
    deadline, buf = start + limit, b""
    while True:
        if stop_on_status and re.match(rb"HTTP/1\.[01] 408", buf) and _complete(buf):
            how = "answered"
            break
        left = deadline - time.monotonic()
        if left <= 0:
            how = "timeout"
            break
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            how = "timeout"
            break
        except (ConnectionResetError, ConnectionAbortedError):
            how = "reset"
            break
        if not data:
            how = "closed"
            break
        buf += data
    match = re.match(rb"HTTP/1\.[01] (\d{3})", buf)
    body = buf.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in buf else b""
    return RawResponse(int(match.group(1)) if match else None, {}, body, how, time.monotonic() - start)


def record_raw(r: RawResponse, what: str, *, allow_5xx: bool = False) -> None:
    if r.status is not None:
        TRACKER.record(r.status, what, allow_5xx=allow_5xx)


# ------------------------------------------------------------------------ /health and /metrics


class HealthWatch:
    """Polls GET /health in a thread every `every` s while the block runs; afterwards, `worst`
    is the slowest answer's latency and `bad` lists anything but a quick 200."""

    def __init__(self, api: Api, every: float = 0.1, limit: float = 1.0) -> None:
        self.api, self.every, self.limit = api, every, limit
        self.latencies: list[float] = []
        self.bad: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.api.url, timeout=10, limits=_no_pool()) as client:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    r = client.get("/health")
                except httpx.TimeoutException:
                    TRACKER.hang("GET /health (health watch)")
                    self.bad.append("no answer within 10 s")
                    self.latencies.append(10.0)
                    continue
                except httpx.TransportError as e:
                    TRACKER.lose("GET /health (health watch)")
                    self.bad.append(f"connection failed: {e!r}")
                    continue
                dt = time.monotonic() - t0
                TRACKER.record(r.status_code, "GET /health (health watch)")
                self.latencies.append(dt)
                if r.status_code != 200 or dt > self.limit:
                    self.bad.append(f"{r.status_code} after {dt:.2f} s")
                self._stop.wait(self.every)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(15)

    @property
    def worst(self) -> float:
        return max(self.latencies, default=0.0)

    def check(self) -> None:
        assert self.latencies, "GET /health was never answered during the test"
        assert not self.bad, (
            f"GET /health was not a 200 within {self.limit} s meanwhile: {self.bad[:5]} "
            f"(worst {self.worst:.2f} s over {len(self.latencies)} polls)"
        )


def metrics(api: Api) -> dict[str, float]:
    r = api.get("/metrics", auth=False)
    assert r.status_code == 200, r.text[:300]
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            # every series has a model_name label: keyed without it
            name = re.sub(r',?model_name="[^"]*"', "", name).replace("{,", "{").replace("{}", "")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def wait_idle(api: Api, deadline_s: float = 30.0) -> dict[str, float]:
    """Until /metrics says no request runs or waits and no KV block is held."""
    names = (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    )
    deadline = time.monotonic() + deadline_s
    while True:
        m = metrics(api)
        now = {n: m.get(n) for n in names}
        if all(v == 0 for v in now.values()):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle {deadline_s} s later: {now}")
        time.sleep(0.1)
