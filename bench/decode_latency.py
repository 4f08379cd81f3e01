"""Single-stream (and small-batch) decode latency of tinyoss, against the memory-bandwidth roofline.

    python bench/decode_latency.py --model gpt-oss-20b --load-format dummy \\
        --batch-size 1 --input-len 1024 --output-len 256

Each iteration submits `batch-size` prompts of `input-len` random tokens, times the prefill
(TTFT) and then every decode step through the engine (scheduler, runner, CUDA graph, sampler:
what a user waits for). The roofline is the bytes a step must read (weights of the active
experts, dense layers, lm_head, and the KV cache) over the device-to-device copy bandwidth
measured in the same run.

`--structured none json string` measures the same engine without, then with, a JSON-schema
constraint on every sequence (llguidance masks filled on the host while the GPU runs, applied in
the sampler), and prints the slowdowns. `json`: a string of at least 4096 characters, open the
whole run, whose length llguidance's lexer counts (the costly case: ~130 us a mask on the CPU
against ~10 us for a plain string); `string`: a plain string (the usual case; the model may
close it early, after which only the end token is allowed, which costs little).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinyoss import LLM, SamplingParams  # noqa: E402
from tinyoss.sampling_params import StructuredOutputs  # noqa: E402
from tinyoss.engine.core import CoreRequest  # noqa: E402
from tinyoss.config import MXFP4_BACKENDS, ModelConfig  # noqa: E402
from tinyoss.config import parse_fp8_layers, parse_mxfp4_layers  # noqa: E402


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 2**30, reps: int = 20) -> float:
    """Bytes read plus bytes written per second by a large device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def dense_bytes(n: int, k: int, mxfp4: bool, fp8: bool = False) -> int:
    """A dense [n, k] weight: bf16, MXFP4 (k/2 bytes of codes and k/32 scale bytes a row) or
    FP8 (k bytes and a 4-byte scale a row)."""
    return n * (k // 2 + k // 32) if mxfp4 else n * (k + 4) if fp8 else n * k * 2


def bytes_per_step(
    c: ModelConfig,
    batch: int,
    context: int,
    kv_dtype_bytes: int = 2,
    mxfp4_layers: tuple[str, ...] = (),
    ranks: int = 1,
    fp8_layers: tuple[str, ...] = (),
    expert_parallel: bool = False,
) -> dict:
    """What one decode step must read from memory, by part (dense weights in bf16 except the
    `mxfp4_layers` and `fp8_layers` quantized at load, from `parse_mxfp4_layers` and
    `parse_fp8_layers`; MXFP4 experts). With tensor
    parallelism, what each GPU reads: `c` is a rank's own config (its heads and intermediate
    units, padding included) and lm_head holds 1/`ranks` of the vocabulary.

    Experts: each layer reads the distinct experts its `batch` tokens picked; with uniform
    routing that is E * (1 - (1 - k/E)**batch) on average (exactly k at batch 1). With
    `expert_parallel` a rank holds E/`ranks` whole experts (`c` keeps the whole intermediate
    size) and reads 1/`ranks` of them on average: its busiest rank reads more.
    """
    h, L = c.hidden_size, c.num_hidden_layers
    qkv = c.q_size + 2 * c.kv_size
    attn = (
        dense_bytes(qkv, h, "qkv" in mxfp4_layers, "qkv" in fp8_layers)
        + dense_bytes(h, c.q_size, "o" in mxfp4_layers, "o" in fp8_layers)
        + (qkv + h) * 2
    )
    router = c.num_local_experts * h * 2
    i = c.intermediate_size
    expert = (2 * i * h // 2 + 2 * i * h // 32) + (h * i // 2 + h * i // 32) + (2 * i + h) * 2
    e, k = c.num_local_experts, c.num_experts_per_tok
    active = e * (1 - (1 - k / e) ** batch)
    kv_row = 2 * c.kv_size * kv_dtype_bytes  # K and V of one token in one layer
    kv = sum(min(context, c.window(layer) or context) for layer in range(L)) * kv_row * batch
    parts = {
        "attention_weights": L * (attn + router + 2 * h * 2),
        "experts": L * active * expert / (ranks if expert_parallel else 1),
        "lm_head": dense_bytes(-(-c.vocab_size // ranks), h, "lm_head" in mxfp4_layers,
                               "lm_head" in fp8_layers),
        "kv_cache": kv,
    }
    parts["total"] = sum(parts.values())
    return parts


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, math.ceil(q * len(s)) - 1)]


# A constraint that stays open for the whole run: the string cannot close before 4096 chars.
LONG_STRING_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "minLength": 4096}},
    "required": ["answer"],
    "additionalProperties": False,
}
STRING_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}
STRUCTURED = {
    "none": None,
    "json": StructuredOutputs(json=LONG_STRING_SCHEMA),
    "string": StructuredOutputs(json=STRING_SCHEMA),
}


def run(args: argparse.Namespace) -> list[dict]:
    """One record per `--structured` mode, measured on the same engine."""
    llm = LLM(
        args.model,
        load_format=args.load_format,
        max_num_seqs=args.max_num_seqs or args.batch_size,
        max_model_len=args.max_model_len or args.input_len + args.output_len + 32,
        max_num_batched_tokens=max(8192, args.input_len),
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
        async_scheduling=not args.no_async_scheduling,
        mxfp4_backend=args.mxfp4_backend,
        mxfp4_layers=args.mxfp4_layers,
        fp8_layers=args.fp8_layers,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        speculative_config=args.speculative_config,
    )
    try:
        records = [measure(llm.engine, args, mode) for mode in args.structured]
        if args.profile:
            profile(llm.engine, args)
    finally:
        llm.engine.close()
    return records


def measure(engine, args: argparse.Namespace, mode: str) -> dict:
    device = torch.device("cuda")
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                            structured_outputs=STRUCTURED[mode])  # fmt: skip
    ttfts, steps, emitted = [], [], 0
    outputs: dict[str, list[int]] = {}  # every request's tokens: a run's digest (same weights,
    # same prompts) must not change with a speed switch (TINYOSS_PDL, graphs, async scheduling)

    def step() -> list:
        deltas = engine.step()
        for d in deltas:
            outputs.setdefault(d.request_id, []).extend(d.token_ids)
        return deltas

    for it in range(args.warmup + args.iters):
        if it == args.warmup:
            start = engine.stats.spec_drafts, engine.stats.spec_accepted_tokens
        for b in range(args.batch_size):
            ids = [rng.randrange(199998) for _ in range(args.input_len)]
            engine.add(CoreRequest(f"it{it}-{b}", ids, params))
        t0 = time.perf_counter()
        started: set[str] = set()
        while len(started) < args.batch_size:  # prefill until every sequence has a first token
            started.update(d.request_id for d in step() if d.token_ids)
        ttft = time.perf_counter() - t0
        times, tokens = [], 0
        while engine.has_work():
            t = time.perf_counter()
            tokens += sum(len(d.token_ids) for d in step())
            times.append(time.perf_counter() - t)
        if it >= args.warmup:
            ttfts.append(ttft)
            steps.extend(times)
            emitted += tokens
    bandwidth = copy_bandwidth(device)
    context = args.input_len + args.output_len // 2
    layers = parse_mxfp4_layers(args.mxfp4_layers)
    fp8 = parse_fp8_layers(args.fp8_layers, args.mxfp4_layers)
    config = engine.executor.model.config
    ranks = args.tensor_parallel_size
    need = bytes_per_step(config, args.batch_size, context, mxfp4_layers=layers, ranks=ranks,
                          fp8_layers=fp8, expert_parallel=args.enable_expert_parallel)
    median = statistics.median(steps)
    record = {
        "gpu": torch.cuda.get_device_name(device),
        "commit": args.commit or _git_commit(),
        "command": " ".join(sys.argv),
        "model": args.model,
        "batch_size": args.batch_size,
        "tensor_parallel_size": ranks,
        "expert_parallel": args.enable_expert_parallel,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "iterations": args.iters,
        "engine": engine.info.summary,
        "mxfp4_layers": ",".join(("moe", *layers)),
        "fp8_layers": ",".join(fp8) or "none",
        "cuda_graphs": not args.enforce_eager,
        "async_scheduling": not args.no_async_scheduling,
        "structured_output": mode,
        "ttft_ms": 1e3 * statistics.median(ttfts),
        "ms_per_step_median": 1e3 * median,
        "ms_per_step_p90": 1e3 * percentile(steps, 0.9),
        "tok_per_s": args.batch_size / median,
        "bytes_per_step": need,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "achieved_gb_s": need["total"] / median / 1e9,
        "roofline_fraction": need["total"] / median / bandwidth,
        "roofline_tok_per_s": args.batch_size * bandwidth / need["total"],
        "tokens_sha256": hashlib.sha256(json.dumps(sorted(outputs.items())).encode()
                                        ).hexdigest()[:16],
    }
    if args.speculative_config:  # steps emit several tokens: speed from the tokens themselves
        drafts = engine.stats.spec_drafts - start[0]
        accepted = engine.stats.spec_accepted_tokens - start[1]
        record |= {"speculative_config": args.speculative_config,
                   "tok_per_s": emitted / sum(steps),
                   "mean_acceptance_length": 1 + accepted / max(1, drafts),
                   "verify_steps": drafts}
    return record


def graph_alone_ms(engine, batch: int, replays: int = 20) -> float:
    """GPU milliseconds of the decode graph for `batch` sequences replayed back to back on its
    current inputs (nan without graphs): the step's kernels without the host or the copies."""
    graphs = engine.executor.graphs
    if graphs is None:
        return float("nan")
    graph = graphs.graphs[graphs.bucket(batch)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def profile(engine, args: argparse.Namespace) -> None:
    """Where a decode step's time goes: GPU time of the decode graph alone, per-kernel GPU time
    (torch profiler), and the host's Python time by function (cProfile)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for b in range(args.batch_size):
        engine.add(CoreRequest(f"prof-{b}", [1] * args.input_len, params))
    while any(s.num_computed < s.num_prompt for r in engine.requests.values() for s in r):
        engine.step()
    if engine.executor.peers is not None:  # a replay on rank 0 alone would wait in its all-reduces
        print("decode graph alone: not timed under tensor parallelism (every rank must replay)")
    elif engine.executor.graphs is not None:
        print(f"decode graph alone: {graph_alone_ms(engine, args.batch_size):.3f} ms GPU time "
              "per step")
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            engine.step()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                    max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    host = cProfile.Profile()
    host.enable()
    for _ in range(20):
        engine.step()
    host.disable()
    pstats.Stats(host).sort_stats("tottime").print_stats(18)
    while engine.has_work():
        engine.step()


def _git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default="gpt-oss-20b", help="preset (with --load-format dummy) or folder"
    )
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: input + output + 32; `tinyoss serve` takes the model's 131072")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: the batch size; `tinyoss serve` takes 256 (more CUDA graphs)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs the model is split over; bytes and roofline are per GPU")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size: the experts dealt out whole, not cut")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="finish each step before launching the next")
    p.add_argument(
        "--mxfp4-backend",
        default=None,
        choices=MXFP4_BACKENDS,
        help="MoE kernel (default: env TINYOSS_MXFP4_BACKEND, else auto)",
    )
    p.add_argument(
        "--mxfp4-layers", default="moe", help="moe, or a comma list adding qkv, o, lm_head; all"
    )
    p.add_argument("--fp8-layers", default="none",
                   help="none, or a comma list of qkv, o, lm_head in FP8; all")
    p.add_argument("--structured", nargs="+", choices=tuple(STRUCTURED), default=["none"],
                   help="constraint modes to measure in turn on one engine (none, json, string)")
    p.add_argument("--speculative-config", default=None,
                   help="vLLM's JSON (e.g. {\"method\": \"eagle3\", \"model\": DRAFT}): tok/s "
                   "counts every emitted token; prints the mean acceptance length")
    p.add_argument("--profile", action="store_true", help="print a per-kernel time table")
    p.add_argument("--trace", default=None,
                   help="with --profile: write the profiled steps' Chrome trace to this file")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse)")
    p.add_argument("--json", default=None, help="write the record to this file")
    args = p.parse_args()
    if not torch.cuda.is_available():  # else the 20b would load on the CPU, then crash or crawl
        raise SystemExit(
            "bench/decode_latency.py is a GPU benchmark (decode steps against the GPU's memory "
            "bandwidth): it needs a CUDA GPU, and PyTorch sees none. It has no CPU mode; to try "
            "tinyoss on the CPU, run: tinyoss generate 'Hello' --model tiny"
        )
    records = run(args)
    for record in records:
        report(record, args)
    if len(records) > 1:
        base = records[0]["ms_per_step_median"]
        for r in records[1:]:
            print(f"{r['structured_output']} against {records[0]['structured_output']}: "
                  f"{100 * (r['ms_per_step_median'] / base - 1):+.1f}% ms/step")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        out = records[0] if len(records) == 1 else records
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


def report(record: dict, args: argparse.Namespace) -> None:
    need = record["bytes_per_step"]
    print(
        f"{record['gpu']} | {record['model']} | batch {args.batch_size} | in {args.input_len} "
        f"out {args.output_len} | {record['engine']} | graphs {record['cuda_graphs']} | "
        f"async scheduling {record['async_scheduling']} | structured output "
        f"{record['structured_output']}"
    )
    print(
        f"TTFT {record['ttft_ms']:.1f} ms | decode {record['ms_per_step_median']:.3f} ms/step "
        f"(p90 {record['ms_per_step_p90']:.3f}) | {record['tok_per_s']:.1f} tok/s | tokens "
        f"sha256 {record['tokens_sha256']}"
    )
    if "mean_acceptance_length" in record:
        print(f"speculative decoding {record['speculative_config']}: mean acceptance length "
              f"{record['mean_acceptance_length']:.2f} tokens a verify step over "
              f"{record['verify_steps']} of them (the roofline figures below count one token "
              "a step)")
    per_gpu = " per GPU" if record["tensor_parallel_size"] > 1 else ""
    ep = " (experts whole: expert parallel)" if record.get("expert_parallel") else ""
    print(
        f"tensor parallel {record['tensor_parallel_size']}{ep} | bytes/step{per_gpu} "
        f"{need['total'] / 1e9:.3f} GB (attn {need['attention_weights'] / 1e9:.2f}, "
        f"experts {need['experts'] / 1e9:.2f}, lm_head {need['lm_head'] / 1e9:.2f}, "
        f"kv {need['kv_cache'] / 1e9:.3f}) | copy bw {record['copy_bandwidth_gb_s']:.0f} GB/s | "
        f"achieved {record['achieved_gb_s']:.0f} GB/s = {100 * record['roofline_fraction']:.1f}% "
        f"of roofline ({record['roofline_tok_per_s']:.0f} tok/s ceiling)"
    )


if __name__ == "__main__":
    main()
