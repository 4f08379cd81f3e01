"""Engine settings that an environment variable can also give: argument > env var > "auto".

An argument (CLI flag, `LLM(...)` keyword, `EngineConfig` field) left at None defers to the
environment, so a deployment can set e.g. TINYOSS_MXFP4_BACKEND once; an explicit "auto" still
beats the variable. Where the value came from travels with it, for logs and error messages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    value: str
    source: str  # "argument", "env NAME=value" or "default"


def resolve(name: str, value: str | None, env: str, choices: tuple[str, ...]) -> Setting:
    """The value to use and where it came from; anything outside `choices` is an error."""
    if value is not None:
        setting = Setting(value, "argument")
    elif os.environ.get(env):
        setting = Setting(os.environ[env], f"env {env}={os.environ[env]}")
    else:
        setting = Setting("auto", "default")
    if setting.value not in choices:
        raise ValueError(
            f"{name} {setting.value!r} (from {setting.source}) is not one of: {', '.join(choices)}"
        )
    return setting
