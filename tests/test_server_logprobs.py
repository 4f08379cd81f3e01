"""Chat logprobs are the answer's (OpenAI: `logprobs.content` holds the tokens of
`message.content`, so joining their bytes gives it back): never a harmony header, reasoning or a
tool call's arguments. Driven through the server's `ChatChoice` with chosen harmony tokens on
the real tokenizer, a token an update as a stream gets them; end to end on the tiny model in
tests/test_server.py. Completions logprobs (`TextChoice`) list every token, their text_offset
indexing the returned text."""

from __future__ import annotations

import pytest

from tests.core_hooks import harmony_ids
from tinyoss.engine.builder import load_tokenizer
from tinyoss.engine.core import SeqDelta
from tinyoss.engine.output_processor import CompletionOutput, OutputProcessor
from tinyoss.engine.step import TokenLogprob
from tinyoss.harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START
from tinyoss.sampling_params import SamplingParams
from tinyoss.server.choices import ChatChoice, TextChoice
from tinyoss.tools.make_checkpoint import ensure_tiny

THINK = (CHANNEL, "analysis", MESSAGE, "Let me think.", END, START, "assistant")
FINAL = (CHANNEL, "final", MESSAGE)
CALL_HEAD = (CHANNEL, "commentary to=functions.get_weather ", CONSTRAIN, "json", MESSAGE)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ensure_tiny())


def logprob(at: int) -> float:
    """The made-up logprob of the token at `at`: tells which token an entry is of."""
    return -0.5 - at


def run(tok, ids: list[int], stops: tuple[str, ...] = (), finish: str = "stop"):
    """(stream chunks' choices, the final choice) of `ids` fed a token an update."""
    choice = ChatChoice(0, tok, list(stops), logprobs=True)
    out = CompletionOutput(0, logprobs=[])
    chunks = [choice.opening()]
    for at, token in enumerate(ids):
        out.token_ids.append(token)
        out.logprobs.append(TokenLogprob(token, logprob(at), [(token, logprob(at))]))
        out.finish_reason = finish if at == len(ids) - 1 else None
        if (chunk := choice.update(out)) is not None:
            chunks.append(chunk)
    return chunks, choice.final()


def text_of(entries: list[dict] | None) -> str | None:
    """The entries' bytes joined, as text (None for none)."""
    raw = bytes(b for e in entries or () for b in e["bytes"])
    return raw.decode("utf-8", errors="replace") if entries else None


def streamed_entries(chunks: list[dict]) -> list[dict]:
    return [e for c in chunks for e in (c["logprobs"] or {}).get("content") or ()]


def test_reasoning_and_headers_are_left_out(tok):
    ids = harmony_ids(tok, *THINK, *FINAL, "Hello there, Paris!", RETURN)
    chunks, final = run(tok, ids)
    assert final["message"]["content"] == "Hello there, Paris!"
    entries = final["logprobs"]["content"]
    assert [e["token"] for e in entries] == ["Hello", " there", ",", " Paris", "!"]
    first = len(ids) - 6  # the answer's tokens, before <|return|>
    assert [e["logprob"] for e in entries] == [logprob(at) for at in range(first, first + 5)]
    assert entries[0]["top_logprobs"] == [{"token": "Hello", "logprob": logprob(first),
                                           "bytes": list(b"Hello")}]
    assert final["logprobs"]["refusal"] is None
    for c in chunks:  # each chunk's logprobs are of its own content
        lps = (c["logprobs"] or {}).get("content")
        assert text_of(lps) == (c["delta"].get("content") or None)
    assert streamed_entries(chunks) == entries


def test_a_tool_call_has_no_content_logprobs(tok):
    """Arguments are not content: logprobs.content is null like message.content."""
    ids = harmony_ids(tok, *THINK, *CALL_HEAD, '{"city":"Paris"}', CALL)
    chunks, final = run(tok, ids)
    assert final["message"]["content"] is None and final["message"]["tool_calls"]
    assert final["logprobs"] == {"content": None, "refusal": None}
    assert all(c["logprobs"] is None for c in chunks)
    # a preamble before the call is content, and has its logprobs
    ids = harmony_ids(tok, CHANNEL, "commentary", MESSAGE, "Checking the weather.", END, START,
                      "assistant", *CALL_HEAD, '{"city":"Paris"}', CALL)
    chunks, final = run(tok, ids)
    entries = final["logprobs"]["content"]
    assert text_of(entries) == final["message"]["content"] == "Checking the weather."
    assert streamed_entries(chunks) == entries


def test_a_character_split_across_tokens(tok):
    """🦜 is three tokens; the first also holds the space: `bytes` carry each token's raw bytes,
    `token` their text (U+FFFD for a part of a character)."""
    ids = harmony_ids(tok, *FINAL, "Hi 🦜!", RETURN)
    chunks, final = run(tok, ids)
    entries = final["logprobs"]["content"]
    assert [bytes(e["bytes"]) for e in entries] == [b"Hi", b" \xf0\x9f", b"\xa6", b"\x9c", b"!"]
    assert [e["token"] for e in entries][1:4] == [" \ufffd", "\ufffd", "\ufffd"]
    assert text_of(entries) == final["message"]["content"] == "Hi 🦜!"
    assert streamed_entries(chunks) == entries


@pytest.mark.parametrize(
    "stop, content, tokens",
    [
        ("ere, P", "Hello th", ["Hello", " there"]),  # cut inside " there": it stays
        (", Par", "Hello there", ["Hello", " there"]),  # cut between tokens
        ("Hello", "", []),  # nothing left: "", as streamed (null is for tool calls alone)
    ],
)
def test_stop_strings_keep_the_tokens_partly_shown(tok, stop, content, tokens):
    ids = harmony_ids(tok, *THINK, *FINAL, "Hello there, Paris!", RETURN)
    chunks, final = run(tok, ids, stops=(stop,))
    assert final["finish_reason"] == "stop" and final["message"]["content"] == content
    entries = final["logprobs"]["content"]
    assert (entries and [e["token"] for e in entries]) == tokens
    assert streamed_entries(chunks) == (entries or [])


def test_cut_short_by_max_tokens(tok):
    ids = harmony_ids(tok, *THINK, *FINAL, "Hello there, Paris!")[:-3]
    chunks, final = run(tok, ids, finish="length")
    assert final["finish_reason"] == "length" and final["message"]["content"] == "Hello there"
    assert text_of(final["logprobs"]["content"]) == "Hello there"
    assert streamed_entries(chunks) == final["logprobs"]["content"]


def test_text_outside_any_message(tok):
    """A model that writes no harmony (tiny's random weights): its text is the answer, whole
    tokens of it, and the logprobs are theirs."""
    ids = harmony_ids(tok, " governors said hello", END)
    chunks, final = run(tok, ids)
    assert final["message"]["content"] == " governors said hello"
    assert text_of(final["logprobs"]["content"]) == " governors said hello"
    assert streamed_entries(chunks) == final["logprobs"]["content"]


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_stop_string_in_text_outside_any_message(tok, finish):
    """Text outside any message comes as one delta at the end; a stop string inside it keeps
    only the tokens at least partly before it (all of them were kept)."""
    ids = harmony_ids(tok, " governors said hello")
    chunks, final = run(tok, ids, stops=(" said",), finish=finish)
    assert final["message"]["content"] == " governors"
    assert text_of(final["logprobs"]["content"]) == " governors"
    assert streamed_entries(chunks) == final["logprobs"]["content"]


def test_two_answer_messages(tok):
    """The "\\n" the answer puts between two messages is no token's: it has no entry."""
    ids = harmony_ids(tok, *FINAL, "One.", END, START, "assistant", *FINAL, "Two.", RETURN)
    _, final = run(tok, ids)
    assert final["message"]["content"] == "One.\nTwo."
    assert text_of(final["logprobs"]["content"]) == "One.Two."


# ---------------------------------------------------------------- /v1/completions logprobs


def completion(tok, ids: list[int], stop: str | None = None, skip_special: bool = True,
               include_stop: bool = False, finish: str = "stop"):
    """(stream chunks' logprobs, the final choice) of `ids` through the engine's output
    processor (text, stop strings) and a `TextChoice`, a token an update; the last ends it
    with `finish` ("stop": the core's, for a stop token)."""
    params = SamplingParams(logprobs=0, stop=stop, skip_special_tokens=skip_special,
                            include_stop_str_in_output=include_stop)
    processor = OutputProcessor(tok)
    processor.add("r", None, [1], params)
    choice = TextChoice(0, tok, None, logprobs=True, skip_special_tokens=skip_special)
    chunks = []
    for at, token in enumerate(ids):
        end = finish if at == len(ids) - 1 else None
        lp = TokenLogprob(token, logprob(at), [(token, logprob(at))])
        for out in processor.process([SeqDelta("r", 0, [token], [lp], finish_reason=end)])[0]:
            if (chunk := choice.update(out.outputs[0])) is not None:
                chunks.append(chunk["logprobs"])
        if choice.finish_reason is not None:
            break
    joined = {k: [x for c in chunks for x in c[k]] for k in chunks[0]}
    return joined, choice.final()


@pytest.mark.parametrize("skip_special, text, offsets", [
    # 🦜 is three tokens, the first with the space: each points at the character its first
    # byte is in; <|return|>, kept in the logprobs as vLLM keeps the stop token, at the end of
    # the text, which leaves it out even where special tokens show (it had ended "<|return|>")
    (True, "finalHi 🦜!", [0, 0, 5, 5, 7, 8, 8, 9, 10]),
    (False, "<|channel|>final<|message|>Hi 🦜!", [0, 11, 16, 27, 29, 30, 30, 31, 32]),
])  # fmt: skip
def test_completion_text_offsets_index_the_text(tok, skip_special, text, offsets):
    """text_offset counted each token's text as U+FFFD for part of a character, and a skipped
    special token as its name: offsets drifted past the text."""
    ids = harmony_ids(tok, *FINAL, "Hi 🦜!", RETURN)
    streamed, final = completion(tok, ids, skip_special=skip_special)
    lps = final["logprobs"]
    assert final["text"] == text and lps["text_offset"] == offsets
    assert lps["tokens"][-1] == "<|return|>" and len(lps["tokens"]) == len(ids)
    assert lps["token_logprobs"] == [logprob(at) for at in range(len(ids))]
    assert streamed == lps


@pytest.mark.parametrize("skip_special, include_stop, text", [
    (False, False, "<|channel|>final<|message|>Hi!"),
    (False, True, "<|channel|>final<|message|>Hi!<|return|>"),
    (True, True, "finalHi!"),  # shown only where special tokens are
])  # fmt: skip
def test_the_end_token_shows_only_with_include_stop_str_in_output(
    tok, skip_special, include_stop, text
):
    """As vLLM's detokenizer: a stop-token-terminated text leaves that token out unless
    include_stop_str_in_output, whether special tokens show or not; token_ids and logprobs keep
    it. With skip_special_tokens false the text had ended in <|return|>."""
    ids = harmony_ids(tok, *FINAL, "Hi!", RETURN)
    _, final = completion(tok, ids, skip_special=skip_special, include_stop=include_stop)
    assert final["text"] == text and final["logprobs"]["tokens"][-1] == "<|return|>"


def test_a_stop_token_id_is_left_out_of_the_text(tok):
    """vLLM's stop_token_ids end the text without their token (an ordinary one here), unless
    include_stop_str_in_output; a text cut by max_tokens keeps its last token."""
    ids = harmony_ids(tok, "Hello there, Paris!")
    assert completion(tok, ids)[1]["text"] == "Hello there, Paris"
    assert completion(tok, ids, include_stop=True)[1]["text"] == "Hello there, Paris!"
    assert completion(tok, ids, finish="length")[1]["text"] == "Hello there, Paris!"


@pytest.mark.parametrize("kept", [False, True])
def test_a_stop_token_id_is_left_out_of_the_answer(tok, kept):
    """As completions' text (and vLLM's detokenizer): the stop_token_ids token that ended the
    answer is not its text, nor among its content logprobs, unless include_stop_str_in_output
    (a trial saw chat keep it where completions dropped it); token_ids keep it."""
    ids = harmony_ids(tok, *FINAL, "Hello there, Paris!")
    choice = ChatChoice(0, tok, [], logprobs=True, token_ids=True, stop_kept=kept)
    out = CompletionOutput(0, logprobs=[])
    for at, token in enumerate(ids):
        out.token_ids.append(token)
        out.logprobs.append(TokenLogprob(token, logprob(at), [(token, logprob(at))]))
        if at == len(ids) - 1:
            out.finish_reason, out.stop_reason = "stop", token
        choice.update(out)
    final = choice.final()
    want = "Hello there, Paris!" if kept else "Hello there, Paris"
    assert final["message"]["content"] == want and final["stop_reason"] == ids[-1]
    assert text_of(final["logprobs"]["content"]) == want and final["token_ids"] == ids


def test_completion_text_offsets_end_at_a_stop_string(tok):
    """The tokens that made the stop string stay (as vLLM keeps them), pointing no further than
    the end of the text the stop string cut."""
    ids = harmony_ids(tok, "Hello there, Paris!")
    _, final = completion(tok, ids, stop="ere,")
    lps = final["logprobs"]
    assert final["text"] == "Hello th" and final["finish_reason"] == "stop"
    assert lps["tokens"] == ["Hello", " there", ","] and lps["text_offset"] == [0, 5, 8]


def test_streamed_text_offsets_never_pass_the_text(tok):
    """A stop string holds text back; a token whose text starts in held-back text waits for it
    (as chat's logprobs wait for their content), so no chunk's text_offset passes the text the
    stream returns. One had gone out at 11 in a stream whose text the stop string then cut to
    4 characters."""
    ids = harmony_ids(tok, "Hello there, Paris!")
    streamed, final = completion(tok, ids, stop="o there, Paris")
    lps = final["logprobs"]
    assert final["text"] == "Hell" and lps["tokens"] == ["Hello", " there", ",", " Paris"]
    assert lps["text_offset"] == [0, 4, 4, 4] and streamed == lps
    # no stop string cuts it: each offset goes out as it is
    streamed, final = completion(tok, ids, stop="Paris?", finish="length")
    assert final["text"] == "Hello there, Paris!" and streamed == final["logprobs"]
    assert final["logprobs"]["text_offset"] == [0, 5, 11, 12, 18]


def test_echo_with_max_tokens_0_waits_for_the_whole_prompt(tok):
    """Echo with max_tokens 0 (`prompt_only`) ends at the engine's first token, not at an
    earlier output (a long prompt's prefill chunks bring theirs, prompt logprobs still
    coming): the choice, and the prompt_logprobs read from it, are whole."""
    choice = TextChoice(0, tok, "abc", logprobs=False, prompt_only=True)
    assert choice.update(CompletionOutput(0)) is None and choice.finish_reason is None
    done = choice.update(CompletionOutput(0, token_ids=[5], pieces=["x"]))
    assert done["text"] == "abc" and done["finish_reason"] == "length"
    assert choice.final()["text"] == "abc" and choice.num_tokens == 0


@pytest.mark.parametrize("ids, finish", [
    ((*THINK, *FINAL, RETURN), "stop"),  # an empty answer (a constraint may allow only that)
    ((CHANNEL, "analysis", MESSAGE, "Let me"), "length"),  # cut off while reasoning
])  # fmt: skip
def test_an_empty_answer_is_an_empty_string_as_streamed(tok, ids, finish):
    """OpenAI's content is null only in a message of tool calls alone: an answer with no text
    is "", as the stream's opening delta gives it (the whole answer had said null)."""
    chunks, final = run(tok, harmony_ids(tok, *ids), finish=finish)
    streamed = "".join(c["delta"].get("content") or "" for c in chunks)
    assert chunks[0]["delta"]["content"] == "" == streamed
    assert final["message"]["content"] == "" and final["finish_reason"] == finish
    assert final["logprobs"] == {"content": [], "refusal": None}


# ---------------------------------------------------------------- return_tokens_as_token_ids


def parrot_ids(tok) -> tuple[list[int], int, int]:
    """"Hi 🦜!" as a final answer's ids, and the ids of 🦜's second and third tokens: both
    decode to U+FFFD alone, so by text they are one token."""
    ids = harmony_ids(tok, *FINAL, "Hi 🦜!", RETURN)
    a, b = (t for t in ids if tok.token_bytes(t) in (b"\xa6", b"\x9c"))
    return ids, a, b


def test_chat_tokens_as_ids_name_tokens_by_id_as_vllm_does(tok):
    """Each token and top token is "token_id:<id>"; the token's bytes stay its own (they join
    to the content), a top token's are its name's, as vLLM gives them; streamed alike."""
    ids, a, b = parrot_ids(tok)
    choices = [ChatChoice(0, tok, [], logprobs=True, as_ids=as_ids) for as_ids in (False, True)]
    out = CompletionOutput(0, logprobs=[])
    chunks: list[list[dict]] = [[], []]
    for at, token in enumerate(ids):
        out.token_ids.append(token)
        top = [(token, logprob(at)), (a, -7.0), (b, -8.0)]
        out.logprobs.append(TokenLogprob(token, logprob(at), top))
        out.finish_reason = "stop" if at == len(ids) - 1 else None
        for choice, mine in zip(choices, chunks):
            if (chunk := choice.update(out)) is not None:
                mine.append(chunk)
    plain, named = (c.final()["logprobs"]["content"] for c in choices)
    answer = ids[len(ids) - 6 : -1]  # the answer's tokens, before <|return|>
    assert [e["token"] for e in named] == [f"token_id:{t}" for t in answer]
    assert [e["bytes"] for e in named] == [e["bytes"] for e in plain]
    assert text_of(named) == "Hi 🦜!"
    assert [e["logprob"] for e in named] == [e["logprob"] for e in plain]
    for e, t in zip(named, answer):
        names = [f"token_id:{t}", f"token_id:{a}", f"token_id:{b}"]
        assert e["top_logprobs"] == [{"token": n, "logprob": lp, "bytes": list(n.encode())}
                                     for n, lp in zip(names, (e["logprob"], -7.0, -8.0))]
    assert streamed_entries(chunks[1]) == named
    assert [c["delta"] for c in chunks[1]] == [c["delta"] for c in chunks[0]]


def test_completion_tokens_as_ids_keep_tokens_of_one_text_apart(tok):
    """`tokens` and the top_logprobs keys are "token_id:<id>": two tokens that decode to the
    same text (U+FFFD) no longer share a key; text and text_offset are the text's, as without."""
    ids, a, b = parrot_ids(tok)
    finals = []
    for as_ids in (False, True):
        processor = OutputProcessor(tok)
        processor.add("r", None, [1], SamplingParams(logprobs=2))
        choice = TextChoice(0, tok, None, logprobs=True, as_ids=as_ids)
        for at, token in enumerate(ids):
            end = "stop" if at == len(ids) - 1 else None
            lp = TokenLogprob(token, logprob(at), [(a, -7.0), (b, -8.0)])
            for out in processor.process([SeqDelta("r", 0, [token], [lp], finish_reason=end)])[0]:
                choice.update(out.outputs[0])
        finals.append(choice.final())
    plain, named = finals
    assert named["text"] == plain["text"] == "finalHi 🦜!"
    lps, was = named["logprobs"], plain["logprobs"]
    assert lps["text_offset"] == was["text_offset"] == [0, 0, 5, 5, 7, 8, 8, 9, 10]
    assert lps["tokens"] == [f"token_id:{t}" for t in ids]
    assert lps["token_logprobs"] == was["token_logprobs"]
    for at, (t, top, was_top) in enumerate(zip(ids, lps["top_logprobs"], was["top_logprobs"])):
        want = {f"token_id:{a}": -7.0, f"token_id:{b}": -8.0}
        want.setdefault(f"token_id:{t}", logprob(at))  # the token's own, as without
        assert top == want
        assert len(was_top) == len(want) - 1  # by text, a and b were one key
