"""Where compiled GPU kernels are kept between starts, and what a start with none of them costs.

Triton compiles each kernel specialization on its first launch and keeps it in its own cache
(TRITON_CACHE_DIR, default ~/.triton/cache); tinyoss keeps its nvcc build and tokenizer files in
TINYOSS_CACHE (~/.cache/tinyoss). A start with an empty Triton cache compiles every kernel
of the decode graphs one at a time (docs/serve.md, "Start-up time", has the measured cost).
Containers that start from a fresh image pay it every time unless the caches live on a
volume, so the log says so when it happens.
"""

from __future__ import annotations

import os
from pathlib import Path

from tinyoss.tools.make_checkpoint import cache_dir


def triton_cache_dir() -> Path:
    """The folder Triton compiles into, as Triton itself resolves it."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    return Path(os.environ.get("TRITON_HOME", Path.home())) / ".triton" / "cache"


def empty_cache_note() -> str | None:
    """A line for the start-up log when Triton's cache holds no kernel yet, else None."""
    triton = triton_cache_dir()
    if triton.is_dir() and any(triton.iterdir()):
        return None
    return (f"Triton's kernel cache ({triton}) is empty: this start compiles the GPU kernels "
            "once, a minute or two; later starts on this machine reuse them. In a container, "
            f"keep {triton} and {cache_dir()} on a volume (or point TRITON_CACHE_DIR and "
            "TINYOSS_CACHE at one), or every start compiles again")
