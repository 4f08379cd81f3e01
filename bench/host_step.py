"""Whether a decode step at batch B waits for the GPU or the GPU waits for the host: N greedy
streams decode for --steps steps of `EngineCore.step()`, timed from outside (no profiler, which
slows the host), with each step's wall time split into the executor's launch (the next step's
copies and graph replay), the wait for the previous step's tokens (`HostCopy.wait`), and the rest
(the host's own work: scheduling, results, deltas); beside it the decode graph replayed alone.
A step whose wait is near zero is host-bound: the GPU idled for the host. `--parts` also times
calls inside those (the graph replay call, the attention plan, the sampler's queueing, ...).

    python bench/host_step.py --batch 8,64 --steps 100
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.decode_latency import graph_alone_ms  # noqa: E402
from bench.step_timer import start_streams  # noqa: E402
from tinyoss import LLM  # noqa: E402
from tinyoss.engine import executor as executor_module  # noqa: E402
from tinyoss.engine import transfer  # noqa: E402


class Clock:
    """Seconds spent in wrapped calls since the last `take`."""

    def __init__(self) -> None:
        self.spent = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - t0
        return timed

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--batch", default="8,64")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--parts", action="store_true", help="also time calls inside the step")
    args = p.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(args.model, load_format="dummy", max_num_seqs=max(batches),
              max_model_len=args.prompt_len + args.steps + 64)
    core = llm.engine
    launch, wait = Clock(), Clock()
    core.executor.launch = launch.wrap(core.executor.launch)
    transfer.HostCopy.wait = wait.wrap(transfer.HostCopy.wait)
    parts: dict[str, Clock] = {}
    if args.parts:
        graphs = core.executor.graphs
        for name, owner, attr in [
                ("graph.replay", torch.cuda.CUDAGraph, "replay"),
                ("attention.plan", graphs.attention, "plan") if graphs else (None, None, None),
                ("build_batch", executor_module, "build_batch"),
                ("complete", core.executor, "complete"),
                ("finish", core, "_finish"),
                ("chain", core.scheduler, "chain"),
                ("sampler", core.executor, "sampler")]:
            if name is not None:
                parts[name] = Clock()
                setattr(owner, attr, parts[name].wrap(getattr(owner, attr)))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{device} | {args.model} | prompt {args.prompt_len} | "
          f"ms a step (median of {args.steps})")
    for batch in batches:
        rng = random.Random(batch)
        start_streams(core, batch, args.prompt_len, args.steps + 8, rng)
        for _ in range(4):
            core.step()
        rows = []
        launch.take(), wait.take()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            core.step()
            wall = time.perf_counter() - t0
            rows.append((wall, launch.take(), wait.take(), *(c.take() for c in parts.values())))
        while core.has_work():
            core.step()
        med = [statistics.median(r[i] for r in rows) * 1e3 for i in range(3)]
        print(f"batch {batch:3d}: step {med[0]:.3f} | launch {med[1]:.3f} | wait for tokens "
              f"{med[2]:.3f} | host's own work {med[0] - med[1] - med[2]:.3f} | "
              f"decode graph alone {graph_alone_ms(core, batch):.3f}")
        if parts:
            meds = [statistics.median(r[3 + i] for r in rows) * 1e3 for i in range(len(parts))]
            print("    " + " | ".join(f"{n} {m:.3f}" for n, m in zip(parts, meds)))


if __name__ == "__main__":
    main()
