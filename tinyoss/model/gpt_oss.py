"""gpt-oss: the one model tinyoss runs, on a flat batch of tokens from many sequences.

Module and parameter names follow the Hugging Face checkpoint, except that q/k/v are held as one
`qkv_proj` (one matmul instead of three). Attention goes through the backend passed to
`forward` (it owns the paged KV cache and applies the rotary embedding, so that a GPU backend
fuses it into its own launches); the MoE and norms go through `Kernels`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from tinyoss.config import ModelConfig
from tinyoss.kernels import Kernels
from tinyoss.kernels.moe_torch import ExpertWeights
from tinyoss.model.rope import cos_sin_cache
from tinyoss.model.sharding import Shard


class AttentionBackend(Protocol):
    """Owns the paged KV cache, and the rotary embedding of q and k: a GPU backend applies it
    inside its K/V store and attention launches (`rope_cache` from `cos_sin_cache`)."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
        positions: torch.Tensor, rope_cache: torch.Tensor,
    ) -> torch.Tensor: ...


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Linear):
    """A bf16 dense layer computed by `Kernels.linear` (on a GPU possibly a decode GEMV)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, kernels: Kernels) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, kernels: Kernels) -> None:
        super().__init__()
        self.weight = _param(size, dtype=torch.float32)  # kept in fp32, as transformers does
        self.eps = eps
        self.kernels = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, kernels: Kernels) -> None:
        super().__init__()
        self.layer = layer
        self.kernels = kernels
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, True, kernels)
        self.o_proj = Linear(self.q_size, config.hidden_size, True, kernels)
        self.sinks = _param(self.num_heads, dtype=torch.float32)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope_cache: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.o_proj(attn(self.layer, q, k, v, self.sinks, positions, rope_cache))
        return self.kernels.reduce(out)


class Experts(nn.Module):
    """Packed MXFP4 experts, named as in the checkpoint.

    A MoE kernel that reads its own layout (`Kernels.prepare_experts`, e.g. CUTLASS) gets it
    built once by `prepare()` after loading; the checkpoint tensors are then released, so the
    experts never sit in memory twice.
    """

    def __init__(self, config: ModelConfig, kernels: Kernels, shard: Shard) -> None:
        super().__init__()
        e, h, i = shard.experts_held(config), config.hidden_size, config.intermediate_size
        # expert parallelism: the global ids of the experts held, [first, end), which the
        # router hands the experts as 0.. (and the others as -1, which the kernels skip)
        self.held = shard.expert_range(config) if shard.experts and shard.size > 1 else None
        self.num_experts = e  # on this rank (prepare() empties the tensors that also say it)
        self.gate_up_proj_blocks = _param(e, 2 * i, h // 32, 16, dtype=torch.uint8)
        self.gate_up_proj_scales = _param(e, 2 * i, h // 32, dtype=torch.uint8)
        self.gate_up_proj_bias = _param(e, 2 * i)
        self.down_proj_blocks = _param(e, h, i // 32, 16, dtype=torch.uint8)
        self.down_proj_scales = _param(e, h, i // 32, dtype=torch.uint8)
        self.down_proj_bias = _param(e, h)
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.kernels = kernels
        self.prepared: object | None = None

    def weights(self) -> ExpertWeights:
        assert self.prepared is None, "the checkpoint tensors were released by prepare()"
        return ExpertWeights(
            self.gate_up_proj_blocks,
            self.gate_up_proj_scales,
            self.gate_up_proj_bias,
            self.down_proj_blocks,
            self.down_proj_scales,
            self.down_proj_bias,
            self.alpha,
            self.limit,
        )

    def prepare(self) -> None:
        """Builds the MoE kernel's own layout from the loaded weights (no-op for kernels that
        read the checkpoint layout) and frees the checkpoint tensors."""
        if self.kernels.prepare_experts is None or self.prepared is not None:
            return
        self.prepared = self.kernels.prepare_experts(self.weights())
        for p in self.parameters():
            p.data = p.data.new_empty(0)

    def packed(self) -> object:
        """What the MoE kernel reads: the kernel's own layout, or the checkpoint's."""
        return self.weights() if self.prepared is None else self.prepared

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return self.kernels.moe(x, topk_weights, topk_ids, self.packed())


class MoE(nn.Module):
    """The router and the experts. Both run in `DecoderLayer.forward`: the router fused with the
    norm before it (`Kernels.post_attention`), the experts with the norm after
    (`Kernels.moe_then_norm`), where the kernels can."""

    def __init__(self, config: ModelConfig, kernels: Kernels, shard: Shard) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = Linear(config.hidden_size, config.num_local_experts, True, kernels)
        self.experts = Experts(config, kernels, shard)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, kernels: Kernels, shard: Shard) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.self_attn = Attention(config, layer, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.mlp = MoE(config, kernels, shard)
        self.kernels = kernels

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
        rope_cache: torch.Tensor,
        attn: AttentionBackend,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x is this layer's `input_layernorm` output (applied by the layer before, which fuses
        it with its experts, or by the model for layer 0). Returns next_norm(h + residual) and
        h + residual for the layer's output h: the next layer's input, ready."""
        x = self.self_attn(x, positions, rope_cache, attn)
        norm, router = self.post_attention_layernorm, self.mlp.router
        x, residual, top_weights, top_ids = self.kernels.post_attention(
            x, residual, norm.weight, norm.eps, router.weight, router.bias, self.mlp.top_k,
            self.mlp.experts.held)
        return self.kernels.moe_then_norm(x, top_weights, top_ids, self.mlp.experts.packed(),
                                          residual, next_norm.weight, next_norm.eps)


class VocabEmbedding(nn.Embedding):
    """The embedding rows [start, start + rows) of the vocabulary: with tensor parallelism each
    rank looks up the ids it holds (zeros elsewhere) and the all-reduce fills in the rest."""

    def __init__(self, rows: int, hidden: int, start: int, kernels: Kernels) -> None:
        super().__init__(rows, hidden)
        self.start, self.kernels = start, kernels

    def reset_parameters(self) -> None:
        """Nothing: loading writes the weights. (nn.Embedding's random init, even on the meta
        device, pulled in torch's Python decompositions: ~3.6 s of a CPU start-up.)"""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kernels.all_reduce is None:
            return super().forward(ids)
        local = ids - self.start
        held = (local >= 0) & (local < self.num_embeddings)
        x = super().forward(local.clamp(0, self.num_embeddings - 1))
        return self.kernels.reduce(x * held[:, None].to(x.dtype))


class GptOssModel(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, shard: Shard) -> None:
        super().__init__()
        rows, start = shard.vocab_rows(config), shard.vocab_start(config)
        self.embed_tokens = VocabEmbedding(rows, config.hidden_size, start, kernels)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, kernels, shard) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)


class GptOssForCausalLM(nn.Module):
    """Build under `torch.device("meta")`, then materialize with `init_runtime` and load weights.

    With tensor parallelism (`shard`), `config` is the rank's own (`Shard.local_config`: its
    heads and intermediate units; the whole vocabulary) and lm_head holds its vocabulary rows."""

    def __init__(
        self, config: ModelConfig, kernels: Kernels | None = None, shard: Shard = Shard()
    ) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels or Kernels()
        self.model = GptOssModel(config, self.kernels, shard)
        self.lm_head = Linear(config.hidden_size, shard.vocab_rows(config), False, self.kernels)
        self.rope_cache: torch.Tensor | None = None
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def keep_aux_hidden(self, layers: tuple[int, ...], max_tokens: int) -> None:
        """From now on every forward pass also writes the residual stream entering each of
        `layers` (what an EAGLE-3 draft reads) side by side into `aux_hidden[:T]` [T, n * H]: a
        fixed buffer, so CUDA graphs captured afterwards write it too."""
        embed = self.model.embed_tokens.weight
        self.aux_layers = tuple(layers)
        self.aux_hidden = torch.zeros(max_tokens, len(layers) * self.config.hidden_size,
                                      dtype=embed.dtype, device=embed.device)

    def init_runtime(self, max_len: int, device: torch.device) -> None:
        """Builds what is computed rather than loaded: the rotary table for `max_len` positions."""
        c = self.config
        self.rope_cache = cos_sin_cache(c.rope, c.head_dim, max_len, device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """input_ids, positions [T] (tokens of all sequences, back to back) -> hidden [T, H]."""
        assert self.rope_cache is not None, "init_runtime() must run before forward()"
        layers, h = self.model.layers, self.config.hidden_size
        x, residual = layers[0].input_layernorm(self.model.embed_tokens(input_ids))
        for i, layer in enumerate(layers):
            if i in self.aux_layers:
                j = self.aux_layers.index(i)
                self.aux_hidden[: x.shape[0], j * h : (j + 1) * h].copy_(residual)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, residual = layer(x, residual, positions, self.rope_cache, attn, nxt)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [T, V]; written into `out` when given (a CUDA graph's fixed buffer:
        one converting copy instead of a float32 temporary and a second copy)."""
        logits = self.lm_head(hidden)
        if self.kernels.all_gather is not None:
            logits = self.kernels.all_gather(logits)[:, : self.config.vocab_size]
        return logits.float() if out is None else out.copy_(logits)
