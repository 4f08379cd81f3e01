"""`PlanRing` on CPU, with a stand-in wrapper and events: each plan writes the next pinned buffer,
and a buffer is written again only after the event of its last copy is waited on. On the GPU,
tests/test_gpu.py plans two steps behind a busy stream and checks their outputs."""

from __future__ import annotations

import pytest
import torch

from tinyoss.kernels import attention_flashinfer as af


class _Wrapper:
    def __init__(self) -> None:
        self._pin_memory_int_workspace_buffer = torch.zeros(8, dtype=torch.uint8)
        self.planned: list[torch.Tensor] = []

    def plan(self, step: int) -> None:
        buf = self._pin_memory_int_workspace_buffer
        buf.fill_(step)  # as FlashInfer does: the schedule into the pinned buffer, then a copy
        self.planned.append(buf)


class _Event:
    log: list[tuple[str, int]] = []
    count = 0

    def __init__(self) -> None:
        _Event.count += 1
        self.id = _Event.count

    def record(self) -> None:
        _Event.log.append(("record", self.id))

    def synchronize(self) -> None:
        _Event.log.append(("wait", self.id))


def test_each_plan_writes_a_buffer_whose_last_copy_is_done(monkeypatch):
    monkeypatch.setattr(af, "_pinned_like", torch.empty_like)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.log, _Event.count = [], 0
    wrapper = _Wrapper()
    ring = af.PlanRing(wrapper, size=3)
    for step in range(7):
        ring.plan(step)
    ids = [id(b) for b in wrapper.planned]
    assert len(set(ids[:3])) == 3 and ids[3:] == ids[:3] + ids[:1]  # in turn
    # steps 0-2 wait for nothing; step 3 reuses step 0's buffer once step 0's copy is done, ...
    assert _Event.log == [("record", 1), ("record", 2), ("record", 3),
                          ("wait", 1), ("record", 4), ("wait", 2), ("record", 5),
                          ("wait", 3), ("record", 6), ("wait", 4), ("record", 7)]
    assert [int(b[0]) for b in ring.buffers] == [6, 4, 5]  # the newest plans, none overwritten


def test_a_flashinfer_that_plans_elsewhere_is_named():
    with pytest.raises(RuntimeError, match="no pinned schedule buffer where FlashInfer"):
        af.PlanRing(object())
