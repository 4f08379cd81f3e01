"""Structured outputs on the CPU: the sampler's grammar mask, grammars through the whole engine
(async scheduling on and off give the same tokens), and chat's harmony grammar (free reasoning,
constrained answer, forced tool calls, the thinking budget). The tiny model has random weights:
whatever it writes under a grammar is the grammar's doing."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from tinyoss import LLM, harmony
from tinyoss.engine.core import EngineInfo
from tinyoss.engine.grammar import check
from tinyoss.engine.sampler import Sampler, SamplingBatch, SamplingRow
from tinyoss.harmony_grammar import ConstraintError, chat_constraint
from tinyoss.sampling_params import SamplingParams, StructuredOutputs
from tinyoss.server.protocol import parse_chat

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                           "b": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
HI = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", max_model_len=1024)


def test_the_mask_leaves_only_allowed_tokens_to_sample():
    torch.manual_seed(0)
    v = 100
    logits = torch.randn(3, v)
    allowed = [[5, 17, 99], [3]]  # rows 0 and 2; row 1 is unconstrained
    bits = torch.zeros(2, (v + 31) // 32, dtype=torch.int32)
    for j, ids in enumerate(allowed):
        for t in ids:
            bits[j, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    rows = [SamplingRow(SamplingParams(temperature=0)), SamplingRow(SamplingParams(temperature=0)),
            SamplingRow(SamplingParams(seed=1))]  # fmt: skip
    batch = SamplingBatch.build(rows, v, "cpu")
    batch.allowed = (torch.tensor([0, 2]), bits)
    for _ in range(5):  # the random row too, whatever its draw
        tokens = Sampler()(logits, batch).token_ids.tolist()
        assert tokens[0] == max(allowed[0], key=lambda t: logits[0, t].item())
        assert tokens[1] == logits[1].argmax().item()
        assert tokens[2] == 3


def test_a_grammar_that_allows_only_its_end_outranks_min_tokens(llm):
    """min_tokens bans the end tokens; where the grammar allows nothing else, the grammar wins:
    the answer ends inside it, finished by its end token, no filler (it came back "yes!!" from
    a sample out of an empty row, or as a 500 in chat)."""
    choice = StructuredOutputs(choice=["yes", "no", "maybe"])
    outs = llm.generate(["Answer:", "Answer:"],
                        [SamplingParams(max_tokens=12, min_tokens=10, temperature=0,
                                        structured_outputs=choice),
                         SamplingParams(max_tokens=12, temperature=0, structured_outputs=choice)],
                        use_tqdm=False)
    held, free = (o.outputs[0] for o in outs)
    assert held.text == free.text and held.text in ("yes", "no", "maybe")
    assert held.token_ids == free.token_ids and held.finish_reason == "stop"
    # while the grammar allows more than its end, min_tokens still holds the end back
    longer = llm.generate(["Code:"], SamplingParams(
        max_tokens=12, min_tokens=5, temperature=0,
        structured_outputs=StructuredOutputs(regex=r"[a-z]{1,8}")), use_tqdm=False)[0]
    assert len(longer.outputs[0].text) >= 5


def test_a_grammar_beyond_the_parsers_limits_is_the_requests_fault():
    """A token its mask allowed that the parser still refuses (3,000 choices sharing a first
    byte: a parser row past llguidance's 2,000 items, found only once text is sampled) is the
    grammar's fault, "invalid_grammar" (the server's 400, with the first line of llguidance's
    words); a token outside the mask is the engine's, "structured_output" (a 500)."""
    from tinyoss.engine.grammar import GrammarCompiler, _byte_tokenizer

    compiler = GrammarCompiler(lambda: "", 257, [256])
    compiler._tokenizer = _byte_tokenizer()  # 256 bytes and an end token
    many = StructuredOutputs(choice=[f"w{i}" for i in range(3000)])
    for token, code in ((ord("w"), "invalid_grammar"), (ord("x"), "structured_output")):
        matcher = compiler.matcher(many)
        bits = compiler.fill([matcher])
        assert [t for t in range(257) if (int(bits[0, t >> 5]) >> (t & 31)) & 1] == [ord("w")]
        got, message = matcher.consume(token)
        assert got == code
        if code == "invalid_grammar":  # one line: llguidance's dump of the grammar is left out
            assert "max is 2000" in message and "\n" not in message
    small = compiler.matcher(StructuredOutputs(choice=["yes", "no"]))
    compiler.fill([small])
    assert small.consume(ord("y")) is None


def test_the_engine_fails_only_the_request_whose_grammar_is_beyond_limits(llm):
    """Through the engine: the request whose grammar has a rule of 3,000 alternatives ends
    with finish_reason "error" and code "invalid_grammar"; the request beside it finishes."""
    many = StructuredOutputs(grammar="start: " + " | ".join(f'"w{i}"' for i in range(3000)))
    bad, good = llm.generate(["Pick:", "Pick:"], [
        SamplingParams(max_tokens=8, temperature=0, structured_outputs=many),
        SamplingParams(max_tokens=8, temperature=0,
                       structured_outputs=StructuredOutputs(choice=["yes", "no"]))],
        use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and bad.error.code == "invalid_grammar"
    assert "max is 2000" in bad.error.message
    assert good.outputs[0].finish_reason == "stop" and good.outputs[0].text in ("yes", "no")


def test_a_grammar_is_built_while_other_requests_step(llm, monkeypatch):
    """A matcher is built off the step loop: while one is being built (here held until
    released) a free request beside it runs to its end, and the constrained one starts once its
    matcher is there, with n=2 each its own, aborting another mid-build loses nothing. The
    loop had built matchers inline: a 64,000-choice grammar stalled every stream ~1.8 s."""
    import threading

    grammars = llm.engine.executor.grammars
    release, started, build = threading.Event(), threading.Event(), grammars.matcher

    def held(spec):
        started.set()
        assert release.wait(30), "the test never released the build"
        return build(spec)

    monkeypatch.setattr(grammars, "matcher", held)
    yes_no = SamplingParams(n=2, max_tokens=8, seed=3, temperature=1,
                            structured_outputs=StructuredOutputs(choice=["yes", "no"]))
    gone = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(regex="[a-z]+"))
    held_id = llm._submit("Answer:", yes_no)
    gone_id = llm._submit("Word:", gone)
    free_id = llm._submit("Free text", SamplingParams(max_tokens=6, temperature=0))
    assert started.wait(30)
    free = []
    while not (free and free[-1].finished):
        free += llm._outputs([free_id])
    assert len(free[-1].outputs[0].token_ids) == 6
    assert llm.engine.prompt_progress(held_id) == (0, len(llm.tokenizer.encode("Answer:")))
    llm._abort(gone_id)
    release.set()
    done = []
    while not (done and all(o.finished for o in done[-1:])):
        done += llm._outputs([held_id])
    monkeypatch.undo()
    texts = sorted(c.text for c in done[-1].outputs)
    assert all(t in ("yes", "no") for t in texts), texts
    while llm.engine.has_work():  # a step chained ahead of the last results
        llm.engine.step()
    assert not llm.engine.requests and not llm.engine.executor.prebuilt


def test_json_schemas_on_raw_prompts_with_and_without_async_scheduling(llm):
    params = [
        SamplingParams(max_tokens=80, seed=i, temperature=0 if i == 0 else 1,
                       structured_outputs=StructuredOutputs(json=PERSON))
        for i in range(4)
    ] + [SamplingParams(max_tokens=8, seed=9)]  # fmt: skip
    prompts = ["Describe someone.", "Who?", "A person:", "JSON please", "free text"]
    runs = []
    for async_scheduling in (True, False):
        llm.engine.async_scheduling = async_scheduling
        try:
            runs.append(llm.generate(prompts, params, use_tqdm=False))
        finally:
            llm.engine.async_scheduling = True
    first, second = ([o.outputs[0].token_ids for o in run] for run in runs)
    assert first == second
    for out in runs[0][:4]:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    with pytest.raises(ValueError):  # the unconstrained request stays free text
        json.loads(runs[0][4].outputs[0].text)


def test_regex_and_choice_on_raw_prompts(llm):
    regex = SamplingParams(max_tokens=20, seed=1,
                           structured_outputs=StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2}"))
    choice = SamplingParams(max_tokens=20, seed=1,
                            structured_outputs=StructuredOutputs(choice=["yes", "no", "maybe"]))
    a, b = llm.generate(["Code:", "Answer:"], [regex, choice], use_tqdm=False)
    assert len(a.outputs[0].text) == 6 and a.outputs[0].text[3] == "-"
    assert a.outputs[0].text[:3].isdigit() and a.outputs[0].text[4:].isalpha()
    assert b.outputs[0].text in ("yes", "no", "maybe")


def test_gbnf_grammars_as_in_vllms_examples(llm):
    """vLLM's structured-output examples write grammars in GBNF (`root ::= ...`), which its
    backends take: llguidance's Lark parser had refused them ("Expected token '_', found
    '='"). GBNF is converted; Lark, with its `start:` rule, is kept; bad GBNF says so."""
    sql = "\n".join(['root ::= "SELECT " column " FROM " table', 'column ::= "a" | "b"',
                     'table ::= "t" [0-9]'])
    gbnf, lark = (SamplingParams(max_tokens=20, seed=1, structured_outputs=StructuredOutputs(
        grammar=g)) for g in (sql, 'start: "x" | "y"'))
    a, b = llm.generate(["Query:", "Letter:"], [gbnf, lark], use_tqdm=False)
    text = a.outputs[0].text
    assert text[:7] == "SELECT " and text[7] in "ab" and text[8:15] == " FROM t"
    assert text[15:].isdigit() and len(text) == 16 and b.outputs[0].text in ("x", "y")
    with pytest.raises(ValueError, match="reads as GBNF .* does not parse: Expected '\\)'"):
        check(StructuredOutputs(grammar='root ::= ( "a"'))


def test_gbnf_unicode_escapes_mean_their_characters(llm):
    """GBNF's \\u and \\U escapes are the characters they name: llguidance's converter
    dropped their leading zeros (\\u00e9 became \\ue9, which no regex takes), so a valid
    grammar was a 400. An escaped backslash before a `u` stays a backslash."""
    grammars = ['root ::= [\\u00e9\\u00fc]{2} "\\u0022" "\\U0001F600"', 'root ::= "\\\\u00e9"']
    params = [SamplingParams(max_tokens=12, seed=1, structured_outputs=StructuredOutputs(
        grammar=g)) for g in grammars]
    a, b = llm.generate(["Letters:", "Escape:"], params, use_tqdm=False)
    text = a.outputs[0].text
    assert len(text) == 4 and set(text[:2]) <= {"\u00e9", "\u00fc"} and text[2:] == '"\U0001f600'
    assert b.outputs[0].text == "\\u00e9"


def test_special_token_names_in_a_grammar_are_written_as_text(llm):
    """A schema or choice whose text spells a special token ('<|end|>') is written as plain
    text, in chat too: llguidance wrote a grammar's forced text with a tokenizer that read such
    names as the special tokens, its parser refused them, and no answer could ever follow."""
    consts = ["<|end|>", "a<|return|>b", "<|call|>"]
    params = [SamplingParams(max_tokens=24, temperature=t, seed=1, structured_outputs=so)
              for so in [StructuredOutputs(json={"const": c}) for c in consts]
              + [StructuredOutputs(choice=["<|channel|>"])] for t in (0, 1)]
    outs = llm.generate(["x"] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert [o.outputs[0].finish_reason for o in outs] == ["stop"] * len(params)
    assert texts == [t for c in consts for t in [json.dumps(c)] * 2] + ["<|channel|>"] * 2
    reply = llm.chat([HI], SamplingParams(max_tokens=64, structured_outputs=StructuredOutputs(
        json={"const": "<|end|>"})), thinking_token_budget=0, use_tqdm=False)[0]
    assert reply.finish_reason == "stop" and json.loads(reply.content) == "<|end|>"


def test_the_grammars_vocabulary_writes_any_bytes():
    """The encoder llguidance is given spells every byte string with tokens of exactly those
    bytes: special-token names as text, a UTF-8 character cut short as one-byte tokens."""
    from tinyoss.engine.builder import load_tokenizer
    from tinyoss.engine.grammar import _Vocabulary

    vocabulary = _Vocabulary(load_tokenizer(None), 201088, 200002)
    for text in [b"a<|end|>b", "\u00e9".encode()[:1], b"ab\xc3cd", b"\xff\xfe",
                 "\u65e5\u672c".encode()[:4], b""]:
        ids = vocabulary(text)
        assert b"".join(vocabulary.tokens[i] for i in ids) == text
        assert not set(ids) & set(vocabulary.special_token_ids)


def _thought(reply) -> list[int]:
    """The tokens of a reply's analysis message (the first message, when it reasoned)."""
    ids = reply.output.outputs[0].token_ids
    if reply.reasoning is None:
        return []
    return ids[ids.index(harmony.MESSAGE) + 1 : ids.index(harmony.END)]


def test_the_reasoning_is_free_and_the_answer_follows_the_schema(llm):
    """The same seeds with and without the schema: identical reasoning (the grammar leaves it
    free), and an answer that follows the schema only where one was given."""
    seeds = range(6)
    so = StructuredOutputs(json=PERSON)
    constrained = llm.chat(
        [HI] * len(seeds),
        [SamplingParams(max_tokens=200, seed=s, structured_outputs=so) for s in seeds],
        thinking_token_budget=12, use_tqdm=False,
    )
    free = llm.chat(
        [HI] * len(seeds), [SamplingParams(max_tokens=200, seed=s) for s in seeds],
        thinking_token_budget=12, use_tqdm=False,
    )
    assert [c.reasoning for c in constrained] == [f.reasoning for f in free]
    assert sum(c.reasoning is not None for c in constrained) >= 2  # the model chose to reason
    for c in constrained:
        assert c.finish_reason == "stop" and not c.tool_calls
        jsonschema.validate(json.loads(c.content), PERSON)
        assert len(_thought(c)) <= 12
    assert not all(_is_json(f.content) for f in free)


def _is_json(text: str | None) -> bool:
    try:
        json.loads(text or "")
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_tool_choice_required_and_named_force_valid_calls(llm, choice):
    replies = llm.chat(
        [HI] * 4, [SamplingParams(max_tokens=150, seed=s) for s in range(4)],
        tools=[WEATHER, ADD], tool_choice=choice, thinking_token_budget=6, use_tqdm=False,
    )
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    for r in replies:
        assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1 and r.content is None
        call = r.tool_calls[0]
        assert choice == "required" or call.name == "add"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        assert r.output.outputs[0].token_ids[-1] == harmony.CALL


def test_a_forced_call_of_a_function_without_parameters_takes_none(llm):
    """OpenAI: a function whose `parameters` are left out takes none, so its arguments are {}
    (they had been any JSON object: `{"=>": [{}]}` came back)."""
    bare = {"type": "function", "function": {"name": "noparams"}}
    replies = llm.chat(
        [HI] * 3, [SamplingParams(max_tokens=60, seed=s) for s in range(1, 4)], tools=[bare],
        tool_choice={"type": "function", "function": {"name": "noparams"}},
        thinking_token_budget=2, use_tqdm=False,
    )
    for r in replies:
        assert r.finish_reason == "tool_calls" and json.loads(r.tool_calls[0].arguments) == {}


def test_a_zero_budget_answers_at_once(llm):
    (reply,) = llm.chat(HI, SamplingParams(max_tokens=50, seed=3), thinking_token_budget=0,
                        response_format={"type": "json_object"}, use_tqdm=False)  # fmt: skip
    assert reply.reasoning is None and isinstance(json.loads(reply.content), dict)
    assert harmony.END not in reply.output.outputs[0].token_ids  # one message: the answer
    # a bool is not a budget: refused at the call (True had become a broken grammar)
    with pytest.raises(ValueError, match="thinking_token_budget=True is invalid"):
        llm.chat(HI, SamplingParams(max_tokens=3), thinking_token_budget=True, use_tqdm=False)


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
        ({"type": "string", "format": "no-such-format"}, "no-such-format"),
        ({"$ref": "#/$defs/missing"}, "missing"),
    ],
)
def test_schemas_that_cannot_be_enforced_are_refused_by_name(schema, words):
    with pytest.raises(ValueError, match=words):
        check(StructuredOutputs(json=schema))
    with pytest.raises(ConstraintError, match=words) as e:
        chat_constraint(StructuredOutputs(json=schema))
    assert e.value.param == "response_format"
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    with pytest.raises(ConstraintError, match=words) as e:
        chat_constraint(tools=[WEATHER, bad_tool], tool_choice="required")
    assert e.value.param == "tools[1].function.parameters"
    # a tool the model may choose not to call does not fail the request: any object instead
    assert chat_constraint(StructuredOutputs(json_object=True), tools=[bad_tool]) is not None


def test_a_choice_beyond_the_parsers_row_is_refused_before_building():
    """2,000 strings fail at the first token (the parser's row holds 2,000 items), after
    seconds of building at 64,000: refused at the check; 1,999 are followed."""
    from tinyoss.engine.grammar import MAX_CHOICES

    with pytest.raises(ValueError, match="at most 1999"):
        check(StructuredOutputs(choice=[f"w{i}" for i in range(MAX_CHOICES + 1)]))
    check(StructuredOutputs(choice=[f"w{i}" for i in range(MAX_CHOICES)]))


def test_the_grammar_engines_internal_assertions_are_said_plainly():
    """A choice of 100,000 strings failed in llguidance's Rust source (`panic: assertion
    failed: grammar.symbols.len() < u16::MAX ...`), which the client read as is."""
    from tinyoss.engine.grammar import _plain

    said = _plain("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10")
    assert "u16" not in said and "beyond the grammar engine's limits" in said
    assert _plain("regex parse error: x") == "regex parse error: x"


def test_nothing_to_constrain_means_no_grammar():
    assert chat_constraint() is None
    assert chat_constraint(tools=[WEATHER]) is None  # "auto": the model decides
    with pytest.raises(ConstraintError, match="Lark grammar"):
        chat_constraint(StructuredOutputs(grammar="start: /a+/"))
    with pytest.raises(ConstraintError, match="needs tools"):
        chat_constraint(tool_choice="required")


INFO = EngineInfo("tiny", 4096, 201088, (199999,), 100, 16, "")


def test_chat_stops_on_harmony_ends_whatever_the_checkpoint_lists():
    params = parse_chat({"messages": HI}, INFO).params
    assert harmony.RETURN in params.stop_token_ids and harmony.CALL in params.stop_token_ids
    params = parse_chat({"messages": HI, "ignore_eos": True}, INFO).params
    assert params.stop_token_ids == []  # a benchmark's fixed length: nothing stops it


def test_response_format_is_rendered_as_harmony_prescribes():
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "description": "Who it is."}}  # fmt: skip
    prep = parse_chat({"messages": HI, "response_format": fmt}, INFO)
    developer = prep.sources[0][prep.sources[0].index("developer") + 2]
    assert developer == ("# Response Formats\n\n## person\n\n// Who it is.\n"
                         + json.dumps(PERSON, separators=(",", ":")))  # fmt: skip
    assert prep.params.structured_outputs.grammar is not None
