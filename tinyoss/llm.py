"""The embedded Python API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages)`."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from tinyoss import harmony
from tinyoss.config import EngineConfig
from tinyoss.engine.builder import build_engine, checkpoint_folder, load_tokenizer
from tinyoss.engine.core import CoreRequest
from tinyoss.engine.output_processor import OutputProcessor, RequestOutput
from tinyoss.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class ChatOutput:
    """A chat reply taken apart: harmony's analysis channel is `reasoning`, final is `content`."""

    reasoning: str | None
    content: str | None
    tool_calls: list[harmony.ToolCall]
    finish_reason: str | None  # "stop", "length", "tool_calls" or "abort"
    output: RequestOutput


class LLM:
    """Load a gpt-oss checkpoint (folder, hub id, or "tiny") and generate from it.

    Keyword arguments are `EngineConfig` fields: dtype, device, max_model_len, max_num_seqs,
    max_num_batched_tokens, block_size, gpu_memory_utilization, kv_cache_tokens,
    enable_prefix_caching, load_format, revision, seed. The engine core runs in this process
    (`tinyoss serve` runs it in a process of its own).
    """

    def __init__(self, model: str = "tiny", **kwargs: Any) -> None:
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise TypeError(
                f"unknown LLM argument(s) {', '.join(unknown)}; "
                f"valid: {', '.join(sorted(fields - {'model'}))}"
            )
        config = EngineConfig(model=model, **kwargs)
        folder = checkpoint_folder(config)
        self.tokenizer = load_tokenizer(folder)
        self.engine = build_engine(config, folder)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def _submit(self, prompt: Prompt, params: SamplingParams | None) -> str:
        """Validates and queues one prompt; returns its request id."""
        params = params or SamplingParams()
        request_id = f"gen-{next(self._ids)}"
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.engine.add(CoreRequest(request_id, ids, params))
        self.processor.add(request_id, text, ids, params)
        return request_id

    def _step(self) -> list[RequestOutput]:
        outputs, stopped = self.processor.process(self.engine.step())
        for request_id, index in stopped:
            self.engine.abort(request_id, index)
        return outputs

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.processor.abort(request_id)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs all prompts as one continuous batch; outputs come back in prompt order."""
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params, len(batch))
        request_ids = []
        try:
            for p, sp in zip(batch, params):
                request_ids.append(self._submit(p, sp))
        except Exception:
            for request_id in request_ids:  # a bad prompt: nothing of the batch runs
                self._abort(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yields the request's output after each step; `outputs[i].delta_text` is the new text."""
        request_id = self._submit(prompt, sampling_params)
        try:
            while True:
                for out in self._step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self._abort(request_id)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        reasoning_effort: str = "medium",
        tools: list[dict] | None = None,
        tool_choice: str | dict = "auto",
        use_tqdm: bool = True,
    ) -> list[ChatOutput]:
        """Chat through the harmony format: one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encode = self.tokenizer.encode
        prompts = [
            harmony.render_prompt(
                conv,
                encode,
                reasoning_effort=reasoning_effort,
                tools=tools,
                tool_choice=tool_choice,
            )
            for conv in conversations
        ]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        decode = self.tokenizer.decode
        replies = []
        for out in outputs:
            completion = out.outputs[0]
            parsed = harmony.parse_completion(completion.token_ids, decode)
            finish = completion.finish_reason
            if parsed.tool_calls and finish == "stop":
                finish = "tool_calls"
            replies.append(
                ChatOutput(parsed.reasoning, parsed.content, parsed.tool_calls, finish, out)
            )
        return replies

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(request_ids)) if use_tqdm and len(request_ids) > 1 else None
        try:
            while pending:
                for out in self._step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            for request_id in pending:  # interrupted (e.g. Ctrl-C): free what is left
                self._abort(request_id)
            if bar is not None:
                bar.close()
        return [done[r] for r in request_ids]


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
    return params


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="req")
