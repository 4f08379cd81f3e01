"""tinyoss's one-shot all-reduce (`kernels/all_reduce.cu`) on 2 and 4 GPUs, one process a GPU:
every call's sum bit for bit the fp32 sum in rank order rounded to bf16 (NCCL's exactly on two
GPUs), the fused residual add exact and its RMSNorm within bf16 rounding of the torch norm,
across row counts that change from call to call (the three slots rotate and each call clears
what the previous one used), inputs holding -0.0 (the kernel's "not arrived" mark), the
experts' uncombined pair rows summed in the same launch (pairs of id -1 never read), and calls
captured in a CUDA graph and replayed. On the CPU `tests/test_tensor_parallel.py` checks when
the engine takes it."""

from __future__ import annotations

import socket

import pytest
import torch

needs = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs Hopper GPUs")


def _worker(rank: int, size: int, init: str, hidden: int) -> None:
    import torch.distributed as dist

    from tinyoss.engine.comm import Group, _CustomAllReduce, disable_multicast
    from tinyoss.kernels import rms_norm_torch

    disable_multicast()
    device = torch.device("cuda", rank)
    group = Group(rank, size, device, init)
    ar = _CustomAllReduce(group, torch.bfloat16, hidden)
    gen = torch.Generator(device=device).manual_seed(10 + rank)
    weight = (torch.rand(hidden, device=device, generator=torch.Generator(device=device)
                         .manual_seed(0)) + 0.5).to(torch.bfloat16).float()

    def inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, hidden, device=device, generator=gen).to(torch.bfloat16)
        x[:, ::7] = -0.0  # the mark a receive buffer holds where nothing arrived
        x[:, 1::11] = 0.0
        residual = torch.randn(rows, hidden, device=device,
                               generator=torch.Generator(device=device).manual_seed(rows))
        return x, residual.to(torch.bfloat16)  # the same on every rank, as in the model

    def expected(x: torch.Tensor, residual: torch.Tensor):
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x)
        total = torch.zeros_like(x, dtype=torch.float32)
        for part in parts:  # rank order, in fp32, rounded once
            total += part.float()
        total = total.to(torch.bfloat16)
        if size == 2:
            nccl = x.clone()
            dist.all_reduce(nccl)
            assert torch.equal(nccl, total)
        return total, rms_norm_torch(total, weight, 1e-5, residual)

    def check(got, want) -> None:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()
        assert not torch.signbit(got[got == 0]).any()  # never the "not arrived" mark

    def check_fused(got, want) -> None:
        (normed, residual), (want_normed, want_residual) = got, want
        assert torch.equal(residual, want_residual)
        torch.testing.assert_close(normed, want_normed, rtol=1e-2, atol=1e-2)

    def pairs(rows: int, topk: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The experts' pair rows y [rows * topk, hidden] fp32 and ids [rows, topk] (some -1,
        whose rows hold NaN: never read), and their combine as moe_triton's `_combine` gives
        it: the sum in slot order, in fp32, rounded to bf16."""
        y = torch.randn(rows * topk, hidden, device=device, generator=gen)
        ids = torch.randint(-1, 8, (rows, topk), device=device, generator=gen,
                            dtype=torch.int32)
        y[ids.view(-1) < 0] = float("nan")
        combined = torch.zeros(rows, hidden, device=device)
        for k in range(topk):
            combined += torch.where(ids[:, k, None] >= 0, y.view(rows, topk, hidden)[:, k], 0.0)
        return y, ids, combined.to(torch.bfloat16)

    for rows in [1, 5, ar.max_tokens, 2, 1, 33, 7, ar.max_tokens, 1, 3, 64, 1, 1, 2]:
        x, residual = inputs(rows)
        want, fused_want = expected(x, residual)
        got = ar(x)
        fused = ar.norm(x, residual.clone(), weight, 1e-5)
        y, ids, combined = pairs(rows)
        _, pairs_want = expected(combined, residual)
        from_pairs = ar.pairs_norm(y, ids, residual.clone(), weight, 1e-5)
        torch.cuda.synchronize(device)
        check(got, want)
        check_fused(fused, fused_want)
        check_fused(from_pairs, pairs_want)

    # captured: three calls a replay (sizes 1, 4, 1), replayed with new inputs each time
    static = [inputs(n) for n in (1, 4, 1)]
    outs: list = []
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        dist.barrier()
        with torch.cuda.graph(graph, stream=stream):
            for i, (x, res) in enumerate(static):
                outs.append(ar(x) if i != 1 else ar.norm(x, res, weight, 1e-5))
    torch.cuda.synchronize(device)
    for _ in range(4):
        fresh = [inputs(n) for n in (1, 4, 1)]
        wants = [expected(x, res) for x, res in fresh]
        for (sx, sres), (x, res) in zip(static, fresh):
            sx.copy_(x)
            sres.copy_(res)
        graph.replay()
        torch.cuda.synchronize(device)
        check(outs[0], wants[0][0])
        check_fused(outs[1], wants[1][1])
        check(outs[2], wants[2][0])
        assert torch.equal(static[1][1], wants[1][1][1])  # the residual in place
    group.close()


@needs
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("hidden", [2880, 64])
def test_the_one_shot_all_reduce_sums_as_nccl(size, hidden):
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    mp.spawn(_worker, args=(size, init, hidden), nprocs=size)
