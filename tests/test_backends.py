"""Kernel choice (`backends.select_backends`): it needs no Triton on a CPU, and the dense
layers' backend follows env TINYOSS_DENSE_BACKEND."""

from __future__ import annotations

import pytest
import torch

from tinyoss.kernels import backends
from tinyoss.kernels.linear_triton import linear_triton


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
