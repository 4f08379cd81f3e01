"""A progress bar over a stream of checkpoint tensors, for the waits of writing and loading one.

tqdm on stderr that turns itself off where stderr is no terminal (logs, pipes, CI), as Hugging
Face's downloads do; the callers log a line at the start and the end either way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

from tinyoss.model.layout import TensorSpec

T = TypeVar("T")


def tensor_progress(
    stream: Iterable[tuple[TensorSpec, T]], total_bytes: int, desc: str
) -> Iterator[tuple[TensorSpec, T]]:
    """Yields `stream` unchanged, advancing a bar by each tensor's checkpoint bytes as it is
    handed on: a consumer that stops at the last tensor (a shard writer) still sees 100%."""
    with tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, disable=None) as bar:
        for spec, tensor in stream:
            bar.update(spec.nbytes)
            yield spec, tensor


def thread_lock_only() -> None:
    """For the processes tinyoss starts (the engine core, tensor-parallel workers): tqdm's bars
    there take a thread lock instead of tqdm's default multiprocessing one, whose named
    semaphore was reported leaked ("resource_tracker: ... leaked semaphore") when the server
    stopped such a process."""
    tqdm.set_lock(threading.RLock())
