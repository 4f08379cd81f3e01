"""Fail fast, before anything heavy loads: a port in use, --device cuda without a GPU, the GPU
benchmark without a GPU; and `tinyoss chat` on `tiny` showing what it generated."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tinyoss import cli
from tinyoss.server import cli as server_cli
from tinyoss.tokenizer import MESSAGE

REPO = Path(__file__).resolve().parents[1]


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("module", ["tinyoss", "tinyoss.cli"])
def test_serve_on_a_port_in_use_stops_at_once(module):
    """The real command, as a user runs it: exit 2 naming the port, before the model loads.
    `python -m tinyoss.cli` too: run as __main__, cli.py is a second module beside the
    `tinyoss.cli` the server imports, whose CliError its main() did not catch (a traceback,
    exit 1)."""
    with _listening() as busy:
        port = busy.getsockname()[1]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        t0 = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", module, "serve", "tiny", "--port", str(port)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        took = time.monotonic() - t0
    assert run.returncode == 2, run.stderr
    assert f"tinyoss serve: error: port {port} on 127.0.0.1 is already in use" in run.stderr
    assert re.search(r"pick a free port with --port, e\.g\. --port \d+", run.stderr)
    assert "Traceback" not in run.stderr and "loaded" not in run.stderr
    assert took < 15, f"took {took:.1f} s: something loaded before the check"


def test_the_port_in_use_message_suggests_a_port_that_is_free():
    """The suggested port is one that binds now (it had been the next one, often taken too)."""
    import errno

    from tinyoss.server.cli import _bind_error

    with _listening() as busy:
        port = busy.getsockname()[1]
        with contextlib.ExitStack() as taken:
            with contextlib.suppress(OSError):  # (the next port may be another's already)
                taken.enter_context(socket.create_server(("127.0.0.1", port + 1)))
            message = _bind_error("127.0.0.1", port, OSError(errno.EADDRINUSE, "in use"))
        suggested = int(re.search(r"--port (\d+)$", message)[1])
    assert suggested not in (port, port + 1)
    socket.create_server(("127.0.0.1", suggested)).close()


def test_serve_of_a_model_that_is_not_there_says_so_in_one_line(tmp_path):
    with _listening() as s:
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "tinyoss", "serve", str(tmp_path / "nothing"), "--port",
         str(port)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert "tinyoss serve: the engine could not run: model " in run.stderr
    assert "is neither a checkpoint folder nor a hub id" in run.stderr
    assert "Traceback" not in run.stderr, run.stderr


def test_check_port_leaves_a_free_port_free():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server_cli.check_port("127.0.0.1", port)  # no error
    with socket.socket() as again:  # nothing was kept bound
        again.bind(("127.0.0.1", port))
        again.listen()


@pytest.mark.parametrize(
    "host, port, says",
    [
        ("127.0.0.1", 70000, r"--port 70000 is not a port: give one from 1 to 65535 \(or 0"),
        ("192.0.2.1", 0, "--host 192.0.2.1 is not an address of this machine"),
    ],
)
def test_check_port_names_the_problem(host, port, says):
    with pytest.raises(cli.CliError, match=says):
        server_cli.check_port(host, port)


def test_check_port_unknown_host(monkeypatch):
    def unknown(*args, **kwargs):  # no DNS lookup in a test
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    with pytest.raises(cli.CliError, match="--host nowhere: not an address this machine can"):
        server_cli.check_port("nowhere", 8000)


def test_serve_port_check_comes_first(capsys, monkeypatch):
    """In process: serve stops on the busy port before it checks the device or imports the
    app (neither is reached)."""
    monkeypatch.setattr(cli, "check_device", lambda device: pytest.fail("device checked"))
    with _listening() as busy:
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            cli.main(["serve", "tiny", "--port", str(port)])
    assert e.value.code == 2
    assert f"port {port} on 127.0.0.1 is already in use" in capsys.readouterr().err


def test_uvicorn_log_flags_reach_uvicorn(monkeypatch):
    """vLLM's --uvicorn-log-level and --disable-uvicorn-access-log set uvicorn's (they were a
    no-op and a refusal: health probes logged a line each, whatever was asked)."""
    import uvicorn

    import tinyoss.server.app as app_module

    seen = []

    class Server:
        def __init__(self, config):
            seen.append(config)

        def run(self):
            pass

    monkeypatch.setattr(uvicorn, "Server", Server)
    app = SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace()))  # no model loads
    monkeypatch.setattr(app_module, "create_app", lambda *a, **k: app)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli.main(["serve", "tiny", "--port", str(port), "--uvicorn-log-level", "warning",
              "--disable-uvicorn-access-log"])
    cli.main(["serve", "tiny", "--port", str(port)])
    assert [(c.log_level, c.access_log) for c in seen] == [("warning", False), ("info", True)]


@pytest.mark.parametrize("command", [["serve", "tiny"], ["chat", "hi"], ["generate", "hi"]])
def test_device_cuda_without_a_gpu(command, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_cuda_available", lambda: False)
    monkeypatch.setattr(cli, "default_model", lambda: pytest.fail("went on to pick a model"))
    with socket.socket() as s:  # a free port, for serve
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    argv = [*command, "--device", "cuda"] + (["--port", port] if command[0] == "serve" else [])
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"tinyoss {command[0]}: error: --device cuda: no CUDA GPU is usable here" in err
    assert "--device cpu" in err and "Traceback" not in err


def test_device_checks():
    cli.check_device(None)
    cli.check_device("cpu")
    with pytest.raises(cli.CliError, match="'gpu' is not one tinyoss runs on: give cuda"):
        cli.check_device("gpu")


def test_invalid_engine_option_is_a_cli_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--model", "tiny", "--max-num-seqs", "0"])
    assert e.value.code == 2
    assert "tinyoss generate: error: invalid max_num_seqs: 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens: max_tokens=0 is invalid"),
    (["chat", "hi", "--temperature", "-1"], "--temperature: temperature=-1.0 is invalid"),
    (["generate", ""], "PROMPT is empty"),
    (["chat", ""], "MESSAGE is empty"),
])
def test_bad_sampling_or_input_stops_before_loading(argv, says, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("it loaded"))
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert f"tinyoss {argv[0]}: error: {says}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--model", "no-such-model"], "model 'no-such-model' is neither a checkpoint folder"),
    (["--model", "tiny", "--kv-cache-tokens", "10"], "too few to run anything"),
    (["--model", "tiny", "--max-model-len", "2"],
     "max_model_len 2 is shorter than one KV cache block (16 tokens)"),
    (["--model", "tiny", "--kv-cache-tokens", "1024", "--max-model-len", "64"],
     "max_model_len is 64"),  # the prompt refused at submission
])
def test_model_and_engine_refusals_are_one_line(argv, says, capsys):
    """What only loading finds (a model that is not there, a KV cache too small, a prompt too
    long for max_model_len): exit 2 with the message, no traceback."""
    prompt = "hi " * 100
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", prompt, "--max-tokens", "2", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "tinyoss generate: error: " in err and says in err and "Traceback" not in err


def test_decode_latency_needs_a_gpu(monkeypatch):
    from bench import decode_latency

    monkeypatch.setattr(decode_latency.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(decode_latency, "run", lambda args: pytest.fail("it ran"))
    monkeypatch.setattr(sys, "argv", ["decode_latency.py"])
    with pytest.raises(SystemExit) as e:
        decode_latency.main()
    assert "GPU benchmark" in str(e.value.code) and "needs a CUDA GPU" in str(e.value.code)
    assert "tinyoss generate 'Hello' --model tiny" in str(e.value.code)


def _reply(token_ids, text, reasoning=None, content=None, tool_calls=()):
    completion = SimpleNamespace(token_ids=list(token_ids), text=text)
    return SimpleNamespace(reasoning=reasoning, content=content, tool_calls=list(tool_calls),
                           output=SimpleNamespace(outputs=[completion]))  # fmt: skip


def test_reply_text():
    # no harmony message: the raw text, marked (whether or not the parser kept it as content)
    assert cli.reply_text(_reply([1, 2], " foo bar")) == (
        "[raw output, no harmony message:  foo bar]"
    )
    assert cli.reply_text(_reply([1, 2], "foo", content="foo")) == (
        "[raw output, no harmony message: foo]"
    )
    # a harmony reply: reasoning, then the answer
    assert cli.reply_text(_reply([5, MESSAGE, 6], "x", content="Hello")) == "Hello"
    assert cli.reply_text(_reply([MESSAGE], "x", reasoning="think", content="Hi")) == (
        "[reasoning] think\n\nHi"
    )
    # a message formed but nothing parsed out of it: still the raw text, not an empty line
    assert cli.reply_text(_reply([MESSAGE, 7], "<|message|>?")) == (
        "[raw output, no harmony message: <|message|>?]"
    )
    call = SimpleNamespace(name="get_weather", arguments='{"city": "Paris"}')
    assert cli.reply_text(_reply([MESSAGE], "x", tool_calls=[call])) == (
        '[tool call] get_weather({"city": "Paris"})'
    )


def test_chat_on_tiny_shows_its_raw_output(capsys):
    """End to end on `tiny` (random weights: no harmony headers): a note that its text is
    gibberish, then the generated text, marked, instead of an empty line."""
    cli.main(["chat", "Hello", "--model", "tiny", "--max-tokens", "6", "--temperature", "0",
              "--kv-cache-tokens", "1024"])  # fmt: skip
    out, err = capsys.readouterr()
    assert cli.TINY_NOTE in err
    assert out.startswith("[raw output, no harmony message: ")
    raw = out.strip().removeprefix("[raw output, no harmony message: ").removesuffix("]")
    assert raw.strip(), out
    assert "[finish: " in err


@pytest.mark.parametrize("flags, says", [
    (["-tp", "3"], "tensor_parallel_size 3 must divide the model's 2 KV heads"),
    (["--max-model-len", "10000000"], "exceeds the model's max_position_embeddings"),
    (["--max-model-len", "2"], "shorter than one KV cache block"),
    (["--watchdog-timeout", "0.5"], "--watchdog-timeout=0.5 is invalid: must be at least 2 s"),
    (["--watchdog-timeout", "0"], "--watchdog-timeout=0.0 is invalid: must be > 0"),
])
def test_serve_refuses_a_config_the_engine_would_before_it_listens(flags, says, capsys,
                                                                   monkeypatch):
    """Found by a new-user trial: these started the server, then exited 1 once the engine
    core refused them. Now exit 2 at once, the app never made."""
    import tinyoss.server.app as app

    monkeypatch.setattr(app, "create_app", lambda *a, **k: pytest.fail("the app was made"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "tiny", "--device", "cpu", "--port", port, *flags])
    assert e.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat", "hi"]])
def test_generate_and_chat_check_the_config_before_loading(command, capsys, monkeypatch):
    """`tinyoss generate --max-model-len 2` loaded the model before refusing it (trial)."""
    import tinyoss

    monkeypatch.setattr(tinyoss, "LLM", lambda *a, **k: pytest.fail("the model was loaded"),
                        raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main([*command, "--device", "cpu", "--max-model-len", "2"])
    assert e.value.code == 2
    assert "shorter than one KV cache block" in capsys.readouterr().err


def test_os_errors_and_ctrl_c_are_one_line(tmp_path, capsys, monkeypatch):
    """A folder without config.json and a model cache that cannot be written are one-line
    errors with status 2 (they were tracebacks with status 1), the cache's naming
    TINYOSS_CACHE; Ctrl-C while generating is "interrupted" with status 130, no traceback."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--model", str(tmp_path / "empty")])
    assert e.value.code == 2
    assert "error: " in (err := capsys.readouterr().err) and "config.json not found" in err
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("TINYOSS_CACHE", str(tmp_path / "afile" / "sub"))
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "set TINYOSS_CACHE to a writable folder" in err, err

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_load", lambda args: SimpleNamespace(
        generate=lambda *a, **k: interrupted(None), stream=lambda *a, **k: interrupted(None)))
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 130 and "tinyoss generate: interrupted" in err


def test_output_piped_into_a_reader_that_leaves_ends_quietly():
    """`tinyoss generate ... | head -c 5`: once the reader has gone, the command stops with
    status 141 (128 + SIGPIPE, as `yes | head` does) and no BrokenPipeError traceback."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinyoss", "generate", "Hello", "--max-tokens", "4000",
         "--temperature", "1"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout.read(5)  # the first text: generation has started
    proc.stdout.close()
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


def test_serve_with_a_cache_that_cannot_be_written_says_so_before_listening(tmp_path, capsys,
                                                                            monkeypatch):
    """It had started, then printed the engine core's traceback without naming TINYOSS_CACHE."""
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("TINYOSS_CACHE", str(tmp_path / "afile" / "sub"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "tiny", "--port", str(port)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "set TINYOSS_CACHE to a writable folder" in err, err


def test_the_logged_url_can_be_pasted():
    """An IPv6 host is bracketed in the URL the server logs (it had read http://::1:8000/v1)."""
    from tinyoss.server.cli import base_url

    assert base_url("::1", 8000) == "http://[::1]:8000/v1"
    assert base_url("0.0.0.0", 80) == "http://0.0.0.0:80/v1"
    assert base_url("localhost", 8000) == "http://localhost:8000/v1"


def test_a_shutdown_that_cuts_requests_off_logs_no_error():
    """uvicorn's ERROR lines when the grace ends with requests running (a new user read them as
    a crash): the count as INFO in tinyoss's words, then the incomplete-response lines dropped;
    before the cut-off that line, and any other record, passes as it is."""
    import logging

    from tinyoss.server.cli import SHUTDOWN_GRACE_S, _QuietShutdown

    def record(msg: str, *args) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, msg, args, None)

    quiet, incomplete = _QuietShutdown(), "ASGI callable returned without completing response."
    assert quiet.filter(record(incomplete))  # no shutdown yet: a fault, kept
    cancel = record("Cancel %s running task(s), timeout graceful shutdown exceeded", 2)
    assert quiet.filter(cancel) and cancel.levelno == logging.INFO
    assert cancel.getMessage() == (f"shutting down: 2 request(s) still running after the "
                                   f"{SHUTDOWN_GRACE_S} s grace are cut off")
    assert not quiet.filter(record(incomplete))
    other = record("Exception in ASGI application")
    assert quiet.filter(other) and other.levelno == logging.ERROR


@pytest.mark.parametrize("argv, says", [
    (["serve", "tiny", "--served-model-name", "", "b"], "a served model name must not be blank"),
    (["serve", "tiny", "--allowed-origins", '["*"]', "--allowed-headers", "{}"],
     '--allowed-headers takes a JSON list of strings, e.g. \'["*"]\' or \'["Content-Type", '),
])
def test_serve_flags_refused_by_name(capsys, argv, says):
    """A blank --served-model-name (an unset shell variable had served the model as "") and a
    CORS flag's example fitting the flag (it had shown an origin for --allowed-headers)."""
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_generate_takes_max_tokens_as_the_other_integer_flags_do():
    args = cli.build_parser().parse_args(["generate", "hi", "--max-tokens", "1k"])
    assert args.max_tokens == 1000


def test_serve_on_port_0_logs_the_port_it_listens_on():
    """--port 0 (any free port): the log names the port the system picked, not ':0', and that
    port answers."""
    import httpx

    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "tinyoss", "serve", "tiny", "--port", "0"],
                            cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            found = re.search(r"listening on http://127\.0\.0\.1:(\d+)/v1", line)
            if found or not line:
                break
        assert found, "".join(lines)
        port = int(found.group(1))
        assert port > 0 and not any(":0/v1" in line for line in lines)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code in (200, 503)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
