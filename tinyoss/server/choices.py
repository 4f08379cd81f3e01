"""Engine outputs to OpenAI choices, for streams and whole answers alike.

Each choice keeps its own state and reads the engine's cumulative fields (token_ids, text
pieces, logprobs: shared lists that grow), from where it stopped last time, so an update costs
what the step added even when outputs queue up. Stream chunks and the final answer come from
the same state, so a stream joins up to exactly the non-streaming answer.

Logprobs: each choice releases the engine's entries it has turned into its own (a windowed
output processor then drops them), and keeps its own only for a final answer
(`keep_logprobs`): a stream holds what it has not sent, not what it has.
"""

from __future__ import annotations

import codecs
from collections import deque
from typing import Any

from tinyoss import harmony
from tinyoss.engine.output_processor import CompletionOutput, LogprobWindow, StopStrings
from tinyoss.engine.step import TokenLogprob
from tinyoss.tokenizer import IncrementalDetokenizer, Tokenizer

_FLOOR = -9999.0  # OpenAI's stand-in for a log-probability of -inf (JSON has no infinities)


def _token(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def _name(tokenizer: Tokenizer, token_id: int, as_id: bool) -> str:
    """A token as logprobs name it: its text, or with vLLM's return_tokens_as_token_ids
    "token_id:<id>", which tells apart a token that is part of a character ("\ufffd" alone)
    or whose text another token has too."""
    return f"token_id:{token_id}" if as_id else _token(tokenizer, token_id)[0]


def _lp(value: float) -> float:
    return max(value, _FLOOR)


def prompt_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob | None]) -> list:
    """vLLM's prompt_logprobs: a position each, null where there is none (the first), else
    {token id (a string, as JSON keys are): {logprob, rank, decoded_token}} for the prompt's
    token and its top alternatives."""
    return [None if e is None else {
        str(t): {"logprob": _lp(v.logprob), "rank": v.rank,
                 "decoded_token": _token(tokenizer, t)[0]}
        for t, v in e.items()} for e in entries]


def token_logprob(tokenizer: Tokenizer, e: TokenLogprob, as_ids: bool = False) -> dict:
    """A token's logprob entry as chat's logprobs.content and Responses' output_text give it.
    `as_ids` (chat's return_tokens_as_token_ids) names tokens "token_id:<id>", as vLLM does:
    the token's bytes stay its own, so they still join to the content, and a top token's are
    those of its name (vLLM's, which clients of that mode read)."""
    token, raw = _token(tokenizer, e.token_id)
    if as_ids:
        token = _name(tokenizer, e.token_id, True)
        names = [(_name(tokenizer, t, True), lp) for t, lp in e.top]
        top = [(name, list(name.encode()), lp) for name, lp in names]
    else:
        top = [_token(tokenizer, t) + (lp,) for t, lp in e.top]
    return {
        "token": token,
        "logprob": _lp(e.logprob),
        "bytes": raw,
        "top_logprobs": [{"token": t, "logprob": _lp(lp), "bytes": b} for t, b, lp in top],
    }


def release(logprobs: list[TokenLogprob] | LogprobWindow | None, upto: int) -> None:
    """Drops the engine's logprob entries before position `upto`, all of them taken, where the
    output processor is windowed (the server's)."""
    if isinstance(logprobs, LogprobWindow):
        logprobs.release(upto)


def _choice(index: int, finish_reason: str | None, stop_reason: str | int | None = None,
            **fields: Any) -> dict:
    """A choice as vLLM answers it: `stop_reason` is the stop string or stop token id that
    ended it (null for the model's own end, a length cut, or a choice not yet finished)."""
    return {"index": index, **fields, "finish_reason": finish_reason, "stop_reason": stop_reason}


class _TokenIds:
    """A choice's token ids, for return_token_ids: a stream chunk carries those new since the
    last chunk (a token may bring no chunk of its own: half a character, a harmony header)."""

    def __init__(self) -> None:
        self.all: list[int] = []
        self.sent = 0

    def new(self) -> list[int]:
        ids, self.sent = self.all[self.sent :], len(self.all)
        return ids


class ChatChoice:
    """One chat choice: generated tokens through the harmony parser into message fields.

    Logprobs are the content's tokens only, as OpenAI's `logprobs.content` (their bytes join to
    `message.content`): no header, reasoning or tool arguments. Each is sent with the chunk
    whose content shows its text first; a stop string keeps the tokens at least partly before
    it. The "\n" between two answer messages is no token's."""

    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer,
        stops: list[str],
        logprobs: bool,
        token_ids: bool = False,
        keep_logprobs: bool = True,
        reasoning: bool = True,
        stop_kept: bool = False,
        channel: str | None = None,
        as_ids: bool = False,
        reasoning_content: bool = False,
    ) -> None:
        """`keep_logprobs`: keep the entries sent for `final` (False: a stream's). `reasoning`:
        send the reasoning (False: vLLM's `include_reasoning: false`; the model still reasons).
        `stop_kept`: the answer keeps the stop string that ended it (include_stop_str_in_output).
        `channel`: that of the message the prompt left open (continue_final_message).
        `as_ids`: logprobs name tokens "token_id:<id>" (return_tokens_as_token_ids).
        `reasoning_content`: the reasoning goes under that name too (`--reasoning-content`)."""
        self.index, self.tokenizer, self.as_ids = index, tokenizer, as_ids
        self.reasoning_content = reasoning_content
        self.reasoning, self.stop_kept = reasoning, stop_kept
        self.keep_logprobs = keep_logprobs
        self.ids = _TokenIds() if token_ids else None
        self.parser = harmony.HarmonyStreamParser(
            tokenizer.decode, detokenizer=lambda: IncrementalDetokenizer(tokenizer),
            channel=channel,
        )
        self.stop = StopStrings(stops, stop_kept) if stops else None
        self.num_tokens = 0
        self.parts: dict[str, list[str]] = {"reasoning": [], "content": []}  # joined at the end
        self.calls: list[dict] = []
        self.logprobs: list[dict] | None = [] if logprobs else None
        # content tokens not yet shown (stop strings hold text back): (where their text starts
        # in the content fed to the stop strings, their positions)
        self.held: deque[tuple[int, tuple[int, ...]]] = deque()
        self.fed = self.shown = 0  # characters of content fed to the stop strings, and shown
        self.token_ids: list[int] = []  # the output's tokens, as `update` last had them
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # set by the run

    def opening(self) -> dict:
        return _choice(self.index, None, delta={"role": "assistant", "content": ""}, logprobs=None)

    def update(self, out: CompletionOutput) -> dict | None:
        """The stream chunk's choice for what `out` adds, or None when nothing changed."""
        if self.finish_reason is not None:
            return None
        start, deltas = self.num_tokens, []
        self.token_ids = out.token_ids
        end = len(out.token_ids) - hidden_stop_token(out, self.stop_kept)
        for token in out.token_ids[start:end]:
            self.num_tokens += 1
            deltas += self._keep(self.parser.add(token))
            if self.finish_reason is not None:
                break
        if self.finish_reason is None and self.num_tokens == end < len(out.token_ids):
            self.num_tokens += 1  # the stop token: in token_ids and logprobs, not the text
        if out.finished() and self.finish_reason is None:
            deltas += self._keep(self.parser.finish())
            if self.stop is not None and self.finish_reason is None:
                deltas += self._keep([harmony.Delta("content", self.stop.flush())], final=True)
            if self.finish_reason is None:
                calls = self.calls and out.finish_reason == "stop"
                self.finish_reason = "tool_calls" if calls else out.finish_reason
                # the engine's, as vLLM's chat passes it on: null for <|return|> (the EOS),
                # 200012 for <|call|> (a tool call's end is one of stop_token_ids)
                self.stop_reason = out.stop_reason
        lps = []
        if self.logprobs is not None and out.logprobs is not None:
            while self.held and self.held[0][0] < self.shown:
                lps += [token_logprob(self.tokenizer, out.logprobs[at], self.as_ids)
                        for at in self.held.popleft()[1]]  # fmt: skip
            if self.keep_logprobs:
                self.logprobs += lps
            # entries still needed: tokens held back, and those the parser has not put out
            needed = self.held[0][1][0] if self.held else self.parser.holding
            release(out.logprobs, len(out.logprobs) if self.finish_reason else needed)
        if self.ids is not None:
            self.ids.all += out.token_ids[start : self.num_tokens]
        delta = _delta([d for d in deltas if self.reasoning or d.kind != "reasoning"])
        if self.reasoning_content and "reasoning" in delta:
            delta["reasoning_content"] = delta["reasoning"]
        if not (delta or self.finish_reason):
            return None
        lps_field = {"content": lps, "refusal": None} if lps else None
        choice = _choice(self.index, self.finish_reason, self.stop_reason, delta=delta,
                         logprobs=lps_field)
        return choice if self.ids is None else {**choice, "token_ids": self.ids.new()}

    def final(self) -> dict:
        # as OpenAI's: content is null only in a message of tool calls alone; an empty answer
        # (a constraint that allows it, a reply cut off while reasoning) is "", as streamed
        content = "".join(self.parts["content"]) or (None if self.calls else "")
        reasoning = ("".join(self.parts["reasoning"]) or None) if self.reasoning else None
        message = {  # refusal and annotations as OpenAI's (apps iterate annotations)
            "role": "assistant",
            "content": content,
            "refusal": None,
            "annotations": [],
            "reasoning": reasoning,
        }
        if self.reasoning_content:
            message["reasoning_content"] = reasoning
        if self.calls:
            message["tool_calls"] = self.calls
        logprobs = None
        if self.logprobs is not None:  # null like the content when there is none
            logprobs = {"content": None if content is None else self.logprobs, "refusal": None}
        choice = _choice(self.index, self.finish_reason, self.stop_reason, message=message,
                         logprobs=logprobs)
        return choice if self.ids is None else {**choice, "token_ids": self.ids.all}

    def _hold(self, positions: tuple[int, ...]) -> None:
        """Each token of a content delta, held at where its own text starts in the content (a
        delta may hold many: text outside any harmony message comes whole at the end), so a stop
        string inside the delta keeps only the tokens at least partly before it."""
        decoder, at = codecs.getincrementaldecoder("utf-8")("replace"), self.fed
        for p in positions:
            self.held.append((at, (p,)))
            at += len(decoder.decode(self.tokenizer.token_bytes(self.token_ids[p])))

    def _keep(self, deltas: list[harmony.Delta], final: bool = False) -> list[harmony.Delta]:
        """Records deltas into the message; with stop strings, cuts the answer at the first."""
        kept = []
        for d in deltas:
            if d.kind == "content" and not final:
                if d.tokens and self.logprobs is not None:
                    self._hold(d.tokens)
                self.fed += len(d.text)
                if self.stop is not None:
                    text, hit = self.stop.feed(d.text)
                    d = harmony.Delta("content", text)
                    if hit is not None:
                        self.finish_reason, self.stop_reason = "stop", hit
            if d.kind == "tool_call":
                call = {"name": d.name, "arguments": ""}
                self.calls.append({"id": d.id, "type": "function", "function": call})
            elif d.kind == "arguments":
                self.calls[d.index]["function"]["arguments"] += d.text
            elif d.text:
                self.parts[d.kind].append(d.text)
                self.shown += len(d.text) if d.kind == "content" else 0
            kept.append(d)
            if self.finish_reason is not None:
                break
        return kept


def hidden_stop_token(out: CompletionOutput, kept: bool) -> int:
    """1 where the output ended on a `stop_token_ids` token whose text is left out of the
    answer (unless `kept`: include_stop_str_in_output), as completions leave it out of their
    text and vLLM's detokenizer does; harmony's own end tokens are never text."""
    reason = out.stop_reason
    return int(out.finish_reason == "stop" and not kept and isinstance(reason, int)
               and reason not in harmony.STOP_TOKENS and bool(out.token_ids)
               and out.token_ids[-1] == reason)


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
    if calls:
        delta["tool_calls"] = calls
    return delta


class TextChoice:
    """One completions choice: the engine's text (it applies stop strings itself).
    `prompt_ids`, given with return_token_ids, are its prompt's.

    A logprobs `text_offset` is where the token's text starts in `text`: the characters the
    tokens before it complete (decoded as the engine decodes them), so part of a character
    points at that character and a skipped special token adds nothing. Tokens past a stop
    string, and the end token (kept, as vLLM keeps it), point at the end of the text. A token
    is sent once the text up to its offset has been: text a stop string might begin is held
    back, and the stop string may cut it, so an offset into it could pass the final text.

    With echo and logprobs (`prompt`: the prompt's ids) the entries begin with the prompt's
    tokens, as vLLM gives them (the first has no logprob and no top ones), each with its offset
    in the echoed text, and the generated tokens' offsets follow the echo: what
    lm-evaluation-harness reads to score a continuation. The prompt's entries
    (`prompt_logprobs`, set by the run) are whole once the first token has come, so the echo
    waits for it. They are also the answer's vLLM `prompt_logprobs` (not streamed)."""

    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer,
        echo: str | None,
        logprobs: bool,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        keep_logprobs: bool = True,
        prompt: list[int] | None = None,
        top: int | None = None,
        prompt_only: bool = False,
        as_ids: bool = False,
    ) -> None:
        """`keep_logprobs`: keep the entries sent for `final` (False: a stream's). `prompt`:
        the prompt's ids, whose logprobs come first (echo with logprobs), each with at most
        `top` alternatives (the request's logprobs; its prompt_logprobs may ask for more).
        `prompt_only`: echo with max_tokens 0, the echo (and its logprobs) alone: the engine's
        one token is left out and the choice ends at it ("length"). `as_ids`: logprobs name
        tokens "token_id:<id>" (return_tokens_as_token_ids), `tokens` and the `top_logprobs`
        keys alike (tokens of one text no longer share a key); `text_offset` still indexes
        the text."""
        self.index, self.tokenizer, self.as_ids = index, tokenizer, as_ids
        self.keep_logprobs = keep_logprobs
        self.prompt_ids, self.opened = prompt_ids, False  # opened: a chunk carried them
        self.ids = None if prompt_ids is None else _TokenIds()
        self.prefix = echo or ""  # sent with the first update
        self.parts: list[str] = []  # the echo and the engine's text so far
        self.seen = 0  # pieces of the engine's text already taken
        self.num_tokens = 0
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)  # for text_offset
        self.offset = 0  # characters the tokens so far complete
        self.sent = 0  # characters of the engine's text sent
        self.held: deque[tuple[str, float, dict, int]] = deque()  # entries not yet sent
        self.logprobs: dict | None = _text_logprobs() if logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.prompt, self.top, self.prompt_only = prompt, top, prompt_only
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # set by the run
        if prompt is not None:  # the generated tokens' text follows the echo
            self.offset = self.sent = len(self.prefix)

    def opening(self) -> None:
        return None

    def update(self, out: CompletionOutput) -> dict | None:
        if self.finish_reason is not None:
            return None
        if (self.prompt is not None or self.prompt_only) and not (out.token_ids or out.finished()):
            return None  # the prompt's logprobs are not all in yet
        if self.prompt_only:
            return self._prompt_alone(out)
        text = "".join(out.pieces[self.seen :])
        new, self.sent = self.prefix + text, self.sent + len(text)
        self.prefix, self.seen = "", len(out.pieces)
        self.parts.append(new)
        start, self.num_tokens = self.num_tokens, len(out.token_ids)
        if self.ids is not None:
            self.ids.all += out.token_ids[start:]
        lps = None
        if self.logprobs is not None and out.logprobs is not None:
            lps = _text_logprobs()
            if self.prompt is not None:
                self._prompt_entries(lps)
            for e in out.logprobs[start : self.num_tokens]:
                token = _name(self.tokenizer, e.token_id, self.as_ids)
                top = {_name(self.tokenizer, t, self.as_ids): _lp(lp) for t, lp in e.top}
                top.setdefault(token, _lp(e.logprob))
                self.held.append((token, _lp(e.logprob), top, self.offset))
                self.offset += len(self.detok.add((e.token_id,)))
            # at the end, the rest: those a stop string cut point at the end of the text
            while self.held and (out.finished() or self.held[0][3] <= self.sent):
                token, lp, top, at = self.held.popleft()
                for key, value in zip(lps, (token, lp, top, min(at, self.sent))):
                    lps[key].append(value)
                    if self.keep_logprobs:
                        self.logprobs[key].append(value)
            release(out.logprobs, self.num_tokens)
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if not (new or lps and lps["tokens"] or self.finish_reason):
            return None
        choice = _choice(self.index, self.finish_reason, self.stop_reason, text=new, logprobs=lps)
        if self.ids is None:
            return choice
        first = {} if self.opened else {"prompt_token_ids": self.prompt_ids}
        self.opened = True
        return {**choice, **first, "token_ids": self.ids.new()}

    def _prompt_alone(self, out: CompletionOutput) -> dict:
        """The whole choice of echo with max_tokens 0, from the engine's first output: the
        echo, the prompt's logprobs, no token of its own."""
        lps = None
        if self.logprobs is not None:
            lps = _text_logprobs()
            if self.prompt is not None:
                self._prompt_entries(lps)
            release(out.logprobs, len(out.token_ids))
        self.parts.append(self.prefix)
        self.finish_reason, self.prefix = "length", ""
        choice = _choice(self.index, self.finish_reason, text=self.parts[-1], logprobs=lps)
        if self.ids is None:
            return choice
        return {**choice, "prompt_token_ids": self.prompt_ids, "token_ids": []}

    def _prompt_entries(self, lps: dict) -> None:
        """The prompt's entries, once, into `lps` (and the kept logprobs)."""
        entries, ids, self.prompt = self.prompt_logprobs or [], self.prompt, None
        detok, at = IncrementalDetokenizer(self.tokenizer), 0
        for i, token_id in enumerate(ids):
            token = _name(self.tokenizer, token_id, self.as_ids)
            e = entries[i] if i < len(entries) else None
            lp = top = None
            if e is not None:
                lp = _lp(e.logprob)
                top = {_name(self.tokenizer, t, self.as_ids): _lp(v)
                       for t, v in e.top[: self.top]}
                top.setdefault(token, lp)
            for key, value in zip(lps, (token, lp, top, at)):
                lps[key].append(value)
                if self.keep_logprobs:
                    self.logprobs[key].append(value)
            at += len(detok.add((token_id,)))

    def final(self) -> dict:
        text = "".join(self.parts)
        choice = _choice(self.index, self.finish_reason, self.stop_reason, text=text,
                         logprobs=self.logprobs)
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(self.tokenizer, self.prompt_logprobs)
        if self.ids is None:
            return choice
        return {**choice, "prompt_token_ids": self.prompt_ids, "token_ids": self.ids.all}


def _text_logprobs() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
