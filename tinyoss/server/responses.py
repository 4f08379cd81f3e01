"""Engine outputs to OpenAI choices, for streams and whole answers alike.

Each choice keeps its own state and reads the engine's cumulative fields (token_ids, text,
logprobs), not the per-step `delta_*` ones: with n > 1 a sequence that was not scheduled in a
step keeps its previous deltas. Stream chunks and the final answer come from the same state,
so a stream joins up to exactly the non-streaming answer.
"""

from __future__ import annotations

from typing import Any

from tinyoss import harmony
from tinyoss.engine.sequence import CompletionOutput, TokenLogprob
from tinyoss.tokenizer import IncrementalDetokenizer, Tokenizer

_FLOOR = -9999.0  # OpenAI's stand-in for a log-probability of -inf (JSON has no infinities)


class StopFilter:
    """Cuts text at the first stop string, holding back a tail that may yet start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.pending = stops, ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was found)."""
        text = self.pending + text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return text[: min(hits)], True
        keep = max(
            (n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0
        )
        self.pending = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


def _token(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def _lp(value: float) -> float:
    return max(value, _FLOOR)


def _choice(index: int, finish_reason: str | None, **fields: Any) -> dict:
    return {"index": index, **fields, "finish_reason": finish_reason}


class ChatChoice:
    """One chat choice: generated tokens through the harmony parser into message fields."""

    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer,
        stops: list[str],
        seed: int | None,
        logprobs: bool,
    ) -> None:
        self.index, self.tokenizer = index, tokenizer
        self.parser = harmony.HarmonyStreamParser(
            tokenizer.decode, detokenizer=lambda: IncrementalDetokenizer(tokenizer), seed=seed
        )
        self.stop = StopFilter(stops) if stops else None
        self.num_tokens = 0
        self.text: dict[str, str] = {"reasoning": "", "content": ""}
        self.calls: list[dict] = []
        self.logprobs: list[dict] | None = [] if logprobs else None
        self.finish_reason: str | None = None

    def opening(self) -> dict:
        return _choice(self.index, None, delta={"role": "assistant", "content": ""}, logprobs=None)

    def update(self, out: CompletionOutput) -> dict | None:
        """The stream chunk's choice for what `out` adds, or None when nothing changed."""
        if self.finish_reason is not None:
            return None
        start, deltas = self.num_tokens, []
        for token in out.token_ids[start:]:
            self.num_tokens += 1
            deltas += self._keep(self.parser.add(token))
            if self.finish_reason is not None:
                break
        if out.finished and self.finish_reason is None:
            deltas += self._keep(self.parser.finish())
            if self.stop is not None and self.finish_reason is None:
                deltas += self._keep([harmony.Delta("content", self.stop.flush())], final=True)
            if self.finish_reason is None:
                calls = self.calls and out.finish_reason == "stop"
                self.finish_reason = "tool_calls" if calls else out.finish_reason
        lps = []
        if self.logprobs is not None and out.logprobs is not None:
            lps = [self._logprob(e) for e in out.logprobs[start : self.num_tokens]]
            self.logprobs += lps
        delta = _delta(deltas)
        if not (delta or lps or self.finish_reason):
            return None
        lps_field = {"content": lps} if lps else None
        return _choice(self.index, self.finish_reason, delta=delta, logprobs=lps_field)

    def final(self) -> dict:
        message = {
            "role": "assistant",
            "content": self.text["content"] or None,
            "reasoning": self.text["reasoning"] or None,
            "reasoning_content": self.text["reasoning"] or None,
        }
        if self.calls:
            message["tool_calls"] = self.calls
        logprobs = None if self.logprobs is None else {"content": self.logprobs}
        return _choice(self.index, self.finish_reason, message=message, logprobs=logprobs)

    def _keep(self, deltas: list[harmony.Delta], final: bool = False) -> list[harmony.Delta]:
        """Records deltas into the message; with stop strings, cuts the answer at the first."""
        kept = []
        for d in deltas:
            if d.kind == "content" and self.stop is not None and not final:
                text, hit = self.stop.feed(d.text)
                d = harmony.Delta("content", text)
                if hit:
                    self.finish_reason = "stop"
            if d.kind == "tool_call":
                call = {"name": d.name, "arguments": ""}
                self.calls.append({"id": d.id, "type": "function", "function": call})
            elif d.kind == "arguments":
                self.calls[d.index]["function"]["arguments"] += d.text
            elif d.text:
                self.text[d.kind] += d.text
            kept.append(d)
            if self.finish_reason is not None:
                break
        return kept

    def _logprob(self, e: TokenLogprob) -> dict:
        token, raw = _token(self.tokenizer, e.token_id)
        top = [_token(self.tokenizer, t) + (lp,) for t, lp in e.top]
        return {
            "token": token,
            "logprob": _lp(e.logprob),
            "bytes": raw,
            "top_logprobs": [{"token": t, "logprob": _lp(lp), "bytes": b} for t, b, lp in top],
        }


def _delta(deltas: list[harmony.Delta]) -> dict:
    delta: dict = {}
    calls: list[dict] = []
    for d in deltas:
        if d.kind == "tool_call":
            fn = {"name": d.name, "arguments": ""}
            calls.append({"index": d.index, "id": d.id, "type": "function", "function": fn})
        elif d.kind == "arguments" and calls and calls[-1]["index"] == d.index:
            calls[-1]["function"]["arguments"] += d.text
        elif d.kind == "arguments":
            calls.append({"index": d.index, "function": {"arguments": d.text}})
        elif d.text:
            delta[d.kind] = delta.get(d.kind, "") + d.text
    if "reasoning" in delta:
        delta["reasoning_content"] = delta["reasoning"]
    if calls:
        delta["tool_calls"] = calls
    return delta


class TextChoice:
    """One completions choice: the engine's text (it applies stop strings itself)."""

    def __init__(self, index: int, tokenizer: Tokenizer, echo: str | None, logprobs: bool) -> None:
        self.index, self.tokenizer = index, tokenizer
        self.prefix = echo or ""  # sent with the first update
        self.text = ""  # the echo and the engine's text so far
        self.seen = 0  # characters of the engine's text already taken
        self.num_tokens = 0
        self.offset = 0
        self.logprobs: dict | None = _text_logprobs() if logprobs else None
        self.finish_reason: str | None = None

    def opening(self) -> None:
        return None

    def update(self, out: CompletionOutput) -> dict | None:
        if self.finish_reason is not None:
            return None
        new, self.prefix, self.seen = self.prefix + out.text[self.seen :], "", len(out.text)
        self.text += new
        start, self.num_tokens = self.num_tokens, len(out.token_ids)
        lps = None
        if self.logprobs is not None and out.logprobs is not None:
            lps = _text_logprobs()
            for e in out.logprobs[start : self.num_tokens]:
                token = _token(self.tokenizer, e.token_id)[0]
                top = {_token(self.tokenizer, t)[0]: _lp(lp) for t, lp in e.top}
                top.setdefault(token, _lp(e.logprob))
                for key, value in zip(lps, (token, _lp(e.logprob), top, self.offset)):
                    lps[key].append(value)
                    self.logprobs[key].append(value)
                self.offset += len(token)
        self.finish_reason = out.finish_reason
        if not (new or lps and lps["tokens"] or self.finish_reason):
            return None
        return _choice(self.index, self.finish_reason, text=new, logprobs=lps)

    def final(self) -> dict:
        return _choice(self.index, self.finish_reason, text=self.text, logprobs=self.logprobs)


def _text_logprobs() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
