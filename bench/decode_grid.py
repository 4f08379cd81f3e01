"""A named set of decode_latency.py runs in one command, their records in one JSON-lines file and
a markdown table: the issue-18 roofline table, the same engine sized as `tinyoss serve` sizes it
(`served`), the dense GEMVs' batches 1-8 in bf16 and FP8, or tensor parallelism's scaling
(issue 19).

    python bench/decode_grid.py roofline --commit abc1234 --out $OUT/roofline.jsonl --runs 2
    python bench/decode_grid.py tp --commit abc1234 --out $OUT/tp.jsonl --only "20b tp1,20b tp2"
    python bench/decode_grid.py tp --dry-run          # the commands, nothing run

Each run is its own process (a fresh engine, as when measured one by one), and its record is
appended as soon as it ends, so a device call stopped at its time limit keeps what finished;
runs already in `--out` (same label and run number) are skipped, so the same command goes on
where the last one stopped. The table gives each configuration's median over its runs and, for
`tp`, the speed-up over tensor parallel 1 of the same model and batch (what issue 19 asks:
120b at TP 2 >= 1.7x).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIG = ["--model", "gpt-oss-120b", "--gpu-memory-utilization", "0.97"]

# label -> decode_latency.py arguments (20b, input 1024, output 256 unless said)
GRIDS: dict[str, dict[str, list[str]]] = {
    "roofline": {
        "20b bs1": ["--batch-size", "1"],
        "20b bs1 8k": ["--input-len", "8192"],
        "20b bs1 32k": ["--input-len", "32768"],
        "20b bs8": ["--batch-size", "8"],
        "20b bs64": ["--batch-size", "64"],
        "120b bs1": BIG,
        "20b bs1 mxfp4-all": ["--mxfp4-layers", "all"],
        "20b bs1 fp8-all": ["--fp8-layers", "all"],
    },
    "served": {  # the engine sized as `tinyoss serve` sizes it: 128k context, 256 sequences
        f"20b bs{bs}{f' {ctx // 1024}k' * (ctx > 1024)} served": [
            "--batch-size", str(bs), "--input-len", str(ctx), "--max-model-len", "131072",
            "--max-num-seqs", "256"]
        for bs, ctx in ((1, 1024), (1, 8192), (8, 1024))
    },
    "gemv": {  # the dense GEMV's routing (bf16, FP8) at the batches where it changes
        f"20b bs{bs}{' fp8-all' * fp8}": ["--batch-size", str(bs)]
        + (["--fp8-layers", "all"] if fp8 else [])
        for fp8 in (False, True) for bs in (1, 2, 4, 8)
    },
    "tp": {
        f"{model} tp{tp} bs{bs}": (BIG if model == "120b" else [])
        + ["--tensor-parallel-size", str(tp), "--batch-size", str(bs)]
        for model in ("20b", "120b") for tp in (1, 2, 4) for bs in (1, 8, 16, 64)
    } | {  # expert parallel: the experts dealt out whole (`ep2`: over 2 GPUs)
        f"{model} ep{tp} bs{bs}": (BIG if model == "120b" else [])
        + ["--tensor-parallel-size", str(tp), "--enable-expert-parallel", "--batch-size", str(bs)]
        for model in ("20b", "120b") for tp in (2, 4) for bs in (1, 8, 64)
    },
}


def read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(records: list[dict]) -> str:
    """Markdown: a row per label (median of its runs), with TP speed-up where TP 1 was run."""
    by_label: dict[str, list[dict]] = {}
    for r in records:
        by_label.setdefault(r["label"], []).append(r)
    speed = {label: statistics.median(r["tok_per_s"] for r in rs)
             for label, rs in by_label.items()}
    lines = ["| run | tok/s | ms/step | of roofline | TTFT ms | runs | vs TP 1 |",
             "|---|---|---|---|---|---|---|"]
    for label, rs in by_label.items():
        tp = rs[0].get("tensor_parallel_size", 1)
        base = re.sub(rf"\b[te]p{tp} ", "tp1 ", label) if tp > 1 else None
        vs = f"{speed[label] / speed[base]:.2f}x" if base in speed else ""
        med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731
        lines.append(
            f"| {label} | {speed[label]:.1f} | {med('ms_per_step_median'):.3f} | "
            f"{100 * med('roofline_fraction'):.1f}% | {med('ttft_ms'):.1f} | "
            f"{' / '.join(format(r['tok_per_s'], '.1f') for r in rs)} | {vs} |"
        )
    gpu = {r["gpu"] for r in records}
    commits = {r["commit"] for r in records}
    return "\n".join([f"GPU {', '.join(sorted(gpu))}; commit {', '.join(sorted(commits))}", "",
                      *lines])


def _names(part: str, label: str) -> bool:
    """Whether `part` names `label` by whole words: "20b bs1" names "20b bs1 8k" but not
    "120b bs1" or "20b bs16"."""
    return f" {part.strip()} " in f" {label} "


def commands(grid: str, only: list[str], runs: int, commit: str | None,
             extra: list[str]) -> list[tuple[str, int, list[str]]]:
    out = []
    for label, args in GRIDS[grid].items():
        if only and not any(_names(o, label) for o in only):
            continue
        cmd = [sys.executable, str(HERE / "decode_latency.py"), *args, "--iters", "2", *extra]
        if commit:
            cmd += ["--commit", commit]
        out += [(label, run, cmd) for run in range(1, runs + 1)]
    return out


def run_one(cmd: list[str], timeout: float) -> int | None:
    """The run's exit status, or None when it ran past `timeout`; then it is stopped with
    everything it started (tensor-parallel workers), so no GPU stays taken."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("grid", choices=tuple(GRIDS))
    p.add_argument("--out", type=Path, default=None, help="JSON-lines file of the records")
    p.add_argument("--runs", type=int, default=1, help="runs of each configuration")
    p.add_argument("--only", default="",
                   help="comma list: run labels containing any of these as whole words")
    p.add_argument("--commit", default=None, help="passed to decode_latency.py --commit")
    p.add_argument("--timeout", type=float, default=600, help="seconds for one run")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args, extra = p.parse_known_args()  # the rest goes to every decode_latency.py run
    todo = commands(args.grid, [o for o in args.only.split(",") if o], args.runs, args.commit,
                    extra)
    if args.dry_run:
        for label, run, cmd in todo:
            print(f"{label} (run {run}): {' '.join(cmd)}")
        return
    if args.out is None:
        p.error("--out is needed unless --dry-run")
    done = {(r["label"], r["run"]) for r in read(args.out)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for label, run, cmd in todo:
        if (label, run) in done:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            record_path = Path(tmp) / "record.json"
            t0 = time.perf_counter()
            print(f"== {label} (run {run}): {' '.join(cmd)}", flush=True)
            code = run_one(cmd + ["--json", str(record_path)], args.timeout)
            if code is None:
                print(f"== {label} (run {run}): over {args.timeout:.0f} s, stopped", flush=True)
                continue
            if code != 0 or not record_path.exists():
                print(f"== {label} (run {run}): failed (exit {code})", flush=True)
                continue
            record = json.loads(record_path.read_text())
        record |= {"label": label, "run": run, "wall_s": round(time.perf_counter() - t0, 1)}
        with args.out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"== {label} (run {run}): {record['tok_per_s']:.1f} tok/s in "
              f"{record['wall_s']:.0f} s", flush=True)
    records = [r for r in read(args.out) if r["label"] in GRIDS[args.grid]]
    if records:
        summary = table(records)
        args.out.with_suffix(".md").write_text(summary + "\n")
        print(summary)


if __name__ == "__main__":
    main()
