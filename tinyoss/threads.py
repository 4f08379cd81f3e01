"""How many threads torch runs CPU ops on, chosen once when an engine is built for the CPU.

Torch's default is every physical core it sees (of the machine, or of the CPUs this process may
run on, depending on its build), and never a container's cgroup quota. And with OpenMP's
spin-waiting, a thread that loses its core to another process stalls every parallel op until
it gets it back: on a 2-core VM busy with other work, `tiny` decoded 64 tokens in 1.1-1.9 s on
one thread and 9-48 s on two (torch's default there); idle, in 1.2 s on either. So tinyoss
leaves one usable core free (for the server's HTTP process, the detokenizer, the rest of the
machine), unless the user chose: OMP_NUM_THREADS / MKL_NUM_THREADS, or a
`torch.set_num_threads` call before the engine was built.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

import torch

log = logging.getLogger("tinyoss")

ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
CPU_SYSFS = Path("/sys/devices/system/cpu")
CGROUP = Path("/sys/fs/cgroup")
_chosen: int | None = None  # what tinyoss set, so a second engine does not take it for the user's
_ranks = 1  # the tensor-parallel ranks it was chosen for


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def physical_cores(cpus: Iterable[int], sysfs: Path = CPU_SYSFS) -> int:
    """Distinct cores among `cpus`: hyperthreads of one core list the same siblings in sysfs. A
    CPU whose topology sysfs does not show counts as a core of its own."""
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        siblings = _read(topology / "core_cpus_list") or _read(topology / "thread_siblings_list")
        cores.add(siblings or f"cpu{cpu}")
    return len(cores)


def cgroup_cpu_limit(root: Path = CGROUP) -> int | None:
    """The CPUs a cgroup quota allows (v2 cpu.max, else v1 cfs files), rounded up; None: none."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
    else:
        quota = _read(root / "cpu" / "cpu.cfs_quota_us") or "max"
        period = _read(root / "cpu" / "cpu.cfs_period_us") or "100000"
    if quota in ("max", "-1") or not period:
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def choose_threads(
    env: Mapping[str, str], current: int, torch_defaults: Collection[int], cores: int,
    quota: int | None, ranks: int = 1,
) -> tuple[int | None, str]:
    """(threads to set, or None to leave torch's setting alone; why), from the environment,
    torch's current count and what its default may be, the usable physical cores and the
    cgroup quota; `ranks` processes of a tensor-parallel engine share the cores."""
    for var in ENV_VARS:
        if env.get(var):
            return None, f"{var}={env[var]} is set"
    if current not in torch_defaults:
        default = " or ".join(map(str, sorted(torch_defaults)))
        return None, f"set by torch.set_num_threads; torch's default here: {default}"
    usable = min(cores, quota) if quota else cores
    where = f"{usable} usable core(s)" + (f", cgroup quota {quota}" if quota else "")
    if usable <= 1:
        return 1, where
    if ranks > 1:
        return (max(1, (usable - 1) // ranks),
                f"{where}, one left free, shared by {ranks} ranks; set OMP_NUM_THREADS to choose")
    return usable - 1, f"{where}, one left free; set OMP_NUM_THREADS to choose"


def configure_cpu_threads(ranks: int = 1) -> None:
    """Applies `choose_threads` to this process (one of `ranks`) and logs the choice (once per
    process)."""
    global _chosen, _ranks
    current = torch.get_num_threads()
    if _chosen == current and _ranks == ranks:
        return
    everything = range(os.cpu_count() or 1)
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else everything
    cores = physical_cores(usable)
    defaults = {cores, physical_cores(everything)}  # MKL builds count the affinity mask
    if _chosen == current:  # tinyoss's own earlier choice, for another number of ranks
        defaults.add(current)
    threads, why = choose_threads(os.environ, current, defaults, cores, cgroup_cpu_limit(),
                                  ranks)
    if threads is not None:
        torch.set_num_threads(threads)
    _chosen, _ranks = torch.get_num_threads(), ranks
    log.info("CPU threads: %d (%s)", _chosen, why)
