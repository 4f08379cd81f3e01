"""EAGLE-3 drafting inside the engine: the drafts it proposes are the reference draft's, greedy
output is unchanged, and the cache stays consistent (tiny target, synthetic drafts, CPU)."""

import random

import pytest
import torch

from tests.test_speculative import Replay
from tinyoss import LLM, SamplingParams
from tinyoss.config import ModelConfig
from tinyoss.engine.kv_cache import CacheLayout, allocate_kv_tensors
from tinyoss.kernels.attention import AttentionMetadata, GroupMetadata, TorchAttention
from tinyoss.model.eagle3 import Eagle3KVCache
from tinyoss.model.presets import preset_config
from tinyoss.tools.eagle3_checkpoints import write_synthetic_draft

# the target's attention geometry (the draft's keys share its cache), small otherwise
DIMS = {"num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 64}
K = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 150000) for _ in range(n)] for n in (3, 140, 300)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    base = LLM("tiny", max_model_len=1024)
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    root = tmp_path_factory.mktemp("drafts")
    return prompts, ref, params, root


def eagle3_llm(root, layout: str, **options) -> LLM:
    target = ModelConfig.from_dict(preset_config("tiny"))
    folder = write_synthetic_draft(root / layout, layout, target, dims=DIMS)
    return LLM("tiny", max_model_len=1024, speculative_config={
        "method": "eagle3", "model": str(folder), "num_speculative_tokens": K}, **options)


def record_drafts(core) -> list[tuple[list[int], list[int]]]:
    """(the sequence's tokens after a step, the drafts proposed for what follows) per step."""
    records, last = [], {}
    result, finish = core.executor.result, core._finish

    def keep_result(launched):
        last["result"] = result(launched)
        return last["result"]

    def keep_drafts(plan, launched):
        deltas = finish(plan, launched)
        for seq_id, drafts in last["result"].drafts.items():
            seq = core._seqs.get(seq_id)
            if seq is not None and not seq.finished:
                records.append((list(seq.token_ids), drafts))
        return deltas

    core.executor.result, core._finish = keep_result, keep_drafts
    return records


@torch.inference_mode()
def reference_drafts(core, tokens: list[int]) -> list[int]:
    """The drafts for `tokens` by the draft's own per-sequence cache and attention, on the
    target states of a one-sequence forward pass with a fresh cache (torch attention, on the
    engine's device and dtype)."""
    model, drafter = core.executor.model, core.executor.drafter
    config, dtype = model.config, model.lm_head.weight.dtype
    device = model.lm_head.weight.device
    n = len(tokens) - 1  # states of positions 0..n-1, each with the token after it
    layout = CacheLayout.for_model(config)
    blocks = -(-n // 16)
    kv = allocate_kv_tensors(layout, blocks, 16, config, dtype, device)
    attention = TorchAttention(kv, layout.layer_group,
                               [layout.windows[g] for g in layout.layer_group],
                               config.head_dim ** -0.5)
    group = GroupMetadata([list(range(blocks))], [0], torch.arange(n, device=device))
    attention.plan(AttentionMetadata([n], [n], [group] * len(layout.windows)))
    positions = torch.arange(n, device=device)
    model(torch.tensor(tokens[:n], device=device), positions, attention)
    aux = model.aux_hidden[:n].clone()
    draft = drafter.draft
    cache = Eagle3KVCache(draft.config, n + K, dtype=dtype, device=device)
    normed, feedback = draft.prefill(aux, torch.tensor(tokens[1:], device=device), positions,
                                     cache)
    out = [int(draft.propose_ids(normed[-1]))]
    fb = feedback[-1]
    for j in range(K - 1):
        normed, fb = draft.step(fb, out[-1], n + j, cache)
        out.append(int(draft.propose_ids(normed)))
    return out


def amplify_attention(core) -> None:
    """Makes attention dominate the draft's output, so that wrong keys change its drafts."""
    attn = core.executor.drafter.draft.midlayer.self_attn
    c = attn.c
    with torch.no_grad():
        attn.qkv_proj.weight[c.q_size + c.kv_size :].mul_(8)  # v
        attn.o_proj.weight.mul_(8)


@pytest.mark.parametrize("layout", ["specforge", "nvidia"])
def test_engine_drafts_are_the_reference_drafts(setup, layout):
    """Prompts on both sides of the 128-token window in one batch, verify steps with drafts
    partly accepted (a replayed continuation, every third token wrong): the engine's EAGLE-3
    proposals (pass 1 over the step on the step's attention plan, the lookahead passes on
    device-computed slots) equal the draft's reference on a fresh cache; greedy output is
    unchanged; every block comes back, and a request sharing a prompt gets the same tokens."""
    prompts, ref, params, root = setup
    llm = eagle3_llm(root, layout)
    core = llm.engine
    amplify_attention(core)
    if layout == "specforge":  # drafts the target partly accepts; the drafter still proposes
        core.proposer = Replay({tuple(p): r for p, r in zip(prompts, ref)}, wrong=3)
    records = record_drafts(core)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    s = core.stats
    assert s.spec_drafts > 0
    if layout == "specforge":
        assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens
    assert len(records) > 20
    for tokens, drafts in records[::4]:
        assert drafts == reference_drafts(core, tokens), len(tokens)
    assert core.scheduler.kv.usage() == 0 and not core.has_work()
    core.proposer = None
    again = llm.generate([prompts[2]], params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == ref[2] and again.num_cached_tokens > 0
