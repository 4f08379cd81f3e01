"""bench/prefill_stall.py runs end to end on `tiny` (CPU): its step timing and its report."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_prefill_stall_reports_on_tiny():
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(
        [sys.executable, "bench/prefill_stall.py", "--long-len", "300", "--alone-steps", "4",
         "--streams", "2", "--budgets", "0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("budget 0 ms"))
    assert "2 streams alone: ITL p50" in line and "300-token prompt is admitted" in line
    slowest = re.search(r"chunk\): \[\((\S+), (\S+), (\S+), 0, 300\)", line)
    assert slowest, line  # the whole prompt went in one step, from context 0
    wall, gpu, host = (float(v.rstrip(",")) for v in slowest.groups())
    assert wall > 0 and gpu == wall and 0 < host <= wall  # on a CPU the event time is the wall
