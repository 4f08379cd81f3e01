"""The `tinyoss` command: serve, chat, generate, make-checkpoint.

`tinyoss` and `python -m tinyoss` are the same (`main`). Mistakes in how it is called (a bad
flag, a port in use, --device cuda without a GPU, a model that is not there, a bad sampling
value, a KV cache too small) are reported as `tinyoss COMMAND: error: ...` with exit status 2,
as argparse reports a bad flag, and without a traceback; those that need no weights are found
before any load.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from tinyoss.config import EngineConfig

if TYPE_CHECKING:
    from tinyoss.llm import LLM, ChatOutput
    from tinyoss.sampling_params import SamplingParams

log = logging.getLogger("tinyoss")

MODEL_HELP = (
    "checkpoint folder, hub id or 'tiny' (default: openai/gpt-oss-20b with a GPU, else tiny)"
)
SHARD_BYTES = 4_800_000_000  # make_checkpoint.SHARD_BYTES, which imports torch (a test pins it)
NO_COMMAND = (
    "tinyoss: give a command, e.g. `tinyoss serve` (the OpenAI-compatible server on port 8000) "
    "or `tinyoss chat 'Hello'`; `tinyoss COMMAND --help` lists its flags"
)
VLLM_HINT = "; docs/serve.md, 'Coming from vLLM', says what becomes of vLLM's"
TINY_NOTE = (
    "note: `tiny` has random weights, so its text is gibberish (it runs every part of the "
    "engine without a GPU); give --model openai/gpt-oss-20b on a GPU for real answers"
)


class CliError(Exception):
    """A mistake in the command line found before anything loads; `main` prints it and exits 2."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, unless the help already says it or the default
    is None or False (a switch that is off): one rule, so no flag can forget it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "(default" in text
            or "%(default)" in text
            or default is None
            or default is False
            or default == argparse.SUPPRESS
        ):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is its message and a pointer to --help, not the whole usage
    (serve's runs to some 50 lines, burying the one that matters)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the flags)\n")


def version() -> str:
    """The installed distribution's version; the package's own where it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("tinyoss")
    except metadata.PackageNotFoundError:
        import tinyoss

        return getattr(tinyoss, "__version__", "unknown")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per `EngineConfig` field (but `model`), with its help, choices and default: the
    CLI cannot drift from the options the engine takes."""
    add_dataclass_args(p.add_argument_group("engine options"), EngineConfig)


_SPELLINGS = {"dtype": {"half": "float16", "float": "float32"}}  # vLLM's other names of values
_HUMAN_INT = re.compile(r"(-?\d+(?:\.\d+)?)([kmgKMG]?)")
_MULTIPLIERS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_int(text: str) -> int:
    """An integer flag's value as vLLM reads it: 32768, 32k (32,000), 32K (32,768), 1.5m."""
    m = _HUMAN_INT.fullmatch(text.strip())
    if m and "." not in m[1]:  # exact: through a float, --seed 2**53 + 1 became 2**53
        return int(m[1]) * _MULTIPLIERS[m[2]]
    value = float(m[1]) * _MULTIPLIERS[m[2]] if m else 0.5
    if value != int(value) or (m and m[2].isupper()):
        raise argparse.ArgumentTypeError(
            f"invalid integer {text!r}: give one such as 32768, 32k (32,000) or 32K (32,768)")
    return int(value)


def add_dataclass_args(group: argparse._ArgumentGroup, cls: type) -> None:
    """One flag per field of an options dataclass (but `model`), from its `option` metadata."""
    for f in dataclasses.fields(cls):
        if f.name == "model":
            continue
        kwargs: dict = {"dest": f.name, "default": f.default, "choices": f.metadata["choices"]}
        if f.type == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name in _SPELLINGS:
            kwargs["type"] = lambda v, names=_SPELLINGS[f.name]: names.get(v, v)
        else:
            kwargs["type"] = human_int if "int" in f.type else float if "float" in f.type else str
        default = "" if f.default is None else f" (default: {f.default})"
        group.add_argument(
            "--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()),
            help=f.metadata["help"] + default, **kwargs,
        )


def engine_kwargs(args: argparse.Namespace, cls: type = EngineConfig) -> dict:
    """The values of `cls`'s flags (added by `add_dataclass_args`)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name != "model"}


def default_model() -> str:
    """gpt-oss-20b where a GPU is present, the built-in tiny model otherwise."""
    return "openai/gpt-oss-20b" if _cuda_available() else "tiny"


def _cuda_available() -> bool:
    """torch.cuda.is_available() without the "Found no NVIDIA driver" warning it may print."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.cuda.is_available()


def check_device(device: str | None) -> None:
    """Refuses a --device that cannot run here, naming why, before torch fails deep inside the
    engine (serve's engine core would only fail after the server had started)."""
    if device is None or device == "cpu":
        return
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise CliError(f"--device {device!r} is not one tinyoss runs on: give cuda, cuda:N or cpu")
    if not _cuda_available():
        raise CliError(
            f"--device {device}: no CUDA GPU is usable here ({_why_no_cuda()}). Leave out "
            "--device or give --device cpu to run on the CPU (the built-in `tiny` model runs "
            "there; a full-size gpt-oss is very slow on a CPU)"
        )
    import torch

    count, index = torch.cuda.device_count(), int(device.partition(":")[2] or 0)
    if index >= count:
        raise CliError(f"--device {device}: this machine has {count} CUDA GPU(s), cuda:0 to "
                       f"cuda:{count - 1}")  # fmt: skip


def _why_no_cuda() -> str:
    import torch

    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.version.cuda is None:
        return "this PyTorch is a CPU-only build; install a CUDA build of torch"
    if hidden is not None and hidden.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU"
    return "PyTorch finds no NVIDIA GPU or driver"


class _ModelAction(argparse.Action):
    """`serve MODEL` and `serve --model MODEL` (vLLM's spelling) set the same thing; giving two
    different models is an error naming both, not a silent pick."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values is None:  # the positional MODEL, left out
            return
        this = option_string or "MODEL"
        given, where = getattr(namespace, self.dest, None), getattr(namespace, "model_from", None)
        if given is not None and given != values:
            parser.error(
                f"the model is given twice, as {where} {given!r} and as {this} {values!r}: "
                f"give MODEL or --model, once (or, if {values!r} is the value of the flag "
                "before it, that flag is not one tinyoss knows: see --help)"
            )
        setattr(namespace, self.dest, values)
        setattr(namespace, "model_from", this)


def _load(args: argparse.Namespace) -> LLM:
    """The LLM for chat and generate, after the checks that need no loading."""
    check_device(args.device)
    model = args.model or default_model()
    from tinyoss.engine.builder import check_config

    try:  # its refusals, and the model's config against it, before any loading
        check_config(EngineConfig(model=model, **engine_kwargs(args)))
    except ValueError as e:
        raise CliError(str(e)) from None
    except OSError as e:  # a folder without config.json, a cache that cannot be written
        raise CliError(_os_error(e)) from None
    if model == "tiny":
        print(TINY_NOTE, file=sys.stderr)
    from tinyoss import LLM

    try:
        return LLM(model, **engine_kwargs(args))
    except ValueError as e:  # a model that is not there, a cache too small for it, ...
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(_os_error(e)) from None


def _os_error(e: OSError) -> str:
    """An OSError as one line; one under the model cache says how to move the cache."""
    text = str(e) if e.filename is None else f"{e.strerror or e}: {e.filename}"
    cache = os.environ.get("TINYOSS_CACHE", str(Path.home() / ".cache" / "tinyoss"))
    if e.filename is not None and str(e.filename).startswith(cache):
        text += (f" (tinyoss keeps models and kernels in {cache}: set TINYOSS_CACHE to a "
                 "writable folder)")
    return text


def _params(args: argparse.Namespace, text: str, what: str) -> SamplingParams:
    """chat's and generate's sampling parameters and input, checked before anything loads."""
    from tinyoss.sampling_flags import sampling_params

    if not text:
        raise CliError(f"{what} is empty: give some text, e.g. 'Hello'")
    try:
        return sampling_params(args)
    except ValueError as e:
        raise CliError(str(e)) from None


def reply_text(reply: ChatOutput) -> str:
    """What `chat` prints of a `ChatOutput`: reasoning, tool calls, then the answer. A reply
    that formed no harmony message (tiny's random weights never write one) shows the raw
    generated text, marked as such, rather than an empty line."""
    from tinyoss.tokenizer import MESSAGE

    completion = reply.output.outputs[0]
    lines = [f"[reasoning] {reply.reasoning}\n"] if reply.reasoning else []
    lines += [f"[tool call] {call.name}({call.arguments})" for call in reply.tool_calls]
    if MESSAGE not in completion.token_ids or not (
        reply.content or reply.reasoning or reply.tool_calls
    ):
        lines.append(f"[raw output, no harmony message: {completion.text}]")
    elif reply.content or not reply.tool_calls:
        lines.append(reply.content or "")
    return "\n".join(lines)


def _chat(args: argparse.Namespace) -> None:
    message, what = _text(args.message, "MESSAGE", "chat")
    params = _params(args, message, what)
    llm = _load(args)
    try:
        reply = llm.chat(
            [{"role": "user", "content": message}],
            params,
            reasoning_effort=args.reasoning_effort,
        )[0]
    except ValueError as e:  # the input refused (too long for max_model_len, ...)
        raise CliError(str(e)) from None
    print(reply_text(reply))
    print(f"\n[finish: {reply.finish_reason}]", file=sys.stderr)


def _text(arg: str | None, name: str, command: str) -> tuple[str, str]:
    """generate's PROMPT or chat's MESSAGE, and what messages call it: the argument, or stdin's
    text, as Unix tools read theirs, when the argument is `-` or left out with stdin not a
    terminal (`echo hi | tinyoss generate`); one trailing newline, echo's, is dropped."""
    if arg is not None and arg != "-":
        return arg, name
    if sys.stdin is None or arg is None and sys.stdin.isatty():
        raise CliError(f"{name} is missing: give it as an argument, or pipe it in "
                       f"(echo 'Hello' | tinyoss {command})")  # fmt: skip
    data = sys.stdin.buffer.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CliError(f"stdin is not UTF-8 text (at byte {e.start}): pipe the prompt in as "
                       "UTF-8 (iconv -t UTF-8 converts it)") from None  # fmt: skip
    return re.sub(r"\r?\n\Z", "", text), f"{name} (read from stdin)"


def _generate(args: argparse.Namespace) -> None:
    prompt, what = _text(args.prompt, "PROMPT", "generate")
    params = _params(args, prompt, what)
    llm = _load(args)
    try:
        for out in llm.stream(prompt, params):
            print(out.outputs[0].delta_text, end="", flush=True)
    except ValueError as e:  # the input refused (too long for max_model_len, ...)
        raise CliError(str(e)) from None
    print()


def _make_checkpoint(args: argparse.Namespace) -> None:
    from tinyoss.tools.make_checkpoint import make_checkpoint

    out = make_checkpoint(
        args.preset, args.out, seed=args.seed, data=args.data, max_shard_bytes=args.max_shard_bytes
    )
    print(f"wrote {args.preset} checkpoint to {out}")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: cheap to build (no torch), so --help and errors are instant."""
    from tinyoss.model.presets import PRESETS
    from tinyoss.sampling_flags import add_sampling_args
    from tinyoss.server.cli import add_serve_args, serve
    from tinyoss.server.vllm_flags import ENGINE_FLAGS, add_vllm_args

    # no abbreviated flags: --max-n must never quietly mean --max-num-seqs
    parser = _Parser(
        prog="tinyoss",
        description="A lean inference engine for OpenAI's gpt-oss models.",
        epilog="`tinyoss COMMAND --help` lists a command's flags.",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"tinyoss {version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=summary,
            description=description,
            allow_abbrev=False,
            formatter_class=HelpFormatter,
        )

    serve_p = command(
        "serve",
        "OpenAI-compatible HTTP server (Chat Completions, Completions, Responses)",
        "Serve MODEL over the OpenAI API at http://HOST:PORT/v1 (docs/serve.md).",
    )
    serve_p.add_argument("model", nargs="?", default=None, action=_ModelAction,
                         metavar="MODEL", help=MODEL_HELP)  # fmt: skip
    serve_p.add_argument(
        "--model", dest="model", default=None, action=_ModelAction,
        help="the same as MODEL (vLLM's spelling); give one of the two",
    )  # fmt: skip
    add_engine_args(serve_p)
    add_serve_args(serve_p)
    serve_p.set_defaults(func=serve)

    for name, func, text_arg in (("chat", _chat, "message"), ("generate", _generate, "prompt")):
        what = "a chat reply (harmony: reasoning, then the answer)" if name == "chat" else (
            "a raw text completion, streamed")
        p = command(name, f"one {text_arg}, answered on stdout", f"Print {what} for one "
                    f"{text_arg}; the model loads in this process.")  # fmt: skip
        p.add_argument(text_arg, nargs="?", help=f"the {text_arg} text; - or none (with stdin "
                       "not a terminal) reads it from stdin")  # fmt: skip
        p.add_argument("--model", default=None, help=MODEL_HELP)
        add_sampling_args(p)
        if name == "chat":
            p.add_argument("--reasoning-effort", default="medium",
                           choices=("low", "medium", "high"),
                           help="how long gpt-oss reasons before it answers")  # fmt: skip
        add_engine_args(p)
        add_vllm_args(p, only=ENGINE_FLAGS)
        p.set_defaults(func=func)

    ckpt = command(
        "make-checkpoint",
        "write a synthetic checkpoint folder (random weights)",
        "Write a complete synthetic gpt-oss checkpoint folder in the Hugging Face layout:\n"
        "config, tokenizer and random weights of a preset (tests and benchmarks).",
    )
    ckpt.add_argument("preset", choices=tuple(PRESETS), type=lambda s: s.removeprefix("openai/"),
                      help="the model's shape")  # fmt: skip
    ckpt.add_argument("out", help="folder to write")
    ckpt.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ckpt.add_argument("--data", choices=("random", "sparse"), default="random",
                      help="sparse: real headers, the data left as holes in the files "
                      "(a full-size checkpoint costs no disk and no time)")  # fmt: skip
    ckpt.add_argument("--max-shard-bytes", type=int, default=SHARD_BYTES,
                      help="largest safetensors shard, in bytes")  # fmt: skip
    ckpt.set_defaults(func=_make_checkpoint)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        where = f"tinyoss {args.command}" if args.command else "tinyoss"
        hint = VLLM_HINT if args.command == "serve" else ""
        print(f"{where}: error: unrecognized arguments: {' '.join(unknown)}\n"
              f"(`{where} --help` lists the flags{hint})", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    if args.command is None:
        parser.print_help()
        print(f"\n{NO_COMMAND}", file=sys.stderr)
        raise SystemExit(2)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for note in getattr(args, "vllm_notes", None) or []:
        log.info("%s", note)
    try:
        args.func(args)
        # The interpreter's exit garbage-collects every object left, torch's hundreds of
        # thousands included: 1.3 s of CPU after the command was done. Frozen, they are only
        # freed (or left to the OS); the atexit handlers (logging, the engine core's) still run.
        gc.freeze()
    except CliError as e:
        print(f"tinyoss {args.command}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # Ctrl-C while loading or generating: no torch traceback
        print(f"tinyoss {args.command}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:  # `tinyoss generate ... | head`: the reader left, so stop quietly,
        # as `yes | head` does; stdout goes to /dev/null first, or Python's flush at exit
        # would raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141) from None  # 128 + SIGPIPE: what a shell reports for `yes`


if __name__ == "__main__":
    # `python -m tinyoss.cli`: this file runs as __main__, a module apart from the tinyoss.cli
    # that the subcommands import, so its CliError would not catch theirs: run that one's main
    from tinyoss.cli import main as _main

    _main()
