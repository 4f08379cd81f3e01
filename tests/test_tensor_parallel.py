"""Tensor parallelism on the CPU: ranks as threads (the split's numerics at 2, 4 and 8 ranks,
padding included) and as real processes over gloo (the engine path: plans, chained steps,
speculative steps, sampling on rank 0)."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

from tests.test_model_reference import run_paged
from tests.test_speculative import Replay
from tinyoss import LLM, SamplingParams
from tinyoss.config import ModelConfig
from tinyoss.engine import workers
from tinyoss.kernels import Kernels
from tinyoss.model.loader import build_model, load_weights
from tinyoss.model.presets import GENERATION_CONFIG, preset_config
from tinyoss.model.sharding import Cut, Shard
from tinyoss.model.synthetic import synthetic_tensors

CPU = torch.device("cpu")


class ThreadGroup:
    """Collectives between threads (one a rank): each rank deposits its tensor, all wait, and
    each reads the sum (or the concatenation) in rank order."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.parts: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size)

    def _exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.parts[rank] = x.clone()
        self.barrier.wait()
        parts = list(self.parts)
        self.barrier.wait()
        return parts

    def kernels(self, rank: int) -> Kernels:
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            return x.copy_(torch.stack(self._exchange(rank, x)).sum(0))

        def all_gather(x: torch.Tensor) -> torch.Tensor:
            return torch.cat(self._exchange(rank, x), dim=-1)

        return Kernels(all_reduce=all_reduce, all_gather=all_gather)


def _config() -> ModelConfig:
    """tiny with 8 KV heads (so 8 ranks can split them) and 4 MXFP4 blocks of intermediate
    units (so 8 ranks hold 1 each, half of them padding)."""
    cfg = preset_config("tiny") | {"num_key_value_heads": 8, "intermediate_size": 128}
    return ModelConfig.from_dict(cfg, GENERATION_CONFIG)


def test_an_expert_split_that_does_not_divide_says_what_does():
    cfg = preset_config("tiny") | {"num_key_value_heads": 8, "num_local_experts": 6}
    c = ModelConfig.from_dict(cfg, GENERATION_CONFIG)
    with pytest.raises(ValueError, match=r"6 experts to split evenly: use a tensor_parallel_size "
                                         r"of \[1, 2\], or drop enable_expert_parallel"):
        Shard(0, 4, experts=True).check(c)
    Shard(0, 4).check(c)  # cut by the intermediate dimension: any size the heads take


def test_shard_cuts_at_real_shapes():
    c = ModelConfig.from_dict(preset_config("gpt-oss-20b"), GENERATION_CONFIG)
    gate_up = (32, 5760, 90, 16)
    # 90 blocks over 4 ranks: 23 each (1472 interleaved gate/up rows), the last 21 real + 2 pad
    cuts = [Shard(r, 4).cut("model.layers.0.mlp.experts.gate_up_proj_blocks", gate_up, c)
            for r in range(4)]
    assert [(k.start, k.stop, k.length) for k in cuts] == [
        (0, 1472, 1472), (1472, 2944, 1472), (2944, 4416, 1472), (4416, 5760, 1472)]
    down = Shard(7, 8).cut("model.layers.0.mlp.experts.down_proj_scales", (32, 2880, 90), c)
    assert (down.dim, down.start, down.stop, down.length) == (2, 84, 90, 12)  # 6 real + 6 pad
    assert Shard(3, 8).local_config(c).intermediate_size == 12 * 32
    bias = Shard(1, 2).cut("model.layers.0.self_attn.o_proj.bias", (2880,), c)
    assert bias.take(torch.ones(2880)).count_nonzero() == 0  # rank 0 alone adds the bias
    assert Shard(0, 2).cut("model.layers.0.self_attn.o_proj.bias", (2880,), c) is None
    o = Shard(1, 2).cut("model.layers.0.self_attn.o_proj.weight", (2880, 4096), c)
    assert (o.dim, o.start, o.stop) == (1, 2048, 4096)
    with pytest.raises(ValueError, match="must divide the model's 8 KV heads"):
        Shard(0, 3).check(c)
    ep = Shard(1, 4, experts=True)  # 8 of the 32 experts, whole
    assert ep.cut("model.layers.0.mlp.experts.down_proj_bias", (32, 2880), c) == Cut(0, 8, 16, 8)
    assert ep.local_config(c).intermediate_size == 2880 and ep.experts_held(c) == 8


@pytest.fixture(scope="module")
def whole():
    """A random model and its weights, kept to split over ranks."""
    config = _config()
    weights = list(synthetic_tensors(config, seed=0))
    model = build_model(config, dtype=torch.float32, device=CPU)
    load_weights(model, weights)
    model.init_runtime(256, CPU)
    return config, weights, model


@pytest.mark.parametrize("size, experts", [(2, False), (8, False), (4, True)])
def test_ranks_as_threads_match_one_model(whole, size, experts):
    """The same random weights split over `size` ranks give the single model's logits, for a
    prompt past the 128-token window (fp32: to rounding); experts cut (8 ranks: half of them
    padding) or dealt out whole (expert parallelism)."""
    config, weights, model = whole
    ids = torch.randint(0, config.vocab_size, (150,), generator=torch.Generator().manual_seed(0))
    want = run_paged(model, model.config, ids)
    group, got = ThreadGroup(size), [None] * size

    def rank(r: int) -> None:
        shard = Shard(r, size, experts)
        part = build_model(config, dtype=torch.float32, device=CPU, kernels=group.kernels(r),
                           shard=shard)
        load_weights(part, ((s, t if (c := shard.cut(s.name, s.shape, config)) is None
                             else c.take(t)) for s, t in weights))
        part.init_runtime(256, CPU)
        got[r] = run_paged(part, part.config, ids)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(size):
        torch.testing.assert_close(got[r], want, rtol=1e-4, atol=1e-4)


PROMPTS = [list(range(100, 400)), [5, 6, 7], list(range(1000, 1150))]


def _run(llm: LLM) -> list:
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    logprobs = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3,
                              prompt_logprobs=2)
    seeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)
    outs = [llm.generate(PROMPTS, greedy, use_tqdm=False)]  # speculates where configured
    outs.append(llm.generate(PROMPTS, logprobs, use_tqdm=False))  # chained (async) steps
    outs.append(llm.generate(PROMPTS[:2], seeded, use_tqdm=False))
    return outs


@pytest.fixture(scope="module")
def one_process(tiny_llm):
    return _run(tiny_llm)


@pytest.mark.parametrize("experts", [False, True])
def test_two_processes_match_one(one_process, tiny_dir, experts):
    """rank 0 and a worker process over gloo: the same tokens as one process, logprobs to
    rounding; greedy requests with drafts (every third wrong) in verify steps on both ranks;
    experts cut or dealt out whole (expert parallelism)."""
    want = one_process
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", tensor_parallel_size=2,
              kv_cache_tokens=16384, max_num_batched_tokens=2048,
              enable_expert_parallel=experts,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    llm.engine.proposer = Replay({tuple(p): o.outputs[0].token_ids
                                  for p, o in zip(PROMPTS, want[0])}, wrong=3)
    try:
        got = _run(llm)
        assert llm.engine.stats.spec_drafts > 0  # verify steps ran on both ranks
        workers = llm.engine.executor.peers.procs
        assert len(workers) == 1 and workers[0].poll() is None
    finally:
        llm.engine.close()
    assert workers[0].wait(timeout=10) == 0
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
    for x, y in zip(got[1], want[1]):
        pairs = list(zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]))
        pairs += list(zip(x.outputs[0].logprobs, y.outputs[0].logprobs))
        assert len(pairs) > 10
        for p, q in pairs:
            assert p.token_id == q.token_id
            assert p.logprob == pytest.approx(q.logprob, abs=1e-4)
            assert [t for t, _ in p.top] == [t for t, _ in q.top]


def _workers_of_this_process() -> list[int]:
    me, found = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if int(stat[1]) == me and b"tinyoss.engine.workers" in cmdline and stat[0] != "Z":
            found.append(int(pid))
    return found


def test_a_refusal_after_the_workers_started_ends_them(tiny_dir):
    """Rank 0 and the worker both refuse a KV cache too small to run: the error reaches the
    caller (this process is not taken down by the worker's report) and no worker is left."""
    with pytest.raises(ValueError, match="too few to run anything"):
        LLM(str(tiny_dir), device="cpu", dtype="float32", tensor_parallel_size=2,
            kv_cache_tokens=10)
    time.sleep(workers._GRACE_S + 0.5)  # past the watcher's grace: this process still runs
    assert _workers_of_this_process() == []


def test_a_bad_all_reduce_setting_is_refused_before_any_worker_starts(tiny_dir, monkeypatch):
    monkeypatch.setenv("TINYOSS_ALL_REDUCE", "bogus")
    with pytest.raises(ValueError, match="all-reduce 'bogus' .* is not one of: auto, nccl"):
        LLM(str(tiny_dir), device="cpu", dtype="float32", tensor_parallel_size=2)
    assert _workers_of_this_process() == []


def test_an_interrupted_rendezvous_ends_the_workers(tiny_dir, monkeypatch):
    """Ctrl-C while rank 0 waits for its workers to join (a terminal's Ctrl-C reaches rank 0
    alone: the workers run in a session of their own): rank 0 ends them, none is left."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(workers, "Group", interrupted)
    with pytest.raises(KeyboardInterrupt):
        LLM(str(tiny_dir), device="cpu", dtype="float32", tensor_parallel_size=2)
    assert _workers_of_this_process() == []


_WORKER_DIES = """
import os, signal, sys, threading, time
from tinyoss import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2,
          kv_cache_tokens=4096)
greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
llm.generate(["hi"], greedy, use_tqdm=False)
pid = llm.engine.executor.peers.procs[0].pid
print("worker", pid, flush=True)
kill = lambda: os.kill(pid, signal.SIGKILL)
if sys.argv[2] == "between":
    kill()
    time.sleep(0.5)
else:  # during a call
    threading.Timer(1.0, kill).start()
    greedy = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
try:
    llm.generate(["hi"], greedy, use_tqdm=False)
except RuntimeError as e:
    print("raised:", e, flush=True)
time.sleep(30)  # the watcher ends the process before this
print("still running", flush=True)
"""


@pytest.mark.parametrize("when", ["between", "during"])
def test_a_worker_that_dies_ends_the_engine_with_why(tiny_dir, when):
    """A worker killed between calls or during one: the call raises naming the worker, its pid
    and the signal (not a bare BrokenPipeError or gloo's "connection reset"), and rank 0's
    watcher logs the same and ends the process (exit 1): the engine cannot step without it (a
    collective left waiting cannot be called back; `tinyoss serve` starts a new engine core)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _WORKER_DIES, str(tiny_dir), when],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-2000:]
    pid = run.stdout.split("worker ", 1)[1].split()[0]
    lost = f"tensor-parallel worker rank 1 (pid {pid}) was killed by SIGKILL"
    assert f"raised: {lost}, so this engine cannot go on" in run.stdout, run.stdout
    assert "still running" not in run.stdout
    assert f"{lost}, so the engine cannot go on; this process ends" in run.stderr


def test_a_stopped_worker_is_named_and_the_engine_goes_on_once_resumed(tiny_dir, caplog):
    """A worker stopped (SIGSTOP, a debugger) makes every call wait for it, silently until
    gloo's timeout: rank 0's watcher names it once, with how to resume it, and leaves it be;
    resumed, the call that waited ends with the same tokens."""
    import signal

    caplog.set_level(logging.INFO, logger="tinyoss")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(tiny_dir), device="cpu", dtype="float32", tensor_parallel_size=2,
             kv_cache_tokens=4096) as llm:
        want = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
        pid = llm.engine.executor.peers.procs[0].pid
        said = (f"tensor-parallel worker rank 1 (pid {pid}) is stopped (SIGSTOP or a debugger), "
                f"so every call waits for it: resume it with kill -CONT {pid}")
        got: list = []
        call = threading.Thread(target=lambda: got.append(
            llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids))
        os.kill(pid, signal.SIGSTOP)
        try:
            call.start()
            deadline = time.monotonic() + 10
            while said not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.05)
            time.sleep(3 * workers._POLL_S)  # still stopped: said once, the call still waits
            assert caplog.text.count(said) == 1 and call.is_alive() and not got
        finally:
            os.kill(pid, signal.SIGCONT)
        call.join(timeout=60)
        assert got == [want]
        deadline = time.monotonic() + 5
        while f"rank 1 (pid {pid}) runs again" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
        assert llm.engine.executor.peers.procs[0].poll() is None


def test_the_all_reduce_choice(monkeypatch):
    """`auto` takes tinyoss's own one-shot all-reduce where its kernel builds (sm_90 with nvcc),
    else FlashInfer's where it is built, else symmetric memory, else NCCL; the fast paths serve
    one engine a process (a second engine there hung in PyTorch's per-
    process rendezvous count on the GPUs), so a later one takes NCCL, or, asked for a fast path
    by name, is told which works."""
    from tinyoss.engine import comm

    class Symm:
        name, fuses_norm = "symm_mem one-shot", False

        def __init__(self, group, dtype) -> None:
            comm._uses_symmetric_memory()

    class FlashInfer:
        name, fuses_norm = "flashinfer one-shot", True

        def __init__(self, group, dtype, hidden) -> None:
            comm._uses_symmetric_memory()

    class Custom:
        name, fuses_norm = "custom one-shot", True

        def __init__(self, group, dtype, hidden) -> None:
            comm._uses_symmetric_memory()

    monkeypatch.setattr(comm, "_SymmMemAllReduce", Symm)
    monkeypatch.setattr(comm, "_FlashInferAllReduce", FlashInfer)
    monkeypatch.setattr(comm, "_CustomAllReduce", Custom)
    built, loads = [True], [False]
    monkeypatch.setattr(comm, "_flashinfer_built", lambda: built[0])
    monkeypatch.setattr(comm, "_custom_loads", lambda device: loads[0])

    no_peers: list[str | None] = [None]

    def choose(setting: str, earlier_engine: bool = False) -> str:
        monkeypatch.setenv(comm.ALL_REDUCE_ENV, setting)
        monkeypatch.setattr(comm, "_symmetric_memory_used", earlier_engine)
        group = comm.Group.__new__(comm.Group)  # as on GPUs, without starting NCCL
        group._nccl, group._fast, group.min = True, None, lambda v: v
        group.device = torch.device("cpu")
        group._without_peer_access = lambda: no_peers[0]
        return group.use_fast_all_reduce(torch.bfloat16, 2880)

    loads[0] = True
    assert choose("auto") == ("custom one-shot up to 512 KiB, fused with the residual add and "
                              "RMSNorm, nccl above")
    assert choose("custom").startswith("custom one-shot")
    loads[0] = False  # not sm_90, or no nvcc
    assert choose("auto").startswith("flashinfer one-shot up to 512 KiB, fused")
    assert choose("flashinfer").startswith("flashinfer") and choose("nccl") == "nccl"
    built[0] = False
    assert choose("auto").startswith("symm_mem one-shot")
    assert choose("auto").endswith("(minutes, once a machine)")
    assert choose("symm_mem").startswith("symm_mem one-shot")
    for setting in ("auto", "symm_mem", "custom", "flashinfer"):
        built[0] = setting == "auto"
        if setting == "auto":
            assert choose(setting, earlier_engine=True) == (
                "nccl (symmetric memory served an earlier engine of this process)")
        else:
            with pytest.raises(RuntimeError, match="serves one tensor-parallel engine a process"):
                choose(setting, earlier_engine=True)
    assert choose("nccl", earlier_engine=True) == "nccl"
    # GPUs that cannot read each other's memory (no NVLink or PCIe peer-to-peer path)
    built[0], no_peers[0] = True, "GPU 0 cannot access GPU 1 peer to peer"
    assert choose("auto") == "nccl (GPU 0 cannot access GPU 1 peer to peer)"
    for setting in ("symm_mem", "custom", "flashinfer"):
        with pytest.raises(RuntimeError, match=r"reads the other GPUs' memory, but GPU 0 cannot "
                                               r"access GPU 1 peer to peer; TINYOSS_ALL_RED"):
            choose(setting)
    assert choose("nccl") == "nccl"


def test_the_first_gpu_a_rank_cannot_read_peer_to_peer(monkeypatch):
    from tinyoss.engine import comm

    links = {(0, 1), (1, 0), (0, 2), (2, 0)}  # GPUs 1 and 2 share no peer-to-peer path
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) in links)
    assert comm._unreachable_peer(0, [0, 1, 2]) is None
    assert comm._unreachable_peer(1, [0, 1, 2]) == 2 and comm._unreachable_peer(2, [0, 1, 2]) == 1
    assert comm._unreachable_peer(1, [1]) is None  # itself is no peer


def test_a_second_tensor_parallel_llm_starts_once_the_first_is_closed(tiny_dir):
    """One tensor-parallel group a process: a second LLM while the first runs is refused with
    what to do (it used to fail on a bare torch.distributed error); `with` closes it, and a
    closed LLM says so."""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kwargs = {"device": "cpu", "dtype": "float32", "tensor_parallel_size": 2,
              "kv_cache_tokens": 4096}
    with LLM(str(tiny_dir), **kwargs) as first:
        assert " x 2 ranks (all-reduce: gloo)" in first.engine.info.summary  # bench records it
        want = first.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
        with pytest.raises(RuntimeError, match=r"close it first \(LLM.close\(\), or"):
            LLM(str(tiny_dir), **kwargs)
    with pytest.raises(RuntimeError, match="this LLM was closed"):
        first.generate(PROMPTS[:1], greedy, use_tqdm=False)
    assert _workers_of_this_process() == []
    second = LLM(str(tiny_dir), **kwargs)
    try:
        assert second.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids == want
    finally:
        second.close()


def test_only_a_failed_collective_is_blamed_on_a_lost_worker(monkeypatch):
    """Rank 0's own error (say, out of memory) stays its own though a worker has ended by then
    (of the same error): only a collective's failure becomes "worker N ... was killed"."""
    from tinyoss.engine.comm import GroupError
    from tinyoss.engine.executor import Executor

    class FakePeers:
        def lost(self, wait_s: float = 0.0) -> str:
            return "tensor-parallel worker rank 1 (pid 7) was killed by SIGKILL"

    executor = Executor.__new__(Executor)
    executor.peers, executor.stream = FakePeers(), None
    monkeypatch.setattr(executor, "_launch", lambda plan: (_ for _ in ()).throw(
        RuntimeError("CUDA out of memory")))
    with pytest.raises(RuntimeError, match="^CUDA out of memory$"):
        executor.launch(None)
    monkeypatch.setattr(executor, "_launch", lambda plan: (_ for _ in ()).throw(
        GroupError("[gloo] Connection reset by peer")))
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid 7\) was killed by SIGKILL, so this "
                                           r"engine cannot go on") as e:
        executor.launch(None)
    assert isinstance(e.value.__cause__, GroupError)


def test_how_a_worker_ended_is_said_for_any_exit():
    assert workers._how(1) == "exited with status 1"
    assert workers._how(-9) == "was killed by SIGKILL"
    assert workers._how(-40) == "was killed by signal 40"  # real-time signals have no name


def test_the_experts_pairs_go_to_the_all_reduce_up_to_its_tokens():
    """With a fast all-reduce that also sums the experts' pairs (`pairs_max_tokens` > 0), a
    step of up to that many tokens hands it the uncombined pair rows (one launch for the
    combine, the all-reduce, the residual add and the norm); a longer step combines first."""
    calls = []

    def moe(x, w, ids, experts):
        calls.append("moe")
        return x

    def moe_pairs(x, w, ids, experts):
        calls.append("pairs")
        return x.repeat_interleave(ids.shape[1], 0).float()

    def pairs_norm(y, ids, residual, weight, eps):
        calls.append(("pairs_norm", tuple(y.shape), tuple(ids.shape)))
        return residual, residual

    def reduce_norm(y, residual, weight, eps):
        calls.append("reduce_norm")
        return residual, residual

    kernels = Kernels(all_reduce=lambda x: x, all_reduce_norm=reduce_norm, moe=moe,
                      moe_pairs=moe_pairs, all_reduce_pairs_norm=pairs_norm, pairs_max_tokens=3)
    ids = torch.zeros(3, 4, dtype=torch.int32)
    for t in (3, 4):
        x = torch.zeros(t, 8)
        kernels.moe_then_norm(x, torch.ones(t, 4), ids[:1].expand(t, 4), None, x, x[0], 1e-5)
    assert calls == ["pairs", ("pairs_norm", (12, 8), (3, 4)), "moe", "reduce_norm"]
    calls.clear()
    kernels.pairs_max_tokens = 0  # NCCL, symmetric memory or FlashInfer's: the combine first
    kernels.moe_then_norm(x[:1], torch.ones(1, 4), ids[:1], None, x[:1], x[0], 1e-5)
    assert calls == ["moe", "reduce_norm"]
