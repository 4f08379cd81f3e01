"""`GET /metrics` in the Prometheus text format (version 0.0.4), written by hand.

Engine numbers (queue, tokens, KV usage, preemptions, prefix-cache hits) are the engine core's,
sent with each step's deltas; latencies and request outcomes are recorded by the server as outputs reach it. Twenty
lines of formatting do not justify a dependency on prometheus_client.
"""

from __future__ import annotations

import bisect

from tinyoss.engine.core import CoreStats

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
_ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class Histogram:
    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip((*self.buckets, "+Inf"), self.counts):
            total += count
            out.append(f'{self.name}_bucket{{le="{bound}"}} {total}')
        return out + [f"{self.name}_sum {self.sum}", f"{self.name}_count {total}"]


class Metrics:
    """Server-side counters and histograms; touched only from the event loop."""

    def __init__(self) -> None:
        self.finished = 0
        self.aborted = 0
        self.ttft = Histogram(
            "tinyoss_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            _TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "tinyoss_inter_token_latency_seconds",
            "Time between successive outputs of one request.",
            _ITL_BUCKETS,
        )

    def render(self, stats: CoreStats | None) -> str:
        values: dict[str, float] = {
            "requests_finished_total": self.finished,
            "requests_aborted_total": self.aborted,
        }
        if stats is not None:  # the core's, as of its last step
            values |= {
                "num_requests_running": stats.num_requests_running,
                "num_requests_waiting": stats.num_requests_waiting,
                "kv_cache_usage_ratio": stats.kv_cache_usage,
                "prompt_tokens_total": stats.prompt_tokens,
                "generation_tokens_total": stats.generation_tokens,
                "prefix_cache_hit_tokens_total": stats.cached_prompt_tokens,
                "num_preemptions_total": stats.num_preemptions,
            }
        out = []
        for name, value in values.items():
            kind = "counter" if name.endswith("_total") else "gauge"
            name = "tinyoss_" + name
            out += [f"# HELP {name} {_DOCS[name]}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(out + self.ttft.lines() + self.itl.lines()) + "\n"


_DOCS = {
    "tinyoss_requests_finished_total": "Requests answered in full.",
    "tinyoss_requests_aborted_total": "Requests cut short (client gone, engine error).",
    "tinyoss_num_requests_running": "Requests in the running batch.",
    "tinyoss_num_requests_waiting": "Requests waiting for a place in the batch.",
    "tinyoss_kv_cache_usage_ratio": "Fraction of KV cache blocks held by requests.",
    "tinyoss_prompt_tokens_total": "Prompt tokens submitted.",
    "tinyoss_generation_tokens_total": "Tokens generated.",
    "tinyoss_prefix_cache_hit_tokens_total": "Prompt tokens of finished requests found cached.",
    "tinyoss_num_preemptions_total": "Sequences preempted for lack of KV blocks.",
}
