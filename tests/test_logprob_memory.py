"""What logprobs hold in the server, measured with tracemalloc on the server's own path: the
engine's entries as they arrive (unpickled, as from the core), the windowed output processor,
the choices, and the JSON of the answer or of each stream event. What --max-logprob-memory
reserves a token (limits.logprob_bytes) must cover what a kept answer holds at its peak without
being far above it, a stream must hold nothing it has sent, and a stored response's
`footprint` must cover what its items keep."""

from __future__ import annotations

import asyncio
import gc
import pickle
import random
import tracemalloc

import pytest
from starlette.responses import JSONResponse

from tests.core_hooks import harmony_ids
from tinyoss.engine.builder import load_tokenizer
from tinyoss.engine.core import SeqDelta
from tinyoss.engine.output_processor import LogprobWindow, OutputProcessor
from tinyoss.engine.step import TokenLogprob
from tinyoss.harmony import CHANNEL, FIRST_SPECIAL, MESSAGE
from tinyoss.sampling_params import SamplingParams
from tinyoss.server.app import _sse
from tinyoss.server.choices import ChatChoice, TextChoice
from tinyoss.server.limits import logprob_bytes
from tinyoss.server.responses_api import Output, ResponseRun, translate
from tinyoss.tools.make_checkpoint import ensure_tiny

SHORT, LONG = 200, 800  # tokens: the cost of a token is the difference over LONG - SHORT


@pytest.fixture(scope="module")
def tok():
    tok = load_tokenizer(ensure_tiny())
    tok.fill_byte_cache()  # as the server does at start
    return tok


def deltas(tok, k: int, num_tokens: int) -> list[bytes]:
    """A final-channel answer of random ordinary tokens, a token a delta, pickled as the core
    sends them, each with k random alternatives."""
    rng = random.Random(num_tokens * 100 + k)
    ids = harmony_ids(tok, CHANNEL, "final", MESSAGE)
    ids += [rng.randrange(1000, FIRST_SPECIAL) for _ in range(num_tokens - len(ids))]
    out = []
    for at, token in enumerate(ids):
        top = [(rng.randrange(1000, FIRST_SPECIAL), -rng.random() * 20) for _ in range(k)]
        end = "length" if at == len(ids) - 1 else None
        delta = SeqDelta("r", 0, [token], [TokenLogprob(token, -rng.random() * 20, top)],
                         finish_reason=end)  # fmt: skip
        out.append(pickle.dumps([delta], protocol=pickle.HIGHEST_PROTOCOL))
    return out


def outputs(tok, k: int, steps: list[bytes]):
    """The server's engine outputs of `steps` (a windowed processor, as CoreClient's)."""
    processor = OutputProcessor(tok, windowed=True)
    processor.add("r", None, [1], SamplingParams(logprobs=k, max_tokens=len(steps)))
    for step in steps:
        yield from processor.process(pickle.loads(step))[0]


def chat(tok, k: int, steps: list[bytes], keep: bool) -> None:
    choice = ChatChoice(0, tok, [], True, keep_logprobs=keep)
    for out in outputs(tok, k, steps):
        chunk = choice.update(out.outputs[0])
        if chunk is not None and not keep:
            _sse({"choices": [chunk]}).encode()  # sent (EventStream encodes it), dropped
    if keep:
        JSONResponse({"choices": [choice.final()]})


def completions(tok, k: int, steps: list[bytes], keep: bool) -> None:
    choice = TextChoice(0, tok, None, True, keep_logprobs=keep)
    for out in outputs(tok, k, steps):
        chunk = choice.update(out.outputs[0])
        if chunk is not None and not keep:
            _sse({"choices": [chunk]}).encode()
    if keep:
        JSONResponse({"choices": [choice.final()]})


class _Run:
    """The engine run of one response (what ResponseRun needs of app.Run)."""

    def __init__(self, output: Output, outs) -> None:
        self.output, self.outs, self.streams, self.num_tokens = output, outs, [], 0
        self.rid = "resp_test"

    async def updates(self):
        for out in self.outs:
            self.num_tokens = len(out.outputs[0].token_ids)
            yield [self.output.update(out.outputs[0])]

    def usage(self) -> dict:
        return {"prompt_tokens": 1, "completion_tokens": self.num_tokens,
                "total_tokens": 1 + self.num_tokens,
                "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip


def response(tok, k: int, steps: list[bytes], stream: bool) -> ResponseRun:
    """A response (kept: its last events carry every entry, streamed too); returns it, as the
    store keeps it."""
    req = translate({"input": "hi", "top_logprobs": k}, lambda _: [])
    output = Output(tok, logprobs=True)
    run = _Run(output, outputs(tok, k, steps))
    resp = ResponseRun(req, "tiny", run, output, lambda e: e)

    async def drain() -> bool:
        async for _ in run.updates():
            pass
        return True

    async def go() -> None:
        if stream:
            async for event in resp.events():
                _sse(event, event["type"]).encode()
        else:
            JSONResponse(await resp.drain(drain))

    asyncio.run(go())
    return resp


def peak(run, *args) -> int:
    """Bytes allocated at the peak of `run(*args)`, over what was allocated before."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        run(*args)
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def per_token(tok, k: int, run, *args) -> float:
    """The bytes a token adds to the peak of `run`."""
    short, long = deltas(tok, k, SHORT), deltas(tok, k, LONG)
    return (peak(run, tok, k, long, *args) - peak(run, tok, k, short, *args)) / (LONG - SHORT)


KEPT = [("chat", chat, True), ("completions", completions, True),
        ("responses", response, False), ("responses streamed", response, True)]  # fmt: skip


@pytest.mark.parametrize("k", [0, 20])
@pytest.mark.parametrize("name, run, arg", KEPT, ids=[name for name, *_ in KEPT])
def test_what_a_kept_answer_holds_is_what_is_reserved(tok, k, name, run, arg):
    cost, reserved = per_token(tok, k, run, arg), logprob_bytes(1, k)
    assert cost <= reserved, f"{name}, top_logprobs {k}: {cost:.0f} bytes a token at the peak"
    if name == "chat":  # the costliest: the reservation is not far above it (with room for
        # another CPython's object sizes: 0.65 measured on 3.11)
        assert cost >= 0.4 * reserved, f"top_logprobs {k}: {cost:.0f} bytes a token"


@pytest.mark.parametrize("name, run", [("chat", chat), ("completions", completions)])
def test_a_stream_holds_no_logprobs_it_has_sent(tok, name, run):
    """A stream's choices had kept every entry they sent, and the output processor every
    engine entry: a stream held as much as a whole answer."""
    with_logprobs, without = per_token(tok, 20, run, False), per_token(tok, 0, run, False)
    assert with_logprobs - without < 512, (with_logprobs, without)  # bytes a token


@pytest.mark.parametrize("k", [0, 20])
def test_a_stored_response_counts_what_its_items_keep(tok, k):
    """Once a response has ended, its items keep their logprob entries (no reservation covers
    them then): the store counts them by `footprint`."""
    for num_tokens in (SHORT, LONG):
        steps = deltas(tok, k, num_tokens)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            resp = response(tok, k, steps, stream=False)
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert kept <= resp.footprint() <= 2 * kept + 4096, (num_tokens, kept, resp.footprint())


def test_a_logprob_window_reads_by_position_and_drops_what_is_released():
    window = LogprobWindow()
    entries = [TokenLogprob(i, -float(i), []) for i in range(6)]
    window += entries[:4]
    window.release(2)
    assert len(window) == 4 and window.held == 2 and window[2] is entries[2]
    assert window[2:4] == entries[2:4] and window[-1] is entries[3]
    with pytest.raises(IndexError):
        window[1]
    window += entries[4:]
    window.release(10)  # only what has arrived
    assert len(window) == 6 and window.held == 0
    window += [entries[0]]
    assert window[6] is entries[0]
