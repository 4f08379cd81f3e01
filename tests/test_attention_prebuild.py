"""FlashInfer's sink-attention JIT builds started early: side by side, each window once, and a
build's error raised where the wrapper would have raised it."""

import threading

import pytest
import torch

from tinyoss.kernels import attention_flashinfer as af


def test_the_builds_run_side_by_side_once_a_window(monkeypatch):
    both = threading.Barrier(2, timeout=10)  # times out if one build waits for the other
    built = []

    def fake(workspace, dtype, head_dim, window, backend):
        built.append((window, head_dim, dtype, backend))
        both.wait()

    monkeypatch.setattr(af, "_sink_wrapper", fake)
    job = af.Prebuild(torch.device("cpu"), torch.bfloat16, 64, [128, 0, 128, 0])
    job.wait()
    assert sorted(built) == [(0, 64, torch.bfloat16, "fa2"), (128, 64, torch.bfloat16, "fa2")]
    assert all(not t.is_alive() and t.daemon for t in job.threads)


def test_a_failed_build_is_raised_by_wait(monkeypatch):
    def fake(workspace, dtype, head_dim, window, backend):
        if window:
            raise RuntimeError("ninja: build stopped: subcommand failed")

    monkeypatch.setattr(af, "_sink_wrapper", fake)
    job = af.Prebuild(torch.device("cpu"), torch.bfloat16, 64, [128, 0])
    with pytest.raises(RuntimeError, match="subcommand failed"):
        job.wait()
