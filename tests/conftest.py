"""Shared fixtures. Triton runs in its interpreter when there is no GPU (set before any import)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_dir():
    """The built-in tiny checkpoint (written once into the tinyoss cache)."""
    from tinyoss.tools.make_checkpoint import ensure_tiny

    return ensure_tiny()


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    """One fp32 CPU engine over the tiny checkpoint, shared by the engine tests."""
    from tinyoss import LLM

    return LLM(
        str(tiny_dir),
        device="cpu",
        dtype="float32",
        kv_cache_tokens=16384,
        max_num_batched_tokens=2048,
    )
