"""The harmony chat format of gpt-oss: chats to prompt tokens, generated tokens to messages.

Rendering follows OpenAI's reference renderer (github.com/openai/harmony, src/encoding.rs and
docs/format.md); tests/test_harmony.py pins where the Hugging Face chat_template.jinja differs.
Special tokens are kept as ids and only ordinary text goes through the tokenizer, so no user
text can forge a message boundary.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from tinyoss.tokenizer import (CALL, CHANNEL, CONSTRAIN, END, ENDOFTEXT, MESSAGE, RETURN,
                               SPECIAL_NAMES, START)
FIRST_SPECIAL = 199998  # every id from here up is a special token in o200k_harmony
STOP_TOKENS = (RETURN, CALL)  # generation ends on these (they close the last message)
DEFAULT_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
CHANNELS_LINE = (
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)
TOOLS_LINE = "Calls to these tools must go to the commentary channel: 'functions'."
# vLLM's words for asking both (its request validator's), and what to do
BOTH_ENDINGS = ("Cannot set both `continue_final_message` and `add_generation_prompt` to True: "
                "continue_final_message continues the last message, add_generation_prompt "
                "starts a new one (set add_generation_prompt to false)")

Segment = int | str  # a special token id, or text for the tokenizer
Message = dict[str, Any]


# ---------------------------------------------------------------- checking

ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PARTS = ("text", "input_text", "output_text")  # content parts that are plain text


def _need(ok: object, message: str) -> None:
    if not ok:
        raise ValueError(message)


_JSON_WORDS = {None: "null", True: "true", False: "false"}


def _given(value: Any) -> str:
    """How a message goes on after a field's path: " is missing" for None (JSON's null, or left
    out), else "=VALUE is invalid"."""
    return " is missing" if value is None else f"={short_repr(value)} is invalid"


def _not(value: Any) -> str:
    """", not VALUE", or nothing where the value is None (the message then says what to send)."""
    return "" if value is None else f", not {short_repr(value)}"


def short_repr(value: Any, limit: int = 80) -> str:
    """A client's value as an error message shows it, in at most `limit` characters: null, true
    and false as JSON writes them (a JSON client sent them: Python's None, True and False would
    name no value of its), strings quoted as OpenAI's messages quote values ('text'), numbers as
    written, lists and objects item by item. Only what shows is rendered: a 10 MB value costs
    no more than a short one. A check shared with the Python API says "is missing" rather than
    show a None, which reads the same to both."""
    out: list[str] = []
    size = 0

    def put(text: str) -> None:
        nonlocal size
        out.append(text)
        size += len(text)

    def walk(v: Any) -> None:  # each level writes a character: at most `limit` deep
        if size > limit:
            return
        if v is None or isinstance(v, bool):
            put(_JSON_WORDS[v])
        elif isinstance(v, dict):
            put("{")
            for i, (key, item) in enumerate(v.items()):
                if size > limit:
                    return
                put(", " if i else "")
                walk(key)
                put(": ")
                walk(item)
            put("}")
        elif isinstance(v, (list, tuple)):
            put("[" if isinstance(v, list) else "(")
            for i, item in enumerate(v):
                if size > limit:
                    return
                put(", " if i else "")
                walk(item)
            put("]" if isinstance(v, list) else ",)" if len(v) == 1 else ")")
        elif isinstance(v, str):
            put(repr(v[: limit + 1]))  # the head is all that shows
        else:
            put(repr(v))

    walk(value)
    text = "".join(out)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def function_name(tool: Any) -> str | None:
    """N of {"type": "function", "function": {"name": N}} (the type may be left out), else None."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) and name else None


def check_messages(messages: Any, where: str = "messages") -> None:
    """Raises ValueError naming the path (messages[i].content[j]) of a role or content the
    renderer cannot take: it would otherwise fail with a Python error, or drop what it cannot
    read."""
    _need(
        isinstance(messages, list) and messages,
        f'{where} must be a non-empty list of message objects, e.g. [{{"role": "user", '
        '"content": "Hi"}]',
    )
    for i, m in enumerate(messages):
        at = f"{where}[{i}]"
        _need(isinstance(m, dict), f"{at} must be an object{_not(m)}")
        role = m.get("role")
        _need(role in ROLES, f"{at}.role{_given(role)}: must be one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                _need(isinstance(part, dict),
                      f'{at}.content[{j}] must be a text part {{"type": "text", "text": str}}'
                      f"{_not(part)}")  # fmt: skip
                if kind == "refusal" and role == "assistant":  # OpenAI's: read as its text
                    _need(isinstance(part.get("refusal"), str),
                          f"{at}.content[{j}].refusal{_given(part.get('refusal'))}: a refusal "
                          'part is {"type": "refusal", "refusal": str}')  # fmt: skip
                    continue
                if kind in ("thinking", "redacted_thinking") and role == "assistant":
                    continue  # LiteLLM's blocks of another provider's reasoning: left out, as
                    # vLLM reads them (empty text); the reasoning gpt-oss reads is `reasoning`
                _need(
                    kind in TEXT_PARTS,
                    f"{at}.content[{j}].type is missing: gpt-oss reads text parts "
                    '{"type": "text", "text": str}' if kind is None else
                    f"{at}.content[{j}] of type {short_repr(kind)} is not supported: gpt-oss reads "
                    "text only (parts of type 'text')",
                )  # fmt: skip
                _need(isinstance(part.get("text"), str),
                      f"{at}.content[{j}].text{_given(part.get('text'))}: a text part is "
                      '{"type": "text", "text": str}')  # fmt: skip
        else:
            _need(
                isinstance(content, str) or content is None and role == "assistant",
                f"{at}.content is missing: a {role} message's content is a string or a list of "
                "text parts (only an assistant message may have none)" if content is None else
                f"{at}.content must be a string or a list of text parts, not {short_repr(content)}",
            )  # fmt: skip
        _need(m.get("refusal") is None or role == "assistant",
              f"{at}.refusal is an assistant message's field, not a {role} message's")
        for key in ("reasoning", "reasoning_content", "thinking", "name", "tool_call_id",
                    "refusal"):
            value = m.get(key)
            _need(
                value is None or isinstance(value, str),
                f"{at}.{key} must be a string, not {short_repr(value)}",
            )
        if role == "tool" and m.get("name") is not None:
            _need(_TOOL_NAME.fullmatch(m["name"]) is not None,
                  f"{at}.name is {short_repr(m['name'])}: a tool's name must be 1 to 64 letters, "
                  "digits, '_' or '-'")
        calls = m.get("tool_calls")
        _need(
            calls is None or isinstance(calls, list) and role == "assistant",
            f"{at}.tool_calls must be a list, on an assistant message",
        )
        for j, call in enumerate(calls or ()):
            fn = call.get("function") if isinstance(call, dict) else None
            args = fn.get("arguments", "") if isinstance(fn, dict) else None
            _need(
                function_name(call) and isinstance(args, (str, dict)),
                f"{at}.tool_calls[{j}] must be {{\"type\": \"function\", \"function\": "
                '{"name": N, "arguments": JSON text}}',
            )
            _need(_TOOL_NAME.fullmatch(function_name(call)) is not None,
                  f"{at}.tool_calls[{j}].function.name is {short_repr(function_name(call))}: a "
                  "tool's name must be 1 to 64 letters, digits, '_' or '-' (it is written into "
                  "the prompt's headers)")


def not_object_type(parameters: dict | None) -> str | None:
    """The type a tool's parameters schema gives, in JSON, where it is not "object" (OpenAI
    requires an object: the arguments the model writes are one; any other type had a call's
    arguments written as a bare 9 or [false]); None where it is or none is given."""
    kind = (parameters or {}).get("type", "object")
    return None if kind in ("object", ["object"]) else json.dumps(kind)


def check_tools(tools: Any) -> None:
    """Raises ValueError naming the tool (tools[i]) that is not a function tool the renderer
    can show the model."""
    _need(
        isinstance(tools, list),
        'tools must be a list of {"type": "function", "function": {"name": N, ...}}',
    )  # fmt: skip
    first: dict[str, int] = {}  # name -> the first tool of that name
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        _need(
            function_name(tool),
            f'{at} must be {{"type": "function", "function": {{"name": N, ...}}}}',
        )  # fmt: skip
        name = function_name(tool)
        _need(_TOOL_NAME.fullmatch(name) is not None,
              f"{at} is named {short_repr(name)}: a tool's name must be 1 to 64 letters, digits, "
              "'_' or '-' (as in OpenAI's API; the model writes it in its call)")
        j = first.setdefault(name, i)
        _need(j == i, f"{at} is named {name!r} like tools[{j}]: give each tool its own name "
                      "(the model calls a tool by its name)")
        fn = tool["function"]
        params, desc = fn.get("parameters"), fn.get("description")
        _need(
            params is None or isinstance(params, dict),
            f"{at}.function.parameters must be a JSON schema object, not {short_repr(params)}",
        )
        _need(not_object_type(params) is None,
              f"{at}.function.parameters must be a JSON schema of type 'object' (a call's "
              f"arguments are an object), got type {not_object_type(params)}")
        _need(
            desc is None or isinstance(desc, str),
            f"{at}.function.description must be a string, not {short_repr(desc)}",
        )


def check_tool_choice(choice: Any, tools: list[dict]) -> None:
    named = isinstance(choice, dict) and function_name(choice) in map(function_name, tools)
    _need(
        choice in (None, "auto", "none", "required") or named,
        f"tool_choice={short_repr(choice)} is invalid: must be 'auto', 'none', 'required' or "
        '{"type": "function", "function": {"name": N}} naming one of the tools',
    )


# ---------------------------------------------------------------- rendering


def render_segments(
    messages: list[Message],
    *,
    tools: list[dict] | None = None,
    tool_choice: str | dict | None = "auto",
    reasoning_effort: str = "medium",
    model_identity: str = DEFAULT_IDENTITY,
    knowledge_cutoff: str = "2024-06",
    current_date: str | None = None,
    response_format: dict | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[Segment]:
    """The prompt as special ids and text runs, ending with `<|start|>assistant`.

    vLLM's `add_generation_prompt=False` ends it after the last message instead (the model
    writes the next header itself), rendered as the Hugging Face chat template renders a
    finished conversation: a last assistant answer keeps its reasoning and is closed by
    `<|return|>` (the token that ends a reply; openai-harmony's
    `render_conversation_for_training` closes it so too), any other last message as ever.
    `continue_final_message=True` ends it inside the last message, an assistant's, left open
    for the model to continue (`continued_channel` says how; `check_ending` what may be asked).

    OpenAI `system`/`developer` messages become harmony's developer "# Instructions" (leading
    ones merged, later ones as their own developer message); harmony's system message carries
    identity, knowledge cutoff, date (None: today, "": left out) and reasoning effort.
    `tool_choice`: "none" offers no tools; "required" adds an instruction to call one; a named
    function ({"type": "function", "function": {"name": N}}) offers only N and adds an
    instruction to call it. Harmony has no native tool_choice; the engine may also constrain
    decoding. `response_format` ({"name", "schema", "description"?}, a chat request's
    json_schema) ends the developer message as harmony's "# Response Formats" section (it
    informs the model; the engine's grammar enforces it).
    """
    if reasoning_effort not in ("low", "medium", "high"):
        raise ValueError(f"reasoning_effort must be low, medium or high, not {reasoning_effort!r}")
    tools, directive = _choose_tools(tools or [], tool_choice)
    if current_date is None:
        current_date = datetime.date.today().isoformat()
    head = "\n".join(  # an empty identity keeps its (empty) line, as harmony's renderer does
        [model_identity] + [
            line
            for line in (
                knowledge_cutoff and f"Knowledge cutoff: {knowledge_cutoff}",
                current_date and f"Current date: {current_date}",
            )
            if line
        ]
    )
    channels = CHANNELS_LINE + ("\n" + TOOLS_LINE if tools else "")
    out: list[Segment] = []
    _message(
        out,
        ["system"],
        "\n\n".join(s for s in (head, f"Reasoning: {reasoning_effort}", channels) if s),
    )
    lead = 0
    while lead < len(messages) and messages[lead].get("role") in ("system", "developer"):
        lead += 1
    instructions = "\n\n".join(
        s for s in [_text(m.get("content")) for m in messages[:lead]] + [directive] if s
    )
    sections = (["# Instructions", instructions] if instructions else []) + (
        ["# Tools\n\n" + render_tool_namespace(tools)] if tools else []
    )
    if response_format is not None:
        sections.append(_response_format(response_format))
    if sections:
        _message(out, ["developer"], "\n\n".join(sections))
    check_ending(messages, add_generation_prompt, continue_final_message)
    if continue_final_message:  # the turns before it: this turn's reasoning is kept
        _render_turns(out, messages[lead:-1], lead)
        _open_message(out, messages[-1])
    else:
        _render_turns(out, messages[lead:], lead, finished=not add_generation_prompt)
        out += [START, "assistant"] if add_generation_prompt else []
    return out


def check_ending(messages: list[Message], add_generation_prompt: bool,
                 continue_final_message: bool) -> None:
    """Raises ValueError where the prompt cannot end as asked: vLLM's rule (not both), and a
    continued message must be an assistant's answer or reasoning, not tool calls (a call is
    complete when it is written: the model cannot add to it)."""
    _need(not (add_generation_prompt and continue_final_message), BOTH_ENDINGS)
    if not continue_final_message:
        return
    at, last = f"messages[{len(messages) - 1}]", messages[-1]
    _need(last.get("role") == "assistant",
          f"{at}.role is {short_repr(last.get('role'))}: continue_final_message continues the "
          "last message, which must be the assistant's (its text is the start of the reply)")
    _need(not last.get("tool_calls"),
          f"{at} has tool_calls: continue_final_message cannot continue a tool call (it is "
          "complete once made); send the tool's result as a tool message and leave "
          "continue_final_message out")


def continued_channel(messages: list[Message]) -> str:
    """The channel of the message `continue_final_message` leaves open: "final" where the
    last message has text (content or refusal) or no reasoning, else "analysis" (its reasoning
    is continued)."""
    last = messages[-1]
    return "final" if _answer_text(last) or not _reasoning(last) else "analysis"


def _reasoning(m: Message) -> str | None:
    return m.get("reasoning") or m.get("reasoning_content") or m.get("thinking")


def _given_reasoning(m: Message) -> str | None:
    """The first reasoning field given (not None), empty or not, as transformers passes it to
    the template's `thinking` (its template renders any `thinking` key, "" too)."""
    return next((m[k] for k in ("reasoning", "reasoning_content", "thinking")
                 if m.get(k) is not None), None)


def _answer_text(m: Message) -> str:
    """An assistant message's answer: its content, else OpenAI's refusal."""
    return _text(m.get("content")) or m.get("refusal") or ""


def _open_message(out: list[Segment], m: Message) -> None:
    """The last assistant message, open: its reasoning (kept, as the turn is in progress) as an
    analysis message before an answer, then the header and text of the channel continued,
    without the closing <|end|>."""
    channel, text, reasoning = continued_channel([m]), _answer_text(m), _reasoning(m)
    if channel == "final" and reasoning:
        _message(out, ["assistant", CHANNEL, "analysis"], reasoning)
    _message(out, ["assistant", CHANNEL, channel], text if channel == "final" else reasoning,
             end="")


def _response_format(fmt: dict) -> str:
    description = fmt.get("description")
    schema = json.dumps(fmt.get("schema") or {}, separators=(",", ":"), ensure_ascii=False)
    note = f"// {description}\n" if description else ""
    return f"# Response Formats\n\n## {fmt.get('name') or 'response'}\n\n{note}{schema}"


def render_text(messages: list[Message], **options: Any) -> str:
    """The prompt as one string with special tokens written out (for templates and debugging)."""
    return "".join(
        SPECIAL_NAMES[s] if isinstance(s, int) else s for s in render_segments(messages, **options)
    )


def render_prompt(
    messages: list[Message], encode: Callable[[str], list[int]], **options: Any
) -> list[int]:
    """Prompt token ids. `encode` must treat its text as ordinary (never emit special ids)."""
    ids: list[int] = []
    for s in render_segments(messages, **options):
        ids.extend([s] if isinstance(s, int) else encode(s))
    return ids


def _choose_tools(tools: list[dict], choice: str | dict | None) -> tuple[list[dict], str]:
    if not tools or choice in (None, "auto"):
        return tools, ""
    if choice == "none":
        return [], ""
    if choice == "required":
        return tools, "You must call at least one of the functions in the `functions` namespace."
    name = (choice.get("function") or choice).get("name") if isinstance(choice, dict) else None
    chosen = [t for t in tools if t.get("function", t).get("name") == name]
    if not chosen:
        raise ValueError(f"tool_choice names no offered function: {choice!r}")
    return chosen, f"You must call the function `functions.{name}`."


def _message(out: list[Segment], header: list[Segment], body: str,
             end: Segment = END) -> None:
    """One message; an `end` of "" leaves it open."""
    for s in [START, *header, MESSAGE, body, end]:
        if isinstance(s, str) and out and isinstance(out[-1], str):
            out[-1] += s
        elif s != "":
            out.append(s)


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(
        p["refusal"] if p.get("type") == "refusal" else p.get("text", "")
        for p in content
        if isinstance(p, dict) and p.get("type") in (*TEXT_PARTS, "refusal")
    )


def _render_turns(out: list[Segment], messages: list[Message], first: int = 0,
                  finished: bool = False) -> None:
    """User, assistant and tool turns; reasoning is kept only before tool calls of the turn in
    progress (no assistant answer after it), as harmony and the HF template prescribe.

    `finished` (no generation prompt follows): a last message that is an assistant's answer is
    the end of the conversation, rendered as the HF template renders it then: its reasoning (a
    reasoning field given, even empty) as an analysis message, and the answer closed by
    `<|return|>`, not `<|end|>`."""
    names: dict = {}  # call id -> function, of the calls so far: a result names its nearest
    last_answer = max(
        (
            i
            for i, m in enumerate(messages)
            if m.get("role") == "assistant" and not m.get("tool_calls")
        ),
        default=-1,
    )
    last_call = None
    for i, m in enumerate(messages):
        role, text = m.get("role"), _text(m.get("content"))
        if role == "assistant":  # OpenAI's refusal: its answer
            text = _answer_text(m)
        if role == "user":
            _message(out, ["user"], text)
        elif role in ("system", "developer"):
            _message(out, ["developer"], "# Instructions\n\n" + text)
        elif role == "assistant" and m.get("tool_calls"):
            reasoning = _reasoning(m)
            if reasoning and i > last_answer:
                _message(out, ["assistant", CHANNEL, "analysis"], reasoning)
            if text:
                _message(out, ["assistant", CHANNEL, "commentary"], text)
            for call in m["tool_calls"]:
                fn = call.get("function", call)
                last_call, args = fn["name"], fn.get("arguments", "")
                names[call.get("id")] = last_call
                _message(
                    out,
                    [
                        "assistant",
                        CHANNEL,
                        f"commentary to=functions.{last_call} ",
                        CONSTRAIN,
                        "json",
                    ],
                    args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                    CALL,
                )
        elif role == "assistant" and finished and i == len(messages) - 1:
            reasoning = _given_reasoning(m)
            if reasoning is not None:
                _message(out, ["assistant", CHANNEL, "analysis"], reasoning)
            _message(out, ["assistant", CHANNEL, "final"], text, RETURN)
        elif role == "assistant":
            _message(out, ["assistant", CHANNEL, "final"], text)
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and call_id not in names:
                raise ValueError(f"messages[{first + i}].tool_call_id={short_repr(call_id)} is "
                                 "the id of no earlier assistant tool call")
            name = names.get(call_id) or m.get("name") or last_call
            if not name:
                raise ValueError(f"messages[{first + i}] is a tool result without a tool call "
                                 "before it")
            _message(out, [f"functions.{name} to=assistant", CHANNEL, "commentary"], text)
        else:
            raise ValueError(f"unknown message role {role!r}")


def render_tool_namespace(tools: list[dict]) -> str:
    """OpenAI function tools as harmony's TypeScript-like `namespace functions`."""
    lines = ["## functions\n", "namespace functions {\n"]
    for tool in tools:
        fn = tool.get("function", tool)
        lines += [f"// {line}" for line in _lines(fn.get("description") or "")]
        params = fn.get("parameters")
        # arguments with properties, or a union of them (shown as harmony shows it: a top-level
        # oneOf had been shown as taking none)
        shown = params and (params.get("properties") or isinstance(params.get("oneOf"), list))
        args = f"_: {_ts(params, '')}" if shown else ""
        lines.append(f"type {fn['name']} = ({args}) => any;\n")
    lines.append("} // namespace functions")
    return "\n".join(lines)


def _lines(text: str) -> list[str]:
    """`text`'s lines as harmony's renderer (Rust's `lines`) cuts them: at \\n and \\r\\n only
    (Python's splitlines also cuts at \\r, \\x0b, \\u2028 and more)."""
    parts = text.split("\n")
    if parts[-1] == "":
        parts.pop()
    return [p[:-1] if p.endswith("\r") else p for p in parts]


def _is_enum(schema: dict) -> bool:
    return isinstance(schema.get("enum"), list) and bool(schema["enum"])


def _default(value: Any, schema: dict, raw_enum: bool = True) -> str:
    if isinstance(value, str) and not _is_enum(schema):
        return f'"{value}"'
    if isinstance(value, str) and raw_enum:
        return value
    return _json(value)


def _json(value: Any) -> str:
    """Compact JSON as harmony's renderer (Rust's serde_json) writes it: floats in its form."""
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, list):
        return "[" + ",".join(_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(str(k), ensure_ascii=False) + ":" + _json(v)
                              for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def _float(x: float) -> str:
    """A float as serde_json (Rust's ryu) writes it: 1e-6, 1e20 and 0.00001, where Python
    writes 1e-06, 1e+20 and 1e-05 (a schema default the model saw in another form)."""
    if x == 0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    mantissa, _, exp = repr(abs(x)).partition("e")
    whole, _, frac = mantissa.partition(".")
    digits = (whole + frac).lstrip("0")
    k = int(exp or 0) - len(frac) + len(digits) - len(digits.rstrip("0"))
    digits = digits.rstrip("0")
    n, kk = len(digits), len(digits) + k  # value = digits x 10^k; kk: the point's place
    if 0 <= k and kk <= 16:
        body = digits + "0" * k + ".0"
    elif 0 < kk <= 16:
        body = digits[:kk] + "." + digits[kk:]
    elif -5 < kk <= 0:
        body = "0." + "0" * -kk + digits
    else:
        body = digits[0] + ("." + digits[1:] if n > 1 else "") + f"e{kk - 1}"
    return ("-" if x < 0 else "") + body


def _nullable(ts: str, schema: dict) -> str:
    return ts + " | null" if schema.get("nullable") is True and "null" not in ts else ts


def _ts(schema: dict, indent: str) -> str:
    """JSON schema to TypeScript, a port of harmony's json_schema_to_typescript."""
    if not isinstance(schema, dict):
        return "any"
    if isinstance(schema.get("oneOf"), list):
        out = ""
        for variant in schema["oneOf"]:
            out += f"\n{indent} | " + _nullable(_ts(variant, indent + "   "), variant)
            notes = [variant["description"]] if isinstance(variant.get("description"), str) else []
            if "default" in variant:
                notes.append("default: " + _default(variant["default"], variant, raw_enum=False))
            out += f" // {' '.join(notes)}" if notes else ""
        return out
    kind = schema.get("type")
    if isinstance(kind, list) and any(isinstance(k, str) for k in kind):
        return " | ".join("number" if k == "integer" else k for k in kind if isinstance(k, str))
    if kind == "object":
        return _ts_object(schema, indent)
    if kind == "string":
        values = [f'"{v}"' for v in schema.get("enum") or [] if isinstance(v, str)]
        return " | ".join(values) if values else "string"
    if kind == "array":
        return _ts(schema["items"], indent) + "[]" if "items" in schema else "Array<any>"
    return {"number": "number", "integer": "number", "boolean": "boolean"}.get(kind, "any")


def _ts_object(schema: dict, indent: str) -> str:
    desc = schema.get("description")
    out = (f"{indent}// {desc}\n" if isinstance(desc, str) else "") + "{\n"
    required = set(schema.get("required") or [])
    for key, val in (schema.get("properties") or {}).items():
        val = val if isinstance(val, dict) else {}
        opt = "" if key in required else "?"
        if isinstance(val.get("title"), str):
            out += f"{indent}// {val['title']}\n{indent}//\n"
        desc = val.get("description") if isinstance(val.get("description"), str) else None
        if desc is not None and "oneOf" not in val:  # an empty one too, as harmony's
            out += f"{indent}// {desc}\n"
        if isinstance(val.get("examples"), list) and val["examples"]:
            out += f"{indent}// Examples:\n" + "".join(
                f'{indent}// - "{ex}"\n' for ex in val["examples"] if isinstance(ex, str)
            )
        variants = val.get("oneOf")
        if not isinstance(variants, list):
            out += f"{indent}{key}{opt}: " + _nullable(_ts(val, indent + "    "), val) + ","
            out += f" // default: {_default(val['default'], val)}" if "default" in val else ""
            out += "\n"
            continue
        above = desc is not None and not (variants and variants[0].get("description") == desc)
        out += f"{indent}// {desc}\n" if above else ""
        out += f"{indent}// default: {_default(val['default'], val)}\n" if "default" in val else ""
        out += f"{indent}{key}{opt}:\n"
        for i, variant in enumerate(variants):
            out += f"{indent} | " + _nullable(_ts(variant, indent + "   "), variant)
            vdesc = variant.get("description")
            notes = (
                [vdesc]
                if isinstance(vdesc, str) and vdesc != desc and not (i == 0 and above)
                else []
            )
            if "default" in variant:
                notes.append("default: " + _default(variant["default"], variant))
            out += (f" // {' '.join(notes)}" if notes else "") + "\n"
        out += f"{indent},\n"
    return out + f"{indent}}}"


# ---------------------------------------------------------------- parsing


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text as generated, possibly cut short


@dataclass
class ParsedCompletion:
    reasoning: str | None  # analysis (and unknown-channel) text, messages joined by "\n"
    content: str | None  # final text and commentary without a recipient, joined by "\n"
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish: Literal["stop", "tool_calls", "length"] = "stop"
    # positions of the tokens whose text the content is (what its logprobs are of)
    content_tokens: list[int] = field(default_factory=list, compare=False)


@dataclass(frozen=True)
class Delta:
    """One streaming event: text of a kind, or the start of tool call `index` (id, name).

    `tokens`: positions (in the order fed) of the tokens the text is of, each named once, so
    logprobs can follow the text: the tokens of one message's deltas decode to its text. The
    "\n" put between two messages of a kind is the only text of no token."""

    kind: Literal["reasoning", "content", "tool_call", "arguments"]
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""
    tokens: tuple[int, ...] = ()


class Detokenizer(Protocol):
    def add(self, ids: list[int]) -> str: ...
    def flush(self) -> str: ...


class WindowDetokenizer:
    """Incremental decode over a full `decode`: holds text back while it ends in U+FFFD (a
    character cut between tokens), so deltas never split UTF-8 and join to decode(all)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode, self._ids = decode, []

    def add(self, ids: list[int]) -> str:
        self._ids += ids
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        self._ids = []
        return text

    def flush(self) -> str:
        text, self._ids = self._decode(self._ids) if self._ids else "", []
        return text


class _WholeDecode:
    """Decodes a message's content in one call when it ends (non-streaming parse)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode, self._ids = decode, []

    def add(self, ids: list[int]) -> str:
        self._ids += ids
        return ""

    def flush(self) -> str:
        return self._decode(self._ids) if self._ids else ""


_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([^\s<]*)")
_RECIPIENT_RE = re.compile(r"to=([^\s<]+)")
_CUT_RECIPIENT_RE = re.compile(r"t(o(=\S*)?)?")  # the start of " to=functions.f", cut
_CONSTRAIN_RE = re.compile(r"<\|constrain\|>\s*[^\s<]*")
_NOT_RECIPIENTS = ("all", "assistant", "user")
# A header is a few tokens (a tool's name at most 64 characters): ordinary text past this many
# without <|message|> is not one
_MAX_HEADER_TOKENS = 48
_ID_CHARS = string.ascii_letters + string.digits


class HarmonyStreamParser:
    """Parses generated tokens (they start after `<|start|>assistant`) one at a time.

    `decode(ids) -> str` decodes ordinary ids (headers, and content unless `detokenizer` is
    given: a factory of incremental detokenizers with add/flush, one per message). Tool call ids
    are `call_` + 24 letters/digits, from `random.Random(seed)` when a seed is given. Never
    raises on malformed output: it keeps what it can. `channel`: the prompt left a message of
    the assistant's open on it (continue_final_message; `continued_channel`), so the first
    tokens are that message's text, not a header.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        *,
        detokenizer: Callable[[], Detokenizer] | None = None,
        seed: int | None = None,
        channel: str | None = None,
    ) -> None:
        self._decode = decode
        self._new_detok = detokenizer or (lambda: WindowDetokenizer(decode))
        self._rng = random.Random(seed) if seed is not None else random.SystemRandom()
        self._state = "header"  # header | content | idle (between messages)
        self._header: list[tuple[int, int, str]] = []  # (position, token, its text) a header
        self._implicit_role = True  # the first header has no role: it follows <|start|>assistant
        self._kind: str | None = None  # what the open message's text is; None: discarded
        self._detok: Detokenizer | None = None
        self._pending: list[int] = []  # positions of tokens in the detokenizer, not yet in text
        self._started = False  # the open message has emitted text
        self._text: dict[str, list[str]] = {"reasoning": [], "content": []}
        self._fed = 0  # tokens fed so far: the next one's position
        self._content_tokens: list[int] = []
        self.tool_calls: list[ToolCall] = []
        self.reasoning_tokens = 0  # ordinary tokens of reasoning (analysis) text generated
        if channel is not None:
            self._state = "content"
            self._new_message(self._kind_of(channel))

    def add(self, token: int) -> list[Delta]:
        """Feed one generated token; returns the deltas it completes."""
        out: list[Delta] = []
        at, self._fed = self._fed, self._fed + 1
        if self._state == "content":
            if token < FIRST_SPECIAL:
                self.reasoning_tokens += self._kind == "reasoning"
                self._feed([token], [at], out)
            elif token in (END, RETURN, CALL, ENDOFTEXT, START, CHANNEL):
                self._close(out)
                self._state = "idle"
                if token in (START, CHANNEL):  # a missing <|end|>: the next header began
                    self._begin(token, at)
        elif self._state == "header":
            if token == MESSAGE:
                self._open(out)
            elif token < FIRST_SPECIAL or token in (CHANNEL, CONSTRAIN):
                text = self._decode([token]) if token < FIRST_SPECIAL else SPECIAL_NAMES[token]
                self._header.append((at, token, text))
                if len(self._header) > _MAX_HEADER_TOKENS and token < FIRST_SPECIAL:
                    self._text_without_header(out)
            elif token == START:
                self._begin(token, at)
            elif token in (END, RETURN, CALL, ENDOFTEXT):
                self._salvage(out)
                self._state = "idle"
        elif token in (START, CHANNEL):
            self._begin(token, at)
        return out

    @property
    def holding(self) -> int:
        """The position of the first token fed whose text has not come out (a header not yet
        ended, or part of a character): no later delta names a token before it."""
        if self._state == "header" and self._header:
            return self._header[0][0]
        return self._pending[0] if self._pending else self._fed

    def finish(self) -> list[Delta]:
        """End of generation: flushes the open message. A cut-off header is dropped, unless it
        is all there is: output that never formed a harmony message (a model that does not
        write harmony, such as `tiny`'s random weights) is the reply's text, not lost."""
        out: list[Delta] = []
        if self._state == "content":
            self._close(out)
        elif self._state == "header" and not self.tool_calls and not any(self._text.values()):
            self._salvage(out)
        return out

    def result(self) -> ParsedCompletion:
        """Everything parsed so far; finish is "length" when output stopped inside a message."""
        reasoning, content = ("".join(self._text[k]) or None for k in ("reasoning", "content"))
        finish = "length" if self._state != "idle" else "tool_calls" if self.tool_calls else "stop"
        return ParsedCompletion(
            reasoning, content, list(self.tool_calls), finish, list(self._content_tokens)
        )

    def _begin(self, token: int, at: int) -> None:
        self._state, self._implicit_role = "header", token == CHANNEL
        self._header = [(at, CHANNEL, SPECIAL_NAMES[CHANNEL])] if token == CHANNEL else []

    def _parse_header(self) -> tuple[bool, str | None, str | None, list[int]]:
        """(from the assistant, channel, recipient, the header's leftover: indices of its
        ordinary tokens that are none of these, less those of spaces only before them).

        Each token's own text is parsed (harmony's names are ASCII, never split), so text
        outside any message is made of whole tokens and their logprobs line up with it."""
        texts = [text for _, _, text in self._header]
        text = "".join(texts)
        cuts: list[tuple[int, int]] = []  # spans of the text that are the header's parts

        def cut(start: int, end: int) -> None:
            nonlocal text
            cuts.append((start, end))
            text = text[:start] + " " * (end - start) + text[end:]

        channel = recipient = None
        if m := _CHANNEL_RE.search(text):
            channel = m.group(1) or None
            cut(*m.span())
        if m := _RECIPIENT_RE.search(text):
            recipient = m.group(1)
            cut(*m.span())
        for m in _CONSTRAIN_RE.finditer(text):
            cut(*m.span())
        body, start = text.strip(), len(text) - len(text.lstrip())
        role = ""
        if not self._implicit_role and body:
            role = body.partition(" ")[0]
            cut(start, start + len(role))
        elif body.startswith("assistant") and body[9:10] in ("", " "):
            cut(start, start + 9)
        if recipient in _NOT_RECIPIENTS:
            recipient = None
        ends = list(itertools.accumulate(map(len, texts)))
        left = [
            i for i, (_, token, _) in enumerate(self._header)
            if token < FIRST_SPECIAL
            and not any(a < ends[i] and ends[i] - len(texts[i]) < b for a, b in cuts)
        ]  # fmt: skip
        left = list(itertools.dropwhile(lambda i: texts[i].isspace(), left))
        return role in ("", "assistant"), channel, recipient, left

    def _kind_of(self, channel: str | None) -> str:
        return "reasoning" if channel not in (None, "final", "commentary") else "content"

    def _open(self, out: list[Delta]) -> None:
        mine, channel, recipient, _ = self._parse_header()
        kind = None
        if mine and recipient:
            call_id = "call_" + "".join(self._rng.choice(_ID_CHARS) for _ in range(24))
            name = recipient.removeprefix("functions.")
            self.tool_calls.append(ToolCall(call_id, name, ""))
            out.append(Delta("tool_call", index=len(self.tool_calls) - 1, id=call_id, name=name))
            kind = "arguments"
        elif mine:
            kind = self._kind_of(channel)
        self._state = "content"
        self._new_message(kind)

    def _new_message(self, kind: str | None) -> None:
        self._kind, self._detok, self._started = kind, self._new_detok(), False

    def _text_without_header(self, out: list[Delta]) -> None:
        """Ordinary text far longer than any header and still no <|message|>: a model that
        does not write harmony (`tiny`'s random weights). It is the message, streamed from
        here on rather than held to the end; a header addressing a tool keeps waiting."""
        mine, channel, recipient, left = self._parse_header()
        if not mine or recipient:
            return
        self._state = "content"
        self._new_message(self._kind_of(channel))
        self._feed_header(left, out)

    def _salvage(self, out: list[Delta]) -> None:
        """A header ended without <|message|>: its leftover text is the message (as harmony's
        non-strict parser does, less spaces around it), unless it addressed a tool (a call cut
        short)."""
        mine, channel, recipient, left = self._parse_header()
        while left and self._header[left[-1]][2].isspace():
            left.pop()
        rest = "".join(self._header[i][2] for i in left).strip()
        if channel is not None and _CUT_RECIPIENT_RE.fullmatch(rest):
            return  # "<|channel|>commentary to=": a tool call's header cut short, no text
        if mine and not recipient and left:
            self._new_message(self._kind_of(channel))
            self._feed_header(left, out)
            self._close(out)

    def _feed_header(self, left: list[int], out: list[Delta]) -> None:
        self._feed([self._header[i][1] for i in left], [self._header[i][0] for i in left], out)

    def _feed(self, ids: list[int], positions: list[int], out: list[Delta]) -> None:
        """Ordinary tokens into the open message: text goes out with all the tokens it is of."""
        self._pending += positions
        self._emit(self._detok.add(ids), out)

    def _emit(self, text: str, out: list[Delta]) -> None:
        if not text:
            return
        tokens, self._pending = tuple(self._pending), []
        if self._kind is None:
            return
        if self._kind == "arguments":
            self.tool_calls[-1].arguments += text
            out.append(Delta("arguments", text, index=len(self.tool_calls) - 1, tokens=tokens))
            return
        if not self._started and self._text[self._kind]:
            self._text[self._kind].append("\n")
            out.append(Delta(self._kind, "\n"))
        self._started = True
        self._text[self._kind].append(text)
        if self._kind == "content":
            self._content_tokens += tokens
        out.append(Delta(self._kind, text, tokens=tokens))

    def _close(self, out: list[Delta]) -> None:
        self._emit(self._detok.flush(), out)
        self._detok, self._kind, self._pending = None, None, []


def parse_completion(
    token_ids: list[int], decode: Callable[[list[int]], str], *, seed: int | None = None,
    channel: str | None = None,
) -> ParsedCompletion:
    """Parse a whole generation (include its stop token: without one, finish is "length");
    `channel` as HarmonyStreamParser's."""
    parser = HarmonyStreamParser(decode, detokenizer=lambda: _WholeDecode(decode), seed=seed,
                                 channel=channel)
    for token in token_ids:
        parser.add(token)
    parser.finish()
    return parser.result()
