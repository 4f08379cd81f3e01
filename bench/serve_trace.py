"""Where a served request's time to first token goes, across both processes.

Starts `tinyoss serve`'s app in this process (uvicorn in a thread) with a hook in the engine
core's process, sends requests one at a time, and stamps each on one clock (CLOCK_MONOTONIC is
shared by all processes): client send -> HTTP handler hands it to the core -> the core takes it
-> the core's step returns its first token -> the HTTP process gets that delta -> the client
reads the first chunk. Prints the median of each segment.

    python bench/serve_trace.py --model gpt-oss-20b --load-format dummy --input-len 1024
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TRACE_ENV = "TINYOSS_TRACE_FILE"


def hook(core) -> None:
    """In the core's process: stamp each request's arrival and the step giving its first
    token."""
    out = open(os.environ[TRACE_ENV], "a", buffering=1)  # noqa: SIM115 - the process's life
    add, step, seen = core.add, core.step, set()

    def traced_add(request):
        out.write(json.dumps({"id": request.request_id, "core_add": time.monotonic()}) + "\n")
        add(request)

    def traced_step():
        t0 = time.monotonic()
        deltas = step()
        for d in deltas:
            if d.token_ids and d.request_id not in seen:
                seen.add(d.request_id)
                stamp = {"id": d.request_id, "step_start": t0, "core_first": time.monotonic()}
                out.write(json.dumps(stamp) + "\n")
        return deltas

    core.add, core.step = traced_add, traced_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--requests", type=int, default=12)
    args = p.parse_args()

    import httpx
    import uvicorn

    from tinyoss.config import EngineConfig
    from tinyoss.engine.core_client import CoreClient
    from tinyoss.engine.core_process import HOOK_ENV
    from tinyoss.server.app import create_app

    trace = Path(tempfile.mkdtemp()) / "trace.jsonl"
    os.environ[HOOK_ENV], os.environ[TRACE_ENV] = "bench.serve_trace:hook", str(trace)
    front: dict[str, dict] = {}
    send, deliver = CoreClient._send, CoreClient._deliver

    def traced_send(self, *msg):
        if msg[0] == "add":
            front.setdefault(msg[1].request_id, {})["front_send"] = time.monotonic()
        send(self, *msg)

    def traced_deliver(self, deltas):
        now = time.monotonic()
        for d in deltas:
            if d.token_ids:
                front.setdefault(d.request_id, {}).setdefault("front_first", now)
        deliver(self, deltas)

    CoreClient._send, CoreClient._deliver = traced_send, traced_deliver
    config = EngineConfig(
        model=args.model, load_format=args.load_format, max_model_len=args.max_model_len
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(config, model_name="m"), log_level="error"))
    threading.Thread(target=server.run, args=([sock],), daemon=True).start()
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    rng = random.Random(0)
    client_times = []
    with httpx.Client(timeout=120) as client:
        for i in range(args.requests + 2):  # two to warm up
            ids = [rng.randrange(1000, 150000) for _ in range(args.input_len)]
            body = {"prompt": ids, "max_tokens": 4, "stream": True, "ignore_eos": True}
            sent = time.monotonic()
            first = None
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.monotonic()
            if i >= 2:
                client_times.append((sent, first))
    server.should_exit = True
    time.sleep(2)
    core: dict[str, dict] = {}
    for line in trace.read_text().splitlines():
        e = json.loads(line)
        core.setdefault(e.pop("id"), {}).update(e)
    rows = []
    ids = sorted(front, key=lambda k: front[k].get("front_send", 0))[-args.requests :]
    for (sent, first), rid in zip(client_times, ids):
        f, c = front[rid], core.get(rid, {})
        rows.append(
            {
                "client -> handed to core": f["front_send"] - sent,
                "core takes it": c["core_add"] - f["front_send"],
                "core: arrival -> step start": c["step_start"] - c["core_add"],
                "core: step with first token": c["core_first"] - c["step_start"],
                "core -> HTTP process": f["front_first"] - c["core_first"],
                "HTTP process -> client": first - f["front_first"],
                "client TTFT": first - sent,
            }
        )
    for key in rows[0]:
        print(f"{key:32s} {1e3 * statistics.median(r[key] for r in rows):8.2f} ms (median)")


if __name__ == "__main__":
    main()
