"""Structured-output libraries at gpt-oss's vocabulary (201,088 ids): xgrammar against
llguidance, for issue 15's choice. Per JSON schema: the compile time (cold, then again), and the
time to fill one token's mask while a valid document is walked token by token (what a decode
step would wait for if the mask did not overlap the forward pass): the first token's apart, then
the median and the max of the rest.

    pip install xgrammar llguidance && python bench/grammar_mask.py

CPU only; the tokenizer is tinyoss's o200k_harmony (the real gpt-oss vocabulary).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 201088

SCHEMAS: dict[str, tuple[dict | None, object]] = {
    "json_object": (None, {"answer": 391, "steps": ["17 * 20 = 340", "17 * 3 = 51"]}),
    "get_weather": (
        {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
         "required": ["city"], "additionalProperties": False},
        {"city": "Paris", "unit": "c"},
    ),
    "person": (
        {"type": "object", "properties": {
            "name": {"type": "string", "minLength": 1},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "format": "email"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
            "addresses": {"type": "array", "items": {
                "type": "object", "properties": {
                    "street": {"type": "string"}, "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "kind": {"enum": ["home", "work", "other"]}},
                "required": ["street", "city", "zip"], "additionalProperties": False}}},
         "required": ["name", "age", "addresses"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
         "tags": ["math", "engines"],
         "addresses": [{"street": "12 St James's Square", "city": "London", "zip": "10001",
                        "kind": "home"}]},
    ),
}


def _stats(us: list[float]) -> str:
    """The first mask apart (a library may do lazy work there), then the rest's median and max."""
    rest = us[1:]
    return (f"first {us[0]:7.1f} us, then median {statistics.median(rest):6.1f} us, "
            f"max {max(rest):7.1f} us")


def run_xgrammar(hf_tok, name: str, schema: dict | None, ids: list[int]) -> str:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=VOCAB)
    times = []
    for _ in range(2):  # a fresh compiler each time: no cache
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = (compiler.compile_builtin_json_grammar() if schema is None
                    else compiler.compile_json_schema(json.dumps(schema)))
        times.append(time.perf_counter() - t0)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    us = []
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        us.append(1e6 * (time.perf_counter() - t0))
        assert matcher.accept_token(t), f"xgrammar refused token {t} of {name}"
    return f"compile {1e3 * times[0]:7.1f} / {1e3 * times[1]:7.1f} ms | mask {_stats(us)}"


def run_llguidance(hf_tok, name: str, schema: dict | None, ids: list[int]) -> str:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln

    lltok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=VOCAB)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema if schema is not None else {"type": "object"})
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar)
        times.append(time.perf_counter() - t0)
    assert not matcher.is_error(), matcher.get_error()
    bitmask = lln.allocate_token_bitmask(1, VOCAB)
    us = []
    for t in ids:
        t0 = time.perf_counter()
        lln.fill_next_token_bitmask(matcher, bitmask, 0)
        us.append(1e6 * (time.perf_counter() - t0))
        assert matcher.consume_token(t), f"llguidance refused token {t} of {name}"
    return f"compile {1e3 * times[0]:7.1f} / {1e3 * times[1]:7.1f} ms | mask {_stats(us)}"


def main() -> None:
    from transformers import PreTrainedTokenizerFast

    from tinyoss.tools.o200k import tokenizer_dir

    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir() / "tokenizer.json"))
    for name, (schema, doc) in SCHEMAS.items():
        ids = hf_tok.encode(json.dumps(doc), add_special_tokens=False)
        for lib, run in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance)):
            print(f"{name:12s} ({len(ids):3d} tokens) {lib:10s} {run(hf_tok, name, schema, ids)}",
                  flush=True)


if __name__ == "__main__":
    main()
