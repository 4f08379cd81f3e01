"""Builds an engine core from its config: checkpoint -> model -> kernels -> KV cache sizing ->
warm-up -> CUDA graphs -> scheduler and executor. Everything that happens once lives here, apart
from the step loop (`core.py`); hardware choices are made once, in `select_backends`, and
logged.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path

import torch

from tinyoss.config import EngineConfig, ModelConfig, parse_fp8_layers, parse_mxfp4_layers
from tinyoss.engine.core import CoreRequest, CoreStats, EngineCore, EngineInfo
from tinyoss.engine.cuda_graphs import CudaGraphRunner, graph_sizes
from tinyoss.engine.piecewise_graphs import PiecewiseGraphRunner, piecewise_sizes
from tinyoss.engine.comm import ALL_REDUCE_ENV, Group, GroupError, all_reduce_setting
from tinyoss.engine.eagle3_drafter import Eagle3Drafter
from tinyoss.engine.executor import Executor
from tinyoss.engine.workers import Peers, rank_device
from tinyoss.engine.grammar import GrammarCompiler
from tinyoss.engine.speculative import SpeculativeConfig, make_proposer
from tinyoss.engine.kv_cache import (
    CacheLayout,
    KVCacheManager,
    allocate_kv_tensors,
    blocks_needed,
    kv_bytes_per_block,
)
from tinyoss.engine.scheduler import PrefillCost, Scheduler
from tinyoss.kernels.attention import TorchAttention
from tinyoss.kernels.backends import BackendChoice, choose_attention, select_backends
from tinyoss.kernels.compile_cache import empty_cache_note
from tinyoss.model.eagle3 import Eagle3Config, load_draft
from tinyoss.model.gpt_oss import GptOssForCausalLM
from tinyoss.model.loader import disable_attention_sinks, load_model, resolve_model
from tinyoss.model.sharding import Shard
from tinyoss.model.presets import GENERATION_CONFIG, PRESETS, preset_config
from tinyoss.model.quant_linear import quantize_layers
from tinyoss.sampling_params import SamplingParams, StructuredOutputs
from tinyoss.settings import resolve
from tinyoss.threads import configure_cpu_threads
from tinyoss.tokenizer import Tokenizer

log = logging.getLogger("tinyoss")

SINKS_ENV = "TINYOSS_ATTENTION_SINKS"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def checkpoint_folder(config: EngineConfig) -> Path | None:
    """The checkpoint's folder (written or downloaded on first use), or None for a random-weight
    preset made from its config alone."""
    if config.load_format == "dummy" and config.model.removeprefix("openai/") in PRESETS:
        return None
    return resolve_model(config.model, config.revision)


def check_config(config: EngineConfig) -> None:
    """Raises ValueError for what the engine would refuse from its config and the model's
    config.json alone, so that `tinyoss serve` refuses it before it listens. A hub id is left
    to the engine core (its first use downloads, while the server answers "loading")."""
    name = config.model.removeprefix("openai/")
    if name in PRESETS and (name == "tiny" or config.load_format == "dummy"):
        model_config = ModelConfig.from_dict(preset_config(name), GENERATION_CONFIG)
    elif Path(config.model).expanduser().is_dir():
        model_config = ModelConfig.from_folder(Path(config.model).expanduser())
    else:
        return
    _shard(config, 0).check(model_config)
    for rank in range(config.tensor_parallel_size):
        rank_device(config, rank)
    _check_max_model_len(config, model_config)


def _check_max_model_len(config: EngineConfig, m: ModelConfig) -> int:
    """The longest sequence asked for (max_model_len, else the model's own), if the model and
    a KV block can take it."""
    limit = config.max_model_len or m.max_position_embeddings
    if limit > m.max_position_embeddings:
        raise ValueError(
            f"max_model_len {limit} exceeds the model's max_position_embeddings "
            f"({m.max_position_embeddings})"
        )
    if limit < config.block_size:
        raise ValueError(
            f"max_model_len {limit} is shorter than one KV cache block ({config.block_size} "
            f"tokens), too short to run anything: give at least {config.block_size}"
        )
    return limit


def load_model_config(folder: Path | None, config: EngineConfig) -> ModelConfig:
    if folder is not None:
        return ModelConfig.from_folder(folder)
    return ModelConfig.from_dict(preset_config(config.model), GENERATION_CONFIG)


def load_tokenizer(folder: Path | None) -> Tokenizer:
    if folder is None:
        from tinyoss.tools.o200k import tokenizer_dir

        folder = tokenizer_dir()
    return _last_tokenizer(Path(folder))


# the tokenizer last loaded, under (its tokenizer.json's real path, size, mtime)
_TOKENIZERS: dict[tuple[str, int, int], Tokenizer] = {}


def _last_tokenizer(folder: Path) -> Tokenizer:
    """`Tokenizer.from_folder`, kept for the next load of the same, unchanged file. Parsing
    o200k's tokenizer.json took 2 s of every LLM's and server's start after the first in one
    process (a second engine, a test suite's many) on a 2-core CPU. A Tokenizer is not changed
    once built (its byte cache only fills), so engines may share one; only the last is kept."""
    path = folder / "tokenizer.json"
    try:
        stat = path.stat()
    except OSError:
        return Tokenizer.from_folder(folder)  # which says what is missing
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    tokenizer = _TOKENIZERS.get(key)
    if tokenizer is None:
        tokenizer = Tokenizer.from_folder(folder)
        _TOKENIZERS.clear()
        _TOKENIZERS[key] = tokenizer
    return tokenizer


@dataclass
class Rank:
    """What every tensor-parallel rank builds alike: its slice of the model, its KV cache,
    attention and CUDA graphs (rank 0 alone adds the scheduler, sampler and grammars)."""

    model_config: ModelConfig  # the whole model's
    backends: BackendChoice
    model: GptOssForCausalLM
    layout: CacheLayout
    num_blocks: int
    per_block: int  # bytes of one KV block on this rank
    max_model_len: int
    attention: object
    graphs: CudaGraphRunner | None
    pieces: PiecewiseGraphRunner | None
    verify: CudaGraphRunner | None  # speculative verify steps
    drafter: Eagle3Drafter | None  # an EAGLE-3 draft model
    dtype: torch.dtype
    device: torch.device
    stream: torch.cuda.Stream | None  # the one its graphs were captured on (None: the CPU)

    def executor(self, grammars: GrammarCompiler | None = None,
                 peers: Peers | None = None) -> Executor:
        return Executor(self.model, self.attention, len(self.layout.windows), self.device,
                        self.graphs, self.pieces, grammars, peers, self.verify, self.drafter,
                        self.stream)


def build_engine(config: EngineConfig, folder: Path | None = None) -> EngineCore:
    """The engine core for `config`; `folder`: the checkpoint, when the caller resolved it."""
    device = rank_device(config, 0)
    if device.type == "cpu":
        configure_cpu_threads(config.tensor_parallel_size)
    if config.tensor_parallel_size > 1:
        all_reduce_setting()  # checked before any worker starts
    for note in _idle_options(config, device):
        log.warning("%s", note)
    folder = folder if folder is not None else checkpoint_folder(config)
    model_config = load_model_config(folder, config)
    _shard(config, 0).check(model_config)  # before starting any worker
    peers = Peers(config, folder, device) if config.tensor_parallel_size > 1 else None
    try:
        return _core(config, folder, device, model_config, peers)
    except BaseException as e:  # the workers may wait in a collective that rank 0 never reaches
        if peers is None:
            raise
        lost = peers.lost(wait_s=1.0) if isinstance(e, GroupError) else None
        if isinstance(e, KeyboardInterrupt):
            log.info("interrupted while starting; stopping the tensor-parallel workers")
        elif lost is None:
            log.exception("rank 0 failed while starting; stopping the tensor-parallel workers")
        peers.kill()
        if lost is not None:
            raise RuntimeError(f"{lost}, so the engine could not start") from e
        raise


def _idle_options(config: EngineConfig, device: torch.device) -> list[str]:
    """Options given that change nothing here: said, rather than dropped in silence."""
    default = {f.name: f.default for f in fields(EngineConfig)}
    notes = []
    if device.type == "cpu" and config.gpu_memory_utilization != default["gpu_memory_utilization"]:
        notes.append(f"gpu_memory_utilization {config.gpu_memory_utilization} has no effect on "
                     "the CPU: kv_cache_tokens sizes the KV cache there (default 65536)")
    if device.type == "cpu" and config.decode_step_budget_ms:
        notes.append(f"decode_step_budget_ms {config.decode_step_budget_ms} has no effect on "
                     "the CPU: its prefill cost model is timed on a GPU; prefill chunks take "
                     "max_num_batched_tokens")
    if config.enable_expert_parallel and config.tensor_parallel_size == 1:
        notes.append("enable_expert_parallel has no effect without tensor_parallel_size > 1")
    setting = os.environ.get(ALL_REDUCE_ENV) or "auto"  # empty: unset, as `resolve` reads it
    if device.type == "cpu" and config.tensor_parallel_size > 1 and setting != "auto":
        notes.append(f"{ALL_REDUCE_ENV}={setting} has no effect on the CPU: the ranks all-reduce "
                     "over gloo")
    return notes


def _core(config: EngineConfig, folder: Path | None, device: torch.device,
          model_config: ModelConfig, peers: Peers | None) -> EngineCore:
    """Rank 0's part of `build_engine`, once the workers (if any) are started."""
    rank = build_rank(config, folder, device, _shard(config, 0),
                      None if peers is None else peers.group)
    grammars = GrammarCompiler(
        lambda: load_tokenizer(folder), model_config.vocab_size,
        list(model_config.eos_token_ids),
    )
    executor = rank.executor(grammars, peers)
    scheduler = Scheduler(_kv_manager(rank, config), config.max_num_seqs,
                          config.max_num_batched_tokens, rank.max_model_len)
    num_blocks, dtype = rank.num_blocks, rank.dtype
    tp = (f" x {config.tensor_parallel_size} ranks ("
          f"{'experts dealt out whole, ' * config.enable_expert_parallel}all-reduce: "
          f"{peers.group.all_reduce_choice})" if peers else "")
    summary = (
        f"model {config.model} on {device}{tp}, {str(dtype).removeprefix('torch.')}; backends: "
        f"{rank.backends.describe()}; CUDA graphs: {_graphs_summary(rank.graphs, rank.pieces)}; "
        f"KV cache: {num_blocks * config.block_size} token slots ({num_blocks} blocks of "
        f"{config.block_size}, {num_blocks * rank.per_block / 2**30:.2f} GiB{' a rank' * bool(tp)}"
        f"); max_model_len {rank.max_model_len}; max_num_seqs {config.max_num_seqs}"
    )
    info = EngineInfo(
        config.model, rank.max_model_len, model_config.vocab_size, model_config.eos_token_ids,
        num_blocks, config.block_size, summary,
    )
    log.info(summary)
    random_weights = _random_weights(config)
    if random_weights:
        log.info(random_weights)
    core = EngineCore(info, scheduler, executor)
    core.async_scheduling = config.async_scheduling
    speculative = SpeculativeConfig.parse(config.speculative_config)
    if speculative is not None:
        core.proposer = make_proposer(speculative)
        core.num_speculative_tokens = speculative.num_speculative_tokens
        if rank.drafter is not None:
            scheduler.draft_lookahead = speculative.num_speculative_tokens - 1
        log.info("speculative decoding: %s", speculative)
    if device.type == "cuda":
        warm_up_steps(core, config)
        if config.decode_step_budget_ms:
            cost = _prefill_cost(core, config)
            scheduler.prefill_budget = (cost, config.decode_step_budget_ms / 1e3)
    # as vLLM: requests without a seed of their own sample the same tokens run after run (in
    # the same order and batches), from the engine's seed
    torch.manual_seed(config.seed)
    return core


def _kv_manager(rank: Rank, config: EngineConfig) -> KVCacheManager:
    return KVCacheManager(
        rank.num_blocks, config.block_size, rank.layout.windows, config.enable_prefix_caching
    )


def build_worker(config: EngineConfig, folder: Path | None, index: int,
                 init: str) -> tuple[Executor, Group]:
    """A tensor-parallel worker's executor (rank `index`) and its place in the group."""
    device = rank_device(config, index)
    if device.type == "cpu":
        configure_cpu_threads(config.tensor_parallel_size)
    group = Group(index, config.tensor_parallel_size, device, init)
    rank = build_rank(config, folder, device, _shard(config, index), group)
    return rank.executor(), group


def _shard(config: EngineConfig, rank: int) -> Shard:
    return Shard(rank, config.tensor_parallel_size, config.enable_expert_parallel)


def build_rank(config: EngineConfig, folder: Path | None, device: torch.device, shard: Shard,
               group: Group | None) -> Rank:
    """Model, KV cache, attention and CUDA graphs of one rank. Every rank runs this in the same
    order: the collectives of the graph warm-ups meet. Built on the stream its steps will run
    on (`Executor.stream`), where the CUDA graphs are captured."""
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.cuda.stream(stream):
        return _build_rank(config, folder, device, shard, group, stream)


def _build_rank(config: EngineConfig, folder: Path | None, device: torch.device, shard: Shard,
                group: Group | None, stream: torch.cuda.Stream | None) -> Rank:
    dtype = _DTYPES.get(config.dtype) or (
        torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    model_config = load_model_config(folder, config)
    max_step_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
    attention = choose_attention(device, config.attention_backend, dtype)
    prebuild = None
    if attention == "flashinfer":  # its JIT builds overlap the MoE kernel's and the loading
        from tinyoss.kernels.attention_flashinfer import Prebuild

        prebuild = Prebuild(device, dtype, model_config.head_dim,
                            CacheLayout.for_model(model_config).windows)
    backends = select_backends(
        device, attention, config.mxfp4_backend, dtype=dtype, max_num_tokens=max_step_tokens,
    )
    if group is not None:
        kernels = backends.kernels
        log.info("tensor-parallel all-reduce: %s",
                 group.use_fast_all_reduce(dtype, model_config.hidden_size))
        kernels.all_reduce, kernels.all_gather = group.all_reduce, group.all_gather
        kernels.all_reduce_norm = partial(group.all_reduce_norm, norm=kernels.rms_norm)
        kernels.all_reduce_pairs_norm = group.all_reduce_pairs_norm
        kernels.pairs_max_tokens = group.pairs_max_tokens()
    sinks = resolve("attention_sinks", config.attention_sinks, SINKS_ENV, ("auto", "false"))
    note = empty_cache_note() if device.type == "cuda" and shard.rank == 0 else None
    if note:
        log.info(note)
    t0 = time.perf_counter()
    model = load_model(
        folder, model_config, dtype=dtype, device=device, kernels=backends.kernels,
        load_format=config.load_format, seed=config.seed, shard=shard,
    )
    log.info(
        "loaded %s%s in %.1f s (%s, %s)", config.model,
        f" (rank {shard.rank} of {shard.size})" if shard.size > 1 else "",
        time.perf_counter() - t0, device, str(dtype).removeprefix("torch."),
    )
    if sinks.value == "false":
        disable_attention_sinks(model)
        log.warning(
            "attention sinks DISABLED (attention_sinks=false, from %s): the softmax runs without "
            "the sink column; gpt-oss was trained with sinks and its output degrades without "
            "them (debugging only)",
            sinks.source,
        )
    quantize_layers(model, parse_mxfp4_layers(config.mxfp4_layers))
    quantize_layers(model, parse_fp8_layers(config.fp8_layers, config.mxfp4_layers), "fp8")

    local = model.config
    speculative = SpeculativeConfig.parse(config.speculative_config)
    draft_config = None
    if speculative is not None and speculative.model is not None:
        draft_config = _draft_config(speculative.model, model_config)
    layout = CacheLayout.for_model(local, draft_layers=int(draft_config is not None))
    per_block = kv_bytes_per_block(layout, config.block_size, local, dtype)
    num_blocks = _num_kv_blocks(config, device, per_block)
    if group is not None:  # every rank holds the same blocks
        num_blocks = group.min(num_blocks)
    max_model_len = _max_model_len(config, model_config, layout, num_blocks)
    model.init_runtime(max_model_len, device)
    # One block more than the manager hands out: padded CUDA-graph rows write there.
    kv_tensors = allocate_kv_tensors(
        layout, num_blocks + 1, config.block_size, local, dtype, device
    )
    if device.type == "cuda":  # nothing to tune or compile on the CPU
        warm_up_moe(model, backends, local, max_step_tokens, dtype, device)
    # the torch attention plans on the host (not capturable): such an engine runs eagerly
    use_graphs = (device.type == "cuda" and not config.enforce_eager
                  and backends.attention != "torch")
    if device.type == "cuda" and not config.enforce_eager and not use_graphs:
        log.info("CUDA graphs off: the torch attention cannot be captured")
    sizes = graph_sizes(config.max_num_seqs) if use_graphs else []
    tokens = []  # the verify graphs' query-token counts
    if use_graphs and speculative is not None:
        tokens = verify_sizes(config.max_num_seqs, speculative.num_speculative_tokens)
    if prebuild is not None:
        prebuild.wait()
    attention = _attention(  # its decode rows: sequences, or a verify step's tokens
        config, local, backends, layout, kv_tensors, num_blocks, sizes + tokens, max_model_len
    )
    piece_sizes = piecewise_sizes(min(config.max_prefill_graph_tokens, max_step_tokens))
    if draft_config is not None:  # before any capture: the graphs write the states too
        rows = max([max_step_tokens] + sizes + tokens + piece_sizes)
        model.keep_aux_hidden(draft_config.aux_layer_ids, rows)
    graphs = None
    if use_graphs:
        graphs = CudaGraphRunner(model, attention, sizes, len(layout.windows), device)
        graphs.capture()
    pieces = None
    if use_graphs and piece_sizes:
        pieces = PiecewiseGraphRunner(model, attention, piece_sizes, device)
        pieces.capture()
    verify = None
    if tokens:
        verify = CudaGraphRunner(model, attention, tokens, len(layout.windows), device, rows=True)
        verify.capture()
    drafter = None
    if draft_config is not None:
        t0 = time.perf_counter()
        draft = load_draft(speculative.model, model_config, dtype=dtype, device=device,
                           target_embed=model.model.embed_tokens, target_lm_head=model.lm_head,
                           max_len=max_model_len)
        draft.use_linear(backends.kernels.linear)  # the target's GEMVs
        drafter = Eagle3Drafter(draft, attention, local.num_hidden_layers, model.rope_cache,
                                speculative.num_speculative_tokens, config.block_size,
                                layout.windows.index(0), max_model_len)
        if use_graphs and not isinstance(attention, TorchAttention):  # planned on the device
            drafter.capture(config.max_num_seqs)
        log.info("loaded the EAGLE-3 draft %s in %.1f s (target layers %s)", speculative.model,
                 time.perf_counter() - t0, list(draft_config.aux_layer_ids))
    return Rank(model_config, backends, model, layout, num_blocks, per_block, max_model_len,
                attention, graphs, pieces, verify, drafter, dtype, device, stream)


def _draft_config(folder: str, target: ModelConfig) -> Eagle3Config:
    """The draft's config, checked for what sharing the target's KV cache needs."""
    c = Eagle3Config.from_folder(folder, target)
    geometry = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    want = (target.num_attention_heads, target.num_key_value_heads, target.head_dim)
    if geometry != want or c.sliding_window:
        raise ValueError(
            f"the EAGLE-3 draft in {folder} has {geometry[0]} query heads, {geometry[1]} KV heads "
            f"of {geometry[2]}{' and a sliding window' * bool(c.sliding_window)}; tinyoss keeps a "
            f"draft's keys in the target's cache and needs the target's {want[0]}, {want[1]} and "
            f"{want[2]} with full attention (as every published gpt-oss draft has)")
    return c


def verify_sizes(max_num_seqs: int, k: int) -> list[int]:
    """Query-token counts of the verify graphs: every count a single sequence's step can have
    (2 .. k+1), then the decode buckets up to 64 tokens (larger steps take the piecewise
    graphs)."""
    top = min(64, max_num_seqs * (k + 1))
    return sorted(set(range(2, min(k + 1, top) + 1)) | {s for s in graph_sizes(top) if s > 1})


def _random_weights(config: EngineConfig) -> str | None:
    """What to tell a user whose model has random weights: its text looks broken, by design."""
    if config.model == "tiny":
        return (
            "tiny is tinyoss's built-in test model and has random weights, so its text is "
            "random; give a gpt-oss checkpoint (e.g. openai/gpt-oss-20b) for real text"
        )
    if config.load_format == "dummy":
        return "load_format dummy: the weights are random, so the text is random"
    return None


def _prefill_cost(core: EngineCore, config: EngineConfig) -> PrefillCost:
    """Times prefill chunks of the largest step (after the warm-up: nothing left to compile):
    one from an empty context, and the last of a prompt several chunks long, which tells the
    cost of the attention over the context apart from the rest."""
    chunk = min(config.max_num_batched_tokens, core.info.max_model_len - 1)
    length = min(4 * chunk, core.info.max_model_len - 1)
    ids = random.Random(1).choices(range(1000, 150000), k=length)
    core.add(CoreRequest("prefill-cost", ids, SamplingParams(max_tokens=1, temperature=0)))
    times = []
    while core.has_work():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        core.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    core.stats = CoreStats()
    full = length // chunk  # chunks of `chunk` tokens; the last one starts at context c
    per_key = 0.0
    if full >= 2:
        c = (full - 1) * chunk
        per_key = max(0.0, (times[full - 1] - times[0]) / (chunk * c))
    per_token = max(1e-9, times[0] / chunk - per_key * chunk / 2)
    cost = PrefillCost(per_token, per_key)
    log.info(
        "prefill cost: %.1f ms for %d tokens from empty, %.1f ms for %d after %d: %.2f us a "
        "token + %.3f ns a token and key", times[0] * 1e3, chunk, times[full - 1] * 1e3, chunk,
        (full - 1) * chunk, per_token * 1e6, per_key * 1e9,
    )
    return cost


# (prompts, prompt tokens) of the warm-up requests: every MoE token-tile size, integer arguments
# that are 1, multiples of 16 and neither (Triton compiles a variant for each), multi-sequence
# prefills, and the largest step.
_WARM_UP_SHAPES = [(1, 1), (1, 17), (1, 100), (1, 250), (1, 500), (3, 37), (16, 64), (64, 64)]
# Every sampler path, alone and mixed in one batch: torch loads a kernel's module on its first
# launch, and a first request at the default temperature 1 would otherwise pay for the random
# draw, top-k/top-p sorting, penalties, seeded generators, logprobs and grammar masks.
_WARM_UP_PARAMS = [
    SamplingParams(max_tokens=3, ignore_eos=True, temperature=0),
    SamplingParams(max_tokens=3, ignore_eos=True),
    SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=50,
                   min_p=0.05),
    SamplingParams(max_tokens=3, ignore_eos=True, seed=1, presence_penalty=0.5,
                   frequency_penalty=0.5, repetition_penalty=1.1, logprobs=5),
    # the grammar path: builds llguidance's tokenizer (~1.3 s) now, not for a first request
    SamplingParams(max_tokens=3, ignore_eos=True,
                   structured_outputs=StructuredOutputs(json={"type": "object"})),
]


def warm_up_steps(core: EngineCore, config: EngineConfig) -> None:
    """Runs requests of assorted shapes through the whole core before it serves, so that what
    Triton compiles, FlashInfer plans and the caching allocator grows on first use is paid at
    start-up, not by the first burst of traffic; then resets the core's counters."""
    t0 = time.perf_counter()
    rng = random.Random(0)
    limit = core.info.max_model_len - 4
    # and the eager path just above the piecewise graphs, at a size that is no multiple of 16
    shapes = _WARM_UP_SHAPES + [(1, config.max_prefill_graph_tokens + 17),
                                (1, config.max_num_batched_tokens + 17)]
    for i, (n, length) in enumerate(shapes):
        for j in range(n):
            ids = [rng.randrange(1000, 150000) for _ in range(min(length, limit))]
            params = _WARM_UP_PARAMS[(i + j) % len(_WARM_UP_PARAMS)]
            core.add(CoreRequest(f"warm-up-{i}-{j}", ids, params))
        while core.has_work():
            core.step()
    core.stats = CoreStats()
    core.scheduler.num_preemptions = 0
    log.info("warm-up: %d requests in %.1f s", sum(n for n, _ in shapes), time.perf_counter() - t0)


def _graphs_summary(graphs: CudaGraphRunner | None, pieces: PiecewiseGraphRunner | None) -> str:
    if graphs is None:
        return "off"
    out = f"decode of up to {max(graphs.sizes)} sequences"
    if pieces is not None:
        out += f", piecewise for steps of up to {max(pieces.sizes)} tokens"
    return out


def _attention(
    config: EngineConfig,
    m: ModelConfig,
    backends: BackendChoice,
    layout: CacheLayout,
    kv_tensors: list,
    num_blocks: int,
    sizes: list[int],
    max_model_len: int,
):
    if backends.attention == "torch":
        windows = [layout.windows[g] for g in layout.layer_group]
        return TorchAttention(kv_tensors, layout.layer_group, windows, m.head_dim**-0.5)
    from tinyoss.kernels.attention_flashinfer import FlashInferAttention

    return FlashInferAttention(
        kv_tensors,
        layout.layer_group,
        layout.windows,
        m.num_attention_heads,
        m.num_key_value_heads,
        m.head_dim,
        config.block_size,
        dummy_block=num_blocks,
        max_num_tokens=max(config.max_num_batched_tokens, max(sizes, default=1)),
        max_num_seqs=max(config.max_num_seqs, max(sizes, default=1)),
        max_model_len=max_model_len,
    )


@torch.inference_mode()
def warm_up_moe(
    model, backends: BackendChoice, m: ModelConfig, tokens: int, dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Runs every layer's experts once on the most tokens a step can hold, routed so that every
    expert gets tokens: autotuners (inside `Kernels.moe_warmup`, sized for this many tokens) and
    lazy JIT builds see every expert and the largest shape before serving and before CUDA-graph
    capture."""
    held = model.model.layers[0].mlp.experts.num_experts  # on this rank
    ids = uniform_routing(tokens, m.num_experts_per_tok, held, device)
    weights = torch.full(ids.shape, 1 / ids.shape[1], dtype=torch.float32, device=device)
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(tokens, m.hidden_size, generator=gen, device=device).to(dtype)
    t0 = time.perf_counter()
    with backends.kernels.moe_warmup():
        for layer in model.model.layers:
            layer.mlp.experts(x, weights, ids)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info("MoE warm-up: %d tokens over all experts in %.1f s", tokens, time.perf_counter() - t0)


def uniform_routing(
    num_tokens: int, top_k: int, num_experts: int, device: torch.device
) -> torch.Tensor:
    """topk_ids [T, K] dealing experts round-robin: K distinct experts per token (K <= E), and
    every expert picked once T * K >= E."""
    return torch.arange(num_tokens * top_k, device=device).remainder(num_experts).view(-1, top_k)


def _num_kv_blocks(config: EngineConfig, device: torch.device, per_block: int) -> int:
    if config.kv_cache_tokens is not None or device.type != "cuda":
        tokens = config.kv_cache_tokens or 65536
        return max(1, -(-tokens // config.block_size))
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    reserve = total * (1 - config.gpu_memory_utilization) + 2 * 2**30  # activations, graphs
    blocks = int((free - reserve) // per_block)
    if blocks < 1:
        raise RuntimeError(
            f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free of "
            f"{total / 2**30:.1f} GiB after loading the weights); raise gpu_memory_utilization "
            "or use a smaller model"
        )
    return blocks


def _max_model_len(
    config: EngineConfig, m: ModelConfig, layout: CacheLayout, num_blocks: int
) -> int:
    limit = _check_max_model_len(config, m)
    lo, hi = 1, limit
    while lo < hi:  # the longest sequence the cache can hold on its own
        mid = (lo + hi + 1) // 2
        fits = blocks_needed(layout.windows, config.block_size, mid) <= num_blocks
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    if lo < config.block_size:
        raise ValueError(
            f"the KV cache ({num_blocks} blocks of {config.block_size} tokens) holds a sequence "
            f"of at most {lo} tokens, too few to run anything: give it more room "
            "(kv_cache_tokens, gpu_memory_utilization)"
        )
    if lo < limit:
        if config.max_model_len:
            raise ValueError(
                f"max_model_len {limit} does not fit in the KV cache ({num_blocks} blocks hold "
                f"one sequence of at most {lo} tokens); lower it or give the cache more memory"
            )
        log.info("max_model_len lowered to %d tokens to fit the KV cache", lo)
    return lo
