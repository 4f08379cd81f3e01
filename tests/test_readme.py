"""Every code block of README.md and docs/serve.md, run as written against `tiny` (or, where it
cannot run here, checked for what it promises): a snippet that rots fails CI.

The server snippets run against one `tinyoss serve` (the README's run command, the default
model: `tiny` on a machine without a GPU) on a free port instead of 8000. Every block must be
claimed by a rule below; a new kind of block fails `test_every_block_is_covered` until it is.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/serve.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks() -> list[tuple[str, str, str]]:
    """(file, language, code) of every fenced block."""
    out = []
    for name in DOCS:
        for m in FENCE.finditer((REPO / name).read_text()):
            out.append((name, m.group(1), m.group(2)))
    return out


def kind(lang: str, code: str) -> str:
    """Which rule covers a block."""
    if lang == "" and ("engine core process" in code or code.startswith("request -> ")):
        return "diagram"
    if lang == "bash" and code.startswith("python3 -m venv"):
        return "install"
    if lang == "bash" and code.startswith("curl http://localhost:8000/"):
        return "curl"
    if lang == "bash" and code.lstrip().startswith("python bench/"):
        return "gpu-benchmark"  # full-size models on a GPU: bench/results/ records them
    if lang == "bash" and all(line.startswith("tinyoss serve") for line in code.splitlines()):
        return "serve-commands"
    if lang == "bash" and all(line.startswith(("tinyoss generate", "tinyoss chat"))
                              for line in code.splitlines()):
        return "cli"
    if lang == "python" and 'OpenAI(base_url="http://localhost:8000/v1"' in code:
        return "openai-client"
    if lang == "python" and "from tinyoss import LLM" in code:
        return "python-api"
    if lang == "toml" and "[model_providers." in code:
        return "codex-config"
    return "unknown"


def of_kind(k: str) -> list[str]:
    """The distinct blocks of kind `k`: docs/serve.md repeats some of the README's word for
    word, and running the same code twice (a 256-token chat each) checks nothing more."""
    return list(dict.fromkeys(code for _, lang, code in blocks() if kind(lang, code) == k))


def test_every_block_is_covered():
    unknown = [(f, code[:60]) for f, lang, code in blocks() if kind(lang, code) == "unknown"]
    assert not unknown, f"code blocks no test runs or checks: {unknown}"
    for k in ("install", "curl", "openai-client", "python-api", "serve-commands", "cli"):
        assert of_kind(k), f"no {k} block left: update this test"


def test_codex_config_names_the_served_model():
    """docs/serve.md's Codex provider (Codex cannot run here: test_server_responses'
    test_a_codex_turn_streams_to_completed replays its request): valid TOML, its model the name
    the command before it serves (starting gpt-oss, as Codex picks gpt-oss settings by it), the
    Responses wire API on the server's /v1."""
    import tomllib

    (code,) = of_kind("codex-config")
    config = tomllib.loads(code)
    text = (REPO / "docs/serve.md").read_text()
    served = re.search(r"--served-model-name (\S+?)`", text).group(1)
    provider = config["model_providers"][config["model_provider"]]
    assert config["model"] == served and served.startswith("gpt-oss"), (config, served)
    assert provider["base_url"] == "http://localhost:8000/v1" and provider["wire_api"] == (
        "responses")


def test_install_commands_match_ci():
    """The README's test command is what .ci/run runs (its torch comes from the machine's own
    index first, as the README says); the run commands install the extras that exist."""
    ci = (REPO / ".ci/run").read_text()
    test = next(c for c in of_kind("install") if "pytest" in c)
    assert "pip install -e '.[test]'" in test and test.rstrip().endswith("python -m pytest -q")
    assert "-e '.[test]'" in ci and "python -m pytest -q" in ci
    cpu_index = "--index-url https://download.pytorch.org/whl/cpu"
    assert cpu_index in test and cpu_index in ci
    extras = re.findall(r"\[project\.optional-dependencies\](.*?)\n\[", (
        REPO / "pyproject.toml").read_text(), re.S)[0]
    for code in of_kind("install"):
        for wanted in re.findall(r"-e '\.\[([\w,]+)\]'", code):
            for extra in wanted.split(","):
                assert re.search(rf"^{extra} = \[", extras, re.M), f"no extra {extra!r}"


def test_serve_commands_parse():
    """The documented `tinyoss serve` lines are accepted by the CLI (parsing only: the 20b's
    weights are not here)."""
    from tinyoss.cli import build_parser

    parser = build_parser()
    for code in of_kind("serve-commands"):
        for line in code.splitlines():
            argv = shlex.split(line.split("#")[0])[1:]
            args = parser.parse_args(argv)
            assert args.command == "serve"


def test_cli_commands():
    """`tinyoss generate` and `chat` as written (the default model: `tiny` without a GPU):
    exit 0 with text on stdout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    for code in of_kind("cli"):
        for line in code.splitlines():
            run = subprocess.run([sys.executable, "-m", "tinyoss", *shlex.split(line)[1:]],
                                 cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stderr[-3000:]
            assert run.stdout.strip(), (line, run.stderr[-3000:])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`tinyoss serve` as the README runs it (default model), on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("readme") / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("TINYOSS_API_KEY", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tinyoss.cli", "serve", "--port",
                                 str(port)], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            pytest.fail(f"server not healthy: {log.read_text()[-3000:]}")
        yield port
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _curl_request(code: str, port: int) -> tuple[str, dict[str, str], dict]:
    """(url, headers, JSON body) of a documented curl command, aimed at `port`."""
    argv = shlex.split(code.replace("\\\n", " "))
    assert argv[0] == "curl"
    url = argv[1].replace("localhost:8000", f"127.0.0.1:{port}")
    headers, body = {}, None
    for flag, value in zip(argv[2:], argv[3:]):
        if flag == "-H":
            name, _, v = value.partition(":")
            headers[name.strip()] = v.strip()
        elif flag == "-d":
            body = json.loads(value)
    assert body is not None, "a documented curl command sends a JSON body"
    return url, headers, body


def test_curl_examples(server):
    """Each documented curl command, sent as written plus a seed: the built-in model's weights
    are random, so without one an unlucky draw never leaves the analysis channel."""
    for code in of_kind("curl"):
        url, headers, body = _curl_request(code, server)
        r = httpx.post(url, headers=headers, json={**body, "seed": 0}, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert text and text.strip(), f"the example shows nothing: {r.json()}"


def _run_python(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<snippet>", "exec"), {"__name__": "__snippet__"})
    return out.getvalue()


def test_openai_client_examples(server):
    for code in of_kind("openai-client"):
        printed = _run_python(code.replace("localhost:8000", f"127.0.0.1:{server}"))
        assert printed.strip(), "the streaming example printed only blank lines"


def test_python_api_example():
    """As written (it builds `tiny`), its three prints show text."""
    for code in of_kind("python-api"):
        printed = _run_python(code)
        assert len(printed.strip().splitlines()) >= 2 and len(printed.strip()) > 20, printed
