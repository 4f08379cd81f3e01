"""Runs a `StepPlan`: the flat batch, attention metadata, one forward pass, sampling.

Sequences' tokens go back to back into one flat batch with their positions; each cache group
gets block tables and the cache slot of every new token. Logits are computed only where needed
(each sampling sequence's last token, and prompt positions whose logprobs were asked for), then
one batched sampler call picks every sequence's next token.

`launch` only queues work: the sampled tokens stay on the device, where a chained step takes
them as its input ids before the host has seen them, and come back to the host in the
background (`result` waits for them). The executor keeps each sequence's sampler state (its
seeded generator, the tokens penalties count, its grammar matcher) between steps, keyed by
sequence id.

A grammar's mask for a step needs the previous step's token. A chained step that holds
constrained sequences therefore queues only its forward pass; `complete` queues its sampling
once `result` has fed the previous tokens to the matchers. The GPU runs the forward pass
meanwhile, so the masks cost the host's time, not the GPU's.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass

import torch

from tinyoss.engine.cuda_graphs import CudaGraphRunner
from tinyoss.engine.eagle3_drafter import Eagle3Drafter
from tinyoss.engine.comm import Group, GroupError
from tinyoss.engine.workers import ENDS, Peers
from tinyoss.engine.grammar import GrammarCompiler, Matcher
from tinyoss.engine.piecewise_graphs import PiecewiseGraphRunner
from tinyoss.engine.sampler import Sampler, SamplingBatch, compute_logprobs
from tinyoss.engine.speculative import can_speculate, verify
from tinyoss.engine.step import NewSeq, StepPlan, StepResult, TokenLogprob
from tinyoss.engine.transfer import HostCopy, to_device
from tinyoss.kernels.attention import AttentionMetadata, GroupMetadata
from tinyoss.model.gpt_oss import GptOssForCausalLM
from tinyoss.sampling_params import MAX_LOGPROBS, SamplingParams

_PENDING = -1  # an output token sampled by a launched step, not yet on the host
# Prompt positions whose logits exist at once (prompt logprobs): a [512, 201,088] slice is
# ~0.2 GB in bf16, ~0.4 in fp32, where a whole 8k-token chunk's would be 3.3 and 6.6.
PROMPT_LOGPROB_ROWS = 512
# (logprob, rank, top ids, top logprobs) of each prompt position: the top MAX_LOGPROBS, cut to
# the request's k later
PromptRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class SamplerState:
    """What the sampler reads of one sequence (`SamplingRowLike`)."""

    __slots__ = ("params", "prompt_token_ids", "output_token_ids", "generator")
    __slots__ += ("min_tokens_stop_ids", "grammar", "error")

    def __init__(
        self, new: NewSeq, device: torch.device, grammars: GrammarCompiler | None,
        prebuilt: Matcher | ValueError | None = None,
    ) -> None:
        """`prebuilt`: the sequence's grammar matcher, built off the step loop (or why it
        could not be); else it is built here."""
        self.params: SamplingParams = new.params
        self.prompt_token_ids = new.prompt_token_ids
        self.output_token_ids: list[int] = []
        self.min_tokens_stop_ids = new.min_tokens_stop_ids
        self.generator: torch.Generator | None = None
        if new.params.seed is not None:  # a seeded request samples the same tokens in any batch
            self.generator = torch.Generator(device=device)
            # choice i, 1,000,003 seeds on: seeds closer than that share no choice's stream
            # (vLLM's seed + i gives seed 1's first choice seed 0's second)
            self.generator.manual_seed(new.params.seed + new.index * 1_000_003)
        self.grammar: Matcher | None = None
        self.error: tuple[str, str] | None = None  # why this sequence cannot go on: code, text
        spec = new.params.structured_outputs
        if spec is not None:
            try:
                if isinstance(prebuilt, ValueError):
                    raise prebuilt
                if grammars is None:
                    raise ValueError("this engine was built without a tokenizer for grammars")
                self.grammar = prebuilt or grammars.matcher(spec)
            except ValueError as e:
                self.error = ("invalid_grammar", str(e))


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata


def build_batch(
    plan: StepPlan, num_groups: int, device: torch.device, input_ids: torch.Tensor | None = None
) -> FlatBatch:
    """The flat batch of a step. `input_ids` (on the device) replaces the token ids when they
    are not known on the host yet: a chained step. Everything the host builds goes up in one
    non-blocking copy."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[list[int]] = [[] for _ in range(num_groups)]
    tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
    starts: list[list[int]] = [[] for _ in range(num_groups)]
    query_lens, seq_lens = [], []
    for s in plan.seqs:
        if input_ids is None:
            ids.extend(s.token_ids)
        positions.extend(range(s.start, s.start + s.num_tokens))
        query_lens.append(s.num_tokens)
        seq_lens.append(s.start + s.num_tokens)
        for g in range(num_groups):
            tables[g].append(s.block_tables[g])
            starts[g].append(s.block_starts[g])
            slots[g].extend(s.slots[g])
    t = len(positions)
    flat = to_device(torch.tensor(ids + positions + sum(slots, []), dtype=torch.long), device)
    if input_ids is None:
        input_ids, flat = flat[:t], flat[t:]
    groups = [
        GroupMetadata(tables[g], starts[g], flat[(g + 1) * t : (g + 2) * t])
        for g in range(num_groups)
    ]
    return FlatBatch(input_ids, flat[:t], AttentionMetadata(query_lens, seq_lens, groups))


@dataclass
class LaunchedStep:
    """A step whose GPU work is queued: its sampled tokens stay on the device (`tokens`, one row
    per sampling sequence, in `seq_ids` order) and travel to the host meanwhile."""

    seq_ids: list[int]  # the sequence of each sampled row
    tokens: torch.Tensor | None  # [len(seq_ids)] on the device
    host: HostCopy | None  # [token ids, finite rows], logprobs, top ids, top logprobs
    prompt_logprobs: dict[int, list[TokenLogprob]]
    placeholders: list[tuple[SamplerState, int]]  # where each row's token goes in its state
    logits: torch.Tensor | None = None  # kept until `Executor.complete` samples them
    drafts: list[int] | None = None  # a verify step: each row's drafted next token (or -1)
    verified: tuple[torch.Tensor, torch.Tensor] | None = None  # its tokens and acceptance
    proposed: HostCopy | None = None  # an EAGLE-3 draft's proposals for the next step


def _verifies(plan: StepPlan) -> bool:
    """A verify step: every token samples (each sequence's last token and its drafts), at
    least one sequence has drafts, and nobody wants prompt logprobs."""
    return any(s.num_tokens > 1 for s in plan.seqs) and all(
        s.num_sampled == s.num_tokens and s.prompt_logprobs is None for s in plan.seqs)


@dataclass
class StepLogits:
    """What a step's forward pass leaves to sample: one row per sampled position."""

    seq_ids: list[int]  # the sequence of each row
    logits: torch.Tensor | None  # [rows, V]; None when nothing samples
    drafts: list[int]  # each row's drafted next token, or -1
    prompt: dict[int, tuple[PromptRows, list[int]]]  # seq -> its prompt rows and their targets
    batch: FlatBatch | None = None  # the step's flat batch
    rows: list[int] | None = None  # the batch row of each logits row


class Executor:
    def __init__(
        self,
        model: GptOssForCausalLM,
        attention,
        num_groups: int,
        device: torch.device,
        graphs: CudaGraphRunner | None = None,
        pieces: PiecewiseGraphRunner | None = None,
        grammars: GrammarCompiler | None = None,
        peers: Peers | None = None,
        verify: CudaGraphRunner | None = None,
        drafter: Eagle3Drafter | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.model = model
        # Every step runs on this stream (None: the current one), the one the graphs were
        # captured on: a graph replayed on another stream than its capture's ran slower once
        # several graphs existed (bench/results/2026-11-27_session28.md).
        self.stream = stream
        self.drafter = drafter  # an EAGLE-3 draft model, run after each step's sampling
        self.verify = verify  # graphs of verify steps (speculative decoding)
        self.peers = peers  # tensor parallelism: the other ranks, which follow every plan
        self.attention = attention
        self.num_groups = num_groups
        self.device = device
        self.graphs = graphs
        self.pieces = pieces
        self.grammars = grammars
        self.sampler = Sampler(model.kernels.greedy_pick)
        self.states: dict[int, SamplerState] = {}
        # grammar matchers built off the step loop, by sequence, until it is first planned
        self.prebuilt: dict[int, Matcher | ValueError] = {}
        self._last: LaunchedStep | None = None  # the step a chained plan reads its tokens from

    def drop_graphs(self) -> None:
        """Frees the CUDA graphs once no step will run: a tensor-parallel group's NCCL teardown
        waited forever while captured graphs still held its communicator (H200, torch 2.11)."""
        self.graphs = self.pieces = self.verify = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queues the step's forward pass and sampling; nothing here waits for the GPU (prompt
        logprobs excepted). A collective that fails because a worker ended raises which worker
        and why (gloo and NCCL say only that a connection broke)."""
        try:
            with torch.cuda.stream(self.stream):
                return self._launch(plan)
        except GroupError as e:
            lost = self.peers.lost(wait_s=1.0) if self.peers is not None else None
            if lost is None:
                raise
            raise RuntimeError(f"{lost}, so this engine cannot go on ({ENDS})") from e

    @torch.inference_mode()
    def _launch(self, plan: StepPlan) -> LaunchedStep:
        if self.peers is not None:  # the workers queue the same forward pass
            self.peers.send(plan)
        for seq_id in plan.finished:
            self.states.pop(seq_id, None)
        for new in plan.new:
            self.states[new.seq_id] = SamplerState(new, self.device, self.grammars,
                                                   self.prebuilt.pop(new.seq_id, None))
        chained = self._chained_ids(plan)
        out = self.forward(plan, chained)
        prompt = {
            seq_id: self._prompt_logprobs(rows, targets, self.states[seq_id].params)
            for seq_id, (rows, targets) in out.prompt.items()
        }
        if out.logits is None:
            launched = LaunchedStep([], None, None, prompt, [])
        elif any(d >= 0 for d in out.drafts):
            launched = self._verify(out.seq_ids, out.logits, out.drafts, prompt)
        else:
            launched = self._launched(out.seq_ids, out.logits, prompt)
        if chained is None or not any(state.grammar for state, _ in launched.placeholders):
            self._complete(launched)
        if self.drafter is not None and out.logits is not None and any(
                can_speculate(self.states[i].params) for i in out.seq_ids):
            launched.proposed = self._propose(plan, out, launched)
        self._last = launched
        return launched

    @torch.inference_mode()
    def follow(self, plan: StepPlan, group: Group) -> None:
        """A tensor-parallel worker's step: rank 0's chained tokens (if the plan is chained),
        then the forward pass; the logits are rank 0's to sample and are dropped here."""
        with torch.cuda.stream(self.stream):
            ids = None
            if plan.seqs and plan.seqs[0].token_ids is None:
                ids = group.broadcast(torch.empty(len(plan.seqs), dtype=torch.long,
                                                  device=self.device))
            self.forward(plan, ids)

    def forward(self, plan: StepPlan, input_ids: torch.Tensor | None = None) -> StepLogits:
        """The step's forward pass and the logits it needs, in one fixed order: every
        tensor-parallel rank runs this on the same plan, and their collectives meet."""
        batch = build_batch(plan, self.num_groups, self.device, input_ids)
        if self.graphs is not None and plan.is_decode and self.graphs.bucket(len(plan.seqs)):
            logits = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
            n = len(plan.seqs)
            return StepLogits([s.seq_id for s in plan.seqs], logits, [-1] * n, {}, batch,
                              list(range(n)))
        if self.verify is not None and _verifies(plan) and self.verify.bucket(len(batch.positions)):
            logits = self.verify.run(batch.input_ids, batch.positions, batch.meta)
            seq_ids = [s.seq_id for s in plan.seqs for _ in range(s.num_tokens)]
            drafts = [d for s in plan.seqs for d in s.token_ids[1:] + [-1]]
            return StepLogits(seq_ids, logits, drafts, {}, batch, list(range(len(seq_ids))))
        hidden = self._forward(batch)
        out = StepLogits([], None, [], {}, batch)
        rows, offset = [], 0
        for s in plan.seqs:
            if s.prompt_logprobs is not None:
                first, end = s.prompt_logprobs
                index = [offset + p - 1 - s.start for p in range(first, end)]
                out.prompt[s.seq_id] = (self._prompt_rows(hidden[index], s.prompt_targets),
                                        s.prompt_targets)
            for j in range(s.num_tokens - s.num_sampled, s.num_tokens):  # drafts: several
                rows.append(offset + j)
                out.seq_ids.append(s.seq_id)
                out.drafts.append(s.token_ids[j + 1] if j + 1 < s.num_tokens else -1)
            offset += s.num_tokens
        if rows:
            out.logits = self.model.compute_logits(hidden[to_device(torch.tensor(rows),
                                                                    self.device)])
        out.rows = rows
        return out

    def complete(self, launched: LaunchedStep) -> None:
        """Queues the sampling of a launched step (once the matchers hold the previous step's
        tokens); nothing when it is queued already."""
        with torch.cuda.stream(self.stream):
            self._complete(launched)

    def _complete(self, launched: LaunchedStep) -> None:
        if launched.logits is None:
            return
        logits, launched.logits = launched.logits, None
        states = [state for state, _ in launched.placeholders]
        batch = SamplingBatch.build(states, logits.shape[-1], logits.device)
        batch.allowed = self._masks(states)
        out = self.sampler(logits, batch)
        launched.tokens = out.token_ids
        launched.host = HostCopy.start([out.checked, out.logprobs, out.ranks, out.top_ids,
                                        out.top_logprobs])
        for i, (state, _) in enumerate(launched.placeholders):
            launched.placeholders[i] = (state, len(state.output_token_ids))
            state.output_token_ids.append(_PENDING)

    def _masks(self, states: list[SamplerState]) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """The grammar rows of a step: their allowed tokens as bits, on the device."""
        rows = [i for i, state in enumerate(states) if state.grammar is not None]
        if not rows:
            return None
        bits = self.grammars.fill([states[i].grammar for i in rows])
        index = None if len(rows) == len(states) else to_device(torch.tensor(rows), self.device)
        return index, to_device(bits, self.device)

    def _chained_ids(self, plan: StepPlan) -> torch.Tensor | None:
        """A chained plan's input ids: the previous step's sampled tokens, on the device."""
        if not plan.seqs or plan.seqs[0].token_ids is not None:
            return None
        last = self._last
        assert last is not None and last.tokens is not None, "a chained step follows a sample"
        row_of = {seq_id: row for row, seq_id in enumerate(last.seq_ids)}
        rows = [row_of[s.seq_id] for s in plan.seqs]
        if rows == list(range(len(last.seq_ids))):  # the same sequences in the same order
            ids = last.tokens
        else:
            ids = last.tokens.index_select(0, to_device(torch.tensor(rows), last.tokens.device))
        return ids if self.peers is None else self.peers.group.broadcast(ids)

    def _forward(self, batch: FlatBatch) -> torch.Tensor:
        """Hidden states of every token of the batch: piecewise graphs where a size holds it."""
        if self.pieces is not None and self.pieces.bucket(batch.input_ids.shape[0]):
            return self.pieces.run(batch.input_ids, batch.positions, batch.meta)
        self.attention.plan(batch.meta)
        return self.model(batch.input_ids, batch.positions, self.attention)

    def _verify(
        self,
        seq_ids: list[int],
        logits: torch.Tensor,
        drafts: list[int],
        prompt: dict[int, list[TokenLogprob]],
    ) -> LaunchedStep:
        """A step that scores drafted tokens (speculative decoding): which are accepted, and
        the token after them, per row; `result` takes each sequence's run. The step's other
        sequences (one row each: a grammar, logprobs or a seed keep a request from drafting)
        sample their token here under their grammar's mask, with their logprobs."""
        states = [self.states[i] for i in seq_ids]
        batch = SamplingBatch.build(states, logits.shape[-1], logits.device)
        batch.allowed = self._masks(states)
        drafted = to_device(torch.tensor(drafts), self.device)
        tokens, accepted = verify(logits, batch, drafted)
        finite = self.sampler.pick(logits)[1]  # 0 where a row holds a NaN or an infinity
        lps = compute_logprobs(logits, tokens, batch.max_logprobs) if batch.needs_logprobs else ()
        host = HostCopy.start([tokens, finite, accepted, *lps])
        chosen = torch.where(accepted, drafted, tokens)  # the token after each row
        return LaunchedStep(seq_ids, None, host, prompt, [], drafts=drafts,
                            verified=(chosen, accepted))

    def _propose(self, plan: StepPlan, out: StepLogits, launched: LaunchedStep) -> HostCopy:
        """Queues the draft model's proposals for the step's sequences (after its tokens)."""
        if launched.verified is not None:
            chosen, accepted = launched.verified
        else:
            assert launched.tokens is not None, "a drafting step is sampled at launch"
            chosen, accepted = launched.tokens, None
        batch = out.batch
        t = batch.input_ids.shape[0]
        drafts = self.drafter.propose(plan, batch.input_ids, batch.positions,
                                      self.model.aux_hidden[:t], out.rows, chosen, accepted)
        return HostCopy.start([drafts])

    def _launched(
        self, seq_ids: list[int], logits: torch.Tensor, prompt: dict[int, list[TokenLogprob]]
    ) -> LaunchedStep:
        """A step whose forward pass is queued; `complete` samples it."""
        placeholders = [(self.states[i], -1) for i in seq_ids]
        return LaunchedStep(seq_ids, None, None, prompt, placeholders, logits)

    def result(self, launched: LaunchedStep) -> StepResult:
        """Waits for the step's tokens (and logprobs) on the host."""
        out = StepResult(prompt_logprobs=launched.prompt_logprobs)
        for seq_id, lps in launched.prompt_logprobs.items():
            if not all(math.isfinite(e.logprob) for e in lps):
                out.failed.add(seq_id)
        if launched.host is None:
            return out
        if launched.proposed is not None:
            (drafts,) = (t.tolist() for t in launched.proposed.wait())
            ids = list(dict.fromkeys(launched.seq_ids))  # the sampling sequences, in order
            out.drafts = dict(zip(ids, drafts))
        if launched.drafts is not None:
            return self._verified(launched, out)
        (tokens, finite), logprobs, ranks, top_ids, top_lps = (
            None if t is None else t.tolist() for t in launched.host.wait()
        )
        for row, (seq_id, (state, at)) in enumerate(zip(launched.seq_ids, launched.placeholders)):
            state.output_token_ids[at] = tokens[row]
            if state.grammar is not None and (refused := state.grammar.consume(tokens[row])):
                state.error = refused
            if state.error is not None:
                out.errors[seq_id] = state.error
                continue
            if not finite[row]:
                out.failed.add(seq_id)
                continue
            out.sampled[seq_id] = [tokens[row]]
            k = state.params.logprobs
            if k is not None:
                top = list(zip(top_ids[row][:k], top_lps[row][:k])) if k and top_ids else []
                out.logprobs[seq_id] = [TokenLogprob(tokens[row], logprobs[row], top,
                                                     ranks[row])]
        return out

    def _verified(self, launched: LaunchedStep, out: StepResult) -> StepResult:
        """Each sequence of a verify step emits its accepted drafts and one token more (a
        sequence without drafts: its token, through its grammar, with its logprobs)."""
        tokens, finite, accepted, *lps = (t.tolist() for t in launched.host.wait())
        logprobs, ranks, top_ids, top_lps = lps or (None,) * 4
        ids, drafts, row = launched.seq_ids, launched.drafts, 0
        while row < len(ids):
            end = row + 1
            while end < len(ids) and ids[end] == ids[row]:
                end += 1
            seq_id, state = ids[row], self.states[ids[row]]
            if not all(finite[row:end]):
                out.failed.add(seq_id)
                row = end
                continue
            a = next((j for j in range(row, end - 1) if not accepted[j]), end - 1) - row
            emitted = drafts[row : row + a] + [tokens[row + a]]
            state.output_token_ids.extend(emitted)
            for token in emitted if state.grammar is not None else ():
                if state.error is None and (refused := state.grammar.consume(token)):
                    state.error = refused
            if state.error is not None:
                out.errors[seq_id] = state.error
            else:
                out.sampled[seq_id] = emitted
                k = state.params.logprobs
                if k is not None and logprobs is not None:  # one row: it does not draft
                    top = list(zip(top_ids[row][:k], top_lps[row][:k])) if k and top_ids else []
                    out.logprobs[seq_id] = [TokenLogprob(emitted[0], logprobs[row], top,
                                                         ranks[row])]
            row = end
        return out

    def _prompt_rows(self, hidden: torch.Tensor, targets: list[int]) -> PromptRows:
        """The logprob and rank of each of `targets`, each predicted by its row of `hidden`,
        and the row's top MAX_LOGPROBS; the logits made PROMPT_LOGPROB_ROWS rows at a time, so a
        long chunk's never exist whole. Every tensor-parallel rank runs it (the logits gather
        the vocabulary's shards)."""
        ids = torch.tensor(targets, device=hidden.device)
        parts = []
        for i in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            logits = self.model.compute_logits(hidden[i : i + PROMPT_LOGPROB_ROWS])
            k = min(MAX_LOGPROBS, logits.shape[-1])
            parts.append(compute_logprobs(logits, ids[i : i + PROMPT_LOGPROB_ROWS], k))
        return tuple(torch.cat(t) for t in zip(*parts))  # type: ignore[return-value]

    def _prompt_logprobs(
        self, rows: PromptRows, targets: list[int], params: SamplingParams
    ) -> list[TokenLogprob]:
        """`_prompt_rows`'s as TokenLogprobs, with the request's k top entries."""
        k = params.prompt_logprobs
        lp, rank, top_ids, top_lps = (t.tolist() for t in (rows[0], rows[1], rows[2][:, :k],
                                                         rows[3][:, :k]))
        return [
            TokenLogprob(t, lp[j], list(zip(top_ids[j], top_lps[j])), rank[j])
            for j, t in enumerate(targets)
        ]
