"""The embedded Python API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages)`."""

from __future__ import annotations

import codecs
import dataclasses
import itertools
import logging
import reprlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from tinyoss import harmony
from tinyoss.config import EngineConfig
from tinyoss.engine.builder import build_engine, checkpoint_folder, load_tokenizer
from tinyoss.engine.core import CoreRequest, EngineCore, check_prompt, truncate_prompt
from tinyoss.engine.grammar import check as check_grammar
from tinyoss.engine.output_processor import OutputProcessor, RequestOutput, StopStrings
from tinyoss.engine.step import TokenLogprob
from tinyoss.harmony_grammar import answer_constraint, chat_constraint
from tinyoss.sampling_params import SamplingParams, bad_words_ids
from tinyoss.tokenizer import HFTokenizerFacade, IncrementalDetokenizer
from tinyoss.server.choices import hidden_stop_token
from tinyoss.server.vllm_flags import llm_keyword


class TextPrompt(TypedDict):
    """vLLM's text prompt form, accepted so code written for vLLM runs unchanged."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's token-id prompt form."""

    prompt_token_ids: list[int]


Prompt = str | list[int] | TextPrompt | TokensPrompt
PROMPT_FORMS = 'a str, a list of int token ids, {"prompt": str} or {"prompt_token_ids": [int, ...]}'
PARAMS_FORMS = "None, a SamplingParams, or a list of them with one per prompt"
CHAT_SHAPE = (
    'a list of message dicts such as [{"role": "user", "content": "hi"}] (one conversation), '
    "or a list of such lists"
)
EFFORTS = ("low", "medium", "high")
# vLLM's arguments of generate and chat that tinyoss has no use for: the values that ask for
# nothing (scripts pass lora_request=None and the like) are taken, any other is refused, saying why
VLLM_INERT: dict[str, tuple[tuple[object, ...], str]] = {
    "lora_request": ((None,), "tinyoss serves no LoRA adapters"),
    "priority": ((None,), "tinyoss schedules first come, first served (as vLLM without its "
                 "priority policy): only None or 0 for every prompt"),
    "tokenization_kwargs": ((None, {}), "give the prompt's token ids instead"),
    "chat_template": ((None,), "gpt-oss prompts are rendered in harmony, not by a template: "
                      "render your own prompt and give it to generate"),
    "chat_template_content_format": (("auto", "string", "openai"), "it must be auto, string or "
                                     "openai (content is read in either form)"),
    "mm_processor_kwargs": ((None, {}), "gpt-oss reads text only"),
}
VLLM_ARGS = {
    "generate": ("lora_request", "priority", "tokenization_kwargs"),
    "chat": ("lora_request", "chat_template", "chat_template_content_format",
             "tokenization_kwargs", "mm_processor_kwargs"),
}
ProgressBar = bool | Callable[..., Any]  # vLLM's use_tqdm: on, off, or the bar's factory


@dataclass
class ChatChoice:
    """One choice of a chat reply taken apart: harmony's analysis channel is `reasoning`,
    final is `content`; `logprobs` (with SamplingParams(logprobs=k)) are those of the
    content's tokens, as the server's `logprobs.content` (all tokens' are in the raw output)."""

    reasoning: str | None
    content: str | None
    tool_calls: list[harmony.ToolCall]
    finish_reason: str | None  # "stop", "length", "tool_calls" or "abort"
    logprobs: list[TokenLogprob] | None


@dataclass
class ChatOutput(ChatChoice):
    """A chat reply: its own fields are the first choice's; `choices` holds each of the n
    choices (SamplingParams.n) taken apart, `output` the raw tokens and text. It also reads as
    the `RequestOutput` vLLM's `LLM.chat` returns (`.outputs[0].text`, `.prompt_token_ids`...),
    so code written for vLLM runs unchanged: those are the raw output's."""

    output: RequestOutput
    choices: list[ChatChoice]

    def __getattr__(self, name: str) -> Any:
        """vLLM's `RequestOutput` fields (`outputs`, `prompt_token_ids`, `prompt_logprobs`,
        `num_cached_tokens`, ...) are the raw output's."""
        if name.startswith("__") or name == "output":  # copy and pickle look before init
            raise AttributeError(name)
        return getattr(self.output, name)


class LLM:
    """Load a gpt-oss checkpoint (folder, hub id, or "tiny") and generate from it.

    Keyword arguments are `EngineConfig` fields: dtype, device, max_model_len, max_num_seqs,
    max_num_batched_tokens, block_size, gpu_memory_utilization, kv_cache_tokens,
    enable_prefix_caching, load_format, revision, seed. The engine core runs in this process
    (`tinyoss serve` runs it in a process of its own).

    A request the engine fails alone (out of memory on its prompt, NaN/Inf logits) comes back
    with finish_reason "error" and `RequestOutput.error` saying why; the others run on.

    Calls may overlap: streams left open while other calls run, and calls from several
    threads. All share one engine, stepped by whichever call needs an output (one step at a
    time), and each output goes to the call whose request it is.

    The start-up lines (loading, backends, the summary) go to stderr through the "tinyoss"
    logger, unless the application configured logging itself;
    `logging.getLogger("tinyoss").setLevel(logging.WARNING)` before `LLM(...)` silences them.
    """

    def __init__(self, model: str = "tiny", **kwargs: Any) -> None:
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        # vLLM's own arguments that change nothing here (trust_remote_code, quantization="mxfp4")
        # are noted and dropped; one that would change the result is a ValueError
        notes = {k: note for k in sorted(set(kwargs) - fields)
                 if (note := llm_keyword(k, kwargs[k])) is not None}
        unknown = sorted(set(kwargs) - fields - set(notes))
        if unknown:
            raise TypeError(
                f"unknown LLM argument(s) {', '.join(unknown)}; "
                f"valid: {', '.join(sorted(fields - {'model'}))}"
            )
        config = EngineConfig(model=model, **{k: v for k, v in kwargs.items() if k in fields})
        show_startup_logs()
        for note in notes.values():
            logging.getLogger("tinyoss").info("%s", note)
        folder = checkpoint_folder(config)
        self.tokenizer = load_tokenizer(folder)
        self.engine = build_engine(config, folder)
        self.processor = OutputProcessor(self.tokenizer)
        self._hf_tokenizer = HFTokenizerFacade(self.tokenizer, self._render_chats)
        self._ids = itertools.count()
        self._lock = threading.RLock()  # the engine and the processor: one caller at a time
        self._inbox: dict[str, list[RequestOutput]] = {}  # each live request's outputs, unread
        self._closed = False

    def get_tokenizer(self) -> HFTokenizerFacade:
        """The tokenizer as vLLM's `get_tokenizer()` gives it, a Hugging Face tokenizer's
        surface (`HFTokenizerFacade`): its `apply_chat_template` renders as `chat` does."""
        return self._hf_tokenizer

    def _render_chats(self, messages: list[dict] | list[list[dict]],
                      **options: Any) -> list[list[int]]:
        """Prompt ids of a conversation or a list of them, as `chat` renders them."""
        return self._chat_prompts(_conversations(messages), **options)

    def close(self) -> None:
        """Stops the engine's tensor-parallel workers and leaves their group (an engine of one
        process holds nothing to stop); the LLM generates no more. Another tensor-parallel LLM
        can start in this process only after this (or use `with LLM(...) as llm:`). Requests
        still running (a stream left open, a generate in another thread) end with a
        RuntimeError at their next step."""
        self._closed = True  # before the lock: a caller between steps would take it again first
        with self._lock:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(
        self, prompt: str | list[int], params: SamplingParams, where: str = "prompt"
    ) -> str:
        """Queues one checked prompt; returns its request id."""
        return self._queue(self._prepare(prompt, params, where))

    def _prepare(self, prompt: str | list[int], params: SamplingParams,
                 where: str) -> tuple[str | None, list[int], SamplingParams]:
        """The prompt's text, token ids and params as the engine takes them, checked as the
        engine checks them: its refusals name `where`, the prompt's place (or, for the
        params' token ids, sampling_params)."""
        text = prompt if isinstance(prompt, str) else None
        try:
            ids = self.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else prompt
        except TypeError as e:  # the tokenizers library on a lone surrogate
            raise ValueError(f"{where} cannot be encoded as UTF-8 (a lone surrogate?): {e}") from e
        params = bad_words_ids(params, self.tokenizer.encode)
        try:
            ids = truncate_prompt(ids, params, self.engine.info.max_model_len)
            check_prompt(ids, params, self.engine.info)
        except ValueError as e:
            if str(e).startswith(("logit_bias", "allowed_token_ids")):
                whose = "" if where == "prompt" else f" (the params of {where})"
                raise ValueError(f"sampling_params.{e}{whose}") from e
            raise ValueError(f"{where}: {e}") from e
        return text, ids, params

    def _queue(self, prepared: tuple[str | None, list[int], SamplingParams]) -> str:
        text, ids, params = prepared
        with self._lock:
            if self._closed:
                raise RuntimeError("this LLM was closed: start a new one to generate")
            request_id = f"gen-{next(self._ids)}"
            self.engine.add(CoreRequest(request_id, ids, params))
            self.processor.add(request_id, text, ids, params)
            self._inbox[request_id] = []
        return request_id

    def _outputs(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """The unread outputs of `request_ids`, after one engine step if there were none (so a
        caller that loops also moves the other callers' requests on)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this LLM was closed while it generated: its requests ended")
            if not any(self._inbox[r] for r in request_ids):
                if not self.engine.has_work():
                    raise RuntimeError(f"requests {list(request_ids)} are no longer in the engine")
                outputs, stopped = self.processor.process(self.engine.step())
                for request_id, index in stopped:
                    self.engine.abort(request_id, index)
                for out in outputs:
                    if out.request_id in self._inbox:
                        self._inbox[out.request_id].append(out)
            got = [out for r in request_ids for out in self._inbox[r]]
            for r in request_ids:
                self._inbox[r] = []
            return got

    def _stop(self, request_id: str, index: int, reason: str) -> None:
        """Ends one sequence at an answer's stop string: finish_reason "stop", `reason` its
        stop_reason."""
        with self._lock:
            if request_id in self._inbox:
                self.engine.abort(request_id, index)
                if (out := self.processor.stop(request_id, index, reason)) is not None:
                    self._inbox[request_id].append(out)

    def _abort(self, request_id: str) -> None:
        """Ends a request (done, or given up): nothing more of it is kept."""
        with self._lock:
            if self._inbox.pop(request_id, None) is not None:
                self.engine.abort(request_id)
                self.processor.abort(request_id)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given none (vLLM's name): the model's
        generation config sets no sampling fields, so the defaults."""
        return SamplingParams()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: ProgressBar = True,
        **vllm_args: Any,
    ) -> list[RequestOutput]:
        """Runs all prompts as one continuous batch; outputs come back in prompt order
        (`use_tqdm` third, as in vLLM's, or a tqdm-like factory of the bar). `vllm_args`: vLLM's
        lora_request, priority, tokenization_kwargs, at values that ask for nothing."""
        _check_vllm_args("generate", vllm_args)
        batch = _as_batch(prompts)
        return self._generate(batch, _per_prompt(sampling_params, len(batch)), use_tqdm)

    def _generate(self, batch: list[tuple[str, str | list[int]]], params: list[SamplingParams],
                  use_tqdm: ProgressBar,
                  answer_stops: list[list[str]] | None = None,
                  channels: list[str | None] | None = None) -> list[RequestOutput]:
        """`answer_stops`: each prompt's stop strings on its harmony answer (chat), which end
        its sequences in the engine; `channels`: the channel each chat prompt leaves open
        (continue_final_message)."""
        request_ids = []
        try:
            for (where, p), sp in zip(batch, params):
                request_ids.append(self._submit(p, sp, where))
        except Exception:
            for request_id in request_ids:  # a bad prompt: nothing of the batch runs
                self._abort(request_id)
            raise
        watch = {r: [_AnswerStop(self.tokenizer, stops, channel) for _ in range(sp.n)]
                 for r, sp, stops, channel in zip(request_ids, params,
                                                  answer_stops or [[]] * len(params),
                                                  channels or [None] * len(params))
                 if stops}
        return self._run(request_ids, use_tqdm, watch)

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yields the request's output after each step; `outputs[i].delta_text` is the new text.

        Bad input raises here, at the call (the engine's own checks too: an empty prompt, a token
        outside the vocabulary, a prompt longer than the context); the request is queued on the
        first `next`, so an iterator that is never started leaves nothing in the engine. Each
        output's `text` stays as it was at its step (`token_ids` and `logprobs` are shared).
        """
        if _is_seq(prompt) and prompt and all(
                isinstance(p, str) or _is_seq(p) or isinstance(p, dict) and "role" not in p
                for p in prompt):
            raise TypeError("stream takes one prompt, and this is a list of them: stream each, "
                            "or give them all to generate")
        checked = _prompt(prompt, "prompt")
        params = _checked(
            SamplingParams() if sampling_params is None else sampling_params, "sampling_params"
        )
        return self._stream(self._prepare(checked, params, "prompt"))

    def _stream(
        self, prepared: tuple[str | None, list[int], SamplingParams]
    ) -> Iterator[RequestOutput]:
        request_id = self._queue(prepared)
        try:
            while True:
                for out in self._outputs([request_id]):
                    yield out
                    if out.finished:
                        return
        finally:
            self._abort(request_id)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: ProgressBar = True,
        *,
        reasoning_effort: str | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict = "auto",
        response_format: dict | None = None,
        thinking_token_budget: int | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **vllm_args: Any,
    ) -> list[ChatOutput]:
        """Chat through the harmony format: one conversation or a list of them.

        As on the server: `response_format` (OpenAI's shape) or a `structured_outputs` in the
        sampling params constrains the final answer only, `tool_choice` "required" or a named
        function forces a valid call, `thinking_token_budget` bounds the reasoning. Stop
        strings cut the answer (`content`) before the first one, never the reasoning or a
        tool call, and end the sequence there (finish_reason "stop", its `outputs[i]`'s
        stop_reason the string; its raw text is not cut).
        `reasoning_effort` (default medium) may come as vLLM users give it, in
        `chat_template_kwargs`, which also takes `model_identity`; `use_tqdm` is the third
        argument, as in vLLM. `continue_final_message=True` with `add_generation_prompt=False`
        (vLLM's pair) continues the last message, an assistant's: its text (or, without any,
        its reasoning) is the reply's start, and the reply holds what the model adds;
        `add_generation_prompt=False` alone ends the prompt after the last message (the model
        writes the next header; a last assistant answer is closed by `<|return|>`, its reasoning
        shown, as Hugging Face's template renders a finished conversation). `vllm_args`: vLLM's
        lora_request, chat_template, chat_template_content_format, tokenization_kwargs,
        mm_processor_kwargs, at values that ask for nothing."""
        _check_vllm_args("chat", vllm_args)
        conversations = _conversations(messages)
        prompts = self._chat_prompts(
            conversations, reasoning_effort=reasoning_effort, tools=tools,
            tool_choice=tool_choice, response_format=response_format,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message)
        asked = _per_prompt(sampling_params, len(conversations))
        params = [_chat_params(p, response_format, tools, tool_choice, thinking_token_budget)
                  for p in asked]
        constrained = [name for name, given in (
            ("response_format", (response_format or {}).get("type") in ("json_object",
                                                                        "json_schema")),
            ("sampling_params.structured_outputs", any(p.structured_outputs for p in asked)),
            ("tool_choice", tool_choice == "required" or isinstance(tool_choice, dict)),
            ("thinking_token_budget", thinking_token_budget is not None)) if given]
        if constrained and not add_generation_prompt:
            raise ValueError(f"{constrained[0]} cannot be enforced with add_generation_prompt="
                             "False (or continue_final_message=True): its grammar is of a reply "
                             "that starts a new assistant message; leave one of them out")
        channels = [harmony.continued_channel(conv) if continue_final_message else None
                    for _, conv in conversations]
        outputs = self._generate([(w, p) for (w, _), p in zip(conversations, prompts)], params,
                                 use_tqdm, [p.stop for p in asked], channels)
        decode = self.tokenizer.decode
        replies = []
        for out, p, channel in zip(outputs, asked, channels):
            choices = []
            for completion in out.outputs:
                hidden = hidden_stop_token(completion, p.include_stop_str_in_output)
                ids = completion.token_ids[: len(completion.token_ids) - hidden]
                parsed = harmony.parse_completion(ids, decode, channel=channel)
                finish = completion.finish_reason
                if parsed.tool_calls and finish == "stop":
                    finish = "tool_calls"
                positions, content = parsed.content_tokens, parsed.content
                cut = _first_stop(content, p.stop, p.include_stop_str_in_output)
                if cut is not None:  # the answer ends at its first stop string
                    positions = _tokens_before(self.tokenizer, completion.token_ids, positions,
                                               cut)
                    content, finish = content[:cut] or None, "stop"
                lps = completion.logprobs
                lps = None if lps is None else [lps[at] for at in positions]
                choices.append(ChatChoice(parsed.reasoning, content, parsed.tool_calls,
                                          finish, lps))
            first = choices[0]
            replies.append(ChatOutput(first.reasoning, first.content, first.tool_calls,
                                      first.finish_reason, first.logprobs, out, choices))
        return replies

    def _chat_prompts(
        self,
        conversations: list[tuple[str, list[dict]]],
        *,
        reasoning_effort: str | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict = "auto",
        response_format: dict | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[list[int]]:
        """The prompt token ids of each (place, conversation), as `chat` runs them; an error
        names the conversation's place."""
        if add_generation_prompt and continue_final_message:
            raise ValueError(harmony.BOTH_ENDINGS)
        options = _template_options(reasoning_effort, chat_template_kwargs)
        _check_chat_options(options["reasoning_effort"], tools, tool_choice)
        options.update(tools=tools, tool_choice=tool_choice,
                       add_generation_prompt=bool(add_generation_prompt),
                       continue_final_message=bool(continue_final_message))
        fmt = response_format if isinstance(response_format, dict) else {}
        if fmt.get("type") == "json_schema" and isinstance(fmt.get("json_schema"), dict):
            options["response_format"] = fmt["json_schema"]
        prompts = []
        for where, conv in conversations:
            try:
                prompts.append(harmony.render_prompt(conv, self.tokenizer.encode, **options))
            except KeyError as e:
                raise ValueError(f"{where}: missing field {e}") from e
            except (ValueError, TypeError, AttributeError) as e:
                raise ValueError(f"{where}: {e}") from e
        return prompts

    def _run(self, request_ids: list[str], use_tqdm: ProgressBar,
             watch: dict[str, list[_AnswerStop]] | None = None) -> list[RequestOutput]:
        """Steps until every request has finished; `watch`: each sequence's answer stop, which
        ends it in the engine once its answer reaches a stop string."""
        pending = list(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(request_ids), use_tqdm) if use_tqdm and len(request_ids) > 1 else None
        prefill = _PrefillBar(self.engine, request_ids[0]) if use_tqdm else None
        try:
            while pending:
                for out in self._outputs(pending):
                    for c in out.outputs if watch and out.request_id in watch else ():
                        stop = watch[out.request_id][c.index]
                        if c.finish_reason is None and (hit := stop.hit(c.token_ids)):
                            self._stop(out.request_id, c.index, hit)
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                pending = [r for r in pending if r not in done]
                if prefill is not None:
                    prefill.update()
        finally:
            for request_id in request_ids:  # done, or interrupted (e.g. Ctrl-C): free it
                self._abort(request_id)
            for b in (bar, prefill):
                if b is not None:
                    b.close()
        return [done[r] for r in request_ids]


class _AnswerStop:
    """Chat's stop strings on the answer as its tokens come: the harmony parser's content
    through StopStrings, as the server's chat choices read it, so the engine stops at the first
    (it had run on to max_tokens, its reply cut afterwards)."""

    def __init__(self, tokenizer, stops: list[str], channel: str | None = None) -> None:
        self.parser = harmony.HarmonyStreamParser(
            tokenizer.decode, detokenizer=lambda: IncrementalDetokenizer(tokenizer),
            channel=channel,
        )
        self.stops = StopStrings(stops, False)
        self.seen = 0

    def hit(self, token_ids: list[int]) -> str | None:
        """The stop string the answer has reached, if any, after the new tokens."""
        for token in token_ids[self.seen :]:
            self.seen += 1
            for d in self.parser.add(token):
                if d.kind == "content" and (hit := self.stops.feed(d.text)[1]) is not None:
                    return hit
        return None


class _FallbackHandler(logging.StreamHandler):
    """stderr, only while the root logger has no handler: an application that configures
    logging after building an LLM gets each line once, through its own handlers."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def show_startup_logs() -> None:
    """Python shows a library's INFO lines nowhere unless the application configured logging
    (its last resort prints warnings only), so a first `LLM(...)` would load in silence. As
    vLLM does, tinyoss then prints its own logger's INFO lines to stderr; a level set on the
    "tinyoss" logger beforehand is kept."""
    logger = logging.getLogger("tinyoss")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = _FallbackHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def _given(value: object) -> str:
    """A value as an error message shows it: a short repr and its type."""
    return f"{reprlib.repr(value)} ({type(value).__name__})"


def _is_seq(value: object) -> bool:
    """A list-like: str and bytes are Sequences too, but never a list of prompts or token ids."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def _as_batch(prompts: object) -> list[tuple[str, str | list[int]]]:
    """Each prompt checked and named by its place ("prompt" or "prompts[i]"), all before any is
    queued. A list whose first item is an int is one prompt of token ids, as in vLLM."""
    first = prompts[0] if _is_seq(prompts) and prompts else None
    if isinstance(prompts, (str, dict)) or isinstance(first, int):
        return [("prompt", _prompt(prompts, "prompt"))]
    if not _is_seq(prompts):
        raise TypeError(
            f"prompts={_given(prompts)} is invalid: give {PROMPT_FORMS}, or a list of them"
        )
    if not prompts:
        raise ValueError(f"prompts is an empty list: give {PROMPT_FORMS}, or a list of them")
    return [(f"prompts[{i}]", _prompt(p, f"prompts[{i}]")) for i, p in enumerate(prompts)]


def _prompt(prompt: object, where: str) -> str | list[int]:
    """One prompt in any accepted form, as text or as a list of plain ints."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        return _dict_prompt(prompt, where)
    if _is_seq(prompt):
        if prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
            raise TypeError(f"{where} is a list of chat messages: give them to chat(), which "
                            "renders them in harmony; a prompt is " + PROMPT_FORMS)
        return _token_ids(prompt, where)
    raise TypeError(f"{where}={_given(prompt)} is invalid: a prompt is {PROMPT_FORMS}")


def _dict_prompt(prompt: dict, where: str) -> str | list[int]:
    """vLLM's TextPrompt / TokensPrompt; their other keys (multi_modal_data, ...) have no meaning
    here and are refused rather than ignored."""
    unknown = [k for k in prompt if k not in ("prompt", "prompt_token_ids")]
    if unknown:
        raise ValueError(
            f"{where} has unsupported key {unknown[0]!r}: a prompt dict is "
            '{"prompt": str} or {"prompt_token_ids": [int, ...]}'
        )
    if len(prompt) != 1:
        raise ValueError(f"{where} must have exactly one of 'prompt' or 'prompt_token_ids'")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(
                f"{where}['prompt']={_given(prompt['prompt'])} is invalid: must be a str"
            )
        return prompt["prompt"]
    ids = prompt["prompt_token_ids"]
    if not _is_seq(ids):
        raise TypeError(
            f"{where}['prompt_token_ids']={_given(ids)} is invalid: must be a list of int token ids"
        )
    return _token_ids(ids, f"{where}['prompt_token_ids']")


def _token_ids(ids: Sequence, where: str) -> list[int]:
    """A copy as plain ints; bools are ints to Python but never token ids."""
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise TypeError(
                f"{where}[{i}]={_given(t)} is invalid: token ids are ints (not bools); "
                f"a prompt is {PROMPT_FORMS}"
            )
    return [int(t) for t in ids]


def _checked(params: object, where: str) -> SamplingParams:
    """A re-validated copy: `replace` re-runs SamplingParams' checks, so fields set after
    construction are checked too, and later changes by the caller do not reach the request."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"{where}={_given(params)} is invalid: must be a SamplingParams")
    try:
        checked = dataclasses.replace(params)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    if checked.structured_outputs is not None:  # one that cannot be enforced fails here, not
        try:  # as an empty answer
            check_grammar(checked.structured_outputs)
        except ValueError as e:
            raise ValueError(f"{where}.structured_outputs: {e}") from None
    return checked


def _per_prompt(params: object, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [_checked(params or SamplingParams(), "sampling_params")] * n
    if not _is_seq(params):
        raise TypeError(f"sampling_params={_given(params)} is invalid: give {PARAMS_FORMS}")
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts: give {PARAMS_FORMS}")
    return [_checked(p, f"sampling_params[{i}]") for i, p in enumerate(params)]


def _conversations(messages: object) -> list[tuple[str, list[harmony.Message]]]:
    """One conversation or a list of them, each named by its place ("messages" or
    "messages[i]") and checked message by message, so a mistake is reported where it is."""
    if not _is_seq(messages):
        raise TypeError(f"messages={_given(messages)} is invalid: give {CHAT_SHAPE}")
    if not messages:
        raise ValueError(f"messages is empty: give {CHAT_SHAPE}")
    if isinstance(messages[0], dict):
        batch = [("messages", messages)]
    else:
        batch = [(f"messages[{i}]", conv) for i, conv in enumerate(messages)]
    for where, conv in batch:
        if not _is_seq(conv):
            raise TypeError(f"{where}={_given(conv)} is invalid: give {CHAT_SHAPE}")
        harmony.check_messages(list(conv), where)
    return [(where, list(conv)) for where, conv in batch]


def _chat_params(
    params: SamplingParams,
    response_format: dict | None,
    tools: list[dict] | None,
    tool_choice: str | dict,
    thinking_token_budget: int | None,
) -> SamplingParams:
    """A chat request's params: its constraints as one harmony grammar, stopping where harmony
    ends a reply."""
    if thinking_token_budget is not None and not (
        isinstance(thinking_token_budget, int) and not isinstance(thinking_token_budget, bool)
        and thinking_token_budget >= 0
    ):
        raise ValueError(
            f"thinking_token_budget={thinking_token_budget!r} is invalid: must be an int >= 0"
        )
    answer = answer_constraint(response_format)
    if answer is not None and params.structured_outputs is not None:
        raise ValueError("give either response_format or sampling_params.structured_outputs")
    grammar = chat_constraint(
        answer or params.structured_outputs, tools=tools, tool_choice=tool_choice,
        thinking_token_budget=thinking_token_budget,
        answer_from="response_format" if answer else "sampling_params.structured_outputs",
    )
    stops = [] if params.ignore_eos else [t for t in harmony.STOP_TOKENS
                                          if t not in params.stop_token_ids]
    # stop strings apply to the answer only (`LLM.chat` watches it), as on the server: the
    # engine, which sees reasoning, headers and tool arguments too, does not look for them
    return dataclasses.replace(
        params, structured_outputs=grammar, stop_token_ids=params.stop_token_ids + stops, stop=[]
    )


def _first_stop(content: str | None, stops: list[str], included: bool = False) -> int | None:
    """Where the answer ends at the first of `stops`: where it begins, or with `included`
    (`include_stop_str_in_output`) where it ends; None without one."""
    hits = [(i, len(s)) for s in stops if content and (i := content.find(s)) >= 0]
    if not hits:
        return None
    at, size = min(hits)  # the earliest, and of those starting there the one that ends first
    return at + size if included else at


def _tokens_before(tokenizer: Any, token_ids: list[int], positions: list[int],
                   cut: int) -> list[int]:
    """The answer's token positions whose text starts before character `cut` of the answer
    (their bytes join to it): a token the stop string begins inside is kept, as the server
    keeps its logprob."""
    decoder, at, kept = codecs.getincrementaldecoder("utf-8")("replace"), 0, []
    for p in positions:
        if at >= cut:
            break
        kept.append(p)
        at += len(decoder.decode(tokenizer.token_bytes(token_ids[p])))
    return kept


def _template_options(effort: str | None, kwargs: dict | None) -> dict[str, Any]:
    """Harmony's options from `reasoning_effort` and vLLM's `chat_template_kwargs` (the keys
    gpt-oss's template reads; any other would go unread: an error naming it)."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"chat_template_kwargs={kwargs!r} is invalid: give a dict")
    kwargs = dict(kwargs or {})
    unread = sorted(k for k in kwargs if k not in ("reasoning_effort", "model_identity",
                                                   "builtin_tools"))
    if unread:
        raise ValueError(f"chat_template_kwargs key {unread[0]!r} is not read by gpt-oss's "
                         "chat template: it reads reasoning_effort, model_identity and "
                         "builtin_tools")
    if kwargs.get("builtin_tools"):
        raise ValueError(f"chat_template_kwargs builtin_tools={kwargs['builtin_tools']!r} is not "
                         "supported: tinyoss runs no browser or python tool; offer functions "
                         "as tools")
    inner = kwargs.get("reasoning_effort")
    if None not in (effort, inner) and effort != inner:
        raise ValueError(f"chat_template_kwargs reasoning_effort={inner!r} contradicts "
                         f"reasoning_effort={effort!r}: give one of them")
    options: dict[str, Any] = {"reasoning_effort": effort or inner or "medium"}
    if kwargs.get("model_identity") is not None:
        options["model_identity"] = kwargs["model_identity"]
    return options


def _check_chat_options(reasoning_effort: object, tools: object, tool_choice: object) -> None:
    """Checked once before rendering, so their errors are not blamed on a conversation."""
    if reasoning_effort not in EFFORTS:
        raise ValueError(
            f"reasoning_effort={reasoning_effort!r} is invalid: must be one of {', '.join(EFFORTS)}"
        )
    harmony.check_tools(tools or [])
    harmony.check_tool_choice(tool_choice, tools or [])


class _PrefillBar:
    """A bar over a long prompt's tokens while they are prefilled (the wait before the first
    token), for a single request: `tinyoss chat` and `generate` of one prompt. Off where stderr
    is no terminal, as the checkpoint bars are."""

    MIN_TOKENS = 2048  # shorter prompts are prefilled in one step or two: nothing to watch

    def __init__(self, engine: EngineCore, request_id: str) -> None:
        from tqdm import tqdm

        self.engine, self.request_id, self.bar = engine, request_id, None
        progress = engine.prompt_progress(request_id)
        if progress is not None and progress[1] >= self.MIN_TOKENS:
            self.bar = tqdm(total=progress[1], desc="prefill", unit="tok", disable=None)

    def update(self) -> None:
        if self.bar is None:
            return
        progress = self.engine.prompt_progress(self.request_id)
        done = self.bar.total if progress is None else progress[0]
        self.bar.update(done - self.bar.n)
        if done >= self.bar.total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _progress(total: int, use_tqdm: ProgressBar):
    """The bar of requests done: tqdm's, or from the factory given as `use_tqdm` (vLLM's)."""
    from tqdm import tqdm

    return (use_tqdm if callable(use_tqdm) else tqdm)(total=total, desc="generating",
                                                       unit="req")


def _check_vllm_args(method: str, given: dict[str, Any]) -> None:
    """`given` are vLLM's arguments of `method`, at values that ask for nothing (VLLM_INERT)."""
    for name, value in given.items():
        if name not in VLLM_ARGS[method]:
            raise TypeError(f"LLM.{method}() got an unexpected keyword argument {name!r}")
        inert, why = VLLM_INERT[name]
        if name == "priority" and isinstance(value, list) and value and all(
                type(p) is int and p == 0 for p in value):
            continue  # vLLM's default priority for each prompt: the order it has anyway
        if not any(value is x or type(value) is type(x) and value == x for x in inert):
            raise ValueError(f"{name}={_given(value)} is not supported: {why}")
