"""Speculative decoding at batch 1: what a verify step costs, and the speed drafts can buy.

    python bench/spec_decode.py --model gpt-oss-20b --load-format dummy --ks 1 2 3 4 5 6 7 8

Random weights accept no real draft, so besides n-gram lookup this measures:
(a) the time of a step that verifies k drafts (k + 1 query tokens), against a plain decode
    step, for each k: measured with drafts that are always wrong (the step's work does not
    depend on acceptance), which also records the greedy continuation as verify steps compute
    it;
(b) tok/s with an oracle proposer that replays that continuation: every draft the model
    computes the same way is accepted, the ceiling any proposer can reach. (A continuation
    recorded by plain decode steps is no oracle on random weights: their logits are nearly
    flat, and the verify steps' prefill kernels round differently from the decode kernels, so
    near-ties fall the other way within a few tokens.)
(c) the tok/s implied by published mean acceptance lengths at those verify costs, labelled as
    a projection (acceptance length / verify step time);
(d) n-gram lookup on a prompt built so that lookup finds the model's own continuation: the
    model's greedy continuation C of a prompt P is recorded, then the prompt is P + C + P; the
    lookup drafts C after the repeated P. Whether the random model repeats C there is its own
    business: the acceptance it gets is reported as measured. The random model is chaotic:
    neither that, nor its own output, nor a prompt of one token repeated (`--ngram-repeat N`)
    gives lookup anything to find. `--ngram-last-token` makes it predictable instead: every
    block's input norms zeroed leave a model whose next token depends on the last
    token alone, so C comes again after P + C + P (same kernels and bytes, other tokens).
(e) with `--eagle3 LAYOUT` (nvidia: the target's 201k-token head; specforge: a 32k draft
    vocabulary), a full-size synthetic EAGLE-3 draft in that layout: the GPU time of its
    drafting after each step (CUDA events around it), decode with it (random drafts: nothing
    is accepted, so this is its cost), the oracle with the draft's cost included, and the
    published acceptance lengths projected at verify + draft cost.
Greedy decoding, input `--input-len` random tokens, `--output-len` generated tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinyoss import LLM, SamplingParams  # noqa: E402
from tinyoss.engine.core import CoreRequest  # noqa: E402
from tinyoss.engine.speculative import NgramProposer  # noqa: E402
from tinyoss.tools.eagle3_checkpoints import write_synthetic_draft  # noqa: E402

# Published mean acceptance lengths (tokens per verify step, the bonus token included).
PUBLISHED = {
    "gpt-oss-20b": [("nebius EAGLE3-gpt-oss-20b, 7 drafts, temperature 0", 7, 3.49)],
    "gpt-oss-120b": [("SGLang EAGLE-3 on one H100, 3 steps / 4 drafts", 4, 2.41)],
}


class Replay:
    """Drafts a recorded continuation of the prompt (`wrong`: each draft off by one id)."""

    def __init__(self, prompt: list[int], continuation: list[int], wrong: bool = False) -> None:
        self.key, self.continuation, self.wrong = tuple(prompt), continuation, wrong

    def propose(self, token_ids: list[int], num_prompt: int, limit: int) -> list[int]:
        assert tuple(token_ids[:num_prompt]) == self.key
        done = len(token_ids) - num_prompt
        draft = self.continuation[done : done + limit]
        return [(t + 1) % 199998 for t in draft] if self.wrong else draft


def decode(engine, prompt: list[int], output_len: int, tag: str) -> tuple[list[int], list[float],
                                                                          list[int]]:
    """Runs one greedy request; (its tokens, each decode step's seconds, tokens per step)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.add(CoreRequest(tag, prompt, params))
    tokens: list[int] = []
    while not tokens:  # the prefill, up to the first token
        tokens += [t for d in engine.step() for t in d.token_ids]
    times, per_step = [], []
    while engine.has_work():
        t = time.perf_counter()
        got = [t for d in engine.step() for t in d.token_ids]
        times.append(time.perf_counter() - t)
        per_step.append(len(got))
        tokens += got
    return tokens, times, per_step


def measure(engine, prompt: list[int], args, proposer, k: int, tag: str) -> dict:
    engine.proposer, engine.num_speculative_tokens = proposer, k
    runs = [decode(engine, prompt, args.output_len, f"{tag}-{i}") for i in range(args.iters)]
    engine.proposer, engine.num_speculative_tokens = None, 0
    tokens = runs[0][0]
    steps = [t for _, times, _ in runs for t in times]
    emitted = [n for _, _, per in runs for n in per]
    total = sum(sum(times) for _, times, _ in runs)
    return {
        "k": k,
        "ms_per_step": 1e3 * statistics.median(steps),
        "ms_per_step_mean_p90_max": [1e3 * statistics.fmean(steps),
                                     1e3 * statistics.quantiles(steps, n=10)[-1],
                                     1e3 * max(steps)],
        "tokens_per_step": sum(emitted) / len(emitted),
        "tok_per_s": sum(emitted) / total,
        "tokens": tokens,
    }


def profile(engine, prompt: list[int], greedy: list[int], k: int = 3) -> None:
    """Where a verify step's time goes: wall time against GPU kernel time, top kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine.proposer = Replay(prompt, greedy, wrong=True)
    engine.num_speculative_tokens = k
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add(CoreRequest("profile", prompt, params))
    for _ in range(8):  # the prefill and warm verify steps
        engine.step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 10
    while engine.has_work():
        engine.step()
    engine.proposer, engine.num_speculative_tokens = None, 0
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    gpu = sum(e.self_device_time_total for e in events) / 10 / 1e3
    print(f"verify step at k={k}: wall {1e3 * wall:.2f} ms, GPU kernels {gpu:.2f} ms")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18,
                                    max_name_column_width=60))


def _period(tokens: list[int]) -> int | None:
    """The smallest period (<= 32) of the last 64 tokens, if they repeat."""
    tail = tokens[-64:]
    return next((q for q in range(1, 33) if tail[q:] == tail[:-q]), None)


def lookup_rate(prompt: list[int], out: list[int], k: int) -> float:
    """Tokens a step that n-gram lookup (k drafts) would get on `out`, computed on the host."""
    proposer, i, steps = NgramProposer(4, 1), 0, 0
    while i < len(out):
        drafts = proposer.propose(prompt + out[:i], len(prompt), k)
        n = next((a for a, d in enumerate(drafts) if i + a >= len(out) or d != out[i + a]),
                 len(drafts))
        i, steps = i + n + 1, steps + 1
    return len(out) / steps


def ngram_repeat(engine, pool: list[int], args, base: dict, k: int = 4) -> dict:
    """(d'): a prompt the random model continues predictably. A prompt of one token t repeated
    makes every attention layer average near-identical values, so the state at its end hardly
    depends on the position and the continuation tends to settle (t again, or a short cycle).
    Of `--ngram-repeat` candidates t (distinct tokens of the model's own greedy output and of
    the random prompt, which random heads favour), the one whose 64-token greedy continuation
    n-gram lookup would draft best is measured with and without n-gram speculation."""
    candidates = list(dict.fromkeys(pool))[: args.ngram_repeat]
    scored = []
    for i, t in enumerate(candidates):
        prompt = [t] * args.input_len
        out, _, _ = decode(engine, prompt, 64, f"repeat{i}")
        scored.append((lookup_rate(prompt, out, k), t))
    rate, best = max(scored)
    prompt = [best] * args.input_len
    ngram = measure(engine, prompt, args, NgramProposer(4, 1), k, "repeat-ngram")
    plain = measure(engine, prompt, args, None, 0, "repeat-plain")
    ngram["speedup"] = ngram["tok_per_s"] / plain["tok_per_s"]
    ngram["same_tokens"] = ngram.pop("tokens") == plain["tokens"]
    ngram["token"], ngram["candidates"] = best, len(candidates)
    ngram["predicted_tokens_per_step_64"] = rate
    ngram["candidate_rates"] = sorted(r for r, _ in scored)[::-1][:10]
    ngram["period_of_greedy_tail"] = _period(plain.pop("tokens"))
    print(f"n-gram (k={k}) on token {best} repeated {args.input_len} times (best of "
          f"{len(candidates)} tokens; lookup on 64 tokens predicted {rate:.2f} tokens/step): "
          f"{ngram['tokens_per_step']:.2f} tokens/step, {ngram['tok_per_s']:.1f} tok/s against "
          f"{plain['tok_per_s']:.1f} without ({ngram['speedup']:.2f}x), same tokens "
          f"{ngram['same_tokens']}, greedy tail period {ngram['period_of_greedy_tail']}")
    return {"ngram": ngram, "plain": plain}


def ngram_last_token(engine, prompt: list[int], args, k: int = 4) -> dict:
    """(d''): a random model made to continue predictably. Each block's input norms are zeroed
    in place, so attention and the MoE see zeros and add their biases only (attention's
    through values that are all alike, weighted against the sink by the context's length): the
    residual stream is the last token's embedding plus near-constants, and the next token
    depends on the last token alone. The greedy continuation C of a prompt P then comes again
    after P + C + P, where lookup drafts it. The kernels, the bytes read and so the cost of
    every step are the unmodified model's; only which tokens come out changes. This runs
    last: the weights stay zeroed."""
    with torch.no_grad():
        for layer in engine.executor.model.model.layers:
            layer.input_layernorm.weight.zero_()
            layer.post_attention_layernorm.weight.zero_()
    c, _, _ = decode(engine, prompt, args.output_len, "last-c")
    looped = prompt + c + prompt
    ngram = measure(engine, looped, args, NgramProposer(4, 1), k, "last-ngram")
    plain = measure(engine, looped, args, None, 0, "last-plain")
    ngram["speedup"] = ngram["tok_per_s"] / plain["tok_per_s"]
    ngram["same_tokens"] = ngram.pop("tokens") == plain["tokens"]
    ngram["plain_repeats_c"] = sum(a == b for a, b in zip(plain.pop("tokens"), c)) / len(c)
    print(f"n-gram (k={k}) on P + C + P with the blocks' input norms zeroed (the next "
          f"token depends on the last token; plain decode repeats "
          f"{100 * ngram['plain_repeats_c']:.0f}% of C): {ngram['tokens_per_step']:.2f} "
          f"tokens/step, {ngram['tok_per_s']:.1f} tok/s against {plain['tok_per_s']:.1f} "
          f"without ({ngram['speedup']:.2f}x), same tokens {ngram['same_tokens']}")
    return {"ngram": ngram, "plain": plain}


def eagle3(engine, drafter, prompt: list[int], args, base: dict, by_k: dict,
           continuations: dict[int, list[int]]) -> dict:
    """(e): the draft's GPU time a step, decode with it, the oracle with its cost."""
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    propose = drafter.propose

    def timed(*a, **kw):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = propose(*a, **kw)
        end.record()
        events.append((start, end))
        return out

    drafter.propose = timed
    engine.executor.drafter = drafter
    rows = []
    print(f"EAGLE-3 ({args.eagle3} layout, full size, random weights) | k | draft GPU ms/step | "
          "ms/step (nothing accepted) | tok/s | oracle + draft tok/s | speed-up")
    built_k, graphs = drafter.k, drafter.graphs
    for k in args.ks:
        drafter.k, engine.scheduler.draft_lookahead = k, k - 1
        drafter.graphs = graphs if k == built_k else {}  # captured for the built k only
        events.clear()
        r = measure(engine, prompt, args, None, k, f"eagle{k}")
        torch.cuda.synchronize()
        r["draft_ms"] = statistics.median(a.elapsed_time(b) for a, b in events)
        r["same_tokens_as_plain"] = r.pop("tokens") == base["tokens"]
        oracle = measure(engine, prompt, args, Replay(prompt, continuations[k]), k, f"eo{k}")
        r["oracle_tok_per_s"] = oracle["tok_per_s"]
        r["oracle_speedup"] = oracle["tok_per_s"] / base["tok_per_s"]
        r["draft_graphs"] = bool(drafter.graphs)
        rows.append(r)
        mean, p90, top = r["ms_per_step_mean_p90_max"]
        print(f"{k}{'' if drafter.graphs else ' (eager)'} | {r['draft_ms']:.3f} | "
              f"{r['ms_per_step']:.3f} (mean {mean:.2f}, p90 "
              f"{p90:.2f}, max {top:.1f}) | {r['tok_per_s']:.1f} | {r['oracle_tok_per_s']:.1f} | "
              f"{r['oracle_speedup']:.2f}x")
    engine.executor.drafter, drafter.k, drafter.graphs = None, built_k, graphs
    projections = []
    for label, k, length in PUBLISHED.get(args.model, []):
        row = next((r for r in rows if r["k"] == k), None)
        if row is not None and k in by_k:
            ms = by_k[k]["verify_ms_per_step"] + row["draft_ms"]
            tps = length / (ms / 1e3)
            projections.append({"source": label, "k": k, "acceptance_length": length,
                                "ms_per_step": ms, "tok_per_s": tps,
                                "speedup": tps / base["tok_per_s"]})
            print(f"PROJECTION (published acceptance; measured verify + draft cost): {label}: "
                  f"{length} tokens/step at k={k} -> {tps:.0f} tok/s "
                  f"({tps / base['tok_per_s']:.2f}x)")
    return {"layout": args.eagle3, "rows": rows, "projections": projections}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--profile", action="store_true",
                   help="also: the GPU kernels of verify steps at k=3 (torch profiler)")
    p.add_argument("--ngram-search", type=int, default=0,
                   help="try up to N random prompts for one whose greedy continuation loops")
    p.add_argument("--ngram-repeat", type=int, default=0,
                   help="try N prompts of one token repeated for the most predictable greedy "
                        "continuation, and measure n-gram lookup on it")
    p.add_argument("--ngram-last-token", action="store_true",
                   help="last: zero the blocks' input norms, so the model predicts from the "
                        "last token alone, and measure n-gram lookup on P + C + P")
    p.add_argument("--eagle3", default=None, choices=["nvidia", "specforge"],
                   help="also measure a full-size synthetic EAGLE-3 draft in this layout")
    p.add_argument("--commit", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/spec_decode.py is a GPU benchmark: it needs a CUDA GPU")
    # the config sizes the verify graphs (k + 1 tokens up to the largest k); the proposer is
    # set per measurement below
    spec = {"method": "ngram", "num_speculative_tokens": max(args.ks)}
    if args.eagle3:
        from tinyoss.engine.builder import load_model_config
        from tinyoss.config import EngineConfig

        target = load_model_config(None, EngineConfig(model=args.model, load_format="dummy"))
        folder = write_synthetic_draft(Path("/tmp/tinyoss-bench-eagle3") / args.eagle3,
                                       args.eagle3, target, small=False)
        spec = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": max(args.ks)}
    llm = LLM(args.model, load_format=args.load_format, max_num_seqs=1,
              max_model_len=3 * args.input_len + 2 * args.output_len + 64,
              enable_prefix_caching=False, speculative_config=spec,
              gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
    engine = llm.engine
    drafter, engine.executor.drafter = engine.executor.drafter, None  # (e) alone drafts
    rng = random.Random(0)
    prompt = [rng.randrange(199998) for _ in range(args.input_len)]
    base = measure(engine, prompt, args, None, 0, "plain")
    greedy = base["tokens"]
    print(f"{torch.cuda.get_device_name()} | {args.model} | batch 1 | in {args.input_len} out "
          f"{args.output_len} | {engine.info.summary}")
    print(f"no speculation: {base['ms_per_step']:.3f} ms/step, {base['tok_per_s']:.1f} tok/s")
    rows, continuations = [], {}
    print("k | verify ms/step | x decode step | oracle tokens/step | oracle tok/s | speed-up | "
          "same tokens as plain decode")
    for k in args.ks:
        cost = measure(engine, prompt, args, Replay(prompt, greedy, wrong=True), k, f"cost{k}")
        verified = continuations[k] = cost.pop("tokens")
        r = measure(engine, prompt, args, Replay(prompt, verified), k, f"oracle{k}")
        r["verify_ms_per_step"] = cost["ms_per_step"]
        r["cost_ratio"] = cost["ms_per_step"] / base["ms_per_step"]
        r["speedup"] = r["tok_per_s"] / base["tok_per_s"]
        r["same_tokens_as_plain"] = r.pop("tokens") == greedy
        rows.append(r)
        print(f"{k} | {cost['ms_per_step']:.3f} | {r['cost_ratio']:.2f} | "
              f"{r['tokens_per_step']:.2f} | {r['tok_per_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['same_tokens_as_plain']}")
    by_k = {r["k"]: r for r in rows}
    projections = []
    for label, k, length in PUBLISHED.get(args.model, []):
        if k in by_k:
            tps = length / (by_k[k]["verify_ms_per_step"] / 1e3)
            projections.append({"source": label, "k": k, "acceptance_length": length,
                                "tok_per_s": tps, "speedup": tps / base["tok_per_s"]})
            print(f"PROJECTION (not measured: published acceptance, measured verify cost): "
                  f"{label}: {length} tokens/step at k={k} -> {tps:.0f} tok/s "
                  f"({tps / base['tok_per_s']:.2f}x)")
    # n-gram on P + C + P: the lookup finds C after the repeated P
    looped = prompt + greedy + prompt
    k = 4
    ngram = measure(engine, looped, args, NgramProposer(4, 1), k, "ngram")
    plain = measure(engine, looped, args, None, 0, "ngram-plain")
    ngram["speedup"] = ngram["tok_per_s"] / plain["tok_per_s"]
    ngram["same_tokens"] = ngram.pop("tokens") == plain.pop("tokens")
    print(f"n-gram (k={k}) on P + C + P: {ngram['tokens_per_step']:.2f} tokens/step, "
          f"{ngram['tok_per_s']:.1f} tok/s against {plain['tok_per_s']:.1f} without "
          f"({ngram['speedup']:.2f}x), same tokens {ngram['same_tokens']}")
    # n-gram on a prompt alone: the lookup searches the model's own output, which pays once a
    # greedy continuation falls into a loop; with --ngram-search N, the first of N random
    # prompts whose continuation loops (the period of its last 64 tokens is reported)
    own_prompt, plain_tokens, tried = prompt, greedy, 1
    period = _period(greedy)
    while period is None and tried <= args.ngram_search:
        own_prompt = [rng.randrange(199998) for _ in range(args.input_len)]
        plain_tokens, _, _ = decode(engine, own_prompt, args.output_len, f"search{tried}")
        period, tried = _period(plain_tokens), tried + 1
    own = measure(engine, own_prompt, args, NgramProposer(4, 1), k, "ngram-own")
    own["speedup"] = own["tok_per_s"] / base["tok_per_s"]
    own["same_tokens"] = own.pop("tokens") == plain_tokens
    own["period_of_greedy_tail"], own["prompts_tried"] = period, tried
    print(f"n-gram (k={k}) on a prompt alone (lookup in its own output; prompts tried: "
          f"{tried}; the greedy tail's period: {period}): "
          f"{own['tokens_per_step']:.2f} tokens/step, {own['tok_per_s']:.1f} tok/s "
          f"({own['speedup']:.2f}x), same tokens {own['same_tokens']}")
    repeat = ngram_repeat(engine, greedy + prompt, args, base) if args.ngram_repeat else None
    eagle = None if drafter is None else eagle3(engine, drafter, prompt, args, base, by_k,
                                                 continuations)
    if args.profile:
        profile(engine, prompt, greedy)
    last = ngram_last_token(engine, prompt, args) if args.ngram_last_token else None
    if args.json:
        commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                               capture_output=True, text=True).stdout.strip()
        record = {"gpu": torch.cuda.get_device_name(), "commit": commit,
                  "command": " ".join(sys.argv), "model": args.model,
                  "engine": engine.info.summary, "base": base | {"tokens": None},
                  "oracle": rows, "projections": projections,
                  "ngram": ngram, "ngram_plain": plain, "ngram_own": own,
                  "ngram_repeat": repeat, "ngram_last_token": last,
                  "eagle3": eagle}  # fmt: skip
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
