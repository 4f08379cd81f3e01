"""Engine-core hooks for the reliability suite, loaded in the core's own process.

The suite's server (tests/reliability/conftest.py) is started with
TINYOSS_CORE_HOOK=tests.reliability.hooks:install, so `install(core)` runs in every engine core
process, after the core is built (again in a core restarted after a failure). It injects the
faults of `tests.core_hooks.faults`: prompts holding OOM run out of memory on their prefill,
NAN get NaN logits, CRASH makes the step raise; every other request runs normally.
"""

from __future__ import annotations

from tests.core_hooks import CRASH, NAN, OOM, faults

__all__ = ["CRASH", "NAN", "OOM", "install"]

install = faults
