"""Synthetic EAGLE-3 drafts for gpt-oss in each published layout, with random weights.

Config keys, tensor names and dtypes follow the published formats (see tinyoss/model/eagle3.py);
`small=True` shrinks the draft's own dimensions (heads, intermediate, draft vocabulary) for
tests. The draft's hidden size is always the target's: it shares the target's embeddings.

    nvidia       ModelOpt export (nvidia/gpt-oss-120b-Eagle3*): Llama config + eagle_config,
                 layers.0.*, no lm_head / d2t / embeddings (uses the target's 201088-token head)
    specforge    SpecForge / lmsys/EAGLE3-gpt-oss-120b-bf16: LlamaForCausalLMEagle3, midlayer.*,
                 32000-token lm_head, d2t (I64) and t2d (BOOL)
    speculators  RedHatAI/gpt-oss-*-speculator.eagle3: speculators config (Llama config under
                 transformer_layer_config), layers.0.*, input_norm (norm_before_fc),
                 embed_tokens, lm_head, d2t, t2d
    nebius       nebius/EAGLE3-gpt-oss-*: HF Llama draft with a top-level aux-id key and an I32
                 d2t (no t2d); inferred from the hub's tensor-type summary, not from its files
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tinyoss.config import ModelConfig
from tinyoss.model.eagle3 import default_aux_layer_ids

LAYOUTS = ("nvidia", "specforge", "speculators", "nebius")
ALIASES = {
    **{f"nvidia/gpt-oss-120b-Eagle3{s}": "nvidia"
       for s in ("", "-v2", "-v3", "-short-context", "-long-context", "-throughput")},
    "lmsys/EAGLE3-gpt-oss-120b-bf16": "specforge",
    "RedHatAI/gpt-oss-20b-speculator.eagle3": "speculators",
    "RedHatAI/gpt-oss-120b-speculator.eagle3": "speculators",
    "nebius/EAGLE3-gpt-oss-20b": "nebius",
    "nebius/EAGLE3-gpt-oss-120b": "nebius",
}
PUBLISHED = {"num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
             "intermediate_size": 17280, "draft_vocab_size": 32000}
SMALL = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "intermediate_size": 256, "draft_vocab_size": 64}


def aux_layer_ids(layout: str, num_layers: int) -> list[int]:
    """The ids each trainer writes by default; a fallback when the formula collapses on a
    target with few layers (tiny has 4)."""
    formulas = {
        "nvidia": [1, num_layers // 2 - 1, num_layers - 4],  # ModelOpt's default
        "specforge": [1, num_layers // 2 - 1, num_layers - 3],  # SpecForge's gpt-oss configs
    }
    ids = formulas.get(layout, list(default_aux_layer_ids(num_layers)))
    if ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= num_layers:
        ids = [0, num_layers // 2, num_layers - 1]
    return ids


def _rope(target: ModelConfig) -> dict:
    r = target.rope
    return {"beta_fast": r.beta_fast, "beta_slow": r.beta_slow, "factor": r.factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
            "rope_type": "yarn", "truncate": r.truncate}


def _llama(target: ModelConfig, d: dict, *, rope: bool) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "attention_bias": False,
        "head_dim": d["head_dim"],
        "hidden_act": "silu",
        "hidden_size": target.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": d["intermediate_size"],
        "max_position_embeddings": target.max_position_embeddings if rope else 4096,
        "model_type": "llama",
        "num_attention_heads": d["num_attention_heads"],
        "num_hidden_layers": 1,
        "num_key_value_heads": d["num_key_value_heads"],
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": target.vocab_size,
    }
    if rope:
        cfg |= {"rope_scaling": _rope(target), "rope_theta": target.rope.theta}
    return cfg


def draft_config(layout: str, target: ModelConfig, d: dict) -> dict:
    """config.json of a draft in `layout` with dimensions `d` (keys of PUBLISHED + aux ids)."""
    ids = d["aux_layer_ids"]
    if layout == "nvidia":
        return _llama(target, d, rope=True) | {
            "attention_dropout": 0.0, "bos_token_id": target.bos_token_id,
            "draft_vocab_size": target.vocab_size, "eos_token_id": target.eos_token_ids[0],
            "mlp_bias": False, "pad_token_id": target.pad_token_id, "pretraining_tp": 1,
            "transformers_version": "4.55.0",
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True,
                "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                "use_mtp_layernorm": False, "next_layer_regular": True,
                "parallel_draft_step": 1, "parallel_draft_heads_num_layers": None,
            },
        }
    if layout == "specforge":
        return _llama(target, d, rope=False) | {
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids},
            "pad_token_id": 0, "transformers_version": "4.52.3",
            "draft_vocab_size": d["draft_vocab_size"],
        }
    if layout == "nebius":
        return _llama(target, d, rope=False) | {
            "draft_vocab_size": d["draft_vocab_size"],
            "eagle_aux_hidden_state_layer_ids": ids,
        }
    if layout == "speculators":
        layer = _llama(target, d, rope=True) | {
            "architectures": ["LlamaForCausalLM"], "attention_dropout": 0.0, "mlp_bias": False,
            "pretraining_tp": 1,
        }
        for key in ("tie_word_embeddings", "torch_dtype"):
            layer.pop(key)
        verifier = "openai/gpt-oss-120b" if target.num_hidden_layers > 24 else "openai/gpt-oss-20b"
        return {
            "architectures": ["Eagle3Speculator"],
            "draft_vocab_size": d["draft_vocab_size"],
            "eagle_aux_hidden_state_layer_ids": ids,
            "has_no_defaults_at_init": False,
            "norm_before_fc": True,
            "norm_before_residual": True,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                      "speculative_tokens": 3, "verifier_accept_k": 1}],
                "verifier": {"architectures": ["GptOssForCausalLM"], "name_or_path": verifier},
            },
            "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "target_hidden_size": None,
            "torch_dtype": "bfloat16",
            "transformer_layer_config": layer,
        }
    raise ValueError(f"unknown EAGLE-3 layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


def draft_tensors(layout: str, target: ModelConfig, d: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of a `layout` draft, named and typed as published (random values)."""
    g = torch.Generator().manual_seed(seed)
    h, vocab, dv = target.hidden_size, target.vocab_size, d["draft_vocab_size"]
    q, kv, inter = d["num_attention_heads"] * d["head_dim"], \
        d["num_key_value_heads"] * d["head_dim"], d["intermediate_size"]
    p = "midlayer." if layout in ("specforge", "nebius") else "layers.0."
    shapes = {
        f"{p}input_layernorm.weight": (h,),
        f"{p}hidden_norm.weight": (h,),
        f"{p}post_attention_layernorm.weight": (h,),
        f"{p}self_attn.q_proj.weight": (q, 2 * h),
        f"{p}self_attn.k_proj.weight": (kv, 2 * h),
        f"{p}self_attn.v_proj.weight": (kv, 2 * h),
        f"{p}self_attn.o_proj.weight": (h, q),
        f"{p}mlp.gate_proj.weight": (inter, h),
        f"{p}mlp.up_proj.weight": (inter, h),
        f"{p}mlp.down_proj.weight": (h, inter),
        "fc.weight": (h, 3 * h),
        "norm.weight": (h,),
    }
    if layout == "speculators":
        shapes |= {"input_norm.weight": (3 * h,), "embed_tokens.weight": (vocab, h)}
    if layout != "nvidia":
        shapes["lm_head.weight"] = (dv, h)
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if len(shape) == 1:  # norm weights around 1
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        out[name] = t.to(torch.bfloat16)
    if layout != "nvidia":
        # a sorted draft vocabulary that keeps the harmony specials (ids near the top)
        specials = torch.tensor([200002, 200005, 200006, 200008, 200012])
        picks = torch.randperm(vocab - 1000, generator=g)
        picks = picks[~torch.isin(picks, specials)][: dv - len(specials)]
        ids = torch.cat([picks, specials]).unique().sort().values
        assert len(ids) == dv, f"draft vocabulary of {dv} tokens needs {dv} distinct ids"
        d2t = ids - torch.arange(dv)
        out["d2t"] = d2t.to(torch.int32 if layout == "nebius" else torch.int64)
        if layout != "nebius":
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[ids] = True
            out["t2d"] = t2d
    return out


def write_synthetic_draft(
    folder: str | Path,
    layout: str,
    target: ModelConfig,
    *,
    seed: int = 0,
    small: bool = True,
    dims: dict | None = None,
) -> Path:
    """Writes config.json and model.safetensors of a random draft in `layout` (a name from
    LAYOUTS or a hub id from ALIASES). `dims` overrides keys of PUBLISHED / SMALL and
    `aux_layer_ids`."""
    layout = ALIASES.get(layout, layout)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown EAGLE-3 layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    d = dict(SMALL if small else PUBLISHED)
    d["aux_layer_ids"] = aux_layer_ids(layout, target.num_hidden_layers)
    d |= dims or {}
    if d["draft_vocab_size"] < 8 or d["draft_vocab_size"] > target.vocab_size - 1000:
        raise ValueError(f"draft_vocab_size {d['draft_vocab_size']} out of range")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = draft_config(layout, target, d)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(draft_tensors(layout, target, d, seed), folder / "model.safetensors",
              metadata={"format": "pt"})
    return folder


def main() -> None:
    """`python -m tinyoss.tools.eagle3_checkpoints OUT --layout nvidia --target gpt-oss-20b`:
    a random full-size draft (for benchmarks; `--small` for tests)."""
    import argparse

    from tinyoss.model.presets import PRESETS, preset_config

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("out")
    p.add_argument("--layout", default="nvidia", choices=sorted(LAYOUTS + tuple(ALIASES)))
    p.add_argument("--target", default="gpt-oss-20b", choices=sorted(PRESETS))
    p.add_argument("--small", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    target = ModelConfig.from_dict(preset_config(args.target))
    print(write_synthetic_draft(args.out, args.layout, target, seed=args.seed, small=args.small))


if __name__ == "__main__":
    main()
