"""The engine on the tiny model (fp32, CPU): batching, chunking, preemption, prefix caching,
sliding-window memory, sampling, stops and bad input."""

import random

import pytest
import torch

from tinyoss import LLM, SamplingParams
from tinyoss.engine.core import CoreRequest
from tinyoss.engine.scheduler import PrefillCost
from tinyoss.engine.sequence import Status

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(199998) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def solo(tiny_llm):
    """Each prompt of `prompts(6)` generated alone: the reference for batched runs."""
    return [tokens(tiny_llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts(6)]


def test_batched_greedy_equals_each_prompt_alone(tiny_llm, solo):
    outs = tiny_llm.generate(prompts(6), GREEDY, use_tqdm=False)
    assert tokens(outs) == solo
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_chunked_prefill_equals_one_shot(tiny_dir, solo):
    llm = LLM(
        str(tiny_dir),
        device="cpu",
        dtype="float32",
        kv_cache_tokens=16384,
        max_num_batched_tokens=37,
        enable_prefix_caching=False,
    )
    assert tokens(llm.generate(prompts(6), GREEDY, use_tqdm=False)) == solo


def test_tiny_pool_preempts_and_loses_nothing(tiny_dir, tiny_llm):
    """Four sequences that each end up needing ~16 blocks share a pool of 24."""
    batch = prompts(4, seed=2, lo=10, hi=40)
    sp = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
    expected = [tokens(tiny_llm.generate([p], sp, use_tqdm=False))[0] for p in batch]
    llm = LLM(
        str(tiny_dir),
        device="cpu",
        dtype="float32",
        kv_cache_tokens=16 * 24,
        enable_prefix_caching=False,
    )
    outs = llm.generate(batch, sp, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens(outs) == expected
    assert [len(t) for t in tokens(outs)] == [90] * 4  # nothing lost or duplicated
    assert llm.engine.scheduler.kv.num_free == llm.engine.scheduler.kv.num_blocks


def test_a_decode_preempted_for_an_older_prefill_chunk_leaves_the_step(tiny_dir, tiny_llm):
    """Decodes are picked before prefill chunks, so the newest sequence, preempted to make room
    for an older prompt's chunk, may already be in the step: it must leave it (its blocks are
    gone; the step's plan had failed with an IndexError)."""
    batch = [prompts(1, seed=13, lo=160, hi=161)[0], [1, 2, 3]]
    sp = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 30)]
    expected = [tokens(tiny_llm.generate([p], s, use_tqdm=False))[0] for p, s in zip(batch, sp)]
    llm = LLM(
        str(tiny_dir),
        device="cpu",
        dtype="float32",
        kv_cache_tokens=16 * 20,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    assert tokens(llm.generate(batch, sp, use_tqdm=False)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.kv.num_free == llm.engine.scheduler.kv.num_blocks


def test_prefix_cache_hits_and_gives_the_same_tokens(tiny_llm, tiny_dir):
    rng = random.Random(7)
    system = [rng.randrange(199998) for _ in range(200)]
    first = system + [rng.randrange(199998) for _ in range(30)]
    second = system + [rng.randrange(199998) for _ in range(25)]
    kv = tiny_llm.engine.scheduler.kv
    tiny_llm.generate([first], GREEDY, use_tqdm=False)
    hits = kv.hit_blocks
    out = tiny_llm.generate([second], GREEDY, use_tqdm=False)[0]
    full_blocks = 200 // 16
    window_blocks = -(-(128 + 16) // 16)
    assert kv.hit_blocks - hits >= full_blocks  # full-attention group: the whole shared prefix
    assert out.num_cached_tokens == full_blocks * 16
    uncached = LLM(
        str(tiny_dir),
        device="cpu",
        dtype="float32",
        kv_cache_tokens=16384,
        enable_prefix_caching=False,
    )
    assert (
        out.outputs[0].token_ids == tokens(uncached.generate([second], GREEDY, use_tqdm=False))[0]
    )
    assert kv.hit_blocks - hits <= full_blocks + window_blocks


def test_a_preempted_request_does_not_count_its_own_blocks_as_cached(tiny_dir):
    """num_cached_tokens (and vllm:prefix_cache_hits) are what the prefix cache gave a request
    when first scheduled, as in vLLM: recomputing after a preemption finds the request's own
    blocks, which are no hit (two unrelated prompts had reported 16 cached tokens)."""
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=16 * 12)
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    outs = llm.generate(prompts(2, seed=14, lo=40, hi=41), sp, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert llm.engine.stats.cached_prompt_tokens == 0


def test_cache_salt_keeps_prefixes_apart(tiny_llm):
    """vLLM's cache_salt: prompts of different salts share no cached block, of equal salts do
    (the salt seeds the first block's hash, so every later block differs too)."""
    prompt = prompts(1, seed=12, lo=100, hi=101)[0]
    kv = tiny_llm.engine.scheduler.kv

    def cached(salt: str | None) -> int:
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, cache_salt=salt)
        return tiny_llm.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens

    assert cached("alice") == 0
    hits = kv.hit_blocks
    assert cached("bob") == 0 and cached(None) == 0 and kv.hit_blocks == hits
    assert cached("alice") == cached("bob") == cached(None) == 96
    with pytest.raises(ValueError, match="cache_salt='' is invalid: must be None or a non-empty"):
        SamplingParams(cache_salt="")


def test_sliding_layers_keep_only_the_window(tiny_llm):
    """Between steps a sliding group holds the window's blocks plus one; a full group holds all.
    (While a prefill chunk runs, its own tokens' blocks are held too.)"""
    engine = tiny_llm.engine
    windows = engine.scheduler.kv.windows
    engine.add(
        CoreRequest(
            "long",
            prompts(1, seed=3, lo=400, hi=401)[0],
            SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
        )
    )
    seq = engine.requests["long"][0]
    peak = {g: 0 for g in range(len(windows))}
    while not seq.finished:
        engine.step()
        if seq.status is Status.RUNNING:
            for g, table in enumerate(seq.blocks.tables):
                peak[g] = max(peak[g], len(table))
                if windows[g] == 0:
                    assert len(table) == -(-seq.num_computed // 16)
    sliding = windows.index(128)
    assert peak[sliding] <= 128 // 16 + 1
    assert peak[windows.index(0)] >= 600 // 16


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_llm):
    p = prompts(3, seed=11)
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    alone = tokens(tiny_llm.generate([p[0]], sp, use_tqdm=False))[0]
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batch = tiny_llm.generate([p[1], p[0], p[2]], [other, sp, other], use_tqdm=False)
    assert tokens(batch)[1] == alone
    different = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=10, ignore_eos=True)
    assert tokens(tiny_llm.generate([p[0]], different, use_tqdm=False))[0] != alone


def test_n_samples_share_the_prompt(tiny_llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    out = tiny_llm.generate([prompts(1, seed=4)[0]], sp, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_n_samples_hold_the_prompts_blocks_once(tiny_dir, tiny_llm):
    """The n sequences of a request compute the prompt once, here in two chunks: the others
    wait, then take its blocks from the prefix cache (admitted beside it, each had computed and
    held the prompt's blocks again)."""
    prompt = prompts(1, seed=15, lo=321, hi=322)[0]
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True)
    expected = [o.token_ids for o in tiny_llm.generate([prompt], sp, use_tqdm=False)[0].outputs]
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", max_num_batched_tokens=200)
    engine, kv = llm.engine, llm.engine.scheduler.kv
    engine.add(CoreRequest("n3", prompt, sp))
    engine.step()
    assert engine.prompt_progress("n3") == (200, len(prompt))  # the first chunk, shared
    got, held = [[], [], []], 0
    while engine.has_work():
        for delta in engine.step():
            got[delta.index] += delta.token_ids
        held = max(held, kv.num_blocks - kv.num_free)
    assert got == expected
    # one sequence's blocks, and the others' own last blocks (a chunk apart, they held 50)
    assert held <= kv.blocks_needed(len(prompt) + 4) + 3 * 2


def test_requests_behind_n_samples_are_admitted_while_their_prompt_is_computed(tiny_dir):
    """The waiting siblings of an n > 1 request do not hold up the requests queued after them:
    a short request is admitted beside the first sequence's prompt chunks."""
    long, short = prompts(2, seed=16, lo=330, hi=331)[0], prompts(1, seed=17, lo=5, hi=6)[0]
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", max_num_batched_tokens=200)
    engine = llm.engine
    engine.add(CoreRequest("n2", long, SamplingParams(n=2, max_tokens=2, ignore_eos=True)))
    engine.add(CoreRequest("next", short, SamplingParams(max_tokens=2, ignore_eos=True)))
    def waiting() -> list[tuple[str, int]]:
        return [(s.request_id, s.index) for s in engine.scheduler.waiting]

    engine.step()  # the budget's 200 tokens: the first chunk of n2's prompt
    assert waiting() == [("n2", 1), ("next", 0)]
    engine.step()  # the prompt's last 130 tokens, and "next" beside them (it had waited)
    assert waiting() == [("n2", 1)] and engine.prompt_progress("next") == (5, 5)
    while engine.has_work():
        engine.step()


def test_stop_ids_stop_strings_and_length(tiny_llm):
    p = prompts(1, seed=5)[0]
    free = tiny_llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0]
    third = free.token_ids[2]
    out = tiny_llm.generate(
        [p], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[third]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == third
    assert out.token_ids == free.token_ids[:3]
    tok = tiny_llm.get_tokenizer()
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3 and stop in text
    out = tiny_llm.generate(
        [p],
        SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    out = tiny_llm.generate(
        [p],
        SamplingParams(
            temperature=0,
            max_tokens=12,
            stop=[stop],
            include_stop_str_in_output=True,
            ignore_eos=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == text[: text.index(stop) + len(stop)]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    assert tok.decode(free.token_ids) == free.text


def test_the_eos_has_no_stop_reason_even_among_stop_token_ids(tiny_llm):
    """As vLLM's check_stop, which tests the EOS (the tokenizer's, <|return|>) before
    stop_token_ids: an output that ends on it has stop_reason None even where the request's
    stop_token_ids list it too (it had been 200002, in generate and chat alike); with
    ignore_eos it is no EOS, only a stop token id, which names itself."""
    p = prompts(1, seed=5)[0]
    eos = tiny_llm.get_tokenizer().eos_token_id
    assert eos == 200002

    def end(**kw) -> tuple:
        params = SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[eos], **kw)
        out = tiny_llm.generate([p], params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, out.finish_reason, out.stop_reason

    assert end() == ([eos], "stop", None)
    assert end(stop_token_ids=[eos]) == ([eos], "stop", None)
    assert end(stop_token_ids=[5, eos]) == ([eos], "stop", None)
    assert end(stop_token_ids=[eos], ignore_eos=True) == ([eos], "stop", eos)
    assert end(ignore_eos=True) == ([eos] * 3, "length", None)
    streamed = list(tiny_llm.stream(p, SamplingParams(temperature=0, max_tokens=3,
                                                      allowed_token_ids=[eos],
                                                      stop_token_ids=[eos])))
    last = streamed[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", None)
    # LLM.chat stops on harmony's end tokens through stop_token_ids: <|return|> is the EOS
    reply = tiny_llm.chat([{"role": "user", "content": "hi"}],
                          SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[eos]),
                          use_tqdm=False)[0]
    assert reply.outputs[0].token_ids == [eos]
    assert (reply.finish_reason, reply.outputs[0].stop_reason) == ("stop", None)


def test_the_checkpoints_other_end_ids_name_themselves(tiny_llm):
    """vLLM adds generation_config.json's eos_token_id list but the EOS (<|endoftext|>,
    <|call|>) to a request's stop_token_ids unless ignore_eos, and check_stop names a stop
    token id: an output that ends on one has it as stop_reason, asked for or not (it had been
    None unless asked for); with ignore_eos they do not end it."""
    p = prompts(1, seed=5)[0]
    assert tiny_llm.engine.info.eos_token_ids == (200002, 199999, 200012)
    for end_id in (199999, 200012):
        params = SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[end_id])
        out = tiny_llm.generate([p], params, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([end_id], "stop", end_id)
        params = SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[end_id],
                                ignore_eos=True)
        out = tiny_llm.generate([p], params, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([end_id] * 3, "length",
                                                                       None)


def test_a_stop_string_begun_within_min_tokens_still_stops(tiny_llm):
    """A stop string that begins in the text of the first min_tokens tokens (shown unwatched)
    and ends after them stops the output, as vLLM looks back for it (it had been missed, and the
    output ran to max_tokens); its head, shown already, stays, and the deltas still add up."""
    p = prompts(1, seed=5)[0]
    free = tiny_llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0]
    tok = tiny_llm.get_tokenizer()
    text, b = free.text, len(tok.decode(free.token_ids[:4]))
    stop = text[b - 2 : b + 2]
    assert text.index(stop) == b - 2
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=4,
                            stop=[stop])
    out = tiny_llm.generate([p], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == text[:b]
    ends = [k for k in range(5, 13) if len(tok.decode(free.token_ids[:k])) >= b + 2]
    assert out.token_ids == free.token_ids[: ends[0]]
    streamed = "".join(o.outputs[0].delta_text for o in tiny_llm.stream(p, params))
    assert streamed == out.text


def test_streaming_deltas_add_up(tiny_llm):
    p = prompts(1, seed=6)[0]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    text, ids, lps = "", [], []
    for out in tiny_llm.stream(p, sp):
        c = out.outputs[0]
        text += c.delta_text
        ids += c.delta_token_ids
        lps += c.delta_logprobs
    assert c.finished() and text == c.text and ids == c.token_ids and len(lps) == 12
    assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1] for lp in lps)
    assert all(lp.token_id == lp.top[0][0] for lp in lps)  # greedy picks the most likely token


def test_logprobs_match_a_direct_forward(tiny_llm):
    engine = tiny_llm.engine
    p = prompts(1, seed=8, lo=20, hi=21)[0]
    out = tiny_llm.generate(
        [p],
        SamplingParams(temperature=0, max_tokens=1, logprobs=0, prompt_logprobs=1),
        use_tqdm=False,
    )[0]
    from tests.test_model_reference import run_paged

    model = engine.executor.model
    logits = run_paged(model, model.config, torch.tensor(p))
    lsm = torch.log_softmax(logits, -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    for i in range(1, len(p)):
        entry = out.prompt_logprobs[i]
        assert entry.token_id == p[i]
        assert entry.logprob == pytest.approx(lsm[i - 1, p[i]].item(), abs=1e-4)
        assert entry.top[0][0] == lsm[i - 1].argmax().item()
    first = out.outputs[0].logprobs[0]
    assert first.token_id == lsm[-1].argmax().item()
    assert first.logprob == pytest.approx(lsm[-1].max().item(), abs=1e-4)


def test_prompt_logprobs_over_chunks_miss_no_position(tiny_llm, monkeypatch):
    """A prompt prefilled in chunks gets every position's logprob, as in one pass: the position
    right after a chunk is predicted by that chunk's last row (it was dropped, and every later
    entry shifted by one). The logits are made a few rows at a time (PROMPT_LOGPROB_ROWS, so a
    long chunk's never exist whole): the same entries."""
    from tinyoss.engine import executor

    p = prompts(1, seed=9, lo=60, hi=61)[0]
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    whole = tiny_llm.generate([p], sp, use_tqdm=False)[0].prompt_logprobs
    monkeypatch.setattr(tiny_llm.engine.scheduler, "max_num_batched_tokens", 16)
    chunked = tiny_llm.generate([p], sp, use_tqdm=False)[0].prompt_logprobs
    monkeypatch.setattr(executor, "PROMPT_LOGPROB_ROWS", 5)
    sliced = tiny_llm.generate([p], sp, use_tqdm=False)[0].prompt_logprobs
    assert len(whole) == len(chunked) == len(sliced) == len(p)
    assert whole[0] is None is chunked[0] is sliced[0]
    for i in range(1, len(p)):
        assert chunked[i].token_id == whole[i].token_id == sliced[i].token_id == p[i]
        assert chunked[i].logprob == pytest.approx(whole[i].logprob, abs=1e-4)
        assert sliced[i].logprob == pytest.approx(whole[i].logprob, abs=1e-4)
        assert [t for t, _ in sliced[i].top] == [t for t, _ in whole[i].top] and len(
            whole[i].top) == 3


def test_bad_requests_fail_clearly_and_the_engine_keeps_serving(tiny_llm):
    engine = tiny_llm.engine
    long = [1] * engine.info.max_model_len
    with pytest.raises(
        ValueError,
        match=f"prompt is {len(long)} tokens long, but max_model_len is {engine.info.max_model_len}",
    ):
        tiny_llm.generate([long], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny_llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.generate([[5, 201088]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p=1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(TypeError, match="unknown LLM argument\\(s\\) max_len"):
        LLM("tiny", max_len=5)
    kv = engine.scheduler.kv
    assert (
        not engine.requests
        and kv.num_free + sum(1 for r in kv.ref_count if r) == kv.num_blocks
    )
    out = tiny_llm.generate([prompts(1)[0]], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12


def test_abort_frees_blocks(tiny_llm):
    engine = tiny_llm.engine
    kv = engine.scheduler.kv
    engine.add(CoreRequest("to-abort", prompts(1, seed=9)[0], SamplingParams(max_tokens=50)))
    engine.step()
    engine.step()
    assert any(kv.ref_count)
    assert engine.abort("to-abort") and not engine.abort("to-abort")
    while engine.has_work():  # the step launched ahead finishes; its token is dropped
        assert engine.step() == []
    assert not any(kv.ref_count) and not engine.requests


def test_steps_run_in_inference_mode_and_hold_no_memory(tiny_llm, monkeypatch):
    """The forward pass runs under torch.inference_mode (outside it, every step's tensors were
    kept alive: ~6 MB a step of tiny on the CPU), and a request leaves no tensors behind."""
    import gc
    import warnings

    executor, modes = tiny_llm.engine.executor, []
    forward = executor.forward

    def spy(*args):
        modes.append(torch.is_inference_mode_enabled())
        return forward(*args)

    monkeypatch.setattr(executor, "forward", spy)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def live_tensors() -> int:
        gc.collect()
        with warnings.catch_warnings():  # (isinstance on torch.distributed's deprecated names)
            warnings.simplefilter("ignore", FutureWarning)
            return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    # seeds no other test uses: a prompt prefix in the shared engine's cache would change the
    # prefill plans of tests that count them
    tiny_llm.generate(prompts(2, seed=71), sp, use_tqdm=False)  # warm: lazily built state
    before = live_tensors()
    tiny_llm.generate(prompts(2, seed=72), sp, use_tqdm=False)
    assert modes and all(modes)
    assert live_tensors() - before < 50  # 26,910 for a 90-token request when it leaked


def test_step_plans_and_results_are_plain_data(tiny_llm, monkeypatch):
    """What crosses from scheduler to executor (and back) survives pickling unchanged: an
    executor could live in another process."""
    import pickle

    executor, seen = tiny_llm.engine.executor, []
    launch, result = executor.launch, executor.result

    def spy_launch(plan):
        seen.append(plan)
        return launch(plan)

    def spy_result(launched):
        out = result(launched)
        seen.append(out)
        return out

    monkeypatch.setattr(executor, "launch", spy_launch)
    monkeypatch.setattr(executor, "result", spy_result)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=5, logprobs=2, prompt_logprobs=1)
    tiny_llm.generate(prompts(3, seed=13), params, use_tqdm=False)
    assert len(seen) > 6 and any(getattr(p, "new", None) for p in seen)
    for item in seen:
        assert pickle.loads(pickle.dumps(item)) == item


def _drain(llm, ids: list[str]) -> dict[str, list[int]]:
    """Steps the engine until it is idle: each finished request's tokens by id."""
    done: dict[str, list[int]] = {}
    while llm.engine.has_work():
        for out in llm._outputs(ids):
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    for request_id in ids:
        llm._abort(request_id)  # (done: only forgotten)
    return done


def test_prefill_chunks_shrink_while_sequences_decode(tiny_llm, monkeypatch):
    """With a cap, a step that decodes carries at most that many prefill tokens (a long prompt
    is spread over more steps), and every output is what it is without the cap."""
    engine, plans = tiny_llm.engine, []
    launch = engine.executor.launch

    def spy(plan):
        plans.append(plan)
        return launch(plan)

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batch = prompts(2, seed=21, lo=5, hi=10) + prompts(1, seed=22, lo=300, hi=301)
    cost = PrefillCost(per_token=1.0, per_key=0.0)  # a chunk of n tokens "takes" n seconds
    monkeypatch.setattr(engine.scheduler, "prefill_budget", (cost, 32.0))
    monkeypatch.setattr(engine.executor, "launch", spy)
    ids = [tiny_llm._submit(p, greedy) for p in batch[:2]]
    tiny_llm._outputs(ids)  # one step, the short prompts' prefill: both decode from here on
    ids.append(tiny_llm._submit(batch[2], greedy))
    done = _drain(tiny_llm, ids)
    mixed = [p for p in plans if any(s.num_tokens == 1 for s in p.seqs)]
    chunks = [sum(s.num_tokens for s in p.seqs if s.num_tokens > 1) for p in mixed]
    assert max(chunks) == 32 and sum(chunks) >= 300 - 32  # the long prompt, 32 at a time
    got = [done[k] for k in sorted(done, key=lambda k: int(k.split("-")[1]))]
    monkeypatch.undo()
    assert got == tokens(tiny_llm.generate(batch, greedy, use_tqdm=False))


def test_a_short_newcomer_is_admitted_beside_a_long_prefill(tiny_llm, monkeypatch):
    """A short request that arrives while a long prompt is prefilled in chunks starts in the
    next step (its whole prompt beside a shorter chunk of the long one), not after the long
    prompt's last chunk; a long one waits its turn; every output is what it is alone."""
    engine, plans = tiny_llm.engine, []
    launch = engine.executor.launch

    def spy(plan):
        plans.append(plan)
        return launch(plan)

    budget = 64
    monkeypatch.setattr(engine.scheduler, "max_num_batched_tokens", budget)
    monkeypatch.setattr(engine.executor, "launch", spy)
    long, short = prompts(1, seed=31, lo=400, hi=401)[0], prompts(1, seed=32, lo=9, hi=10)[0]
    other = prompts(1, seed=33, lo=100, hi=101)[0]  # more than a quarter of the budget
    ids = [tiny_llm._submit(long, GREEDY)]
    tiny_llm._outputs(ids)  # the long prompt's first chunk
    ids += [tiny_llm._submit(short, GREEDY), tiny_llm._submit(other, GREEDY)]
    done = _drain(tiny_llm, ids)
    monkeypatch.undo()
    assert [[s.num_tokens for s in p.seqs] for p in plans[:3]] == [
        [budget], [budget - len(short), len(short)], [1, budget - 1]]  # 3: the short decodes first
    assert [done[i] for i in ids] == tokens(tiny_llm.generate([long, short, other], GREEDY,
                                                              use_tqdm=False))


def test_prefill_cost_gives_the_longest_chunk_within_a_budget():
    cost = PrefillCost(per_token=20e-6, per_key=2e-9)
    for context in (0, 1000, 30000):
        n = cost.tokens_within(0.05, context)
        assert cost.seconds(n, context) <= 0.05 < cost.seconds(n + 1, context)
    assert cost.tokens_within(0.05, 30000) < cost.tokens_within(0.05, 0)  # longer context
    assert PrefillCost(1.0, 0.0).tokens_within(32.0, 500) == 32 and cost.tokens_within(0, 0) == 0
