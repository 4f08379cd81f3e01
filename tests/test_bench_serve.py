"""bench/serve.py: its statistics on hand-made timings, and one whole run on the tiny model (the
offline child, a real `tinyoss serve` subprocess, a burst and two concurrency levels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import serve as bench

SCRIPT = Path(bench.__file__)


def test_stats_ms_percentiles_interpolate_linearly():
    s = bench.stats_ms([0.004, 0.001, 0.003, 0.002])
    assert s["n"] == 4
    assert s["p50"] == pytest.approx(2.5)
    assert s["p99"] == pytest.approx(3.97)  # rank 0.99 * 3 = 2.97: 3 ms + 0.97 of the last gap
    assert s["mean"] == pytest.approx(2.5)
    assert s["max"] == pytest.approx(4.0)
    assert bench.stats_ms([]) == {"n": 0, "p50": None, "p99": None, "mean": None, "max": None}


def test_itl_gaps_split_a_chunk_of_k_tokens_into_k_gaps():
    # chunks at 0, 0.1, 0.4, 0.5 s bringing the request to 1, 2, 5 and 6 tokens
    gaps = bench.itl_gaps([0.0, 0.1, 0.4, 0.5], [1, 2, 5, 6])
    assert gaps == pytest.approx([0.1] * 5)
    assert bench.itl_gaps([0.3], [1]) == []


def result(send, times, tokens, finish, error=None):
    return bench.RequestResult(send, finish, times, tokens, tokens[-1] if tokens else 0, error)


def test_level_stats():
    results = [
        result(0.0, [0.5, 0.6, 0.7, 0.8], [1, 2, 3, 4], 0.8),
        result(0.2, [1.0, 1.2], [1, 4], 1.2),  # its second chunk brought 3 tokens
        result(0.1, [], [], 0.15, error="HTTP 500: boom"),
    ]
    s = bench.level_stats(results, output_len=4)
    assert (s["requests"], s["ok"], s["failed"], s["short"]) == (3, 2, 1, 0)
    assert s["errors"] == ["HTTP 500: boom"]
    assert s["duration_s"] == pytest.approx(1.2)  # first send to last finish
    assert s["output_tokens"] == 8
    assert s["output_tok_s"] == pytest.approx(8 / 1.2)
    assert s["requests_s"] == pytest.approx(2 / 1.2)
    assert s["ttft_ms"]["p50"] == pytest.approx(650) and s["ttft_ms"]["max"] == pytest.approx(800)
    assert s["itl_ms"]["n"] == 6
    assert s["itl_ms"]["max"] == pytest.approx(100)
    assert s["itl_ms"]["mean"] == pytest.approx((3 * 100 + 3 * 200 / 3) / 6)
    assert s["tpot_ms"]["mean"] == pytest.approx((300 / 3 + 200 / 3) / 2)  # (e2e - ttft) / 3
    assert s["e2e_ms"]["p50"] == pytest.approx(900)
    assert bench.level_stats(results, output_len=5)["short"] == 2


def test_ratios():
    served = {"output_tok_s": 90.0, "ttft_ms": {"p50": 12.0}, "itl_ms": {"p50": 3.0}}
    offline = {"output_tok_s": 100.0, "ttft_ms": {"p50": 10.0}, "itl_ms": {"p50": 2.0}}
    assert bench.ratios(served, offline) == pytest.approx(
        {"output_tok_s": 0.9, "ttft_p50": 1.2, "itl_p50": 1.5}
    )
    assert bench.ratios(served, {"output_tok_s": 45.0}) == {"output_tok_s": 2.0}


@pytest.mark.slow
def test_end_to_end_tiny(tmp_path):
    out = tmp_path / "run.json"
    cmd = [
        sys.executable, str(SCRIPT), "--model", "tiny", "--concurrency", "1", "2",
        "--num-prompts", "2", "--input-len", "16", "--output-len", "8",
        "--kv-cache-tokens", "4096", "--max-model-len", "512",
        "--burst", "2", "--burst-input-len", "16", "--burst-output-len", "8", "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    assert record["model"] == "tiny" and record["gpu"] == "cpu"
    assert [level["concurrency"] for level in record["levels"]] == [1, 2]
    for level in record["levels"]:
        served, off = level["served"], level["offline"]
        assert (served["ok"], served["failed"], served["short"]) == (2, 0, 0), served
        assert served["output_tokens"] == 2 * 8
        assert served["itl_ms"]["n"] > 0 and served["ttft_ms"]["p50"] > 0
        assert off["output_tokens"] == level["concurrency"] * 8 and off["output_tok_s"] > 0
        assert level["served_over_offline"]["output_tok_s"] > 0
    assert record["levels"][0]["offline"]["itl_ms"]["p50"] > 0
    assert set(record["levels"][0]["served_over_offline"]) == {"output_tok_s", "ttft_p50", "itl_p50"}
    burst = record["burst"]
    for run in (burst["first"], burst["repeat"]):
        assert (run["ok"], run["failed"], run["output_tokens"]) == (2, 0, 16)
    assert burst["first_over_repeat"] > 0
    assert "offline batch-1 stream" in proc.stdout
