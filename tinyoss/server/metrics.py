"""`GET /metrics` through prometheus_client, under vLLM's metric names.

The names (and the `model_name` label on every series) are vLLM's (v1), so that dashboards and
alerts written for a vLLM server work unchanged on tinyoss; metrics that vLLM has no name for
stay under `tinyoss_` names. prometheus_client, not hand-written text: it escapes labels,
formats values, spells counters' `_total` and histograms' `_bucket`/`_sum`/`_count` exactly as
scrapers expect, and speaks whichever exposition format the scraper asks for (Prometheus text
0.0.4 or 1.0.0, OpenMetrics). docs/serve.md lists the mapping.

Engine numbers (queue, prompt tokens, KV usage, preemptions, prefix-cache hits) are the engine
core's totals as of its last step (CoreStats, sent with each step's deltas); a collector turns
them into samples at scrape time. Latencies, generated tokens, token histograms and request
outcomes are recorded by the server as its requests take the outputs in, so that the counter of
generated tokens and the histogram of them count the same tokens: those the answers took (not
those the engine made for a request whose client had left, or past a stop string). The request
phases (queue, prefill, decode) come from the engine core's timestamps, which it sends with a
sequence's deltas. Each app has a registry of its own (never the global one), so several apps
in one process do not clash.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tinyoss.engine.core import STEP_TOKEN_BUCKETS, CoreStats
from tinyoss.engine.output_processor import RequestStateStats

# vLLM's buckets, so heatmaps line up; inter-token latency gains a few finer ones at the bottom
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# vLLM's 1-2-5 series (it stops at max_model_len; gpt-oss's is 131072)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5) if m * 10**e <= 200_000)
_N_BUCKETS = (1, 2, 5, 10, 20)


class _EngineCollector(Collector):
    """The core's latest CoreStats as vLLM's gauges and counters (they are totals already)."""

    def __init__(self, model_name: str, stats: Callable[[], CoreStats | None],
                 restarts: Callable[[], int]) -> None:
        self.model_name, self.stats, self.restarts = model_name, stats, restarts

    def collect(self) -> Iterator[Metric]:
        s = self.stats() or CoreStats()  # no engine yet: nothing ran
        for kind, name, doc, value in (
            (GaugeMetricFamily, "vllm:num_requests_running",
             "Sequences in the running batch (each of a request's n choices counts, as "
             "vLLM v1's child requests do).", s.num_requests_running),
            (GaugeMetricFamily, "vllm:num_requests_waiting",
             "Sequences waiting for a place in the batch (each of a request's n choices).",
             s.num_requests_waiting),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc",
             "KV cache usage: the fraction of blocks held by requests (1 = full).",
             s.kv_cache_usage),
            (CounterMetricFamily, "vllm:num_preemptions",
             "Sequences preempted for lack of KV blocks.", s.num_preemptions),
            (CounterMetricFamily, "vllm:prompt_tokens",
             "Prompt tokens submitted to the engine.", s.prompt_tokens),
            (CounterMetricFamily, "vllm:prefix_cache_queries",
             "Prompt tokens looked up in the prefix cache (every prompt token submitted).",
             s.prompt_tokens),
            (CounterMetricFamily, "vllm:prefix_cache_hits",
             "Prompt tokens found in the prefix cache (counted as requests finish).",
             s.cached_prompt_tokens),
            (CounterMetricFamily, "vllm:spec_decode_num_drafts",
             "Speculative decoding: sequence-steps that verified drafted tokens.", s.spec_drafts),
            (CounterMetricFamily, "vllm:spec_decode_num_draft_tokens",
             "Speculative decoding: tokens drafted.", s.spec_draft_tokens),
            (CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens",
             "Speculative decoding: drafted tokens the model accepted.", s.spec_accepted_tokens),
        ):  # fmt: skip
            family = kind(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        family = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Tokens per engine step: the prompt chunks and "
            "decoded positions it ran through the model.", labels=["model_name"])
        counts = itertools.accumulate(s.step_tokens)
        family.add_metric([self.model_name], sum_value=s.step_tokens_sum, buckets=[
            (floatToGoString(le), n) for le, n in zip((*STEP_TOKEN_BUCKETS, math.inf), counts)])
        yield family
        # the vllm: counters above start again from 0 in a new core; this says when that was
        family = CounterMetricFamily("tinyoss_engine_restarts", "Engine cores started again "
                                     "after one stopped (the engine's counters start again at 0).",
                                     labels=["model_name"])
        family.add_metric([self.model_name], self.restarts())
        yield family


class _LogprobCollector(Collector):
    """The logprob budget (--max-logprob-memory): what requests hold or have reserved, and the
    whole of it, read at scrape time."""

    def __init__(self, model_name: str, budget: Callable[[], tuple[int, int]]) -> None:
        self.model_name, self.budget = model_name, budget

    def collect(self) -> Iterator[Metric]:
        used, total = self.budget()
        for name, doc, value in (
            ("tinyoss_logprob_memory_used_bytes",
             "Logprob memory that requests in progress hold or have reserved.", used),
            ("tinyoss_logprob_memory_limit_bytes",
             "Logprob memory all requests together may hold (--max-logprob-memory).", total),
        ):  # fmt: skip
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class Metrics:
    """One app's metrics; the server side is touched only from the event loop."""

    def __init__(self, model_name: str, stats: Callable[[], CoreStats | None],
                 logprob_budget: Callable[[], tuple[int, int]] | None = None,
                 restarts: Callable[[], int] = lambda: 0) -> None:
        """`logprob_budget`: (bytes used, bytes in all) of the logprob budget, if any;
        `restarts`: how many times the engine core was started again."""
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(model_name, stats, restarts))
        if logprob_budget is not None:
            r.register(_LogprobCollector(model_name, logprob_budget))
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token (one sample per "
            "request, whatever n).",
            _TTFT_BUCKETS,
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Time between successive outputs of one request.",
            _ITL_BUCKETS,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Time from a request's arrival to its end, its last choice's (one sample per "
            "request, whatever n).",
            _E2E_BUCKETS,
        )
        self.prompt_tokens = hist(
            "vllm:request_prompt_tokens",
            "Prompt tokens of each request (one sample per request, whatever n).",
            _TOKEN_BUCKETS,
        )
        self.generated = counter(
            "vllm:generation_tokens",
            "Tokens generated that answers took in (what vllm:request_generation_tokens sums "
            "up, counted as they come).",
        )
        self.generation_tokens = hist(
            "vllm:request_generation_tokens",
            "Tokens generated for each request, all its choices together (one sample per "
            "request, whatever n).",
            _TOKEN_BUCKETS,
        )
        # vLLM's request phases, from the engine core's timestamps (RequestStateStats): queue
        # + prefill is about the TTFT, queue + inference about the end-to-end latency
        self.queue_time, self.prefill_time, self.decode_time, self.inference_time = (
            hist(f"vllm:request_{name}_time_seconds", doc, _E2E_BUCKETS) for name, doc in (
                ("queue", "Time a request waited in the engine's queue: from the engine "
                 "taking it to its first scheduling (one sample per request that got a token "
                 "or prompt logprobs, whatever n; as in vLLM, none for one aborted before)."),
                ("prefill", "Time a request spent in prefill: from its first scheduling to "
                 "its first token (one sample per request that got one, whatever n)."),
                ("decode", "Time a request spent in decode: from its first token to its last "
                 "(one sample per request that got a token, whatever n)."),
                ("inference", "Time a request spent running: from its first scheduling to its "
                 "last token, prefill and decode (one sample per request that got a token, "
                 "whatever n)."),
            )
        )  # fmt: skip
        self.params_n = hist("vllm:request_params_n", "The n request parameter (one sample "
                             "per request).", _N_BUCKETS)
        self.params_max_tokens = hist(
            "vllm:request_params_max_tokens",
            "The max_tokens request parameter, or the context the prompt leaves where that is "
            "less or none was given (one sample per request).",
            _TOKEN_BUCKETS,
        )
        self.max_generation_tokens = hist(
            "vllm:request_max_num_generation_tokens",
            "The most tokens one of a request's n choices generated (one sample per request).",
            _TOKEN_BUCKETS,
        )
        self._success = Counter(
            "vllm:request_success",
            "Requests ended (one per choice), by finish reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        for reason in ("stop", "length", "abort", "error"):  # tinyoss's; at 0 from the start
            self._success.labels(model_name, reason)
        self.model_name = model_name
        # tinyoss's own: whole API requests (vLLM has no such count)
        self.finished = counter("tinyoss_requests_finished", "API requests answered in full.")
        self.aborted = counter(
            "tinyoss_requests_aborted", "API requests cut short (client gone, engine error)."
        )
        self._responses = Counter(
            "tinyoss_http_responses", "API responses (/v1, /tokenize, /detokenize) by HTTP "
            "status: 429 turned away at capacity, 4xx refused, 5xx failed (a stream counts its "
            "200 when it starts).",
            [*labels, "status"], registry=r,
        )

    def responded(self, status: int) -> None:
        self._responses.labels(self.model_name, str(status)).inc()

    def request_ended(self, finish_reasons: Sequence[str | None], choice_tokens: Sequence[int],
                      seconds: float, prompt_tokens: int, max_tokens: int,
                      times: RequestStateStats | None) -> None:
        """One request's (one prompt's) end, its `n` choices together: each histogram counts
        requests, as the TTFT does, so their counts agree; `finish_reasons` as the API gave
        them (None: cut short) count one per choice, as vLLM's request_success does.
        `choice_tokens`: the tokens each choice took; `max_tokens`: the most it could take;
        `times`: the engine's timestamps of it (None: it never reached the engine)."""
        for finish_reason in finish_reasons:
            # vLLM's engine-level reasons: a tool call is a stop; an unfinished choice an abort
            reason = {None: "abort", "tool_calls": "stop"}.get(finish_reason, finish_reason)
            self._success.labels(self.model_name, reason).inc()
        self.e2e.observe(seconds)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(sum(choice_tokens))
        self.max_generation_tokens.observe(max(choice_tokens))
        self.params_n.observe(len(choice_tokens))
        self.params_max_tokens.observe(max_tokens)
        if times is None or times.scheduled_ts is None:  # never scheduled: no phase began
            return
        self.queue_time.observe(times.scheduled_ts - times.queued_ts)
        if times.first_token_ts is not None:  # as vLLM: no token, no prefill (or later) time
            self.prefill_time.observe(times.first_token_ts - times.scheduled_ts)
            self.decode_time.observe(times.last_token_ts - times.first_token_ts)
            self.inference_time.observe(times.last_token_ts - times.scheduled_ts)

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition in the format `accept` (the scraper's Accept header) asks for, and its
        content type; a header that names no version tinyoss can read gets the text format."""
        try:
            encoder, content_type = choose_encoder(accept or "")
        except TypeError:  # prometheus_client (0.26) on a version it cannot compare ("abc")
            encoder, content_type = choose_encoder("")  # the format of a scraper that asks none
        if content_type.startswith("application/openmetrics-text"):
            # prometheus_client (0.26) escapes the colons of the samples' names ("vllm:x" ->
            # "vllm_x") but not of their HELP and TYPE lines, so neither vLLM's dashboards nor
            # a strict parser find them. Colons are valid in legacy metric names, so the
            # unescaped text is also what `escaping=underscores` asks for.
            version = content_type.partition("version=")[2].partition(";")[0] or "1.0.0"
            encoder = partial(openmetrics.generate_latest, escaping=openmetrics.ALLOWUTF8,
                              version=version)
        return encoder(self.registry), content_type
