"""GPU families and kernel availability by compute capability, for GPUs this machine lacks."""

from __future__ import annotations

import pytest

from tinyoss.kernels import hardware as hw

# cap: family, Blackwell-class, FP4 tensor cores, CUTLASS MoE build
TABLE = [
    ((8, 0), "Ampere", False, False, None),  # A100
    ((8, 9), "Ada", False, False, None),  # L40S, RTX 4090
    ((9, 0), "Hopper", False, False, "w4a16"),  # H100, H200
    ((10, 0), "Blackwell", True, True, "mxfp8"),  # B200, GB200
    ((10, 3), "Blackwell", True, True, "mxfp8"),  # B300, GB300
    ((11, 0), "Blackwell", True, True, "mxfp8"),  # Jetson Thor
    ((12, 0), "Blackwell", True, True, "mxfp8"),  # RTX 50xx, RTX PRO 6000
    ((12, 1), "Blackwell", True, True, "mxfp8"),  # GB10 (DGX Spark)
]


@pytest.mark.parametrize("cap,family,blackwell,fp4,cutlass", TABLE)
def test_capability_table(cap, family, blackwell, fp4, cutlass):
    assert hw.family(cap) == family
    assert hw.is_hopper(cap) == (cap == (9, 0))
    assert hw.is_blackwell_class(cap) is blackwell
    assert hw.has_fp4_tensor_cores(cap) is fp4
    assert hw.cutlass_moe_variant(cap) == cutlass


def test_names_and_unknown_parts():
    assert hw.sm_name((12, 1)) == "sm_121"
    assert hw.family((13, 0)) == "unknown"
    assert not hw.is_blackwell_class((13, 0)) and hw.cutlass_moe_variant((10, 1)) is None


def test_without_a_gpu_everything_is_false(monkeypatch):
    monkeypatch.setattr(hw.torch.cuda, "is_available", lambda: False)
    assert hw.capability() is None and hw.family() == "none"
    assert not (hw.is_hopper() or hw.is_blackwell_class() or hw.has_fp4_tensor_cores())
    assert hw.cutlass_moe_variant() is None


def test_default_is_the_current_device(monkeypatch):
    monkeypatch.setattr(hw.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hw.torch.cuda, "get_device_capability", lambda device=None: (12, 1))
    assert hw.capability() == (12, 1) and hw.is_blackwell_class()
    assert hw.cutlass_moe_variant() == "mxfp8"
