"""config.json contents of the published gpt-oss models and of tinyoss's built-in `tiny` model.

`tiny` keeps every structural feature of the real models (sinks, sliding and full layers, the
128-token window, YaRN, top-4 MoE in MXFP4, the real 201088-token vocabulary with harmony's
special ids) at a size a CPU runs in milliseconds.
"""

from __future__ import annotations

import copy

GPT_OSS_20B: dict = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}

GPT_OSS_120B: dict = {
    **copy.deepcopy(GPT_OSS_20B),
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}

TINY: dict = {
    **copy.deepcopy(GPT_OSS_20B),
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
}

GENERATION_CONFIG: dict = {
    "bos_token_id": 199998,
    "do_sample": True,
    "eos_token_id": [200002, 199999, 200012],
    "pad_token_id": 199999,
    "transformers_version": "4.55.0.dev0",
}

PRESETS: dict[str, dict] = {"tiny": TINY, "gpt-oss-20b": GPT_OSS_20B, "gpt-oss-120b": GPT_OSS_120B}


def preset_config(name: str) -> dict:
    """A copy of a preset's config.json dict; accepts `openai/` prefixed names too."""
    key = name.removeprefix("openai/")
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[key])
