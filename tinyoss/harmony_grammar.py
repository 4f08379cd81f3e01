"""A chat request's constraints as one grammar over gpt-oss's whole reply, in harmony's form.

gpt-oss writes its reasoning, `<|channel|>analysis<|message|>...<|end|><|start|>assistant`, then
either an answer, `<|channel|>final<|message|>...<|return|>`, or a tool call,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`. A
`response_format` constrains the answer's text only, so the reasoning before it stays free (a
constraint applied to the reasoning, or never switched on after it, is the failure reported
most for gpt-oss in vLLM and SGLang). `tool_choice` "required" or a named function makes the
reply a call whose arguments follow the tool's schema; `thinking_token_budget` bounds the
reasoning. The grammar is llguidance's Lark dialect (`engine/grammar.py` enforces it).
"""

from __future__ import annotations

import json
import re
from typing import Any

from tinyoss import harmony
from tinyoss.engine.grammar import check, json_schema_grammar
from tinyoss.sampling_params import StructuredOutputs

_TEXT = "/(?s:.*)/"  # any text (special tokens excluded: they are the grammar's own)


class ConstraintError(ValueError):
    """A constraint that cannot be enforced; `param` names the request field to blame."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name


def answer_constraint(response_format: Any = None, structured_outputs: Any = None) -> (
    StructuredOutputs | None
):
    """What a reply's text must be, from OpenAI's `response_format` ({"type": "text"},
    {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name", "schema"}}) or
    vLLM's `structured_outputs` ({"json" | "json_object" | "regex" | "choice" | "grammar": ...});
    ConstraintError naming the field when it is malformed."""
    fmt, so = response_format, structured_outputs
    if fmt is not None and so is not None:
        raise ConstraintError(
            "structured_outputs", "give either response_format or structured_outputs, not both"
        )
    if so is not None:
        unknown = sorted(set(so) - set(_STRUCTURED_KEYS)) if isinstance(so, dict) else None
        if unknown != []:
            raise ConstraintError(
                "structured_outputs",
                f"structured_outputs={harmony.short_repr(so)} is invalid: give an object with one "
                f"of {', '.join(_STRUCTURED_KEYS)}",
            )
        try:  # a null is the key left out, as at the top level of a request
            return StructuredOutputs(**{k: v for k, v in so.items() if v is not None})
        except ValueError as e:
            raise ConstraintError("structured_outputs", f"structured_outputs: {e}") from None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise ConstraintError(
            "response_format",
            f"response_format={harmony.short_repr(fmt)} is invalid: must be "
            '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
            '"json_schema": {"name": N, "schema": SCHEMA}}',
        )
    if kind == "text":
        return None
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if kind == "json_schema":  # `name` required, as OpenAI and vLLM require it
        at = "response_format.json_schema"
        if not isinstance(spec, dict):
            given = " is missing" if spec is None else f"={harmony.short_repr(spec)} is invalid"
            raise ConstraintError(at, f'{at}{given}: must be an object {{"name": N, "schema": '
                                      "SCHEMA}")
        name = spec.get("name")
        if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
            given = " is missing" if name is None else f"={harmony.short_repr(name)} is invalid"
            raise ConstraintError(f"{at}.name", f"{at}.name{given}: must be 1 to 64 letters, "
                                                "digits, '_' or '-'")
        if schema is not None and not isinstance(schema, dict):
            raise ConstraintError(f"{at}.schema", f"{at}.schema must be a JSON schema object, "
                                                  f"not {harmony.short_repr(schema)}")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise ConstraintError(f"{at}.strict", f"{at}.strict must be true or false, not "
                                                  f"{harmony.short_repr(spec['strict'])}")
    return StructuredOutputs(json=schema) if schema is not None else StructuredOutputs(
        json_object=True
    )


def chat_constraint(
    answer: StructuredOutputs | None = None,
    *,
    tools: list[dict] | None = None,
    tool_choice: str | dict | None = "auto",
    thinking_token_budget: int | None = None,
    answer_from: str = "response_format",
) -> StructuredOutputs | None:
    """The grammar of a chat reply (None when nothing constrains it). `answer`: what the final
    message's text must be (a JSON schema, any JSON object, a regex or a choice; not a Lark
    grammar of its own), from the request field `answer_from`. Raises ConstraintError naming
    the field that cannot be enforced."""
    tools = tools or []
    forced = _forced_tools(tools, tool_choice)
    if answer is None and forced is None and thinking_token_budget is None:
        return None
    rules = {"start": "answer" if thinking_token_budget == 0 else "reasoning? answer"}
    budget = "" if thinking_token_budget is None else f"[max_tokens={thinking_token_budget}]"
    rules["reasoning"] = '<|channel|> "analysis" <|message|> think <|end|> <|start|> "assistant"'
    rules[f"think{budget}"] = _TEXT
    choices = []
    if forced is None:  # the model may answer (and call a tool unless told not to)
        rules["final"] = f'<|channel|> "final" <|message|> {_body(answer, answer_from)} '
        rules["final"] += "<|return|>"
        choices.append("final")
        if tool_choice != "none":
            forced, lenient = tools, True  # calls it chooses to make follow their schemas too
    else:
        lenient = False
    for i, tool in enumerate(forced or []):
        fn = tool["function"]
        schema = _arguments_schema(fn.get("parameters"), lenient, tools.index(tool))
        header = json.dumps(f"commentary to=functions.{fn['name']} ")
        rules[f"call{i}"] = f'<|channel|> {header} <|constrain|> "json" <|message|> args{i} '
        rules[f"call{i}"] += "<|call|>"
        rules[f"args{i}"] = "%json " + json.dumps(schema)
        choices.append(f"call{i}")
    rules["answer"] = " | ".join(choices)
    return StructuredOutputs(grammar="\n".join(f"{k}: {v}" for k, v in rules.items()))


def _forced_tools(tools: list[dict], tool_choice: Any) -> list[dict] | None:
    """The tools a reply must call one of (None: it need not call any)."""
    if tool_choice == "required":
        if not tools:
            raise ConstraintError("tool_choice", 'tool_choice "required" needs tools')
        return tools
    if isinstance(tool_choice, dict):
        name = harmony.function_name(tool_choice)
        return [t for t in tools if harmony.function_name(t) == name]
    return None


def _arguments_schema(schema: dict | None, lenient: bool, index: int) -> dict:
    """A tool's arguments grammar. A call the reply must make follows its schema exactly (400
    when it cannot be enforced); one the model may choose follows what can be enforced of it,
    or is any JSON object. A function without `parameters` takes none, as OpenAI defines it
    (and as the model is shown it: `() => any`): its arguments are `{}`."""
    if schema is None:
        schema = {"type": "object", "properties": {}, "additionalProperties": False}
    schema = schema or {"type": "object"}
    try:
        _check(StructuredOutputs(json=schema), f"tools[{index}].function.parameters")
    except ConstraintError:
        if not lenient:
            raise
        return json_schema_grammar(None)
    return json_schema_grammar(schema, lenient)


def _body(answer: StructuredOutputs | None, param: str) -> str:
    """The final message's text as a Lark expression; `param` is blamed when it cannot be."""
    if answer is None:
        return _TEXT
    if answer.grammar is not None:
        raise ConstraintError(
            param,
            "a Lark grammar cannot be placed in a chat reply's final message: use json, regex "
            "or choice, or send the grammar to /v1/completions",
        )
    _check(answer, param)
    if answer.regex is not None:
        return "/" + answer.regex.replace("/", "\\/") + "/"
    if answer.choice is not None:
        return "(" + " | ".join(json.dumps(c) for c in answer.choice) + ")"
    schema = answer.json if isinstance(answer.json, dict) else None
    if isinstance(answer.json, str):
        schema = json.loads(answer.json)  # checked above
    return "%json " + json.dumps(json_schema_grammar(schema))


def _check(spec: StructuredOutputs, param: str) -> None:
    try:
        check(spec)
    except ValueError as e:
        raise ConstraintError(param, f"{param}: {e}") from None
