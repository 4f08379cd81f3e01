"""`LLM(...)` shows the start-up lines in a script that configured no logging, as the server
does; a level on the "tinyoss" logger silences them; `tiny` says its text is random."""

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tinyoss.config import EngineConfig
from tinyoss.engine.builder import _random_weights
from tinyoss.llm import show_startup_logs


@contextlib.contextmanager
def bare_logging() -> Iterator[logging.Logger]:
    """Logging as a script that configured none finds it: no handler on the root logger, and the
    "tinyoss" logger without handlers or level. Entered in the test itself, and restored in
    place: pytest hangs its own handlers on the root around each test phase."""
    root, logger = logging.getLogger(), logging.getLogger("tinyoss")
    saved = root.handlers[:], logger.handlers[:], logger.level
    root.handlers.clear()
    logger.handlers.clear()
    logger.setLevel(logging.NOTSET)
    try:
        yield logger
    finally:
        root.handlers[:], logger.handlers[:] = saved[:2]
        logger.setLevel(saved[2])


def test_info_lines_go_to_stderr_when_nothing_is_configured(capsys):
    with bare_logging() as logger:
        show_startup_logs()
        show_startup_logs()  # a second LLM: no second handler
        assert len(logger.handlers) == 1
        logger.info("loaded %s", "tiny")
        logging.getLogger("tinyoss.server").debug("not shown")
    assert capsys.readouterr().err.endswith(" INFO tinyoss: loaded tiny\n")


def test_a_level_set_beforehand_silences_them(capsys):
    with bare_logging() as logger:
        logger.setLevel(logging.WARNING)
        show_startup_logs()
        logger.info("loaded tiny")
        logger.warning("attention sinks DISABLED")
    assert capsys.readouterr().err.endswith(" WARNING tinyoss: attention sinks DISABLED\n")


def test_an_application_that_configures_logging_gets_each_line_once(capsys):
    with bare_logging() as logger:
        show_startup_logs()
        logging.getLogger().addHandler(logging.StreamHandler(sys.stdout))  # after the LLM
        logger.info("loaded tiny")
    out = capsys.readouterr()
    assert out.out == "loaded tiny\n" and out.err == ""


def test_nothing_is_added_when_the_application_configured_logging():
    with bare_logging() as logger:
        logging.getLogger().addHandler(logging.NullHandler())
        show_startup_logs()
        assert logger.handlers == [] and logger.level == logging.NOTSET


def test_random_weights_are_said_plainly():
    assert "tiny" in _random_weights(EngineConfig(model="tiny"))
    assert "random" in _random_weights(EngineConfig(model="tiny"))
    dummy = EngineConfig(model="openai/gpt-oss-20b", load_format="dummy")
    assert "random" in _random_weights(dummy)
    assert _random_weights(EngineConfig(model="openai/gpt-oss-20b")) is None


SCRIPT = """
from tinyoss import LLM
LLM("tiny", device="cpu", kv_cache_tokens=1024)
"""


@pytest.mark.slow
def test_a_new_users_script_sees_the_start_up():
    """A fresh interpreter, as a user's script runs: no logging configured anywhere."""
    err = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=300
    ).stderr
    lines = [line.split(" tinyoss: ", 1)[1] for line in err.splitlines() if " tinyoss: " in line]
    n = os.environ["OMP_NUM_THREADS"]  # conftest's, inherited
    assert lines[0] == f"CPU threads: {n} (OMP_NUM_THREADS={n} is set)"
    assert any(line.startswith("backends on ") for line in lines)
    assert any(line.startswith("loading ") and "tensors" in line for line in lines)
    assert any(line.startswith("loaded tiny in ") for line in lines)
    assert any(line.startswith("model tiny on cpu, float32; backends: ") for line in lines)
    assert lines[-1].startswith("tiny is tinyoss's built-in test model and has random weights")
