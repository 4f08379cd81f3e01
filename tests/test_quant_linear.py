"""Dense layers quantized to MXFP4 at load (`mxfp4_layers`): parsing, the module, the engine
option, and the quality report on `tiny` (CPU, torch reference kernels)."""

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
from tinyoss.config import parse_mxfp4_layers
from tinyoss.model.quant_linear import MXFP4Linear, quantize_layers
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
