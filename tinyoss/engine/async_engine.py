"""Drives an `LLMEngine` from asyncio: the engine steps in its own thread, callers await outputs.

Requests are validated in the caller's task (errors come back at once), then handed to the engine
thread, which owns all engine state. Each request's outputs arrive on its own asyncio queue.
Aborts (a client that went away) free the request's blocks before the next step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from typing import AsyncIterator

from tinyoss.engine.llm_engine import LLMEngine, Request, RequestOutput
from tinyoss.sampling_params import SamplingParams


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards make_request's read of engine.requests
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="tinyoss-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's output after every step that changes it; the last is finished.

        Leaving the iteration early (a cancelled task, a closed stream) aborts the request.
        """
        request_id = request_id or uuid.uuid4().hex
        if self._error is not None:
            raise RuntimeError(f"the engine stopped after an error: {self._error!r}")
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"request_id {request_id!r} is already in use")
            request = self.engine.make_request(request_id, prompt, params)
            self._queues[request_id] = (asyncio.get_running_loop(), asyncio.Queue())
        self._send("add", request)
        finished = False
        try:
            q = self._queues[request_id][1]
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise RuntimeError(f"the engine failed: {out!r}") from out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._send("abort", request_id)

    def _send(self, kind: str, payload: object) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        target = self._queues.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopped:
            while not self._inbox.empty():
                kind, payload = self._inbox.get()
                with self._lock:
                    if kind == "add":
                        assert isinstance(payload, Request)
                        if payload.request_id in self._queues:
                            engine.submit(payload)
                    else:
                        engine.abort(str(payload))
            if not engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except BaseException as e:  # noqa: BLE001 - every waiting client must hear of it
                self._error = e
                for request_id in list(engine.requests):
                    self._deliver(e, request_id)
                raise
            for out in outputs:
                self._deliver(out, out.request_id)
