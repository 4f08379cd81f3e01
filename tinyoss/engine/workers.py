"""Tensor parallelism's processes: rank 0 (the engine core) starts one worker per other GPU.

Each worker builds its slice of the model (`builder.build_rank`), KV cache and CUDA graphs,
then follows rank 0: for every step plan it runs the same forward pass (`Executor.forward`), so
that its collectives meet rank 0's. Only rank 0 schedules, samples and talks to clients; a
worker never syncs with its host, and a chained step's input tokens reach it by a broadcast
from rank 0's GPU.

Workers are plain `python -m tinyoss.engine.workers` processes (the engine core may itself be a
daemon process, which multiprocessing forbids to have children) joined to rank 0 by a socket
pair: rank 0 sends the plans down it, pickled once for all workers. A worker that fails sends
why up it and exits; rank 0 then cannot step (its collectives would wait forever), so it logs
the reason and exits too (`tinyoss serve` starts a new engine core). A worker exits when rank 0
goes away. A stopped worker (SIGSTOP, a debugger) is named in rank 0's log, once per stop, and
left to be resumed: until then every call waits for it.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from tinyoss.config import EngineConfig
from tinyoss.engine.comm import NO_MULTICAST, Group, GroupError
from tinyoss.engine.step import StepPlan
from tinyoss.progress import thread_lock_only

log = logging.getLogger("tinyoss")

ENDS = ("a collective left waiting for a lost rank cannot be called back; `tinyoss serve` runs "
        "the engine in a process of its own and starts a new one")
_POLL_S = 0.5  # how often a worker checks that rank 0 still lives, and rank 0 for stopped ones
_GRACE_S = 2.0  # how long rank 0 may take to fail on its own after a worker did
_ABORT_S = 10.0  # how long rank 0 waits to leave the group after its own failure


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU from the configured one (cuda = cuda:0), or the CPU."""
    base = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if base.type != "cuda":
        return base
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no GPU or driver found"
        raise ValueError(f"device {config.device!r} was asked for, but PyTorch finds no CUDA GPU "
                         f"here ({build}): give device='cpu' (the built-in 'tiny' model runs "
                         "there)")
    index = (base.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size {config.tensor_parallel_size} needs GPUs "
            f"{base.index or 0}..{(base.index or 0) + config.tensor_parallel_size - 1}, but "
            f"torch sees {torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", index)


class Peers:
    """Rank 0's side: the workers, their channels, and the group's collectives (`group`)."""

    def __init__(self, config: EngineConfig, folder: Path | None, device: torch.device) -> None:
        size = config.tensor_parallel_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine already runs in this process: close it first "
                "(LLM.close(), or start it as `with LLM(...) as llm:`), then start this one")
        for rank in range(1, size):
            rank_device(config, rank)  # every GPU exists, before anything starts
        os.environ.update(NO_MULTICAST)
        with socket.socket() as s:  # a free port for the group's rendezvous
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        self.conns: list[Connection] = []
        self.procs: list[subprocess.Popen] = []
        self.closing = False
        self._reasons: dict[int, str | None] = {}
        self._reasons_lock = threading.Lock()
        for rank in range(1, size):
            ours, theirs = socket.socketpair()
            self.procs.append(subprocess.Popen(  # a session of its own: Ctrl-C is rank 0's
                [sys.executable, "-m", "tinyoss.engine.workers", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env={**os.environ, **NO_MULTICAST},
                start_new_session=True,
            ))
            theirs.close()
            conn = Connection(ours.detach())
            conn.send((config, None if folder is None else str(folder), rank, init, os.getpid()))
            self.conns.append(conn)
        threading.Thread(target=self._watch, name="tinyoss-tp-watch", daemon=True).start()
        log.info("tensor parallelism: %d ranks, workers started (pids %s)", size,
                 [p.pid for p in self.procs])
        try:
            self.group = Group(0, size, device, init)
        except BaseException:  # Ctrl-C or a failed rendezvous: no group to leave yet
            self.closing = True
            for proc in self.procs:
                proc.kill()
                proc.wait()
            for conn in self.conns:
                conn.close()
            if torch.distributed.is_initialized():  # joined, then failed: let a retry start
                _within(_ABORT_S, torch.distributed.destroy_process_group)
            raise

    def send(self, plan: StepPlan) -> None:
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send_bytes(data)
            except OSError as e:  # the watcher logs why and ends this process
                raise GroupError(f"tensor-parallel worker {rank} is gone ({e})") from e

    def lost(self, wait_s: float = 0.0) -> str | None:
        """Which worker has ended, how, and what it said (waiting up to `wait_s` for one to be
        reaped: a collective can fail a moment before its peer's exit is seen), or None. A
        worker killed by a signal is named before others that ended of the broken group."""
        deadline = time.monotonic() + wait_s
        while True:
            ended = [(rank, proc, code) for rank, proc in enumerate(self.procs, 1)
                     if (code := proc.poll()) is not None]
            if ended:
                rank, proc, code = min(ended, key=lambda e: (e[2] >= 0, e[0]))
                why = (self._reason(rank) or "").split("\n", 1)[0]  # the rest is the log's
                more = f" ({len(ended) - 1} more ended)" if len(ended) > 1 else ""
                return (f"tensor-parallel worker rank {rank} (pid {proc.pid}) {_how(code)}"
                        f"{more}{' (' + why + ')' if why else ''}")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _reason(self, rank: int) -> str | None:
        """What worker `rank` sent up before it ended (its error), read once and kept."""
        with self._reasons_lock:
            if rank not in self._reasons:
                conn = self.conns[rank - 1]
                try:
                    self._reasons[rank] = conn.recv()[1] if conn.poll(0) else None
                except (EOFError, OSError):
                    self._reasons[rank] = None
            return self._reasons[rank]

    def _watch(self) -> None:
        """A worker that ends while rank 0 runs leaves rank 0 unable to step: exit with why.
        The process ends even between calls: a collective or an all-reduce kernel left waiting
        for the lost rank cannot be called back. Meanwhile, every `_POLL_S`, a stopped worker
        is named (`_say_stopped`)."""
        try:
            sentinels = [os.pidfd_open(p.pid) for p in self.procs]
        except OSError:  # no pidfds (old kernel, seccomp): a dead worker's socket closes too
            sentinels = []
        stopped: set[int] = set()
        try:
            while not wait(self.conns + sentinels, timeout=_POLL_S) and not self.closing:
                stopped = self._say_stopped(stopped)
        except OSError:  # the channels closed under it: rank 0 is closing or failed to start
            pass
        for fd in sentinels:
            os.close(fd)
        time.sleep(_GRACE_S)  # rank 0 met the same error (a config both ranks refuse)?
        if self.closing:  # then it raises its own, and has stopped the workers
            return
        why = self.lost(wait_s=1.0) or "a tensor-parallel worker closed its channel"
        for rank in range(1, len(self.procs) + 1):
            if "\n" in (said := self._reason(rank) or ""):
                log.error("worker %d's error: %s", rank, said)
        log.error("%s, so the engine cannot go on; this process ends (%s)", why, ENDS)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)

    def _say_stopped(self, before: set[int]) -> set[int]:
        """Warns once per stop about a worker that is stopped (SIGSTOP, SIGTSTP, a debugger):
        every collective waits for it, silently until gloo's or NCCL's timeout. It may be
        resumed, so it is only named, never ended; returns the ranks stopped now."""
        now = {rank for rank, proc in enumerate(self.procs, 1) if _stopped(proc.pid)}
        for rank in sorted(now - before):
            pid = self.procs[rank - 1].pid
            log.warning("tensor-parallel worker rank %d (pid %d) is stopped (SIGSTOP or a "
                        "debugger), so every call waits for it: resume it with kill -CONT %d",
                        rank, pid, pid)
        for rank in sorted(before - now):
            log.info("tensor-parallel worker rank %d (pid %d) runs again", rank,
                     self.procs[rank - 1].pid)
        return now

    def close(self) -> None:
        """Stops the workers; every rank leaves the group together (NCCL's teardown waits for
        all of them), then the workers exit."""
        self.closing = True
        for conn in self.conns:
            try:
                conn.send_bytes(b"")  # the stop signal
            except OSError:
                pass
        self.group.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def kill(self) -> None:
        """Rank 0 failed while the workers may wait in a collective: end them, and leave the
        group without waiting for them."""
        self.closing = True
        for proc in self.procs:
            proc.kill()
            proc.wait()
        # NCCL's abort has been seen to wait for ever here on the GPUs; rank 0's own error
        # matters more than a clean exit from the group
        _within(_ABORT_S, self.group.abort)


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped: state T (a stop signal) or t (held by a tracer) in
    /proc/PID/stat, Linux's; False where that cannot be read (another OS, the process gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split(maxsplit=1)[0]  # the name may hold ")"
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


def _how(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:  # real-time signals have no name
        return f"was killed by signal {-code}"


def _within(seconds: float, fn) -> None:
    """fn() in a thread given `seconds`: leaving a group has been seen to wait for ever."""
    leaving = threading.Thread(target=fn, name="tinyoss-group-leave", daemon=True)
    leaving.start()
    leaving.join(seconds)
    if leaving.is_alive():
        log.warning("leaving the tensor-parallel group did not finish in %.0f s; going on",
                    seconds)


def _exit_with(parent: int) -> None:
    """Ends this worker when rank 0's process is gone, wherever the worker waits (a
    collective, a GPU sync, the next plan): a clean shutdown could wait forever."""
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    os._exit(0)


def _main(fd: int) -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s tinyoss.worker: %(message)s")
    conn = Connection(fd)
    thread_lock_only()
    config, folder, rank, init, parent = conn.recv()
    threading.Thread(target=_exit_with, args=(parent,), name="tinyoss-rank0-watch",
                     daemon=True).start()
    try:
        from tinyoss.engine.builder import build_worker

        executor, group = build_worker(config, None if folder is None else Path(folder), rank,
                                       init)
        with torch.inference_mode():
            while True:
                data = conn.recv_bytes()
                if not data:
                    break
                executor.follow(pickle.loads(data), group)
        executor.drop_graphs()
        group.close()
    except BaseException as e:  # noqa: BLE001 - rank 0 must hear why
        try:
            conn.send(("dead", f"rank {rank}: {e!r}\n{traceback.format_exc()}"))
        except OSError:
            pass
        os._exit(1)


if __name__ == "__main__":
    _main(int(sys.argv[1]))
