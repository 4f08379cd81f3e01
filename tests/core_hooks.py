"""Test-only hooks, loaded inside the engine core's process through TINYOSS_CORE_HOOK.

The server runs its engine core in another process, so tests cannot patch it; a hook gets the
built core there and wraps its executor instead. Hooks talk back through files named by
environment variables (the child inherits them at spawn).

- `scripted`: prompts containing a marker sample their script's harmony tokens instead of the
  model's (the scheduler, KV cache and everything else run for real); prompts with SLOW make
  each step take 20 ms. The prompt of each scripted request is appended to the file in
  TINYOSS_TEST_PROMPTS, its token ids as one JSON list a line (`scripted_server` decodes them).
  The markers' and scripts' token ids come from a file of the temp folder (`Encoded`), not from
  a tokenizer loaded in the core: that took 2 s of every hooked core's start.
- `fail_once`: the third step's result raises, once per TINYOSS_TEST_MARK file (the restarted
  core, finding the file, runs normally).
- `hang_once`: the third step never returns, once per TINYOSS_TEST_MARK file.
- `gated_failure`: start-up waits for the file in TINYOSS_TEST_GATE, then fails.
- `faults`: prompts containing OOM run out of memory when their prompt is prefilled, those
  containing NAN get NaN logits, and one containing CRASH makes a step raise (a fault of the
  engine, not of the request: the core dies and is restarted).
- `scripted_faults`: both `scripted` and `faults`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import tokenizers
import torch

import tinyoss.tokenizer as tokenizer_module
from tinyoss.engine.builder import load_tokenizer
from tinyoss.engine.core import EngineCore
from tinyoss.engine.step import TokenLogprob
from tinyoss.harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START
from tinyoss.tools.make_checkpoint import ensure_tiny

WEATHER = "[[weather]]"  # a user message that makes the model call get_weather
ANSWER = "[[answer]]"  # ... that makes it think, then answer
GOES_ON = "[[goes on]]"  # ... that makes it write text and end its answer (a continued one)
THINKS_ON = "[[thinks on]]"  # ... that makes it write text, end, then answer (after reasoning)
SLOW = "[[slow]]"  # ... that makes each engine step take 20 ms (for disconnects)
OOM = "[[oom]]"  # ... whose prefill runs out of memory
NAN = "[[nan]]"  # ... whose logits are NaN
CRASH = "[[crash]]"  # ... that makes the engine's step raise


def harmony_ids(tokenizer, *parts: int | str) -> list[int]:
    return [i for p in parts for i in ([p] if isinstance(p, int) else tokenizer.encode(p))]


def _has(ids: list[int], marker: tuple[int, ...]) -> bool:
    return any(tuple(ids[i : i + len(marker)]) == marker for i in range(len(ids)))


class Encoded:
    """tiny's token ids of some texts, as `encode` gives them. Loading the tokenizer in the
    core took 2 s of every hooked core's start (4 for scripted_faults); the ids are kept in a
    file of the temp folder, keyed by the texts, the tokenizer file and the code that encodes
    (tinyoss/tokenizer.py, the tokenizers version), so that only the first core of a run loads
    it (a race between two writes the same content)."""

    def __init__(self, texts: Iterable[str]) -> None:
        folder = ensure_tiny()
        source = folder / "tokenizer.json"
        stat, texts = source.stat(), sorted(set(texts))
        code = hashlib.sha256(Path(tokenizer_module.__file__).read_bytes()).hexdigest()
        key = json.dumps([str(source), stat.st_size, stat.st_mtime_ns, code,
                          tokenizers.__version__, texts])
        cache = Path(tempfile.gettempdir()) / (
            f"tinyoss-test-ids-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json")
        try:
            self.ids: dict[str, list[int]] = json.loads(cache.read_text())
        except (OSError, ValueError):
            tok = load_tokenizer(folder)
            self.ids = {t: tok.encode(t) for t in texts}
            tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.ids))
            os.replace(tmp, cache)

    def encode(self, text: str) -> list[int]:
        return self.ids[text]


_SCRIPTS: dict[str, tuple[int | str, ...]] = {
    WEATHER: (
        CHANNEL, "analysis", MESSAGE, "think", END, START, "assistant", CHANNEL,
        "commentary to=functions.get_weather ", CONSTRAIN, "json", MESSAGE, '{"city":"Paris"}',
        CALL,
    ),
    ANSWER: (
        CHANNEL, "analysis", MESSAGE, "Let me think.", END, START, "assistant", CHANNEL, "final",
        MESSAGE, "Hello there, Paris!", RETURN,
    ),
    GOES_ON: ("ld, and hello again!", RETURN),
    THINKS_ON: (" so it is 4.", END, START, "assistant", CHANNEL, "final", MESSAGE, "4", RETURN),
}  # fmt: skip


def scripted(core: EngineCore) -> None:
    texts = [p for parts in _SCRIPTS.values() for p in parts if isinstance(p, str)]
    tok = Encoded([*_SCRIPTS, SLOW, *texts])
    scripts = {tuple(tok.encode(m)): harmony_ids(tok, *parts) for m, parts in _SCRIPTS.items()}
    slow = tuple(tok.encode(SLOW))
    log = Path(os.environ["TINYOSS_TEST_PROMPTS"])
    executor = core.executor
    launch, result = executor.launch, executor.result
    script_of: dict[int, list[int]] = {}  # seq id -> its script
    given: dict[int, int] = {}  # seq id -> scripted tokens so far
    slow_seqs: set[int] = set()

    def scripted_launch(plan):
        for new in plan.new:
            ids = new.prompt_token_ids
            if _has(ids, slow):
                slow_seqs.add(new.seq_id)
            for marker, script in scripts.items():
                if _has(ids, marker):
                    script_of[new.seq_id] = script
                    with log.open("a") as f:
                        f.write(json.dumps(list(ids)) + "\n")
        if any(s.seq_id in slow_seqs for s in plan.seqs):
            time.sleep(0.02)
        return launch(plan)

    def scripted_result(launched):
        out = result(launched)
        for seq_id, tokens in out.sampled.items():
            script, done = script_of.get(seq_id), given.get(seq_id, 0)
            if script is None or done >= len(script):
                continue
            out.sampled[seq_id] = [script[done]]
            given[seq_id] = done + 1
            if seq_id in out.logprobs:
                lp = out.logprobs[seq_id][0]
                out.logprobs[seq_id] = [TokenLogprob(script[done], lp.logprob, lp.top)]
        return out

    executor.launch, executor.result = scripted_launch, scripted_result


def _on_third_step_once(core: EngineCore, act) -> None:
    """The third step's result calls `act` instead, once per TINYOSS_TEST_MARK file (the
    restarted core, finding the file, runs normally)."""
    mark = Path(os.environ["TINYOSS_TEST_MARK"])
    if mark.exists():
        return
    result, calls = core.executor.result, []

    def third(launched):
        calls.append(1)
        if len(calls) == 3:
            mark.touch()
            act()
        return result(launched)

    core.executor.result = third


def _fail() -> None:
    raise RuntimeError("injected engine failure")


def _hang() -> None:
    while True:
        time.sleep(60)


def fail_once(core: EngineCore) -> None:
    _on_third_step_once(core, _fail)


def hang_once(core: EngineCore) -> None:
    """The third step never returns (a hung GPU or step)."""
    _on_third_step_once(core, _hang)


def gated_failure(core: EngineCore) -> None:
    gate = Path(os.environ["TINYOSS_TEST_GATE"])
    deadline = time.monotonic() + 60
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    raise RuntimeError("no weights here")


def faults(core: EngineCore) -> None:
    tok = Encoded([OOM, NAN, CRASH])
    inject_faults(core, {tuple(tok.encode(m)): m for m in (OOM, NAN, CRASH)})


def scripted_faults(core: EngineCore) -> None:
    scripted(core)
    faults(core)


def inject_faults(core: EngineCore, markers: dict[tuple[int, ...], str]) -> None:
    """Wraps the executor: sequences whose prompt holds a marker get its fault."""
    executor = core.executor
    launch, sample = executor.launch, executor._launched
    fault_of: dict[int, str] = {}  # seq id -> its marker

    def faulty_launch(plan):
        for new in plan.new:
            for marker, kind in markers.items():
                if _has(new.prompt_token_ids, marker):
                    fault_of[new.seq_id] = kind
        for s in plan.seqs:
            kind = fault_of.get(s.seq_id)
            if kind == OOM and s.num_tokens > 1:
                raise torch.OutOfMemoryError("injected: CUDA out of memory")
            if kind == CRASH:
                raise RuntimeError("injected engine fault")
        return launch(plan)

    def faulty_sample(seq_ids, logits, prompt):
        rows = [i for i, seq_id in enumerate(seq_ids) if fault_of.get(seq_id) == NAN]
        if rows:
            logits = logits.clone()
            logits[rows] = float("nan")
        return sample(seq_ids, logits, prompt)

    executor.launch, executor._launched = faulty_launch, faulty_sample
