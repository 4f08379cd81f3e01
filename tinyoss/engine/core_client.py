"""The server's handle on the engine core, which runs in its own process (`core_process.py`).

It is the engine client interface the server and its metrics use: `generate` (add, then stream
outputs; leaving early aborts), `abort`, `stats`, `state`. Tokens come back as per-step deltas
and are turned into text here, in the front end (`OutputProcessor`), on the event loop.

Lifecycle: `start` spawns the core and waits until it has built the engine (its start-up error
is raised here). If the core dies later, every request in flight or queued fails at once with
`EngineDeadError`, `state` says "restarting", and a new core is started; a core that cannot
start again leaves `state` "failed" and calls `on_fatal` (the CLI then exits non-zero). A core
that is alive but silent for `watchdog_s` while requests wait on it (a hung step or GPU; the core
says it is alive at least once a second while it steps) is killed, and restarted as above.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing
import os
import pickle
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import zmq
import zmq.asyncio

from tinyoss.config import EngineConfig
from tinyoss.engine.core import (CoreRequest, CoreStats, EngineInfo, RequestError, check_prompt,
                                 truncate_prompt)
from tinyoss.engine.core_process import run_core, unbounded
from tinyoss.engine.output_processor import OutputProcessor, RequestOutput
from tinyoss.sampling_params import SamplingParams, bad_words_ids
from tinyoss.tokenizer import Tokenizer

log = logging.getLogger("tinyoss.server")

_SHUTDOWN_WAIT_S = 10.0
_CORE_GONE = "the engine core stopped; it restarts, retry shortly"


class EngineDeadError(RuntimeError):
    """The engine core stopped while a request was running or queued."""


class ShuttingDown(EngineDeadError):
    """The server is shutting down and its grace for requests in flight has ended."""


class EngineUnavailable(RuntimeError):
    """The engine core is not ready for requests (still starting, restarting, or failed)."""


class RequestFailed(RuntimeError):
    """The engine failed this request alone (out of memory on its prompt, non-finite logits);
    it goes on serving the others."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.code = error.code


class _Core:
    """One core process and its two sockets."""

    def __init__(self, ctx: zmq.asyncio.Context, config: EngineConfig, folder: Path | None):
        base = Path(tempfile.gettempdir()) / f"tinyoss-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        inbox, outbox = f"ipc://{base}-in", f"ipc://{base}-out"
        self.push, self.pull = unbounded(ctx.socket(zmq.PUSH)), unbounded(ctx.socket(zmq.PULL))
        self.push.bind(inbox)
        self.pull.bind(outbox)
        self.paths = [Path(f"{base}-in"), Path(f"{base}-out")]
        spawn = multiprocessing.get_context("spawn")
        args = (config, None if folder is None else str(folder), inbox, outbox, os.getpid())
        self.process = spawn.Process(target=run_core, args=args, name="tinyoss-core", daemon=True)
        self.process.start()

    def send(self, *msg: object) -> None:
        sent = self.push.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), zmq.NOBLOCK)
        if sent.done() and sent.exception() is not None:  # never lose a message in silence
            raise sent.exception()

    async def stop(self, timeout: float) -> None:
        """Asks the process to stop, kills it after `timeout` s, and closes the sockets."""
        if self.process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self.send("shutdown")
        await asyncio.to_thread(self._reap, timeout)
        self.push.close(linger=0)
        self.pull.close(linger=0)
        for p in self.paths:
            p.unlink(missing_ok=True)

    def _reap(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


class OutputStream:
    """One request's outputs, as an async iterator; `aclose` (or `close`) before its end aborts
    it, whether or not iteration ever started. `watch(stream, output)`, when set, sees each
    output as it arrives, before its reader takes it (which may be far behind)."""

    def __init__(self, client: CoreClient, request_id: str) -> None:
        self.client, self.request_id = client, request_id
        self.q: asyncio.Queue = asyncio.Queue()
        self.done = False
        self.watch: Callable[[OutputStream, RequestOutput], None] | None = None

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        try:
            out = await self.q.get()
        except BaseException:  # cancelled: the request goes with the task
            self.close()
            raise
        if isinstance(out, Exception):
            self.close()
            raise out
        if out.finished:
            self.done = True
            self.client._streams.pop(self.request_id, None)
        return out

    def put(self, item: RequestOutput | Exception) -> None:
        self.q.put_nowait(item)
        if self.watch is not None and isinstance(item, RequestOutput):
            self.watch(self, item)

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.client._streams.pop(self.request_id, None)
            self.client.abort(self.request_id)

    def fail(self, error: Exception) -> None:
        """Ends the stream from outside its reader (a cancel request): the reader's next read
        raises `error`, which aborts the request."""
        if not self.done:
            self.q.put_nowait(error)

    def cut(self, error: Exception) -> None:
        """Ends the request now, for a reader that may be far behind: the outputs queued for it
        are dropped, the engine request is aborted, and the reader's next read raises
        `error`."""
        if self.done:
            return
        while not self.q.empty():
            self.q.get_nowait()
        self.q.put_nowait(error)
        self.client.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()


class CoreClient:
    def __init__(
        self,
        config: EngineConfig,
        folder: Path | None,
        tokenizer: Tokenizer,
        on_fatal: Callable[[str], None] | None = None,
        watchdog_s: float = 300.0,
    ) -> None:
        self.config, self.folder, self.tokenizer = config, folder, tokenizer
        self.on_fatal, self.watchdog_s = on_fatal, watchdog_s
        self._heard = time.monotonic()  # when the core last spoke, or was first given work
        self._hung: str | None = None  # why the watchdog killed the core
        self.info: EngineInfo | None = None
        self.stats = CoreStats()
        self.state = "loading"  # loading | ready | restarting | failed | stopped
        self.error: str | None = None  # why the state is failed (or the last core died)
        self.restarts = 0
        # windowed: the server's choices release the logprobs they have taken
        self.processor = OutputProcessor(tokenizer, windowed=True)
        self._ctx = zmq.asyncio.Context()
        self._core: _Core | None = None
        self._streams: dict[str, OutputStream] = {}
        self._reader: asyncio.Task | None = None
        self._gone = False  # the watcher found the core's process gone (and cancelled the reader)
        atexit.register(self.kill_core)  # before multiprocessing's exit handler (LIFO)
        self.closing = False  # the server is shutting down: a core that stops stays stopped

    @property
    def num_requests(self) -> int:
        """Requests handed to the core and not finished (running or queued)."""
        return len(self._streams)

    @property
    def core_alive(self) -> bool:
        """Whether the core's process runs: false from the moment it dies, before the watcher
        notices (up to ~0.4 s) and the state turns to restarting."""
        return self._core is not None and self._core.process.is_alive()

    @property
    def pid(self) -> int | None:
        return None if self._core is None else self._core.process.pid

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        """Starts the core and waits until it is ready; raises its start-up error."""
        core = self._core = _Core(self._ctx, self.config, self.folder)
        receiving = asyncio.ensure_future(core.pull.recv())
        while True:
            done, _ = await asyncio.wait({receiving}, timeout=0.2)
            if not done and core.process.is_alive():
                continue
            msg = pickle.loads(receiving.result()) if done else None
            if msg is None or msg[0] == "failed":
                why = "the engine core exited while starting" if msg is None else msg[1]
                self.state, self.error = "failed", why
                receiving.cancel()
                await core.stop(0)
                raise RuntimeError(why)
            if msg[0] == "ready":
                self.info, self.state = msg[1], "ready"
                break
            receiving = asyncio.ensure_future(core.pull.recv())
        self._reader = asyncio.create_task(self._read(core))
        return self.info

    def begin_shutdown(self) -> None:
        """The server's first signal: requests in flight may still finish, but a core that
        stops from now on (a second Ctrl-C reaches it too) is not restarted."""
        self.closing = True

    def end_requests(self, why: str) -> None:
        """Ends every request in flight with ShuttingDown(why), so that each answers it (a
        stream with an error event and its end) before the server closes its connection."""
        for request_id in list(self._streams):
            self._put(request_id, ShuttingDown(why))

    def kill_core(self) -> None:
        """Kills the core's process now if it still runs. Registered to run at exit: the core
        ignores SIGINT and SIGTERM, so multiprocessing's own terminate at exit would not end it
        (and its join would wait for ever) where `shutdown` did not run (a forced exit)."""
        if self.core_alive:
            self._core.process.kill()
            self._core.process.join(5)

    async def shutdown(self) -> None:
        self.closing, self.state = True, "stopped"
        if self._reader is not None:
            self._reader.cancel()
        if self._core is not None:
            await self._core.stop(_SHUTDOWN_WAIT_S)
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._ctx.term()

    async def _read(self, core: _Core) -> None:
        """Takes the core's messages as they come (one await each: this is the per-token path);
        a watcher notices a core that died without a word."""
        watcher = asyncio.create_task(self._watch(core))
        try:
            while True:
                msg = pickle.loads(await core.pull.recv())
                self._heard = time.monotonic()
                if msg[0] == "step":
                    self.stats = msg[2]
                    self._deliver(msg[1], msg[3])
                elif msg[0] == "reject":
                    self._put(msg[1], ValueError(msg[2]))
                elif msg[0] == "dead":
                    break
        except asyncio.CancelledError:
            if not self._gone:  # cancelled from outside (uvicorn's forced exit): no restart
                watcher.cancel()
                raise
            msg = None  # the watcher found the process gone
        self._gone = False
        watcher.cancel()
        why = self._hung or (f"exit code {core.process.exitcode}" if msg is None else msg[1])
        self._hung = None
        if self.state == "ready" and not self.closing:
            await self._restart(f"the engine core stopped ({why})")
        elif self.state == "ready":  # stopped while the server shuts down: fail, don't restart
            self.state, self.error = "stopped", f"the engine core stopped ({why})"
            self._fail_all(EngineDeadError("the server is shutting down"))

    async def _watch(self, core: _Core) -> None:
        while core.process.is_alive():
            await asyncio.sleep(0.2)
            silent = time.monotonic() - self._heard
            if self._streams and silent > self.watchdog_s and self._hung is None:
                self._hung = (f"hung: no step in {silent:.1f} s with {len(self._streams)} "
                              f"request(s) waiting (--watchdog-timeout {self.watchdog_s:g}); "
                              f"killed")
                log.error("the engine core is %s", self._hung)
                core.process.kill()
        await asyncio.sleep(0.2)  # its last words (a "dead" message) may still be on the way
        if self._reader is not None:
            self._gone = True
            self._reader.cancel()

    async def _restart(self, why: str) -> None:
        log.error("%s: failing %d request(s) and starting a new core", why, len(self._streams))
        self.state, self.error = "restarting", why
        self._fail_all(EngineDeadError(f"{why}; it is restarting, retry shortly"))
        old, self._core = self._core, None
        await old.stop(1.0)
        self.restarts += 1
        try:
            await self.start()
            log.info("the engine core is ready again (restart %d); its counters start at 0",
                     self.restarts)
        except Exception as e:  # noqa: BLE001 - reported through state and on_fatal
            log.error("the engine core could not be restarted: %s", e)
            if self.on_fatal is not None:
                self.on_fatal(str(e))

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._streams):
            self._put(request_id, error)
        self.processor = OutputProcessor(self.tokenizer, windowed=True)
        self.stats = CoreStats()

    def _deliver(self, deltas: list, step_time: float) -> None:
        outputs, stopped = self.processor.process(deltas, step_time)
        for request_id, index in stopped:
            self._send("abort", request_id, index)
        for out in outputs:
            self._put(out.request_id, out if out.error is None else RequestFailed(out.error))

    def _put(self, request_id: str, item: RequestOutput | Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)

    def _send(self, *msg: object) -> None:
        if self._core is not None:
            self._core.send(*msg)

    # -- requests ---------------------------------------------------------------------------
    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError if the engine would refuse this prompt."""
        if self.info is not None:
            check_prompt(prompt_token_ids, params, self.info)

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
    ) -> OutputStream:
        """Hands the request to the core now; the stream yields its output after every step
        that changes it, the last one finished. Closing the stream early aborts the request."""
        if self.state != "ready" or self.info is None:
            raise EngineUnavailable(self.error or f"the engine is {self.state}")
        if not self.core_alive:
            raise EngineUnavailable(_CORE_GONE)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = bad_words_ids(params, self.tokenizer.encode)
        prompt_token_ids = truncate_prompt(prompt_token_ids, params, self.info.max_model_len)
        check_prompt(prompt_token_ids, params, self.info)
        if not self._streams:  # an idle core owes no step: the watchdog counts from now
            self._heard = time.monotonic()
        stream = self._streams[request_id] = OutputStream(self, request_id)
        self.processor.add(request_id, prompt, prompt_token_ids, params)
        try:
            self._send("add", CoreRequest(request_id, prompt_token_ids, params))
        except zmq.ZMQError as e:  # the core went away just now (zmq: no peer to take it)
            self._streams.pop(request_id, None)
            self.processor.abort(request_id)
            raise EngineUnavailable(_CORE_GONE) from e
        return stream

    def abort(self, request_id: str) -> None:
        if self.processor.abort(request_id) is not None:
            with contextlib.suppress(zmq.ZMQError):  # a core that is gone runs nothing
                self._send("abort", request_id, None)
