"""The `tinyoss` command line itself: help and defaults on every flag, --version, `python -m
tinyoss`, no command, `serve --model`, make-checkpoint's own flags. Parsing only: nothing
here loads a model."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import tinyoss
from tinyoss import cli

REPO = Path(__file__).resolve().parents[1]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flat(text: str) -> str:
    """Help text with argparse's line wrapping undone."""
    return " ".join(text.split())


def _help(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """What `tinyoss ARGV` prints on stdout, exiting 0 (--help, --version)."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_every_flag_has_help_and_shows_its_default():
    parser = cli.build_parser()
    commands = _subparsers(parser)
    assert set(commands) == {"serve", "chat", "generate", "make-checkpoint"}
    checked = 0
    for name, sub in commands.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            where = f"tinyoss {name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help and action.help != argparse.SUPPRESS, f"{where} has no help"
            shown = formatter._expand_help(action)
            assert shown.count("(default") <= 1, f"{where}: {shown!r}"
            default = action.default
            off = default is None or default is False or default == argparse.SUPPRESS
            if action.option_strings and not off:  # (0 and 0.0 are shown: `is`, not `in`)
                assert f"(default: {default})" in shown, f"{where}: {shown!r}"
            checked += 1
    assert checked > 80  # serve alone has the engine, server, limit and vLLM flags


def test_defaults_in_the_help_output(capsys):
    serve = _flat(_help(capsys, ["serve", "--help"]))
    assert ("--port PORT port to listen on (0: any free one, which the log names) (default: "
            "8000)") in serve
    assert "--host HOST address to bind (0.0.0.0: all) (default: 127.0.0.1)" in serve
    assert "--max-num-seqs MAX_NUM_SEQS most sequences in one batch (default: 256)" in serve
    assert serve.count("(default: 256)") == 1  # shown once, not twice
    assert "env TINYOSS_API_KEY, else env VLLM_API_KEY" in serve
    chat = _flat(_help(capsys, ["chat", "--help"]))
    assert "--max-tokens MAX_TOKENS most tokens to generate (default: 256)" in chat
    assert "--temperature TEMPERATURE sampling temperature; 0 = greedy (default: 1.0)" in chat
    assert "(default: medium)" in chat
    assert "(default: None)" not in serve + chat


def test_make_checkpoint_help_is_its_own(capsys):
    text = _flat(_help(capsys, ["make-checkpoint", "--help"]))
    assert text.startswith("usage: tinyoss make-checkpoint")
    assert "rest" not in text.split()  # the old pass-through argument
    assert "{tiny,gpt-oss-20b,gpt-oss-120b}" in text
    assert "--max-shard-bytes MAX_SHARD_BYTES largest safetensors shard, in bytes " \
        "(default: 4800000000)" in text
    assert "--data {random,sparse}" in text and "(default: random)" in text


def test_the_tool_module_is_the_cli_command(capsys):
    """`python -m tinyoss.tools.make_checkpoint` runs `tinyoss make-checkpoint` (one parser), and
    the CLI's shard default (kept in cli.py: the tool's module imports torch) is the tool's."""
    from tinyoss.tools import make_checkpoint as tool

    with pytest.raises(SystemExit):
        tool.main(["--help"])
    via_tool = capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["make-checkpoint", "--help"])
    assert via_tool == capsys.readouterr().out and "--max-shard-bytes" in via_tool
    assert cli.SHARD_BYTES == tool.SHARD_BYTES


def test_make_checkpoint_runs(tmp_path, capsys):
    out = tmp_path / "ckpt"
    cli.main(["make-checkpoint", "openai/gpt-oss-20b", str(out), "--data", "sparse"])
    assert (out / "config.json").is_file()
    assert (out / "model.safetensors.index.json").is_file()  # the 20b's shards
    assert f"wrote gpt-oss-20b checkpoint to {out}" in capsys.readouterr().out


def test_version_in_process(capsys):
    text = _help(capsys, ["--version"])
    assert text.strip() == f"tinyoss {metadata.version('tinyoss')}"


def test_version_falls_back_to_the_package(monkeypatch):
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert cli.version() == tinyoss.__version__


def test_python_dash_m_tinyoss():
    """`python -m tinyoss` is `tinyoss` (tinyoss/__main__.py)."""
    run = subprocess.run(
        [sys.executable, "-m", "tinyoss", "--version"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"tinyoss {cli.version()}"


def test_no_command_prints_help_and_a_hint(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out.startswith("usage: tinyoss")
    for command in ("serve", "chat", "generate", "make-checkpoint"):
        assert command in out
    assert "give a command" in err and "tinyoss serve" in err
    assert "the following arguments are required" not in out + err


def test_errors_are_short_and_point_to_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--max-num-seqs", "many"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert ("tinyoss serve: error: argument --max-num-seqs: invalid integer 'many': give one "
            "such as 32768, 32k (32,000) or 32K (32,768)") in err
    assert "`tinyoss serve --help` lists the flags" in err
    assert "usage:" not in err  # not serve's fifty lines of usage


def test_vllm_spellings_of_values():
    """vLLM's `--max-model-len 32k` (32,000), `32K` (32,768) and `--dtype half` mean what they
    mean there; a fraction of a token is refused."""
    parse = cli.build_parser().parse_known_args
    args, _ = parse(["serve", "tiny", "--max-model-len", "32k", "--max-num-batched-tokens", "8K",
                     "--dtype", "half"])
    assert (args.max_model_len, args.max_num_batched_tokens, args.dtype) == (32000, 8192,
                                                                             "float16")
    assert parse(["serve", "--dtype", "float", "--max-model-len", "1.5k"])[0].dtype == "float32"
    assert cli.human_int("25.6k") == 25600 and cli.human_int("2M") == 2 * 2**20
    for bad in ("1.5K", "3.3", "x1k", ""):
        with pytest.raises(Exception, match="invalid integer"):
            cli.human_int(bad)


def test_unknown_flag_names_it_and_the_vllm_table(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "tiny", "--no-such-flag", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "tinyoss serve: error: unrecognized arguments: --no-such-flag 3" in err
    assert "Coming from vLLM" in err


def test_serve_model_flag():
    parser = cli.build_parser()
    assert parser.parse_args(["serve", "--model", "tiny"]).model == "tiny"
    assert parser.parse_args(["serve", "tiny"]).model == "tiny"
    assert parser.parse_args(["serve", "tiny", "--model", "tiny"]).model == "tiny"
    assert parser.parse_args(["serve", "--model=tiny", "tiny", "--port", "9"]).model == "tiny"
    assert parser.parse_args(["serve"]).model is None


@pytest.mark.parametrize(
    "argv, first, second",
    [
        (["serve", "a", "--model", "b"], "MODEL 'a'", "--model 'b'"),
        (["serve", "--model", "b", "a"], "--model 'b'", "MODEL 'a'"),
    ],
)
def test_serve_model_given_twice_differently(argv, first, second, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"the model is given twice, as {first} and as {second}" in err
    # an unknown flag's value lands in MODEL: the message says that may be the cause
    assert "is the value of the flag before it, that flag is not one tinyoss knows" in err


def test_subcommand_help_describes_the_command(capsys):
    serve = _flat(_help(capsys, ["serve", "--help"]))
    assert "Serve MODEL over the OpenAI API" in serve
    chat = _flat(_help(capsys, ["chat", "--help"]))
    assert "Print a chat reply" in chat and "message the message text" in chat
    generate = _flat(_help(capsys, ["generate", "--help"]))
    assert "raw text completion" in generate and "prompt the prompt text" in generate
