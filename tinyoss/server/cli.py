"""`tinyoss serve [MODEL]`: the OpenAI-compatible server on uvicorn.

The engine options (--max-model-len, --max-num-seqs, --gpu-memory-utilization, ...) come from
`tinyoss.cli.add_engine_args`; this adds the server's own. Heavy imports wait until `serve`, so
other subcommands start fast.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import logging
import os
import socket
from typing import Any

log = logging.getLogger("tinyoss.server")
API_KEY_ENVS = ("TINYOSS_API_KEY", "VLLM_API_KEY")  # in this order, after --api-key
SHUTDOWN_GRACE_S = 5  # after SIGTERM or Ctrl-C, requests in flight get this long, then end
_ANSWER_S = 1  # of the grace, the time requests ended by the shutdown get to send their answer


def _cut_off_quietly(app: Any) -> Any:
    """`app`, answering uvicorn's cancel of a request still running when the shutdown grace
    ends with one log line instead of an "Exception in ASGI application" traceback (uvicorn
    cancels request tasks only then; a client that leaves is seen through `receive`), and a
    request whose answer had not begun with a JSON 503 (uvicorn's own is a text 500)."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message.get("type") == "http.response.start"
            await send(message)

        try:
            await app(scope, receive, tracked)
        except asyncio.CancelledError:
            if scope.get("type") != "http":
                raise
            log.info("%s %s cut off by the shutdown", scope.get("method"), scope.get("path"))
            if not started:
                from tinyoss.server.protocol import APIError

                body = json.dumps(APIError(
                    503, f"the server is shutting down: this request was cut off after the "
                    f"{SHUTDOWN_GRACE_S} s grace; send it again once the server is back",
                    code="shutting_down").body()).encode()
                with contextlib.suppress(Exception):  # the connection may be gone too
                    await send({"type": "http.response.start", "status": 503, "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})

    return wrapped


def _model_name(text: str) -> str:
    """argparse type of --served-model-name: a name with something in it (an unset shell
    variable had served the model as "")."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"a served model name must not be blank, not {text!r}")
    return text


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8000,
                   help="port to listen on (0: any free one, which the log names)")
    p.add_argument(
        "--served-model-name", nargs="+", default=None, metavar="NAME",
        type=_model_name, help="the model name clients send (default: MODEL); several: any of "
        "them, answers named by the first (as vLLM's flag)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize (default: "
        "env TINYOSS_API_KEY, else "
        "env VLLM_API_KEY; neither set: no key)",
    )
    p.add_argument(
        "--uvicorn-log-level", default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's log level, as vLLM's flag sets it (tinyoss's own lines are at info)",
    )
    p.add_argument(
        "--disable-uvicorn-access-log", action="store_true",
        help="no line a request (health probes included), as vLLM's flag (default: off)",
    )
    p.add_argument(
        "--reasoning-content", action="store_true",
        help="chat answers carry the reasoning as reasoning_content too (DeepSeek's name, which "
        "LiteLLM and the Vercel AI SDK read); off: as reasoning only, as vLLM sends it and "
        "OpenAI's gpt-oss guide asks (the Agents SDK reads the two as different things)",
    )
    p.add_argument(
        "--enable-log-requests", action="store_true",
        help="log one line a generation request once it has ended: its x-request-id, "
        "endpoint, status and finish reasons, prompt, completion and cached tokens, time to "
        "first token, total time and client address; never its text (vLLM's flag; vLLM's "
        "lines carry the prompt)",
    )
    p.add_argument(
        "--max-log-len", type=int, default=None, metavar="CHARS",
        help="with --enable-log-requests: each line shows the first CHARS characters of the "
        "prompt too, as vLLM's flag cuts its logged prompts (default: no prompt text)",
    )
    p.add_argument(
        "--max-stored-responses",
        type=int,
        default=1000,
        help="/v1/responses answers kept in memory for GET and previous_response_id, the least "
        "recently used evicted first (and at most 256 MiB of request bodies and, once ended, "
        "output items); 0 keeps none",
    )
    group = p.add_argument_group("CORS (vLLM's flags; off unless --allowed-origins is given)")
    group.add_argument(
        "--allowed-origins",
        type=_json_list("--allowed-origins", '["https://app.example"]'),
        default=None,
        help='origins allowed to call the API from a browser, a JSON list: \'["*"]\' for any, '
        '\'["https://app.example"]\' (default: none, no CORS headers)',
    )
    group.add_argument(
        "--allowed-methods",
        type=_json_list("--allowed-methods", '["GET", "POST"]'),
        default=None,
        help='methods allowed, a JSON list (default \'["*"]\'); needs --allowed-origins',
    )
    group.add_argument(
        "--allowed-headers",
        type=_json_list("--allowed-headers", '["Content-Type", "Authorization"]'),
        default=None,
        help='request headers allowed, a JSON list (default \'["*"]\'); needs --allowed-origins',
    )
    group.add_argument(
        "--allow-credentials",
        action="store_true",
        help="allow credentials (cookies, Authorization) in cross-origin requests; needs "
        "--allowed-origins",
    )
    from tinyoss.cli import add_dataclass_args
    from tinyoss.server.limits import ServerLimits
    from tinyoss.server.vllm_flags import add_vllm_args

    add_dataclass_args(p.add_argument_group("server limits"), ServerLimits)
    add_vllm_args(p)


def _json_list(flag: str, example: str):
    """argparse type: a JSON list of strings, as vLLM takes its CORS flags."""

    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(
                f"{flag} takes a JSON list of strings, e.g. '[\"*\"]' or '{example}', not "
                f"{text!r}"
            )
        return value

    return parse


def cors(args: argparse.Namespace):
    """The CORS settings the flags give (None: off), or a CliError for a flag without
    --allowed-origins."""
    from tinyoss.cli import CliError
    from tinyoss.server.app import Cors

    if args.allowed_origins is None:
        given = [
            flag
            for flag, value in (
                ("--allowed-methods", args.allowed_methods),
                ("--allowed-headers", args.allowed_headers),
                ("--allow-credentials", args.allow_credentials or None),
            )
            if value is not None
        ]
        if given:
            raise CliError(
                f"{', '.join(given)} without --allowed-origins does nothing: CORS is off unless "
                "--allowed-origins is given (e.g. --allowed-origins '[\"*\"]')"
            )
        return None
    return Cors(
        tuple(args.allowed_origins),
        tuple(args.allowed_methods if args.allowed_methods is not None else ["*"]),
        tuple(args.allowed_headers if args.allowed_headers is not None else ["*"]),
        args.allow_credentials,
    )


def api_key(args: argparse.Namespace) -> tuple[str | None, str]:
    """The key clients must send, and where it came from (for the start-up log)."""
    if args.api_key:
        return args.api_key, "--api-key"
    for env in API_KEY_ENVS:
        if os.environ.get(env):
            return os.environ[env], f"env {env}"
    return None, "none given"


def check_port(host: str, port: int) -> None:
    """Binds host:port and lets go at once, as uvicorn will bind it (SO_REUSEADDR; IPv6 sockets
    IPv6-only), so that a port in use is reported now, not after the model has loaded. Nothing
    is held: uvicorn binds the port itself."""
    from tinyoss.cli import CliError

    if not 0 <= port <= 65535:
        raise CliError(f"--port {port} is not a port: give one from 1 to 65535 (or 0: any free "
                       "one, which the log names)")
    try:
        addresses = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise CliError(f"--host {host}: not an address this machine can resolve ({e})") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as e:
                raise CliError(_bind_error(host, port, e)) from None


def _free_port(host: str, after: int) -> int | None:
    """The first of the ten ports after `after` that `host` can bind now, or None (the
    suggestion had been `after + 1`, taken as often as not)."""
    for port in range(after + 1, min(after + 11, 65536)):
        try:
            with socket.create_server((host, port)):
                return port
        except OSError:
            continue
    return None


def _bind_error(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use (is another server running there?): "
            "stop it, or pick a free port with --port" + (
                f", e.g. --port {free}" if (free := _free_port(host, port)) else "")
        )
    if e.errno == errno.EACCES:
        return (
            f"no permission to listen on port {port} (ports below 1024 need privileges): "
            "pick another with --port, e.g. --port 8000"
        )
    if e.errno == errno.EADDRNOTAVAIL:
        return (
            f"--host {host} is not an address of this machine: give 127.0.0.1 (this machine "
            "only) or 0.0.0.0 (all interfaces)"
        )
    return f"cannot listen on {host}:{port}: {e.strerror}"


def serve(args: argparse.Namespace) -> None:
    from tinyoss.cli import CliError, _os_error, check_device, default_model, engine_kwargs
    from tinyoss.config import EngineConfig
    from tinyoss.engine.builder import check_config
    from tinyoss.server.limits import ServerLimits, limited_http
    from tinyoss.tools.make_checkpoint import cache_dir

    # what can be checked without loading anything, before the model (or uvicorn) loads
    check_port(args.host, args.port)
    check_device(args.device)
    if args.max_log_len is not None and args.max_log_len < 0:
        raise CliError(f"--max-log-len {args.max_log_len} is invalid: give a number of "
                       "characters >= 0 (0: none of the prompt)")
    if args.max_log_len is not None and not args.enable_log_requests:
        log.info("--max-log-len changes nothing without --enable-log-requests: no request is "
                 "logged")
    if args.max_stored_responses < 0:
        raise CliError(
            f"--max-stored-responses {args.max_stored_responses} is invalid: give a count >= 0 "
            "(0 keeps no responses)"
        )
    model = args.model
    if model is None:
        model = default_model()
        why = "a GPU is present" if model != "tiny" else "no GPU: the built-in random-weight model"
        log.info("no MODEL given: serving %s (%s)", model, why)
    try:
        config = EngineConfig(model=model, **engine_kwargs(args))
        limits = ServerLimits(**engine_kwargs(args, ServerLimits))
        check_config(config)  # before the server listens: a supervisor sees exit 2 at once
        cache_dir().mkdir(parents=True, exist_ok=True)  # the engine core writes there
    except ValueError as e:
        raise CliError(str(e)) from None
    except OSError as e:  # a folder without config.json, a cache that cannot be written
        raise CliError(_os_error(e)) from None

    import uvicorn

    from tinyoss.server.app import create_app
    from tinyoss.server.request_log import RequestLog

    cors_options = cors(args)

    key, key_from = api_key(args)
    fatal: list[str] = []

    def on_fatal(why: str) -> None:  # no engine core can run: stop, non-zero, for a supervisor
        fatal.append(why)
        server.should_exit = True

    name, *aliases = args.served_model_name or [model]
    app = create_app(
        config,
        model_name=name,
        aliases=tuple(aliases),
        api_key=key,
        on_fatal=on_fatal,
        limits=limits,
        cors=cors_options,
        max_stored_responses=args.max_stored_responses,
        request_log=RequestLog(args.max_log_len) if args.enable_log_requests else None,
        reasoning_content=args.reasoning_content,
    )
    log.info(
        "serving %r on %s (API key: %s); the model loads in the background, "
        "GET /health answers 200 once it is ready",
        name,
        base_url(args.host, args.port) if args.port else f"a free port of {args.host} (--port 0: "
        "the next line names it)",
        f"required, from {key_from}" if key else "off",
    )
    state = app.state.server

    class Server(uvicorn.Server):
        """uvicorn's, telling the app when a signal starts the shutdown (a request it cuts off
        is logged as such, not as one whose client left)."""

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if args.port == 0 and self.servers:  # the port the system picked: say which
                port = self.servers[0].sockets[0].getsockname()[1]
                log.info("listening on %s", base_url(args.host, port))

        def handle_exit(self, sig: int, frame: Any) -> None:
            state.shutting_down = True
            if state.client is not None:  # (a second Ctrl-C reaches the core's process too)
                state.client.begin_shutdown()
            forced = self.force_exit
            super().handle_exit(sig, frame)
            if self.force_exit and not forced:
                quiet.cutting = True  # its cut-off requests and cancelled lifespan: expected
                log.info("a second signal: exiting now, requests in flight are cut off")

        async def _wait_tasks_to_complete(self) -> None:
            """uvicorn's wait for the requests in flight, whose tasks it cancels when the grace
            ends; a second before that they are ended through the engine, so a stream's client
            reads an error event (shutting_down) and the stream's end, not a cut connection."""
            try:
                await asyncio.wait_for(super()._wait_tasks_to_complete(),
                                       SHUTDOWN_GRACE_S - _ANSWER_S)
            except TimeoutError:
                if state.client is not None:
                    state.client.end_requests(
                        f"the server is shutting down: this request was cut off after the "
                        f"{SHUTDOWN_GRACE_S} s grace; send it again once the server is back")
                await super()._wait_tasks_to_complete()

    server = Server(
        uvicorn.Config(
            _cut_off_quietly(app),
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            http=limited_http(limits),
            timeout_keep_alive=limits.timeout_keep_alive,
            # uvicorn waits for every request in flight before shutting down, with no limit:
            # a 60,000-token stream kept a SIGTERM'd server up for its whole length
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
    )
    quiet = _QuietShutdown()
    logging.getLogger("uvicorn.error").addFilter(quiet)  # after uvicorn's log config
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal once it has shut down in order
        pass
    if fatal:
        raise SystemExit(f"tinyoss serve: the engine could not run: {fatal[0]}")


class _QuietShutdown(logging.Filter):
    """uvicorn's ERROR lines when the shutdown grace ends with requests still running, which
    read like a crash: its count of them becomes an INFO line in tinyoss's words, and from then
    on "ASGI callable returned without completing response" (a stream cut mid-answer, which
    `_cut_off_quietly` logs) goes, as does, after a second signal's forced exit, the lifespan's
    cancellation traceback. Before the cut-off those stay errors: a real fault."""

    cutting = False

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if self.cutting and text == "ASGI callable returned without completing response.":
            return False
        if self.cutting and text.startswith("Traceback") and text.rstrip().endswith(
                "CancelledError"):
            return False
        if text.startswith("Cancel ") and text.endswith("timeout graceful shutdown exceeded"):
            self.cutting = True
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg = (f"shutting down: {text.split()[1]} request(s) still running after "
                          f"the {SHUTDOWN_GRACE_S} s grace are cut off")
            record.args = ()
        return True


def base_url(host: str, port: int) -> str:
    """The API's URL for the log, one a client can paste: an IPv6 address in brackets."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
