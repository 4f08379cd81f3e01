"""Faults of one request stay with it: out of memory on its prefill, NaN logits. The engine
fails that request with an error delta, frees its blocks and serves the rest as if it had never
come; a fault that is not one request's (a decode step out of memory) propagates."""

from __future__ import annotations

import pytest
import torch

from tests.core_hooks import NAN, inject_faults
from tinyoss.config import EngineConfig
from tinyoss.engine.builder import build_engine, checkpoint_folder
from tinyoss.engine.core import CoreRequest, EngineCore, SeqDelta
from tinyoss.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)


def _engine() -> EngineCore:
    config = EngineConfig(
        model="tiny", device="cpu", dtype="float32", kv_cache_tokens=4096,
        max_num_batched_tokens=64, max_model_len=1024,
    )  # fmt: skip
    return build_engine(config, checkpoint_folder(config))


def _run(core: EngineCore, requests: dict[str, list[int]]) -> dict[str, list[SeqDelta]]:
    for rid, ids in requests.items():
        core.add(CoreRequest(rid, ids, GREEDY))
    deltas: dict[str, list[SeqDelta]] = {rid: [] for rid in requests}
    for _ in range(500):
        if not core.has_work():
            return deltas
        for d in core.step():
            deltas[d.request_id].append(d)
    raise AssertionError("the engine did not finish")


def _tokens(deltas: list[SeqDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def _logprobs(deltas: list[SeqDelta]) -> list[float]:
    return [e.logprob for d in deltas for e in d.logprobs or ()]


SHORT = [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26]]
LONG = list(range(1000, 1300))  # five chunks of 64


@pytest.fixture(scope="module")
def reference() -> dict[str, list[SeqDelta]]:
    return _run(_engine(), {"a": SHORT[0], "b": SHORT[1], "long": LONG})


def test_out_of_memory_on_a_prefill_fails_that_request_alone(reference):
    core = _engine()
    launch, failed = core.executor.launch, []

    def launch_once_out_of_memory(plan):  # a chunk of the long prompt after some were named
        if not failed and any(s.start >= 100 and s.num_tokens > 1 for s in plan.seqs):
            failed.append(plan)
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return launch(plan)

    core.executor.launch = launch_once_out_of_memory
    got = _run(core, {"a": SHORT[0], "long": LONG, "b": SHORT[1]})
    assert failed, "the fault was never injected"
    (last,) = got["long"]
    assert last.finish_reason == "error" and last.error.code == "out_of_memory"
    assert "300 tokens" not in last.error.message and "prompt" in last.error.message
    for rid in "ab":  # the others: exactly the tokens they get without the fault
        assert _tokens(got[rid]) == _tokens(reference[rid])
        assert got[rid][-1].finish_reason == "length"
    assert core.scheduler.kv.usage() == 0 and not core.has_work()
    # the failed step's blocks were never written: they must not be found by content again
    again = _run(core, {"long2": LONG})["long2"]
    assert _tokens(again) == _tokens(reference["long"])
    assert _logprobs(again) == pytest.approx(_logprobs(reference["long"]), abs=1e-4)


def test_non_finite_logits_fail_that_request_alone(reference):
    core = _engine()
    marker = (7, 7, 7)
    inject_faults(core, {marker: NAN})
    got = _run(core, {"a": SHORT[0], "bad": [5, *marker, 9], "b": SHORT[1]})
    (last,) = got["bad"]
    assert last.finish_reason == "error" and last.error.code == "non_finite_logits"
    assert not last.token_ids
    for rid in "ab":
        assert _tokens(got[rid]) == _tokens(reference[rid])
    assert core.scheduler.kv.usage() == 0 and not core.has_work()


def test_a_decode_step_out_of_memory_is_the_engines_fault():
    core = _engine()
    launch = core.executor.launch

    def decode_out_of_memory(plan):
        if plan.is_decode:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return launch(plan)

    core.executor.launch = decode_out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        _run(core, {"a": SHORT[0]})


def test_an_aborted_prompt_stops_before_its_next_chunk():
    core = _engine()
    core.add(CoreRequest("a", SHORT[0], GREEDY))
    core.add(CoreRequest("long", LONG, GREEDY))
    steps = []
    launch = core.executor.launch
    core.executor.launch = lambda plan: steps.append(plan) or launch(plan)
    core.step()
    assert any(s.num_tokens > 1 for s in steps[-1].seqs)  # the long prompt's first chunk ran
    long_ids = {s.seq_id for s in steps[-1].seqs if s.num_tokens > 5}
    assert core.abort("long")
    while core.has_work():
        core.step()
    assert all(s.seq_id not in long_ids for plan in steps[1:] for s in plan.seqs)
    assert core.scheduler.kv.usage() == 0
