"""Shared fixtures. Triton runs in its interpreter when there is no GPU (set before any import).

One CPU thread unless OMP_NUM_THREADS says otherwise: the tests' ops are small, and on a 2-core
machine the suite took 21 minutes on torch's default threads and under 4 on one. Set before
torch loads, so engine-core subprocesses inherit it too.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
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


@pytest.fixture
def mma():
    """The tensor-core GEMV library (`moe_gemv_mma`) on an sm_90 GPU with nvcc; skips
    elsewhere, and fails where it should build but does not."""
    from tinyoss.kernels.hardware import capability
    from tinyoss.kernels.moe_gemv_mma import _nvcc, load

    if not torch.cuda.is_available() or capability() != (9, 0) or _nvcc() is None:
        pytest.skip("the tensor-core GEMV needs sm_90 and nvcc")
    lib, why = load(capability())
    assert lib is not None, why
    return lib


# The reliability suite's line of counts, printed at the end of the run. Under pytest-xdist the
# worker that ran it hands the line to the controller, which prints it.
_RELIABILITY_LINES: list[str] = []


def _reliability_lines() -> list[str]:
    from tests.reliability.helpers import TRACKER

    if not TRACKER.used:
        return []
    events = ["reliability events: " + "; ".join(TRACKER.events[:20])] if TRACKER.events else []
    return [TRACKER.summary(), *events]


def pytest_sessionfinish(session) -> None:
    out = getattr(session.config, "workeroutput", None)  # set in a pytest-xdist worker
    if out is not None:
        out["reliability"] = _reliability_lines()


def pytest_testnodedown(node, error) -> None:  # pytest-xdist's controller: a worker ended
    _RELIABILITY_LINES.extend(getattr(node, "workeroutput", {}).get("reliability", []))


def pytest_terminal_summary(terminalreporter) -> None:
    for line in _RELIABILITY_LINES or _reliability_lines():
        terminalreporter.write_line(line)
