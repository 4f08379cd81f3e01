"""`--enable-log-requests`: one INFO line per generation request, once its answer has been sent.

It lets an operator match a client's `x-request-id` to what the server did with the request:
its endpoint, HTTP status and finish reasons, token counts, time to first token and total time,
and where it came from. Prompts and outputs are the users' data: no line carries their text,
unless `--max-log-len` asks for the head of the prompt (at most that many characters, as vLLM
cuts its logged prompts).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from tinyoss.tokenizer import Tokenizer

log = logging.getLogger("tinyoss.server")


@dataclass(frozen=True)
class RequestLog:
    """`max_log_len`: characters of the prompt each line shows (None: none)."""

    max_log_len: int | None = None

    def prompt_head(self, tokenizer: Tokenizer, prompt: list[int]) -> str | None:
        """The first `max_log_len` characters of the prompt, or None when no prompt text is
        wanted. Decoded from at most 4 tokens a character: a token is at least a byte and a
        character at most 4 (an emoji may take 3 tokens, and fewer would cut it to U+FFFD)."""
        if self.max_log_len is None:
            return None
        return tokenizer.decode(prompt[: 4 * self.max_log_len])[: self.max_log_len]

    def ended(
        self,
        request_id: str,
        endpoint: str,
        status: int,
        client: str,
        seconds: float,
        usage: dict | None = None,
        finish_reasons: Sequence[str] = (),
        ttft: float | None = None,
        prompt: str | None = None,
    ) -> None:
        """Logs the line of a request that has ended. `usage`: its API usage (None: it never
        reached the engine); `ttft`: seconds to its first engine output."""
        parts = [f"request {request_id}: {endpoint} {status}"]
        if finish_reasons:
            parts.append("finish=" + ",".join(finish_reasons))
        if usage is not None:
            cached = (usage["prompt_tokens_details"] or {}).get("cached_tokens")
            parts.append(f"prompt_tokens={usage['prompt_tokens']} "
                         f"completion_tokens={usage['completion_tokens']} "
                         f"cached_tokens={'-' if cached is None else cached}")
        if ttft is not None:
            parts.append(f"ttft={ttft:.3f}s")
        parts.append(f"time={seconds:.3f}s client={client}")
        if prompt is not None:
            parts.append(f"prompt={prompt!r}")
        log.info(" ".join(parts))
