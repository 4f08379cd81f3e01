"""Sampler transforms against independent float64 references, seeding, logprobs, validation."""

from __future__ import annotations

import math

import pytest
import torch

from tinyoss.engine.sampler import Sampler, SamplingBatch, SamplingRow, compute_logprobs
from tinyoss.sampling_params import ParamError, SamplingParams

V = 16
N = 20_000  # draws per distribution check


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def fixed_logits(v: int = V, seed: int = 1) -> torch.Tensor:
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 1.5


def sample(logits: torch.Tensor, rows: list[SamplingRow]):
    batch = SamplingBatch.build(rows, logits.shape[-1], "cpu")
    return Sampler()(logits, batch)


def draws(logits: torch.Tensor, params: SamplingParams, n: int = N, **row) -> torch.Tensor:
    """n independent samples of one row: the row repeated n times in one batch."""
    rows = [SamplingRow(params, **row)] * n
    return sample(logits.expand(n, -1).contiguous(), rows).token_ids


def reference(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """Expected sampling distribution, computed token by token in float64."""
    p = torch.softmax(logits.double() / temperature, -1)
    keep = [i for i in range(len(p)) if p[i] >= min_p * p.max()]
    keep.sort(key=lambda i: (-p[i].item(), i))
    if top_k > 0:
        keep = keep[:top_k]
    total, mass, kept = sum(p[i].item() for i in keep), 0.0, []
    for i in keep:
        if top_p < 1 and kept and mass >= top_p:  # the most likely always stays
            break
        kept.append(i)
        mass += p[i].item() / total
    out = torch.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


def check_distribution(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """Samples stay inside the support; every likely token appears; frequencies pass a
    chi-square bound (df + 8 sd), with cells expecting < 5 draws pooled."""
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    exp = expected.double() * len(tokens)
    assert set(tokens.tolist()) <= set((expected > 0).nonzero().flatten().tolist())
    assert (counts[exp >= 20] > 0).all()
    big = exp >= 5
    obs_cells = torch.cat([counts[big], counts[~big].sum()[None]])
    exp_cells = torch.cat([exp[big], exp[~big].sum()[None]])
    used = exp_cells > 0
    chi2 = ((obs_cells[used] - exp_cells[used]) ** 2 / exp_cells[used]).sum().item()
    df = max(int(used.sum()) - 1, 1)
    assert chi2 < df + 8 * math.sqrt(2 * df), (chi2, df)


def test_plain_sampling_matches_softmax() -> None:
    logits = fixed_logits()
    check_distribution(draws(logits, SamplingParams()), reference(logits))


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_temperature(temperature: float) -> None:
    logits = fixed_logits()
    got = draws(logits, SamplingParams(temperature=temperature))
    check_distribution(got, reference(logits, temperature=temperature))


@pytest.mark.parametrize("top_k", [1, 3, 7, V, V + 5])
def test_top_k(top_k: int) -> None:
    logits = fixed_logits()
    got = draws(logits, SamplingParams(top_k=top_k), n=8000)
    check_distribution(got, reference(logits, top_k=top_k))
    if top_k == 1:
        assert (got == logits.argmax()).all()


@pytest.mark.parametrize("top_p", [0, 1e-9, 0.3, 0.62, 0.9, 1.0])  # 0: OpenAI's range
def test_top_p(top_p: float) -> None:
    logits = fixed_logits()
    got = draws(logits, SamplingParams(top_p=top_p), n=8000)
    check_distribution(got, reference(logits, top_p=top_p))
    if top_p < 1e-6:
        assert (got == logits.argmax()).all()


@pytest.mark.parametrize(
    "top_p, kept", [(0.25, {0}), (0.5, {0, 1}), (0.5001, {0, 1, 2}), (1.0, {0, 1, 2, 3})]
)
def test_top_p_boundary_and_ties(top_p: float, kept: set[int]) -> None:
    """Four equal logits: probabilities exactly 0.25; reaching top_p exactly stops there, and
    ties keep the lower token ids."""
    got = draws(torch.zeros(4), SamplingParams(top_p=top_p), n=4000)
    check_distribution(got, torch.tensor([1.0 if i in kept else 0.0 for i in range(4)]) / len(kept))


def test_top_k_ties_keep_lower_ids() -> None:
    logits = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 0.5])
    got = draws(logits, SamplingParams(top_k=2), n=4000)
    check_distribution(got, torch.tensor([0, 0.5, 0.5, 0, 0, 0]))


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p(min_p: float) -> None:
    logits = fixed_logits()
    got = draws(logits, SamplingParams(min_p=min_p, temperature=0.8), n=8000)
    check_distribution(got, reference(logits, temperature=0.8, min_p=min_p))
    if min_p == 1.0:
        assert (got == logits.argmax()).all()


def test_combined_filters_in_order() -> None:
    logits = fixed_logits(seed=3)
    params = SamplingParams(temperature=0.7, min_p=0.02, top_k=6, top_p=0.8)
    check_distribution(
        draws(logits, params), reference(logits, temperature=0.7, top_k=6, top_p=0.8, min_p=0.02)
    )


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    logits = fixed_logits()
    order = logits.argsort(descending=True).tolist()
    stop = order[:2]
    greedy = SamplingParams(temperature=0, min_tokens=3)
    rows = [
        SamplingRow(greedy, output_token_ids=[5, 5], min_tokens_stop_ids=stop + [10**9]),
        SamplingRow(greedy, output_token_ids=[5, 5, 5], min_tokens_stop_ids=stop),
    ]
    assert sample(logits.expand(2, -1), rows).token_ids.tolist() == [order[2], order[0]]
    got = draws(logits, SamplingParams(min_tokens=1), min_tokens_stop_ids=stop)
    expected = torch.softmax(logits.double(), -1)
    expected[stop] = 0
    check_distribution(got, expected / expected.sum())


def test_logit_bias_and_allowed_token_ids() -> None:
    """logit_bias adds to the logits before sampling (as OpenAI's and vLLM's); allowed_token_ids
    leaves only its tokens, where a bias still counts; rows without either are untouched."""
    logits = fixed_logits()
    order = logits.argsort(descending=True).tolist()
    bias = {order[5]: 100.0, order[0]: -3.0}
    rows = [SamplingRow(SamplingParams(temperature=0)),
            SamplingRow(SamplingParams(temperature=0, logit_bias={order[5]: 100})),
            SamplingRow(SamplingParams(temperature=0, allowed_token_ids=order[3:6])),
            SamplingRow(SamplingParams(temperature=0, allowed_token_ids=order[3:6],
                                       logit_bias={order[5]: 2.0, order[1]: 100}))]
    got = sample(logits.expand(4, -1), rows).token_ids.tolist()
    assert got == [order[0], order[5], order[3], order[5] if logits[order[5]] + 2 >
                   logits[order[3]] else order[3]]
    expected = torch.softmax(logits.double() + torch.tensor(
        [bias.get(t, 0.0) for t in range(V)], dtype=torch.float64) * 0.01, -1)
    got = draws(logits, SamplingParams(logit_bias={t: b * 0.01 for t, b in bias.items()}))
    check_distribution(got, expected)
    allowed = [order[2], order[7], order[11]]
    expected = torch.zeros(V, dtype=torch.float64)
    expected[allowed] = torch.softmax(logits.double()[allowed], -1)
    check_distribution(draws(logits, SamplingParams(allowed_token_ids=allowed)), expected)


def test_bad_words_ban_one_token_words_always_and_longer_ones_after_their_start() -> None:
    """vLLM's bad words: a one-token word is never taken; the last token of a longer word is
    banned only right after the rest of it."""
    logits = fixed_logits()
    order = logits.argsort(descending=True).tolist()
    words = [[order[0]], [order[5], order[6], order[1]]]
    params = SamplingParams(temperature=0, bad_words_token_ids=words)
    rows = [SamplingRow(params, output_token_ids=[order[5]]),
            SamplingRow(params, output_token_ids=[order[5], order[6]]),
            SamplingRow(params, output_token_ids=[order[6], order[5], order[6]]),
            SamplingRow(params)]
    got = sample(logits.expand(4, -1), rows).token_ids.tolist()
    assert got == [order[1], order[2], order[2], order[1]]
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[[]])


def test_bad_words_are_tokenized_as_vllm_does() -> None:
    """Each word bare and after a space (when that is another token sequence of one length)."""
    from tinyoss.sampling_params import bad_words_ids

    vocab = {"cat": [1], " cat": [2], "a b": [3, 4], " a b": [5, 6, 7], "x": [8], " x": [8]}
    params = bad_words_ids(SamplingParams(bad_words=["  cat", "a b", "x"]), vocab.__getitem__)
    assert params.bad_words_token_ids == [[1], [2], [3, 4], [8]]
    assert params.needs_output_ids
    assert not SamplingParams(bad_words_token_ids=[[1]]).needs_output_ids
    assert bad_words_ids(SamplingParams(), vocab.__getitem__).bad_words_token_ids is None


def test_allowed_token_ids_of_ends_only_outrank_min_tokens() -> None:
    """A row allowed only end tokens still under min_tokens keeps them (else no token is left)."""
    logits = fixed_logits()
    params = SamplingParams(temperature=0, min_tokens=4, allowed_token_ids=[3])
    row = SamplingRow(params, output_token_ids=[1], min_tokens_stop_ids=[3])
    assert sample(logits[None], [row]).token_ids.tolist() == [3]


@pytest.mark.parametrize("kw", [{"temperature": 1e39}, {"temperature": 3.5e38},
                                {"top_p": 1e-50}, {"repetition_penalty": 1e-46},
                                {"repetition_penalty": 1e39, "temperature": 1e-4}])
def test_values_beyond_float32_sample_an_allowed_token(kw: dict) -> None:
    """A temperature, top_p or repetition penalty that float32 cannot hold (inf or 0 there)
    still samples only tokens the row allows: they had turned the -inf of a grammar's (or
    allowed_token_ids') masked tokens into NaN, and the row took token 0 whatever it allowed.
    top_p below float32's smallest number keeps the most likely token, as a tiny top_p does."""
    logits = fixed_logits()
    allowed = [5, 9, 12]
    rows = [SamplingRow(SamplingParams(allowed_token_ids=allowed, **kw),
                        prompt_token_ids=[5, 9, 3], output_token_ids=[12, 1])] * 64
    got = set(sample(logits.expand(64, -1).contiguous(), rows).token_ids.tolist())
    assert got <= set(allowed)
    if "top_p" in kw:  # the allowed token of the highest logit, every time
        assert got == {max(allowed, key=lambda t: logits[t].item())}


def penalised(
    logits: torch.Tensor,
    prompt: list[int],
    output: list[int],
    rep: float = 1.0,
    freq: float = 0.0,
    pres: float = 0.0,
) -> torch.Tensor:
    out = logits.double().clone()
    for t in range(len(out)):
        c = output.count(t)
        if t in prompt or c:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        out[t] -= freq * c + pres * (c > 0)
    return out


@pytest.mark.parametrize(
    "kw",
    [
        {"rep": 1.8},
        {"rep": 0.6},
        {"freq": 0.7},
        {"freq": -1.2},
        {"pres": 1.5},
        {"pres": -0.8},
        {"rep": 1.3, "freq": 0.4, "pres": 0.9},
    ],
)
def test_penalties(kw: dict) -> None:
    logits = fixed_logits()
    prompt, output = [1, 2, 3, 3], [3, 4, 4, 4, 9]
    params = SamplingParams(
        repetition_penalty=kw.get("rep", 1.0),
        frequency_penalty=kw.get("freq", 0.0),
        presence_penalty=kw.get("pres", 0.0),
    )
    expected = penalised(logits, prompt, output, **kw)
    got = draws(logits, params, prompt_token_ids=prompt, output_token_ids=output)
    check_distribution(got, torch.softmax(expected, -1))
    greedy = SamplingParams(
        temperature=0,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
    )
    # A plain row beside the penalised one must be untouched.
    rows = [
        SamplingRow(SamplingParams(temperature=0), prompt, output),
        SamplingRow(greedy, prompt, output),
    ]
    tokens = sample(logits.expand(2, -1), rows).token_ids.tolist()
    assert tokens == [logits.argmax().item(), expected.argmax().item()]


def test_penalty_flips_greedy_choice() -> None:
    logits = torch.tensor([0.0, 2.0, 1.9, -1.0])
    row = SamplingRow(SamplingParams(temperature=0, presence_penalty=0.5), (), [1])
    assert sample(logits[None], [row]).token_ids.tolist() == [2]


def test_no_penalty_state_without_penalties() -> None:
    batch = SamplingBatch.build([SamplingRow(SamplingParams(), [1, 2], [3])] * 3, V, "cpu")
    assert batch.penalties is None and batch.banned is None and batch.top_k is None


def test_greedy_is_argmax_in_mixed_batch() -> None:
    logits = torch.randn(6, 1000)
    rows = [SamplingRow(SamplingParams(temperature=0 if i % 2 else 1.0, top_k=5)) for i in range(6)]
    tokens = sample(logits, rows).token_ids
    assert tokens.dtype == torch.int64
    assert tokens[1::2].tolist() == logits[1::2].argmax(-1).tolist()
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy


def seeded_run(
    seed: int, position: int, others: list[SamplingRow], logits: torch.Tensor, steps: int = 8
) -> list[int]:
    params = SamplingParams(seed=seed, temperature=1.1, top_p=0.95)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        rows = list(others)
        rows.insert(position, SamplingRow(params, generator=g))
        batch_logits = torch.randn(len(rows), logits.shape[-1])
        batch_logits[position] = logits
        out.append(sample(batch_logits, rows).token_ids[position].item())
    return out


def test_seeded_rows_reproduce_in_any_batch() -> None:
    logits = torch.zeros(1000)  # uniform: every draw is a fresh choice among 1000
    a = seeded_run(7, 0, [SamplingRow(SamplingParams())], logits)
    other_seed = SamplingParams(seed=99, top_k=3)
    b = seeded_run(
        7,
        2,
        [
            SamplingRow(SamplingParams(temperature=0)),
            SamplingRow(other_seed, generator=torch.Generator().manual_seed(99)),
            SamplingRow(SamplingParams(min_p=0.1, repetition_penalty=1.2)),
        ],
        logits,
    )
    assert a == b
    assert seeded_run(8, 0, [], logits) != a


def test_empirical_frequencies_small_vocab() -> None:
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3])
    check_distribution(draws(logits, SamplingParams(), n=50_000), torch.softmax(logits, -1))


def test_logprobs_are_raw_log_softmax() -> None:
    logits = torch.randn(4, 300) * 3
    rows = [
        SamplingRow(SamplingParams(temperature=0.5, top_k=3, logprobs=2)),
        SamplingRow(SamplingParams(temperature=0, repetition_penalty=2.0), [1], [2]),
        SamplingRow(SamplingParams(logprobs=5)),
        SamplingRow(SamplingParams(min_p=0.5, logprobs=0)),
    ]
    out = sample(logits, rows)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == out.top_logprobs.shape == (4, 5)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    top = ref.topk(5, -1)
    assert out.top_ids.tolist() == top.indices.tolist()
    torch.testing.assert_close(out.top_logprobs, top.values)
    none = sample(logits, [SamplingRow(SamplingParams())] * 4)
    assert none.top_ids is None and none.top_logprobs is None


def test_compute_logprobs_for_prompt() -> None:
    logits = torch.randn(7, 50)
    ids = torch.randint(0, 50, (7,))
    lp, rank, top_ids, top_lp = compute_logprobs(logits, ids, 3)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp, ref[torch.arange(7), ids])
    want = [sorted(row.tolist(), reverse=True).index(row[t].item()) + 1
            for row, t in zip(ref, ids.tolist())]
    assert rank.tolist() == want
    assert top_ids.tolist() == ref.topk(3).indices.tolist()
    torch.testing.assert_close(top_lp, ref.topk(3).values)
    _, _, no_ids, no_lps = compute_logprobs(logits, ids, 0)
    assert no_ids.shape == no_lps.shape == (7, 0)


def test_stop_normalisation() -> None:
    p = SamplingParams(stop="x", stop_token_ids=None, temperature=1)
    assert p.stop == ["x"] and p.stop_token_ids == [] and isinstance(p.temperature, float)
    assert SamplingParams().stop == [] and SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(frequency_penalty=0.1).needs_penalties
    assert not SamplingParams().needs_penalties


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 1.0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", -0.1),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("presence_penalty", 2.1),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", 5),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", 3),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", 21),
        ("logprobs", -1),
        ("logprobs", True),
        ("prompt_logprobs", 50),
        ("seed", "7"),
        ("seed", 1.5),
        ("seed", 2**64),
        ("ignore_eos", 1),
        ("skip_special_tokens", None),
        ("logit_bias", {1: 100.5}),
        ("logit_bias", {"1": 5}),
        ("logit_bias", {-1: 5}),
        ("logit_bias", {1: float("nan")}),
        ("logit_bias", [1, 5]),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [1, -2]),
        ("allowed_token_ids", 3),
        ("bad_words", "cat"),
        ("bad_words", ["cat", " "]),
    ],
)
def test_validation_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"{field}={value!r}".replace("[", r"\[")) as err:
        SamplingParams(**{field: value})
    assert "must be" in str(err.value)


def test_validation_speaks_python_and_carries_its_parts() -> None:
    """The Python API's message says None where None is allowed; the server words its own from
    the error's parts (no None: a JSON client sends null, or leaves the field out)."""
    with pytest.raises(ParamError, match=r"max_tokens=0 is invalid: must be None or an int >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ParamError) as err:
        SamplingParams(stop=["ok", ""])
    e = err.value
    assert (e.name, e.value, e.allowed, e.optional) == (
        "stop", ["ok", ""], "a non-empty string or a list of them", True)
    with pytest.raises(ParamError, match=r"n=0 is invalid: must be an int >= 1$"):
        SamplingParams(n=0)


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match=r"min_tokens=5 .*max_tokens \(3\)"):
        SamplingParams(min_tokens=5, max_tokens=3)
    assert SamplingParams(min_tokens=5, max_tokens=None).min_tokens == 5
