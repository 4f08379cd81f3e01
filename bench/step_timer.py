"""Timing an engine core's steps from outside, for bench/prefill_stall.py and
bench/experiments/mixed_step_profile.py: each step's wall time, the host's time until the
executor's launch returned (a host-bound step shows it), and its CUDA-event time; and N decoding
streams to time steps against."""

from __future__ import annotations

import random
import time

import torch

from tinyoss import SamplingParams
from tinyoss.engine.core import CoreRequest, EngineCore


class StepTimer:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._launch = core.executor.launch
        core.executor.launch = self._timed_launch
        self._host = 0.0
        self._records: list[tuple[float, tuple | None, float]] = []  # wall, events, host

    def _timed_launch(self, plan):
        t0 = time.perf_counter()
        try:
            return self._launch(plan)
        finally:
            self._host += time.perf_counter() - t0

    def step(self) -> tuple[float, list]:
        """One core step: (its wall seconds, its deltas); the rest is kept for `times`."""
        self._host = 0.0
        events = None
        if torch.cuda.is_available():
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        t0 = time.perf_counter()
        deltas = self.core.step()
        wall = time.perf_counter() - t0
        if events is not None:
            events[1].record()
        self._records.append((wall, events, self._host))
        return wall, deltas

    def clear(self) -> None:
        self._records.clear()

    def times(self) -> list[tuple[float, float, float]]:
        """(wall, CUDA events, host launch) seconds of each step since `clear`; the event time
        includes the GPU's idle gaps inside the step (on a CPU it is the wall time)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return [(w, e[0].elapsed_time(e[1]) / 1e3 if e else w, h) for w, e, h in self._records]


def start_streams(core: EngineCore, n: int, prompt_len: int, max_tokens: int,
                  rng: random.Random) -> None:
    """n greedy streams of random prompts, prefilled: from then on every step decodes them."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    for i in range(n):
        ids = [rng.randrange(1000, 150000) for _ in range(prompt_len)]
        core.add(CoreRequest(f"s{i}", ids, params))
    while any(s.num_computed < s.num_prompt for s in core.scheduler.running) or (
        core.scheduler.waiting
    ):
        core.step()
