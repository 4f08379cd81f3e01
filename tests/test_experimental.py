"""TINYOSS_EXPERIMENTAL: unknown names are errors everywhere; on a GPU each name swaps in its
kernels (checked here with the GPU's answers stubbed); on the CPU nothing changes."""

from __future__ import annotations

import functools

import pytest
import torch

from tinyoss.kernels import backends, launch
from tinyoss.kernels.linear_triton import linear_triton


def test_unknown_name_is_an_error(monkeypatch):
    monkeypatch.setenv(backends.EXPERIMENTAL_ENV, "pdl,warp-speed")
    with pytest.raises(ValueError, match="unknown warp-speed; choose from pdl, f16x2"):
        backends.select_backends(torch.device("cpu"))


def test_cpu_ignores_it(monkeypatch):
    monkeypatch.setenv(backends.EXPERIMENTAL_ENV, "pdl,f16x2")
    choice = backends.select_backends(torch.device("cpu"))
    assert choice.kernels.linear is torch.nn.functional.linear
    assert "pdl" not in choice.kernels.names and choice.kernels.names["moe"] == "torch"


def test_gpu_wiring(monkeypatch):
    monkeypatch.setenv(backends.EXPERIMENTAL_ENV, " f16x2 , pdl ")
    monkeypatch.setattr(backends, "pdl_available", lambda device: True)
    kernels = backends.Kernels()
    try:
        backends._experimental(kernels, torch.device("cuda"), "triton")
        assert launch.pdl_options(torch.empty(0)) == {"USE_PDL": False}  # CPU tensors: never
        assert launch._enabled
    finally:
        launch.enable_pdl(False)
    assert kernels.names["pdl"] == "on"
    assert isinstance(kernels.moe, functools.partial) and kernels.moe.keywords["gemv"].f16x2
    assert kernels.moe_norm.keywords["gemv"].f16x2
    assert kernels.mxfp4_linear.keywords == {"f16x2": True}
    assert kernels.names["moe"] == "triton-f16x2" and kernels.names["pdl"] == "on"


def test_engine_starts_without_triton(tiny_dir):
    """A CPU install without Triton (no GPU extras) still starts: choosing kernels needs none."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"
            "from tinyoss import LLM, SamplingParams\n"
            f"llm = LLM({str(tiny_dir)!r}, device='cpu', kv_cache_tokens=1024)\n"
            "print(len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2),"
            " use_tqdm=False)[0].outputs[0].token_ids))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "2"


def test_dense_backend(monkeypatch):
    """The bf16 dense layers: the Triton GEMV on a GPU unless env says torch; triton on a CPU
    and unknown names are errors."""
    kernels = backends.Kernels()
    backends._dense(kernels, on_gpu=True)
    assert kernels.linear is linear_triton and kernels.names["linear"] == "triton"
    monkeypatch.setenv(backends.DENSE_ENV, "torch")
    kernels = backends.Kernels()
    backends._dense(kernels, on_gpu=True)
    assert kernels.linear is torch.nn.functional.linear and kernels.names["linear"] == "torch"
    monkeypatch.setenv(backends.DENSE_ENV, "triton")
    with pytest.raises(ValueError, match="dense backend 'triton' .*needs a CUDA GPU"):
        backends.select_backends(torch.device("cpu"))
    monkeypatch.setenv(backends.DENSE_ENV, "cublas")
    with pytest.raises(ValueError, match="dense backend 'cublas'.* not one of: auto, triton"):
        backends.select_backends(torch.device("cpu"))
