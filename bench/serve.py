"""Serving benchmark: `tinyoss serve` under load, against the same engine run offline, in one run.

    python bench/serve.py --model openai/gpt-oss-20b --load-format dummy \\
        --concurrency 1 4 16 64 256 --input-len 1024 --output-len 256 --burst 64 \\
        --json bench/results/NAME.json

In the manner of `vllm bench serve`. First (unless --no-offline) a child process runs the engine
through the Python API and exits, so that its GPU memory is free before the server starts: at
concurrency 1 it streams a few requests (`LLM.stream`: TTFT and inter-token latency of a bare
batch-1 step), and at every level c it times `LLM.generate` of c prompts (output tok/s). Then
`tinyoss serve` starts on a free loopback port with the same engine flags (or --base-url names a
running server), and at each --concurrency level N streaming /v1/completions requests of random
token ids run with c in flight (`ignore_eos`: each decodes --output-len tokens). What the server
adds to the engine shows in the served/offline ratios. --burst sends N requests at once as the
very first load, then again: a first burst much slower than the repeat means that something is
compiled or planned on first use.

Latencies are the client's, one timestamp per SSE chunk that brings tokens. The client is aiohttp,
as in vLLM's benchmark: its own time is in every TTFT, and httpx's async client costs more. ITL is the gap
between successive chunks of a request; a chunk known to bring k tokens (per-chunk usage, vLLM's
`stream_options.continuous_usage_stats`) counts as k gaps of gap / k, as sglang's client does.
Without per-chunk usage each chunk counts as one token, as vLLM's client does (a token whose text
is empty, inside a UTF-8 character, then merges into the next gap). TPOT is per request
(e2e - TTFT) / (tokens - 1), tokens from the final usage chunk. Prompts differ between levels,
bursts and the warm-up, so prefix caching never hits. client_cpu (the client's CPU seconds per
second of a level) near 1 means that the client, not the server, was the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import NoReturn

import aiohttp
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OFFLINE_STREAMS = 8  # batch-1 streams timed offline (TTFT and ITL at concurrency 1)
WARMUP_INPUT_LEN, WARMUP_OUTPUT_LEN = 16, 4
# Keys of independent prompt draws (a level's key is its index in --concurrency).
BURST_KEY, WARMUP_KEY, OFFLINE_STREAM_KEY, ARRIVALS_KEY = 1000, 2000, 3000, 4000
PRCTL = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform == "linux" else None


JSON = {"Content-Type": "application/json"}


def random_prompts(n: int, length: int, seed: int, key: int) -> list[list[int]]:
    """n prompts of exactly `length` token ids drawn uniformly from [1000, 150000): ordinary
    o200k tokens, never special ones; each key is an independent draw (no shared prefixes)."""
    return np.random.default_rng([seed, key]).integers(1000, 150000, (n, length)).tolist()


def stats_ms(seconds: list[float]) -> dict:
    """p50, p99 (linear interpolation, as numpy and vLLM), mean and max, in milliseconds."""
    if not seconds:
        return {"n": 0, "p50": None, "p99": None, "mean": None, "max": None}
    ms = 1e3 * np.asarray(seconds, dtype=np.float64)
    p50, p99 = np.percentile(ms, [50, 99])
    return {"n": len(ms), "p50": float(p50), "p99": float(p99), "mean": float(ms.mean()),
            "max": float(ms.max())}


def itl_gaps(times: list[float], tokens: list[int]) -> list[float]:
    """Inter-token gaps of one request, from the arrival time of each chunk and the cumulative
    token count it brought the request to: a gap that brought k tokens counts k times as gap/k."""
    gaps: list[float] = []
    for i in range(1, len(times)):
        k = tokens[i] - tokens[i - 1]
        gaps += [(times[i] - times[i - 1]) / k] * k
    return gaps


@dataclass
class RequestResult:
    """One request as the client saw it (time.perf_counter seconds)."""

    send: float = 0.0
    finish: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # chunks that brought tokens
    chunk_tokens: list[int] = field(default_factory=list)  # cumulative tokens at each
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send

    @property
    def e2e(self) -> float:
        return self.finish - self.send


def level_stats(results: list[RequestResult], output_len: int) -> dict:
    """One level's served figures; failed requests count in `failed` only. The wall time runs
    from the first send to the last finish."""
    ok = [r for r in results if r.error is None]
    duration = max(r.finish for r in results) - min(r.send for r in results)
    tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "requests": len(results),
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "short": sum(r.output_tokens < output_len for r in ok),  # fewer tokens than asked
        "duration_s": duration,
        "output_tokens": tokens,
        "output_tok_s": tokens / duration,
        "requests_s": len(ok) / duration,
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "itl_ms": stats_ms([g for r in ok for g in itl_gaps(r.chunk_times, r.chunk_tokens)]),
        "tpot_ms": stats_ms(tpots),
        "e2e_ms": stats_ms([r.e2e for r in ok]),
    }


async def one_request(
    client: aiohttp.ClientSession, url: str, body: bytes, r: RequestResult
) -> None:
    """Streams one completion into `r`; any failure (status, error event, exception) goes to
    r.error, so that one bad request does not end the run."""
    r.send = time.perf_counter()
    try:
        async with client.post(url, data=body, headers=JSON) as resp:
            if resp.status != 200:
                text = await resp.text(errors="replace")
                r.error = f"HTTP {resp.status}: {text[:300]}"
                return
            async for raw in resp.content:  # lines, split at b"\n" alone (as SSE says)
                line = raw.decode()
                if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                    continue
                now, chunk = time.perf_counter(), json.loads(data)
                if "error" in chunk:
                    r.error = f"error event: {chunk['error'].get('message')}"
                    return
                usage = chunk.get("usage") or {}
                if chunk.get("choices"):
                    last = r.chunk_tokens[-1] if r.chunk_tokens else 0
                    count = usage.get("completion_tokens", last + 1)
                    if count > last:
                        r.chunk_times.append(now)
                        r.chunk_tokens.append(count)
                elif "completion_tokens" in usage:  # the final usage chunk
                    r.output_tokens = usage["completion_tokens"]
        if not r.chunk_times:
            r.error = "no tokens came back"
        elif not r.output_tokens:  # no usage chunk: count what came
            r.output_tokens = r.chunk_tokens[-1]
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        r.error = f"{type(e).__name__}: {e}"
    finally:
        r.finish = time.perf_counter()


async def run_requests(
    base_url: str, body: dict, prompts: list[list[int]], concurrency: int,
    request_rate: float | None = None, seed: int = 0,
) -> list[RequestResult]:
    """Sends `prompts` with at most `concurrency` in flight. With `request_rate`, arrivals are a
    Poisson process of that rate; an arrival waits for a slot when the cap is reached."""
    results = [RequestResult() for _ in prompts]
    slots = asyncio.Semaphore(concurrency)
    gaps = np.zeros(len(prompts))
    if request_rate:
        gaps = np.random.default_rng([seed, ARRIVALS_KEY]).exponential(1 / request_rate, len(prompts))
    key = os.environ.get("TINYOSS_API_KEY")  # the server requires it when the env has it
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency),
        timeout=aiohttp.ClientTimeout(total=None),
        headers={"Authorization": f"Bearer {key}"} if key else None,
    ) as client:

        async def go(prompt: list[int], r: RequestResult) -> None:
            data = json.dumps({**body, "prompt": prompt}).encode()  # before the clock starts
            async with slots:
                await one_request(client, base_url + "/v1/completions", data, r)

        tasks = []
        for prompt, r, gap in zip(prompts, results, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(go(prompt, r)))
        await asyncio.gather(*tasks)
    return results


def warn_incomplete(label: str, stats: dict, output_len: int) -> None:
    """Failed requests, and requests that came back short (ignore_eos not honoured?), on stderr."""
    if stats["failed"]:
        print(f"WARNING: {label}: {stats['failed']} of {stats['requests']} requests failed, e.g. "
              f"{stats['errors'][0]}", file=sys.stderr)
    if stats["short"]:
        print(f"WARNING: {label}: {stats['short']} of {stats['ok']} requests returned fewer than "
              f"{output_len} tokens (is ignore_eos honoured?)", file=sys.stderr)


def request_body(model: str, output_len: int, temperature: float) -> dict:
    return {
        "model": model,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


async def served_run(args: argparse.Namespace, base_url: str, model: str) -> dict:
    """The burst (first thing after /health), one warm-up request, then every level."""
    record: dict = {}
    if args.burst:
        burst = {}
        for i, name in enumerate(("first", "repeat")):
            prompts = random_prompts(args.burst, args.burst_input_len, args.seed, BURST_KEY + i)
            body = request_body(model, args.burst_output_len, args.temperature)
            results = await run_requests(base_url, body, prompts, args.burst)
            burst[name] = level_stats(results, args.burst_output_len)
            warn_incomplete(f"burst, {name}", burst[name], args.burst_output_len)
        burst["first_over_repeat"] = burst["first"]["duration_s"] / burst["repeat"]["duration_s"]
        record["burst"] = burst
    warmup = random_prompts(1, WARMUP_INPUT_LEN, args.seed, WARMUP_KEY)
    await run_requests(base_url, request_body(model, WARMUP_OUTPUT_LEN, args.temperature), warmup, 1)
    record["levels"] = []
    for i, c in enumerate(args.concurrency):
        n = args.num_prompts or max(c, 8)  # one wave: the same requests the offline run takes
        prompts = random_prompts(n, args.input_len, args.seed, i)
        body = request_body(model, args.output_len, args.temperature)
        cpu = time.process_time()
        results = await run_requests(base_url, body, prompts, c, args.request_rate, args.seed)
        stats = level_stats(results, args.output_len)
        stats["client_cpu"] = (time.process_time() - cpu) / stats["duration_s"]
        record["levels"].append(stats)
        warn_incomplete(f"concurrency {c}", stats, args.output_len)
    return record


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags, spelled as for `tinyoss serve`; --extra-serve-args last."""
    flags = []
    for name in ("load_format", "max_num_seqs", "max_model_len", "kv_cache_tokens"):
        if (value := getattr(args, name)) is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags + ["--enforce-eager"] * args.enforce_eager + shlex.split(args.extra_serve_args)


def engine_options(args: argparse.Namespace) -> dict:
    """`LLM` keyword arguments from the same flags, read by tinyoss's own engine-flag parser, so
    that the offline engine is the server's (server-only flags such as --api-key drop out)."""
    from tinyoss.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_kwargs(parser.parse_known_args(engine_flags(args))[0])


def offline(args: argparse.Namespace) -> dict:
    """The engine alone through the Python API (runs in the --offline-worker child)."""
    from tinyoss import LLM, SamplingParams

    llm = LLM(args.model, **engine_options(args))

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=args.temperature)

    warmup = random_prompts(1, WARMUP_INPUT_LEN, args.seed, WARMUP_KEY)
    llm.generate(warmup, params(WARMUP_OUTPUT_LEN), use_tqdm=False)
    levels = []
    for i, c in enumerate(args.concurrency):
        level: dict = {}
        if c == 1:  # the bare batch-1 step: time every step's tokens as the engine yields them
            ttfts, itls = [], []
            for prompt in random_prompts(OFFLINE_STREAMS, args.input_len, args.seed,
                                         OFFLINE_STREAM_KEY):
                start, times, counts = time.perf_counter(), [], [0]
                for out in llm.stream(prompt, params(args.output_len)):
                    if (n := len(out.outputs[0].token_ids)) > counts[-1]:
                        times.append(time.perf_counter())
                        counts.append(n)
                ttfts.append(times[0] - start)
                itls += itl_gaps(times, counts[1:])
            level = {"ttft_ms": stats_ms(ttfts), "itl_ms": stats_ms(itls)}
        prompts = random_prompts(c, args.input_len, args.seed, i)
        start = time.perf_counter()
        outs = llm.generate(prompts, params(args.output_len), use_tqdm=False)
        duration = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        levels.append({**level, "requests": c, "duration_s": duration, "output_tokens": tokens,
                       "output_tok_s": tokens / duration})
    return {"levels": levels}


def run_offline(args: argparse.Namespace) -> dict:
    """`offline` in a child process: its exit frees the GPU memory before the server starts."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "offline.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:],
               "--offline-worker", str(out)]
        print("offline run:", shlex.join(cmd), flush=True)
        if subprocess.run(cmd, check=False, cwd=ROOT, env=child_env(args)).returncode != 0:
            raise SystemExit("bench/serve.py: the offline run failed (its output is above)")
        return json.loads(out.read_text())


def child_env(args: argparse.Namespace) -> dict:
    """The offline worker's and the server's environment: each starts with an empty Triton
    cache (as on a first start) unless --warm-triton-cache, so that what the engine compiles on
    first use shows in the start-up burst instead of hiding in what an earlier run cached."""
    env = dict(os.environ)
    if not args.warm_triton_cache:
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tinyoss-triton-")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """Linux: the server gets SIGKILL should this process die first, even by SIGKILL (libc is
    looked up before the fork: the child only makes the call)."""
    if PRCTL is not None:
        PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Server:
    """`tinyoss serve` as a child in a session of its own, so that its whole process group can
    be signalled at the end (and Ctrl-C reaches this script only); its output goes to a log."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=die_with_parent)  # noqa: PLW1509

    def wait_healthy(self, base_url: str, timeout: float) -> float:
        """Seconds until GET /health answers 200."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                self.fail(f"exited with status {self.proc.returncode} before it was healthy")
            with suppress(httpx.TransportError):
                if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                    return time.monotonic() - start
            time.sleep(0.25)
        self.fail(f"was not healthy after {timeout:.0f} s (--startup-timeout)")

    def fail(self, why: str) -> NoReturn:
        tail = self.log_path.read_text(errors="replace").splitlines()[-40:]
        raise SystemExit(f"tinyoss serve {why}; the end of {self.log_path}:\n" + "\n".join(tail))

    def stop(self) -> None:
        """SIGINT (uvicorn's graceful shutdown), then SIGTERM, then SIGKILL; then SIGKILL to the
        group, for any worker the server left behind."""
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)
                break
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def git_state() -> tuple[str, bool]:
    """Short HEAD and whether tracked files differ from it."""
    try:
        head, status = (
            subprocess.check_output(["git", *a], cwd=ROOT, text=True, stderr=subprocess.DEVNULL)
            for a in (["rev-parse", "--short", "HEAD"], ["status", "--porcelain", "-uno"])
        )
        return head.strip(), bool(status.strip())
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False


def ratios(served: dict, off: dict) -> dict:
    """served / offline: output tok/s at every level; TTFT and ITL p50 where offline has them."""
    out = {"output_tok_s": served["output_tok_s"] / off["output_tok_s"]}
    for key in ("ttft_ms", "itl_ms"):
        if off.get(key, {}).get("p50") and served[key]["p50"] is not None:
            out[key.replace("_ms", "_p50")] = served[key]["p50"] / off[key]["p50"]
    return out


def fmt(stats: dict, keys: str, spec: str = ".1f", scale: float = 1.0) -> str:
    """Some of a stats_ms dict, slash-separated ("-" where there was nothing to measure)."""
    values = [stats.get(k) for k in keys.split("/")]
    return "/".join("-" if v is None else format(v * scale, spec) for v in values)


def print_report(record: dict) -> None:
    a = record["args"]
    print(f"\n{record['gpu']} | {record['model']} | in {a['input_len']} out {a['output_len']} | "
          f"{record['commit']}{' (dirty)' * record['dirty']}")
    if burst := record["burst"]:
        first, repeat = burst["first"], burst["repeat"]
        print(f"burst of {a['burst']} (in {a['burst_input_len']}, out {a['burst_output_len']}): "
              f"first {first['duration_s']:.2f} s, repeat {repeat['duration_s']:.2f} s, "
              f"first/repeat {burst['first_over_repeat']:.2f}, failed "
              f"{first['failed'] + repeat['failed']}")
    print(f"{'conc':>5} {'ok':>5} {'fail':>4} {'dur s':>7} {'tok/s':>8} {'req/s':>6} | "
          f"{'TTFT ms p50/p99/mean':>22} | {'ITL ms p50/p99/max':>20} | "
          f"{'TPOT ms p50/p99':>15} | {'E2E s p50/p99':>13} | {'offline tok/s':>13} {'srv/off':>7}")
    for level in record["levels"]:
        s, off = level["served"], level.get("offline", {})
        r = level.get("served_over_offline", {})
        print(f"{level['concurrency']:>5} {s['ok']:>5} {s['failed']:>4} {s['duration_s']:>7.2f} "
              f"{s['output_tok_s']:>8.1f} {s['requests_s']:>6.2f} | "
              f"{fmt(s['ttft_ms'], 'p50/p99/mean'):>22} | "
              f"{fmt(s['itl_ms'], 'p50/p99/max', '.2f'):>20} | "
              f"{fmt(s['tpot_ms'], 'p50/p99', '.2f'):>15} | "
              f"{fmt(s['e2e_ms'], 'p50/p99', '.2f', 1e-3):>13} | "
              f"{fmt(off, 'output_tok_s'):>13} {fmt(r, 'output_tok_s', '.2f'):>7}")
        if "itl_ms" in off:
            print(f"      offline batch-1 stream: TTFT p50 {fmt(off['ttft_ms'], 'p50')} ms, "
                  f"ITL p50 {fmt(off['itl_ms'], 'p50', '.2f')} ms; served/offline: "
                  f"TTFT {fmt(r, 'ttft_p50', '.2f')}, ITL {fmt(r, 'itl_p50', '.2f')}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="served model: hub id, folder or 'tiny' (default: "
                   "openai/gpt-oss-20b with a GPU, else tiny; with --base-url, the server's)")
    p.add_argument("--load-format", default=None, choices=("auto", "safetensors", "dummy"),
                   help="engine flag: dummy = random weights from the config")
    p.add_argument("--max-num-seqs", type=int, default=None, help="engine flag")
    p.add_argument("--max-model-len", type=int, default=None, help="engine flag")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="engine flag")
    p.add_argument("--enforce-eager", action="store_true", help="engine flag: no CUDA graphs")
    p.add_argument("--extra-serve-args", default="", help="more `tinyoss serve` flags, one shell "
                   "string, appended verbatim (engine flags among them apply offline too)")
    p.add_argument("--base-url", default=None, help="benchmark this running server "
                   "(e.g. http://127.0.0.1:8000) instead of starting one; no offline run")
    p.add_argument("--offline", action="store_true",
                   help="with --base-url: run the offline comparison anyway (needs --model)")
    p.add_argument("--no-offline", action="store_true", help="skip the offline comparison")
    p.add_argument("--startup-timeout", type=float, default=900,
                   help="seconds to wait for the started server's /health")
    p.add_argument("--server-log", default=None,
                   help="file for the started server's output (default: a temporary file)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 256],
                   help="levels run in turn: requests in flight (the cap, with --request-rate)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals at this many requests/s (default: all at once)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per level (default: the concurrency, at least 8: one wave, as offline)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per request")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    p.add_argument("--burst", type=int, default=0,
                   help="first send this many requests at once, twice (0: no burst)")
    p.add_argument("--burst-input-len", type=int, default=64, help="prompt tokens in the burst")
    p.add_argument("--burst-output-len", type=int, default=64, help="output tokens in the burst")
    p.add_argument("--json", default=None, help="write the record to this file")
    p.add_argument("--warm-triton-cache", action="store_true",
                   help="let the engine processes share the user's Triton cache (default: each "
                   "starts with an empty one, as on a first start)")
    p.add_argument("--commit", default=None,
                   help="the commit to record (default: git HEAD; a copy without history)")
    p.add_argument("--offline-worker", default=None, metavar="PATH",
                   help="internal: run the offline part in this process, its JSON to PATH")
    args = p.parse_args()
    if args.offline and args.base_url and args.model is None:
        p.error("--offline with --base-url needs --model (the engine to run offline)")
    if args.model is None and args.base_url is None:
        from tinyoss.cli import default_model

        args.model = default_model()
    return args


def main() -> None:
    args = parse_args()
    if args.offline_worker:
        Path(args.offline_worker).write_text(json.dumps(offline(args)))
        return
    import torch

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server on the way out
    do_offline = args.offline or (args.base_url is None and not args.no_offline)
    off = run_offline(args) if do_offline else None
    server, server_cmd, log_path, startup_s = None, None, None, None
    try:
        base_url = (args.base_url or "").rstrip("/")
        if not base_url:
            port = free_port()
            base_url = f"http://127.0.0.1:{port}"
            server_cmd = [sys.executable, "-m", "tinyoss.cli", "serve", args.model, "--port",
                          str(port), "--host", "127.0.0.1", *engine_flags(args)]
            log_path = Path(args.server_log or f"{tempfile.gettempdir()}/tinyoss-serve-{port}.log")
            print(f"server: {shlex.join(server_cmd)}\nserver log: {log_path}", flush=True)
            server = Server(server_cmd, log_path, child_env(args))
            startup_s = server.wait_healthy(base_url, args.startup_timeout)
            print(f"server healthy after {startup_s:.1f} s", flush=True)
        model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        served = asyncio.run(served_run(args, base_url, model))
    finally:
        if server is not None:
            server.stop()
    commit, dirty = (args.commit, False) if args.commit else git_state()
    levels = []
    for i, (c, s) in enumerate(zip(args.concurrency, served["levels"])):
        level = {"concurrency": c, "served": s}
        if off is not None:
            level["offline"] = off["levels"][i]
            level["served_over_offline"] = ratios(s, off["levels"][i])
        levels.append(level)
    record = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "commit": commit,
        "dirty": dirty,
        "command": shlex.join(sys.argv),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "args": vars(args),
        "model": model,
        "server_command": server_cmd and shlex.join(server_cmd),
        "server_log": log_path and str(log_path),
        "startup_s": startup_s,
        "burst": served.get("burst"),
        "levels": levels,
    }
    print_report(record)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
