"""The reliability suite's one server: `tinyoss serve tiny` as a real subprocess (its engine
core in a process of its own), started once for the session with small limits (helpers.py) and
the fault-hook module tests.reliability.hooks loaded in its core.

At the end the suite prints one line of counts (classes tried, 5xx, hangs, lost, duplicated;
tests/conftest.py prints it, also from pytest-xdist's workers) and fails if any 5xx, hang, lost or duplicated answer was seen.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.reliability.helpers import (
    KEY,
    MAX_MODEL_LEN,
    SERVER_FLAGS,
    TRACKER,
    Api,
)

REPO = Path(__file__).resolve().parents[2]
HOOK = "tests.reliability.hooks:install"
START_TIMEOUT = 120.0


@dataclass
class Server:
    url: str
    port: int
    proc: subprocess.Popen
    log: Path
    flags: dict[str, str]

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["TINYOSS_CORE_HOOK"] = HOOK
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("TINYOSS_API_KEY", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _start(tmp: Path, flags: dict[str, str], attempt: int) -> Server:
    port = _free_port()
    log = tmp / f"server-{attempt}.log"
    cmd = [sys.executable, "-m", "tinyoss.cli", "serve", "tiny", "--port", str(port),
           "--api-key", KEY]
    for flag, value in flags.items():
        cmd += [flag, value]
    cmd += ["--device", "cpu", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-tokens", "8192"]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    return Server(f"http://127.0.0.1:{port}", port, proc, log, flags)


def _wait_healthy(server: Server) -> bool:
    """True once GET /health is 200; False if the process ended first."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return False
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return True
        time.sleep(0.2)
    _stop(server.proc)
    raise RuntimeError(
        f"`tinyoss serve` not healthy after {START_TIMEOUT} s; log:\n{server.log_tail()}"
    )


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    tmp = tmp_path_factory.mktemp("reliability")
    for attempt in range(3):  # a port taken between picking and binding: try another
        srv = _start(tmp, SERVER_FLAGS, attempt)
        if _wait_healthy(srv):
            break
        if "address already in use" not in srv.log_tail().lower():
            raise RuntimeError(f"`tinyoss serve` exited {srv.proc.returncode}:\n{srv.log_tail()}")
    else:
        raise RuntimeError(f"`tinyoss serve` could not bind a port:\n{srv.log_tail()}")
    yield srv
    _stop(srv.proc)


@pytest.fixture(scope="session")
def api(server: Server) -> Api:
    client = Api(server.url)
    yield client
    client.close()


@pytest.fixture(scope="session", autouse=True)
def reliability_counts():
    """After the whole suite: no unexpected 5xx, no hang, nothing lost or answered twice."""
    yield TRACKER
    if not TRACKER.used:
        return
    t = TRACKER
    assert t.server_errors == t.hangs == t.lost == t.duplicated == 0, (
        f"{TRACKER.summary()}; first events: {TRACKER.events[:20]}"
    )
