"""tinyoss: a lean inference engine for OpenAI's gpt-oss models.

`from tinyoss import LLM, SamplingParams` (and `StructuredOutputs`). Names load on first use,
so importing a submodule (the config reader, a kernel) does not pull in the whole engine.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "LLM": "tinyoss.llm",
    "ChatOutput": "tinyoss.llm",
    "ChatChoice": "tinyoss.llm",
    "EngineConfig": "tinyoss.config",
    "RequestOutput": "tinyoss.engine.output_processor",
    "SamplingParams": "tinyoss.sampling_params",
    "StructuredOutputs": "tinyoss.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tinyoss' has no attribute {name!r}")
