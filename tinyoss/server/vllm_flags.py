"""vLLM `serve` flags that tinyoss does not have, and what tinyoss does about each.

People arrive with a `vllm serve` command line. Rather than argparse's bare "unrecognized
arguments", each flag here is either accepted with one log line saying it changes nothing (its
value, if any, is one of `harmless`), or refused with a message naming it and what to do. A flag
that would change results (a quantization, an fp8 KV cache, pipeline or expert parallelism) is
always refused: running anyway would quietly serve something else than was asked for.

This table is the only list: `tinyoss serve` builds its flags from it (`generate` and `chat`
those in `ENGINE_FLAGS`), `tinyoss.LLM` takes its flags as vLLM's `LLM` keywords
(`llm_keyword`: `trust_remote_code=True`, `quantization="mxfp4"`), and docs/serve.md ("Coming
from vLLM") lists it; tests/test_cli_vllm.py checks the two agree.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

ANY = ("*",)  # `harmless` of a flag whose every use changes nothing (switches: ANY or ())
HARMONY = "tinyoss always parses gpt-oss's harmony format: reasoning and tool calls"
ONE_GPU = ("tinyoss splits a model over GPUs by tensor parallelism only "
           "(--tensor-parallel-size)")
# the table's flags that `generate` and `chat` take too: they concern the engine, not serving
ENGINE_FLAGS = ("--pipeline-parallel-size",)


@dataclass(frozen=True)
class VllmFlag:
    names: tuple[str, ...]  # the long name first, then vLLM's short aliases
    takes_value: bool
    harmless: tuple[str, ...]  # the values that change nothing: ANY, none (), or a list
    says: str  # why it changes nothing, or what to do instead

    def accepts(self, value: str | None) -> bool:
        """Whether this use of the flag changes nothing (and is therefore accepted)."""
        return self.harmless == ANY or (value or "").lower() in {v.lower() for v in self.harmless}


VLLM_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag(("--tool-call-parser",), True, ("openai",), HARMONY),
    VllmFlag(("--enable-auto-tool-choice",), False, ANY, HARMONY),
    VllmFlag(("--reasoning-parser",), True, ("openai_gptoss", "GptOss", "gpt_oss"), HARMONY),
    VllmFlag(("--trust-remote-code",), False, ANY, "gpt-oss needs no remote code"),
    VllmFlag(("--disable-log-requests",), False, ANY,
             "tinyoss logs requests only with --enable-log-requests"),
    VllmFlag(("--disable-log-stats",), False, ANY,
             "tinyoss logs no periodic stats (GET /metrics has them)"),
    VllmFlag(("--enable-chunked-prefill",), False, ANY,
             "tinyoss always prefills long prompts in chunks of --max-num-batched-tokens"),
    VllmFlag(("--swap-space",), True, ANY,
             "tinyoss never swaps the KV cache to the CPU: a preempted sequence is recomputed"),
    VllmFlag(("--enable-log-outputs",), False, ANY,
             "tinyoss never logs outputs (--enable-log-requests logs a line a request, without "
             "its text)"),
    VllmFlag(("--stream-interval",), True, ANY,
             "a stream sends each engine step's new text as one chunk, as soon as it is made"),
    VllmFlag(("--max-cudagraph-capture-size",), True, ANY,
             "tinyoss sizes its decode graphs by --max-num-seqs and its piecewise prefill "
             "graphs by --max-prefill-graph-tokens"),
    VllmFlag(("--generation-config",), True, ("auto", "vllm"),
             "gpt-oss's generation_config.json sets no sampling defaults; tinyoss's are "
             "OpenAI's (temperature 1, top_p 1): give sampling parameters in each request"),
    VllmFlag(("--task",), True, ("auto", "generate"),
             "tinyoss serves gpt-oss's text generation only (no pooling or embedding tasks)"),
    VllmFlag(("--runner",), True, ("auto", "generate"),
             "tinyoss serves gpt-oss's text generation only (no pooling runner)"),
    VllmFlag(("--pipeline-parallel-size", "-pp"), True, ("1",), ONE_GPU),
    VllmFlag(("--data-parallel-size", "-dp"), True, ("1",),
             "run one tinyoss serve per GPU (CUDA_VISIBLE_DEVICES=i) behind a load balancer"),
    VllmFlag(("--quantization", "-q"), True, ("mxfp4",),
             "tinyoss runs gpt-oss's MXFP4 experts as shipped; --mxfp4-layers quantizes more "
             "layers (qkv, o, lm_head); other quantizations are not supported"),
    VllmFlag(("--kv-cache-dtype",), True, ("auto",),
             "the KV cache is in the model's dtype (--dtype); an fp8 KV cache is not supported "
             "yet"),
    VllmFlag(("--max-logprobs",), True, ("20",),
             "tinyoss returns at most 20 logprobs per token (OpenAI's limit), not configurable"),
    VllmFlag(("--chat-template",), True, (),
             "tinyoss renders gpt-oss's harmony format itself; a custom chat template is not "
             "supported"),
    VllmFlag(("--compilation-config", "-O"), True, (),
             "tinyoss captures CUDA graphs itself: --enforce-eager turns them off, "
             "--max-prefill-graph-tokens sizes the piecewise prefill graphs"),
    VllmFlag(("--limit-mm-per-prompt",), True, (), "gpt-oss is text-only: drop the flag"),
    VllmFlag(("--tokenizer",), True, (),
             "the tokenizer comes with the checkpoint (o200k_harmony): drop the flag"),
    VllmFlag(("--download-dir",), True, (),
             "set HF_HUB_CACHE (or HF_HOME) to choose where hub downloads go"),
    VllmFlag(("--enable-lora",), False, (), "LoRA adapters are not supported yet"),
    VllmFlag(("--tool-server",), True, (),
             "gpt-oss's built-in browser and python tools are not served: give function "
             "tools in each request"),
    VllmFlag(("--config",), True, (), "give the flags on the command line"),
    VllmFlag(("--cpu-offload-gb",), True, (),
             "offloading weights to the CPU is not supported"),
)


def llm_keyword(name: str, value: object) -> str | None:
    """vLLM's `LLM(name=value)` for a flag of this table: the note to log when the use changes
    nothing; None when the table has no such flag. Raises ValueError for a refused use."""
    flag = next((f for f in VLLM_FLAGS if f.names[0] == "--" + name.replace("_", "-")), None)
    if flag is None:
        return None
    if flag.takes_value:
        ok = value is None or flag.accepts(str(value))
    else:
        ok = flag.harmless == ANY or not value
    if not ok:
        raise ValueError(refusal(flag, f"{name}={value!r}").replace("vLLM flag", "vLLM argument"))
    return f"{name}={value!r} changes nothing: {flag.says}"


def describe(flag: VllmFlag) -> str:
    """What the flag does in tinyoss, in one line (for --help and the docs)."""
    if not flag.harmless:
        return f"refused: {flag.says}"
    if flag.harmless == ANY:
        return f"accepted, changes nothing: {flag.says}"
    return f"accepted as {' or '.join(flag.harmless)} (changes nothing), else refused: {flag.says}"


def refusal(flag: VllmFlag, given: str) -> str:
    """The error for a use of `flag` that tinyoss cannot honour: what, why, what to do."""
    only = ""
    if flag.harmless and flag.harmless != ANY:
        only = f" (only {' or '.join(flag.harmless)} is accepted, and changes nothing)"
    return f"{given}: this vLLM flag is not supported by tinyoss{only}: {flag.says}"


class _VllmAction(argparse.Action):
    """Accepts a harmless use (noted in `vllm_notes`, logged once logging is set up) or stops
    the parse with an error naming the flag and what to do."""

    def __init__(self, *args, flag: VllmFlag, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.flag = flag

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        value = values if isinstance(values, str) else None
        given = f"{option_string} {value}" if value is not None else str(option_string)
        if not self.flag.accepts(value):
            parser.error(refusal(self.flag, given))
        notes = list(getattr(namespace, "vllm_notes", None) or [])
        notes.append(f"{given}: a vLLM flag that changes nothing in tinyoss: {self.flag.says}")
        setattr(namespace, "vllm_notes", notes)


def add_vllm_args(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """One flag per `VLLM_FLAGS` entry (or per entry named in `only`, by its long name), in a
    group of their own: `generate` and `chat` take the engine's few, so that they explain them
    as `serve` does rather than call them unknown."""
    group = p.add_argument_group(
        "vLLM flags", "accepted where they change nothing, else refused (docs/serve.md: "
        "Coming from vLLM)"
    )
    for flag in (f for f in VLLM_FLAGS if only is None or f.names[0] in only):
        group.add_argument(
            *flag.names,
            action=_VllmAction,
            flag=flag,
            nargs=None if flag.takes_value else 0,
            dest="vllm_" + flag.names[0].lstrip("-").replace("-", "_"),
            default=argparse.SUPPRESS,
            metavar="VALUE" if flag.takes_value else None,
            help=describe(flag).replace("%", "%%"),
        )
    p.set_defaults(vllm_notes=[])
