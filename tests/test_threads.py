"""The CPU thread rule: the user's choice first, then the usable physical cores less one."""

import logging

import pytest
import torch

from tinyoss import threads
from tinyoss.threads import cgroup_cpu_limit, choose_threads, physical_cores


@pytest.mark.parametrize("var", ["OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_an_env_var_leaves_torch_alone(var):
    assert choose_threads({var: "3"}, 3, {8}, 8, None) == (None, f"{var}=3 is set")


def test_a_set_num_threads_call_before_the_build_is_kept():
    chosen, why = choose_threads({}, 5, {4, 8}, 4, None)
    assert chosen is None and "torch.set_num_threads" in why and "default here: 4 or 8" in why


def test_one_usable_core_is_left_free():
    assert choose_threads({"OMP_NUM_THREADS": ""}, 8, {8}, 8, None)[0] == 7
    assert choose_threads({}, 2, {2}, 2, None) == (
        1, "2 usable core(s), one left free; set OMP_NUM_THREADS to choose"
    )
    assert choose_threads({}, 1, {1}, 1, None) == (1, "1 usable core(s)")


def test_tensor_parallel_ranks_share_the_cores():
    assert choose_threads({}, 16, {16}, 16, None, ranks=2) == (
        7, "16 usable core(s), one left free, shared by 2 ranks; set OMP_NUM_THREADS to choose")
    assert choose_threads({}, 2, {2}, 2, None, ranks=4)[0] == 1


def test_a_cgroup_quota_caps_the_cores():
    assert choose_threads({}, 16, {16}, 16, 4) == (
        3, "4 usable core(s), cgroup quota 4, one left free; set OMP_NUM_THREADS to choose"
    )
    assert choose_threads({}, 16, {2, 16}, 2, 4)[0] == 1  # affinity narrower than the quota


def test_torch_defaults_of_either_build_are_not_taken_for_the_users():
    # taskset -c 0,1 on a 16-core machine: MKL builds default to 2 threads, others to 16
    for current in (2, 16):
        assert choose_threads({}, current, {2, 16}, 2, None)[0] == 1


def _topology(root, siblings, name="core_cpus_list"):
    for cpu, sib in enumerate(siblings):
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / name).write_text(sib + "\n")
    return root


def test_hyperthreads_of_one_core_count_once(tmp_path):
    sysfs = _topology(tmp_path, ["0,2", "1,3", "0,2", "1,3"])  # 2 cores, 2 threads each
    assert physical_cores(range(4), sysfs) == 2
    assert physical_cores({0, 2}, sysfs) == 1  # affinity: both threads of one core
    assert physical_cores({0, 1}, sysfs) == 2


def test_older_kernels_and_no_topology(tmp_path):
    old = _topology(tmp_path / "old", ["0-1", "0-1"], name="thread_siblings_list")
    assert physical_cores(range(2), old) == 1
    assert physical_cores(range(3), tmp_path / "none") == 3  # unknown: every CPU a core


@pytest.mark.parametrize(
    "files, limit",
    [
        ({"cpu.max": "max 100000"}, None),
        ({"cpu.max": "150000 100000"}, 2),
        ({"cpu.max": "50000 100000"}, 1),
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
        ({"cpu/cpu.cfs_quota_us": "400000", "cpu/cpu.cfs_period_us": "100000"}, 4),
        ({}, None),
    ],
)
def test_cgroup_quota(tmp_path, files, limit):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    assert cgroup_cpu_limit(tmp_path) == limit


@pytest.fixture
def fresh_threads(monkeypatch):
    """Nothing chosen yet in this process; torch's thread count put back afterwards."""
    monkeypatch.setattr(threads, "_chosen", None)
    monkeypatch.setattr(threads, "_ranks", 1)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_configure_applies_the_rule_once_and_logs_it(fresh_threads, monkeypatch, caplog):
    for var in threads.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(threads, "physical_cores", lambda cpus: 3)
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: None)
    torch.set_num_threads(3)  # torch's default on this pretend 3-core machine
    with caplog.at_level(logging.INFO, logger="tinyoss"):
        threads.configure_cpu_threads()
        threads.configure_cpu_threads()  # a second engine: already chosen, not the user's
    assert torch.get_num_threads() == 2
    assert [r.getMessage() for r in caplog.records] == [
        "CPU threads: 2 (3 usable core(s), one left free; set OMP_NUM_THREADS to choose)"
    ]


def test_configure_keeps_the_env_choice(fresh_threads, monkeypatch, caplog):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    with caplog.at_level(logging.INFO, logger="tinyoss"):
        threads.configure_cpu_threads()
    assert torch.get_num_threads() == 1
    assert caplog.messages == ["CPU threads: 1 (OMP_NUM_THREADS=1 is set)"]


def test_a_tensor_parallel_engine_after_another_shares_the_cores(fresh_threads, monkeypatch,
                                                                  caplog):
    """tinyoss's own choice for one rank is not taken for the user's when a later engine has
    several ranks (each rank had kept all cores but one)."""
    for var in threads.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(threads, "physical_cores", lambda cpus: 9)
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: None)
    torch.set_num_threads(9)
    threads.configure_cpu_threads()
    assert torch.get_num_threads() == 8
    threads.configure_cpu_threads(ranks=2)
    assert torch.get_num_threads() == 4
