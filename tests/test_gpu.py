"""The GPU fast path against the torch reference: FlashInfer sink attention (both window groups,
prefill, chunked prefill, decode, graph-mode plans) and end-to-end greedy decoding on `tiny`.
Skipped without a CUDA GPU; run on the device machine."""

import dataclasses
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ATTN_TOL = 2e-2  # ||flashinfer - reference|| / ||reference||, bf16 inputs


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def attention_setup():
    from tinyoss.kernels.attention import TorchAttention
    from tinyoss.kernels.attention_flashinfer import FlashInferAttention

    torch.manual_seed(0)
    hq, hk, d, bs, blocks = 64, 8, 64, 16, 512
    dev = torch.device("cuda")
    caches = [
        (
            torch.randn(blocks + 1, bs, hk, d, device=dev, dtype=torch.bfloat16),
            torch.randn(blocks + 1, bs, hk, d, device=dev, dtype=torch.bfloat16),
        )
        for _ in range(2)
    ]  # layer 0 sliding (group 0), layer 1 full (group 1)
    groups, windows = [0, 1], [128, 0]
    fi = FlashInferAttention(
        caches,
        groups,
        windows,
        hq,
        hk,
        d,
        bs,
        dummy_block=blocks,
        max_num_tokens=4096,
        max_num_seqs=8,
        max_model_len=2048,
    )
    ref = TorchAttention([(k.clone(), v.clone()) for k, v in caches], groups, windows, d**-0.5)
    return fi, ref, (hq, hk, d, bs, blocks)


def _rope_table(n):
    """gpt-oss's YaRN cos/sin table for n positions."""
    from tinyoss.config import ModelConfig
    from tinyoss.model.presets import GENERATION_CONFIG, preset_config
    from tinyoss.model.rope import cos_sin_cache

    config = ModelConfig.from_dict(preset_config("gpt-oss-20b"), GENERATION_CONFIG)
    return cos_sin_cache(config.rope, config.head_dim, n, torch.device("cuda"))


def _meta(query_lens, seq_lens, bs, blocks, windows, rng):
    from tinyoss.kernels.attention import AttentionMetadata, GroupMetadata

    free = list(range(blocks))
    rng.shuffle(free)
    groups = []
    for w in windows:
        tables, starts, slots = [], [], []
        for q, n in zip(query_lens, seq_lens):
            first = max(0, n - q - w + 1) // bs if w else 0  # blocks a window already dropped
            table = [free.pop() for _ in range(-(-n // bs) - first)]
            tables.append(table)
            starts.append(first * bs)
            slots += [table[p // bs - first] * bs + p % bs for p in range(n - q, n)]
        groups.append(GroupMetadata(tables, starts, torch.tensor(slots, device="cuda")))
    return AttentionMetadata(list(query_lens), list(seq_lens), groups)


@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [
        ([300, 17, 129], [300, 17, 129]),  # prefill
        ([64, 1, 200], [500, 90, 1000]),  # chunked prefill next to a decode
        ([1, 1, 1, 1, 1], [1, 128, 129, 700, 2047]),  # decode
    ],
)
def test_flashinfer_sink_attention_matches_reference(attention_setup, query_lens, seq_lens):
    fi, ref, (hq, hk, d, bs, blocks) = attention_setup
    meta = _meta(query_lens, seq_lens, bs, blocks, [128, 0], random.Random(len(query_lens)))
    t = sum(query_lens)
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(hq, device="cuda") * 2
    pos = torch.tensor([p for ql, n in zip(query_lens, seq_lens) for p in range(n - ql, n)],
                       device="cuda")
    rope = _rope_table(4096)
    for layer in (0, 1):
        fi.plan(meta)
        ref.plan(meta)
        out = fi(layer, q.clone(), k.clone(), v, sinks, pos, rope)  # prefill rotates in place
        # the reference rotates in fp32 (bf16 inputs would round its cos/sin to bf16)
        expected = ref(layer, q.float(), k.float(), v, sinks, pos, rope)
        err = _rel(out, expected)
        assert err < ATTN_TOL, (layer, err)
        no_sink = _rel(out, ref(layer, q.float(), k.float(), v, torch.full_like(sinks, -1e4),
                                pos, rope))
        assert no_sink > 3 * err, (layer, err, no_sink)  # the sinks were not ignored


def test_a_plan_made_while_the_gpu_is_behind_keeps_its_schedule(attention_setup):
    """FlashInfer's plan copies the schedule from a pinned host buffer without waiting: two
    prefill steps planned while the GPU is still busy (as under async scheduling, or on a
    tensor-parallel worker) must each run their own schedule (`PlanRing`), giving exactly the
    outputs of the same steps run one at a time. Its steps store K/V in the shared engine's
    caches only (not the reference's): they are put back after, or later tests that draw the
    same blocks would compare different keys."""
    fi, _, shape = attention_setup
    saved = [(k.clone(), v.clone()) for k, v in fi.kv_caches]
    try:
        want, got = two_prefills_behind_a_busy_stream(fi, shape)
    finally:
        for (k, v), (k0, v0) in zip(fi.kv_caches, saved):
            k.copy_(k0)
            v.copy_(v0)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def two_prefills_behind_a_busy_stream(fi, shape, sleep_cycles: int = 20_000_000
                                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two prefill steps' attention outputs run one at a time, then the same two planned and
    launched behind a ~10 ms sleep on the stream (both plans made before the GPU copies
    either). Also bench/experiments/flashinfer_plan_race/race.py's."""
    hq, hk, d, bs, blocks = shape
    rng = random.Random(5)
    steps = []
    for query_lens, seq_lens in (([300, 17, 129], [300, 17, 129]), ([64, 1, 200], [500, 90, 999])):
        meta = _meta(query_lens, seq_lens, bs, blocks, [128, 0], rng)
        t = sum(query_lens)
        qkv = [torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk)]
        pos = torch.tensor([p for ql, n in zip(query_lens, seq_lens) for p in range(n - ql, n)],
                           device="cuda")
        steps.append((meta, qkv, pos))
    sinks, rope = torch.randn(hq, device="cuda"), _rope_table(4096)

    def run_all(wait_each: bool) -> list[torch.Tensor]:
        outs = []
        for meta, (q, k, v), pos in steps:
            fi.plan(meta)
            outs.append(fi(1, q.clone(), k.clone(), v, sinks, pos, rope))
            if wait_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return outs

    run_all(True)  # both steps' K/V stored: the cache then reads the same in every pass
    want = run_all(True)
    torch.cuda._sleep(sleep_cycles)
    return want, run_all(False)


def test_graph_mode_plan_pads_and_matches_unpadded(attention_setup):
    fi, ref, (hq, hk, d, bs, blocks) = attention_setup
    meta = _meta([1, 1, 1], [5, 300, 140], bs, blocks, [128, 0], random.Random(9))
    q = torch.randn(4, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(4, hk, d, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(hq, device="cuda")
    pos, rope = torch.tensor([4, 299, 139, 0], device="cuda"), _rope_table(512)
    fi.plan(meta, graph_size=4)
    padded = fi(1, q, k, v, sinks, pos, rope)
    fi.plan(meta)
    eager = fi(1, q[:3], k[:3], v[:3], sinks, pos[:3], rope)
    assert _rel(padded[:3], eager) < 1e-3


def test_verify_rows_match_reference(attention_setup):
    """A verify step's graph plan (`rows`): several query tokens per sequence, each a row of
    the decode kernel with its own key range (across the window edge, and past one split),
    after a separate rope and store; padded to the graph's size."""
    fi, ref, (hq, hk, d, bs, blocks) = attention_setup
    query_lens, seq_lens = [3, 1, 2], [130, 50, 700]  # 6 rows, padded to the 8 it holds
    meta = _meta(query_lens, seq_lens, bs, blocks, [128, 0], random.Random(5))
    t, size = sum(query_lens), 8
    q = torch.randn(size, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(size, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(size, hk, d, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(hq, device="cuda") * 2
    pos = [p for ql, n in zip(query_lens, seq_lens) for p in range(n - ql, n)]
    pos = torch.tensor(pos + [0] * (size - t), device="cuda")
    rope = _rope_table(4096)
    for layer in (0, 1):
        fi.plan(meta, graph_size=size, rows=True)
        ref.plan(meta)
        out = fi(layer, q.clone(), k.clone(), v, sinks, pos, rope)[:t]
        expected = ref(layer, q[:t].float(), k[:t].float(), v[:t], sinks, pos[:t], rope)
        assert _rel(out, expected) < ATTN_TOL, layer


def test_draft_attention_matches_reference(attention_setup):
    """An EAGLE-3 draft layer's attention on the GPU: the step's plan with no sinks (-inf), and
    `decode_rows` on device-computed tables, key ranges and slots (one of them < 0: not
    stored), against the torch reference."""
    fi, ref, (hq, hk, d, bs, blocks) = attention_setup
    no_sinks = torch.full((hq,), float("-inf"), device="cuda")
    rope = _rope_table(4096)
    meta = _meta([40, 1], [40, 300], bs, blocks, [128, 0], random.Random(3))
    q = torch.randn(41, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(41, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(41, hk, d, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor(list(range(40)) + [299], device="cuda")
    fi.plan(meta)
    ref.plan(meta)
    out = fi(1, q.clone(), k.clone(), v, no_sinks, pos, rope)
    expected = ref(1, q.float(), k.float(), v, no_sinks, pos, rope)
    assert out.isfinite().all() and _rel(out, expected) < ATTN_TOL

    tables = torch.randperm(blocks, device="cuda")[:3 * 40].view(3, 40).to(torch.int32)
    position = torch.tensor([0, 200, 631], device="cuda")
    slots = tables.gather(1, (position // bs)[:, None])[:, 0].long() * bs + position % bs
    real, slots[2] = slots[2].item(), -1
    ranges = torch.stack([torch.zeros_like(position), position + 1], 1).to(torch.int32)
    q, k, v = (torch.randn(3, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk))
    kept = fi.kv_caches[1][0].view(-1, hk, d)[real].clone()
    out = fi.decode_rows(1, q, k, v, no_sinks, position, rope, tables, ranges, slots)
    expected = ref.decode_rows(1, q.float(), k.float(), v, no_sinks, position, rope, tables,
                               ranges, slots)
    assert out.isfinite().all() and _rel(out, expected) < ATTN_TOL
    stored = fi.kv_caches[1][0].view(-1, hk, d)
    assert _rel(stored[slots[:2]], ref.kv_caches[1][0].view(-1, hk, d)[slots[:2]]) < 1e-2
    assert torch.equal(stored[real], kept)  # slot < 0: nothing stored


PROMPT_LENS = (7, 150, 400)


def _greedy(llm, prompts, n=32):
    from tinyoss import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.mark.parametrize(
    "enforce_eager,async_scheduling,piecewise",
    [(False, True, 2048), (True, True, 2048), (False, False, 2048), (False, True, 0)],
)
def test_tiny_greedy_matches_cpu_reference(tiny_dir, enforce_eager, async_scheduling,
                                           piecewise):
    """32 greedy tokens on the fast path equal the fp32 CPU reference, or part at a near tie:
    CUDA graphs on and off (piecewise prefill graphs on and off), async scheduling on and off."""
    from tinyoss import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(199998) for _ in range(n)] for n in PROMPT_LENS]
    cpu = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=8192)
    gpu = LLM(str(tiny_dir), device="cuda", max_num_seqs=8, enforce_eager=enforce_eager,
              kv_cache_tokens=8192, async_scheduling=async_scheduling,
              max_prefill_graph_tokens=piecewise)
    assert (gpu.engine.executor.pieces is not None) == (piecewise > 0 and not enforce_eager)
    assert type(gpu.engine.executor.attention).__name__ == "FlashInferAttention"
    _same_or_near_tie(cpu, tiny_dir, prompts, _greedy(cpu, prompts), _greedy(gpu, prompts))


def test_steps_replay_graphs_on_the_stream_they_were_captured_on(tiny_dir, monkeypatch):
    """Every graph (decode and piecewise) replays on the engine's own stream, where it was
    captured, whichever thread steps the engine (one replayed elsewhere ran slower), and the
    tokens do not depend on the thread."""
    import threading

    from tinyoss import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(199998) for _ in range(n)] for n in PROMPT_LENS]
    llm = LLM(str(tiny_dir), device="cuda", max_num_seqs=8, kv_cache_tokens=8192,
              enable_prefix_caching=False)  # the second run computes what the first did
    executor = llm.engine.executor
    assert executor.stream is not None and executor.pieces is not None
    assert executor.stream != torch.cuda.default_stream()
    streams = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay",
                        lambda g: streams.append(torch.cuda.current_stream()) or replay(g))
    here = _greedy(llm, prompts)
    there = []
    worker = threading.Thread(target=lambda: there.append(_greedy(llm, prompts)))
    worker.start()
    worker.join()
    assert there == [here]
    assert len(streams) > 2 * 32 and set(streams) == {executor.stream}


def _same_or_near_tie(cpu, folder, prompts, want, got, bf16: bool = True) -> None:
    """Greedy tokens `got` equal the CPU reference's `want`, or part at a tie the engine may
    resolve either way:
    - in the logits: the reference's logits for its own token and the one taken are within
      twice the largest logit difference between the reference run in bfloat16 and in float32
      (CPU, the same tokens) at that position (on the random tiny model ~0.15-0.35), or 0.1
      for a float32 engine;
    - in a router: a layer's 4th and 5th expert for that token are within twice the bf16
      reference's largest router-logit difference (1e-3 for float32), and the reference with
      that layer's choice flipped takes the engine's token (within the logit tie). Such a flip
      moves the logits by whole units (2.3 at token 4 of the 400-token prompt, where layer 0's
      gap is 0.003), so it must be shown, not allowed for."""
    from tests.test_model_reference import run_paged
    from tinyoss.model.loader import load_model

    model = cpu.engine.executor.model
    low = None
    for prompt, w, g in zip(prompts, want, got):
        m = next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), None)
        if m is None:
            continue
        if low is None and bf16:
            low = load_model(folder, model.config, dtype=torch.bfloat16,
                             device=torch.device("cpu"))
            low.init_runtime(model.rope_cache.shape[0], torch.device("cpu"))
        ids = torch.tensor(prompt + w[:m])
        ref, routers = _with_routers(model, lambda: run_paged(model, model.config, ids)[-1])
        if low is None:
            shift, router_shift = 0.05, 5e-4
        else:
            low_ref, low_routers = _with_routers(
                low, lambda: run_paged(low, model.config, ids, torch.bfloat16)[-1].float())
            shift = (low_ref - ref).abs().max().item()
            router_shift = max((a.float() - b).abs().max().item()
                               for a, b in zip(low_routers, routers))
        margin = (ref[w[m]] - ref[g[m]]).item()  # the reference's token over the one taken
        if margin < 2 * shift:
            continue
        k = model.config.num_experts_per_tok
        gaps = [(r.topk(k + 1).values[k - 1] - r.topk(k + 1).values[k]).item() for r in routers]
        near = [layer for layer, gap in enumerate(gaps) if gap < 2 * router_shift]
        flipped = {layer: _with_routers(model, lambda: run_paged(model, model.config, ids)[-1],
                                        flip=layer)[0] for layer in near}
        assert any((alt.max() - alt[g[m]]).item() < 2 * shift for alt in flipped.values()), (
            f"diverged at token {m} with a clear margin {margin:.3f} (the logit tie threshold "
            f"there is {2 * shift:.3f}); router gaps between the {k}th and {k + 1}th expert "
            f"{[round(x, 4) for x in gaps]} (tie under {2 * router_shift:.4f}); flipping "
            f"layers {near} does not take the engine's token")


def _with_routers(model, run, flip: int | None = None):
    """(run(), the router logits of the last token a layer): the reference's top-k wrapped to
    record them; with `flip`, that layer's last token takes its k+1th expert for its kth."""
    from tinyoss.kernels import router_topk_torch

    kernels, routers = model.kernels, []
    original = kernels.router_topk

    def recorded(logits: torch.Tensor, k: int, held: tuple[int, int] | None = None):
        weights, ids = original(logits, k, held)
        if len(routers) == flip:
            top = logits[-1].float().topk(k + 1)
            keep = torch.cat([top.indices[: k - 1], top.indices[k:]])
            weights, ids = weights.clone(), ids.clone()
            top_weights, top_ids = router_topk_torch(logits[-1:, keep], k)
            weights[-1], ids[-1] = top_weights[0], keep[top_ids[0]]
        routers.append(logits[-1].float())
        return weights, ids

    kernels.router_topk = recorded
    try:
        return run(), routers
    finally:
        kernels.router_topk = original


def test_logit_bias_and_allowed_token_ids_on_the_gpu(tiny_dir):
    """The sampler's bias and token masks on CUDA under graphs and async scheduling: sampled
    tokens stay in allowed_token_ids, a bias of 100 makes its token the greedy pick while other
    rows of the batch go on as without it, and an id outside the vocabulary is refused before
    it can index the logits (a device-side assert would end the engine)."""
    from tinyoss import LLM, SamplingParams

    gpu = LLM(str(tiny_dir), device="cuda", max_num_seqs=8, kv_cache_tokens=8192)
    prompts = [[7, 8, 9, 10], [11, 12, 13]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = _greedy(gpu, prompts, 8)
    forced = 4242 if 4242 not in plain[0] else 4243
    biased = dataclasses.replace(greedy, logit_bias={forced: 100.0})
    out = gpu.generate(prompts, [biased, greedy], use_tqdm=False)
    assert out[0].outputs[0].token_ids == [forced] * 8
    assert out[1].outputs[0].token_ids == plain[1]
    allowed = [5, 500, 50000]
    sampled = SamplingParams(temperature=1.0, max_tokens=16, seed=3, allowed_token_ids=allowed,
                             ignore_eos=True)
    out = gpu.generate(prompts, sampled, use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in out)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gpu.generate(prompts, dataclasses.replace(greedy, logit_bias={10**7: 1.0}),
                     use_tqdm=False)
    assert _greedy(gpu, prompts, 8) == plain


def test_piecewise_graphs_match_eager_prefill(tiny_dir):
    """Prompt logprobs (every prompt position, teacher-forced) through piecewise graphs equal
    the eager forward's within bf16 noise: chunked prompts next to decodes, so steps mix
    prefill chunks, decodes and padding to each graph size."""
    from tinyoss import LLM, SamplingParams

    rng = random.Random(1)
    prompts = [[rng.randrange(199998) for _ in range(n)] for n in (5, 40, 130, 300, 700)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    runs = []
    for piecewise in (2048, 0):
        llm = LLM(str(tiny_dir), device="cuda", max_num_seqs=8, kv_cache_tokens=8192,
                  max_num_batched_tokens=96, max_prefill_graph_tokens=piecewise)
        assert (llm.engine.executor.pieces is not None) == bool(piecewise)
        runs.append([o.prompt_logprobs for o in llm.generate(prompts, sp, use_tqdm=False)])
        del llm
    for prompt, graph, eager in zip(prompts, *runs):
        # every position, each its own prompt token (across chunks of 96 too)
        assert [p.token_id for p in graph[1:]] == [p.token_id for p in eager[1:]] == prompt[1:]
        a = torch.tensor([p.logprob for p in graph[1:]])
        b = torch.tensor([p.logprob for p in eager[1:]])
        assert a.shape == b.shape and torch.isfinite(a).all()
        assert (a - b).abs().max().item() < 0.05, (a - b).abs().max().item()


def test_structured_outputs_under_graphs_and_async_scheduling(tiny_dir, monkeypatch):
    """JSON-schema constrained decoding on the GPU path (decode graphs, piecewise prefill
    graphs): valid documents, and the same tokens with async scheduling on (the sampling of a
    chained step waits for the previous tokens' masks) and off. Matchers are built off the step
    loop and their requests join when built, so the free row could run alone for a step or two
    in one run and not the other (a batch of another size, other bf16 sums, another greedy
    token): the first step here waits for every build, so both runs batch alike."""
    import json
    from concurrent.futures import wait

    from tinyoss import LLM, SamplingParams
    from tinyoss.engine.core import EngineCore
    from tinyoss.sampling_params import StructuredOutputs

    admit = EngineCore._admit_built

    def admit_all_built(core: EngineCore) -> None:
        wait([future for future, _ in core._building])
        admit(core)

    monkeypatch.setattr(EngineCore, "_admit_built", admit_all_built)

    so = StructuredOutputs(json={
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "role": {"enum": ["admin", "user"]}},
        "required": ["name", "age", "role"], "additionalProperties": False,
    })  # fmt: skip
    params = [SamplingParams(max_tokens=80, seed=i, temperature=0 if i == 0 else 1,
                             structured_outputs=so) for i in range(6)]  # fmt: skip
    params.append(SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))  # free row
    prompts = [f"person {i}:" for i in range(len(params))]
    runs = []
    for async_scheduling in (True, False):
        llm = LLM(str(tiny_dir), device="cuda", max_num_seqs=8, kv_cache_tokens=8192,
                  async_scheduling=async_scheduling)
        assert llm.engine.executor.graphs is not None
        runs.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    for out in runs[0][:-1]:
        assert out.finish_reason == "stop"
        doc = json.loads(out.text)
        assert set(doc) == {"name", "age", "role"} and 0 <= doc["age"] <= 120


@pytest.mark.parametrize("wrong", [0, 1, 3])
def test_speculative_greedy_on_the_gpu_equals_the_cpu_reference(tiny_dir, wrong):
    """Greedy decoding with drafts (all right, all wrong, every third wrong) on the GPU, in fp32
    through the torch kernels: token for token the CPU reference. (The bf16 kernels are no
    oracle here: on tiny's random weights their prefill logprobs differ from fp32 by up to 3.7
    at some positions, median 0.02, and verify steps run the prefill kernels.)"""
    from tests.test_speculative import Replay
    from tinyoss import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 150000) for _ in range(n)] for n in (3, 70, 140, 300)]
    cpu = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=8192)
    want = _greedy(cpu, prompts)
    gpu = LLM(str(tiny_dir), device="cuda", dtype="float32", attention_backend="torch",
              mxfp4_backend="torch", enforce_eager=True, max_num_seqs=8, kv_cache_tokens=8192,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    gpu.engine.proposer = Replay({tuple(p): w for p, w in zip(prompts, want)}, wrong)
    assert _greedy(gpu, prompts) == want
    stats = gpu.engine.stats
    assert stats.spec_drafts > 0
    assert (stats.spec_accepted_tokens == stats.spec_draft_tokens) == (wrong == 0)


def test_eagle3_drafting_on_the_gpu(tiny_dir, tmp_path):
    """EAGLE-3 on the GPU: in fp32 through the torch kernels, the CPU reference's tokens and the
    reference draft's proposals, exactly; in bf16 under CUDA graphs (FlashInfer prefill, the
    decode kernel's verify rows and `decode_rows`), drafts that mostly agree with the reference
    draft in bf16 (near-ties part: the target's states differ in rounding), self-consistent
    greedy output, and every block back."""
    from tests.test_eagle3_engine import (amplify_attention, eagle3_llm, record_drafts,
                                          reference_drafts)
    from tinyoss import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 150000) for _ in range(n)] for n in (3, 140, 300)]
    want = _greedy(LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=8192),
                   prompts)
    fp32 = eagle3_llm(tmp_path, "specforge", device="cuda", dtype="float32",
                      attention_backend="torch", mxfp4_backend="torch", enforce_eager=True,
                      max_num_seqs=8, kv_cache_tokens=8192)
    amplify_attention(fp32.engine)
    records = record_drafts(fp32.engine)
    assert _greedy(fp32, prompts) == want
    assert len(records) > 20
    assert all(d == reference_drafts(fp32.engine, t) for t, d in records[::3])
    del fp32

    llm = eagle3_llm(tmp_path, "nvidia", device="cuda", max_num_seqs=8, kv_cache_tokens=8192)
    core = llm.engine
    assert core.executor.verify is not None and core.executor.graphs is not None
    amplify_attention(core)
    records = record_drafts(core)
    computed = _greedy(llm, prompts)
    agree = [d == reference_drafts(core, t) for t, d in records[::2]]
    assert sum(agree) >= 0.5 * len(agree), f"{sum(agree)} of {len(agree)}"  # 31 of 47 seen
    assert core.scheduler.kv.usage() == 0
    assert _greedy(llm, prompts) == computed


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def test_speculative_verify_steps_replay_graphs(tiny_dir):
    """With CUDA graphs, verify steps replay the verify graphs (every query token a decode-kernel
    row). Their rows do not depend on which row a token is: the continuation they compute with
    every draft wrong, replayed as drafts, is accepted whole and comes out again. (Against plain
    decode steps bf16 may flip an argmax: one row runs the Triton GEMV, several cuBLAS.)"""
    from tests.test_speculative import Replay
    from tinyoss import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 150000) for _ in range(n)] for n in (3, 140, 300)]
    llm = LLM(str(tiny_dir), device="cuda", max_num_seqs=8, kv_cache_tokens=8192,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    verify, core = llm.engine.executor.verify, llm.engine
    assert verify is not None and 4 in verify.sizes
    replays = []
    run = verify.run
    verify.run = lambda *a: replays.append(1) or run(*a)
    core.proposer = Replay({tuple(p): [0] * 64 for p in prompts}, wrong=1)  # always wrong
    computed = _greedy(llm, prompts)
    assert replays and core.stats.spec_accepted_tokens <= core.stats.spec_draft_tokens // 10
    core.stats = type(core.stats)()
    core.proposer = Replay({tuple(p): c for p, c in zip(prompts, computed)})
    again = _greedy(llm, prompts)
    s = core.stats
    assert s.spec_drafts > 0 and s.spec_accepted_tokens >= 0.9 * s.spec_draft_tokens, s
    assert [a[:24] for a in again] == [c[:24] for c in computed]


@two_gpus
@pytest.mark.parametrize("experts", [False, True], ids=["tensor", "expert"])
def test_tensor_parallel_on_two_gpus_equals_the_cpu_reference(tiny_dir, experts):
    """tiny over two GPUs (NCCL), fp32 through the torch kernels, the experts split by their
    intermediate dimension or dealt out whole (`enable_expert_parallel`): the CPU reference's
    tokens (or part at a near tie: the all-reduce sums in another order), for prompts on both
    sides of the 128-token window in one batch."""
    from tinyoss import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 150000) for _ in range(n)] for n in (3, 70, 140, 300)]
    cpu = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=8192)
    gpu = LLM(str(tiny_dir), device="cuda", dtype="float32", attention_backend="torch",
              mxfp4_backend="torch", enforce_eager=True, max_num_seqs=8, kv_cache_tokens=8192,
              tensor_parallel_size=2, enable_expert_parallel=experts)
    try:
        _same_or_near_tie(cpu, tiny_dir, prompts, _greedy(cpu, prompts), _greedy(gpu, prompts),
                          bf16=False)
    finally:
        gpu.engine.close()


_TP_CHILD = """
import json, sys
from tinyoss import LLM, SamplingParams
folder, eager, prompts = json.loads(sys.argv[1])
llm = LLM(folder, device="cuda", max_num_seqs=8, kv_cache_tokens=8192, enforce_eager=eager,
          tensor_parallel_size=2)
try:
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    fast = llm.engine.executor.peers.group._fast
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                      "graphs": llm.engine.executor.graphs is not None,
                      "fast": None if fast is None else fast.name}))
finally:
    llm.engine.close()
"""


def _tensor_parallel_tokens(tiny_dir, all_reduce: str, eager: bool, prompts) -> dict:
    """Greedy tokens of a two-GPU engine in a process of its own: a fast all-reduce serves one
    engine a process (`engine/comm.py`), and each case here must get the one it names."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TINYOSS_ALL_REDUCE": all_reduce}
    run = subprocess.run([sys.executable, "-c", _TP_CHILD,
                          json.dumps([str(tiny_dir), eager, prompts])],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@two_gpus
@pytest.mark.parametrize("all_reduce", ["auto", "nccl", "custom", "flashinfer", "symm_mem"])
def test_tensor_parallel_graphs_equal_eager_on_two_gpus(tiny_dir, all_reduce):
    """The fast kernels over two GPUs: decode and piecewise CUDA graphs, with the all-reduces
    and logit gathers captured in them, give the tokens of the same engine run eagerly; with
    each all-reduce (NCCL, symmetric memory, tinyoss's and FlashInfer's one-shot fused with the
    residual add and RMSNorm after the experts, and whichever `auto` takes); and the fp32 CPU
    reference's tokens, or part at a near tie."""
    from tinyoss import LLM

    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 150000) for _ in range(n)] for n in (5, 90, 200)]
    got = {}
    for eager in (True, False):
        run = _tensor_parallel_tokens(tiny_dir, all_reduce, eager, prompts)
        assert run["graphs"] != eager
        if all_reduce != "auto":
            assert run["fast"] == {"nccl": None, "flashinfer": "flashinfer one-shot",
                                   "custom": "custom one-shot",
                                   "symm_mem": "symm_mem one-shot"}[all_reduce]
        got[eager] = run["tokens"]
    assert got[True] == got[False]
    cpu = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=8192)
    # right, not just alike
    _same_or_near_tie(cpu, tiny_dir, prompts, _greedy(cpu, prompts), got[False])


@two_gpus
def test_a_second_tensor_parallel_engine_in_one_process_takes_nccl(tiny_dir):
    """PyTorch counts symmetric-memory rendezvous per process: a second engine in rank 0's
    process hung on the GPUs in its own. It now takes NCCL (under `auto`) and runs. In fp32,
    so that both engines' tokens must be the reference's (in bf16 one of them parted from it
    once at a 0.21 margin: a TP rank rounds its partial sums to bf16 before the all-reduce)."""
    from tinyoss import LLM

    rng = random.Random(2)
    prompts = [[rng.randrange(1000, 150000) for _ in range(n)] for n in (7, 150)]
    runs = []
    for _ in range(2):
        llm = LLM(str(tiny_dir), device="cuda", dtype="float32", max_num_seqs=4,
                  kv_cache_tokens=8192, tensor_parallel_size=2)
        try:
            runs.append((llm.engine.executor.peers.group._fast, _greedy(llm, prompts)))
        finally:
            llm.engine.close()
    assert runs[1][0] is None  # NCCL
    cpu = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=8192)
    want = _greedy(cpu, prompts)
    for _, tokens in runs:
        _same_or_near_tie(cpu, tiny_dir, prompts, want, tokens, bf16=False)
