"""bench/decode_grid.py without a GPU: each run's record appended to one file, runs already there
skipped, a failed run reported and left out, the table's medians and TP speed-ups."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from bench import decode_grid

FAKE = """
import json, sys
args = sys.argv[1:]
tp = int(args[args.index("--tensor-parallel-size") + 1])
bs = int(args[args.index("--batch-size") + 1])
if bs == 8 and tp == 2:
    sys.exit(3)  # a run that fails
tok = {1: 300.0, 2: 450.0}[tp] * bs
json.dump({"tok_per_s": tok, "ms_per_step_median": 1e3 * bs / tok, "roofline_fraction": 0.5,
           "ttft_ms": 40.0, "tensor_parallel_size": tp, "gpu": "FAKE", "commit": "abc"},
          open(args[args.index("--json") + 1], "w"))
"""


@pytest.fixture
def fake_runs(monkeypatch):
    """decode_latency.py replaced by FAKE; returns the list of processes started."""
    started = []
    real_commands, real_run = decode_grid.commands, decode_grid.run_one

    def commands(*a):
        return [(label, run, [sys.executable, "-c", FAKE, *cmd[2:]])
                for label, run, cmd in real_commands(*a)]

    def run(cmd, timeout):
        started.append(cmd)
        return real_run(cmd, timeout)

    monkeypatch.setattr(decode_grid, "commands", commands)
    monkeypatch.setattr(decode_grid, "run_one", run)
    return started


def _main(monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["decode_grid.py", *argv])
    decode_grid.main()


ONLY = "120b tp1 bs1,120b tp1 bs8,120b tp2 bs1,120b tp2 bs8"


def test_grid_appends_skips_and_tabulates(fake_runs, monkeypatch, tmp_path, capsys):
    out = tmp_path / "tp.jsonl"
    _main(monkeypatch, "tp", "--only", ONLY, "--runs", "2", "--out", str(out))
    assert len(fake_runs) == 8
    records = [json.loads(line) for line in out.read_text().splitlines()]
    labels = sorted({r["label"] for r in records})
    assert labels == ["120b tp1 bs1", "120b tp1 bs8", "120b tp2 bs1"]  # tp2 bs8 failed
    assert len(records) == 6 and {r["run"] for r in records} == {1, 2}
    assert "120b tp2 bs8 (run 1): failed (exit 3)" in capsys.readouterr().out
    table = out.with_suffix(".md").read_text()
    assert "| 120b tp2 bs1 | 450.0 |" in table and "| 1.50x |" in table
    assert "GPU FAKE; commit abc" in table

    fake_runs.clear()
    _main(monkeypatch, "tp", "--only", ONLY, "--runs", "2", "--out", str(out))
    lines = out.read_text().splitlines()
    assert len(lines) == 6  # nothing new: the failed runs failed again, the rest were skipped
    assert len(fake_runs) == 2 and all(c[c.index("--batch-size") + 1] == "8" for c in fake_runs)


def test_dry_run_lists_commands(monkeypatch, capsys):
    _main(monkeypatch, "roofline", "--dry-run", "--only", "120b", "--commit", "abc")
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1
    assert "--model gpt-oss-120b --gpu-memory-utilization 0.97 --iters 2 --commit abc" in printed[0]


def test_a_run_past_its_time_is_stopped_with_its_children(tmp_path):
    """A run that hangs (a tensor-parallel rank waiting on a dead peer) is killed with the
    processes it started."""
    pid_file = tmp_path / "child"
    hang = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)']); open(sys.argv[1], 'w').write(str(p.pid)); "
            "time.sleep(60)")
    assert decode_grid.run_one([sys.executable, "-c", hang, str(pid_file)], timeout=3) is None
    child = int(pid_file.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text()


def test_only_names_labels_by_whole_words(monkeypatch, capsys):
    """"20b bs1" picks 20b's batch-1 rows, not 120b's (a substring match ran all five)."""
    _main(monkeypatch, "roofline", "--dry-run", "--only", "20b bs1")
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 5 and not any("gpt-oss-120b" in line for line in printed)
    _main(monkeypatch, "tp", "--dry-run", "--only", "20b tp4")
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 4 and all("--tensor-parallel-size 4" in line for line in printed)


def test_expert_parallel_rows_compare_with_tp1_and_read_a_share_of_the_experts():
    """An `ep2` row's speed-up is over the same model's TP 1 row, and its roofline counts a
    rank's share of the experts (its config keeps each expert whole)."""
    from bench.decode_latency import bytes_per_step
    from tinyoss.config import ModelConfig

    rec = dict(ms_per_step_median=1.0, roofline_fraction=0.5, ttft_ms=1.0, gpu="G", commit="c")
    table = decode_grid.table([
        {**rec, "label": "120b tp1 bs8", "tok_per_s": 100.0, "tensor_parallel_size": 1},
        {**rec, "label": "120b ep2 bs8", "tok_per_s": 160.0, "tensor_parallel_size": 2}])
    assert "| 120b ep2 bs8 | 160.0 |" in table and "| 1.60x |" in table
    c = ModelConfig()
    whole = bytes_per_step(c, 8, 1024, ranks=2)["experts"]
    assert bytes_per_step(c, 8, 1024, ranks=2, expert_parallel=True)["experts"] == whole / 2
    assert "--enable-expert-parallel" in decode_grid.GRIDS["tp"]["120b ep2 bs8"]
