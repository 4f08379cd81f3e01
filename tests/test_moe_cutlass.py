"""The CUTLASS MoE's weight preparation on CPU: the pure re-layout against `dequantize`, what the
kernel computes on it against `moe_torch`, and the hook that prepares experts once at load.
FlashInfer's own re-layout kernels need CUDA and are stubbed here (tests/test_moe_cutlass_gpu.py
runs the real thing)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tinyoss.config import ModelConfig
from tinyoss.kernels import Kernels
from tinyoss.kernels.moe_cutlass import Relayout, prepare_cutlass, relayout
from tinyoss.kernels.moe_torch import ExpertWeights, moe_torch
from tinyoss.model.loader import load_model
from tinyoss.model.mxfp4 import dequantize, quantize
from tinyoss.model.presets import GENERATION_CONFIG, preset_config


def experts(e: int, h: int, i: int, seed: int = 0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    gu_blocks, gu_scales = quantize(torch.randn(e, 2 * i, h, generator=g) * 0.1)
    d_blocks, d_scales = quantize(torch.randn(e, h, i, generator=g) * 0.1)
    return ExpertWeights(gu_blocks, gu_scales, torch.randn(e, 2 * i, generator=g) * 0.1,
                         d_blocks, d_scales, torch.randn(e, h, generator=g) * 0.1)


def routing(t: int, e: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    top, ids = torch.randn(t, e, generator=g).topk(k, dim=-1)
    return torch.softmax(top, dim=-1), ids


def test_relayout_is_up_then_gate_zero_padded_to_128():
    e, h, i = 3, 160, 96  # -> Hp 256, Ip 128
    w = experts(e, h, i)
    r = relayout(w)
    assert r.fc1_blocks.shape == (e, 256, 8, 16) and r.fc1_scales.shape == (e, 256, 8)
    assert r.fc2_blocks.shape == (e, 256, 4, 16) and r.fc2_scales.shape == (e, 256, 4)
    assert r.fc1_bias.shape == (e, 256) and r.fc2_bias.shape == (e, 256)

    w1 = dequantize(w.gate_up_blocks, w.gate_up_scales)  # [E, 2I, H], rows gate/up interleaved
    want1 = torch.zeros(e, 256, 256)
    want1[:, :i, :h] = w1[:, 1::2]  # up
    want1[:, 128:128 + i, :h] = w1[:, 0::2]  # gate
    assert torch.equal(dequantize(r.fc1_blocks, r.fc1_scales), want1)
    want2 = torch.zeros(e, 256, 128)
    want2[:, :h, :i] = dequantize(w.down_blocks, w.down_scales)
    assert torch.equal(dequantize(r.fc2_blocks, r.fc2_scales), want2)

    b1 = torch.zeros(e, 256)
    b1[:, :i], b1[:, 128:128 + i] = w.gate_up_bias[:, 1::2], w.gate_up_bias[:, 0::2]
    assert torch.equal(r.fc1_bias, b1)
    assert torch.equal(r.fc2_bias[:, :h], w.down_bias) and not r.fc2_bias[:, h:].any()
    # padding: zero codes under scale 1.0 (no subnormal or NaN scale byte)
    assert not r.fc1_blocks[:, i:128].any() and not r.fc1_blocks[:, :, h // 32:].any()
    assert (r.fc1_scales[:, i:128] == 127).all() and (r.fc2_scales[:, :, i // 32:] == 127).all()


def test_aligned_sizes_are_only_reordered():
    w = experts(2, 128, 128)
    r = relayout(w)
    assert torch.equal(r.fc2_blocks, w.down_blocks) and torch.equal(r.fc2_scales, w.down_scales)
    order = torch.cat((torch.arange(1, 256, 2), torch.arange(0, 256, 2)))  # [up; gate]
    assert torch.equal(r.fc1_blocks, w.gate_up_blocks[:, order])


def cutlass_semantics(x, topk_weights, topk_ids, r: Relayout, alpha, beta, limit):
    """What FlashInfer's fused MoE computes on re-laid experts (its SwiGLU: first half up,
    second half gate): activations padded to Hp, output cropped back to H."""
    t, h = x.shape
    hp, ip = r.fc2_blocks.shape[1], r.fc1_blocks.shape[1] // 2
    xp = torch.nn.functional.pad(x.float(), (0, hp - h))
    w1, w2 = dequantize(r.fc1_blocks, r.fc1_scales), dequantize(r.fc2_blocks, r.fc2_scales)
    out = torch.zeros(t, hp)
    for row in range(t):
        for weight, e in zip(topk_weights[row], topk_ids[row].tolist()):
            fc1 = w1[e] @ xp[row] + r.fc1_bias[e]
            up, gate = fc1[:ip].clamp(-limit, limit), fc1[ip:].clamp(max=limit)
            act = (up + beta) * gate * torch.sigmoid(alpha * gate)
            out[row] += weight * (w2[e] @ act + r.fc2_bias[e])
    return out[:, :h]


def test_kernel_semantics_on_relayout_equal_moe_torch():
    e, h, i, t, k = 4, 160, 96, 6, 2
    w = experts(e, h, i, seed=3)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(4))
    topk_weights, topk_ids = routing(t, e, k)
    got = cutlass_semantics(x, topk_weights, topk_ids, relayout(w), w.alpha, 1.0, w.limit)
    torch.testing.assert_close(got, moe_torch(x, topk_weights, topk_ids, w), rtol=1e-5, atol=1e-5)


def test_prepare_cutlass_wires_the_layout_and_swiglu_constants():
    w = experts(3, 160, 96)
    seen = {}

    def stub_layout(r: Relayout, variant: str):  # stands in for FlashInfer's CUDA kernels
        seen["variant"] = variant
        return r.fc1_blocks.flatten(2), r.fc2_blocks.flatten(2), [r.fc1_scales, r.fc2_scales]

    p = prepare_cutlass(w, variant="w4a16", max_num_tokens=512, layout=stub_layout)
    r = relayout(w)
    assert seen == {"variant": "w4a16"} and p.variant == "w4a16" and p.max_num_tokens == 512
    assert torch.equal(p.fc1_weights, r.fc1_blocks.flatten(2)) and p.hidden_size == 160
    assert p.fc1_bias.dtype == torch.bfloat16 and p.fc1_bias.shape == (3, 256)
    torch.testing.assert_close(p.fc1_bias, r.fc1_bias.to(torch.bfloat16))
    torch.testing.assert_close(p.fc2_bias, r.fc2_bias.to(torch.bfloat16))
    for tensor, value in ((p.alpha, 1.702), (p.beta, 1.0), (p.limit, 7.0)):
        assert tensor.dtype == torch.float32 and tensor.shape == (3,)
        torch.testing.assert_close(tensor, torch.full((3,), value))


@dataclasses.dataclass
class Prepared:
    weights: ExpertWeights


def test_loading_prepares_each_layer_once_and_releases_the_checkpoint_tensors():
    config = ModelConfig.from_dict(preset_config("tiny"), GENERATION_CONFIG)
    calls: list[ExpertWeights] = []

    def prepare(w: ExpertWeights) -> Prepared:
        calls.append(w)
        return Prepared(ExpertWeights(*(t.clone() for t in dataclasses.astuple(w)[:6]),
                                      w.alpha, w.limit))

    def moe(x, topk_weights, topk_ids, w):
        assert isinstance(w, Prepared)
        return moe_torch(x, topk_weights, topk_ids, w.weights)

    kernels = Kernels(moe=moe, prepare_experts=prepare)
    model = load_model(None, config, dtype=torch.float32, device=torch.device("cpu"),
                       kernels=kernels, load_format="dummy")
    assert len(calls) == config.num_hidden_layers
    experts_module = model.model.layers[0].mlp.experts
    assert all(p.numel() == 0 for p in experts_module.parameters())
    with pytest.raises(AssertionError, match="released"):
        experts_module.weights()
    x = torch.randn(5, config.hidden_size)
    topk_weights, topk_ids = routing(5, config.num_local_experts, config.num_experts_per_tok)
    want = moe_torch(x, topk_weights, topk_ids, experts_module.prepared.weights)
    torch.testing.assert_close(experts_module(x, topk_weights, topk_ids), want)
    experts_module.prepare()  # a second call changes nothing
    assert len(calls) == config.num_hidden_layers
    assert isinstance(experts_module.prepared, Prepared)
