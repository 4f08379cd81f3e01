"""EAGLE-3 drafts: every published layout parses, loads and runs; the KV cache is consistent."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinyoss.config import ConfigError, ModelConfig
from tinyoss.model.eagle3 import Eagle3Config, Eagle3KVCache, load_draft
from tinyoss.model.loader import CheckpointError
from tinyoss.model.presets import preset_config
from tinyoss.model.rope import apply_rope, cos_sin_cache
from tinyoss.tools.eagle3_checkpoints import LAYOUTS, aux_layer_ids, write_synthetic_draft

TARGET = ModelConfig.from_dict(preset_config("tiny"))
T = 7


@pytest.fixture(scope="module")
def head():
    """Stands in for the target's embeddings and lm_head (both [vocab, hidden])."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=g) * 0.05


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    return {name: write_synthetic_draft(root / name, name, TARGET, seed=i)
            for i, name in enumerate(LAYOUTS)}


def _load(folder, head, **kw):
    return load_draft(folder, TARGET, dtype=torch.float32, target_embed=head,
                      target_lm_head=head, max_len=64, **kw)


def _reference(folder, c, head, aux, ids):
    """vLLM's llama_eagle3 math written out flat, without a cache, from the raw tensors."""
    w = {k: v.float() for k, v in load_file(folder / "model.safetensors").items()
         if v.is_floating_point()}
    w = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}
    p = "layers.0."

    def norm(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w[name]

    if c.norm_before_fc:
        aux = norm(aux, "input_norm.weight")
    h = aux @ w["fc.weight"].T
    emb = w.get("embed_tokens.weight", head)[ids]
    hn = norm(h, p + "hidden_norm.weight")
    res = hn if c.norm_before_residual else h
    x = torch.cat([norm(emb, p + "input_layernorm.weight"), hn], -1)
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(T, -1, c.head_dim)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(T, -1, c.head_dim)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, -1, c.head_dim)
    q, k = apply_rope(q, k, torch.arange(T), cos_sin_cache(TARGET.rope, c.head_dim, T, "cpu"))
    rep = c.num_attention_heads // c.num_key_value_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("thd,shd->hts", q, k) / c.head_dim**0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    a = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, -1)
    x = a @ w[p + "self_attn.o_proj.weight"].T + res
    m = norm(x, p + "post_attention_layernorm.weight")
    y = (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T)
         * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T + x
    return norm(y, "norm.weight")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_loads_and_runs(layout, drafts, head):
    folder = drafts[layout]
    model = _load(folder, head)
    c = model.config
    assert c.aux_layer_ids == tuple(aux_layer_ids(layout, TARGET.num_hidden_layers))
    assert c.layout == ("speculators" if layout == "speculators" else "hf")
    assert c.rope == TARGET.rope and c.vocab_size == TARGET.vocab_size
    assert (c.norm_before_fc, c.norm_before_residual) == ((True, True) if layout ==
                                                         "speculators" else (False, False))
    raw = load_file(folder / "model.safetensors")
    assert (model.embed_tokens.weight.data_ptr() == head.data_ptr()) == (layout != "speculators")
    if layout == "nvidia":  # the target's head, no vocabulary map
        assert c.draft_vocab_size == TARGET.vocab_size and model.draft_to_target is None
        assert model.lm_head.weight.data_ptr() == head.data_ptr()
    else:
        assert c.draft_vocab_size == 64 and 200002 in model.draft_to_target.tolist()
        want = raw["d2t"].long() + torch.arange(64)
        assert torch.equal(model.draft_to_target, want)
        if "t2d" in raw:
            assert torch.equal(raw["t2d"].nonzero().flatten(), want)

    g = torch.Generator().manual_seed(7)
    aux = torch.randn(T, 3 * TARGET.hidden_size, generator=g)
    ids = torch.randint(0, TARGET.vocab_size, (T,), generator=g)
    pos = torch.arange(T)
    with torch.no_grad():
        once, fb_once = model.prefill(aux, ids, pos, Eagle3KVCache(c, 64, dtype=torch.float32))
        torch.testing.assert_close(once, _reference(folder, c, head, aux, ids),
                                   rtol=1e-4, atol=1e-4)
        # the same tokens through a 3-token prefill and single steps: the cache is consistent
        cache = Eagle3KVCache(c, 64, dtype=torch.float32)
        hidden = model.combine(aux)
        outs = [model.forward(hidden[:3], ids[:3], pos[:3], cache)[0]]
        for i in range(3, T):
            outs.append(model.step(hidden[i], ids[i], i, cache)[0][None])
        torch.testing.assert_close(torch.cat(outs), once, rtol=1e-5, atol=1e-5)
        assert cache.length == T

        logits = model.logits(once)
        assert logits.shape == (T, TARGET.vocab_size)
        proposed = model.propose_ids(once)
        assert torch.equal(proposed, logits.argmax(-1))
        if model.draft_to_target is not None:
            assert torch.isinf(logits).sum(-1).eq(TARGET.vocab_size - 64).all()
            assert set(proposed.tolist()) <= set(model.draft_to_target.tolist())
        # drafting on: feedback + proposal -> next position; a rejected step is overwritten
        out, fb = model.step(fb_once[-1], proposed[-1], T, cache)
        cache.truncate(T)
        again, _ = model.step(fb_once[-1], proposed[-1], T, cache)
        torch.testing.assert_close(out, again)


def test_default_aux_layers_and_keys():
    big = ModelConfig.from_dict(preset_config("gpt-oss-120b"))
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 2880,
           "intermediate_size": 17280, "num_attention_heads": 64, "num_key_value_heads": 8,
           "head_dim": 64, "num_hidden_layers": 1, "vocab_size": 201088}
    assert Eagle3Config.from_dict(raw, big).aux_layer_ids == (2, 18, 33)  # vLLM's default
    top = Eagle3Config.from_dict(raw | {"eagle_aux_hidden_state_layer_ids": [1, 17, 33]}, big)
    nested = Eagle3Config.from_dict(
        raw | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]}}, big)
    assert (top.aux_layer_ids, nested.aux_layer_ids) == ((1, 17, 33), (1, 17, 32))
    with pytest.raises(ConfigError, match="eagle_config.eagle_aux_hidden_state_layer_ids"):
        Eagle3Config.from_dict(raw | {"eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [1, 17, 36]}}, big)


def _edit_config(folder, change):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


def _edit_tensors(folder, change):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize("layout, case, error, match", [
    ("specforge", "missing", CheckpointError, "tensor midlayer.mlp.up_proj.weight is missing"),
    ("specforge", "shape", CheckpointError, r"tensor fc.weight in .* has shape \[128, 383\]"),
    ("specforge", "d2t", CheckpointError, "tensor d2t is missing"),
    ("nvidia", "rope", ConfigError, r"config.json: rope_scaling.factor is 8.0"),
    ("speculators", "rope", ConfigError, r"transformer_layer_config.rope_theta is 10000"),
])
def test_errors_name_the_tensor_or_key(layout, case, error, match, tmp_path):
    folder = write_synthetic_draft(tmp_path / layout, layout, TARGET)
    if case == "missing":
        _edit_tensors(folder, lambda t: t.pop("midlayer.mlp.up_proj.weight"))
    elif case == "shape":
        _edit_tensors(folder, lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, :-1].clone()))
    elif case == "d2t":
        _edit_tensors(folder, lambda t: t.pop("d2t"))
    elif layout == "nvidia":
        _edit_config(folder, lambda c: c["rope_scaling"].update(factor=8.0))
    else:
        _edit_config(folder, lambda c: c["transformer_layer_config"].update(rope_theta=10000))
    head = torch.zeros(TARGET.vocab_size, TARGET.hidden_size)
    with pytest.raises(error, match=match):
        _load(folder, head)
