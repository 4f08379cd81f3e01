"""Builds a CUDA C++ source of tinyoss/kernels into a small shared library with nvcc, once a
machine: no PyTorch headers (a few seconds), cached by the source's hash under TINYOSS_CACHE
(~/.cache/tinyoss); the library is loaded with ctypes and launches on PyTorch's stream."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tinyoss.tools.make_checkpoint import cache_dir

log = logging.getLogger("tinyoss")


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build(nvcc: str, source: Path, what: str) -> Path:
    """The library for `source` (sm_90a), built into the cache unless it is there; `what` names
    it in the log."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        cmd = [nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17",
               "-gencode=arch=compute_90a,code=sm_90a", str(source), "-o", str(built)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr[-2000:]}")
        built.replace(target)  # atomic: a concurrent build leaves one whole file
    log.info("built %s in %.1f s: %s", what, time.perf_counter() - start, target)
    return target
