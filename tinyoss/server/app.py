"""The OpenAI-compatible HTTP app: routes, API key, errors, streaming, background loading.

The engine core starts in its own process once the socket is listening, so /health can say
503 until it is ready (and while a core that died is restarted). This process parses,
renders, tokenizes, detokenizes and streams; the core only schedules and steps. A request's
engine generators are always closed explicitly (client gone, stream closed, answer complete),
which aborts what is unfinished and frees its KV blocks, and gives back the logprob memory it
reserved (`Run`: a whole answer's once it is sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Match, Route

from tinyoss import __version__
from tinyoss.config import EngineConfig
from tinyoss.engine.builder import checkpoint_folder, load_tokenizer
from tinyoss.engine.core_client import (
    CoreClient,
    EngineDeadError,
    ShuttingDown,
    EngineUnavailable,
    OutputStream,
    RequestFailed,
)
from tinyoss.engine.output_processor import LogprobWindow, RequestOutput, RequestStateStats
from tinyoss.server.limits import (
    STREAM_WINDOW_TOKENS,
    LogprobBudget,
    ServerLimits,
    logprob_bytes,
)
from tinyoss.server.metrics import Metrics
from tinyoss.server.request_log import RequestLog
from tinyoss.server.protocol import (
    APIError,
    Prepared,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
    prompt_list,
    tokenize,
)
from tinyoss.server.choices import ChatChoice, TextChoice, prompt_logprobs, release
from tinyoss.server.response_store import ResponseStore
from tinyoss.server.schemas import openapi_json
from tinyoss.server.responses_api import (
    Cancelled,
    Output,
    ResponseRun,
    refused_events,
    translate,
)

log = logging.getLogger("tinyoss.server")
_API_PATHS = ("/v1/", "/tokenize", "/detokenize")  # what tinyoss_http_responses counts
Choice = ChatChoice | TextChoice | Output


def system_fingerprint(config: EngineConfig) -> str:
    """Chat answers' `system_fingerprint`, as OpenAI's: it changes with what may change the
    answers to one `seed` (tinyoss's version, the checkpoint, the dtype and the layers'
    quantization), so a client can tell a changed backend from chance."""
    what = [__version__, config.model, config.revision, config.dtype, config.mxfp4_layers,
            config.fp8_layers, config.attention_sinks]  # fmt: skip
    return "fp_" + hashlib.sha256(json.dumps(what).encode()).hexdigest()[:10]


class ServerState:
    def __init__(
        self,
        config: EngineConfig,
        model_name: str,
        api_key: str | None,
        on_fatal: Callable[[str], None] | None,
        limits: ServerLimits,
        aliases: tuple[str, ...] = (),
        request_log: RequestLog | None = None,
    ) -> None:
        self.config, self.model_name, self.api_key = config, model_name, api_key
        self.fingerprint = system_fingerprint(config)  # once: the same on every answer
        self.request_log = request_log  # None: no line a request (--enable-log-requests)
        # every name clients may send, model_name first
        self.names = (model_name, *(a for a in dict.fromkeys(aliases) if a != model_name))
        self.limits = limits
        self.logprobs = LogprobBudget(_gib(limits.max_logprob_memory))
        self.on_fatal = on_fatal
        self.client: CoreClient | None = None
        self.load_error: BaseException | None = None
        self.metrics = Metrics(model_name, lambda: self.client and self.client.stats,
                               lambda: (self.logprobs.used, self.logprobs.total),
                               lambda: self.client.restarts if self.client else 0)
        self.created = int(time.time())
        self.shutting_down = False  # set by `tinyoss serve` on SIGTERM / SIGINT

    def capacity(self) -> int:
        """The most engine requests the server holds at once, running and queued."""
        return self.config.max_num_seqs + self.limits.max_queued_requests

    async def start(self) -> None:
        try:
            folder = await asyncio.to_thread(checkpoint_folder, self.config)
            tokenizer = await asyncio.to_thread(load_tokenizer, folder)
            await asyncio.to_thread(tokenizer.fill_byte_cache)
            self.client = CoreClient(self.config, folder, tokenizer, self.on_fatal,
                                     watchdog_s=self.limits.watchdog_timeout)
            info = await self.client.start()
            log.info("ready: serving %r (%s)", self.model_name, info.summary)
        except Exception as e:  # the server stays up and /health says why
            self.load_error = e
            if not isinstance(e, ValueError):  # a bug or a broken machine: the traceback helps
                log.exception("loading the model failed")
            elif self.on_fatal is None:  # a model not there, a cache too small: its message
                log.error("loading the model failed: %s", e)
            if self.on_fatal is not None:
                self.on_fatal(str(e))

    def unknown_model(self, name: str) -> APIError:
        also = "".join(f", or `{n}`" for n in self.names[1:])
        return APIError(404, f"The model `{_clip(name)}` does not exist (this server serves "
                        f"`{self.model_name}`{also}).", param="model", code="model_not_found")

    def ready(self) -> CoreClient:
        client = self.client
        if self.load_error is not None:
            raise APIError(503, f"the model failed to load: {self.load_error}", code="load_failed")
        if client is None or client.state == "loading":
            raise _unavailable("the model is still loading, retry shortly")
        if client.state != "ready":
            raise _unavailable(f"the engine is {client.state}: {client.error}")
        return client


_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # what a client's X-Request-Id may be


class RequestIdHeader:
    """Every answer carries `x-request-id`, as OpenAI's do (its SDKs show it as `_request_id`,
    and apps log it): the client's own X-Request-Id (up to 128 printable characters, as vLLM's
    --enable-request-id-headers echoes it), else a new `req_...`. The client's own also names
    chat and completions answers (chatcmpl-<id>, as vLLM's `_base_request_id` takes it); one
    this rule refuses is neither echoed nor used. An ASGI middleware: it adds a header to the
    response's start and leaves streamed bodies as they are."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        mine = _REQUEST_ID.fullmatch(given.decode("latin-1")) is not None
        rid = given if mine else f"req_{uuid.uuid4().hex}".encode()
        state = scope.setdefault("state", {})
        state["request_id"] = rid.decode("latin-1")  # for the log line
        state["client_request_id"] = state["request_id"] if mine else None  # names the answer

        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, tagged)


class EventStream(StreamingResponse):
    """SSE that closes its event generator however the stream ends: a client that left must
    abort its request now, not whenever the suspended generator is garbage-collected.
    `on_close` runs last (it aborts engine requests that the generator never reached)."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.on_close()


class _Logged:
    """A response that calls `done` once it has been sent, or could not be (the request's log
    line: a stream's status is known at its start, its finish reasons at its end)."""

    def __init__(self, response: Response, done: Callable[[], None]) -> None:
        self.response, self.done = response, done

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.done()


class Answer(JSONResponse):
    """A whole answer that calls `on_close` once it is sent, or could not be: its body holds
    what its logprobs were reserved for until then."""

    def __init__(self, content: Any, on_close: Callable[[], None]) -> None:
        super().__init__(content)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class Run:
    """One API request: its engine requests feeding its choices. It reserves the logprob memory
    it may hold (`_logprob_reservation`) until `close`."""

    def __init__(
        self,
        state: ServerState,
        prep: Prepared,
        kind: str,
        choices: list[Choice],
        top: dict | None = None,
        keep_logprobs: bool = True,
        client_id: str | None = None,
    ) -> None:
        """`top`: more fields of the answer, and of a stream's first chunk. `keep_logprobs`:
        the choices keep the logprobs they send (False: a stream's, which keep none).
        `client_id`: the client's id for it (X-Request-Id, vLLM's request_id), which names
        the answer; requests in flight may share one, so the engine keys it by `rid`."""
        self.state, self.prep, self.kind, self.choices = state, prep, kind, choices
        self.top = top or {}
        prefix = {"chat.completion": "chatcmpl-", "response": "resp_"}.get(kind, "cmpl-")
        self.rid = prefix + uuid.uuid4().hex  # unique: the engine's key; a response's id
        self.id = self.rid if client_id is None else prefix + client_id  # what the client sees
        self.head = {"id": self.id, "object": kind, "created": int(time.time())}
        self.head["model"] = state.model_name
        if kind != "response":  # chat and completions objects have it (OpenAI's)
            self.head["system_fingerprint"] = state.fingerprint
        # each prompt's tokens found in the prefix cache, known from its first engine output
        self.cached: list[int | None] = [None] * len(prep.prompts)
        self.times: list[RequestStateStats | None] = [None] * len(prep.prompts)  # the engine's
        self.start = time.monotonic()
        self.first_output: float | None = None  # when the first engine output came
        self.cut: str | None = None  # how unfinished choices ended: "error", else "abort"
        client = state.ready()
        self.max_model_len = client.info.max_model_len
        # more than it ever holds was refused before parsing (_refuse_many_prompts)
        if len(prep.prompts) > state.capacity() - client.num_requests:
            raise APIError(
                429,
                f"the server is at capacity ({client.num_requests} requests running or queued); "
                "retry shortly",
                code="too_many_requests",
                headers={"Retry-After": "1"},
            )
        self.streams: list[OutputStream] = []
        self.reserved = _logprob_reservation(prep, client.info.max_model_len, keep_logprobs)
        self.charged: dict[str, int] = {}  # by a stream: its unsent logprobs past the window
        budget = state.logprobs
        if not budget.take(self.reserved):
            raise APIError(
                429,
                f"logprobs of the requests in progress hold {_size(budget.used)} of the "
                f"{_size(budget.total)} this server allows (--max-logprob-memory), and this "
                f"request may hold {_size(self.reserved)}; retry shortly",
                code="too_many_requests",
                headers={"Retry-After": "1"},
            )
        try:  # to the engine now, before any response starts
            for i, p in enumerate(prep.prompts):
                self.streams.append(client.generate(p, prep.params, f"{self.rid}-{i}"))
                if not keep_logprobs and prep.params.logprobs is not None:
                    self.streams[-1].watch = self._watch
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        """Aborts what is unfinished (nothing once the run is done) and gives back the logprob
        memory it held."""
        for stream in self.streams:
            stream.close()
        self.state.logprobs.give_back(self.reserved + sum(self.charged.values()))
        self.reserved = 0
        self.charged.clear()

    def _watch(self, stream: OutputStream, out: RequestOutput) -> None:
        """A stream's unsent logprobs, as each engine output arrives (its reader may be far
        behind): past STREAM_WINDOW_TOKENS tokens a choice they take memory from the budget as
        they grow, and a stream that cannot get it is cut off, freeing them."""
        windows = [c.logprobs for c in out.outputs if isinstance(c.logprobs, LogprobWindow)]
        held = sum(w.held for w in windows)
        need = logprob_bytes(max(0, held - STREAM_WINDOW_TOKENS * len(windows)),
                             self.prep.params.logprobs)  # fmt: skip
        had, budget = self.charged.pop(stream.request_id, 0), self.state.logprobs
        if need <= had or budget.take(need - had):
            budget.give_back(max(0, had - need))
            self.charged[stream.request_id] = need
            return
        budget.give_back(had)
        for w in windows:
            release(w, len(w))
        stream.cut(APIError(
            503,
            f"the stream was cut off: its client had not read the logprobs of {held} tokens, "
            "and this server's logprob memory (--max-logprob-memory) has no room for more; read "
            "a stream as it comes",
            code="logprob_memory_full",
        ))  # fmt: skip

    async def updates(self) -> AsyncIterator[list[dict]]:
        """The changed chunk choices after each engine output."""
        metrics, n = self.state.metrics, self.prep.params.n
        start, last, ended = self.start, {}, {}  # ended: choice index -> when it finished
        cut = None  # how unfinished choices ended: "error" (the engine's), else "abort"
        why = "its client left"
        try:
            async with contextlib.aclosing(_merge(self.streams)) as outputs:
                async for i, out in outputs:
                    now = time.monotonic()
                    self.first_output = self.first_output or now
                    hist = metrics.itl if i in last else metrics.ttft
                    hist.observe(now - last.get(i, start))
                    last[i], self.cached[i], self.times[i] = now, out.num_cached_tokens, out.metrics
                    choices = [self.choices[i * n + c.index] for c in out.outputs]
                    if out.prompt_logprobs is not None:  # prompt_logprobs, or echo's
                        for c in choices:
                            c.prompt_logprobs = out.prompt_logprobs
                    taken = sum(c.num_tokens for c in choices)
                    changed = [ch for c, o in zip(choices, out.outputs) if (ch := c.update(o))]
                    # as the choices count them, so that this counter and the histogram agree
                    metrics.generated.inc(sum(c.num_tokens for c in choices) - taken)
                    for c in out.outputs:
                        if self.choices[i * n + c.index].finish_reason is not None:
                            ended.setdefault(i * n + c.index, now)
                    if changed:
                        yield changed
                    if self.done:
                        break
        except Cancelled:  # POST /v1/responses/{id}/cancel
            why = f"POST /v1/responses/{self.rid}/cancel"
            raise
        except asyncio.CancelledError:  # a stream's client left, or the shutdown's grace ended
            if self.state.shutting_down:
                why = "the server is shutting down"
            raise
        except ShuttingDown:
            cut, why = "error", "the server is shutting down"
            raise
        except Exception:  # a request the engine failed (not a client that left)
            cut, why = "error", "the engine failed it"
            raise
        finally:
            self.cut = cut
            now, most = time.monotonic(), self.prep.params.max_tokens
            for i, prompt in enumerate(self.prep.prompts):  # a request ends with its last choice
                mine = range(i * n, (i + 1) * n)
                room = self.max_model_len - len(prompt)
                metrics.request_ended([self.choices[j].finish_reason or cut for j in mine],
                                      [self.choices[j].num_tokens for j in mine],
                                      max(ended.get(j, now) for j in mine) - start, len(prompt),
                                      room if most is None else min(most, room), self.times[i])
            (metrics.finished if self.done else metrics.aborted).inc()
            if not self.done:  # one line, as vLLM's "Aborted request": to match a balancer's
                log.info("aborted request %s: %s", self.id, why)

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self, choice: int | None = None) -> dict:
        """The request's usage, or (a continuous-usage chunk, as vLLM counts it) one choice's:
        its prompt's tokens and its own."""
        n = self.prep.params.n
        prompts = range(len(self.prep.prompts)) if choice is None else [choice // n]
        choices = self.choices if choice is None else [self.choices[choice]]
        prompt = sum(len(self.prep.prompts[i]) for i in prompts)
        completion = sum(c.num_tokens for c in choices)
        cached = [self.cached[i] for i in prompts]
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # null until every prompt's is known (a stream's opening chunk), never a guess
            "prompt_tokens_details": None if None in cached else {"cached_tokens": sum(cached)},
        }
        if all(isinstance(c, ChatChoice) for c in choices):  # OpenAI's, which agents read
            reasoning = sum(c.parser.reasoning_tokens for c in choices)
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    def answer(self) -> dict:
        choices = [c.final() for c in self.choices]
        body = {**self.head, "choices": choices, "usage": self.usage(), **self.top}
        first = self.choices[0]
        if isinstance(first, ChatChoice) and first.prompt_logprobs is not None:  # vLLM's place
            body["prompt_logprobs"] = prompt_logprobs(first.tokenizer, first.prompt_logprobs)
        return body

    async def events(self) -> AsyncIterator[str]:
        head = {**self.head, "object": self.kind + ".chunk" if "chat" in self.kind else self.kind}
        top = self.top  # on the first chunk only

        def chunk(choices: list[dict]) -> str:
            """An event a choice, as vLLM sends them (clients read `choices[0]`); with
            continuous usage each with its choice's usage."""
            nonlocal top
            out = []
            for c in choices:
                body, top = {**head, "choices": [c], **top}, {}
                if self.prep.continuous_usage:
                    body["usage"] = self.usage(c["index"])
                elif self.prep.include_usage:  # null until the last chunk, as OpenAI's
                    body["usage"] = None
                out.append(_sse(body))
            return "".join(out)

        try:
            for c in self.choices:
                if (opening := c.opening()) is not None:
                    yield chunk([opening])
            async with contextlib.aclosing(self.updates()) as updates:
                async for changed in updates:
                    yield chunk(changed)
            if self.prep.include_usage:
                yield _sse({**head, "choices": [], "usage": self.usage()})
        except Exception as e:  # the status line is sent: report in the stream
            log.warning("stream %s failed: %s", self.id, e)
            yield _sse(_error(e, self.prep).body())
        yield "data: [DONE]\n\n"


async def _merge(gens: list[OutputStream]) -> AsyncIterator[tuple[int, Any]]:
    """Interleaves engine streams, tagged with their index; closing it closes them, which
    aborts what is unfinished. One stream (the usual case) is passed through as it is: no task
    and no queue between the engine and the response."""
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            gens[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                left -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            g.close()


# Characters JSON leaves raw that str.splitlines() (and so httpx's aiter_lines) takes for line
# breaks: escaped, so that no client splits an event inside a string.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
_LINE_BREAK = re.compile("[\x85\u2028\u2029]")


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _sse_of(events: AsyncIterator[dict] | list[dict]) -> AsyncIterator[str]:
    """Responses API events as server-sent events, each named by its type."""
    if isinstance(events, list):
        for e in events:
            yield _sse(e, e["type"])
        return
    async for e in events:
        yield _sse(e, e["type"])


def _sse(obj: dict, event: str | None = None) -> str:
    """One server-sent event; `event` names it (the Responses API's `event: <type>` line). The
    text is copied once: a response's last events carry all its logprobs."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    if _LINE_BREAK.search(text):
        text = text.translate(_LINE_BREAKS)
    return "".join((f"event: {event}\n" if event else "", "data: ", text, "\n\n"))


def _error_response(err: APIError) -> Response:
    """The error as JSON; text that cannot be UTF-8 (lone surrogates) goes out escaped."""
    try:
        body = json.dumps(err.body(), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        body = json.dumps(err.body()).encode()
    return Response(body, err.status, err.headers, media_type="application/json")


RETRY_AFTER_S = 5  # a 503's Retry-After: an engine core restarts in seconds


def _unavailable(message: str) -> APIError:
    """503 engine_unavailable (loading, restarting, or the core that ran a request stopped),
    with Retry-After: OpenAI's SDKs wait that long before their retry (their own backoff, ~1 s
    in all, ran out before a restarted core was back)."""
    return APIError(503, message, code="engine_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


_MAX_FAULT_CHARS = 200  # of a request's own fault, in its answer; all of it goes to the log


def _error(e: Exception, prep: Prepared | None = None) -> APIError:
    """The answer to what failed a request; `prep`, the request's, if it got that far."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), code="shutting_down")
    if isinstance(e, (EngineDeadError, EngineUnavailable)):
        return _unavailable(str(e))
    if isinstance(e, RequestFailed):
        message = str(e)
        if len(message) > _MAX_FAULT_CHARS or "\n" in message:  # e.g. a grammar parser's state
            log.warning("request failed (%s): %s", e.code, message)
            message = (message.splitlines()[0][:_MAX_FAULT_CHARS].rstrip()
                       + " ... (the server log has the rest)")
        status = {"out_of_memory": 503, "invalid_grammar": 400}.get(e.code, 500)
        param = prep.grammar_field if prep and e.code == "invalid_grammar" else None
        return APIError(status, message, param=param, code=e.code)
    log.error("request failed", exc_info=e)
    return APIError(500, f"internal error ({type(e).__name__}); the server log has the details")


async def _drain_unless_gone(request: Request, run: Run) -> bool:
    """Runs `run` to its end; False if the client left first (its requests are aborted)."""

    async def drain() -> None:
        async with contextlib.aclosing(run.updates()) as updates:
            async for _ in updates:
                pass

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(drain()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (watch, work):
            task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        return False
    work.result()  # re-raises an engine failure
    return True


# A JSON \uXXXX escape of a UTF-16 surrogate: only then can a decoded string hold a lone one.
_MAYBE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(body: dict) -> None:
    """400 naming the top-level field whose text holds a lone surrogate (pairs decode to one
    character): such text cannot be UTF-8, so nothing could tokenize or echo it."""
    for key, value in body.items():
        stack = [key, value]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                try:
                    item.encode()
                except UnicodeEncodeError as e:
                    raise APIError(
                        400,
                        f"{_clip(key)} holds a lone UTF-16 surrogate ({item[e.start]!a}), which "
                        "is not valid Unicode: send UTF-8 text",
                        param=_clip(key),
                    ) from None
            elif isinstance(item, dict):
                stack += item.keys()
                stack += item.values()
            elif isinstance(item, list):
                stack += item


def _clip(value: Any) -> str:
    """Client text put into a message: short, and printable whatever it holds."""
    text = value if isinstance(value, str) else repr(value)
    text = text.encode(errors="backslashreplace").decode()
    return text if len(text) <= 100 else text[:97] + "..."


def _unauthorized() -> APIError:
    return APIError(
        401,
        "missing or incorrect API key (send 'Authorization: Bearer KEY')",
        code="invalid_api_key",
    )


def _too_large(most: int) -> APIError:
    return APIError(
        413, f"the request body is larger than {most} bytes (--max-request-bytes)",
        code="request_too_large",
    )  # fmt: skip


# body fields that can carry a grammar (chat, completions, and Responses' own `text`)
_GRAMMAR_FIELDS = ("response_format", "structured_outputs", "tools", "text")
_THREAD_BYTES = 1 << 20  # bodies past this are read and checked off the event loop
CANCEL_SETTLE_S = 5.0  # a cancel's answer waits this long at most for the run to settle


async def _parse(parse: Callable[[Any, Any], Any], body: Any, info: Any,
                 nbytes: int = 0) -> Any:
    """parse(body, info), in a worker thread when the body can carry a grammar or is large:
    llguidance checks a large grammar for seconds (50,000 choices: ~2 s, with the GIL
    released), and 400,000 messages took 2.7 s to validate and render; other bodies parse
    inline (no thread hop)."""
    if nbytes > _THREAD_BYTES or (isinstance(body, dict)
                                  and any(k in body for k in _GRAMMAR_FIELDS)):
        return await asyncio.to_thread(parse, body, info)
    return parse(body, info)


def _footprint(raw: str) -> int:
    """About the bytes the parsed body holds in memory, from its JSON text: a stored response
    keeps its input items as parsed, and `{}` is 3 bytes of JSON but a 64-byte dict (5 million
    of them, 14 MB of JSON, held ~300 MB); counted high (brackets in strings count too), plus
    1 KiB for the top-level objects, which one long string alone would leave uncounted."""
    brackets, quotes, commas = raw.count("{") + raw.count("["), raw.count('"'), raw.count(",")
    return 1024 + len(raw) + 64 * brackets + 32 * quotes + 24 * commas


class _NonFinite:
    """What NaN, Infinity, 1e999 or an integer too long to read parses to, until the body is
    refused naming its field."""

    def __init__(self, text: str) -> None:
        self.text = text


# Python reads integers of up to this many digits (sys.get_int_max_str_digits' default); a longer
# one would fail with Python's own hint, naming no field
_MAX_INT_DIGITS = 4300


def _loads(raw: str) -> Any:
    """JSON as the standard defines it: NaN, Infinity and numbers beyond a double are a 400
    naming their field (a schema or tool carrying them could not be written back out), and so
    is an integer of more than _MAX_INT_DIGITS digits."""
    found: list[_NonFinite] = []

    def non_finite(text: str) -> _NonFinite:
        found.append(_NonFinite(text))
        return found[-1]

    def number(text: str) -> float | _NonFinite:
        value = float(text)
        return value if math.isfinite(value) else non_finite(text)

    def integer(text: str) -> int | _NonFinite:
        return int(text) if len(text.lstrip("-")) <= _MAX_INT_DIGITS else non_finite(text)

    # a leading byte-order mark is ignored, as RFC 8259 lets a parser (Python's json refused
    # it with its own hint)
    body = json.loads(raw.removeprefix("\ufeff"), parse_constant=non_finite,
                      parse_float=number, parse_int=integer)
    if found:
        path = _path_to(body, found[0])
        text = found[0].text
        shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
        raise APIError(400, f"{path or 'the request body'}={shown} is not a JSON number this "
                       "server reads (JSON has no NaN or Infinity, and numbers must fit a "
                       "64-bit float)", param=path or None)
    return body


def _path_to(body: Any, target: object) -> str:
    """The path (tools[0].parameters.default) of `target` in `body`, depth first."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, item = stack.pop()
        if item is target:
            return path
        if isinstance(item, dict):
            stack += [(f"{path}.{k}".lstrip("."), v) for k, v in item.items()]
        elif isinstance(item, list):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(item)]
    return ""


def _refuse_non_json(content_type: str | None) -> None:
    """A 415 for a body declared as anything but JSON (none declared is read as JSON, as
    FastAPI reads it): browsers send text/plain and form bodies to any origin without asking
    first, so a web page could otherwise start generations on a server without an API key."""
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and
                                       media.endswith("+json")):
        return
    raise APIError(
        415,
        f"Content-Type {_clip(content_type)} is not JSON: send the body as application/json "
        "(curl: -H 'Content-Type: application/json')",
        code="unsupported_media_type",
    )


def _refuse_many_prompts(body: dict, capacity: int) -> None:
    """A 400 for a completions body of more prompts than the server ever holds at once, counted
    before any prompt is read: checking and tokenizing a million of them held the event loop
    for seconds. No retry can help, so not a 429."""
    prompt = body.get("prompt")
    count = len(prompt_list(prompt)) if isinstance(prompt, list) else 1
    if count > capacity:
        raise APIError(
            400,
            f"prompt holds {count} prompts, more than the server ever holds at once "
            f"({capacity}: --max-num-seqs + --max-queued-requests); send fewer a request",
            param="prompt",
        )


def _check_limits(
    prep: Prepared, limits: ServerLimits, max_model_len: int, keep_logprobs: bool,
    stream_helps: bool = True,
) -> None:
    """400s for what no server of these limits would ever run. `keep_logprobs` as for `Run`;
    `stream_helps`: a stream would keep none (chat and completions)."""
    n = prep.params.n
    if n > limits.max_n:
        raise APIError(
            400, f"n={n} is more than this server allows ({limits.max_n}, --max-n)", param="n"
        )
    total = sum(
        n * (prep.params.max_tokens or max_model_len - len(ids)) for ids in prep.prompts
    )
    if total > limits.max_request_tokens:
        raise APIError(
            400,
            f"the request may generate {total} tokens (n x max_tokens for each prompt), more "
            f"than this server allows ({limits.max_request_tokens}, --max-request-tokens): "
            "lower n or max_tokens",
            param="max_tokens",
        )
    need = _logprob_reservation(prep, max_model_len, keep_logprobs)
    if need > _gib(limits.max_logprob_memory):
        raise _too_many_logprobs(prep, max_model_len, need, _gib(limits.max_logprob_memory),
                                 stream_helps)  # fmt: skip


def _logprob_reservation(
    prep: Prepared, max_model_len: int, keep: bool, max_tokens: int | None = None
) -> int:
    """The logprob memory a request may hold at once, reserved while it runs. Kept for a whole
    answer (or a response's last events and its store), every generated token's, up to
    max_tokens (else the context left) for each prompt and choice; a stream keeps none it has
    sent and reserves none (what it has not sent counts as it grows: `Run._watch`). Prompt
    logprobs stay to the end either way (`_prompt_logprob_reservation`). `max_tokens`: instead
    of the request's."""
    p = prep.params
    max_tokens = p.max_tokens if max_tokens is None else max_tokens
    total = _prompt_logprob_reservation(prep)
    for ids in prep.prompts:
        if keep and p.logprobs is not None:
            room = max_model_len - len(ids)
            total += p.n * logprob_bytes(room if max_tokens is None else min(max_tokens, room),
                                         p.logprobs)  # fmt: skip
    return total


def _prompt_copies(prep: Prepared) -> int:
    """How many copies of a prompt's logprobs an answer holds: the engine's one, then chat's
    top-level prompt_logprobs, or completions' on each choice and, with echo and logprobs, in
    each choice's logprobs too."""
    p = prep.params
    if prep.what != "prompt":
        return 2
    return 1 + p.n * (1 + (prep.echo is not None and p.logprobs is not None))


def _prompt_logprob_reservation(prep: Prepared) -> int:
    p = prep.params
    if p.prompt_logprobs is None:
        return 0
    return _prompt_copies(prep) * sum(logprob_bytes(len(ids), p.prompt_logprobs)
                                      for ids in prep.prompts)


def _too_many_logprobs(
    prep: Prepared, max_model_len: int, need: int, most: int, stream_helps: bool
) -> APIError:
    """The 400 of a request whose logprobs alone may hold more than --max-logprob-memory: it
    names the fields and the largest max_tokens that would fit."""
    p = prep.params
    prompt = _prompt_logprob_reservation(prep)
    if p.logprobs is None or prompt > most:  # the prompt's alone are too many
        tokens = sum(len(ids) for ids in prep.prompts)
        copies = _prompt_copies(prep) - 1
        field = "logprobs" if prep.echo_scores else "prompt_logprobs"
        how = ("prompt_logprobs" if field == "prompt_logprobs"
               else "echo with logprobs, which scores every prompt token,")
        fixes = [f"ask for fewer {field}", "send a shorter prompt"]
        if copies > 1:
            fixes.append("ask for fewer choices")
        return APIError(
            400, f"{how} may hold {_size(prompt)} for the prompt's {tokens} tokens x "
            f"{p.prompt_logprobs + 1} entries ({copies} in the answer, one in the engine), more "
            f"than this server allows for the logprobs of all requests together ({_size(most)}, "
            f"--max-logprob-memory); streaming does not help: " + ", or ".join(fixes),
            param=field)
    k = p.logprobs
    field = "logprobs" if prep.what == "prompt" else "top_logprobs"  # completions' or chat's
    lo, hi = 0, max_model_len  # the largest max_tokens that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _logprob_reservation(prep, max_model_len, True, mid) <= most:
            lo = mid
        else:
            hi = mid - 1
    longest = max(max_model_len - len(ids) for ids in prep.prompts)
    asked = f"max_tokens={p.max_tokens}" if p.max_tokens is not None else (
        f"no max_tokens (up to the {longest} tokens the context leaves)")
    choices = p.n * len(prep.prompts)
    tokens = longest if p.max_tokens is None else min(p.max_tokens, longest)
    what = (f"{choices} choices x " if choices > 1 else "") + f"{tokens} tokens x {k + 1} entries"
    fixes = [f"give max_tokens of at most {lo} at {field}={k}"] if lo else []
    fixes.append(f"ask for fewer {field}" + ("" if choices == 1 else " or fewer choices"))
    if stream_helps:
        fixes.append("stream the answer (a stream keeps no logprobs it has sent)")
    return APIError(
        400,
        f"{field}={k} with {asked} may hold {_size(need)} of logprobs until the answer is sent "
        f"({what}), more than this server allows for the logprobs of all requests together "
        f"({_size(most)}, --max-logprob-memory): " + ", or ".join(fixes),
        param="max_tokens" if lo else field,
    )


def _gib(value: float) -> int:
    return int(value * 2**30)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Cors:
    """CORS, as vLLM's --allowed-origins, --allowed-methods, --allowed-headers and
    --allow-credentials set it (starlette's CORSMiddleware answers preflights, before the API
    key is checked)."""

    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def kwargs(self) -> dict[str, Any]:
        return {
            "allow_origins": list(self.allowed_origins),
            "allow_methods": list(self.allowed_methods),
            "allow_headers": list(self.allowed_headers),
            "allow_credentials": self.allow_credentials,
        }


def create_app(
    config: EngineConfig,
    *,
    model_name: str,
    aliases: tuple[str, ...] = (),
    api_key: str | None = None,
    on_fatal: Callable[[str], None] | None = None,
    limits: ServerLimits | None = None,
    cors: Cors | None = None,
    max_stored_responses: int = 1000,
    request_log: RequestLog | None = None,
    reasoning_content: bool = False,
) -> Starlette:
    """The server app; its engine core starts in a process of its own once the app starts.
    `on_fatal` is called when no core can run (a failed load, a failed restart). `cors`: None,
    no CORS headers at all. `max_stored_responses`: how many /v1/responses answers are kept
    (LRU) for GET and previous_response_id; 0 keeps none. `aliases`: more names clients may send
    for the model (vLLM's several --served-model-name); answers name `model_name`.
    `request_log`: a line for each generation request once it has ended (None: none).
    `reasoning_content`: chat answers carry the reasoning under that name too."""
    limits = limits or ServerLimits()
    state = ServerState(config, model_name, api_key, on_fatal, limits, aliases, request_log)
    store = ResponseStore(max_stored_responses)

    def authorized(request: Request) -> bool:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(errors="replace"), state.api_key.encode()
        )

    def endpoint(handler: Callable, *, auth: bool = True, logged: bool = False) -> Callable:
        """`logged`: a generation endpoint, whose requests --enable-log-requests logs."""

        async def wrapped(request: Request) -> Response | _Logged:
            arrived = time.monotonic()
            try:
                if auth and state.api_key and not authorized(request):
                    raise _unauthorized()
                response = await handler(request)
            except ClientDisconnect:  # gone while sending its body: nothing ran
                state.metrics.aborted.inc()
                response = Response(status_code=499)
            except Exception as e:  # a bad request must never take the server down
                run = getattr(request.state, "run", None)  # set once the request is running
                response = _error_response(_error(e, run.prep if run else None))
            if request.url.path.startswith(_API_PATHS):  # not probes and scrapes
                state.metrics.responded(response.status_code)
            if logged and state.request_log is not None:
                return _Logged(response, lambda: log_request(request, response, arrived))
            return response

        return wrapped

    def log_request(request: Request, response: Response, arrived: float) -> None:
        """The request's line, once its answer has been sent (a stream: to its end)."""
        run: Run | None = getattr(request.state, "run", None)
        peer = request.client
        kwargs: dict[str, Any] = {}
        if run is not None:
            head = state.request_log.prompt_head(state.client.tokenizer, run.prep.prompts[0])
            kwargs = {"usage": run.usage(), "prompt": head,
                      "finish_reasons": [c.finish_reason or run.cut or "abort"
                                         for c in run.choices],
                      "ttft": run.first_output and run.first_output - arrived}
        state.request_log.ended(
            request.state.request_id, f"{request.method} {request.url.path}",
            response.status_code, f"{peer.host}:{peer.port}" if peer else "-",
            time.monotonic() - arrived, **kwargs)

    async def read_body(request: Request) -> bytes:
        """The body, within --max-request-bytes and --body-timeout, not compressed."""
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            raise APIError(415, f"Content-Encoding {encoding!r} is not supported: send the "
                           "request body uncompressed", code="unsupported_media_type")
        most = limits.max_request_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > most:
            raise _too_large(most)
        chunks, size = [], 0

        async def receive() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > most:
                    raise _too_large(most)
                chunks.append(chunk)

        try:
            await asyncio.wait_for(receive(), limits.body_timeout)
        except TimeoutError as e:
            raise APIError(
                408, f"the request body did not arrive within {limits.body_timeout:g} s",
                code="request_timeout",
            ) from e  # fmt: skip
        return b"".join(chunks)

    async def body_of(request: Request) -> dict:
        _refuse_non_json(request.headers.get("content-type"))
        data = await read_body(request)
        request.state.body_bytes = len(data)
        try:
            raw = data.decode()
        except UnicodeDecodeError as e:
            raise APIError(400, f"the request body is not valid UTF-8: {e}") from e
        request.state.footprint = _footprint(raw)  # what a stored response is counted as
        try:
            if len(data) > _THREAD_BYTES:  # ~0.1 s a 13 MB body: off the event loop
                body = await asyncio.to_thread(_loads, raw)
            else:
                body = _loads(raw)
        except RecursionError as e:
            raise APIError(400, "the JSON body is nested too deeply") from e
        except ValueError as e:
            raise APIError(400, f"malformed JSON body: {e}") from e
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        if _MAYBE_SURROGATE.search(raw):
            _refuse_lone_surrogates(body)
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise APIError(400, f"model must be a string, not {_clip(name)}", param="model")
        if name and name not in state.names:  # "" is the served model, as in vLLM
            raise state.unknown_model(name)
        return body

    async def prepare(request: Request, parse: Callable) -> tuple[CoreClient, Prepared]:
        """Chat's or completions' request, checked (a stream keeps no logprobs it has sent)."""
        client = state.ready()
        body = await body_of(request)
        if parse is parse_completion:  # chat's one prompt is its messages
            _refuse_many_prompts(body, state.capacity())
        prep = await _parse(parse, body, client.info, request.state.body_bytes)
        await tokenize(prep, client.tokenizer, client.info)
        _check_limits(prep, limits, client.info.max_model_len, keep_logprobs=not prep.stream)
        return client, prep

    def client_id(request: Request, prep: Prepared) -> str | None:
        """The id the client gave its request, the X-Request-Id header's before the body's
        request_id (as vLLM's `_base_request_id` orders them); None: the server names it."""
        return getattr(request.state, "client_request_id", None) or prep.request_id

    async def respond(request: Request, run: Run) -> Response:
        request.state.run = run  # for the request's log line
        if run.prep.stream:
            headers = _SSE_HEADERS
            return EventStream(run.events(), run.close, headers=headers)
        try:
            if not await _drain_unless_gone(request, run):
                run.close()
                return Response(status_code=499)
            return Answer(run.answer(), run.close)
        except BaseException:
            run.close()
            raise

    async def chat(request: Request) -> Response:
        client, prep = await prepare(request, parse_chat)
        tok, lp, keep = client.tokenizer, prep.params.logprobs, not prep.stream
        ids = prep.return_token_ids
        # tool call ids are random even under a seed: ids a client keys history by are unique
        choices: list[Choice] = [
            ChatChoice(i, tok, prep.content_stop, lp is not None, ids, keep, prep.reasoning,
                       prep.content_stop_kept, prep.channel, prep.tokens_as_ids,
                       reasoning_content)
            for i in range(prep.params.n)
        ]
        top = {"prompt_token_ids": prep.prompts[0]} if ids else None
        run = Run(state, prep, "chat.completion", choices, top, keep_logprobs=keep,
                  client_id=client_id(request, prep))
        return await respond(request, run)

    async def completions(request: Request) -> Response:
        client, prep = await prepare(request, parse_completion)
        tok, n, lp, keep = client.tokenizer, prep.params.n, prep.params.logprobs, not prep.stream
        choices: list[Choice] = [
            TextChoice(p * n + i, tok, prep.echo[p] if prep.echo else None, lp is not None,
                       prep.prompts[p] if prep.return_token_ids else None,
                       prep.params.skip_special_tokens, keep,
                       prep.prompts[p] if prep.echo and lp is not None else None, lp,
                       prep.prompt_only, prep.tokens_as_ids)
            for p in range(len(prep.prompts))
            for i in range(n)
        ]
        run = Run(state, prep, "text_completion", choices, keep_logprobs=keep,
                  client_id=client_id(request, prep))
        return await respond(request, run)

    async def responses(request: Request) -> Response:
        client = state.ready()
        body = await body_of(request)
        inherited = 0  # the bytes of the items it continues, which it keeps alive

        def conversation(previous: str) -> list[dict]:
            nonlocal inherited
            items, inherited = store.conversation(previous), store.held(previous)
            return items

        if request.state.body_bytes > _THREAD_BYTES:  # 200,000 items: ~1.4 s to check
            # the store is read here, on the event loop; the checks run in a worker thread
            previous = body.get("previous_response_id")
            items = conversation(previous) if isinstance(previous, str) else []
            req = await asyncio.to_thread(translate, body, lambda _: items)
        else:
            req = translate(body, conversation)
        if not store.size:  # nothing is kept: the response says so, as OpenAI echoes the value
            req.store = req.echo["store"] = False
        try:  # every check of chat, its errors naming the Responses fields
            prep = await _parse(parse_chat, req.chat, client.info, request.state.body_bytes)
            prep.what = "input"
            await tokenize(prep, client.tokenizer, client.info)
            # a response keeps its logprobs, streamed too: its last events carry them all
            _check_limits(prep, limits, client.info.max_model_len, keep_logprobs=True,
                          stream_helps=False)  # fmt: skip
        except APIError as e:
            err = req.renamed(e)
            if req.stream and err.code == "context_length_exceeded":
                return EventStream(_sse_of(refused_events(req, state.model_name, err)),
                                   lambda: None, headers=_SSE_HEADERS)
            raise err from None
        output = Output(client.tokenizer, prep.params.logprobs is not None)
        run = request.state.run = Run(state, prep, "response", [output])
        try:
            resp = ResponseRun(req, state.model_name, run, output, _error)
            if req.store:
                store.put(resp, request.state.footprint + inherited)
            if req.stream:
                return EventStream(_sse_of(resp.events()), run.close, headers=_SSE_HEADERS)
            answer = await resp.drain(lambda: _drain_unless_gone(request, run))
            if answer is None:
                run.close()
                return Response(status_code=499)
            return Answer(answer, run.close)
        except BaseException:
            run.close()
            raise

    async def response_get(request: Request) -> Response:
        resp = store.get(request.path_params["id"])
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            # OpenAI's streams a background response's events again; there are none here
            raise APIError(400, "stream=true replays a background response's events, and "
                           "background responses are not supported: GET without stream "
                           "gives the response as it stands", param="stream")
        return JSONResponse(resp.snapshot())

    async def response_input_items(request: Request) -> Response:
        resp, query = store.get(request.path_params["id"]), request.query_params
        include = query.getlist("include") + query.getlist("include[]")  # the client's spelling
        page = resp.input_items(query.get("after"), query.get("limit"), query.get("order"),
                                include)  # fmt: skip
        return JSONResponse(page)

    async def response_delete(request: Request) -> Response:
        store.delete(rid := request.path_params["id"])
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def response_cancel(request: Request) -> Response:
        """The cancelled response as GET gives it afterwards: once its run has settled (its
        usage, its items closed), unless its stream's reader holds that up."""
        resp = store.get(request.path_params["id"])
        resp.cancel()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(resp.ended.wait(), CANCEL_SETTLE_S)
        return JSONResponse(resp.snapshot())

    async def tokenize_(request: Request) -> Response:
        client = state.ready()
        body = await body_of(request)
        prep, token_strs = await _parse(parse_tokenize, body, client.info,
                                        request.state.body_bytes)
        await tokenize(prep, client.tokenizer, client.info)
        ids = prep.prompts[0]
        strs = [client.tokenizer.id_to_token(i) for i in ids] if token_strs else None
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": client.info.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(request: Request) -> Response:
        client = state.ready()
        ids = parse_detokenize(await body_of(request), client.info)
        decode = client.tokenizer.decode
        text = await asyncio.to_thread(decode, ids) if len(ids) > 1 << 16 else decode(ids)
        return JSONResponse({"prompt": text})

    def model_card(name: str) -> dict:
        card = {"id": name, "object": "model", "created": state.created}
        card["owned_by"] = "tinyoss"
        if state.client is not None and state.client.info is not None:
            card["max_model_len"] = state.client.info.max_model_len
        return card

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(n) for n in state.names]})

    async def model(request: Request) -> Response:
        """GET /v1/models/{id} (the openai client's models.retrieve)."""
        name = request.path_params["id"]
        if name not in state.names:
            raise state.unknown_model(name)
        return JSONResponse(model_card(name))

    async def health(request: Request) -> Response:
        client, error = state.client, state.load_error
        if client is not None and client.state == "ready":
            if not client.core_alive:  # died a moment ago: the watcher has yet to see it
                return JSONResponse({"status": "restarting",
                                     "message": "the engine core stopped"}, 503)
            return JSONResponse({"status": "ok"})
        if error is None and (client is None or client.state == "loading"):
            return JSONResponse({"status": "loading"}, 503)
        if client is not None and client.state == "restarting":
            return JSONResponse({"status": "restarting", "message": client.error}, 503)
        why = str(error) if error is not None else client.error if client else None
        return JSONResponse({"status": "error", "message": why or "the engine failed"}, 503)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def metrics(request: Request) -> Response:
        body, content_type = state.metrics.render(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    async def openapi(request: Request) -> Response:
        return Response(openapi_json(bool(state.api_key)), media_type="application/json")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        path = request.url.path
        keyed = path.startswith("/v1") or path in ("/tokenize", "/detokenize")
        if state.api_key and keyed and not authorized(request):
            return _error_response(_unauthorized())  # no probing of /v1 without the key
        headers = None
        if exc.status_code == 405:  # RFC 9110: say which methods the path takes, on all routes
            methods = {m for r in request.app.router.routes
                       if r.matches(request.scope)[0] is not Match.NONE
                       for m in getattr(r, "methods", None) or ()}
            headers = {"Allow": ", ".join(sorted(methods))}
        message = f"{request.url.path}: {exc.detail}"
        return _error_response(APIError(exc.status_code, message, headers=headers))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loading = asyncio.create_task(state.start())
        yield
        loading.cancel()
        if state.client is not None:
            await state.client.shutdown()

    routes = [
        Route("/v1/chat/completions", endpoint(chat, logged=True), methods=["POST"]),
        Route("/v1/completions", endpoint(completions, logged=True), methods=["POST"]),
        Route("/v1/responses", endpoint(responses, logged=True), methods=["POST"]),
        Route("/v1/responses/{id}", endpoint(response_get), methods=["GET"]),
        Route("/v1/responses/{id}", endpoint(response_delete), methods=["DELETE"]),
        Route("/v1/responses/{id}/cancel", endpoint(response_cancel), methods=["POST"]),
        Route("/v1/responses/{id}/input_items", endpoint(response_input_items), methods=["GET"]),
        Route("/v1/models", endpoint(models), methods=["GET"]),
        Route("/v1/models/{id:path}", endpoint(model), methods=["GET"]),
        Route("/tokenize", endpoint(tokenize_), methods=["POST"]),
        Route("/detokenize", endpoint(detokenize), methods=["POST"]),
        Route("/health", endpoint(health, auth=False), methods=["GET"]),
        Route("/ping", endpoint(health, auth=False), methods=["GET", "POST"]),  # vLLM's alias
        Route("/version", endpoint(version, auth=False), methods=["GET"]),
        Route("/metrics", endpoint(metrics, auth=False), methods=["GET"]),
        Route("/openapi.json", endpoint(openapi, auth=False), methods=["GET"]),
    ]
    middleware = [Middleware(RequestIdHeader)]
    middleware += [] if cors is None else [Middleware(CORSMiddleware, **cors.kwargs())]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
        middleware=middleware,
    )
    app.state.server = state
    return app
