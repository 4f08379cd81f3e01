"""Speculative decoding on the CPU: the n-gram proposer, the config, verification (greedy and
rejection sampling against the target distribution), and the engine with drafts that are all
right, partly wrong or all wrong: greedy output is token for token the output without drafts,
and the KV cache and prefix cache stay consistent."""

from __future__ import annotations

import random
import re

import pytest
import torch

from tinyoss import LLM, SamplingParams, StructuredOutputs
from tinyoss.engine.sampler import SamplingBatch, SamplingRow
from tinyoss.engine.speculative import NgramProposer, SpeculativeConfig, verify


def test_ngram_proposer_takes_the_latest_longest_match():
    ids = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    assert NgramProposer(3, 1).propose(ids, 2, 3) == [8, 1, 6]  # "5 6 7", at 0
    assert NgramProposer(2, 1).propose(ids, 2, 3) == [9, 5, 6]  # "6 7": latest at 5
    assert NgramProposer(2, 1).propose(ids, 2, 1) == [9]
    p = NgramProposer(3, 1)
    assert p.propose([1, 2, 3, 2], 1, 4) == [3, 2]  # n = 1: the token after the earlier 2
    assert p.propose([1, 2, 3, 4], 1, 4) == []  # nothing repeats
    assert p.propose([7, 7], 1, 0) == []
    # bytes that match across token boundaries are no match of tokens
    assert p.propose([0x01000000, 0x01, 0x0100], 1, 2) == []
    assert NgramProposer(4, 4).propose([1, 2, 3, 9, 1, 2, 3], 1, 5) == []  # needs 4 in a row


@pytest.mark.parametrize(
    "value, words",
    [
        ('{"method": "eagle"}', "method 'eagle'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "depth": 3}, "depth"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "max"),
        ("{nope", "JSON"),
    ],
)
def test_bad_speculative_configs_are_refused_by_name(value, words):
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig.parse(value)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.7, top_k=3), SamplingParams(top_p=0.8)],
)
def test_rejection_sampling_keeps_the_target_distribution(params):
    """The first token a step emits after one draft, over many trials, follows the target's
    own distribution (temperature, top-k, top-p applied), whatever the draft."""
    torch.manual_seed(0)
    v, trials = 6, 40_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
    batch = SamplingBatch.build([SamplingRow(params)] * 2 * trials, v, "cpu")
    x = logits / params.temperature
    order = x.argsort(descending=True)
    keep = torch.zeros(v, dtype=torch.bool)
    probs = x[order].softmax(-1)
    k = params.top_k or v
    keep[order[:k][(probs.cumsum(-1) - probs)[:k] < params.top_p]] = True
    target = torch.where(keep, x, float("-inf")).softmax(-1)
    for draft in (0, 4):  # the likeliest token, and one top-k/top-p may exclude
        drafts = torch.tensor([draft, -1] * trials)  # each trial: a draft row, then the next
        tokens, accepted = verify(logits.repeat(2 * trials, 1), batch, drafts)
        first = torch.where(accepted[0::2], drafts[0::2], tokens[0::2])
        freq = torch.bincount(first, minlength=v).float() / trials
        assert (freq - target).abs().max() < 0.01, (draft, freq, target)


def test_greedy_verification_accepts_the_argmax_run():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    batch = SamplingBatch.build([SamplingRow(SamplingParams(temperature=0))] * 3, 3, "cpu")
    tokens, accepted = verify(logits, batch, torch.tensor([1, 2, -1]))
    assert tokens.tolist() == [1, 0, 2] and accepted.tolist() == [True, False, False]


class Replay:
    """A proposer replaying known continuations: right (the target's own greedy tokens), or
    wrong every `wrong`-th draft position."""

    def __init__(self, continuations: dict[tuple, list[int]], wrong: int = 0) -> None:
        self.continuations, self.wrong = continuations, wrong

    def propose(self, token_ids: list[int], num_prompt: int, limit: int) -> list[int]:
        done = len(token_ids) - num_prompt
        draft = self.continuations[tuple(token_ids[:num_prompt])][done : done + limit]
        if self.wrong:
            draft = [t + 1 if (done + i) % self.wrong == 0 else t for i, t in enumerate(draft)]
        return draft


@pytest.fixture(scope="module")
def prompts_and_reference():
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 150000) for _ in range(n)] for n in (3, 70, 140, 300)]
    llm = LLM("tiny", max_model_len=1024, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return prompts, ref, params


@pytest.mark.parametrize("wrong, k", [(0, 3), (3, 4), (1, 2)])
def test_greedy_output_is_unchanged_by_drafts(prompts_and_reference, wrong, k):
    """All drafts right, every third wrong, all wrong: the same tokens as without drafts, for
    prompts on both sides of the 128-token window in one batch; no block leaks."""
    prompts, ref, params = prompts_and_reference
    llm = LLM("tiny", max_model_len=1024,
              speculative_config={"method": "ngram", "num_speculative_tokens": k})  # fmt: skip
    core = llm.engine
    core.proposer = Replay({tuple(p): r for p, r in zip(prompts, ref)}, wrong)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    s = core.stats
    assert s.spec_drafts > 0 and s.spec_draft_tokens >= s.spec_drafts
    if wrong == 0:
        assert s.spec_accepted_tokens == s.spec_draft_tokens  # the oracle is always right
        assert s.generation_tokens < s.spec_drafts * (k + 1) + len(prompts) * 2
    elif wrong == 1:
        assert s.spec_accepted_tokens == 0
    else:
        assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens
    kv = core.scheduler.kv
    assert kv.usage() == 0 and not core.has_work()  # every block back (prefix cache aside)
    # a later request sharing a prompt reuses its cached blocks and gets the same tokens
    core.proposer = None
    again = llm.generate([prompts[3]], params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == ref[3] and again.num_cached_tokens > 0


def test_sampled_requests_speculate_and_finish(prompts_and_reference):
    """Random sampling goes through rejection sampling; max_tokens and stop limits hold."""
    prompts, ref, _ = prompts_and_reference
    llm = LLM("tiny", max_model_len=1024,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    llm.engine.proposer = Replay({tuple(p): r for p, r in zip(prompts, ref)})
    params = SamplingParams(temperature=0.8, max_tokens=21, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 21 for o in outs)
    assert llm.engine.stats.spec_drafts > 0
    stop = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ref[1][5]])
    out = llm.generate([prompts[1]], stop, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[1][:6] and out.finish_reason == "stop"


def test_block_tables_end_at_the_step_even_with_blocks_for_rejected_drafts():
    """After a rejection a sequence may hold blocks past its last position; a step's view must
    not show them (FlashInfer derives the last page's length from the table's length)."""
    from tinyoss.engine.kv_cache import KVCacheManager, SeqBlocks

    kv = KVCacheManager(64, 16, [0, 128], enable_prefix_caching=False)
    blocks = SeqBlocks.empty(2)
    assert kv.allocate(blocks, 0, 40)  # 3 blocks: positions 0..47
    tables, firsts, slots = kv.step_view(blocks, 20, 5)  # positions 20..24: 2 blocks
    assert [len(t) for t in tables] == [2, 2] and firsts == [0, 0]
    assert slots[0] == [blocks.tables[0][1] * 16 + p for p in range(4, 9)]


def test_serve_takes_vllms_speculative_config_flag():
    """`tinyoss serve --speculative-config JSON`, as vLLM spells it: n-gram lookup is taken; a
    draft model is refused by name before anything loads."""
    from tinyoss import cli
    from tinyoss.config import EngineConfig

    def config(value: str) -> EngineConfig:
        args = cli.build_parser().parse_args(["serve", "tiny", "--speculative-config", value])
        return EngineConfig(model="tiny", **cli.engine_kwargs(args))

    ngram = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert SpeculativeConfig.parse(config(ngram).speculative_config).num_speculative_tokens == 2
    eagle = SpeculativeConfig.parse(config('{"method": "eagle3", "model": "d"}').speculative_config)
    assert (eagle.model, eagle.num_speculative_tokens) == ("d", 3)  # the published default
    for bad, words in (('{"method": "eagle3"}', "needs \"model\""),
                       ('{"method": "ngram", "model": "d"}', "needs \"model\""),
                       ('{"method": "medusa", "model": "d"}', "'medusa' is not supported")):
        with pytest.raises(ValueError, match=words):
            config(bad)
    with pytest.raises(ValueError, match="one GPU only"):
        EngineConfig(model="tiny", tensor_parallel_size=2,
                     speculative_config={"method": "eagle3", "model": "d"})


def test_steps_still_chain_when_no_sequence_can_take_drafts(prompts_and_reference):
    """Async scheduling goes on for requests speculation does not apply to (here: logprobs),
    with the same tokens."""
    prompts, ref, _ = prompts_and_reference
    llm = LLM("tiny", max_model_len=1024,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    core = llm.engine
    core.proposer = Replay({tuple(p): r for p, r in zip(prompts, ref)})
    launch, chained = core.executor.launch, []

    def counting(plan):
        chained.append(bool(plan.seqs) and plan.seqs[0].token_ids is None)
        return launch(plan)

    core.executor.launch = counting
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref and any(chained) and core.stats.spec_drafts == 0


def test_the_neighbours_of_drafting_sequences_keep_their_grammar_and_logprobs(
        prompts_and_reference):
    """Requests that do not draft (a grammar, logprobs) sharing verify steps with requests that
    do: their grammar's mask and their logprobs, as without speculation. Both had been dropped
    in those steps: a regex request wrote free text (and finished 'stop'), a logprobs request
    lost an entry a step."""
    prompts, ref, params = prompts_and_reference
    rx = SamplingParams(temperature=0, max_tokens=20,
                        structured_outputs=StructuredOutputs(regex=r"[0-9]{3}-[a-z]{4}"))
    lp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    extra, mixed = [[5, 6, 7, 8, 9], [11, 12, 13]], [params] * len(prompts) + [rx, lp]
    plain = LLM("tiny", max_model_len=1024, enable_prefix_caching=False)
    want = [o.outputs[0] for o in plain.generate(prompts + extra, mixed, use_tqdm=False)]
    llm = LLM("tiny", max_model_len=1024,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    llm.engine.proposer = Replay({tuple(p): r for p, r in zip(prompts, ref)})
    got = [o.outputs[0] for o in llm.generate(prompts + extra, mixed, use_tqdm=False)]
    assert llm.engine.stats.spec_accepted_tokens > 0
    assert [g.token_ids for g in got[: len(prompts)]] == ref
    assert got[-2].text == want[-2].text and re.fullmatch(r"[0-9]{3}-[a-z]{4}", got[-2].text)
    g, w = got[-1], want[-1]
    assert g.token_ids == w.token_ids and len(g.logprobs) == len(g.token_ids) == 20
    for a, b in zip(g.logprobs, w.logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_stop_string_inside_a_verify_steps_tokens_drops_the_rest(prompts_and_reference):
    """A stop string that ends inside a step's accepted drafts: the tokens after it are
    dropped, so token_ids (and the usage) are those without speculation (they had kept the
    step's later drafts)."""
    prompts, ref, _ = prompts_and_reference
    plain = LLM("tiny", max_model_len=1024, enable_prefix_caching=False)
    text = plain.get_tokenizer().decode
    stops = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            stop=[text(ref[1][end - 3 : end])]) for end in (6, 7, 8, 9)]
    want = [o.outputs[0] for o in plain.generate([prompts[1]] * 4, stops, use_tqdm=False)]
    llm = LLM("tiny", max_model_len=1024,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    llm.engine.proposer = Replay({tuple(p): r for p, r in zip(prompts, ref)})
    got = [o.outputs[0] for o in llm.generate([prompts[1]] * 4, stops, use_tqdm=False)]
    assert llm.engine.stats.spec_accepted_tokens > 0
    assert [(g.token_ids, g.text, g.finish_reason) for g in got] == \
        [(w.token_ids, w.text, w.finish_reason) for w in want]
    assert all(w.finish_reason == "stop" for w in want)
