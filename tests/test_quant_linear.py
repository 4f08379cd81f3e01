"""Dense layers quantized to MXFP4 or FP8 at load (`mxfp4_layers`, `fp8_layers`): parsing, the
modules, the engine options, the FP8 GEMV, and the quality report on `tiny` (CPU)."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bench.mxfp4_quality import quality
from tinyoss.cli import add_engine_args, engine_kwargs
from tinyoss.config import ModelConfig
from tinyoss.config import EngineConfig
from tinyoss.kernels import Kernels
from tinyoss.model import mxfp4, quant_linear
from tinyoss.model.gpt_oss import GptOssForCausalLM
from tinyoss.model.presets import GENERATION_CONFIG, preset_config
from tinyoss.config import parse_fp8_layers, parse_mxfp4_layers
from tinyoss.model.quant_linear import FP8Linear, MXFP4Linear, quantize_layers
from tinyoss.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("spec", "layers"),
    [
        ("moe", ()),
        ("all", ("qkv", "o", "lm_head")),
        ("lm_head,qkv", ("qkv", "lm_head")),
        (" o , moe ", ("o",)),
        (["o", "qkv"], ("qkv", "o")),
    ],
)
def test_parse(spec, layers) -> None:
    assert parse_mxfp4_layers(spec) == layers


@pytest.mark.parametrize("spec", ["", "qkv,mlp", "attention"])
def test_unknown_layer_names_the_field(spec: str) -> None:
    with pytest.raises(ValueError, match="mxfp4_layers.*moe, qkv, o, lm_head, or all"):
        EngineConfig(mxfp4_layers=spec)


def test_cli_flag() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))["mxfp4_layers"] == "moe"
    assert engine_kwargs(p.parse_args(["--mxfp4-layers", "qkv,o"]))["mxfp4_layers"] == "qkv,o"


def test_from_linear_quantizes_in_chunks(monkeypatch) -> None:
    """Chunked quantization (7 rows a chunk, ragged end) packs exactly what one call would;
    the forward is F.linear on the dequantized weight, over any leading dimensions."""
    monkeypatch.setattr(quant_linear, "_QUANTIZE_CHUNK", 7 * 160)
    torch.manual_seed(0)
    linear = nn.Linear(160, 40)
    q = MXFP4Linear.from_linear(linear, Kernels())
    blocks, scales = mxfp4.quantize(linear.weight.detach())
    assert torch.equal(q.blocks, blocks) and torch.equal(q.scales, scales)
    x = torch.randn(2, 3, 160)
    w = mxfp4.dequantize(blocks, scales)
    torch.testing.assert_close(q(x), F.linear(x, w, linear.bias.detach()))
    assert MXFP4Linear.from_linear(nn.Linear(160, 8, bias=False), Kernels())(x).shape == (2, 3, 8)


def test_tied_lm_head_is_refused() -> None:
    cfg = preset_config("tiny") | {"tie_word_embeddings": True}
    with torch.device("meta"):
        model = GptOssForCausalLM(ModelConfig.from_dict(cfg, GENERATION_CONFIG))
    with pytest.raises(ValueError, match="lm_head.*tie_word_embeddings"):
        quantize_layers(model, ("qkv", "lm_head"))
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, nn.Linear)  # nothing changed


@pytest.fixture(scope="module")
def quantized_llm(tiny_dir):
    from tinyoss import LLM

    return LLM(
        str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=1024,
        max_model_len=512, mxfp4_layers="all",
    )


def test_engine_swaps_the_layers(quantized_llm) -> None:
    model = quantized_llm.engine.executor.model
    assert isinstance(model.lm_head, MXFP4Linear)
    for layer in model.model.layers:
        assert isinstance(layer.self_attn.qkv_proj, MXFP4Linear)
        assert isinstance(layer.self_attn.o_proj, MXFP4Linear)
        assert layer.self_attn.qkv_proj.bias.dtype == torch.float32  # biases stay as loaded
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears == [layer.mlp.router for layer in model.model.layers]  # routers stay


def test_bytes_saved_at_20b(caplog) -> None:
    """gpt-oss-20b's shapes (on the meta device: no memory, no time): bf16 -> MXFP4 saves
    1.786 GB, 2 - 17/32 bytes a weight; the log says what was quantized."""
    with torch.device("meta"):
        model = GptOssForCausalLM(ModelConfig.from_dict(preset_config("gpt-oss-20b")))
    model = model.to(torch.bfloat16)
    c = model.config
    h = c.hidden_size
    shapes = [(c.q_size + 2 * c.kv_size, h), (h, c.q_size)] * c.num_hidden_layers
    shapes.append((c.vocab_size, h))
    with caplog.at_level(logging.INFO, logger="tinyoss"):
        saved = quantize_layers(model, ("qkv", "o", "lm_head"))
    assert saved == sum(n * k * 2 - n * (k // 2 + k // 32) for n, k in shapes) == 1_786_210_560
    assert "quantized qkv, o, lm_head to MXFP4" in caplog.text


def test_engine_generates(quantized_llm) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    out = quantized_llm.generate([[1, 2, 3]], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


def test_quality_on_tiny() -> None:
    """`moe` against itself is exactly zero; `all` moves the logits by a finite amount and
    keeps the greedy token far more often than chance (1 in 201088). On this random 4-layer
    model ~12% weight error per layer gives rel ~0.5 and ~30% agreement (measured)."""
    rows = {r["layers"]: r for r in quality(
        "tiny", ("moe", "all"), num_prompts=2, length=64, device="cpu", dtype="float32"
    )}
    moe, all_ = rows["moe"], rows["all"]
    assert moe["max_abs"] == moe["mean_abs"] == moe["kl"] == 0.0
    assert moe["greedy_agreement"] == 1.0
    assert 0 < all_["mean_abs"] <= all_["max_abs"] < float("inf")
    assert 0 < all_["rel"] < 1.0 and 0 < all_["kl"] < 2.0
    assert all_["greedy_agreement"] > 0.1


# ---- FP8 (`fp8_layers`) ----


@pytest.mark.parametrize(
    ("spec", "mxfp4", "layers"),
    [("none", "moe", ()), ("all", "moe", ("qkv", "o", "lm_head")), ("all", "qkv", ("o", "lm_head")),
     ("lm_head, o", "qkv", ("o", "lm_head"))],
)
def test_parse_fp8(spec, mxfp4, layers) -> None:
    assert parse_fp8_layers(spec, mxfp4) == layers


def test_fp8_option_checks() -> None:
    with pytest.raises(ValueError, match="fp8_layers 'moe'.*none, qkv, o, lm_head, or all"):
        EngineConfig(fp8_layers="moe")
    with pytest.raises(ValueError, match="qkv named in both mxfp4_layers and fp8_layers"):
        EngineConfig(mxfp4_layers="qkv,o", fp8_layers="qkv")
    EngineConfig(mxfp4_layers="qkv", fp8_layers="all")  # all: every one MXFP4 does not take
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))["fp8_layers"] == "none"
    assert engine_kwargs(p.parse_args(["--fp8-layers", "o"]))["fp8_layers"] == "o"


def test_quantize_fp8_rounds_each_row_to_its_scale(monkeypatch) -> None:
    """Scale = row absmax / 448 (the largest magnitude lands on 448 exactly); every weight within
    e4m3's rounding (2**-4 of itself, or 2**-10 of the scale below the normal range); a zero row
    keeps scale 1; chunked (7 rows a chunk) the same as whole."""
    torch.manual_seed(0)
    w = torch.randn(37, 96) * torch.logspace(-3, 2, 37)[:, None]
    w[5] = 0
    q, s = quant_linear.quantize_fp8(w)
    amax = w.abs().amax(1)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(s[amax > 0], (amax / 448)[amax > 0]) and s[5] == 1
    assert q.float().abs().amax(1)[amax > 0].eq(448).all()
    err = (q.float() * s[:, None] - w).abs()
    assert (err <= torch.maximum(w.abs() * 2**-4, s[:, None] * 2**-10)).all()
    monkeypatch.setattr(quant_linear, "_QUANTIZE_CHUNK", 7 * 96)
    q7, s7 = quant_linear.quantize_fp8(w)
    assert torch.equal(q7.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s7, s)


def test_fp8_linear_is_f_linear_on_the_dequantized_weight() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(96, 24)
    q = FP8Linear.from_linear(linear, Kernels())
    x = torch.randn(2, 3, 96)
    w = q.weight.float() * q.scale[:, None]
    torch.testing.assert_close(q(x), F.linear(x, w, linear.bias.detach()))
    assert FP8Linear.from_linear(nn.Linear(96, 8, bias=False), Kernels())(x).shape == (2, 3, 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors: the Triton interpreter's")
@pytest.mark.parametrize("m", [1, 3, 9])
def test_fp8_gemv_matches_the_reference(monkeypatch, m: int) -> None:
    """The Triton path (the interpreter on CPU) against `fp8_linear_torch`: the GEMV up to
    FP8_GEMV_MAX_M rows (ragged N and K), bf16 copies of slices of rows above (3 slices here)."""
    from tinyoss.kernels import linear_triton as lt
    from tinyoss.kernels.linear_fp8_torch import fp8_linear_torch

    monkeypatch.setattr(lt, "_FP8_SLICE", 16)
    torch.manual_seed(m)
    w, x, b = torch.randn(37, 200), torch.randn(m, 200), torch.randn(37)
    q, s = quant_linear.quantize_fp8(w)
    want = fp8_linear_torch(x, q, s, b)
    if m <= lt.FP8_GEMV_MAX_M:
        cfg = lt.GemvConfig(block_m=lt.gemv_config(m, 37, 1).block_m, block_n=8, block_k=64)
        got = lt.linear_gemv(x, q, b, cfg, scale=s)
    else:
        got = lt.fp8_linear(x, q, s, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="FP8 weight takes a float32 scale a row"):
        lt.linear_gemv(x, q, b)


def test_fp8_bytes_saved_at_20b(caplog) -> None:
    """gpt-oss-20b's dense layers in FP8: 1 byte a weight and 4 a row instead of 2 a weight."""
    with torch.device("meta"):
        model = GptOssForCausalLM(ModelConfig.from_dict(preset_config("gpt-oss-20b")))
    model = model.to(torch.bfloat16)
    c = model.config
    h = c.hidden_size
    shapes = [(c.q_size + 2 * c.kv_size, h), (h, c.q_size)] * c.num_hidden_layers
    shapes.append((c.vocab_size, h))
    with caplog.at_level(logging.INFO, logger="tinyoss"):
        saved = quantize_layers(model, ("qkv", "o", "lm_head"), "fp8")
    assert saved == sum(n * k - 4 * n for n, k in shapes)
    assert "quantized qkv, o, lm_head to FP8" in caplog.text
    assert isinstance(model.lm_head, FP8Linear)


def test_fp8_engine_and_quality_on_tiny(tiny_dir) -> None:
    """The engine swaps every dense layer but the routers for FP8Linear and generates; on `tiny`
    FP8 moves the logits less than MXFP4 does (rel ~0.18 against ~0.52, measured)."""
    from tinyoss import LLM

    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=1024,
              max_model_len=512, fp8_layers="all")
    model = llm.engine.executor.model
    assert isinstance(model.lm_head, FP8Linear)
    assert all(isinstance(layer.self_attn.qkv_proj, FP8Linear)
               and isinstance(layer.self_attn.o_proj, FP8Linear) for layer in model.model.layers)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids) == 2
    rows = {r["layers"]: r for r in quality(
        "tiny", ("all", "fp8:all"), num_prompts=2, length=64, device="cpu", dtype="float32"
    )}
    assert 0 < rows["fp8:all"]["rel"] < rows["all"]["rel"]
    assert rows["fp8:all"]["kl"] < rows["all"]["kl"]
