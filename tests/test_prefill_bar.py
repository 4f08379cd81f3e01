"""The prefill progress bar of a single long prompt (`tinyoss chat`, `generate` of one prompt):
it follows the engine's prompt progress and closes at the first token."""

import io
import sys

from tinyoss import SamplingParams
from tinyoss.llm import _PrefillBar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class FakeEngine:
    def __init__(self, steps):
        self.steps = list(steps)

    def prompt_progress(self, request_id):
        return self.steps.pop(0) if self.steps else None


def test_bar_follows_prompt_progress_and_closes(monkeypatch):
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    engine = FakeEngine([(0, 5000), (2048, 5000), (4096, 5000), (5000, 5000)])
    bar = _PrefillBar(engine, "r")
    assert bar.bar is not None and bar.bar.total == 5000
    bar.update()
    assert bar.bar.n == 2048
    bar.update()
    assert bar.bar.n == 4096
    bar.update()  # the whole prompt is in: the bar ends
    assert bar.bar is None
    assert "prefill" in err.getvalue() and "5000/5000" in err.getvalue()
    bar.update()  # nothing left to do
    bar.close()


def test_short_prompts_and_finished_requests_get_no_bar(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert _PrefillBar(FakeEngine([(0, 100)]), "r").bar is None
    assert _PrefillBar(FakeEngine([None]), "r").bar is None
    bar = _PrefillBar(FakeEngine([(0, 3000), None]), "r")  # finished (or aborted) meanwhile
    bar.update()
    assert bar.bar is None


def test_engine_reports_prompt_progress(tiny_llm):
    """The core's counts while a chunked prompt is prefilled, then None once it is done."""
    core = tiny_llm.engine
    from tinyoss.engine.core import CoreRequest

    n = 5 * core.scheduler.max_num_batched_tokens // 2  # three chunks
    core.add(CoreRequest("long", list(range(1000, 1000 + n)), SamplingParams(max_tokens=1)))
    seen = [core.prompt_progress("long")]
    while core.has_work():
        core.step()
        seen.append(core.prompt_progress("long"))
    assert seen[0] == (0, n) and seen[-1] is None
    counts = [s[0] for s in seen if s is not None]
    assert counts == sorted(set(counts)) and len(counts) == 3 and counts[-1] < n
