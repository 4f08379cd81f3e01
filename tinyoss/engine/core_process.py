"""The engine core's own process: a loop that only takes requests, steps, and sends deltas.

`tinyoss serve` runs the core here so that the HTTP process (parsing, rendering, tokenizing,
detokenizing, streaming) never competes with the step loop for the GIL. Messages are small
pickled tuples over ZeroMQ sockets (`core_client.py` holds the other ends):

- in:  ("add", CoreRequest) | ("abort", request_id, index or None) | ("shutdown",)
- out: ("ready", EngineInfo) | ("failed", message) | ("reject", request_id, message) |
       ("step", [SeqDelta], CoreStats, time) (after a step with outputs, or once a second while
       stepping; `time`: when its results were in, on the core's time.monotonic clock, which
       the deltas' queue and schedule times are on too) | ("dead", message)

ZeroMQ gives message framing, queueing while the other side is busy, and non-blocking sends
for free; pickle carries the plain dataclasses without a schema layer, and a step's message is
a few hundred bytes. A step that raises ends the process with ("dead", why): the front end
fails what was in flight and starts a new core. The core exits by itself when its parent dies.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import pickle
import signal
import time
import traceback
from pathlib import Path

import zmq

from tinyoss.config import EngineConfig
from tinyoss.engine.core import EngineCore
from tinyoss.progress import thread_lock_only

log = logging.getLogger("tinyoss.core")

HOOK_ENV = "TINYOSS_CORE_HOOK"  # tests only: "module:function", called with the built core
_IDLE_POLL_MS = 500  # how often an idle core checks that its parent still lives
_ALIVE_S = 1.0  # the longest a stepping core stays silent (the front end's watchdog listens)


def unbounded(sock: zmq.Socket) -> zmq.Socket:
    """No high-water mark. At ZeroMQ's default (1000 messages queued) a non-blocking send failed
    while the core was busy in a long step, and its add or abort was lost: a request that never
    answered, an abort that left a request running. The server's limits bound the queue."""
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


def run_core(
    config: EngineConfig, folder: str | None, inbox: str, outbox: str, parent: int
) -> None:
    """The process's entry point (multiprocessing, spawn)."""
    # Ctrl-C reaches the whole process group, and so does systemd's SIGTERM (KillMode=
    # control-group): the parent decides, and stops us in order after its drain (the core had
    # died at once on a group SIGTERM, failing every request in flight). An orphaned core
    # exits by itself (below), so ignoring them leaves nothing running.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    thread_lock_only()
    ctx = zmq.Context()
    pull, push = unbounded(ctx.socket(zmq.PULL)), unbounded(ctx.socket(zmq.PUSH))
    pull.connect(inbox)
    push.connect(outbox)
    push.setsockopt(zmq.LINGER, 2000)
    send = lambda *msg: push.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))  # noqa: E731
    try:
        from tinyoss.engine.builder import build_engine

        core = build_engine(config, None if folder is None else Path(folder))
        hook = os.environ.get(HOOK_ENV)
        if hook:
            module, name = hook.split(":")
            getattr(importlib.import_module(module), name)(core)
    except BaseException as e:  # noqa: BLE001 - the front end must hear why
        log.exception("the engine core failed to start")
        send("failed", f"{type(e).__name__}: {e}")
        raise SystemExit(1) from e
    send("ready", core.info)
    try:
        _loop(core, pull, send, parent)
    except BaseException as e:  # noqa: BLE001 - every waiting client must hear of it
        log.exception("the engine core failed")
        send("dead", f"{type(e).__name__}: {e}")
        traceback.print_exc()
        raise SystemExit(1) from e
    finally:
        core.close()
        push.close()
        pull.close(linger=0)
        ctx.term()
        # The interpreter's exit garbage-collects every object left, torch's hundreds of
        # thousands included: 1.1 s of CPU before the process ended (the server waits on it).
        # Frozen, they are only freed (or left to the OS); nothing of ours needs a collection.
        gc.freeze()


def _loop(core: EngineCore, pull: zmq.Socket, send, parent: int) -> None:
    busy, said = False, time.monotonic()
    while True:
        if pull.poll(0 if core.has_work() else _IDLE_POLL_MS):
            while True:
                try:
                    msg = pickle.loads(pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if msg[0] == "shutdown":
                    return
                if msg[0] == "abort":
                    core.abort(msg[1], msg[2])
                else:
                    try:
                        core.add(msg[1])
                    except ValueError as e:  # the front end checks first; this is a backstop
                        send("reject", msg[1].request_id, str(e))
        if os.getppid() != parent:  # checked while busy too: a long request must not keep
            log.warning("the server process is gone: the engine core exits")  # the GPU
            return
        if not core.has_work():
            if busy:  # gone idle: the front end's stats should say so
                send("step", [], core.current_stats(), time.monotonic())
                busy = False
            continue
        busy = True
        deltas = core.step()
        now = time.monotonic()
        if deltas or now - said > _ALIVE_S:  # a long prefill says it is alive
            send("step", deltas, core.current_stats(), now)
            said = now
