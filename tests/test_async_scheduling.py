"""Async scheduling (decode steps launched before the previous step's tokens reach the host)
gives exactly what running one step at a time gives, on the tiny model on CPU: stops inside a
chain, seeded sampling, logprobs, n > 1, aborts and newcomers while a step is in flight, and
the cases that must not chain."""

from __future__ import annotations

import random

import pytest

from tinyoss import LLM, SamplingParams
from tinyoss.engine.core import CoreRequest


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(199998) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def sync_llm(tiny_dir):
    return LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=16384,
               max_num_batched_tokens=2048, async_scheduling=False)


@pytest.fixture
def chains(tiny_llm, monkeypatch) -> list[int]:
    """Counts the steps `tiny_llm` launches ahead (one entry each, its batch size)."""
    scheduler = tiny_llm.engine.scheduler
    seen: list[int] = []
    chain = scheduler.chain

    def spy(plan):
        step = chain(plan)
        if step is not None:
            seen.append(len(step.seqs))
        return step

    monkeypatch.setattr(scheduler, "chain", spy)
    return seen


def summary(outs) -> list:
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
          None if c.logprobs is None else [(lp.token_id, round(lp.logprob, 4),
                                            [t for t, _ in lp.top]) for lp in c.logprobs])
         for c in o.outputs]
        for o in outs
    ]


def run_both(tiny_llm, sync_llm, batch, params):
    return (summary(tiny_llm.generate(batch, params, use_tqdm=False)),
            summary(sync_llm.generate(batch, params, use_tqdm=False)))


def test_same_outputs_as_one_step_at_a_time(tiny_llm, sync_llm, chains):
    batch = prompts(4, seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = sync_llm.generate(batch, greedy, use_tqdm=False)
    stop_id = ref[0].outputs[0].token_ids[4]  # prompt 0 stops on its 5th token, mid-chain
    stop_text = ref[1].outputs[0].text[3:6]
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop_text]),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=9, logprobs=2, n=2),
        SamplingParams(temperature=0, max_tokens=7, min_tokens=3, ignore_eos=True),
    ]
    got, want = run_both(tiny_llm, sync_llm, batch, params)
    assert got == want
    assert got[0][0][2] == "stop" and got[1][0][2] == "stop" and len(got[0][0][0]) == 5
    assert chains and max(chains) == 5  # four requests, one with n=2: five sequences chained
    assert tiny_llm.engine.scheduler.kv.num_free == tiny_llm.engine.scheduler.kv.num_blocks


def test_penalties_do_not_chain(tiny_llm, sync_llm, chains):
    params = SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3)
    got, want = run_both(tiny_llm, sync_llm, prompts(2, seed=2), params)
    assert got == want and chains == []


def test_abort_and_newcomer_while_a_step_is_in_flight(tiny_llm, sync_llm, chains):
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a, b, c = prompts(3, seed=3)
    engine.add(CoreRequest("a", a, params))
    engine.add(CoreRequest("b", b, params))
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    done = {}
    while engine._in_flight is None:
        for d in engine.step():
            got[d.request_id] += d.token_ids
    # in flight: a step computing every sequence's pending token, not yet known on the host
    assert all(s.num_pending == 1 for s in engine.scheduler.running)
    assert engine.abort("a")
    engine.add(CoreRequest("c", c, params))  # admitted once the chain stops for it
    while engine.has_work():
        for d in engine.step():
            got[d.request_id] += d.token_ids
            if d.finish_reason:
                done[d.request_id] = got[d.request_id]
    want = [o.outputs[0].token_ids for o in sync_llm.generate([b, c], params, use_tqdm=False)]
    assert [done["b"], done["c"]] == want and "a" not in done
    assert chains and engine.scheduler.kv.num_free == engine.scheduler.kv.num_blocks


def test_a_full_cache_stops_the_chain_instead_of_preempting(tiny_dir, sync_llm):
    """Three sequences in a pool that cannot hold all their next blocks: outputs as if run
    one step at a time, nothing lost."""
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=16 * 14,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    batch = prompts(3, seed=4)
    got = summary(llm.generate(batch, params, use_tqdm=False))
    assert got == summary(sync_llm.generate(batch, params, use_tqdm=False))
    assert all(len(o[0][0]) == 40 for o in got)
    assert llm.engine.scheduler.kv.num_free == llm.engine.scheduler.kv.num_blocks
