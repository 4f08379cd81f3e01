"""CORS (`--allowed-origins`, `--allowed-methods`, `--allowed-headers`, `--allow-credentials`):
off by default, preflights answered without the API key, and the flags parsed as vLLM takes them.

The app runs in-process under starlette's TestClient without its lifespan: no engine core
starts, which CORS does not need (/version answers without one; /v1 routes answer 401 first)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from tinyoss import cli
from tinyoss.cli import CliError
from tinyoss.config import EngineConfig
from tinyoss.server import cli as server_cli
from tinyoss.server.app import Cors, create_app

KEY = "test-key"
TINY = EngineConfig(model="tiny", device="cpu", dtype="float32", max_model_len=512)
ORIGIN = "https://app.example"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def app_client(cors: Cors | None) -> TestClient:
    app = create_app(TINY, model_name="tiny", api_key=KEY, cors=cors)
    return TestClient(app)  # no `with`: the lifespan (and the engine core) never starts


def acao(r) -> str | None:
    return r.headers.get("access-control-allow-origin")


def test_off_by_default_adds_no_cors_headers():
    c = app_client(None)
    r = c.get("/version", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and r.json()["version"]
    assert not [h for h in r.headers if h.lower().startswith("access-control-")]
    r = c.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code in (401, 405)  # no preflight handling at all
    assert not [h for h in r.headers if h.lower().startswith("access-control-")]


def test_any_origin_preflight_without_the_key_and_simple_requests():
    c = app_client(Cors(("*",)))
    r = c.options("/v1/chat/completions", headers=PREFLIGHT)  # no Authorization header
    assert r.status_code == 200, r.text
    assert acao(r) == "*"
    methods = r.headers["access-control-allow-methods"]
    assert "POST" in methods and "OPTIONS" in methods
    # "*" headers: the requested ones are echoed back
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in r.headers
    r = c.options("/tokenize", headers=PREFLIGHT)
    assert r.status_code == 200 and acao(r) == "*"
    r = c.get("/version", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and acao(r) == "*"
    # errors carry the header too, so a browser can read them
    r = c.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert acao(r) == "*"
    # no Origin: not a cross-origin request, nothing added
    assert acao(c.get("/version")) is None


def test_listed_origins_methods_headers_and_credentials():
    cors = Cors((ORIGIN,), ("GET", "POST"), ("authorization", "content-type"), True)
    c = app_client(cors)
    r = c.options("/v1/completions", headers=PREFLIGHT)
    assert r.status_code == 200, r.text
    assert acao(r) == ORIGIN
    assert r.headers["access-control-allow-credentials"] == "true"
    assert set(r.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type"} <= allowed
    r = c.get("/version", headers={"Origin": ORIGIN})
    assert acao(r) == ORIGIN and r.headers["access-control-allow-credentials"] == "true"
    # an origin not listed: the preflight fails, a simple request gets no allow-origin
    r = c.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert r.status_code == 400 and acao(r) is None
    assert acao(c.get("/version", headers={"Origin": "https://evil.example"})) is None
    # a method not listed
    r = c.options("/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "PUT"})
    assert r.status_code == 400


def _parse(argv: list[str]):
    return cli.build_parser().parse_args(["serve", "tiny", *argv])


def test_flags():
    assert server_cli.cors(_parse([])) is None
    args = _parse(["--allowed-origins", '["*"]'])
    assert server_cli.cors(args) == Cors(("*",), ("*",), ("*",), False)
    args = _parse([
        "--allowed-origins", f'["{ORIGIN}"]', "--allowed-methods", '["GET", "POST"]',
        "--allowed-headers", '["authorization"]', "--allow-credentials",
    ])  # fmt: skip
    assert server_cli.cors(args) == Cors((ORIGIN,), ("GET", "POST"), ("authorization",), True)
    with pytest.raises(CliError, match="without --allowed-origins"):
        server_cli.cors(_parse(["--allowed-methods", '["GET"]']))
    with pytest.raises(CliError, match="--allow-credentials"):
        server_cli.cors(_parse(["--allow-credentials"]))


@pytest.mark.parametrize("value", ["*", "[1]", '{"a": "b"}', "[nope"])
def test_a_flag_that_is_not_a_json_list_of_strings_is_refused(value, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(["--allowed-origins", value])
    assert e.value.code == 2
    assert "--allowed-origins takes a JSON list of strings" in capsys.readouterr().err
