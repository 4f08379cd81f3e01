"""Model configuration: a checkpoint's config.json flattened into the fields tinyoss uses.

Real gpt-oss config.json files say `rope_scaling`; transformers 5 writes `rope_parameters`.
Both are accepted. Anything tinyoss cannot run exactly is refused here, with the field named,
rather than computed wrongly later.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

SLIDING = "sliding_attention"
FULL = "full_attention"


class ConfigError(ValueError):
    """A checkpoint's config.json that tinyoss cannot run."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 150000.0
    factor: float = 32.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 4096
    truncate: bool = False
    yarn: bool = True


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 24
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 32
    num_experts_per_tok: int = 4
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()
    max_position_embeddings: int = 131072
    rope: RopeConfig = field(default_factory=RopeConfig)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    quant_method: str = "mxfp4"
    eos_token_ids: tuple[int, ...] = (200002, 199999, 200012)
    pad_token_id: int | None = 199999
    bos_token_id: int | None = 199998

    def __post_init__(self) -> None:
        if not self.layer_types:
            types = tuple(SLIDING if i % 2 == 0 else FULL for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", types)
        _validate(self)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def window(self, layer: int) -> int:
        """Tokens a query of `layer` sees (itself included); 0 means the whole context."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else 0

    def with_(self, **changes: object) -> ModelConfig:
        return replace(self, **changes)

    @classmethod
    def from_dict(cls, cfg: dict, generation: dict | None = None) -> ModelConfig:
        """Build from the dicts of config.json and (optionally) generation_config.json."""
        if cfg.get("model_type") != "gpt_oss":
            raise ConfigError(
                f"config.json: model_type is {cfg.get('model_type')!r}; tinyoss runs only 'gpt_oss'"
            )
        quant = cfg.get("quantization_config") or {}
        quant_method = quant.get("quant_method")
        if quant_method != "mxfp4":
            raise ConfigError(
                f"config.json: quantization_config.quant_method is {quant_method!r}; tinyoss loads "
                "gpt-oss checkpoints with MXFP4 experts ('mxfp4'), as published by OpenAI"
            )
        missing = [k for k in _REQUIRED if k not in cfg]
        if missing:
            raise ConfigError(f"config.json: missing required field(s) {', '.join(missing)}")
        n_layers = int(cfg["num_hidden_layers"])
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=int(cfg["num_attention_heads"]),
            num_key_value_heads=int(cfg["num_key_value_heads"]),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
            num_local_experts=int(cfg["num_local_experts"]),
            num_experts_per_tok=int(
                cfg.get("num_experts_per_tok", cfg.get("experts_per_token", 4))
            ),
            sliding_window=int(cfg.get("sliding_window") or 0),
            layer_types=tuple(cfg.get("layer_types") or ()),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
            rope=_rope_from_dict(cfg),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            quant_method=quant_method,
            eos_token_ids=_eos_ids(cfg, generation or {}),
            pad_token_id=cfg.get("pad_token_id"),
            bos_token_id=(generation or {}).get("bos_token_id", cfg.get("bos_token_id")),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        folder = Path(folder)
        path = folder / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: a gpt-oss checkpoint folder needs config.json"
            )
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        gen_path = folder / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
        return cls.from_dict(cfg, generation)


_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_local_experts",
)


def _rope_from_dict(cfg: dict) -> RopeConfig:
    theta = float(cfg.get("rope_theta", 150000.0))
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return RopeConfig(theta=theta, factor=1.0, yarn=False)
    if rope_type != "yarn":
        raise ConfigError(
            f"config.json: rope_type {rope_type!r} is not supported (gpt-oss uses 'yarn')"
        )
    orig = int(params.get("original_max_position_embeddings", 4096))
    max_pos = cfg.get("max_position_embeddings")
    # transformers recomputes the factor from the two lengths when both are given.
    if max_pos and "original_max_position_embeddings" in params:
        factor = float(max_pos) / orig
    else:
        factor = float(params.get("factor", 32.0))
    return RopeConfig(
        theta=theta,
        factor=factor,
        beta_fast=float(params.get("beta_fast", 32.0)),
        beta_slow=float(params.get("beta_slow", 1.0)),
        original_max_position_embeddings=orig,
        truncate=bool(params.get("truncate", True)),
        yarn=True,
    )


def _eos_ids(cfg: dict, generation: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation.get("eos_token_id"), cfg.get("eos_token_id")):
        for i in source if isinstance(source, list) else [source]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def _validate(c: ModelConfig) -> None:
    def bad(msg: str) -> None:
        raise ConfigError(f"config.json: {msg}")

    for name in (*_REQUIRED, "head_dim", "num_experts_per_tok"):
        if getattr(c, name) <= 0:
            bad(f"{name} must be positive, got {getattr(c, name)}")
    if c.num_attention_heads % c.num_key_value_heads:
        bad(
            f"num_attention_heads ({c.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({c.num_key_value_heads})"
        )
    if c.num_experts_per_tok > c.num_local_experts:
        bad(
            f"num_experts_per_tok ({c.num_experts_per_tok}) exceeds num_local_experts "
            f"({c.num_local_experts})"
        )
    if c.head_dim % 2:
        bad(f"head_dim ({c.head_dim}) must be even for rotary embeddings")
    for name in ("hidden_size", "intermediate_size"):
        if getattr(c, name) % 32:
            bad(f"{name} ({getattr(c, name)}) must be a multiple of 32 (MXFP4 blocks of 32)")
    if len(c.layer_types) != c.num_hidden_layers:
        bad(f"layer_types has {len(c.layer_types)} entries for {c.num_hidden_layers} layers")
    unknown = sorted(set(c.layer_types) - {SLIDING, FULL})
    if unknown:
        bad(f"layer_types holds {unknown}; expected {SLIDING!r} or {FULL!r}")
    if SLIDING in c.layer_types and c.sliding_window <= 0:
        bad("sliding_attention layers need a positive sliding_window")
    if not math.isfinite(c.rope.factor) or c.rope.factor <= 0:
        bad(f"rope factor must be positive, got {c.rope.factor}")


# -- engine options -------------------------------------------------------------------------
# The choices live here, at the bottom of the dependency graph: the kernels, the CLI (generated
# from these fields by `tinyoss.cli.add_engine_args`) and `LLM(**kwargs)` all read them.
DTYPES = ("auto", "bfloat16", "float16", "float32")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
ATTENTION_BACKENDS = ("auto", "flashinfer", "torch")
MXFP4_BACKENDS = ("auto", "triton", "cutlass", "torch")
ATTENTION_SINKS = ("auto", "false")


def option(
    help: str, choices: tuple[str, ...] | None = None, aliases: tuple[str, ...] = (), **kw
) -> object:
    """A field with its CLI help, choices and short flags (vLLM's, e.g. -tp)."""
    return field(metadata={"help": help, "choices": choices, "aliases": aliases}, **kw)


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option, with the help text the CLI shows for it."""

    model: str = option("a checkpoint folder, a hub id, or 'tiny'", default="tiny")
    dtype: str = option(
        "weights and activations: auto = bfloat16 on a GPU, float32 on the CPU",
        DTYPES,
        default="auto",
    )
    device: str | None = option(
        "cuda, cuda:N or cpu (default: cuda when available)", default=None
    )
    max_model_len: int | None = option(
        "longest prompt + output in tokens (default: the model's context, capped by the KV "
        "cache)",
        default=None,
    )
    max_num_seqs: int = option("most sequences in one batch", default=256)
    max_num_batched_tokens: int = option(
        "most tokens in one step (longer prompts are prefilled in chunks)", default=8192
    )
    block_size: int = option("tokens per KV cache block", default=16)
    gpu_memory_utilization: float = option(
        "fraction of GPU memory the engine may use (the KV cache takes what is left)",
        default=0.90,
    )
    kv_cache_tokens: int | None = option(
        "KV cache size in tokens (default: from gpu_memory_utilization; 65536 on the CPU)",
        default=None,
    )
    enable_prefix_caching: bool = option(
        "reuse the KV cache of earlier requests' identical prefixes", default=True
    )
    load_format: str = option(
        "dummy = random weights made from the config alone (benchmarks)",
        LOAD_FORMATS,
        default="auto",
    )
    revision: str | None = option("hub revision of the model", default=None)
    seed: int = option(
        "seed of the random weights (load_format dummy) and, as in vLLM, of the sampling of "
        "requests without a `seed` of their own (the same requests in the same order and "
        "batches sample the same tokens run after run); a request's `seed` makes it "
        "reproducible in any batch",
        default=0,
    )
    enforce_eager: bool = option("no CUDA graphs (debugging)", default=False)
    max_prefill_graph_tokens: int = option(
        "steps with prefill tokens of up to this many tokens replay piecewise CUDA graphs "
        "(attention runs eagerly between the pieces); larger ones run eagerly; 0 = none",
        default=2048,
    )
    attention_backend: str = option(
        "attention kernels: auto = FlashInfer on a GPU, torch on the CPU",
        ATTENTION_BACKENDS,
        default="auto",
    )
    mxfp4_backend: str | None = option(
        "MoE kernels (default: env TINYOSS_MXFP4_BACKEND, else auto: picked for the GPU)",
        MXFP4_BACKENDS,
        default=None,
    )
    attention_sinks: str | None = option(
        "auto: the checkpoint's sinks; false: none, debugging only: output degrades "
        "(default: env TINYOSS_ATTENTION_SINKS, else auto)",
        ATTENTION_SINKS,
        default=None,
    )
    mxfp4_layers: str = option(
        "layers in MXFP4: moe (the experts, as shipped), or a comma list adding qkv, o, "
        "lm_head (quantized at load: fewer bytes per token, some accuracy lost); all = every one",
        default="moe",
    )
    fp8_layers: str = option(
        "dense layers in FP8 (e4m3, a scale a row, quantized at load: half of bf16's bytes per "
        "token, less accuracy lost than MXFP4): none, or a comma list of qkv, o, lm_head; "
        "all = every one not in mxfp4_layers",
        default="none",
    )
    decode_step_budget_ms: float = option(
        "while sequences decode, size a step's prefill chunks to about this many ms, so that a "
        "long prompt does not stall running streams, at some cost in throughput (GPU only: "
        "the rate is measured at start-up; 0 = off: chunks take max_num_batched_tokens)",
        default=0.0,
    )
    async_scheduling: bool = option(
        "launch the next decode step before the previous one's tokens reach the host",
        default=True,
    )
    tensor_parallel_size: int = option(
        "GPUs the model is split over (attention by heads, experts by their intermediate "
        "dimension, the vocabulary by rows): one process per GPU, started by tinyoss; on the "
        "CPU, processes (tests)",
        aliases=("-tp",),
        default=1,
    )
    enable_expert_parallel: bool = option(
        "with tensor_parallel_size N: deal the experts out whole (E/N a GPU) instead of cutting "
        "each one; attention stays split by heads, and each GPU runs only the pairs of its own "
        "experts. Measured at 2 GPUs, batches 1 and 8: 1.05-1.42x one GPU, below plain tensor "
        "parallelism (1.14-1.57x): a GPU waits for whichever holds more of a step's pairs",
        default=False,
    )
    speculative_config: str | None = option(
        "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": "
        "K, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1} (drafts from the sequence's own "
        "earlier tokens) or {\"method\": \"eagle3\", \"model\": DRAFT_FOLDER, "
        "\"num_speculative_tokens\": K} (an EAGLE-3 draft model; K defaults to 3); greedy output "
        "is unchanged; a dict in Python; default: off",
        default=None,
    )

    def __post_init__(self) -> None:
        self._check_types()
        checks = [
            ("max_num_seqs", self.max_num_seqs >= 1, "an int >= 1"),
            ("block_size", self.block_size >= 1, "an int >= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, "an int >= 1"),
            ("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1,
             "a fraction of the GPU's memory, above 0 and at most 1"),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 2,
             "an int >= 2"),
            ("kv_cache_tokens", self.kv_cache_tokens is None or self.kv_cache_tokens >= 1,
             "an int >= 1"),
            ("decode_step_budget_ms", self.decode_step_budget_ms >= 0, ">= 0 (0: off)"),
            ("max_prefill_graph_tokens", self.max_prefill_graph_tokens >= 0, ">= 0 (0: off)"),
            ("tensor_parallel_size", self.tensor_parallel_size >= 1, "an int >= 1"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"invalid {name}: {getattr(self, name)!r} (must be {rule})")
        for f in fields(self):
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ValueError(
                    f"invalid {f.name} {value!r}: choose one of {', '.join(choices)}"
                )
        parse_fp8_layers(self.fp8_layers)
        named = {part.strip() for part in self.fp8_layers.split(",")}  # `all` yields to MXFP4
        both = [n for n in parse_mxfp4_layers(self.mxfp4_layers) if n in named]
        if both:
            raise ValueError(
                f"{', '.join(both)} named in both mxfp4_layers and fp8_layers: choose one format "
                "a layer"
            )
        from tinyoss.engine.speculative import SpeculativeConfig  # torch: imported late

        spec = SpeculativeConfig.parse(self.speculative_config)
        if spec is not None and spec.model is not None and self.tensor_parallel_size > 1:
            raise ValueError("an EAGLE-3 draft model runs on one GPU only: drop "
                             "tensor_parallel_size or use the ngram method")


    def _check_types(self) -> None:
        """Numbers and flags of the right type (the Python API passes them as given): "2" or
        2.0 for a count, or "yes" for a flag, would fail later with a message about something
        else; a bool is no count."""
        for f in fields(self):
            kind, value = _TYPES.get(str(f.type)), getattr(self, f.name)
            if kind is None or (value is None and str(f.type).endswith("| None")):
                continue
            number = numbers.Integral if kind is int else numbers.Real  # numpy's too
            ok = isinstance(value, bool) if kind is bool else (
                isinstance(value, number) and not isinstance(value, bool))
            if not ok:
                rule = {bool: "True or False", int: "an int", float: "a number"}[kind]
                raise ValueError(f"invalid {f.name}: {value!r} (must be {rule})")


_TYPES = {"int": int, "int | None": int, "float": float, "float | None": float, "bool": bool}

DENSE_LAYERS = ("qkv", "o", "lm_head")  # what mxfp4_layers and fp8_layers can quantize


def _parse_layers(spec: str | Iterable[str], field_name: str, base: str) -> tuple[str, ...]:
    """`base`, `all` or a comma list (or a list) of base and DENSE_LAYERS -> the dense layers
    named, in DENSE_LAYERS order (`base` adds nothing)."""
    names = {str(part).strip() for part in (spec.split(",") if isinstance(spec, str) else spec)}
    allowed = (base, *DENSE_LAYERS, "all")
    unknown = sorted(names - set(allowed))
    if unknown or not names:
        raise ValueError(
            f"invalid {field_name} {spec!r} (unknown: {', '.join(map(repr, unknown))}): give a "
            f"comma list of {', '.join(allowed[:-1])}, or all"
        )
    return tuple(n for n in DENSE_LAYERS if n in names or "all" in names)


def parse_mxfp4_layers(spec: str | Iterable[str]) -> tuple[str, ...]:
    """`moe`, `all` or a comma list of moe, qkv, o, lm_head -> the dense layers to quantize to
    MXFP4. The experts are MXFP4 in any case: `moe` adds nothing."""
    return _parse_layers(spec, "mxfp4_layers", "moe")


def parse_fp8_layers(spec: str | Iterable[str], mxfp4_layers: str | Iterable[str] = "moe"
                     ) -> tuple[str, ...]:
    """`none`, `all` or a comma list of qkv, o, lm_head -> the dense layers to quantize to FP8;
    `all` leaves out those `mxfp4_layers` takes."""
    taken = set(parse_mxfp4_layers(mxfp4_layers))
    return tuple(n for n in _parse_layers(spec, "fp8_layers", "none") if n not in taken)
