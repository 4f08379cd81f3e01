"""EAGLE-3 draft models for gpt-oss: config parsing, loading, and a torch reference forward.

A draft is one Llama-style decoder layer over the target's hidden states. Per token it takes the
hidden states that enter three target layers (`aux_layer_ids`, vLLM's convention: id i is the
residual stream after target layers 0..i-1), fuses them with `fc` (3 * H_target -> H), and runs
the layer on cat(input_layernorm(embed(token)), hidden_norm(h)) (2H wide q/k/v). The math is
vLLM's `llama_eagle3.py`:

    h   = fc(input_norm(aux) if norm_before_fc else aux)           # once, on target states
    res = hidden_norm(h) if norm_before_residual else h
    x   = o_proj(attn(cat(input_layernorm(embed(t)), hidden_norm(h)))) + res
    y   = mlp(post_attention_layernorm(x)) + x
    out = norm(y)  -> lm_head (draft vocab) -> d2t -> target ids
    next h = out if norm_output else y                              # fed back at the next step

Published layouts differ in where the config keeps things and in which tensors they ship:
`hf` (ModelOpt/nvidia, SpecForge/lmsys, nebius: a Llama config.json, aux ids in `eagle_config`,
tensors `midlayer.*` or `layers.0.*`) and `speculators` (RedHat: the Llama config nested under
`transformer_layer_config`, flags at the top level). Embeddings and lm_head are the draft's own
when it ships them, else the target's (passed in). `token_ids[i]` is the token that follows the
target state `aux[i]` (the caller shifts ids left by one, as vLLM does).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from tinyoss.config import ConfigError, ModelConfig, RopeConfig
from tinyoss.model.loader import CheckpointError, SafetensorsCheckpoint
from tinyoss.model.rope import apply_rope, cos_sin_cache

_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator",
                  "Eagle3DraftModel", "LlamaForCausalLM")
_FLOAT_DTYPES = ("BF16", "F16", "F32")
_ID_DTYPES = ("I64", "I32")

# The draft layer's attention: q [T, Hq, D], k and v [T, Hk, D] (q and k not yet rotated),
# positions [T] -> [T, Hq * D]; it rotates, stores the new keys and values, and attends.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default for gpt-oss (and Llama) targets when the draft config names none."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    target_hidden_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    rope: RopeConfig = field(default_factory=RopeConfig)
    layout: str = "hf"  # "hf" (Llama config.json) or "speculators"
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    attention_bias: bool = False
    sliding_window: int = 0  # 0: the draft layer sees the whole context
    source: str = "config.json"  # where the config came from, for error messages

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_folder(cls, folder: str | Path, target: ModelConfig) -> Eagle3Config:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: an EAGLE-3 draft folder needs config.json")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(cfg, target, source=str(path))

    @classmethod
    def from_dict(
        cls, cfg: dict, target: ModelConfig, *, source: str = "config.json"
    ) -> Eagle3Config:
        """Any published layout -> one config, checked against the target it drafts for."""

        def bad(key: str, msg: str) -> ConfigError:
            return ConfigError(f"{source}: {key} {msg}")

        archs = cfg.get("architectures") or []
        if archs and not any(a in _ARCHITECTURES for a in archs):
            raise bad("architectures", f"is {archs}; expected an EAGLE-3 Llama draft "
                      f"({', '.join(_ARCHITECTURES[:3])})")
        speculators = "transformer_layer_config" in cfg or "speculators_model_type" in cfg
        if speculators:
            kind = cfg.get("speculators_model_type")
            if kind != "eagle3":
                raise bad("speculators_model_type", f"is {kind!r}; only 'eagle3' drafts load")
            layer = cfg.get("transformer_layer_config")
            if not isinstance(layer, dict):
                raise bad("transformer_layer_config", "is missing or not an object")
            flags, prefix = cfg, "transformer_layer_config."
            # speculators (and vLLM reading it) default to the norm before the residual
            nbr_default = True
        else:
            layer, prefix = cfg, ""
            flags = {**cfg, **(cfg.get("eagle_config") or {})}
            nbr_default = False
        if flags.get("use_aux_hidden_state", True) is False:
            raise bad("eagle_config.use_aux_hidden_state", "is false: that is an EAGLE-1 draft, "
                      "tinyoss runs EAGLE-3 drafts (three target layers through fc)")
        model_type = layer.get("model_type", "llama")
        if model_type != "llama":
            raise bad(f"{prefix}model_type", f"is {model_type!r}; only Llama-style drafts load")
        for key, want in (("num_hidden_layers", 1), ("hidden_act", "silu")):
            if layer.get(key, want) != want:
                raise bad(f"{prefix}{key}", f"is {layer[key]!r}; tinyoss runs {want!r}")
        for key in ("mlp_bias", "tie_word_embeddings"):
            if layer.get(key) or flags.get(key):
                raise bad(key, "is true: no gpt-oss draft uses it and tinyoss does not run it")
        if flags.get("fc_norm"):
            raise bad("fc_norm", "is true (per-layer norms before fc): not supported")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads")
                   if k not in layer]
        if missing:
            raise bad(prefix + missing[0], "is missing")
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        vocab = int(layer.get("vocab_size", target.vocab_size))
        if vocab != target.vocab_size:
            raise bad(f"{prefix}vocab_size", f"is {vocab}, but the target's vocabulary has "
                      f"{target.vocab_size} tokens: this draft is for another model")
        target_hidden = int(flags.get("target_hidden_size") or hidden)
        if target_hidden != target.hidden_size:
            raise bad("target_hidden_size" if flags.get("target_hidden_size") else
                      f"{prefix}hidden_size", f"is {target_hidden}, but the target's hidden "
                      f"size is {target.hidden_size}")
        aux_key = "eagle_aux_hidden_state_layer_ids"
        ids = flags.get(aux_key)
        where = (aux_key if aux_key in cfg else f"eagle_config.{aux_key}") if ids else aux_key
        ids = tuple(int(i) for i in ids) if ids else default_aux_layer_ids(
            target.num_hidden_layers)
        if (len(ids) != 3 or list(ids) != sorted(set(ids)) or ids[0] < 0
                or ids[-1] >= target.num_hidden_layers):
            raise bad(where, f"is {list(ids)}: need 3 increasing target layer ids in "
                      f"[0, {target.num_hidden_layers})")
        layer_types = layer.get("layer_types") or []
        window = 0
        if layer_types and layer_types[0] == "sliding_attention":
            window = int(layer.get("sliding_window") or 0)
            if window <= 0:
                raise bad(f"{prefix}sliding_window", "must be positive for a sliding layer")
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads", heads)),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            intermediate_size=int(layer["intermediate_size"]),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            target_hidden_size=target_hidden,
            vocab_size=vocab,
            draft_vocab_size=int(flags.get("draft_vocab_size") or vocab),
            aux_layer_ids=ids,
            rope=_draft_rope(layer, target.rope, f"{source}: {prefix}"),
            layout="speculators" if speculators else "hf",
            norm_before_residual=bool(flags.get("norm_before_residual", nbr_default)),
            norm_before_fc=bool(flags.get("norm_before_fc", False)),
            norm_output=bool(flags.get("norm_output", False)),
            attention_bias=bool(layer.get("attention_bias", False)),
            sliding_window=window,
            source=source,
        )


def _draft_rope(layer: dict, target: RopeConfig, where: str) -> RopeConfig:
    """The target's RoPE: a draft that states other settings is refused, naming the key.

    NOTE: a draft config without rope keys gets the target's YaRN. vLLM would build the draft
    from the config alone (transformers' Llama default, theta 10000, no scaling); SpecForge
    configs for gpt-oss state no rope keys."""
    theta = layer.get("rope_theta")
    params = None
    for key in ("rope_scaling", "rope_parameters"):
        if layer.get(key):
            params, pkey = layer[key], key
            break
    if params is not None:
        theta = params.get("rope_theta", theta)
    if theta is not None and float(theta) != target.theta:
        key = "rope_theta" if "rope_theta" in layer else f"{pkey}.rope_theta"
        raise ConfigError(f"{where}{key} is {theta}, but the target uses {target.theta:g}: "
                          "the draft must rotate positions as the target does")
    if params is None:
        return target
    rope_type = params.get("rope_type", params.get("type", "default"))
    want_type = "yarn" if target.yarn else "default"
    if rope_type != want_type:
        raise ConfigError(f"{where}{pkey}.rope_type is {rope_type!r}, but the target uses "
                          f"{want_type!r}")
    checks = {"factor": target.factor, "beta_fast": target.beta_fast,
              "beta_slow": target.beta_slow, "truncate": target.truncate,
              "original_max_position_embeddings": target.original_max_position_embeddings}
    for key, want in checks.items():
        if key in params and params[key] is not None and params[key] != want:
            raise ConfigError(f"{where}{pkey}.{key} is {params[key]!r}, but the target uses "
                              f"{want!r}: the draft must rotate positions as the target does")
    return target


# -- the network ------------------------------------------------------------------------------


class Eagle3KVCache:
    """One sequence's draft K/V, indexed by position: slot p holds position p. A rejected draft
    is rolled back by `truncate`, or simply overwritten when that position is written again."""

    def __init__(self, config: Eagle3Config, max_len: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        shape = (max_len, config.num_key_value_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # positions [0, length) hold valid entries

    @property
    def max_len(self) -> int:
        return self.k.shape[0]

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        end = int(positions.max()) + 1
        if end > self.max_len:
            raise ValueError(f"position {end - 1} is past the draft cache ({self.max_len} "
                             "slots): allocate Eagle3KVCache with a larger max_len")
        self.k[positions], self.v[positions] = k, v
        self.length = max(self.length, end)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def attend(self, c: Eagle3Config, rope_cache: torch.Tensor) -> Attend:
        """The draft layer's attention over this cache (q and k not yet rotated)."""

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
            q, k = apply_rope(q, k, positions, rope_cache)
            self.write(positions, k.to(self.k.dtype), v.to(self.v.dtype))
            n, group = self.length, c.num_attention_heads // c.num_key_value_heads
            keys = self.k[:n].to(q.dtype).repeat_interleave(group, dim=1)
            vals = self.v[:n].to(q.dtype).repeat_interleave(group, dim=1)
            scores = torch.einsum("thd,shd->hts", q.float(), keys.float()) / math.sqrt(c.head_dim)
            diff = positions[:, None] - torch.arange(n, device=q.device)[None, :]  # [T, S]
            visible = diff >= 0
            if c.sliding_window:
                visible &= diff < c.sliding_window
            scores = scores.masked_fill(~visible, float("-inf"))
            out = torch.einsum("hts,shd->thd", scores.softmax(-1), vals.float()).to(q.dtype)
            return out.reshape(q.shape[0], -1)

        return attend


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class Linear(nn.Linear):
    """A dense layer computed by `fn` (F.linear; an engine sets its own GEMV kernels)."""

    fn: Callable = staticmethod(F.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight, self.bias)


class _Attention(nn.Module):
    """q, k and v in one matmul (`qkv_proj`: the checkpoint's q_proj, k_proj, v_proj rows)."""

    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.c = c
        self.qkv_proj = Linear(2 * c.hidden_size, c.q_size + 2 * c.kv_size, bias=c.attention_bias)
        self.o_proj = Linear(c.q_size, c.hidden_size, bias=c.attention_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        c = self.c
        q, k, v = self.qkv_proj(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.reshape(-1, c.num_attention_heads, c.head_dim)  # [T, Hq, D]
        k = k.reshape(-1, c.num_key_value_heads, c.head_dim)  # [T, Hk, D]
        v = v.reshape(-1, c.num_key_value_heads, c.head_dim)
        return self.o_proj(attend(q, k, v, positions))


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)


class Eagle3Draft(nn.Module):
    """The draft network; `embed_tokens` / `lm_head` are None when the target's are used."""

    def __init__(self, config: Eagle3Config, *, max_len: int = 4096,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        c = self.config = config
        self.input_norm = (RMSNorm(3 * c.target_hidden_size, c.rms_norm_eps)
                           if c.norm_before_fc else None)
        self.fc = Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.embed_tokens: nn.Embedding | None = None
        self.lm_head: Linear | None = None
        # draft id -> target id (d2t offsets already added); None: the vocabularies coincide
        self.register_buffer("draft_to_target", None)
        self.register_buffer("rope_cache", cos_sin_cache(c.rope, c.head_dim, max_len, device),
                             persistent=False)

    def use_linear(self, fn: Callable) -> None:
        """Computes every dense layer with `fn` (F.linear's signature) from now on."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.fn = fn

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[T, 3 * H_target] target states (aux layers in increasing order) -> [T, H]."""
        if self.input_norm is not None:
            aux_hidden = self.input_norm(aux_hidden)
        return self.fc(aux_hidden)

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                cache: Eagle3KVCache | Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] (fc output, or the previous step's feedback) -> (normed [T, H] for the
        logits, feedback [T, H] for the next draft step). `cache`: this module's own per-sequence
        cache, or the attention of an engine that keeps the draft's K/V in its paged cache."""
        c, layer = self.config, self.midlayer
        if isinstance(cache, Eagle3KVCache):
            if int(positions.max()) >= self.rope_cache.shape[0]:
                raise ValueError(f"position {int(positions.max())} is past the draft's rope "
                                 f"table ({self.rope_cache.shape[0]}): build Eagle3Draft with "
                                 "max_len")
            cache = cache.attend(c, self.rope_cache)
        embeds = layer.input_layernorm(self.embed_tokens(token_ids))  # [T, H]
        normed = layer.hidden_norm(hidden)
        residual = normed if c.norm_before_residual else hidden
        x = torch.cat([embeds, normed], dim=-1)  # [T, 2H]
        x = layer.self_attn(x, positions, cache) + residual
        y = layer.mlp(layer.post_attention_layernorm(x)) + x
        out = self.norm(y)
        return out, (out if c.norm_output else y)

    def prefill(self, aux_hidden: torch.Tensor, token_ids: torch.Tensor,
                positions: torch.Tensor, cache: Eagle3KVCache
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """T tokens at once from the target's states: (normed [T, H], feedback [T, H])."""
        return self.forward(self.combine(aux_hidden), token_ids, positions, cache)

    def step(self, feedback: torch.Tensor, token_id: int | torch.Tensor, position: int,
             cache: Eagle3KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafted token: the previous step's feedback [H] and the token it proposed."""
        device = feedback.device
        ids = torch.as_tensor(token_id, device=device).reshape(1)
        pos = torch.tensor([position], device=device)
        out, fb = self.forward(feedback.reshape(1, -1), ids, pos, cache)
        return out[0], fb[0]

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., target vocab]; tokens outside the draft vocabulary get -inf."""
        draft = self.lm_head(normed)
        if self.draft_to_target is None:
            return draft
        full = draft.new_full((*draft.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.draft_to_target] = draft
        return full

    def propose_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """Greedy proposals as target token ids: argmax over the draft vocabulary, then d2t."""
        ids = self.lm_head(normed).argmax(-1)
        return ids if self.draft_to_target is None else self.draft_to_target[ids]


# -- loading ----------------------------------------------------------------------------------


def expected_tensors(c: Eagle3Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """Required float tensors: checkpoint name -> shape. `prefix`: 'midlayer.' or 'layers.0.'."""
    h, two_h = c.hidden_size, 2 * c.hidden_size
    shapes = {
        "fc.weight": (h, 3 * c.target_hidden_size),
        "norm.weight": (h,),
        f"{prefix}input_layernorm.weight": (h,),
        f"{prefix}hidden_norm.weight": (h,),
        f"{prefix}post_attention_layernorm.weight": (h,),
        f"{prefix}self_attn.q_proj.weight": (c.q_size, two_h),
        f"{prefix}self_attn.k_proj.weight": (c.kv_size, two_h),
        f"{prefix}self_attn.v_proj.weight": (c.kv_size, two_h),
        f"{prefix}self_attn.o_proj.weight": (h, c.q_size),
        f"{prefix}mlp.gate_proj.weight": (c.intermediate_size, h),
        f"{prefix}mlp.up_proj.weight": (c.intermediate_size, h),
        f"{prefix}mlp.down_proj.weight": (h, c.intermediate_size),
    }
    if c.attention_bias:
        for name, size in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size), ("o", h)):
            shapes[f"{prefix}self_attn.{name}_proj.bias"] = (size,)
    if c.norm_before_fc:
        shapes["input_norm.weight"] = (3 * c.target_hidden_size,)
    return shapes


class _Reader:
    """Header checks and reads over a draft's safetensors files; errors name tensor and file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        ckpt = SafetensorsCheckpoint(folder)  # index / shard discovery and its errors
        self.file_of = dict(ckpt.file_of)
        ckpt.close()
        self._handles: dict[str, object] = {}

    def has(self, name: str) -> bool:
        return name in self.file_of

    def _handle(self, name: str):
        file = self.file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(self.folder / file, framework="pt")
        return self._handles[file]

    def read(self, name: str, shape: tuple[int, ...], dtypes: tuple[str, ...],
             why: str = "config.json implies") -> torch.Tensor:
        if name not in self.file_of:
            raise CheckpointError(f"tensor {name} is missing from the EAGLE-3 draft in "
                                  f"{self.folder} ({why} it); the download is incomplete or "
                                  "the draft is not in a supported layout")
        lazy = self._handle(name).get_slice(name)
        got_shape, dtype = tuple(lazy.get_shape()), lazy.get_dtype()
        where = f"tensor {name} in {self.folder / self.file_of[name]}"
        if got_shape != shape:
            raise CheckpointError(f"{where} has shape {list(got_shape)}, but {why} "
                                  f"{list(shape)}")
        if dtype not in dtypes:
            raise CheckpointError(f"{where} has dtype {dtype}, expected {' or '.join(dtypes)}")
        return self._handle(name).get_tensor(name)


def _as_weight(t: torch.Tensor | nn.Module | None) -> torch.Tensor | None:
    return t.weight if isinstance(t, nn.Module) else t


def _fused(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint's q/k/v and gate/up projections as the fused layers that hold them."""
    out = dict(tensors)
    for fused, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj",
                                                 "self_attn.v_proj")),
                         ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))):
        for kind in ("weight", "bias"):
            names = [f"{prefix}{part}.{kind}" for part in parts]
            if names[0] in out:
                out[f"{prefix}{fused}.{kind}"] = torch.cat([out.pop(n) for n in names])
    return out


def load_draft(
    folder: str | Path,
    target: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    target_embed: torch.Tensor | nn.Module | None = None,
    target_lm_head: torch.Tensor | nn.Module | None = None,
    max_len: int | None = None,
) -> Eagle3Draft:
    """Reads a draft folder in any supported layout. The draft's own embed_tokens / lm_head win;
    without them the target's are used (shared, not copied) and must be passed in."""
    folder = Path(folder)
    config = Eagle3Config.from_folder(folder, target)
    reader = _Reader(folder)
    prefix = "midlayer." if reader.has("midlayer.hidden_norm.weight") else "layers.0."
    tensors = {name: reader.read(name, shape, _FLOAT_DTYPES)
               for name, shape in expected_tensors(config, prefix).items()}
    h, vocab, draft_vocab = config.hidden_size, config.vocab_size, config.draft_vocab_size

    if reader.has("lm_head.weight"):
        lm_head = reader.read("lm_head.weight", (draft_vocab, h), _FLOAT_DTYPES,
                              "draft_vocab_size x hidden_size is")
    elif draft_vocab != vocab:
        raise CheckpointError(f"tensor lm_head.weight is missing from the EAGLE-3 draft in "
                              f"{folder}: its draft vocabulary ({draft_vocab} tokens) needs "
                              "its own head")
    else:
        lm_head = _as_weight(target_lm_head)
        if lm_head is None:
            raise CheckpointError(f"the EAGLE-3 draft in {folder} has no lm_head.weight: pass "
                                  "the target's as target_lm_head")
    if reader.has("embed_tokens.weight"):
        embed = reader.read("embed_tokens.weight", (vocab, h), _FLOAT_DTYPES,
                            "vocab_size x hidden_size is")
    else:
        embed = _as_weight(target_embed)
        if embed is None:
            raise CheckpointError(f"the EAGLE-3 draft in {folder} has no embed_tokens.weight: "
                                  "pass the target's as target_embed")
    for name, t, want in (("target_lm_head", lm_head, (draft_vocab, h)),
                          ("target_embed", embed, (vocab, h))):
        if tuple(t.shape) != want:
            raise CheckpointError(f"{name} has shape {list(t.shape)}, expected {list(want)}")

    d2t = None
    if reader.has("d2t"):
        offsets = reader.read("d2t", (draft_vocab,), _ID_DTYPES, "draft_vocab_size is")
        d2t = torch.arange(draft_vocab) + offsets.long()
        if int(d2t.min()) < 0 or int(d2t.max()) >= vocab:
            raise CheckpointError(f"tensor d2t in {folder}: draft ids map outside the target "
                                  f"vocabulary [0, {vocab}); the map is corrupt")
    elif draft_vocab != vocab:
        raise CheckpointError(f"tensor d2t is missing from the EAGLE-3 draft in {folder}: a "
                              f"{draft_vocab}-token draft vocabulary needs the map to target ids")
    if reader.has("t2d"):  # not used at inference (vLLM skips it); checked for consistency
        reader.read("t2d", (vocab,), ("BOOL",), "vocab_size is")

    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise CheckpointError(f"tensor {name} in {folder / reader.file_of[name]} holds NaN "
                                  "or infinite values: the download is corrupt")
    with torch.device("meta"):  # no random init of weights that are about to be replaced
        model = Eagle3Draft(config, max_len=1, device="meta")
    for name, t in _fused(tensors, prefix).items():
        module_name, _, attr = name.replace("layers.0.", "midlayer.").rpartition(".")
        model.get_submodule(module_name).register_parameter(
            attr, nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False))
    model.embed_tokens = nn.Embedding.from_pretrained(embed.to(device=device, dtype=dtype))
    model.lm_head = Linear(h, draft_vocab, bias=False, device="meta")
    model.lm_head.weight = nn.Parameter(lm_head.to(device=device, dtype=dtype),
                                        requires_grad=False)
    model.draft_to_target = None if d2t is None else d2t.to(device)
    model.rope_cache = cos_sin_cache(config.rope, config.head_dim,
                                     max_len or target.max_position_embeddings, device)
    return model.eval()

