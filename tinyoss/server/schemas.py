"""The HTTP API's request and response bodies as pydantic models, and its OpenAPI document.

Requests are validated against these models (`protocol.validate`), so a wrong type is a 400
naming the field's path. They are strict: JSON `true` is not an int and "1" is not 1, because
a client that sends the wrong type has a bug we should tell it about rather than guess around.
`null` at the top level means "not given", so the defaults below apply. Unknown fields are
kept and ignored, as OpenAI-compatible servers do (`protocol.note_ignored` logs their names).
The models check types (and a few ranges that only the API has); what a value means
(SamplingParams' ranges, which roles may omit content, whether a schema can be enforced) stays
with the code that uses it.

The response models document what `app.py`, `choices.py` and `responses_api.py` send; the
tests validate live responses against them with extra fields forbidden, so the two cannot
drift apart unnoticed.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic.json_schema import models_json_schema
from pydantic_core import PydanticCustomError

from tinyoss import __version__, harmony
from tinyoss.sampling_params import MAX_LOGPROBS, SamplingParams

_DEFAULT = SamplingParams()  # SamplingParams' defaults, documented as the server's


def _either(kind: Any, expected: str) -> Any:
    """`kind` (a union, or a list of scalars) checked as one field, its error "must be
    `expected`" at the field itself: pydantic would report each alternative at a path naming
    its internal types ("stop.list[str].1")."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(
                "either", "must be {expected}", {"expected": expected}
            ) from None

    return Annotated[kind, WrapValidator(check)]


def _object_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tool's parameters: a schema of type object (`harmony.not_object_type`)."""
    if (got := harmony.not_object_type(schema)) is not None:
        raise PydanticCustomError(
            "object_schema", "must be a JSON schema of type 'object' (a call's arguments are an "
            "object), got type {got}", {"got": got})
    return schema


_Parameters = Annotated[dict[str, Any] | None, AfterValidator(_object_schema)]


def _by_type(kind: Any, expected: str, at_type: bool = False) -> Any:
    """`kind`, a model or a union of them, validated as the one its "type" names (the model
    whose type has a default when it is left out), so an error inside keeps its own path
    (input[0].role): pydantic's union would report every alternative. Another type: "must be
    `expected`", at the object or (`at_type`) at its type; a value that is no object: "must be
    `expected`" (with `at_type`, "must be an object")."""
    models: dict[str | None, type[BaseModel]] = {}
    for model in get_args(kind) or (kind,):
        tag = model.model_fields["type"]
        models |= dict.fromkeys(get_args(tag.annotation), model)
        if isinstance(tag.default, str):
            models[None] = model

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if not isinstance(value, dict) and at_type:
            raise PydanticCustomError("dict_type", "must be an object")
        if not isinstance(value, dict):
            raise PydanticCustomError("either", "must be {expected}", {"expected": expected})
        kind = value.get("type")
        # a type that is no string (a list, an object) names no model, rather than failing the
        # lookup (unhashable: a 500)
        model = models.get(kind) if kind is None or isinstance(kind, str) else None
        if model is None:
            error = PydanticCustomError("either", "must be {expected}", {"expected": expected})
            at = ("type",) if at_type else ()
            where = value.get("type") if at_type else value
            raise ValidationError.from_exception_data(
                "type", [{"type": error, "loc": at, "input": where}]
            )
        return model.model_validate(value)

    return Annotated[kind, WrapValidator(check)]


def _object(model: type[BaseModel], expected: str) -> Any:
    """A `model` object, an error inside keeping its own path (json_schema.name); a value that
    is no object: "must be `expected`", which `_either` would say of any error inside."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if not isinstance(value, dict):
            raise PydanticCustomError("either", "must be {expected}", {"expected": expected})
        return handler(value)

    return Annotated[model, WrapValidator(check)]


class _Body(BaseModel):
    """A JSON object of the API: strict types, unknown fields kept (and ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)


class _Request(_Body):
    model: StrictStr | None = Field(
        None, description="The served model's name (left out: that model); another name: 404."
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        """A top-level `null` is the field left out, so its default applies."""
        if isinstance(data, dict) and None in data.values():
            return {k: v for k, v in data.items() if v is not None}
        return data


# ---------------------------------------------------------------- request parts


class ContentPart(_Body):
    """A part of a message's content: gpt-oss reads text parts only (a refusal is text)."""

    type: StrictStr = Field(
        description='"text" (or "input_text", "output_text"; "refusal" on an assistant '
        "message); others: 400"
    )
    text: StrictStr | None = Field(None, description="The part's text.")
    refusal: StrictStr | None = Field(
        None, description="A refusal part's text: the assistant's answer, as it said it."
    )


class FunctionCallIn(_Body):
    name: StrictStr = Field(min_length=1, description="The function called.")
    arguments: _either(StrictStr | dict[str, Any], "JSON text (a string) or an object") = Field(
        "", description="Its arguments: JSON text, or an object."
    )


class ToolCallIn(_Body):
    """A tool call an earlier assistant turn made."""

    id: StrictStr | None = Field(None, description="The call's id; tool messages answer it.")
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Body):
    """One message of the conversation, rendered into gpt-oss's harmony format."""

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="system and developer: instructions; tool: a tool's result."
    )
    content: _either(
        StrictStr | list[ContentPart] | None,
        'a string or a list of text parts [{"type": "text", "text": ...}]',
    ) = Field(None, description="The text, or text parts; null only on an assistant message.")
    name: StrictStr | None = Field(None, description="A tool message's function name.")
    tool_call_id: StrictStr | None = Field(
        None, description="The call a tool message answers (required on a tool message)."
    )
    tool_calls: list[ToolCallIn] | None = Field(
        None, description="An assistant message's tool calls."
    )
    reasoning: StrictStr | None = Field(
        None, description="An assistant message's reasoning (kept only before its tool calls)."
    )
    reasoning_content: StrictStr | None = Field(None, description="Another name for reasoning.")
    thinking: StrictStr | None = Field(None, description="Another name for reasoning.")
    refusal: StrictStr | None = Field(
        None, description="An assistant message's refusal: read as its text when it has none."
    )


class FunctionDef(_Body):
    name: StrictStr = Field(min_length=1, description="The name the model calls it by.")
    description: StrictStr | None = Field(None, description="What it does, for the model.")
    parameters: _Parameters = Field(
        None, description="A JSON schema of its arguments, of type object (shown to the model, "
        "and enforced when tool_choice forces a call)."
    )  # fmt: skip
    strict: StrictBool | None = Field(
        None, description="Accepted either way: a call follows the schema when tool_choice "
        "forces one (required, named) or a response_format is given; under auto alone it is not "
        "enforced (nor by vLLM's gpt-oss path)."
    )


class Tool(_Body):
    type: Literal["function"] = Field("function", description="Function tools only.")
    function: FunctionDef


class NamedFunction(_Body):
    name: StrictStr = Field(description="One of the tools' names.")


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


_SCHEMA_NAME = "a string of 1 to 64 letters, digits, '_' or '-'"
_JSON_SCHEMA = "a JSON schema object"


class JsonSchemaSpec(_Body):
    # a missing name passes here: harmony_grammar says it is missing, for the Python API too
    name: _either(StrictStr | None, _SCHEMA_NAME) = Field(
        None, description="The schema's name (required): 1 to 64 letters, digits, '_' or '-'."
    )
    description: StrictStr | None = Field(None, description="What the answer is, for the model.")
    schema_: _either(dict[str, Any] | None, _JSON_SCHEMA) = Field(
        None, alias="schema", description="The JSON schema the answer follows."
    )
    strict: StrictBool | None = Field(None, description="Accepted; the answer always follows it.")


class ResponseFormatText(_Body):
    type: Literal["text"]


class ResponseFormatJsonObject(_Body):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Body):
    type: Literal["json_schema"]
    json_schema: _object(JsonSchemaSpec, '{"name": N, "schema": SCHEMA}, SCHEMA ' + _JSON_SCHEMA)


# by its type, so an error inside names its own part (response_format.json_schema.name)
ResponseFormat = _by_type(
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
    '{"name": N, "schema": SCHEMA}}, SCHEMA a JSON schema object (left out: any JSON object)',
) | None


class StructuredOutputsSpec(BaseModel):
    """vLLM's structured outputs: exactly one of these constrains the output."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: _either(
        dict[str, Any] | StrictStr | None, "a JSON schema: an object, or its JSON text"
    ) = Field(None, alias="json", description="A JSON schema (an object, or its JSON text).")
    json_object: StrictBool | None = Field(None, description="true: any JSON object.")
    regex: StrictStr | None = Field(None, description="A regular expression.")
    choice: list[StrictStr] | None = Field(None, description="One of these strings.")
    grammar: StrictStr | None = Field(
        None, description="A Lark grammar (llguidance's dialect); /v1/completions only."
    )


# an error inside names its part (structured_outputs.choice), as vLLM's does
StructuredOutputs = _object(
    StructuredOutputsSpec, "an object with one of json, json_object, regex, choice or grammar"
) | None


class StreamOptions(_Body):
    """A stream's options. Given at all, they send the usage unless include_usage is false, as
    vLLM's StreamOptions do (OpenAI's API leaves it out unless true)."""

    include_usage: StrictBool = Field(
        True, description="Send a last chunk with the usage (and no choices); true unless "
        "given false, as in vLLM."
    )
    continuous_usage_stats: StrictBool = Field(
        False, description="vLLM: every chunk carries the usage so far."
    )


Stop = _either(StrictStr | list[StrictStr], "a string or a list of strings")
ToolChoice = _either(
    Literal["auto", "none", "required"] | NamedToolChoice,
    "'auto', 'none', 'required' or {\"type\": \"function\", \"function\": {\"name\": N}}",
)
TokenIds = _either(list[StrictInt], "a list of token ids (ints)")
Prompt = _either(  # strings and token lists are not mixed in one list (OpenAI, vLLM)
    StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]],
    "a string, a list of token ids (ints), a list of strings or a list of token-id lists",
)

# ---------------------------------------------------------------- requests


_Key = Annotated[StrictStr, Field(max_length=64)]
Metadata = _either(
    Annotated[dict[_Key, Annotated[StrictStr, Field(max_length=512)]], Field(max_length=16)],
    "an object of at most 16 string values (keys up to 64 characters, values up to 512)",
)


class _Sampling(_Request):
    """The sampling fields chat and completions share (SamplingParams checks their ranges)."""

    n: StrictInt | None = Field(_DEFAULT.n, description="Choices to generate for each prompt.")
    user: StrictStr | None = Field(None, description="Accepted (an end user's id).")
    temperature: StrictFloat | None = Field(
        _DEFAULT.temperature, description="Sampling temperature; 0 samples greedily."
    )
    top_p: StrictFloat | None = Field(
        _DEFAULT.top_p, description="Nucleus sampling: the smallest set of tokens this likely."
    )
    top_k: StrictInt | None = Field(
        _DEFAULT.top_k, description="vLLM: only the k most likely tokens; 0 or -1: all."
    )
    min_p: StrictFloat | None = Field(
        _DEFAULT.min_p, description="vLLM: drop tokens less likely than min_p x the top one's."
    )
    seed: StrictInt | None = Field(
        None, description="Makes sampling reproducible; choice i (of n) samples with seed + i x "
        "1,000,003, so seeds less than that apart share no choice (vLLM's: "
        "seed + i, so seed 1's first choice is seed 0's second)."
    )
    presence_penalty: StrictFloat | None = Field(
        _DEFAULT.presence_penalty, description="Penalizes tokens already generated, once each."
    )
    frequency_penalty: StrictFloat | None = Field(
        _DEFAULT.frequency_penalty, description="Penalizes tokens by how often they were generated."
    )
    repetition_penalty: StrictFloat | None = Field(
        _DEFAULT.repetition_penalty,
        description="vLLM: divides the logits of tokens in the prompt or output (1: off).",
    )
    ignore_eos: StrictBool | None = Field(
        _DEFAULT.ignore_eos, description="vLLM: keep generating past end tokens (benchmarks)."
    )
    min_tokens: StrictInt | None = Field(
        _DEFAULT.min_tokens, description="vLLM: end and stop tokens are held back until this many."
    )
    stop: Stop | None = Field(None, description="Up to which text to generate (not included).")
    stop_token_ids: TokenIds | None = Field(
        None, description="vLLM: token ids that end the answer too (not included in the text)."
    )
    include_stop_str_in_output: StrictBool | None = Field(
        _DEFAULT.include_stop_str_in_output,
        description="vLLM: keep the stop string (or stop token's text) at the end of the text "
        "(/v1/completions only).",
    )
    skip_special_tokens: StrictBool | None = Field(
        _DEFAULT.skip_special_tokens,
        description="vLLM: leave special tokens out of the text (/v1/completions only; the "
        "end token stays out unless include_stop_str_in_output).",
    )
    prompt_logprobs: StrictInt | None = Field(
        None, description="vLLM: the prompt's logprobs with this many top alternatives a token "
        "(prompt_logprobs in the answer: a completions choice's, a chat completion's); not with "
        "stream.",
    )
    cache_salt: StrictStr | None = Field(
        None, description="vLLM: prompts of different salts share no prefix-cache block."
    )
    stream: StrictBool | None = Field(
        False, description="Send the answer as server-sent events, as it is generated."
    )
    stream_options: StreamOptions | None = Field(None, description="Options of a stream.")
    return_token_ids: StrictBool | None = Field(
        False, description="vLLM: return the prompt's token ids (prompt_token_ids) and each "
        "choice's (token_ids; in a stream, each chunk's new ones)."
    )  # fmt: skip
    structured_outputs: StructuredOutputs = Field(
        None, description="vLLM: a grammar the output follows (or give response_format)."
    )
    response_format: ResponseFormat = Field(
        None, description="The answer is JSON (following a schema, when one is given)."
    )
    logit_bias: dict[str, StrictFloat] | None = Field(
        None, description="Token ids (as strings) to a number in [-100, 100] added to the "
        "token's logit before sampling: -100 all but bans it, 100 all but forces it."
    )  # fmt: skip
    bad_words: list[StrictStr] | None = Field(
        None, description="vLLM: words never generated (banned token by token, as vLLM does)."
    )
    allowed_token_ids: TokenIds | None = Field(
        None, description="vLLM: only these token ids may be sampled (not with a grammar)."
    )
    truncate_prompt_tokens: StrictInt | None = Field(
        None, description="vLLM: only the prompt's last k tokens are used (its first k with "
        "truncation_side right; -1: as many as leave room for max_tokens); a prompt too long "
        "is otherwise a 400."
    )  # fmt: skip
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="vLLM: which end truncate_prompt_tokens cuts: left (the default) keeps "
        "the prompt's last tokens, right its first."
    )  # fmt: skip
    use_beam_search: StrictBool | None = Field(
        False, description="vLLM: beam search is not supported; false only."
    )
    logits_processors: list[Any] | None = Field(
        None, description="vLLM: not supported, refused unless empty."
    )
    return_tokens_as_token_ids: StrictBool | None = Field(
        False, description="vLLM: with logprobs, each token and top token is named "
        "'token_id:<id>' instead of its text (chat: a top token's bytes are that name's)."
    )
    structural_tag: Any = Field(
        None, description="vLLM: not supported (give structured_outputs or response_format)."
    )
    priority: StrictInt | None = Field(
        0, description="vLLM: 0 only; tinyoss schedules first come, first served."
    )
    request_id: StrictStr | None = Field(
        None, description="vLLM: the answer's and every chunk's id is chatcmpl-<request_id> "
        "(cmpl-<request_id> on /v1/completions); an X-Request-Id header wins over it. 1 to 256 "
        "printable ASCII characters; requests may share one."
    )  # fmt: skip


class ChatTemplateKwargs(_Body):
    """vLLM's chat_template_kwargs: the variables gpt-oss's chat template reads (others: 400)."""

    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None, description="As the top-level reasoning_effort, which it must not contradict."
    )
    model_identity: StrictStr | None = Field(
        None, description="The system message's first line (left out: ChatGPT's)."
    )
    builtin_tools: list[StrictStr] | None = Field(
        None, description="Not supported, refused unless empty: tinyoss runs no browser or "
        "python tool."
    )  # fmt: skip


class ChatInput(_Request):
    """What renders a chat to a prompt: /tokenize's messages form as chat completions."""

    messages: list[ChatMessage] = Field(
        min_length=1, description="The conversation, oldest message first."
    )
    tools: list[Tool] | None = Field(None, description="Functions the model may call.")
    tool_choice: ToolChoice | None = Field(
        "auto", description="auto: the model decides; none: no tools; required or a named "
        "function: the reply is such a call (enforced by a grammar).",
    )  # fmt: skip
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        "medium", description="How much gpt-oss reasons before answering."
    )
    chat_template_kwargs: ChatTemplateKwargs | None = Field(
        None, description="vLLM: reasoning_effort, model_identity (other keys: 400)."
    )
    response_format: ResponseFormat = Field(
        None, description="OpenAI: the answer is JSON (following a schema, when one is given)."
    )
    parallel_tool_calls: StrictBool | None = Field(
        None, description="Accepted; the model decides how many calls a turn holds."
    )


class ChatCompletionRequest(_Sampling, ChatInput):
    """POST /v1/chat/completions."""

    max_tokens: StrictInt | None = Field(
        None, description="Tokens to generate at most (left out: up to the context length)."
    )
    max_completion_tokens: StrictInt | None = Field(
        None, description="The same as max_tokens, which it overrides."
    )
    logprobs: StrictBool | None = Field(False, description="Return each token's logprob.")
    top_logprobs: StrictInt | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="With logprobs: the top alternatives per token."
    )
    thinking_token_budget: StrictInt | None = Field(
        None, ge=0, description="vLLM: tokens of reasoning at most (enforced by a grammar)."
    )
    include_reasoning: StrictBool = Field(
        True, description="vLLM: false leaves the reasoning out of the answer (the model still "
        "reasons)."
    )
    functions: list[dict[str, Any]] | None = Field(
        None, description="Legacy; not supported (empty only): use tools."
    )
    function_call: Any = Field(None, description='Legacy; not supported ("none" only).')
    audio: dict[str, Any] | None = Field(None, description="Not supported ({} only): text only.")
    modalities: list[StrictStr] | None = Field(None, description='Only ["text"] is supported.')
    prediction: dict[str, Any] | None = Field(None, description="Not supported ({} only).")
    verbosity: StrictStr | None = Field(
        None, description="medium only: gpt-oss has no verbosity control."
    )
    web_search_options: dict[str, Any] | None = Field(
        None, description="Not supported ({} asks for a search)."
    )
    chat_template: StrictStr | None = Field(
        None, description="vLLM: not supported (the prompt is always harmony's)."
    )
    add_generation_prompt: StrictBool | None = Field(
        True, description="vLLM: end the prompt by opening the assistant's turn (false: after "
        "the last message; the model writes the header)."
    )
    continue_final_message: StrictBool | None = Field(
        False, description="vLLM: the reply continues the last message, an assistant's (with "
        "add_generation_prompt false or left out); the reply holds the new text only."
    )
    echo: StrictBool | None = Field(
        False, description="vLLM: false only (/v1/completions echoes the prompt)."
    )
    documents: list[Any] | None = Field(
        None, description="vLLM: not supported, refused unless empty (gpt-oss reads none)."
    )
    store: StrictBool | None = Field(
        None, description="Accepted; chat completions are not stored here."
    )
    metadata: Metadata | None = Field(None, description="Accepted: up to 16 string pairs.")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="Accepted (there is one tier)."
    )


class CompletionRequest(_Sampling):
    """POST /v1/completions: raw text in and out, no chat format."""

    prompt: Prompt = Field(
        description="A text or token ids; a list of them runs each (n choices each)."
    )
    max_tokens: StrictInt | None = Field(16, description="Tokens to generate at most.")
    logprobs: StrictInt | None = Field(
        None, description="Return each token's logprob and this many top alternatives."
    )
    echo: StrictBool | None = Field(False, description="Put the prompt before the text.")
    best_of: StrictInt | None = Field(None, description="Only equal to n is supported.")
    suffix: StrictStr | None = Field(None, description="Not supported (gpt-oss has no FIM).")


class TokenizeChatRequest(ChatInput):
    """POST /tokenize with messages: the prompt a chat request would run."""

    add_generation_prompt: StrictBool | None = Field(
        True, description="End with the assistant's turn opening, as chat completions do."
    )
    continue_final_message: StrictBool | None = Field(
        False, description="End inside the last message, an assistant's, as chat completions do."
    )
    chat_template: StrictStr | None = Field(
        None, description="vLLM: not supported (the prompt is always harmony's)."
    )
    add_special_tokens: StrictBool | None = Field(
        True, description="Accepted; gpt-oss prompts get no BOS or EOS."
    )
    return_token_strs: StrictBool | None = Field(False, description="Return each token's text.")


class TokenizeCompletionRequest(_Request):
    """POST /tokenize with a prompt: the text's tokens, as /v1/completions runs them."""

    prompt: StrictStr = Field(description="The text to tokenize (or give messages, a chat).")
    add_special_tokens: StrictBool | None = Field(
        True, description="Accepted; gpt-oss prompts get no BOS or EOS."
    )
    return_token_strs: StrictBool | None = Field(False, description="Return each token's text.")


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(_Request):
    """POST /detokenize."""

    tokens: TokenIds = Field(description="Token ids, each in the vocabulary.")


# ---------------------------------------------------------------- the Responses API's requests


def _text_or(kind: Any, expected: str) -> Any:
    """A string or a list `kind`; an error inside the list keeps its own path (content[0]),
    which `_either` would report at the field."""
    items = TypeAdapter(kind)

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return items.validate_python(value, strict=True)
        raise PydanticCustomError("either", "must be {expected}", {"expected": expected})

    return Annotated[StrictStr | kind, WrapValidator(check)]


class InputTextPart(_Body):
    type: Literal["input_text", "output_text"]
    text: StrictStr


class RefusalPart(_Body):
    type: Literal["refusal"]
    refusal: StrictStr = Field(description="Read as the assistant's text.")


class ReasoningTextPart(_Body):
    type: Literal["reasoning_text"]
    text: StrictStr


class SummaryTextPart(_Body):
    type: Literal["summary_text"]
    text: StrictStr


_TEXT_ONLY = "gpt-oss reads text only"
MessageContent = _text_or(
    list[_by_type(InputTextPart | RefusalPart,
                  f"an input_text, output_text or refusal part: {_TEXT_ONLY}")],
    "a string or a list of input_text, output_text or refusal parts",
)  # fmt: skip
class ToolImagePart(_Body):
    """An image a tool returned (Codex's view_image, an MCP tool's picture): gpt-oss cannot see
    it, so the model reads a line saying so, where a 400 would fail the agent's turn."""

    type: Literal["input_image"]


OutputContent = _text_or(
    list[_by_type(InputTextPart | ToolImagePart,
                  f"an input_text, output_text or input_image part: {_TEXT_ONLY}")],
    "a string or a list of input_text, output_text or input_image parts",
)


class InputMessage(_Body):
    """A message of the conversation; `type` may be left out."""

    type: Literal["message"] = Field("message", description="message (the default).")
    role: Literal["user", "system", "developer", "assistant"] = Field(
        description="system and developer: instructions."
    )
    content: MessageContent = Field(description="The text, or text parts.")


class InputFunctionCall(_Body):
    """A tool call the model made earlier (as a response's output gives it)."""

    type: Literal["function_call"]
    call_id: StrictStr = Field(min_length=1, description="The id its output answers.")
    name: StrictStr = Field(min_length=1, description="The function called.")
    arguments: StrictStr = Field(description="Its arguments, JSON text.")


class InputFunctionCallOutput(_Body):
    """A tool's result: it must follow its function_call (here or in the previous response)."""

    type: Literal["function_call_output"]
    call_id: StrictStr = Field(description="The call it answers.")
    output: OutputContent = Field(
        description="The result, a text or text parts (an image part: a line saying it is not "
        "shown)."
    )


class InputReasoning(_Body):
    """Reasoning the model did earlier, kept before a tool call of the turn in progress."""

    type: Literal["reasoning"]
    content: _text_or(
        list[_by_type(ReasoningTextPart, "a reasoning_text part")],
        "a string or a list of reasoning_text parts",
    ) | None = Field(None, description="The reasoning, as this server returns it.")  # fmt: skip
    summary: list[_by_type(SummaryTextPart, "a summary_text part")] | None = Field(
        None, description="Read when there is no content."
    )
    encrypted_content: StrictStr | None = Field(
        None, description="Not supported: reasoning here is plain content."
    )


InputItem = _by_type(
    InputMessage | InputFunctionCall | InputFunctionCallOutput | InputReasoning,
    "message, function_call, function_call_output or reasoning (other input items are not "
    "supported)",
    at_type=True,
)
_TOOL = '{"type": "function", "name": N, "parameters": SCHEMA}'


class ResponsesFunctionTool(_Body):
    type: Literal["function"] = Field(description="A function the client runs.")
    name: StrictStr = Field(min_length=1, description="The name the model calls it by.")
    description: StrictStr | None = Field(None, description="What it does, for the model.")
    parameters: Annotated[_either(dict[str, Any] | None, "a JSON schema object"),
                          AfterValidator(_object_schema)] = Field(
        None, description="A JSON schema of its arguments, of type object (enforced when "
        "tool_choice forces a call)."
    )  # fmt: skip
    strict: StrictBool | None = Field(
        None, description="Accepted either way: a call follows the schema when tool_choice "
        "forces one (required, named) or a response_format is given; under auto alone it is not "
        "enforced (nor by vLLM's gpt-oss path)."
    )


# tools OpenAI's servers run themselves: gpt-oss cannot call them here (`--tool-server` is not
# served), so they are left out of the prompt, as vLLM leaves them without a tool server, and
# a client that offers one (Codex's web_search) still works. Tools a client runs (local_shell,
# custom) are a 400: left out, the model would lack them unseen.
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_2025_08_26",
                "web_search_preview_2025_03_11", "file_search", "code_interpreter",
                "image_generation", "mcp")


class ResponsesHostedTool(_Body):
    type: Literal[HOSTED_TOOLS] = Field(  # type: ignore[valid-type]
        description="A tool a hosted server runs: left out (logged), as gpt-oss cannot call it "
        "here."
    )


ResponsesTool = _by_type(
    ResponsesFunctionTool | ResponsesHostedTool,
    f"'function' (the tools this server runs; hosted ones such as web_search are left out), "
    f"{_TOOL}",
    at_type=True,
)


class ResponsesNamedTool(_Body):
    type: Literal["function"]
    name: StrictStr = Field(description="One of the tools' names.")


ResponsesToolChoice = _either(
    Literal["auto", "none", "required"] | ResponsesNamedTool,
    "'auto', 'none', 'required' or {\"type\": \"function\", \"name\": N}",
)


class ResponsesStreamOptions(_Body):
    include_obfuscation: StrictBool | None = Field(
        None, description="Accepted; events carry no obfuscation field."
    )


class ResponsesReasoning(_Body):
    effort: StrictStr | None = Field(
        None, description="low, medium (left out) or high: gpt-oss's efforts; others: 400."
    )
    summary: Literal["auto", "concise", "detailed", "none"] | None = Field(
        None, description="Accepted and echoed; reasoning comes whole, as content (none: Codex's "
        "spelling of no summary)."
    )
    generate_summary: Literal["auto", "concise", "detailed", "none"] | None = Field(
        None, description="The deprecated name of summary."
    )


class TextFormatText(_Body):
    type: Literal["text"]


class TextFormatJsonObject(_Body):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Body):
    type: Literal["json_schema"]
    name: _either(StrictStr, _SCHEMA_NAME) = Field(description="The schema's name.")
    schema_: _either(dict[str, Any], _JSON_SCHEMA) = Field(
        alias="schema", description="The JSON schema it follows."
    )
    description: StrictStr | None = Field(None, description="What the answer is, for the model.")
    strict: StrictBool | None = Field(None, description="Accepted; the answer always follows it.")


TextFormat = _by_type(
    TextFormatText | TextFormatJsonObject | TextFormatJsonSchema,
    '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name": N, '
    '"schema": SCHEMA}, SCHEMA a JSON schema object (left out: any JSON object)',
) | None


class ResponsesText(_Body):
    format: TextFormat = Field(None, description="The answer is JSON (following a schema).")
    verbosity: StrictStr | None = Field(
        None, description="medium only: gpt-oss has no verbosity control."
    )




class ResponseCreateRequest(_Request):
    """POST /v1/responses: made into a chat request, so every chat check applies alike."""

    input: _text_or(
        Annotated[list[InputItem], Field(min_length=1)],
        'a string or a non-empty list of items, e.g. [{"role": "user", "content": "Hi"}]',
    ) = Field(description="The conversation: a string (a user message) or a list of items.")
    instructions: StrictStr | None = Field(None, description="A developer message put first.")
    previous_response_id: StrictStr | None = Field(
        None, description="A stored response this one continues (its input and output first)."
    )
    tools: list[ResponsesTool] | None = Field(
        None, description="Functions the model may call (hosted tools: left out, logged)."
    )
    tool_choice: ResponsesToolChoice | None = Field(
        None, description="auto (left out): the model decides; none: no tools; required or a "
        "named function: the reply is such a call (enforced by a grammar).",
    )  # fmt: skip
    parallel_tool_calls: StrictBool | None = Field(None, description="Accepted and echoed.")
    reasoning: ResponsesReasoning | None = Field(None, description="How much gpt-oss reasons.")
    text: ResponsesText | None = Field(None, description="The answer's format.")
    max_output_tokens: StrictInt | None = Field(
        None, description="Tokens to generate at most, reasoning included."
    )
    temperature: StrictFloat | None = Field(None, description="Sampling temperature (1).")
    top_p: StrictFloat | None = Field(None, description="Nucleus sampling (1: off).")
    top_k: StrictInt | None = Field(None, description="vLLM: only the k most likely tokens.")
    min_p: StrictFloat | None = Field(
        None, description="vLLM: drop tokens less likely than min_p x the top one's."
    )
    seed: StrictInt | None = Field(None, description="vLLM: makes sampling reproducible.")
    cache_salt: StrictStr | None = Field(
        None, description="vLLM: prompts of different salts share no prefix-cache block."
    )
    presence_penalty: StrictFloat | None = Field(
        None, description="Penalizes tokens already generated, once each."
    )
    frequency_penalty: StrictFloat | None = Field(
        None, description="Penalizes tokens by how often they were generated."
    )
    repetition_penalty: StrictFloat | None = Field(
        None, description="vLLM: divides the logits of tokens in the prompt or output (1: off)."
    )
    min_tokens: StrictInt | None = Field(
        None, description="vLLM: end tokens are held back until this many."
    )
    thinking_token_budget: StrictInt | None = Field(
        None, description="vLLM: tokens of reasoning at most (enforced by a grammar)."
    )
    stream: StrictBool | None = Field(
        False, description="Send the response as server-sent events, as it is generated."
    )
    store: StrictBool | None = Field(
        True, description="Keep the response for GET and previous_response_id (the response "
        "says false when the server keeps none: --max-stored-responses 0)."
    )
    metadata: Metadata | None = Field(None, description="Echoed: up to 16 string pairs.")
    user: StrictStr | None = Field(None, description="Echoed.")
    background: StrictBool | None = Field(
        False, description="Not supported: a response runs while its request is open."
    )
    include: list[StrictStr] | None = Field(
        None, description="Accepted for outputs this server never produces; others: 400."
    )
    truncation: StrictStr | None = Field(
        None, description="disabled only: an input longer than the context is a 400."
    )
    top_logprobs: StrictInt | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="The top alternatives of each token of "
        "output_text's logprobs (asks for them, as include message.output_text.logprobs does)."
    )
    conversation: Any = Field(None, description="Not supported: use previous_response_id.")
    prompt: Any = Field(None, description="Prompt templates are not supported.")
    max_tool_calls: StrictInt | None = Field(
        None, ge=1, description="Echoed: it bounds built-in tool calls, and there are none."
    )
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="Accepted; served as 'default' (there is one tier)."
    )
    stream_options: ResponsesStreamOptions | None = Field(
        None, description="Accepted; events are never obfuscated."
    )
    prompt_cache_key: StrictStr | None = Field(
        None, description="Echoed; the prefix cache needs no key."
    )
    safety_identifier: StrictStr | None = Field(None, description="Echoed.")
    priority: StrictInt | None = Field(
        0, description="vLLM: 0 only; tinyoss schedules first come, first served."
    )


# ---------------------------------------------------------------- responses

FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class _Out(BaseModel):
    """A response object; clients must ignore fields they do not know (more may come)."""

    model_config = ConfigDict(extra="allow")


class PromptTokensDetails(_Out):
    cached_tokens: int = Field(description="Prompt tokens whose KV came from the prefix cache.")


class CompletionTokensDetails(_Out):
    reasoning_tokens: int = Field(description="Tokens of reasoning (analysis) text generated.")


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="Chat's: the reasoning tokens among the completion's.")
    prompt_tokens_details: PromptTokensDetails | None = Field(
        description="null only in a stream's chunks sent before the engine said how many of "
        "the prompts' tokens it found cached (with continuous usage stats: the opening chat "
        "chunk; with several completions prompts, until each has begun)")


class TopLogprob(_Out):
    token: str = Field(description="The token's text (bytes that are not UTF-8 replaced).")
    logprob: float = Field(description="Its log-probability (-9999.0 for -inf).")
    bytes: list[int] = Field(description="The token's bytes.")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob] | None = Field(
        description="The answer's tokens (their bytes join to message.content): no reasoning, "
        "no tool arguments; null when there is no answer."
    )
    refusal: None = Field(description="Always null (gpt-oss has no refusal field).")


class FunctionCallOut(_Out):
    name: str
    arguments: str = Field(description="JSON text.")


class ToolCallOut(_Out):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None = Field(description="The answer (null when there is none).")
    refusal: None = Field(description="OpenAI's: always null (gpt-oss writes no refusals).")
    annotations: list[Any] = Field(description="OpenAI's: always empty.")
    reasoning: str | None = Field(description="gpt-oss's reasoning (its analysis channel).")
    reasoning_content: str | None = Field(
        None, description="The same as reasoning, with --reasoning-content (else left out)."
    )
    tool_calls: list[ToolCallOut] | None = Field(None, description="Present when it calls.")


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StrictInt | str | None = Field(
        description="vLLM's: the stop string or stop token id that ended the choice (null for the "
        "model's EOS, <|return|>; a length cut; or a choice not yet ended)."
    )
    token_ids: list[int] | None = Field(None, description="With return_token_ids: all of them.")


class PromptLogprob(_Out):
    logprob: float
    rank: int | None = Field(description="1 for the most likely token.")
    decoded_token: str


# vLLM's prompt_logprobs: a position each, null for the first, else {token id: its entry}
PromptLogprobs = list[dict[str, PromptLogprob] | None]


_FINGERPRINT = Field(description="OpenAI's: fp_ and a hash of what may change the answers to "
                   "one seed (tinyoss's version, the checkpoint, dtype and quantized layers); "
                   "the same on every answer and chunk of a server.")


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str = _FINGERPRINT
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids.")
    prompt_logprobs: PromptLogprobs | None = Field(
        None, description="vLLM's, with prompt_logprobs: the prompt's token and its top "
        "alternatives at each position (null at the first)."
    )


class FunctionCallDelta(_Out):
    name: str | None = None
    arguments: str


class ToolCallDelta(_Out):
    index: int = Field(description="Which call of the message this continues.")
    id: str | None = Field(None, description="On the call's first chunk.")
    type: Literal["function"] | None = Field(None, description="On the call's first chunk.")
    function: FunctionCallDelta


class ChatDelta(_Out):
    role: Literal["assistant"] | None = Field(None, description="On the first chunk.")
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = Field(
        None, description="The same as reasoning, with --reasoning-content (else left out)."
    )
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StrictInt | str | None = Field(
        description="vLLM's: the stop string or stop token id that ended the choice (null for the "
        "model's EOS, <|return|>; a length cut; or a choice not yet ended)."
    )
    token_ids: list[int] | None = Field(
        None, description="With return_token_ids: those new since the last chunk."
    )


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str = _FINGERPRINT
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(
        None, description="On the last chunk, with include_usage; on every chunk (so far), "
        "with continuous_usage_stats."
    )  # fmt: skip
    prompt_token_ids: list[int] | None = Field(
        None, description="On the first chunk, with return_token_ids."
    )


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(
        description="With echo the prompt's come first, the first of them null.")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int] = Field(description="Where each token starts in the text.")


class CompletionChoice(_Out):
    index: int = Field(description="prompt index x n + choice index.")
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StrictInt | str | None = Field(
        description="vLLM's: the stop string or stop token id that ended the choice (null for the "
        "model's EOS, <|return|>; a length cut; or a choice not yet ended)."
    )
    prompt_token_ids: list[int] | None = Field(
        None, description="With return_token_ids (in a stream, on the choice's first chunk)."
    )
    token_ids: list[int] | None = Field(
        None, description="With return_token_ids (in a stream, those new since the last chunk)."
    )
    prompt_logprobs: PromptLogprobs | None = Field(
        None, description="vLLM's, with prompt_logprobs (or echo with logprobs), not in a "
        "stream: the prompt's token and its top alternatives at each position (null at the "
        "first)."
    )


class Completion(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str = _FINGERPRINT
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str = _FINGERPRINT
    choices: list[CompletionChoice]
    usage: Usage | None = Field(
        None, description="On the last chunk, with include_usage; on every chunk (so far), "
        "with continuous_usage_stats."
    )  # fmt: skip


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(description="With return_token_strs.")


class DetokenizeResponse(_Out):
    prompt: str


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(None, description="Once the model has loaded.")


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Out):
    status: Literal["ok", "loading", "restarting", "error"]
    message: str | None = Field(None, description="Why it is not ok.")


class Version(_Out):
    version: str


class ErrorDetail(_Out):
    message: str = Field(description="What was wrong and what to do.")
    type: str = Field(description="invalid_request_error, authentication_error, ...")
    param: str | None = Field(description="The field at fault, e.g. messages[0].content.")
    code: str | None = Field(description="e.g. context_length_exceeded, model_not_found.")


class ErrorResponse(_Out):
    error: ErrorDetail


# ---------------------------------------------------------------- the Responses API's responses

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputReasoningText(_Out):
    type: Literal["reasoning_text"]
    text: str


class OutputSummaryText(_Out):
    type: Literal["summary_text"]
    text: str


class OutputReasoning(_Out):
    id: str
    type: Literal["reasoning"]
    summary: list[OutputSummaryText] = Field(description="Always empty: see content.")
    content: list[OutputReasoningText] = Field(description="gpt-oss's reasoning, whole.")
    status: ItemStatus


class OutputText(_Out):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = Field(description="Always empty.")
    logprobs: list[TokenLogprob] = Field(
        description="With include message.output_text.logprobs or top_logprobs: the text's "
        "tokens (their bytes join to it); else empty."
    )


class OutputMessage(_Out):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(_Out):
    id: str
    type: Literal["function_call"]
    call_id: str = Field(description="The id a function_call_output answers.")
    name: str
    arguments: str = Field(description="JSON text.")
    status: ItemStatus


OutputItem = Annotated[
    OutputReasoning | OutputMessage | OutputFunctionCall, Field(discriminator="type")
]


class ResponseError(_Out):
    code: str
    message: str


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens"]


class ReasoningOut(_Out):
    effort: Literal["low", "medium", "high"]
    summary: Literal["auto", "concise", "detailed", "none"] | None


class TextOut(_Out):
    format: TextFormat = Field(description="As the request gave it ({\"type\": \"text\"}).")
    verbosity: Literal["medium"]


class FunctionToolOut(_Out):
    type: Literal["function"]
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class InputTokensDetails(_Out):
    cached_tokens: int = Field(description="Input tokens whose KV came from the prefix cache.")
    cache_write_tokens: int = Field(description="Always 0: no cache here is written apart.")


class OutputTokensDetails(_Out):
    reasoning_tokens: int


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(_Out):
    """A response: POST /v1/responses' answer, GET's and cancel's; the request's settings are
    repeated as they applied."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "cancelled", "failed"]
    background: bool
    completed_at: int | None
    error: ResponseError | None = Field(description="Why it failed or was cancelled.")
    incomplete_details: IncompleteDetails | None
    model: str
    output: list[OutputItem] = Field(description="Items in the order the model wrote them.")
    max_tool_calls: int | None
    service_tier: str
    prompt_cache_key: str | None
    safety_identifier: str | None
    top_logprobs: int
    truncation: Literal["disabled"]
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ReasoningOut
    store: bool
    temperature: float
    text: TextOut
    tool_choice: ResponsesToolChoice
    tools: list[FunctionToolOut]
    top_p: float
    user: str | None
    usage: ResponseUsage | None = Field(description="Once the response has ended.")


class ResponseItemList(_Out):
    """GET /v1/responses/{id}/input_items: a page of the items a response was generated from."""

    object: Literal["list"]
    data: list[dict[str, Any]] = Field(
        description="Input items (message, function_call, function_call_output, reasoning) as "
        "they were given, each with its id, type and status; a message's text as one part."
    )
    first_id: str | None
    last_id: str | None
    has_more: bool = Field(description="Whether more follow: ask again with after=last_id.")


class ResponseDeleted(_Out):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class ResponseStreamEvent(_Out):
    """One event of a stream: response.created, response.output_text.delta, ...,
    response.completed (or .incomplete, .failed); its fields are OpenAI's for that type."""

    type: str
    sequence_number: int = Field(description="0, 1, 2, ... in the order sent.")


# ---------------------------------------------------------------- OpenAPI

_REQUESTS = (ChatCompletionRequest, CompletionRequest, TokenizeCompletionRequest,
             TokenizeChatRequest, DetokenizeRequest)  # fmt: skip
_RESPONSES = (ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, TokenizeResponse,
              DetokenizeResponse, ModelList, Health, Version, ErrorResponse)  # fmt: skip
_ERRORS = {
    "400": "Invalid request: `param` names the field.",
    "401": "Missing or wrong API key.",
    "404": "Unknown model.",
    "413": "Request body too large (--max-request-bytes).",
    "429": "At capacity; retry after Retry-After.",
    "503": "The model is loading, or the engine is unavailable.",
}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _post(summary: str, op_id: str, request: dict, answer: str, chunk: str | None = None) -> dict:
    ok = _json(_ref(answer), f"A {answer}")
    if chunk is not None:
        ok["description"] += (
            f"; with stream: true, server-sent events `data: <{chunk}>` ending with "
            "`data: [DONE]` (an error after the first event comes as `data: <ErrorResponse>`)"
        )
        ok["content"]["text/event-stream"] = {"schema": _ref(chunk)}
    errors = {code: {"$ref": f"#/components/responses/Error{code}"} for code in _ERRORS}
    return {"post": {
        "summary": summary,
        "operationId": op_id,
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {"200": ok, **errors},
    }}  # fmt: skip


def _get(summary: str, op_id: str, ok: dict, *, public: bool = False, **more: dict) -> dict:
    op: dict = {"summary": summary, "operationId": op_id, "responses": {"200": ok, **more}}
    if public:
        op["security"] = []  # no API key needed
    else:
        op["responses"]["401"] = {"$ref": "#/components/responses/Error401"}
    return {"get": op}


def build_openapi(
    extra_paths: dict[str, dict] | None = None,
    extra_requests: tuple[type[BaseModel], ...] = (),
    extra_responses: tuple[type[BaseModel], ...] = (),
    *,
    api_key: bool = False,
) -> dict:
    """The OpenAPI 3.1 document of the server's routes. The hook for more routes (the Responses
    API): `extra_paths` are added as they are; their schemas may `$ref`
    "#/components/schemas/<Model>" of `extra_requests` and `extra_responses`. `api_key`: the
    server has one, so the bearer scheme, its requirement and the 401s are declared (a client
    generated from a document that asks for a key the server lacks would demand one)."""
    models = [(m, "validation") for m in _REQUESTS + extra_requests]
    models += [(m, "serialization") for m in _RESPONSES + extra_responses]
    _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    tokenize = {"oneOf": [_ref("TokenizeCompletionRequest"), _ref("TokenizeChatRequest")]}
    ping = _get("/health's answer, under vLLM's (SageMaker's) name", "getPing",
                _json(_ref("Health")), public=True,
                **{"503": _json(_ref("Health"), "Not ready")})["get"]  # fmt: skip
    paths = {
        "/v1/chat/completions": _post(
            "A chat reply", "createChatCompletion", _ref("ChatCompletionRequest"),
            "ChatCompletion", "ChatCompletionChunk",
        ),
        "/v1/completions": _post(
            "A text completion", "createCompletion", _ref("CompletionRequest"), "Completion",
            "CompletionChunk",
        ),
        "/tokenize": _post("A text's or a chat's tokens", "tokenize", tokenize, "TokenizeResponse"),
        "/detokenize": _post("Token ids' text", "detokenize", _ref("DetokenizeRequest"),
                             "DetokenizeResponse"),
        "/v1/models": _get("The served model", "listModels", _json(_ref("ModelList"))),
        "/v1/models/{id}": {
            "parameters": [{"name": "id", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            **_get("The served model, by its name", "retrieveModel", _json(_ref("ModelCard")),
                   **{"404": _json(_ref("ErrorResponse"), "No model of that name")}),
        },
        "/health": _get(
            "Whether the engine is ready", "getHealth", _json(_ref("Health")), public=True,
            **{"503": _json(_ref("Health"), "Loading, restarting or failed")},
        ),
        "/ping": {"get": ping, "post": {**ping, "operationId": "postPing"}},  # as vLLM serves it
        "/version": _get("The server's version", "getVersion", _json(_ref("Version")),
                         public=True),
        "/metrics": _get(
            "Prometheus metrics, under vLLM's names", "getMetrics",
            {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}},
            public=True,
        ),
        "/openapi.json": _get("This document", "getOpenapi", _json({"type": "object"}),
                              public=True),
        **(extra_paths or {}),
    }  # fmt: skip
    doc = {
        "openapi": "3.1.0",
        "info": {
            "title": "tinyoss",
            "version": __version__,
            "description": "An OpenAI-compatible server for gpt-oss (with vLLM's extensions).",
        },
        "paths": paths,
        "components": {
            "schemas": defs["$defs"],
            "responses": {
                f"Error{code}": _json(_ref("ErrorResponse"), text) for code, text in _ERRORS.items()
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
    return doc if api_key else _keyless(doc)


def _keyless(doc: dict) -> dict:
    """`doc` for a server without an API key: no bearer scheme, requirement or 401 anywhere."""
    del doc["security"], doc["components"]["securitySchemes"]
    del doc["components"]["responses"]["Error401"]
    for item in doc["paths"].values():
        for op in item.values():
            if isinstance(op, dict) and "responses" in op:  # (not a path's "parameters")
                op.pop("security", None)
                op["responses"].pop("401", None)
    return doc


def _responses_paths() -> dict[str, dict]:
    """The Responses API's routes, for `build_openapi`'s hook."""
    errors = {code: {"$ref": f"#/components/responses/Error{code}"} for code in _ERRORS}
    answer = _json(_ref("ResponseObject"), "The response")
    stream = {"schema": _ref("ResponseStreamEvent")}
    answer["description"] += (
        "; with stream: true, server-sent events `event: <type>` `data: <ResponseStreamEvent>`, "
        "the last one response.completed, response.incomplete or response.failed"
    )
    answer["content"]["text/event-stream"] = stream
    unknown = {"404": _json(_ref("ErrorResponse"), "No stored response has this id"),
               "401": {"$ref": "#/components/responses/Error401"}}  # fmt: skip
    rid = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"},
            "description": "The response's id (resp_...)."}]  # fmt: skip
    body = {"required": True,
            "content": {"application/json": {"schema": _ref("ResponseCreateRequest")}}}  # fmt: skip
    return {
        "/v1/responses": {"post": {
            "summary": "A response (OpenAI's Responses API)",
            "operationId": "createResponse",
            "requestBody": body,
            "responses": {"200": answer, **errors},
        }},
        "/v1/responses/{id}": {
            "parameters": rid,
            "get": {"summary": "A stored response", "operationId": "getResponse",
                    "responses": {"200": _json(_ref("ResponseObject")), **unknown}},
            "delete": {"summary": "Forgets a stored response", "operationId": "deleteResponse",
                       "responses": {"200": _json(_ref("ResponseDeleted")), **unknown}},
        },
        "/v1/responses/{id}/input_items": {
            "parameters": rid + [
                {"name": "after", "in": "query", "schema": {"type": "string"},
                 "description": "List the items after the one of this id."},
                {"name": "limit", "in": "query",
                 "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
                 "description": "Items at most."},
                {"name": "order", "in": "query",
                 "schema": {"enum": ["asc", "desc"], "default": "desc"},
                 "description": "desc: newest first."},
            ],
            "get": {"summary": "The items a stored response was generated from",
                    "operationId": "listInputItems", "responses": {
                "200": _json(_ref("ResponseItemList")),
                "400": _json(_ref("ErrorResponse"), "A bad limit, order or after"),
                **unknown,
            }},
        },
        "/v1/responses/{id}/cancel": {
            "parameters": rid,
            "post": {"summary": "Cancels a response in progress",
                     "operationId": "cancelResponse", "responses": {
                "200": _json(_ref("ResponseObject"), "The response, cancelled"),
                "400": _json(_ref("ErrorResponse"), "The response is not in progress"),
                **unknown,
            }},
        },
    }  # fmt: skip


@functools.cache
def openapi_json(api_key: bool) -> bytes:
    """GET /openapi.json's body, built once for a server with an API key or without: the core
    routes and the Responses API's."""
    doc = build_openapi(
        _responses_paths(),
        extra_requests=(ResponseCreateRequest,),
        extra_responses=(ResponseObject, ResponseDeleted, ResponseItemList,
                         ResponseStreamEvent),
        api_key=api_key,
    )
    return json.dumps(doc).encode()
