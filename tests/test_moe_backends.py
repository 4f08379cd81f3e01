"""`--mxfp4-backend`: precedence (argument > env > auto), auto's choice per GPU, and the start-up
error for every backend a machine cannot run, on mocked GPUs and FlashInfer installs."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from tinyoss.cli import add_engine_args, engine_kwargs
from tinyoss.kernels import Kernels
from tinyoss.kernels.backends import select_backends
from tinyoss.kernels.moe_backends import ENV, Platform, choose, install
from tinyoss.kernels.moe_torch import moe_torch

CPU = Platform("cpu")


def gpu(cap, name="GPU", flashinfer=True, dtype=torch.bfloat16) -> Platform:
    return Platform("cuda", name, cap, flashinfer, dtype)


H100 = gpu((9, 0), "NVIDIA H100 80GB HBM3")
B200 = gpu((10, 0), "NVIDIA B200")
SPARK = gpu((12, 1), "NVIDIA GB10")


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


@pytest.mark.parametrize(
    "platform,backend,reason",
    [
        (CPU, "torch", "auto: no GPU -> torch"),
        (gpu((8, 0)), "triton", "auto: Ampere sm_80 -> triton"),
        (gpu((8, 9)), "triton", "auto: Ada sm_89 -> triton"),
        (H100, "triton", "auto: Hopper sm_90 -> triton"),
        (gpu((9, 0), flashinfer=False), "triton", "auto: Hopper sm_90 -> triton"),
        (B200, "cutlass", "auto: Blackwell sm_100 -> cutlass"),
        (gpu((10, 3)), "cutlass", "auto: Blackwell sm_103 -> cutlass"),
        (gpu((11, 0)), "cutlass", "auto: Blackwell sm_110 -> cutlass"),
        (gpu((12, 0)), "cutlass", "auto: Blackwell sm_120 -> cutlass"),
        (SPARK, "cutlass", "auto: Blackwell sm_121 -> cutlass"),
    ],
)
def test_auto_picks_per_gpu(platform, backend, reason):
    choice = choose(None, platform)
    assert (choice.backend, choice.reason, choice.degraded) == (backend, reason, False)


def test_auto_on_blackwell_without_flashinfer_says_so():
    choice = choose(None, gpu((12, 1), flashinfer=False))
    assert choice.backend == "triton" and choice.degraded
    assert "cutlass cannot run (the flashinfer package is not installed" in choice.reason


def test_precedence_argument_beats_env_beats_auto(monkeypatch):
    assert choose("torch", H100).reason == "asked for -> torch"
    monkeypatch.setenv(ENV, "cutlass")
    assert choose(None, H100).reason == f"env {ENV}=cutlass -> cutlass"
    assert choose("triton", H100).backend == "triton"  # the argument wins over the env
    assert choose("auto", H100).reason == "auto: Hopper sm_90 -> triton"  # explicit auto too
    monkeypatch.setenv(ENV, "auto")
    assert choose(None, H100).reason == f"env {ENV}=auto; auto: Hopper sm_90 -> triton"


@pytest.mark.parametrize("requested,env", [("fast", None), (None, "fast")])
def test_unknown_names_are_rejected(monkeypatch, requested, env):
    if env:
        monkeypatch.setenv(ENV, env)
    where = f"env {ENV}=fast" if env else "argument"
    with pytest.raises(ValueError, match=f"'fast' \\(from {where}\\) is not one of: auto, triton"):
        choose(requested, H100)


NEEDS_GPU = "needs a CUDA GPU. Backends that run here: torch (auto picks torch)"
NO_FLASHINFER = "the flashinfer package is not installed (pip install 'tinyoss[cuda]')"


@pytest.mark.parametrize(
    "backend,platform,expected",
    [
        ("triton", CPU, ["no GPU (cpu)", NEEDS_GPU]),
        ("cutlass", CPU, ["no GPU (cpu)", NEEDS_GPU]),
        ("cutlass", gpu((8, 0), "NVIDIA A100"), [
            "NVIDIA A100 (sm_80)",
            ("kernels for sm_90 (bf16 activations) and sm_100, sm_103, sm_107, sm_110, sm_120, "
             "sm_121 (MXFP8 activations) only"),
            "Backends that run here: triton, torch (auto picks triton)"]),
        ("cutlass", gpu((9, 0), "NVIDIA H100", flashinfer=False), [
            "NVIDIA H100 (sm_90)", NO_FLASHINFER, "run here: triton, torch"]),
        ("cutlass", gpu((9, 0), "NVIDIA H100", dtype=torch.float32), [
            "needs bfloat16 activations (dtype=bfloat16), not float32"]),
        ("cutlass", gpu((12, 1), "NVIDIA GB10", flashinfer=False), [
            "NVIDIA GB10 (sm_121)", NO_FLASHINFER, "(auto picks triton)"]),
        ("cutlass", gpu((10, 0), "NVIDIA B200", flashinfer=False), [
            "NVIDIA B200 (sm_100)", NO_FLASHINFER, "run here: triton, torch (auto picks triton)"]),
    ],
)
def test_backends_that_cannot_run_fail_with_gpu_and_alternatives(backend, platform, expected):
    with pytest.raises(ValueError) as err:
        choose(backend, platform)
    message = str(err.value)
    assert message.startswith(f"mxfp4 backend '{backend}' (from argument) cannot run on ")
    for part in expected:
        assert part in message, (part, message)


def test_an_env_choice_that_cannot_run_names_the_env(monkeypatch):
    monkeypatch.setenv(ENV, "cutlass")
    with pytest.raises(ValueError, match=f"'cutlass' \\(from env {ENV}=cutlass\\) cannot run"):
        choose(None, CPU)


def test_install_points_kernels_at_the_backend():
    kernels = Kernels()
    install(kernels, "torch", CPU, 8192)
    assert kernels.moe is moe_torch and kernels.prepare_experts is None
    install(kernels, "cutlass", SPARK, 4096)
    from tinyoss.kernels.moe_cutlass import autotuning, moe_cutlass, prepare_cutlass

    assert kernels.moe is moe_cutlass and kernels.moe_warmup is autotuning
    assert kernels.prepare_experts.func is prepare_cutlass
    assert kernels.prepare_experts.keywords == {"variant": "mxfp8", "max_num_tokens": 4096}
    assert kernels.names["moe"] == "cutlass"
    install(kernels, "cutlass", H100, 8192)
    assert kernels.prepare_experts.keywords["variant"] == "w4a16"


def test_select_backends_logs_the_choice_once(caplog):
    with caplog.at_level(logging.INFO, logger="tinyoss"):
        choice = select_backends(torch.device("cpu"), "torch", "cutlass", platform=H100)
    assert choice.kernels.names["moe"] == "cutlass"
    lines = [r for r in caplog.records if r.getMessage().startswith("MXFP4 MoE backend")]
    assert [r.getMessage() for r in lines] == ["MXFP4 MoE backend: asked for -> cutlass"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tinyoss"):
        select_backends(torch.device("cpu"), "torch", platform=gpu((12, 0), flashinfer=False))
    assert [r.levelname for r in caplog.records if "MoE backend" in r.getMessage()] == ["WARNING"]


def test_engine_config_and_cli_take_the_option(monkeypatch):
    from tinyoss.config import EngineConfig
    from tinyoss.engine.builder import build_engine

    with pytest.raises(ValueError, match="invalid mxfp4_backend 'fast': choose one of auto, tri"):
        EngineConfig(mxfp4_backend="fast")
    with pytest.raises(ValueError, match="'triton' \\(from argument\\) cannot run on no GPU"):
        build_engine(EngineConfig(device="cpu", load_format="dummy", mxfp4_backend="triton"))
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))["mxfp4_backend"] is None  # env, else auto
    kwargs = engine_kwargs(p.parse_args(["--mxfp4-backend", "cutlass"]))
    assert kwargs["mxfp4_backend"] == "cutlass"
    with pytest.raises(SystemExit):
        p.parse_args(["--mxfp4-backend", "fast"])


def test_attention_on_a_gpu_in_float32_is_torch(monkeypatch, caplog):
    """FlashInfer's sink attention takes bfloat16 only: a float32 engine on a GPU gets the torch
    attention with a warning (it crashed on a KeyError inside FlashInfer), and asking for
    FlashInfer then says what to change."""
    from tinyoss.kernels import backends

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FAKE")
    monkeypatch.setattr(backends, "_has_flashinfer", lambda: True)
    cuda, fp32 = torch.device("cuda"), gpu((9, 0), dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="tinyoss"):
        choice = select_backends(cuda, "auto", "torch", dtype=torch.float32, platform=fp32)
    assert choice.attention == "torch"
    assert "FlashInfer's sink attention takes bfloat16, not float32" in caplog.text
    assert select_backends(cuda, "auto", "torch", platform=H100).attention == "flashinfer"
    with pytest.raises(ValueError, match="'flashinfer' takes bfloat16, not float32: give dtype"):
        select_backends(cuda, "flashinfer", "torch", dtype=torch.float32, platform=fp32)
