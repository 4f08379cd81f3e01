"""Builds a prototype's library fresh each run: its source includes `ring.cuh` (and moe_ring.cu
the product's moe_gemv_mma.cu), which the product's kernel cache, keyed on one file's hash,
would not see change."""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
from pathlib import Path

from tinyoss.kernels import nvcc_build


def build_lib(name: str) -> ctypes.CDLL:
    """`name` (a .cu beside this file) built for sm_90a into a temporary folder and loaded."""
    nvcc = nvcc_build.find_nvcc()
    assert nvcc, "nvcc not found"
    out = Path(tempfile.mkdtemp()) / Path(name).with_suffix(".so").name
    subprocess.run([nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17",
                    "-gencode=arch=compute_90a,code=sm_90a", str(Path(__file__).with_name(name)),
                    "-o", str(out)], check=True)
    return ctypes.CDLL(str(out))
