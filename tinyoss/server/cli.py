"""`tinyoss serve [MODEL]`: the OpenAI-compatible server on uvicorn.

The engine options (--max-model-len, --max-num-seqs, --gpu-memory-utilization, ...) come from
`tinyoss.cli.add_engine_args`; this adds the server's own. Heavy imports wait until `serve`, so
other subcommands start fast.
"""

from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger("tinyoss.server")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: MODEL)"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (default: env TINYOSS_API_KEY)",
    )
    from tinyoss.cli import add_dataclass_args
    from tinyoss.server.limits import ServerLimits

    add_dataclass_args(p.add_argument_group("server limits"), ServerLimits)


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from tinyoss.cli import default_model, engine_kwargs
    from tinyoss.config import EngineConfig
    from tinyoss.server.app import create_app
    from tinyoss.server.limits import ServerLimits, limited_http

    model = args.model
    if model is None:
        model = default_model()
        why = "a GPU is present" if model != "tiny" else "no GPU: the built-in random-weight model"
        log.info("no MODEL given: serving %s (%s)", model, why)
    config = EngineConfig(model=model, **engine_kwargs(args))
    limits = ServerLimits(**engine_kwargs(args, ServerLimits))
    api_key = args.api_key or os.environ.get("TINYOSS_API_KEY") or None
    fatal: list[str] = []

    def on_fatal(why: str) -> None:  # no engine core can run: stop, non-zero, for a supervisor
        fatal.append(why)
        server.should_exit = True

    name = args.served_model_name or model
    app = create_app(config, model_name=name, api_key=api_key, on_fatal=on_fatal, limits=limits)
    log.info(
        "serving %r on http://%s:%d/v1 (API key %s); the model loads in the background, "
        "GET /health answers 200 once it is ready",
        name,
        args.host,
        args.port,
        "required" if api_key else "off",
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="info",
            http=limited_http(limits),
            timeout_keep_alive=limits.timeout_keep_alive,
        )
    )
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal once it has shut down in order
        pass
    if fatal:
        raise SystemExit(f"tinyoss serve: the engine could not run: {fatal[0]}")
