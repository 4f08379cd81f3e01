"""bench/trace_gaps.py on a made-up trace: busy and idle time, overlapping events counted once,
gaps named by the kernels on either side, CPU events left out."""

from __future__ import annotations

import json

from bench import trace_gaps


def test_idle_gaps_and_kernel_totals(tmp_path, capsys, monkeypatch):
    def kernel(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [
        kernel("void _gemv<1, 8>(float*)", 100, 10),  # 100-110
        kernel("_partial_kernel", 112, 5),  # gap 2 after _gemv
        kernel("Memcpy HtoD (Pageable -> Device)", 115, 4, "gpu_memcpy"),  # overlaps: no gap
        kernel("void _gemv<1, 8>(float*)", 130, 10),  # gap 11 (from 119)
        kernel("aten::argmax", 105, 50, "cpu_op"),  # host work: not GPU time
        kernel("_partial_kernel", 145, 5),  # gap 5 after _gemv
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    gpu = trace_gaps.gpu_events(str(path))
    assert [e["ts"] for e in gpu] == [100, 112, 115, 130, 145]
    s = trace_gaps.summarize(gpu)
    assert s.span_us == 50 and s.busy_us == 34 and s.idle_us == 18
    assert s.gaps[("_gemv", "_partial_kernel")] == [7, 2]
    assert s.gaps[("Memcpy HtoD", "_gemv")] == [11, 1]
    assert s.kernels["_gemv"] == [20, 2] and s.kernels["_partial_kernel"] == [10, 2]
    monkeypatch.setattr("sys.argv", ["trace_gaps.py", str(path), "--top", "3"])
    trace_gaps.main()
    out = capsys.readouterr().out
    assert "5 GPU events over 0.050 ms: busy 0.034 ms, idle 0.018 ms (36.0%)" in out
