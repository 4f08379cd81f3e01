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


def describe(engine) -> str:
    """The start-up summary: what runs where, and how much the KV cache holds."""
    c = engine.config
    return (
        f"model {c.model} on {engine.device}, {str(engine.dtype).removeprefix('torch.')}; "
        f"backends: {engine.backends.describe()}; CUDA graphs "
        f"{'on' if engine.runner.graphs is not None else 'off'}; "
        f"KV cache: {engine.kv.num_blocks * c.block_size} token slots "
        f"({engine.kv.num_blocks} blocks of {c.block_size}); max_model_len "
        f"{engine.max_model_len}; max_num_seqs {c.max_num_seqs}"
    )


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from tinyoss.cli import default_model, engine_kwargs
    from tinyoss.engine.llm_engine import EngineConfig, LLMEngine
    from tinyoss.server.app import create_app

    model = args.model
    if model is None:
        model = default_model()
        why = "a GPU is present" if model != "tiny" else "no GPU: the built-in random-weight model"
        log.info("no MODEL given: serving %s (%s)", model, why)
    kwargs = engine_kwargs(args)
    api_key = args.api_key or os.environ.get("TINYOSS_API_KEY") or None

    def load() -> LLMEngine:
        try:
            engine = LLMEngine(EngineConfig(model=model, **kwargs))
        except Exception:
            server.should_exit = True  # from the command line, a model that cannot load ends it
            raise
        log.info(describe(engine))
        return engine

    name = args.served_model_name or model
    app = create_app(load, model_name=name, api_key=api_key)
    log.info(
        "serving %r on http://%s:%d/v1 (API key %s); the model loads in the background, "
        "GET /health answers 200 once it is ready",
        name,
        args.host,
        args.port,
        "required" if api_key else "off",
    )
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
    server.run()
    if app.state.server.load_error is not None:
        raise SystemExit(f"tinyoss serve: the model failed to load: {app.state.server.load_error}")
