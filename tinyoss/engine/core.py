"""The engine core: requests of token ids in, per-step deltas out.

request -> scheduler -> step plan -> executor -> model -> sampler -> deltas. One `step()` runs
one forward pass for everything the scheduler picked and returns what each sequence gained in
it: new token ids, their logprobs, and a finish reason once it ends. Text is the front end's
business (`output_processor.py`), so nothing here costs more as an output grows.

With async scheduling (the default) a decode step is launched before the previous one's tokens
reach the host (`Scheduler.chain`); the host handles the previous step's results while the GPU
runs. A sequence that stopped meanwhile has its extra token dropped.

Faults of one request stay with that request: a step that runs out of memory while it holds a
prefill chunk fails the request of the largest chunk (the rest of the step is undone and runs
again), and a sequence whose logits are not finite fails its request. Either ends with a delta
carrying `error`; every other request goes on. Any other exception is the engine's own and
propagates (the server then restarts the core).
"""

from __future__ import annotations

import bisect
import itertools
import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from tinyoss.engine.executor import Executor, LaunchedStep
from tinyoss.engine.grammar import Matcher
from tinyoss.engine.scheduler import Scheduler
from tinyoss.engine.sequence import Sequence
from tinyoss.engine.speculative import Proposer, can_speculate
from tinyoss.engine.step import StepPlan, TokenLogprob
from tinyoss.sampling_params import SamplingParams

log = logging.getLogger("tinyoss.engine")


@dataclass
class EngineInfo:
    """What a front end needs to know of a built engine (plain data)."""

    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_kv_blocks: int
    block_size: int
    summary: str  # one line: device, dtype, backends, graphs, cache


@dataclass
class CoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class SeqDelta:
    """What one sequence gained in a step."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0
    error: RequestError | None = None  # why the request failed (finish_reason "error")
    # (queued, first scheduled) on the core's clock, on the sequence's first delta only
    times: tuple[float, float] | None = None


@dataclass(frozen=True)
class RequestError:
    """A fault of one request: `code` is "out_of_memory", "non_finite_logits",
    "invalid_grammar" (the request's grammar cannot be built or followed: its fault) or
    "structured_output" (the output left its grammar: the engine's)."""

    code: str
    message: str


def is_out_of_memory(e: BaseException) -> bool:
    """Device or host memory ran out (torch raises a plain RuntimeError for the host)."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
    )


# vLLM's buckets of vllm:iteration_tokens_total, the tokens of each engine step
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class CoreStats:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_prompt_tokens: int = 0
    finished_requests: int = 0
    num_preemptions: int = 0
    spec_drafts: int = 0  # speculative decoding: sequence-steps that verified drafts,
    spec_draft_tokens: int = 0  # the tokens drafted in them,
    spec_accepted_tokens: int = 0  # and those the target accepted
    # steps by the tokens they ran through the model (prefill chunks and decoded positions),
    # one count per STEP_TOKEN_BUCKETS bucket (the first whose bound holds it; the last: more),
    # and all those tokens: a histogram kept here, one increment a step
    step_tokens: list[int] = field(default_factory=lambda: [0] * (len(STEP_TOKEN_BUCKETS) + 1))
    step_tokens_sum: int = 0


def truncate_prompt(prompt_token_ids: list[int], params: SamplingParams,
                    max_model_len: int, side: str = "left") -> list[int]:
    """The prompt as the engine takes it: its last `truncate_prompt_tokens` tokens when that
    is set (vLLM's left truncation; -1: the longest tail that leaves room for max_tokens, or
    for one token without it), else whole. `side` "right" (vLLM's truncation_side) keeps the
    first tokens instead; cutting a prompt already cut changes nothing either way."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return prompt_token_ids
    if keep == -1:
        keep = max_model_len - (params.max_tokens or 1)
        if keep < 1:
            raise ValueError(f"truncate_prompt_tokens=-1 keeps max_model_len - max_tokens "
                             f"prompt tokens, and max_tokens={params.max_tokens} leaves none "
                             f"(max_model_len is {max_model_len})")
    elif keep >= max_model_len:
        raise ValueError(f"truncate_prompt_tokens={keep} is not below max_model_len "
                         f"({max_model_len}): keep fewer tokens, so that one can be generated")
    return prompt_token_ids[:keep] if side == "right" else prompt_token_ids[-keep:]


def check_prompt(
    prompt_token_ids: list[int], params: SamplingParams, info: EngineInfo
) -> int:
    """Validates a prompt for this engine; returns the request's effective max_tokens."""
    ids = prompt_token_ids
    if not ids:
        raise ValueError("prompt is empty: give at least one token")
    vocab = info.vocab_size
    # C loops (set, map, min, max): this runs on every request's every prompt token
    if set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= vocab:
        bad = next(t for t in ids if type(t) is not int or not 0 <= t < vocab)
        raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
    for name in ("logit_bias", "allowed_token_ids"):  # they index the sampler's logits
        bad = [t for t in getattr(params, name) or () if t >= vocab]
        if bad:
            raise ValueError(f"{name} names token id {bad[0]}, outside the vocabulary "
                             f"[0, {vocab})")
    if len(ids) >= info.max_model_len:
        raise ValueError(
            f"prompt is {len(ids)} tokens long, but max_model_len is "
            f"{info.max_model_len} (prompt plus at least one generated token)"
        )
    room = info.max_model_len - len(ids)
    return room if params.max_tokens is None else min(params.max_tokens, room)


class EngineCore:
    def __init__(self, info: EngineInfo, scheduler: Scheduler, executor: Executor) -> None:
        self.info = info
        self.scheduler = scheduler
        self.executor = executor
        self.async_scheduling = True
        self.requests: dict[str, list[Sequence]] = {}
        self.stats = CoreStats()
        self._seq_ids = itertools.count()
        self._seqs: dict[int, Sequence] = {}
        self._in_flight: tuple[StepPlan, LaunchedStep] | None = None
        # requests whose grammar matcher is being built, off the step loop (`_admit_built`)
        self._building: list[tuple[Future, list[Sequence]]] = []
        self._grammar_pool: ThreadPoolExecutor | None = None
        # speculative decoding: drafts up to `num_speculative_tokens` tokens a step, from a
        # proposer on the host (n-gram lookup) or from the executor's draft model, which
        # returns each sequence's drafts with its step's results (`drafted`)
        self.proposer: Proposer | None = None
        self.num_speculative_tokens = 0
        self.drafted: dict[int, list[int]] = {}

    # -- requests ---------------------------------------------------------------------------
    def add(self, request: CoreRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        max_tokens = check_prompt(request.prompt_token_ids, request.params, self.info)
        num_groups = len(self.scheduler.kv.windows)
        seqs = [
            Sequence(
                next(self._seq_ids),
                request.request_id,
                i,
                request.prompt_token_ids,
                request.params,
                max_tokens,
                num_groups,
                self.info.eos_token_ids,
            )
            for i in range(request.params.n)
        ]
        self.requests[request.request_id] = seqs
        for seq in seqs:
            self._seqs[seq.seq_id] = seq
        spec, grammars = request.params.structured_outputs, self.executor.grammars
        if spec is not None and grammars is not None:
            if self._grammar_pool is None:
                self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="tinyoss-grammar")
            self._building.append((self._grammar_pool.submit(grammars.matcher, spec), seqs))
        else:
            for seq in seqs:
                self.scheduler.add(seq)
        self.stats.prompt_tokens += len(request.prompt_token_ids)

    def _admit_built(self) -> None:
        """Requests whose grammar matcher is built join the scheduler, the matchers (or why
        none could be built) handed to the executor. A large grammar takes seconds to build
        (64,000 choices: ~1.8 s), which the step loop, and every stream in it, had waited for;
        a worker thread builds it now (llguidance releases the GIL). With nothing else to run,
        this waits a little for a build rather than spin."""
        if not self._building:
            return
        if self._in_flight is None and not self.scheduler.running and not self.scheduler.waiting:
            wait([f for f, _ in self._building], timeout=0.01, return_when=FIRST_COMPLETED)
        building = []
        for future, seqs in self._building:
            if not future.done():
                building.append((future, seqs))
                continue
            try:
                built: Matcher | ValueError = future.result()
            except ValueError as e:
                built = e
            for i, seq in enumerate(seqs):
                if seq.finished:  # aborted while its grammar was built
                    continue
                mine = built.copy() if i and isinstance(built, Matcher) else built
                self.executor.prebuilt[seq.seq_id] = mine
                self.scheduler.add(seq)
        self._building = building

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Stops a request (or one of its sequences) now and frees its blocks; False if it is
        unknown or already done."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return False
        for seq in seqs:
            if (index is None or seq.index == index) and not seq.finished:
                seq.finish("abort")
                self._drop(seq)
        self._retire(request_id)
        return True

    def prompt_progress(self, request_id: str) -> tuple[int, int] | None:
        """(prompt tokens prefilled or under way, prompt tokens) of a request, for a progress
        bar; None once it is done (or unknown). With n > 1 one sequence computes the prompt
        while the others wait to share it: the furthest one tells."""
        seqs = self.requests.get(request_id)
        if not seqs:
            return None
        return max(s.num_computed for s in seqs), seqs[0].num_prompt

    def has_work(self) -> bool:
        return bool(self.requests) or self._in_flight is not None

    def current_stats(self) -> CoreStats:
        """Running and waiting count sequences, as vLLM v1 counts the n child requests it makes
        of a request with n > 1 (a request with its grammar still being built waits)."""
        s, running = self.stats, len(self.scheduler.running)
        s.num_requests_running = running
        s.num_requests_waiting = len(self._seqs) - running
        s.kv_cache_usage = self.scheduler.kv.usage()
        s.num_preemptions = self.scheduler.num_preemptions
        return s

    # -- stepping ---------------------------------------------------------------------------
    def step(self) -> list[SeqDelta]:
        """Takes the results of one step (launching it first unless it already runs) and
        returns what changed; with async scheduling the next step is launched before those
        results are read."""
        self._admit_built()
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            if self.num_speculative_tokens:
                self._propose()
            plan = self.scheduler.schedule()
            if plan is None:
                return []
            try:
                launched = (plan, self.executor.launch(plan))
            except Exception as e:
                # with tensor parallelism the workers ran the step: no undoing it on rank 0
                if not is_out_of_memory(e) or self.executor.peers is not None:
                    raise
                return self._out_of_memory(plan, e)
        chaining = self.async_scheduling and (  # drafts need the previous tokens on the host
            not self.num_speculative_tokens
            or not any(can_speculate(s.params) for s in self.scheduler.running)
        )
        if chaining and launched[1].tokens is not None:
            chained = self.scheduler.chain(launched[0])
            if chained is not None:
                self._in_flight = (chained, self.executor.launch(chained))
        deltas = self._finish(*launched)
        if self._in_flight is not None:  # its grammar masks needed the tokens just read
            self.executor.complete(self._in_flight[1])
        return deltas

    def close(self) -> None:
        """Stops the grammar builds under way and the tensor-parallel workers, if any."""
        if self._grammar_pool is not None:
            self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        if self.executor.peers is not None:
            self.executor.drop_graphs()
            self.executor.peers.close()
            self.executor.peers = None

    def _propose(self) -> None:
        """Drafts for every decoding sequence that can take them, within its limits."""
        k, max_len = self.num_speculative_tokens, self.info.max_model_len
        for seq in self.scheduler.running:
            if seq.num_tokens - seq.num_computed != 1 or not can_speculate(seq.params):
                continue
            room = min(k, seq.max_tokens - seq.num_output - 1, max_len - len(seq.token_ids) - 1)
            if self.proposer is None:
                seq.draft = self.drafted.pop(seq.seq_id, [])[: max(0, room)]
            else:
                seq.draft = self.proposer.propose(seq.token_ids, seq.num_prompt, room)

    def _finish(self, plan: StepPlan, launched: LaunchedStep) -> list[SeqDelta]:
        result = self.executor.result(launched)
        ran = plan.num_tokens
        self.stats.step_tokens[bisect.bisect_left(STEP_TOKEN_BUCKETS, ran)] += 1
        self.stats.step_tokens_sum += ran
        self.drafted.update(result.drafts)
        max_len = self.info.max_model_len
        deltas = []
        for item in plan.seqs:
            seq = self._seqs.get(item.seq_id)
            if seq is None or seq.finished:  # stopped or aborted meanwhile: its token is dropped
                continue
            if item.seq_id in result.errors:
                error = RequestError(*result.errors[item.seq_id])
                deltas += self._fail(seq.request_id, error)
                continue
            if item.seq_id in result.failed:
                why = "the model's logits for this request were not finite (NaN or Inf)"
                deltas += self._fail(seq.request_id, RequestError("non_finite_logits", why))
                continue
            tokens = result.sampled.get(item.seq_id, [])
            prompt_lps = result.prompt_logprobs.get(item.seq_id)
            for i, token in enumerate(tokens):
                seq.append(token, max_len)
                if seq.finished:  # a stop among accepted drafts: the rest never happened
                    tokens = tokens[: i + 1]
                    break
            if tokens or prompt_lps:
                self.stats.generation_tokens += len(tokens)
                lps = result.logprobs.get(item.seq_id)
                deltas.append(
                    SeqDelta(
                        seq.request_id,
                        seq.index,
                        tokens,
                        lps,
                        prompt_lps,
                        seq.finish_reason,
                        seq.stop_reason,
                        seq.num_cached_prompt,
                        times=seq.first_times(),
                    )
                )
            if item.num_sampled > 1 and tokens:  # drafts verified
                self.stats.spec_drafts += 1
                self.stats.spec_draft_tokens += item.num_sampled - 1
                self.stats.spec_accepted_tokens += len(tokens) - 1
            if seq.finished:
                self._drop(seq)
                self._retire(seq.request_id)
            else:
                self.scheduler.stepped(seq, rejected=max(0, item.num_sampled - len(tokens)))
        return deltas

    def _out_of_memory(self, plan: StepPlan, e: BaseException) -> list[SeqDelta]:
        """A step that ran out of memory at launch: undone; the request of its largest prefill
        chunk fails (a step of decodes alone is not one request's fault: `e` propagates)."""
        culprit = max(plan.seqs, key=lambda s: s.num_tokens)
        if culprit.num_tokens == 1:
            raise e
        self.scheduler.undo(plan, [self._seqs[s.seq_id] for s in plan.seqs])
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        seq = self._seqs[culprit.seq_id]
        why = (
            f"out of memory while computing {culprit.num_tokens} tokens of this request's "
            f"prompt ({type(e).__name__}); retry with a shorter prompt, or start the engine "
            "with a smaller --max-num-batched-tokens"
        )
        log.warning("request %s failed: %s", seq.request_id, why)
        return self._fail(seq.request_id, RequestError("out_of_memory", why))

    def _fail(self, request_id: str, error: RequestError) -> list[SeqDelta]:
        """Ends every unfinished sequence of a request with `error` and frees its blocks."""
        deltas = []
        for seq in self.requests.get(request_id, ()):
            if not seq.finished:
                seq.finish("error")
                self._drop(seq)
                deltas.append(SeqDelta(request_id, seq.index, [], finish_reason="error",
                                       error=error, times=seq.first_times()))  # fmt: skip
        self._retire(request_id)
        return deltas

    def _drop(self, seq: Sequence) -> None:
        self.drafted.pop(seq.seq_id, None)
        self.executor.prebuilt.pop(seq.seq_id, None)
        self.scheduler.remove(seq)
        del self._seqs[seq.seq_id]

    def _retire(self, request_id: str) -> None:
        seqs = self.requests[request_id]
        if all(s.finished for s in seqs):
            del self.requests[request_id]
            self.stats.finished_requests += 1
            self.stats.cached_prompt_tokens += min(s.num_cached_prompt for s in seqs)
