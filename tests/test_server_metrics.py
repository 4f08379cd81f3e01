"""GET /metrics under vLLM's names: after known requests on the tiny server, the exposition
(parsed by prometheus_client's own parser) has every vLLM metric with the `model_name` label,
its counters equal what the responses' usage said, and its histograms counted each request
once, whatever its n."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client.openmetrics import parser as openmetrics_parser
from prometheus_client.parser import text_string_to_metric_families

from tests.core_hooks import SLOW, WEATHER
from tests.test_server import KEY, TINY, TOOLS, Served, environ, wait_healthy
from tinyoss.engine.core_process import HOOK_ENV
from tinyoss.server.app import create_app
from tinyoss.server.metrics import Metrics

NAME = "served-tiny"  # a served name other than the model's: the label must carry this one
HEADERS = {"Authorization": f"Bearer {KEY}"}

VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
VLLM_COUNTERS = (
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
)
PHASES = (
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
)
PARAMS = (
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:request_max_num_generation_tokens",
)
VLLM_HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    *PHASES,
    *PARAMS,
)


def _scripted_server(tmp_path_factory, config) -> Iterator[Served]:
    """A server of `config` on the scripted hook (tests/core_hooks.py): WEATHER makes a tool
    call, SLOW slows each step."""
    prompts = tmp_path_factory.mktemp("metrics") / "prompts.jsonl"
    prompts.touch()
    with environ(**{HOOK_ENV: "tests.core_hooks:scripted", "TINYOSS_TEST_PROMPTS": str(prompts)}):
        app = create_app(config, model_name=NAME, api_key=KEY)
        served = Served(app)
        wait_healthy(served)
        served.client = app.state.server.client
        yield served
        served.close()


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    yield from _scripted_server(tmp_path_factory, TINY)


def scrape(srv, accept: str | None = None) -> tuple[dict, str]:
    """{family name: family} and the content type."""
    r = httpx.get(srv.url + "/metrics", headers={"Accept": accept} if accept else {})
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}, r.headers["content-type"]


def value(families: dict, family: str, sample: str, **labels: str) -> float:
    found = [
        s.value
        for s in families[family].samples
        if s.name == sample and s.labels == {"model_name": NAME, **labels}
    ]
    assert len(found) == 1, (sample, labels, families[family].samples)
    return found[0]


def post(srv, path: str, body: dict) -> dict:
    r = httpx.post(srv.url + path, json={"model": NAME, **body}, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(srv) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = srv.client.stats
        if not (s.num_requests_running or s.num_requests_waiting) and s.kv_cache_usage == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"not idle: {srv.client.stats}")


def test_vllm_metrics_count_what_was_served(srv):
    before, content_type = scrape(srv)
    assert content_type.startswith("text/plain; version=0.0.4")
    for name in VLLM_GAUGES + VLLM_COUNTERS + VLLM_HISTOGRAMS:
        assert name in before, name
    assert before["vllm:kv_cache_usage_perc"].type == "gauge"
    assert before["vllm:prompt_tokens"].type == "counter"
    assert before["vllm:e2e_request_latency_seconds"].type == "histogram"

    full = {"ignore_eos": True}  # every request runs to its max_tokens
    answers = [
        post(srv, "/v1/completions", {"prompt": "count me", "max_tokens": 4, **full}),
        post(srv, "/v1/completions", {"prompt": "count me too, please", "max_tokens": 7, **full}),
        post(srv, "/v1/completions", {"prompt": "two of them", "max_tokens": 3, "n": 2, **full}),
        post(
            srv,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **full},
        ),  # fmt: skip
    ]
    wait_idle(srv)
    after, _ = scrape(srv)

    def delta(family: str, sample: str, **labels: str) -> float:
        return value(after, family, sample, **labels) - value(before, family, sample, **labels)

    prompt = sum(a["usage"]["prompt_tokens"] for a in answers)
    generated = sum(a["usage"]["completion_tokens"] for a in answers)
    assert generated == 4 + 7 + 2 * 3 + 5  # ignore_eos: every request ran to max_tokens
    assert delta("vllm:prompt_tokens", "vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") == generated
    assert delta("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == prompt
    cached = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
    assert delta("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == cached

    reasons: dict[str, int] = {}
    for a in answers:
        for c in a["choices"]:
            reasons[c["finish_reason"]] = reasons.get(c["finish_reason"], 0) + 1
    assert reasons == {"length": 5}
    for reason in ("stop", "length", "abort", "error"):  # each there, at 0 until it happens
        got = delta("vllm:request_success", "vllm:request_success_total", finished_reason=reason)
        assert got == reasons.get(reason, 0), reason

    # a request is a prompt, whatever its n (as vLLM's v0 engine counted latencies; v1 counts
    # each of n choices as a request of its own): each histogram has one sample per request,
    # so the counts agree; the n=2 request's generation tokens are its two choices' together
    for h in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert delta(h, h + "_count") == 4, h
        assert delta(h, h + "_bucket", le="+Inf") == 4, h
    h = "vllm:e2e_request_latency_seconds"
    assert delta(h, h + "_sum") > 0
    h = "vllm:inter_token_latency_seconds"
    # one per engine output after a prompt's first (its n choices come together), at most one
    # per token: (4-1) + (7-1) + (3-1) + (5-1) when every step's output is read on its own
    assert 0 < delta(h, h + "_count") <= 15
    h = "vllm:request_prompt_tokens"
    assert delta(h, h + "_sum") == prompt
    h = "vllm:request_generation_tokens"
    assert delta(h, h + "_sum") == generated
    assert delta(h, h + "_bucket", le="5.0") == 2  # 4 and 5 tokens; not the 7, nor the 3 + 3

    for name in VLLM_GAUGES:
        assert value(after, name, name) == 0
    assert delta("vllm:num_preemptions", "vllm:num_preemptions_total") == 0
    # tinyoss's own, under tinyoss names, labelled as well
    assert delta("tinyoss_requests_finished", "tinyoss_requests_finished_total") == 4
    assert delta("tinyoss_requests_aborted", "tinyoss_requests_aborted_total") == 0


# What Prometheus 2.x sends by default
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


@pytest.mark.parametrize("accept", [PROMETHEUS_ACCEPT, "application/openmetrics-text",
                                    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8"])
def test_openmetrics_scrape_keeps_vllm_names(srv, accept):
    """OpenMetrics, parsed strictly: the samples keep vLLM's names (colons and all), as their
    HELP and TYPE lines do, so vLLM's dashboards find them."""
    r = httpx.get(srv.url + "/metrics", headers={"Accept": accept})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    families = {f.name: f for f in openmetrics_parser.text_string_to_metric_families(r.text)}
    assert value(families, "vllm:num_requests_running", "vllm:num_requests_running") == 0
    names = {s.name for s in families["vllm:request_success"].samples}
    assert "vllm:request_success_total" in names
    assert "vllm_request_success_total" not in r.text


@pytest.mark.parametrize("accept", ["application/openmetrics-text; version=abc",
                                    "application/openmetrics-text;version=1.0.x",
                                    "text/plain; version=1.a"])
def test_an_unreadable_format_version_gets_the_text_format(accept):
    """A version prometheus_client cannot compare had raised a TypeError: a 500 and a traceback
    in the server's log for each scrape of a misconfigured scraper."""
    body, content_type = Metrics(NAME, lambda: None).render(accept)
    assert content_type.startswith("text/plain; version=0.0.4")
    assert "vllm:num_requests_running" in {f.name for f in
                                          text_string_to_metric_families(body.decode())}


def test_scraper_gets_the_format_it_asks_for(srv):
    families, content_type = scrape(srv)
    assert content_type.startswith("text/plain")
    assert value(families, "vllm:num_requests_running", "vllm:num_requests_running") == 0


def test_responses_by_status_and_engine_restarts(srv):
    """An operator's error-rate and load-shedding alerts read the API's responses by status
    (429s, turned away at capacity, had been in no metric); restarts of the core, after which
    the vllm: counters start again at 0, are counted."""
    before, _ = scrape(srv)
    post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    for body, status in (({"model": "gpt-5", "prompt": "x"}, 404), ({"prompt": 5}, 400)):
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, **body},
                       headers=HEADERS, timeout=60)
        assert r.status_code == status, r.text
    after, _ = scrape(srv)

    def delta(status: str) -> float:
        family = "tinyoss_http_responses"
        get = (lambda f: value(f, family, family + "_total", status=status)
               if any(x.labels.get("status") == status for x in f[family].samples) else 0)
        return get(after) - get(before)

    assert (delta("200"), delta("404"), delta("400")) == (1, 1, 1)
    restarts = "tinyoss_engine_restarts"
    assert value(after, restarts, restarts + "_total") == srv.client.restarts


def test_tool_call_counts_as_stop_and_a_client_gone_as_abort(srv, caplog):
    caplog.set_level("INFO", logger="tinyoss.server")
    before, _ = scrape(srv)
    messages = [{"role": "user", "content": WEATHER}]
    answer = post(srv, "/v1/chat/completions", {"messages": messages, "tools": TOOLS})
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    body = {"model": NAME, "prompt": SLOW, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=HEADERS) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        next(lines), next(lines)  # a few tokens in, the client leaves
    wait_idle(srv)
    deadline = time.monotonic() + 10  # the server records the abort as the stream closes
    while True:
        after, _ = scrape(srv)
        aborted = "tinyoss_requests_aborted"
        if value(after, aborted, aborted + "_total") > value(before, aborted, aborted + "_total"):
            break
        assert time.monotonic() < deadline, "the disconnect was never counted"
        time.sleep(0.05)

    def delta(family: str, sample: str, **labels: str) -> float:
        return value(after, family, sample, **labels) - value(before, family, sample, **labels)

    success = "vllm:request_success", "vllm:request_success_total"
    assert delta(*success, finished_reason="stop") == 1  # the tool call: vLLM's engine says stop
    assert delta(*success, finished_reason="abort") == 1
    for reason in ("length", "error"):
        assert delta(*success, finished_reason=reason) == 0
    assert delta("tinyoss_requests_aborted", "tinyoss_requests_aborted_total") == 1
    assert delta("tinyoss_requests_finished", "tinyoss_requests_finished_total") == 1
    # one log line names it, as vLLM's "Aborted request" does
    assert any(m.startswith("aborted request cmpl-") and m.endswith(": its client left")
               for m in caplog.messages), caplog.messages
    h = "vllm:e2e_request_latency_seconds"
    assert delta(h, h + "_count") == 2
    h = "vllm:request_generation_tokens"
    assert delta(h, h + "_count") == 2
    generated = delta("vllm:generation_tokens", "vllm:generation_tokens_total")
    # the aborted stream's tokens count as generated, as in vLLM: more than the tool call's
    assert generated > answer["usage"]["completion_tokens"]
    # those its answer took, as the histogram counts them, not those made after it was gone
    assert generated == delta(h, h + "_sum")


def test_running_counts_each_of_n_choices(srv):
    """vLLM v1 runs a request of n choices as n child requests, and its gauges count each;
    tinyoss's count each sequence too (they had counted the request once)."""
    body = {"model": NAME, "prompt": SLOW, "max_tokens": 400, "n": 3, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=HEADERS) as r:
        assert next(r.iter_lines()).startswith("data: ")
        deadline = time.monotonic() + 10
        while srv.client.stats.num_requests_running != 3:
            assert time.monotonic() < deadline, f"never 3 running: {srv.client.stats}"
            time.sleep(0.01)
        families, _ = scrape(srv)
    assert value(families, "vllm:num_requests_running", "vllm:num_requests_running") == 3
    assert value(families, "vllm:num_requests_waiting", "vllm:num_requests_waiting") == 0
    wait_idle(srv)


def test_generated_tokens_counter_counts_what_the_answers_took(srv):
    """vllm:generation_tokens_total and vllm:request_generation_tokens count the same tokens:
    those the answers took in. Echo with max_tokens 0 makes the engine sample one token that
    the answer leaves out (its usage says 0): the counter had counted it."""
    before, _ = scrape(srv)
    scored = post(srv, "/v1/completions", {"prompt": "score me", "echo": True, "max_tokens": 0})
    assert scored["usage"]["completion_tokens"] == 0
    answer = post(srv, "/v1/completions", {"prompt": "count me", "max_tokens": 3,
                                           "ignore_eos": True})  # fmt: skip
    wait_idle(srv)
    after, _ = scrape(srv)

    def delta(family: str, sample: str) -> float:
        return value(after, family, sample) - value(before, family, sample)

    h = "vllm:request_generation_tokens"
    assert delta(h, h + "_count") == 2
    assert delta(h, h + "_sum") == answer["usage"]["completion_tokens"] == 3
    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") == 3


def test_request_phases_and_parameters(srv):
    """vLLM's request-phase histograms, from the engine core's own timestamps: a SLOW request
    (each step 20 ms) of 6 tokens decodes through 5 steps; inference is prefill plus decode;
    queue plus inference fit in the server's end-to-end time. One sample per request, whatever
    n: request_params_n and request_params_max_tokens as asked, and
    request_max_num_generation_tokens the longest choice's tokens (not all choices')."""
    before, _ = scrape(srv)
    post(srv, "/v1/completions", {"prompt": SLOW, "max_tokens": 6, "ignore_eos": True})
    post(srv, "/v1/completions", {"prompt": "two of them", "max_tokens": 3, "n": 2,
                                  "ignore_eos": True})  # fmt: skip
    wait_idle(srv)
    after, _ = scrape(srv)

    def delta(h: str, sample: str, **labels: str) -> float:
        return value(after, h, h + sample, **labels) - value(before, h, h + sample, **labels)

    for h in PHASES + PARAMS:
        assert after[h].type == "histogram", h
        assert delta(h, "_count") == 2, h
    queue, prefill, decode, inference = (delta(h, "_sum") for h in PHASES)
    assert min(queue, prefill) >= 0
    assert decode >= 5 * 0.02  # the SLOW request's: its 6 tokens are 5 steps apart
    assert inference == pytest.approx(prefill + decode)
    assert queue + inference <= delta("vllm:e2e_request_latency_seconds", "_sum")
    n, max_tokens, longest = PARAMS
    assert (delta(n, "_bucket", le="1.0"), delta(n, "_bucket", le="2.0")) == (1, 2)
    assert delta(n, "_sum") == 1 + 2
    assert delta(max_tokens, "_sum") == 6 + 3
    assert delta(longest, "_sum") == 6 + 3  # the n=2 request's longest choice: 3


def test_iteration_tokens_count_each_engine_step(srv):
    """vllm:iteration_tokens_total: one sample per engine step, of the tokens it ran through
    the model. A request alone in the engine of P prompt tokens and 5 generated ones is a
    prefill step of P tokens, then 4 steps that decode one token each."""
    before, _ = scrape(srv)
    answer = post(srv, "/v1/completions", {"prompt": "steps of a request alone", "max_tokens": 5,
                                           "ignore_eos": True})  # fmt: skip
    wait_idle(srv)
    after, _ = scrape(srv)
    h = "vllm:iteration_tokens_total"
    assert after[h].type == "histogram"

    def delta(sample: str, **labels: str) -> float:
        return value(after, h, h + sample, **labels) - value(before, h, h + sample, **labels)

    prompt = answer["usage"]["prompt_tokens"]
    assert 1 < prompt <= 16  # the prefill step falls in the bucket of 16
    assert delta("_sum") == prompt + 4
    assert (delta("_bucket", le="1.0"), delta("_bucket", le="16.0"), delta("_count")) == (4, 5, 5)


@pytest.fixture(scope="module")
def one_seq(tmp_path_factory):
    """A server of one sequence at a time whose steps take 16 tokens at most: a second request
    waits while the first runs, and a long prompt is prefilled over many (SLOW) steps."""
    yield from _scripted_server(
        tmp_path_factory, dataclasses.replace(TINY, max_num_seqs=1, max_num_batched_tokens=16))


def _gives_up(srv, body: dict, seconds: float, while_: Callable[[], bool] | None = None) -> None:
    """A non-streaming client that gives up after `seconds` (its request is aborted); `while_`,
    if given, must have held (polled meanwhile) before it does."""
    seen, gone = [], threading.Event()

    def watch() -> None:
        while not gone.is_set():
            if while_():
                seen.append(1)
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=watch) if while_ is not None else None
    if watcher is not None:
        watcher.start()
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json={"model": NAME, **body},
                       headers=HEADERS, timeout=seconds)
    finally:
        gone.set()
        if watcher is not None:
            watcher.join()
    assert seen or watcher is None, "the request was never in the state the test aborts it in"


def _aborts_counted(srv, before: dict, count: int) -> dict:
    """The scrape once the server has counted `count` more aborted API requests than `before`
    (it records an abort as the request closes)."""
    deadline, aborted = time.monotonic() + 10, "tinyoss_requests_aborted"
    while True:
        after, _ = scrape(srv)
        got = value(after, aborted, aborted + "_total") - value(before, aborted, aborted + "_total")
        if got == count:
            return after
        assert got < count and time.monotonic() < deadline, f"{got} aborts counted, not {count}"
        time.sleep(0.05)


def test_a_request_cut_short_before_its_first_token_has_no_queue_time(one_seq):
    """vLLM v1 observes its request-phase histograms (queue, prefill, decode, inference) only
    for a request that finishes through the engine's outputs; one its client aborts (AsyncLLM
    abort -> OutputProcessor.abort_requests) records no sample in any of them. tinyoss's phases
    come with a sequence's first delta, so a request cut short while it waits, or while its
    prompt is prefilled, has no queue time (nor a later phase) either, as in vLLM. Unlike vLLM,
    tinyoss counts its end otherwise: request_success{abort} and the end-to-end latency."""
    srv = one_seq
    stats = lambda: srv.client.stats  # noqa: E731

    def delta(after: dict, before: dict, h: str, sample: str, **labels: str) -> float:
        return value(after, h, h + sample, **labels) - value(before, h, h + sample, **labels)

    def phases(after: dict, before: dict) -> list[float]:
        return [delta(after, before, h, "_count")
                for h in (*PHASES, "vllm:time_to_first_token_seconds")]

    # waiting: the one that runs (SLOW steps of 20 ms: 150 tokens take 3 s or more) keeps the
    # next one waiting behind it for the whole second its client gives it (0.3 s was too little
    # for the wait to be seen on a busy 2-core machine)
    before, _ = scrape(srv)
    runs = threading.Thread(target=post, args=(srv, "/v1/completions", {
        "prompt": SLOW, "max_tokens": 150, "ignore_eos": True}))
    runs.start()
    try:
        deadline = time.monotonic() + 10
        while stats().num_requests_running != 1:
            assert time.monotonic() < deadline, f"never running: {stats()}"
            time.sleep(0.005)
        _gives_up(srv, {"prompt": "it waits", "max_tokens": 4}, 1.0,
                  lambda: stats().num_requests_waiting == 1)
    finally:
        runs.join()
    wait_idle(srv)
    after = _aborts_counted(srv, before, 1)
    success = "vllm:request_success"
    assert delta(after, before, success, "_total", finished_reason="abort") == 1
    assert delta(after, before, success, "_total", finished_reason="length") == 1
    assert phases(after, before) == [1] * 5  # the one that ran, alone
    assert delta(after, before, "vllm:e2e_request_latency_seconds", "_count") == 2  # tinyoss's

    # in prefill: a prompt of ~450 tokens, 16 a SLOW step (28 steps, over 0.5 s), whose client
    # leaves after 0.25 s; the engine ran some of its chunks, not all (no token came)
    before, taken = after, stats().prompt_tokens
    _gives_up(srv, {"prompt": SLOW + " a long prompt, prefilled in many chunks" * 50,
                    "max_tokens": 4}, 0.25)
    deadline = time.monotonic() + 10  # a prefilling core sends no stats until it goes idle
    while stats().prompt_tokens == taken:
        assert time.monotonic() < deadline, f"the core never told of the prompt: {stats()}"
        time.sleep(0.01)
    wait_idle(srv)
    after = _aborts_counted(srv, before, 1)
    prompt = delta(after, before, "vllm:prompt_tokens", "_total")
    prefilled = delta(after, before, "vllm:iteration_tokens_total", "_sum")
    assert prompt > 400 and 0 < prefilled < prompt
    assert delta(after, before, success, "_total", finished_reason="abort") == 1
    assert phases(after, before) == [0] * 5
    assert delta(after, before, "vllm:e2e_request_latency_seconds", "_count") == 1  # tinyoss's
