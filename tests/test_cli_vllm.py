"""vLLM habits on `tinyoss serve`: its flags accepted where they change nothing (with a log
line), refused with a clear message where they would change results; the API key from
VLLM_API_KEY; docs/serve.md's "Coming from vLLM" table agreeing with the code's."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

import pytest

from tinyoss import cli
from tinyoss.server import cli as server_cli
from tinyoss.server.vllm_flags import ANY, VLLM_FLAGS, describe

REPO = Path(__file__).resolve().parents[1]


def _parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser().parse_args(["serve", "tiny", *argv])


def _refused(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as e:
        _parse(argv)
    assert e.value.code == 2
    return " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize(
    "argv",
    [
        ["--tool-call-parser", "openai"],
        ["--enable-auto-tool-choice"],
        ["--reasoning-parser", "openai_gptoss"],
        ["--reasoning-parser", "GptOss"],
        ["--reasoning-parser=gpt_oss"],
        ["--trust-remote-code"],
        ["--disable-log-requests"],
        ["--disable-log-stats"],
        ["--enable-chunked-prefill"],
        ["--quantization", "mxfp4"],
        ["--kv-cache-dtype", "auto"],
        ["--swap-space", "4"],
        ["--task", "generate"],
        ["--runner", "auto"],
        ["--stream-interval", "20"],
        ["--max-cudagraph-capture-size", "2048"],
        ["--enable-log-outputs"],
    ],
)
def test_harmless_vllm_flags_are_accepted_and_noted(argv):
    args = _parse(argv)
    assert len(args.vllm_notes) == 1
    note = args.vllm_notes[0]
    assert note.startswith(argv[0].split("=")[0]) and "changes nothing" in note
    assert args.model == "tiny" and args.port == 8000  # the rest parses as before


def test_the_parser_flags_say_harmony():
    args = _parse(["--tool-call-parser", "openai", "--enable-auto-tool-choice",
                   "--reasoning-parser", "openai_gptoss"])  # fmt: skip
    assert len(args.vllm_notes) == 3
    assert all("always parses gpt-oss's harmony format" in n for n in args.vllm_notes)
    assert "vllm_notes" in vars(_parse([])) and _parse([]).vllm_notes == []


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--pipeline-parallel-size", "2"], ["--pipeline-parallel-size 2",
                                             "tensor parallelism only", "only 1"]),
        (["--quantization", "fp8"], ["--quantization fp8", "only mxfp4", "--mxfp4-layers"]),
        (["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype fp8", "fp8 KV cache is not supported"]),
        (["--tool-call-parser", "hermes"], ["--tool-call-parser hermes", "only openai"]),
        (["--reasoning-parser", "deepseek_r1"], ["--reasoning-parser deepseek_r1",
                                                 "openai_gptoss or GptOss or gpt_oss"]),
        (["--chat-template", "t.jinja"], ["--chat-template t.jinja", "harmony"]),
        (["--download-dir", "/data"], ["--download-dir /data", "HF_HUB_CACHE"]),
        (["--max-logprobs", "50"], ["--max-logprobs 50", "at most 20"]),
        (["--task", "embed"], ["--task embed", "only auto or generate", "text generation"]),
        (["--tool-server", "demo"], ["--tool-server demo", "function tools"]),
        (["--config", "GPT-OSS_Hopper.yaml"], ["--config GPT-OSS_Hopper.yaml", "command line"]),
    ],
)
def test_vllm_flags_that_would_change_results_are_refused(argv, names, capsys):
    err = _refused(argv, capsys)
    assert "tinyoss serve: error:" in err and "this vLLM flag is not supported by tinyoss" in err
    for name in names:
        assert name in err
    assert "unrecognized arguments" not in err


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat", "hi"]])
@pytest.mark.parametrize("flag", ["-pp", "--pipeline-parallel-size"])
def test_generate_and_chat_explain_pipeline_parallelism_as_serve_does(command, flag, capsys):
    """Not argparse's "unrecognized arguments": serve's refusal, word for word, before any
    load; 1 is accepted with serve's note."""
    want = _refused(["--pipeline-parallel-size", "2"], capsys).split("error: ", 1)[1]
    want = want.replace("--pipeline-parallel-size 2", f"{flag} 2").replace("serve", command[0])
    with pytest.raises(SystemExit) as e:
        cli.main([*command, flag, "2"])
    assert e.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err == f"tinyoss {command[0]}: error: {want}", err
    assert "tensor parallelism only (--tensor-parallel-size)" in err
    notes = cli.build_parser().parse_args([*command, flag, "1"]).vllm_notes
    assert len(notes) == 1 and notes[0].startswith(f"{flag} 1: a vLLM flag that changes nothing")


def test_notes_are_logged_once_each(monkeypatch, caplog):
    """main logs one line per accepted vLLM flag, before serving (here: a stand-in)."""
    served: list[argparse.Namespace] = []
    monkeypatch.setattr(server_cli, "serve", served.append)
    with caplog.at_level(logging.INFO, logger="tinyoss"):
        cli.main(["serve", "tiny", "--tool-call-parser", "openai", "--trust-remote-code"])
    assert len(served) == 1
    lines = [r.getMessage() for r in caplog.records if "a vLLM flag" in r.getMessage()]
    assert len(lines) == 2
    assert lines[0].startswith("--tool-call-parser openai: a vLLM flag that changes nothing")
    assert "harmony" in lines[0]
    assert lines[1].startswith("--trust-remote-code: a vLLM flag that changes nothing")


def test_api_key_from_flag_then_tinyoss_env_then_vllm_env(monkeypatch):
    monkeypatch.delenv("TINYOSS_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert server_cli.api_key(argparse.Namespace(api_key=None)) == (None, "none given")
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert server_cli.api_key(argparse.Namespace(api_key=None)) == ("v", "env VLLM_API_KEY")
    monkeypatch.setenv("TINYOSS_API_KEY", "t")
    assert server_cli.api_key(argparse.Namespace(api_key=None)) == ("t", "env TINYOSS_API_KEY")
    assert server_cli.api_key(argparse.Namespace(api_key="f")) == ("f", "--api-key")


def test_tensor_parallel_size_is_an_engine_flag():
    assert _parse([]).tensor_parallel_size == 1
    assert _parse(["-tp", "2"]).tensor_parallel_size == 2
    assert _parse(["--tensor-parallel-size", "4"]).tensor_parallel_size == 4


def test_prefix_caching_flags_exist():
    assert _parse([]).enable_prefix_caching is True
    assert _parse(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert _parse(["--enable-prefix-caching"]).enable_prefix_caching is True


def _doc_rows() -> dict[str, str]:
    """docs/serve.md's "Coming from vLLM" table: first flag name -> its cell, backticks off."""
    text = (REPO / "docs/serve.md").read_text()
    section = text.split("### Coming from vLLM", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`-"):
            names = re.findall(r"`(-[\w-]+)`", cells[0])
            rows[", ".join(names)] = cells[1].replace("`", "")
    return rows


def test_docs_table_matches_the_code_table():
    rows = _doc_rows()
    code = {", ".join(f.names): describe(f) for f in VLLM_FLAGS}
    assert len(code) >= 15
    assert rows == code


def test_table_is_consistent():
    names = [n for f in VLLM_FLAGS for n in f.names]
    assert len(names) == len(set(names))
    for f in VLLM_FLAGS:
        assert f.says and f.names[0].startswith("--")
        if not f.takes_value:
            assert f.harmless in (ANY, ()), f"switch {f.names[0]}: accepted or refused"
    # the ones that would silently change results are never accepted as they are asked for
    by_name = {f.names[0]: f for f in VLLM_FLAGS}
    assert not by_name["--quantization"].accepts("fp8")
    assert not by_name["--kv-cache-dtype"].accepts("fp8_e4m3")
    assert not by_name["--pipeline-parallel-size"].accepts("2")
    # no table flag shadows a tinyoss flag
    serve = next(a for a in cli.build_parser()._actions
                 if isinstance(a, argparse._SubParsersAction)).choices["serve"]  # fmt: skip
    own = {s for a in serve._actions if a.dest and not a.dest.startswith("vllm_")
           for s in a.option_strings}  # fmt: skip
    assert not own & set(names)


def test_request_log_flags_are_tinyoss_own(monkeypatch):
    """--enable-log-requests and --max-log-len do something now (tests/test_server_request_log.py):
    no "changes nothing" note; a negative length stops serve, naming the flag."""
    args = _parse(["--enable-log-requests", "--max-log-len", "100"])
    assert (args.enable_log_requests, args.max_log_len, args.vllm_notes) == (True, 100, [])
    assert (_parse([]).enable_log_requests, _parse([]).max_log_len) == (False, None)
    with pytest.raises(cli.CliError, match=r"--max-log-len -1 is invalid: give a number of "
                                           r"characters >= 0"):
        server_cli.serve(_parse(["--port", "0", "--max-log-len", "-1"]))
