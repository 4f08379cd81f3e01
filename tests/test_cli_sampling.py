"""`tinyoss generate` and `chat`'s sampling flags (--top-p, --top-k, --min-p,
--repetition-penalty, --stop, --seed) and generate's prompt from stdin: what reaches the
engine, the refusals in the API's words naming the flag, and end to end on `tiny`."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tinyoss import cli
from tinyoss.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
FLAGS = ["--top-p", "0.9", "--top-k", "40", "--min-p", "0.05", "--repetition-penalty", "1.1",
         "--presence-penalty", "0.5", "--frequency-penalty", "-0.25",
         "--stop", "\n\n", "--stop", "END", "--seed", "7", "--max-tokens", "1k"]  # fmt: skip


class FakeLLM:
    """What `_load` returns in these tests: records the prompt and params it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, SamplingParams]] = []

    def stream(self, prompt: str, params: SamplingParams):
        self.calls.append((prompt, params))
        yield SimpleNamespace(outputs=[SimpleNamespace(delta_text="ok")])

    def chat(self, messages: list[dict], params: SamplingParams, reasoning_effort: str):
        self.calls.append((messages, params))
        out = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], text="ok")])
        return [SimpleNamespace(reasoning=None, content=None, tool_calls=[], output=out,
                                finish_reason="stop")]  # fmt: skip


@pytest.fixture
def llm(monkeypatch) -> FakeLLM:
    fake = FakeLLM()
    monkeypatch.setattr(cli, "_load", lambda args: fake)
    return fake


def piped(monkeypatch, data: bytes, tty: bool = False) -> None:
    """stdin as a pipe (or a terminal) holding `data`."""
    stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
    stdin.isatty = lambda: tty  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stdin", stdin)


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat", "hi"]])
def test_the_flags_reach_the_sampling_params(command, llm, capsys):
    cli.main([*command, *FLAGS])
    (_, params), = llm.calls
    assert (params.top_p, params.top_k, params.min_p) == (0.9, 40, 0.05)
    assert params.repetition_penalty == 1.1 and params.stop == ["\n\n", "END"]
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.25)
    assert (params.seed, params.max_tokens) == (7, 1000)


def test_the_defaults_change_nothing(llm, capsys):
    """Left out, the flags are SamplingParams' own neutral values (and max_tokens 256)."""
    cli.main(["generate", "hi"])
    (_, params), = llm.calls
    neutral = SamplingParams(max_tokens=256, seed=0)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop",
                 "max_tokens", "seed", "presence_penalty", "frequency_penalty"):  # fmt: skip
        assert getattr(params, name) == getattr(neutral, name), name


@pytest.mark.parametrize("flag, value, says", [
    ("--top-p", "1.5", "--top-p: top_p=1.5 is invalid: must be a number in [0, 1]"),
    ("--top-k", "-2", "--top-k: top_k=-2 is invalid: must be an int >= -1 (0 or -1 = off)"),
    ("--min-p", "nan", "--min-p: min_p=nan is invalid: must be a number in [0, 1]"),
    ("--repetition-penalty", "0",
     "--repetition-penalty: repetition_penalty=0.0 is invalid: must be a finite number > 0"),
    ("--stop", "", "--stop: stop=[''] is invalid: must be a non-empty string or a list of them"),
    ("--presence-penalty", "2.5",
     "--presence-penalty: presence_penalty=2.5 is invalid: must be a number in [-2, 2]"),
    ("--seed", str(2**63), f"--seed: seed={2**63} is invalid: must be an int in "
     f"[{-(2**63)}, {2**63 - 1}]"),
])  # fmt: skip
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_bad_value_names_the_flag_and_its_range(command, flag, value, says, capsys,
                                                   monkeypatch):
    """Exit 2, one line, before anything loads; the server's message after the flag."""
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("it loaded"))
    with pytest.raises(SystemExit) as e:
        cli.main([command, "hi", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[0] == f"tinyoss {command}: error: {says}"


@pytest.mark.parametrize("field, value", [("top_p", 1.5), ("stop", [""]), ("top_k", -5)])
def test_the_messages_are_the_servers(field, value):
    """The CLI's refusal is the API's 400 message with the flag in front."""
    from tinyoss.sampling_flags import sampling_params
    from tinyoss.server.protocol import APIError, _sampling

    with pytest.raises(APIError) as api:
        _sampling({}, vocab_size=100, **{field: value})
    args = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                           repetition_penalty=1.0, stop=None, max_tokens=16,
                           presence_penalty=0.0, frequency_penalty=0.0)  # fmt: skip
    setattr(args, field, value)
    with pytest.raises(ValueError) as cli_error:
        sampling_params(args)  # type: ignore[arg-type]
    flag = "--" + field.replace("_", "-")
    assert str(cli_error.value) == f"{flag}: {api.value.message}"


def test_a_seed_past_2_53_is_kept_exactly(llm, capsys):
    """--seed went through a float, so 2**53 + 1 became 2**53: another request's seed."""
    cli.main(["generate", "hi", "--seed", str(2**53 + 1)])
    assert llm.calls[0][1].seed == 2**53 + 1


@pytest.mark.parametrize("argv, data, prompt", [
    (["generate"], b"The capital of France is\n", "The capital of France is"),
    (["generate", "-"], b"line one\nline two\r\n", "line one\nline two"),
    (["generate", "-"], b"two newlines\n\n", "two newlines\n"),  # only echo's is dropped
    (["generate"], "caf\u00e9 \U0001f99c".encode(), "caf\u00e9 \U0001f99c"),
])  # fmt: skip
def test_generate_reads_its_prompt_from_stdin(argv, data, prompt, llm, capsys, monkeypatch):
    piped(monkeypatch, data)
    cli.main(argv)
    assert llm.calls[0][0] == prompt
    assert capsys.readouterr().out == "ok\n"


def test_chat_reads_its_message_from_stdin(llm, capsys, monkeypatch):
    piped(monkeypatch, b"What is 2 + 2?\n")
    cli.main(["chat"])
    assert llm.calls[0][0] == [{"role": "user", "content": "What is 2 + 2?"}]


def test_a_prompt_argument_wins_over_stdin(llm, capsys, monkeypatch):
    piped(monkeypatch, b"from stdin")
    cli.main(["generate", "from the argument"])
    assert llm.calls[0][0] == "from the argument"


@pytest.mark.parametrize("argv, data, tty, says", [
    (["generate"], b"", True, "PROMPT is missing: give it as an argument, or pipe it in"),
    (["generate"], b"", False, "PROMPT (read from stdin) is empty: give some text"),
    (["generate", "-"], b"\n", False, "PROMPT (read from stdin) is empty"),
    (["generate", "-"], b"ok \xff", False, "stdin is not UTF-8 text (at byte 3)"),
    (["chat"], b"", True, "MESSAGE is missing: give it as an argument, or pipe it in "
     "(echo 'Hello' | tinyoss chat)"),
    (["chat", "-"], b"", False, "MESSAGE (read from stdin) is empty"),
])  # fmt: skip
def test_stdin_refusals(argv, data, tty, says, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("it loaded"))
    piped(monkeypatch, data, tty)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"tinyoss {argv[0]}: error: {says}" in err, err


def test_on_tiny_top_k_1_is_greedy_and_stop_cuts_the_text(capsys):
    """End to end: greedy text, then the same prompt piped in with --top-k 1 (greedy at
    temperature 1) and a stop string from that text: the text up to the stop string."""
    prompt, common = "The capital of France is", ["--model", "tiny", "--kv-cache-tokens", "1024",
                                                  "--max-tokens", "12"]  # fmt: skip
    cli.main(["generate", prompt, "--temperature", "0", *common])
    greedy = capsys.readouterr().out.removesuffix("\n")
    stop = greedy[len(greedy) // 2 :][:3]
    assert len(greedy) > 6 and stop.strip(), greedy
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    run = subprocess.run(
        [sys.executable, "-m", "tinyoss", "generate", "--top-k", "1", "--stop", stop, *common],
        input=(prompt + "\n").encode(), cwd=REPO, env=env, capture_output=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert run.stdout.decode().removesuffix("\n") == greedy[: greedy.index(stop)]
