"""The `tinyoss` command: serve, chat, generate, make-checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from tinyoss.config import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per `EngineConfig` field (but `model`), with its help, choices and default: the
    CLI cannot drift from the options the engine takes."""
    add_dataclass_args(p.add_argument_group("engine options"), EngineConfig)


def add_dataclass_args(group: argparse._ArgumentGroup, cls: type) -> None:
    """One flag per field of an options dataclass (but `model`), from its `option` metadata."""
    for f in dataclasses.fields(cls):
        if f.name == "model":
            continue
        kwargs: dict = {"dest": f.name, "default": f.default, "choices": f.metadata["choices"]}
        if f.type == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = int if "int" in f.type else float if "float" in f.type else str
        default = "" if f.default is None else f" (default: {f.default})"
        group.add_argument(
            "--" + f.name.replace("_", "-"), help=f.metadata["help"] + default, **kwargs
        )


def engine_kwargs(args: argparse.Namespace, cls: type = EngineConfig) -> dict:
    """The values of `cls`'s flags (added by `add_dataclass_args`)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name != "model"}


def default_model() -> str:
    """gpt-oss-20b where a GPU is present, the built-in tiny model otherwise."""
    import torch

    return "openai/gpt-oss-20b" if torch.cuda.is_available() else "tiny"


def _chat(args: argparse.Namespace) -> None:
    from tinyoss import LLM, SamplingParams

    llm = LLM(args.model or default_model(), **engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    reply = llm.chat(
        [{"role": "user", "content": args.message}],
        params,
        reasoning_effort=args.reasoning_effort,
    )[0]
    if reply.reasoning:
        print(f"[reasoning] {reply.reasoning}\n")
    print(reply.content or "")
    print(f"\n[finish: {reply.finish_reason}]", file=sys.stderr)


def _generate(args: argparse.Namespace) -> None:
    from tinyoss import LLM, SamplingParams

    llm = LLM(args.model or default_model(), **engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    for out in llm.stream(args.prompt, params):
        print(out.outputs[0].delta_text, end="", flush=True)
    print()


def main(argv: list[str] | None = None) -> None:
    # no abbreviated flags: --max-n must never quietly mean --max-num-seqs
    parser = argparse.ArgumentParser(
        prog="tinyoss", description="A lean engine for gpt-oss.", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True)

    from tinyoss.server.cli import add_serve_args, serve

    serve_p = sub.add_parser("serve", help="OpenAI-compatible HTTP server", allow_abbrev=False)
    serve_p.add_argument("model", nargs="?", default=None, help="folder, hub id or 'tiny'")
    add_engine_args(serve_p)
    add_serve_args(serve_p)
    serve_p.set_defaults(func=serve)

    for name, func, text_arg in (("chat", _chat, "message"), ("generate", _generate, "prompt")):
        p = sub.add_parser(name, help=f"one {text_arg}, answered on stdout", allow_abbrev=False)
        p.add_argument(text_arg)
        p.add_argument("--model", default=None, help="folder, hub id or 'tiny'")
        p.add_argument("--max-tokens", type=int, default=256)
        p.add_argument("--temperature", type=float, default=1.0)
        if name == "chat":
            p.add_argument(
                "--reasoning-effort", default="medium", choices=("low", "medium", "high")
            )
        add_engine_args(p)
        p.set_defaults(func=func)

    ckpt = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint folder")
    ckpt.add_argument("rest", nargs=argparse.REMAINDER)
    ckpt.set_defaults(func=lambda a: _make_checkpoint(a.rest))

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args.func(args)


def _make_checkpoint(rest: list[str]) -> None:
    from tinyoss.tools.make_checkpoint import main as make

    make(rest)


if __name__ == "__main__":
    main()
