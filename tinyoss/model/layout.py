"""The Hugging Face gpt-oss checkpoint layout: every tensor's name, shape and dtype, in file order,
and the magnitudes tinyoss gives synthetic (random) weights of that layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tinyoss.config import ModelConfig

# Per-layer tensor order of the published index (attention first, then MLP, then the second norm).
_LAYER_ORDER = (
    "input_layernorm.weight",
    "self_attn.o_proj.bias",
    "self_attn.o_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.sinks",
    "mlp.router.bias",
    "mlp.router.weight",
    "mlp.experts.gate_up_proj_bias",
    "mlp.experts.gate_up_proj_blocks",
    "mlp.experts.gate_up_proj_scales",
    "mlp.experts.down_proj_bias",
    "mlp.experts.down_proj_blocks",
    "mlp.experts.down_proj_scales",
    "post_attention_layernorm.weight",
)

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def layer_tensors(c: ModelConfig, i: int) -> dict[str, TensorSpec]:
    h, e, inter = c.hidden_size, c.num_local_experts, c.intermediate_size
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "input_layernorm.weight": ((h,), "BF16"),
        "post_attention_layernorm.weight": ((h,), "BF16"),
        "self_attn.q_proj.weight": ((c.q_size, h), "BF16"),
        "self_attn.q_proj.bias": ((c.q_size,), "BF16"),
        "self_attn.k_proj.weight": ((c.kv_size, h), "BF16"),
        "self_attn.k_proj.bias": ((c.kv_size,), "BF16"),
        "self_attn.v_proj.weight": ((c.kv_size, h), "BF16"),
        "self_attn.v_proj.bias": ((c.kv_size,), "BF16"),
        "self_attn.o_proj.weight": ((h, c.q_size), "BF16"),
        "self_attn.o_proj.bias": ((h,), "BF16"),
        "self_attn.sinks": ((c.num_attention_heads,), "BF16"),
        "mlp.router.weight": ((e, h), "BF16"),
        "mlp.router.bias": ((e,), "BF16"),
        "mlp.experts.gate_up_proj_blocks": ((e, 2 * inter, h // 32, 16), "U8"),
        "mlp.experts.gate_up_proj_scales": ((e, 2 * inter, h // 32), "U8"),
        "mlp.experts.gate_up_proj_bias": ((e, 2 * inter), "BF16"),
        "mlp.experts.down_proj_blocks": ((e, h, inter // 32, 16), "U8"),
        "mlp.experts.down_proj_scales": ((e, h, inter // 32), "U8"),
        "mlp.experts.down_proj_bias": ((e, h), "BF16"),
    }
    prefix = f"model.layers.{i}."
    return {prefix + k: TensorSpec(prefix + k, *shapes[k]) for k in _LAYER_ORDER}


def checkpoint_tensors(c: ModelConfig) -> list[TensorSpec]:
    """All tensors in the order of the published checkpoints (layers sorted as strings)."""
    specs: list[TensorSpec] = []
    for i in sorted(range(c.num_hidden_layers), key=str):
        specs.extend(layer_tensors(c, i).values())
    v, h = c.vocab_size, c.hidden_size
    specs.append(TensorSpec("model.embed_tokens.weight", (v, h), "BF16"))
    specs.append(TensorSpec("model.norm.weight", (h,), "BF16"))
    if not c.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (v, h), "BF16"))
    return specs


def synthetic_init(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a random weight: unit-variance activations, so outputs stay lively.

    Norm scales sit near 1. Gate/up weights are 3x larger so some SwiGLU inputs pass the clamp
    at 7; lm_head is 2x so next-token distributions are peaked enough to differ between prompts.
    """
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return 1.0, 0.1
    if name.endswith("sinks") or "embed_tokens" in name:
        return 0.0, 1.0
    if name.endswith("bias"):
        return 0.0, 0.1
    fan_in = shape[-2] * 32 if name.endswith("_blocks") else shape[-1]
    scale = (
        3.0 if name.endswith("gate_up_proj_blocks") else 2.0 if name == "lm_head.weight" else 1.0
    )
    return 0.0, scale / math.sqrt(fan_in)
