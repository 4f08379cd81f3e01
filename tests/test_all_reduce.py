"""tinyoss's one-shot all-reduce on the CPU: where it can run (`load`), and the argument checks
its wrapper makes before any launch (a bad pointer there would fault one GPU and leave the
others waiting for its rows). Its numerics run on the GPUs: tests/test_all_reduce_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tinyoss.kernels import all_reduce


class FakeLib:
    """The library's two entry points, recording the launches."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.tinyoss_all_reduce = self._launch
        self.tinyoss_all_reduce_error = lambda err: b"invalid argument"

    def _launch(self, *args) -> int:
        self.calls.append(args)
        return 0


def test_load_says_why_not(monkeypatch):
    all_reduce.load.cache_clear()
    try:
        assert all_reduce.load(None) == (None, "it is built for sm_90 (Hopper) only")
        assert all_reduce.load((8, 0))[0] is None
        monkeypatch.setattr(all_reduce.nvcc_build, "find_nvcc", lambda: None)
        assert all_reduce.load((9, 0)) == (
            None, "nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    finally:
        all_reduce.load.cache_clear()


def test_bad_arguments_are_refused_before_the_launch(monkeypatch):
    lib = FakeLib()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: type("S", (), {
        "cuda_stream": 0})())
    kernel = all_reduce.OneShot.__new__(all_reduce.OneShot)
    kernel.fn, kernel.error_fn = lib.tinyoss_all_reduce, lib.tinyoss_all_reduce_error
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    out, residual, weight = torch.empty_like(x), torch.zeros_like(x), torch.ones(64)
    state = torch.zeros(3, dtype=torch.int32)
    peers = [1 << 20, 2 << 20]

    def call(**changed) -> None:
        args = dict(x=x, out=out, residual=residual, weight=weight, state=state) | changed
        kernel(args["x"], peers, 0, args["state"], 1000, args["out"], args["residual"],
               args["weight"], 1e-5, ids=args.get("ids"))

    call()
    assert len(lib.calls) == 1
    for changed, message in [
        (dict(weight=torch.ones(32)), "weight \\[64\\]"),
        (dict(weight=torch.ones(64, dtype=torch.bfloat16)), "float32 weight"),
        (dict(x=x.float()), "x must be contiguous"),
        (dict(out=out.float()), "out bf16"),
        (dict(residual=torch.zeros(3, 64, dtype=torch.bfloat16)), "does not match"),
        (dict(x=torch.zeros(2, 128, dtype=torch.bfloat16)[:, :64]), "x must be contiguous"),
        (dict(x=torch.zeros(2 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 64)), "16-byte"),
        (dict(state=torch.zeros(3)), "state"),
        (dict(x=torch.zeros(8, 64), ids=torch.zeros(2, 4, dtype=torch.int64)), "int32"),
        (dict(x=torch.zeros(8, 64), ids=torch.zeros(2, 2, 2, dtype=torch.int32)), "int32"),
    ]:
        with pytest.raises(ValueError, match=message):
            call(**changed)
    assert len(lib.calls) == 1  # nothing more reached the kernel
    call(x=torch.zeros(8, 64), ids=torch.zeros(2, 4, dtype=torch.int32))  # the pairs' rows
    assert len(lib.calls) == 2 and lib.calls[1][3] == 4  # topk
