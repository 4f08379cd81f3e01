"""An engine core whose server died exits even while it is busy with a long request: it must
not hold the GPU until the request ends (it used to check for its parent only when idle)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie has exited
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    return False


def test_busy_core_exits_when_its_server_is_killed(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "tinyoss.cli", "serve", "tiny", "--port",
                               str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    cores: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        body = {"prompt": "a", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        started = threading.Event()

        def generate() -> None:  # a request that keeps the core busy for a long time
            with contextlib.suppress(httpx.HTTPError):
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                    for _ in r.iter_lines():
                        started.set()

        threading.Thread(target=generate, daemon=True).start()
        assert started.wait(60), "the request never started streaming"
        cores = [p for p in _children(server.pid)
                 if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
        assert len(cores) == 1, cores
        server.kill()
        server.wait(10)
        deadline = time.monotonic() + 15
        while _alive(cores[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(cores[0]), "the engine core outlived its server while busy"
    finally:
        for pid in [server.pid, *cores]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()
