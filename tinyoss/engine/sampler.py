"""Batched sampling with per-row parameters, in vLLM's order, without host synchronisation.

grammar mask -> min_tokens masking -> repetition/frequency/presence penalties -> temperature ->
min_p -> top_k -> top_p -> sample. Greedy rows take the argmax of the penalised logits. Random
rows run the exponential race, argmax(probs / E) with E ~ Exp(1), computed in log space as
argmax(logits - log E) (no softmax, no 0/0). A row with its own generator draws its noise from
it, one full-vocab draw per step, so a seeded request samples the same tokens in any batch and
at any position. Per-row values travel to the device through pinned memory (non-blocking), and
all decisions in `Sampler.__call__` depend only on host-side flags, so the only sync is the
caller's final `.tolist()`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

import torch
from torch import Tensor

from tinyoss.engine.transfer import to_device
from tinyoss.kernels import greedy_pick_torch
from tinyoss.sampling_params import SamplingParams

_NEG_INF = float("-inf")
# Temperatures and repetition penalties are clamped into this range on their way to float32:
# beyond it (a temperature of 1e39 is inf there, a penalty of 1e-46 is 0) -inf logits became NaN
# and the row sampled token 0 whatever its grammar said; within it nothing differs that a
# float32 softmax could show (x / 1e30 is uniform already).
_FLOAT32_SAFE = (1e-30, 1e30)


def _safe(x: float) -> float:
    return min(max(x, _FLOAT32_SAFE[0]), _FLOAT32_SAFE[1])


class SamplingRowLike(Protocol):
    """What `SamplingBatch.build` reads from each row (an engine sequence can provide it)."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...
    @property
    def generator(self) -> torch.Generator | None: ...
    @property
    def min_tokens_stop_ids(self) -> Iterable[int]: ...


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None
    min_tokens_stop_ids: Iterable[int] = ()


@dataclass
class Penalties:
    """Penalty state of the rows that need it; [P, V] tensors exist only when some row does."""

    rows: Tensor | None  # [P] row indices into the batch, None = all rows
    counts: Tensor  # [P, V] float32: occurrences of each token in the output
    seen: Tensor  # [P, V] bool: token in prompt or output (repetition penalty)
    presence: Tensor  # [P, 1]
    frequency: Tensor  # [P, 1]
    repetition: Tensor  # [P, 1]


@dataclass
class SamplingBatch:
    """Per-step device tensors for `Sampler`; Python bools/None say which stages run."""

    size: int
    vocab_size: int
    greedy: Tensor | None  # [B] bool, only when some rows are greedy and some are not
    all_greedy: bool
    temperature: Tensor | None  # [B, 1], 1 on greedy rows; None when all rows are greedy
    min_p: Tensor | None  # [B, 1], None when no random row uses min_p
    sort_rows: Tensor | None  # [S] rows that need top_k/top_p, None = all rows
    top_k: Tensor | None  # [S, 1] int64 (V = off), None when no row uses top_k or top_p
    top_p: Tensor | None  # [S, 1] (inf = off)
    banned: tuple[Tensor, Tensor] | None  # (rows, token ids) masked: stops until min_tokens,
    # and bad words
    penalties: Penalties | None
    generators: list[tuple[int, torch.Generator]]  # seeded random rows
    any_unseeded: bool  # some random row draws from the default generator
    max_logprobs: int  # k of the top logprobs: the largest any row asked for
    needs_logprobs: bool  # some row asked for logprobs (else none are computed)
    # Grammar masks: (rows or None = all, [G, ceil(V / 32)] int32 bits of the allowed tokens)
    allowed: tuple[Tensor | None, Tensor] | None = None
    # logit_bias and allowed_token_ids: (rows or None = all, [R, V] float32 added to the logits,
    # -inf on the tokens a row does not allow)
    bias: tuple[Tensor | None, Tensor] | None = None

    @classmethod
    def build(
        cls, rows: Sequence[SamplingRowLike], vocab_size: int, device: torch.device | str
    ) -> SamplingBatch:
        device = torch.device(device)
        b, v = len(rows), vocab_size
        params = [r.params for r in rows]
        greedy = [p.is_greedy for p in params]
        rand = [i for i in range(b) if not greedy[i]]
        top_k = [min(p.top_k, v) if p.top_k > 0 else v for p in params]
        sort = [i for i in rand if top_k[i] < v or params[i].top_p < 1]
        banned = [
            (i, t)
            for i, r in enumerate(rows)
            if r.params.min_tokens and len(r.output_token_ids) < r.params.min_tokens
            for t in r.min_tokens_stop_ids
            if 0 <= t < v
        ]
        banned += [(i, t) for i, r in enumerate(rows) if r.params.bad_words_token_ids
                   for t in _bad_words_now(r.params.bad_words_token_ids, r.output_token_ids)
                   if t < v]
        gens = [(i, rows[i].generator) for i in rand if rows[i].generator is not None]
        pen = [i for i in range(b) if params[i].needs_penalties]
        biased = [i for i in range(b) if params[i].logit_bias or params[i].allowed_token_ids]
        return cls(
            size=b,
            vocab_size=v,
            greedy=_dev(greedy, torch.bool, device) if any(greedy) and rand else None,
            all_greedy=not rand,
            temperature=_col([1.0 if g else _safe(p.temperature) for p, g in zip(params, greedy)],
                             device)
            if rand
            else None,
            min_p=_col([0.0 if g else p.min_p for p, g in zip(params, greedy)], device)
            if any(params[i].min_p > 0 for i in rand)
            else None,
            sort_rows=_subset(sort, b, device),
            top_k=_col([top_k[i] for i in sort], device, torch.int64) if sort else None,
            top_p=_col(
                [params[i].top_p if params[i].top_p < 1 else float("inf") for i in sort], device
            )
            if sort
            else None,
            banned=(
                _dev([i for i, _ in banned], torch.int64, device),
                _dev([t for _, t in banned], torch.int64, device),
            )
            if banned
            else None,
            penalties=_penalties(rows, pen, b, v, device) if pen else None,
            generators=gens,
            any_unseeded=len(gens) < len(rand),
            max_logprobs=max((p.logprobs or 0 for p in params), default=0),
            needs_logprobs=any(p.logprobs is not None for p in params),
            bias=_bias([params[i] for i in biased], b, biased, v, device) if biased else None,
        )


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [B] int64
    # [2, B] int64: the token ids, and 1 where the row's raw logits are all finite (0: a NaN or
    # an infinity): both go to the host in one copy
    checked: Tensor
    logprobs: Tensor | None = None  # [B] log-probability of the sampled token (raw distribution)
    ranks: Tensor | None = None  # [B] its rank there, 1 for the most likely (with logprobs)
    top_ids: Tensor | None = None  # [B, k], k = the most any row asked for; rows use their first n
    top_logprobs: Tensor | None = None  # [B, k], sorted descending


class Sampler:
    def __init__(self, pick: Callable[[Tensor], Tensor] = greedy_pick_torch) -> None:
        self.pick = pick  # logits -> [2, B] (argmax, finite) in one pass: `Kernels.greedy_pick`

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.shape != (batch.size, batch.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match the batch "
                f"({batch.size}, {batch.vocab_size})"
            )
        picked = self.pick(logits)
        x = _processed(logits, batch)
        if x is logits:  # plain greedy: the pick's argmax is the token
            checked = picked
        else:
            tokens = x.argmax(-1) if batch.all_greedy or batch.greedy is not None else None
            if not batch.all_greedy:
                sampled = race(_filter(x, batch), batch)
                tokens = sampled if tokens is None else torch.where(batch.greedy, tokens, sampled)
            checked = torch.stack([tokens, picked[1]])
        tokens = checked[0]
        if not batch.needs_logprobs:
            return SamplerOutput(tokens, checked, None)
        lp, rank, top_ids, top_lp = compute_logprobs(logits, tokens, batch.max_logprobs)
        if batch.max_logprobs == 0:
            return SamplerOutput(tokens, checked, lp, rank)
        return SamplerOutput(tokens, checked, lp, rank, top_ids, top_lp)


def _processed(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """The logits after the grammar mask, min_tokens bans and penalties (a float copy; the
    logits themselves when nothing applies and every row is greedy)."""
    if batch.all_greedy and batch.banned is None and batch.penalties is None and (
        batch.allowed is None and batch.bias is None
    ):
        return logits  # plain greedy: argmax needs no working copy
    x = logits.to(torch.float32, copy=True)
    if batch.allowed is not None:
        _apply_allowed(x, *batch.allowed)
    if batch.bias is not None:
        rows, add = batch.bias
        if rows is None:
            x += add
        else:
            x[rows] += add
    if batch.banned is not None:
        rows, ids = batch.banned
        kept = x[rows, ids]
        x.index_put_(batch.banned, x.new_full((), _NEG_INF))  # a Python scalar would sync
        if batch.allowed is not None or batch.bias is not None:
            # a grammar (or allowed_token_ids) that allows only an end outranks min_tokens: such
            # a row keeps its ends (banning them too would leave no token to sample)
            empty = torch.isneginf(x.amax(-1))
            x.index_put_(batch.banned, torch.where(empty[rows], kept, x.new_full((), _NEG_INF)))
    if batch.penalties is not None:
        x = _apply_penalties(x, batch.penalties)
    return x


def scores(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Each row's scores, whose softmax is the distribution it samples from (greedy rows: the
    processed logits, whose argmax they take). Speculative verification reads them."""
    x = _processed(logits, batch).float()
    return x if batch.all_greedy else _filter(x, batch)


def compute_logprobs(
    logits: Tensor, token_ids: Tensor, k: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Log-softmax value of each row's given token and its rank (1 + the tokens more likely, as
    vLLM's), plus the row's k most likely tokens (sorted; [T, 0] tensors when k is 0).

    For prompt logprobs pass the logits of positions 0..T-2 with the prompt tokens 1..T-1.
    Works from logsumexp and gathers, so no [T, V] log-softmax is materialised.
    """
    logits = logits.float()
    lse = logits.logsumexp(-1)
    given = logits.gather(-1, token_ids[:, None])
    rank = (logits > given).sum(-1) + 1
    vals, ids = logits.topk(k, -1)
    return given.squeeze(-1) - lse, rank, ids, vals - lse[:, None]


def _apply_allowed(x: Tensor, rows: Tensor | None, bits: Tensor) -> None:
    """-inf on the tokens a row's grammar does not allow (bit t % 32 of word t // 32)."""
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    ok = ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, : x.shape[1]]
    if rows is None:
        x.masked_fill_(~ok, _NEG_INF)
    else:
        x[rows] = x[rows].masked_fill(~ok, _NEG_INF)


def _apply_penalties(x: Tensor, p: Penalties) -> Tensor:
    """vLLM/HF semantics: repetition divides positive logits (multiplies negative ones) of every
    token seen in prompt or output; frequency and presence subtract per output occurrence."""
    sub = x if p.rows is None else x[p.rows]
    rep = torch.where(sub > 0, sub / p.repetition, sub * p.repetition)
    sub = torch.where(p.seen, rep, sub) - p.frequency * p.counts - p.presence * (p.counts > 0)
    if p.rows is None:
        return sub
    x[p.rows] = sub
    return x


def _filter(x: Tensor, batch: SamplingBatch) -> Tensor:
    """Temperature, then min_p, top_k and top_p as -inf masks (greedy rows pass through)."""
    x = x / batch.temperature
    if batch.min_p is not None:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < batch.min_p * probs.amax(-1, keepdim=True), _NEG_INF)
    if batch.top_k is None:
        return x
    sub = x if batch.sort_rows is None else x[batch.sort_rows]
    # Stable descending sort: ties are ordered by token id, so the lower id is kept first.
    vals, idx = sub.sort(dim=-1, descending=True, stable=True)
    pos = torch.arange(batch.vocab_size, device=x.device)
    vals = vals.masked_fill(pos >= batch.top_k, _NEG_INF)
    probs = vals.softmax(-1)
    # Keep a token while the mass before it is below top_p: the smallest set reaching top_p;
    # the most likely always (a top_p below float32's smallest number is 0 there, as vLLM keeps)
    vals = vals.masked_fill((probs.cumsum(-1) - probs >= batch.top_p) & (pos > 0), _NEG_INF)
    sub = torch.empty_like(sub).scatter_(-1, idx, vals)
    if batch.sort_rows is None:
        return sub
    x[batch.sort_rows] = sub
    return x


def race(x: Tensor, batch: SamplingBatch) -> Tensor:
    """Exponential race: argmax(probs / E) = argmax(x - log E), E ~ Exp(1) per token."""
    noise = torch.empty_like(x)
    if batch.any_unseeded:
        noise.exponential_()
    for i, g in batch.generators:
        noise[i].exponential_(generator=g)
    return (x - noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_()).argmax(-1)


def _penalties(
    rows: Sequence[SamplingRowLike], pen: list[int], b: int, v: int, device: torch.device
) -> Penalties:
    params = [rows[i].params for i in pen]
    counts = torch.zeros(len(pen), v, device=device)
    seen = torch.zeros(len(pen), v, dtype=torch.bool, device=device)
    out_r, out_t = _flatten([rows[i].output_token_ids for i in pen], device)
    counts.index_put_((out_r, out_t), torch.ones((), device=device), accumulate=True)
    seen.index_put_(_flatten([rows[i].prompt_token_ids for i in pen], device), seen.new_ones(()))
    seen |= counts > 0
    return Penalties(
        rows=_subset(pen, b, device),
        counts=counts,
        seen=seen,
        presence=_col([p.presence_penalty for p in params], device),
        frequency=_col([p.frequency_penalty for p in params], device),
        repetition=_col([_safe(p.repetition_penalty) for p in params], device),
    )


def _bad_words_now(seqs: list[list[int]], output: Sequence[int]) -> set[int]:
    """The tokens a row may not take next (vLLM's bad words): each one-token word, and each
    longer word's last token once the output ends with the rest of it."""
    return {q[-1] for q in seqs
            if len(q) == 1 or len(output) >= len(q) - 1 and list(output[len(output) - len(q) + 1:])
            == q[:-1]}


def _bias(params: list[SamplingParams], b: int, idx: list[int], v: int,
          device: torch.device) -> tuple[Tensor | None, Tensor]:
    """The rows' logit_bias added to -inf off their allowed_token_ids (0 on them), [R, V]."""
    add = torch.zeros(len(params), v, device=device)
    limited = [r for r, p in enumerate(params) if p.allowed_token_ids]
    if limited:
        add[_dev(limited, torch.int64, device)] = _NEG_INF
        add.index_put_(_flatten([params[r].allowed_token_ids for r in limited], device,
                                rows=limited), add.new_zeros(()))
    ids = [list(p.logit_bias or ()) for p in params]
    if any(ids):
        values = [b_ for p in params for b_ in (p.logit_bias or {}).values()]
        add.index_put_(_flatten(ids, device), _dev(values, torch.float32, device),
                       accumulate=True)
    return _subset(idx, b, device), add


def _flatten(lists: list[Sequence[int]], device: torch.device,
             rows: list[int] | None = None) -> tuple[Tensor, Tensor]:
    """(row, token) index pairs of ragged per-row token lists (list i is row rows[i], or i)."""
    lengths = torch.tensor([len(t) for t in lists], dtype=torch.int64)
    row_ids = torch.repeat_interleave(
        torch.arange(len(lists)) if rows is None else torch.tensor(rows), lengths)
    ids = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.int64)
    return to_device(row_ids, device), to_device(ids, device)


def _subset(idx: list[int], b: int, device: torch.device) -> Tensor | None:
    """Row indices of a sub-batch, or None when it is the whole batch (no gather needed)."""
    return None if len(idx) == b else _dev(idx, torch.int64, device)


def _col(values: list, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    return _dev(values, dtype, device)[:, None]


def _dev(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)
