"""Feedback during the waits: writing `tiny`, building the tokenizer, loading weights. A bar on a
terminal only, a log line at the start and the end either way."""

import io
import logging
import shutil
import sys

import pytest
import torch

from tinyoss.config import ModelConfig
from tinyoss.model.layout import TensorSpec
from tinyoss.model.loader import load_model
from tinyoss.model.presets import GENERATION_CONFIG, preset_config
from tinyoss.progress import tensor_progress
from tinyoss.tools import o200k
from tinyoss.tools.make_checkpoint import ensure_tiny, make_checkpoint

SMALL = {"vocab_size": 1024, "eos_token_id": 1000, "pad_token_id": 999}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _terminal(monkeypatch) -> _Terminal:
    """stderr as an interactive terminal, its text kept. Called in the test itself: pytest's
    capture puts its own sys.stderr back after the fixtures are set up."""
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    return term


def _specs(n):
    return [TensorSpec(f"t{i}", (256,), "F32") for i in range(n)]  # 1 KiB each


def test_the_bar_reaches_100_percent_when_the_consumer_stops_at_the_last_tensor(monkeypatch):
    terminal = _terminal(monkeypatch)
    specs = _specs(3)
    stream = tensor_progress(((s, i) for i, s in enumerate(specs)), 3072, "writing x")
    assert [t for _, (_, t) in zip(specs, stream)] == [0, 1, 2]  # zip never asks for a 4th
    del stream  # a shard writer's stream goes when make_checkpoint returns
    out = terminal.getvalue()
    assert "writing x: 100%" in out and "3.07k/3.07k" in out


def test_no_bar_when_stderr_is_no_terminal(tmp_path, capsys):
    make_checkpoint("tiny", tmp_path / "small", config_overrides=SMALL)
    assert capsys.readouterr().err == ""


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A fresh tinyoss cache that already holds the tokenizer (built once, elsewhere)."""
    shutil.copytree(o200k.tokenizer_dir(), tmp_path / o200k.CACHE_NAME)
    monkeypatch.setenv("TINYOSS_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.slow
def test_writing_tiny_on_first_use(empty_cache, monkeypatch, caplog):
    terminal = _terminal(monkeypatch)
    with caplog.at_level(logging.INFO, logger="tinyoss"):
        folder = ensure_tiny()
    assert (folder / "model.safetensors").is_file()
    start, end = caplog.messages
    assert start == (
        f"writing the built-in model tiny (random weights) to {folder}: first use only"
    )
    assert end.startswith("wrote tiny in ") and end.endswith(" s")
    assert "writing tiny: 100%" in terminal.getvalue()
    caplog.clear()
    assert ensure_tiny() == folder and caplog.messages == []  # second use: silent


def test_building_the_tokenizer_on_first_use(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TINYOSS_CACHE", str(tmp_path))

    def fake_build(folder):
        for name in o200k.FILES:
            (folder / name).write_text("{}")

    monkeypatch.setattr(o200k, "_write_fresh", fake_build)
    with caplog.at_level(logging.INFO, logger="tinyoss"):
        folder = o200k.tokenizer_dir()
    start, end = caplog.messages
    assert start == f"building the o200k tokenizer files into {folder}: first use only"
    assert end.startswith("built the tokenizer in ")


def test_loading_weights(tmp_path, monkeypatch, caplog):
    folder = make_checkpoint("tiny", tmp_path / "small", config_overrides=SMALL)
    terminal = _terminal(monkeypatch)
    config = ModelConfig.from_folder(folder)
    with caplog.at_level(logging.INFO, logger="tinyoss"):
        load_model(folder, config, dtype=torch.float32, device=torch.device("cpu"))
    [line] = caplog.messages
    assert line.startswith("loading 79 tensors (") and line.endswith(f" GB) from {folder}")
    assert "loading weights: 100%" in terminal.getvalue()


def test_random_weights(monkeypatch, caplog):
    terminal = _terminal(monkeypatch)
    config = ModelConfig.from_dict(preset_config("tiny") | SMALL, GENERATION_CONFIG)
    with caplog.at_level(logging.INFO, logger="tinyoss"):
        load_model(
            None, config, dtype=torch.float32, device=torch.device("cpu"), load_format="dummy"
        )
    [line] = caplog.messages
    assert line.startswith("loading 79 tensors (") and line.endswith(
        " GB) from random weights (load_format dummy)"
    )
    assert "random weights: 100%" in terminal.getvalue()


def test_processes_tinyoss_starts_make_no_semaphore(monkeypatch):
    """tqdm's default lock is a multiprocessing RLock, a named semaphore that the resource
    tracker reported leaked when `tinyoss serve` stopped its engine core; the core and the
    workers call `thread_lock_only` first, and then a bar makes none."""
    import multiprocessing.synchronize

    from tqdm import tqdm
    from tqdm.std import TqdmDefaultWriteLock

    from tinyoss import progress

    def no_semaphore(*args, **kwargs):
        raise AssertionError("a multiprocessing semaphore was made")

    monkeypatch.setattr(tqdm, "_lock", None, raising=False)
    monkeypatch.delattr(tqdm, "_lock")  # tqdm makes its lock at the first bar
    monkeypatch.delattr(TqdmDefaultWriteLock, "mp_lock", raising=False)  # ... and this one once
    monkeypatch.setattr(multiprocessing.synchronize.SemLock, "__init__", no_semaphore)
    progress.thread_lock_only()
    with tqdm(total=1, disable=False) as bar:
        bar.update(1)
