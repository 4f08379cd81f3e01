"""Triton runs in its interpreter when there is no GPU (set before any import), as in tests/."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
