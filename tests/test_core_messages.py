"""Messages from the server to its engine core are never dropped: while the core is busy in a
long step it reads nothing, and a flood of requests (an add and an abort each) once passed
ZeroMQ's default high-water mark (1000), failed the non-blocking send in silence, and left a
request unanswered or an aborted one running (a hostile-traffic trial)."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from tinyoss.engine.core_client import _Core
from tinyoss.engine.core_process import unbounded


async def _pair(tmp_path, make) -> tuple[zmq.Context, zmq.Socket, _Core]:
    """The server's end of the inbox and a core's, connected (as once the core is ready)."""
    ctx = zmq.asyncio.Context()
    core = _Core.__new__(_Core)  # its sockets only: no core process
    core.push = make(ctx.socket(zmq.PUSH))
    core.push.bind(f"ipc://{tmp_path}/in")
    reader = make(ctx.socket(zmq.PULL))
    reader.connect(f"ipc://{tmp_path}/in")
    await core.push.send(b"hello")
    assert await reader.recv() == b"hello"
    return ctx, reader, core


def test_a_busy_core_gets_every_message(tmp_path):
    async def run() -> int:
        ctx, reader, core = await _pair(tmp_path, unbounded)
        for i in range(5000):  # the core reads nothing meanwhile
            core.send("add", i)
        got = 0
        while await reader.poll(500):
            await reader.recv()
            got += 1
        ctx.destroy(linger=0)
        return got

    assert asyncio.run(run()) == 5000


def test_at_the_default_mark_a_send_fails_loudly(tmp_path):
    """What the sockets had before: the send now raises rather than losing the message."""
    async def run() -> None:
        ctx, reader, core = await _pair(tmp_path, lambda sock: sock)
        try:
            for i in range(5000):
                core.send("add", i)
        finally:
            ctx.destroy(linger=0)

    with pytest.raises(zmq.Again):
        asyncio.run(run())
