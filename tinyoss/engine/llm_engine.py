"""The engine: requests in, batched steps over the paged cache, outputs back.

request -> scheduler -> model runner -> model -> sampler -> output. One `step()` runs one
forward pass for everything the scheduler picked and returns the outputs that changed.

With `async_scheduling` (the default) a decode step is launched before the previous one's
tokens reach the host: each sequence gets a placeholder token, the next step takes the real
ids from the device, and the host does its bookkeeping (detokenizing, stop checks, the next
step's inputs) while the GPU runs. A sequence that stopped meanwhile has its extra token
dropped. Steps chain only when nothing could differ from running them one by one: every running
sequence decodes, nobody waits to be admitted, no sampler needs the previous token (penalties),
and the cache has room for every sequence's next token.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from tinyoss.config import ModelConfig
from tinyoss.engine.cuda_graphs import CudaGraphRunner, graph_sizes
from tinyoss.engine.kv_cache import (
    CacheLayout,
    KVCacheManager,
    allocate_kv_tensors,
    kv_bytes_per_block,
)
from tinyoss.engine.model_runner import LaunchedStep, ModelRunner
from tinyoss.engine.scheduler import Scheduled, Scheduler
from tinyoss.engine.sequence import CompletionOutput, Sequence, TokenLogprob
from tinyoss.engine.transfer import to_device
from tinyoss.kernels.attention import TorchAttention
from tinyoss.kernels.backends import select_backends
from tinyoss.kernels.moe_backends import MXFP4_BACKENDS
from tinyoss.model.loader import disable_attention_sinks, load_model, resolve_model
from tinyoss.model.presets import GENERATION_CONFIG, PRESETS, preset_config
from tinyoss.model.quant_linear import parse_mxfp4_layers, quantize_layers
from tinyoss.sampling_params import SamplingParams
from tinyoss.settings import resolve
from tinyoss.tokenizer import Tokenizer

log = logging.getLogger("tinyoss")


@dataclass
class EngineConfig:
    model: str = "tiny"
    dtype: str = "auto"  # auto = bfloat16 on a GPU, float32 on the CPU
    device: str | None = None  # default: cuda when available
    max_model_len: int | None = None  # default: the model's context, capped by the KV cache
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    gpu_memory_utilization: float = 0.90
    kv_cache_tokens: int | None = None  # explicit KV size in tokens (default on CPU: 65536)
    enable_prefix_caching: bool = True
    load_format: str = "auto"  # auto | safetensors | dummy (random weights from the config)
    revision: str | None = None
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs (debugging)
    attention_backend: str = "auto"  # auto | flashinfer | torch
    # MoE kernel: auto | triton | cutlass | trtllm | torch (None: env TINYOSS_MXFP4_BACKEND,
    # else auto)
    mxfp4_backend: str | None = None
    # auto: the checkpoint's sink logits; false: none (debugging; gpt-oss degrades without them).
    attention_sinks: str | None = None  # None: env TINYOSS_ATTENTION_SINKS, else auto
    # Layers in MXFP4: moe (as shipped), or a comma list adding qkv, o, lm_head; all = every one
    mxfp4_layers: str = "moe"
    # Launch the next decode step before the previous one's tokens reach the host (see above).
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        checks = [
            ("max_num_seqs", self.max_num_seqs >= 1),
            ("block_size", self.block_size >= 1),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1),
            ("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 2),
            ("kv_cache_tokens", self.kv_cache_tokens is None or self.kv_cache_tokens >= 1),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"invalid {name}: {getattr(self, name)!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"invalid dtype {self.dtype!r}: choose one of {', '.join(_DTYPES)}")
        for name, choices in (("mxfp4_backend", MXFP4_BACKENDS), ("attention_sinks", SINKS)):
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise ValueError(f"invalid {name} {value!r}: choose one of {', '.join(choices)}")
        parse_mxfp4_layers(self.mxfp4_layers)


# Stands in a sequence's token list for a token that is sampled but not yet on the host.
PENDING_TOKEN = -1

SINKS = ("auto", "false")
SINKS_ENV = "TINYOSS_ATTENTION_SINKS"

_DTYPES = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def output(self) -> RequestOutput:
        """A snapshot: later steps do not change it (safe to hand to another thread)."""
        outs = [
            dataclasses.replace(
                s.out,
                token_ids=list(s.out.token_ids),
                logprobs=None if s.out.logprobs is None else list(s.out.logprobs),
            )
            for s in self.seqs
        ]
        first = self.seqs[0]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outs,
            self.finished,
            None if first.prompt_logprobs is None else list(first.prompt_logprobs),
            min(s.num_cached_prompt for s in self.seqs),
            self.arrival_time,
            self.first_token_time,
        )


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_prompt_tokens: int = 0
    finished_requests: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.dtype = _DTYPES[config.dtype] or (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32
        )
        folder = self._checkpoint_folder()
        self.model_config = (
            ModelConfig.from_folder(folder)
            if folder is not None
            else ModelConfig.from_dict(preset_config(config.model), GENERATION_CONFIG)
        )
        self.tokenizer = (
            Tokenizer.from_folder(folder) if folder is not None else _default_tokenizer()
        )
        self.max_step_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.backends = select_backends(
            self.device, config.attention_backend, config.mxfp4_backend, dtype=self.dtype,
            max_num_tokens=self.max_step_tokens,
        )
        sinks = resolve("attention_sinks", config.attention_sinks, SINKS_ENV, SINKS)
        t0 = time.perf_counter()
        self.model = load_model(
            folder,
            self.model_config,
            dtype=self.dtype,
            device=self.device,
            kernels=self.backends.kernels,
            load_format=config.load_format,
            seed=config.seed,
        )
        log.info(
            "loaded %s in %.1f s (%s, %s)",
            config.model,
            time.perf_counter() - t0,
            self.device,
            str(self.dtype).removeprefix("torch."),
        )
        if sinks.value == "false":
            disable_attention_sinks(self.model)
            log.warning(
                "attention sinks DISABLED (attention_sinks=false, from %s): the softmax runs "
                "without the sink column; gpt-oss was trained with sinks and its output "
                "degrades without them (debugging only)",
                sinks.source,
            )
        quantize_layers(self.model, parse_mxfp4_layers(config.mxfp4_layers))
        self.layout = CacheLayout.for_model(self.model_config)
        num_blocks = self._num_kv_blocks()
        self.max_model_len = self._max_model_len(num_blocks)
        self.model.init_runtime(self.max_model_len, self.device)
        # One block more than the manager hands out: padded CUDA-graph rows write there.
        self.kv_tensors = allocate_kv_tensors(
            self.layout, num_blocks + 1, config.block_size, self.model_config, self.dtype,
            self.device,
        )
        self.kv = KVCacheManager(
            num_blocks, config.block_size, self.layout.windows, config.enable_prefix_caching
        )
        if self.device.type == "cuda":  # nothing to tune or compile on the CPU
            self.warm_up_moe()
        use_graphs = self.device.type == "cuda" and not config.enforce_eager
        sizes = graph_sizes(config.max_num_seqs) if use_graphs else []
        attention = self._attention(num_blocks, sizes)
        graphs = None
        if use_graphs:
            graphs = CudaGraphRunner(
                self.model, attention, sizes, len(self.layout.windows), self.device
            )
            graphs.capture()
        self.runner = ModelRunner(
            self.model, attention, self.layout, config.block_size, self.device, graphs
        )
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._arrivals = itertools.count()
        self._in_flight: LaunchedStep | None = None  # launched ahead, results not yet taken
        log.info(
            "KV cache: %d blocks of %d tokens, %.2f GiB; max_model_len %d",
            num_blocks,
            config.block_size,
            num_blocks
            * kv_bytes_per_block(self.layout, config.block_size, self.model_config, self.dtype)
            / 2**30,
            self.max_model_len,
        )

    # -- set-up -----------------------------------------------------------------------------
    def _attention(self, num_blocks: int, sizes: list[int]):
        c, m = self.config, self.model_config
        if self.backends.attention == "torch":
            windows = [self.layout.windows[g] for g in self.layout.layer_group]
            return TorchAttention(
                self.kv_tensors, self.layout.layer_group, windows, m.head_dim**-0.5
            )
        from tinyoss.kernels.attention_flashinfer import FlashInferAttention

        return FlashInferAttention(
            self.kv_tensors,
            self.layout.layer_group,
            self.layout.windows,
            m.num_attention_heads,
            m.num_key_value_heads,
            m.head_dim,
            c.block_size,
            dummy_block=num_blocks,
            max_num_tokens=max(c.max_num_batched_tokens, max(sizes, default=1)),
            max_num_seqs=max(c.max_num_seqs, max(sizes, default=1)),
            max_model_len=self.max_model_len,
        )

    @torch.inference_mode()
    def warm_up_moe(self) -> None:
        """Runs every layer's experts once on the most tokens a step can hold, routed so that
        every expert gets tokens: autotuners (inside `Kernels.moe_warmup`, sized for this many
        tokens) and lazy JIT builds see every expert and the largest shape before serving and
        before CUDA-graph capture."""
        m = self.model_config
        t = self.max_step_tokens
        ids = uniform_routing(t, m.num_experts_per_tok, m.num_local_experts, self.device)
        weights = torch.full(ids.shape, 1 / ids.shape[1], dtype=torch.float32, device=self.device)
        gen = torch.Generator(self.device).manual_seed(0)
        x = torch.randn(t, m.hidden_size, generator=gen, device=self.device).to(self.dtype)
        t0 = time.perf_counter()
        with self.backends.kernels.moe_warmup():
            for layer in self.model.model.layers:
                layer.mlp.experts(x, weights, ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("MoE warm-up: %d tokens over all experts in %.1f s", t, time.perf_counter() - t0)

    def _checkpoint_folder(self):
        c = self.config
        if c.load_format == "dummy" and c.model.removeprefix("openai/") in PRESETS:
            return None
        return resolve_model(c.model, c.revision)

    def _num_kv_blocks(self) -> int:
        c = self.config
        per_block = kv_bytes_per_block(self.layout, c.block_size, self.model_config, self.dtype)
        if c.kv_cache_tokens is not None or self.device.type != "cuda":
            tokens = c.kv_cache_tokens or 65536
            return max(1, -(-tokens // c.block_size))
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = (
            total * (1 - c.gpu_memory_utilization) + 2 * 2**30
        )  # activations, graphs, workspace
        blocks = int((free - reserve) // per_block)
        if blocks < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free of "
                f"{total / 2**30:.1f} GiB after loading the weights); raise gpu_memory_utilization "
                "or use a smaller model"
            )
        return blocks

    def _max_model_len(self, num_blocks: int) -> int:
        limit = self.config.max_model_len or self.model_config.max_position_embeddings
        if limit > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {limit} exceeds the model's "
                f"max_position_embeddings ({self.model_config.max_position_embeddings})"
            )
        lo, hi = 1, limit
        while lo < hi:  # the longest sequence the cache can hold on its own
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.kv_blocks_needed(mid) <= num_blocks else (lo, mid - 1)
        if lo < limit:
            if self.config.max_model_len:
                raise ValueError(
                    f"max_model_len {limit} does not fit in the KV cache "
                    f"({num_blocks} blocks hold one sequence of at most {lo} tokens); "
                    "lower it or give the cache more memory"
                )
            log.info("max_model_len lowered to %d tokens to fit the KV cache", lo)
        return lo

    def kv_blocks_needed(self, num_tokens: int) -> int:
        bs = self.config.block_size
        return sum(
            -(-num_tokens // bs) if not w else min(-(-num_tokens // bs), (w - 1) // bs + 2)
            for w in self.layout.windows
        )

    # -- requests ---------------------------------------------------------------------------
    def make_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Request:
        """Validate and build a request (no engine state changes): errors name the field."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long, but max_model_len is "
                f"{self.max_model_len} (prompt plus at least one generated token)"
            )
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        seqs = [
            Sequence(
                request_id,
                i,
                ids,
                params,
                max_tokens,
                next(self._arrivals),
                len(self.layout.windows),
                self.tokenizer,
                self.model_config.eos_token_ids,
                self.device,
            )
            for i in range(params.n)
        ]
        return Request(request_id, text, ids, params, seqs)

    def submit(self, request: Request) -> None:
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)
        self.stats.prompt_tokens += len(request.prompt_token_ids)

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> None:
        self.submit(self.make_request(request_id, prompt, params))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its last output (None if unknown)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.finished:
                seq.begin_step()
                seq.abort()
            self.scheduler.remove(seq)
        return request.output()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Takes the results of one step (launching it first unless it already runs) and
        returns the outputs that changed; with async scheduling the next step is launched
        before those results are read."""
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            plan = self.scheduler.schedule()
            if not plan.scheduled:
                return []
            launched = self._launch(plan.scheduled)
        if self._can_chain(launched):
            self._in_flight = self._launch_after(launched)
        return self._finish(launched)

    def _launch(
        self, scheduled: list[Scheduled], input_ids: torch.Tensor | None = None
    ) -> LaunchedStep:
        launched = self.runner.launch(scheduled, input_ids)
        for item in scheduled:  # the cache will hold these once the queued work runs
            item.seq.num_computed += item.num_tokens
            self._name_full_blocks(item.seq)
        return launched

    def _name_full_blocks(self, seq: Sequence) -> None:
        """Enter the sequence's full, computed blocks of known tokens in the prefix cache, before
        any trimming can give sliding-window blocks back (a later request reading them runs
        after the work that writes them: one stream)."""
        known = seq.num_tokens - (seq.token_ids[-1] == PENDING_TOKEN)
        self.kv.cache_full_blocks(seq.blocks, seq.token_ids, min(seq.num_computed, known))

    def _can_chain(self, launched: LaunchedStep) -> bool:
        """Whether the next step can start before `launched`'s tokens are known: it would be
        exactly the decode of every running sequence (see the module docstring)."""
        if not self.config.async_scheduling or launched.tokens is None:
            return False
        running = self.scheduler.running
        seqs = [launched.scheduled[i].seq for i in launched.rows]
        if len(launched.rows) != len(launched.scheduled) or len(seqs) != len(running):
            return False  # a prefill still has chunks to go, or someone else is running
        if self.scheduler.waiting and len(running) < self.config.max_num_seqs:
            return False  # admit the newcomers first
        if {id(s) for s in seqs} != {id(s) for s in running} or any(
            s.params.needs_penalties
            or s.num_output + 1 >= s.max_tokens
            or s.num_tokens + 1 >= self.max_model_len
            for s in seqs
        ):
            return False
        return len(seqs) <= self.config.max_num_batched_tokens and self.kv.room_for_next_token(
            [(s.blocks, s.num_computed) for s in seqs]
        )

    def _launch_after(self, launched: LaunchedStep) -> LaunchedStep:
        """The decode step that follows `launched`, its input ids taken on the device."""
        row_of = {}
        for row, i in enumerate(launched.rows):
            seq = launched.scheduled[i].seq
            seq.token_ids.append(PENDING_TOKEN)
            row_of[id(seq)] = row
        plan = self.scheduler.schedule()
        assert not plan.preempted and all(
            item.num_tokens == 1 and item.seq.token_ids[-1] == PENDING_TOKEN
            for item in plan.scheduled
        ), "a chained step must be the decode of the sequences it follows"
        rows = torch.tensor([row_of[id(item.seq)] for item in plan.scheduled])
        input_ids = launched.tokens.index_select(0, to_device(rows, launched.tokens.device))
        return self._launch(plan.scheduled, input_ids)

    def _finish(self, launched: LaunchedStep) -> list[RequestOutput]:
        result = launched.result()
        now = time.monotonic()
        stepped = {item.seq.request_id for item in launched.scheduled}
        for request_id in stepped:  # every sequence of a stepped request starts a fresh delta
            if request_id in self.requests:
                for seq in self.requests[request_id].seqs:
                    seq.begin_step()
        touched: dict[str, Request] = {}
        for i, item in enumerate(launched.scheduled):
            seq = item.seq
            if seq.finished:  # stopped or aborted while this step ran: its token is dropped
                continue
            if i in result.prompt_logprobs:
                seq.prompt_logprobs.extend(result.prompt_logprobs[i])
            if i in result.sampled:
                if seq.token_ids[-1] == PENDING_TOKEN:  # a chained step already reads it
                    seq.token_ids.pop()
                token, logprob = result.sampled[i]
                seq.append(token, logprob, self.max_model_len)
                self.stats.generation_tokens += 1
                request = self.requests[seq.request_id]
                request.first_token_time = request.first_token_time or now
                touched[request.request_id] = request
            self._name_full_blocks(seq)
            self.kv.trim_window(seq.blocks, seq.num_computed)
            if seq.finished:
                self.scheduler.remove(seq)
        outputs = []
        for request in touched.values():
            outputs.append(request.output())
            if request.finished:
                del self.requests[request.request_id]
                self.stats.finished_requests += 1
                self.stats.cached_prompt_tokens += outputs[-1].num_cached_tokens
        return outputs


def uniform_routing(
    num_tokens: int, top_k: int, num_experts: int, device: torch.device
) -> torch.Tensor:
    """topk_ids [T, K] dealing experts round-robin: K distinct experts per token (K <= E), and
    every expert picked once T * K >= E."""
    return torch.arange(num_tokens * top_k, device=device).remainder(num_experts).view(-1, top_k)


def _default_tokenizer() -> Tokenizer:
    from tinyoss.tools.o200k import tokenizer_dir

    return Tokenizer.from_folder(tokenizer_dir())
