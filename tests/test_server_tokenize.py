"""POST /tokenize and /detokenize (vLLM's extension endpoints) against a live server on the tiny
model: counts equal a chat request's prompt_tokens, round trips, and errors by param."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.test_server import KEY, TINY, TOOLS, Served, post, wait_healthy
from tinyoss import harmony
from tinyoss.server.app import create_app
from tinyoss.server.limits import ServerLimits

MAX_BYTES = 1 << 16


@pytest.fixture(scope="module")
def srv():
    app = create_app(
        TINY, model_name="tiny", api_key=KEY, limits=ServerLimits(max_request_bytes=MAX_BYTES)
    )
    served = Served(app)
    wait_healthy(served)
    served.client = app.state.server.client
    served.tokenizer = served.client.tokenizer
    yield served
    served.close()


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


TEXTS = ["Hello, world!", "héllo wörld 🤖 你好 <|start|> tabs\tand\nnewlines", "", "  x  "]


@pytest.mark.parametrize("text", TEXTS)
def test_prompt_round_trip(srv, text):
    out = ok(post(srv, "/tokenize", {"prompt": text}))
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["tokens"] == srv.tokenizer.encode_prompt(text)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == TINY.max_model_len
    assert out["token_strs"] is None
    assert ok(post(srv, "/detokenize", {"tokens": out["tokens"]})) == {"prompt": text}
    # a special token's name in a prompt is that token, as vLLM reads it
    assert any(srv.tokenizer.is_special(t) for t in out["tokens"]) == ("<|start|>" in text)


def test_reserved_names_in_a_prompt_read_as_transformers_reads_them(srv):
    """<|reserved_200013|> is listed by gpt-oss's tokenizer.json: a prompt naming it gets the
    token; <|reserved_200019|> is not: plain text, as transformers (vLLM) reads it."""
    out = ok(post(srv, "/tokenize", {"prompt": "<|reserved_200013|>x<|reserved_200019|>"}))
    tail = srv.tokenizer.encode("x<|reserved_200019|>")
    assert out["tokens"] == [200013, *tail] and not any(map(srv.tokenizer.is_special, tail))


def test_token_strs_and_options(srv):
    body = {"prompt": "Hello world", "return_token_strs": True, "add_special_tokens": False}
    out = ok(post(srv, "/tokenize", {**body, "model": "tiny"}))
    assert out["token_strs"] == [srv.tokenizer.id_to_token(t) for t in out["tokens"]]
    assert "".join(out["token_strs"]) == "HelloĠworld"  # byte-level BPE strings, as vLLM's
    # gpt-oss prompts get no BOS/EOS: add_special_tokens changes nothing
    assert ok(post(srv, "/tokenize", {"prompt": "Hello world"}))["tokens"] == out["tokens"]


CHATS = [
    {"messages": [{"role": "user", "content": "What is 17 * 23?"}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
        ],
        "tools": TOOLS,
        "reasoning_effort": "low",
    },
]


@pytest.mark.parametrize("chat", CHATS)
def test_messages_count_equals_chat_prompt_tokens(srv, oai, chat):
    out = ok(post(srv, "/tokenize", {**chat, "return_token_strs": True}))
    r = oai.chat.completions.create(model="tiny", max_tokens=1, **chat)
    assert out["count"] == r.usage.prompt_tokens == len(out["tokens"])
    assert out["token_strs"][-2:] == ["<|start|>", "assistant"]
    text = ok(post(srv, "/detokenize", {"tokens": out["tokens"]}))["prompt"]
    assert text.startswith("<|start|>system<|message|>") and text.endswith("<|start|>assistant")
    # without the generation prompt: the same tokens less the closing <|start|>assistant
    bare = ok(post(srv, "/tokenize", {**chat, "add_generation_prompt": False}))
    assert bare["tokens"] == out["tokens"][:-2] and bare["count"] == out["count"] - 2


def test_a_continued_message_counts_as_chat_renders_it(srv, oai):
    """continue_final_message (vLLM's): /tokenize renders the open last message exactly as
    chat does (its count is the chat's prompt_tokens), with add_generation_prompt false or left
    out; the prompt ends with the answer's header and text, no <|end|>."""
    msgs = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hello wor"}]
    out = ok(post(srv, "/tokenize", {"messages": msgs, "continue_final_message": True,
                                     "return_token_strs": True}))
    agp = {"add_generation_prompt": False}
    assert ok(post(srv, "/tokenize", {"messages": msgs, "continue_final_message": True, **agp}))[
        "tokens"] == out["tokens"]
    r = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=1,
                                    extra_body={"continue_final_message": True, **agp})
    assert out["count"] == r.usage.prompt_tokens == len(out["tokens"])
    tail = srv.tokenizer.encode("Hello wor")
    assert out["tokens"][-len(tail) - 5:] == [harmony.START, *srv.tokenizer.encode("assistant"),
                                             harmony.CHANNEL, *srv.tokenizer.encode("final"),
                                             harmony.MESSAGE, *tail]
    # without continue_final_message the conversation is finished: the same answer closed by
    # <|return|>, as Hugging Face's template closes a last answer with no generation prompt
    closed = ok(post(srv, "/tokenize", {"messages": msgs, **agp}))["tokens"]
    assert closed == out["tokens"] + [harmony.RETURN]
    r = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, extra_body=agp)
    assert r.usage.prompt_tokens == len(closed)


def test_errors(srv):
    tok, detok = "/tokenize", "/detokenize"
    msgs = [{"role": "user", "content": "hi"}]
    assert error(post(srv, tok, {"prompt": "a"}, key=None), 401)["code"] == "invalid_api_key"
    assert error(post(srv, detok, {"tokens": [1]}, key="no"), 401)["code"] == "invalid_api_key"
    assert error(httpx.get(srv.url + tok), 401)["code"] == "invalid_api_key"  # no probing
    err = error(post(srv, tok, {"prompt": "a", "model": "gpt-5"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert error(post(srv, detok, {"tokens": [1], "model": "x"}), 404)["param"] == "model"
    assert "malformed JSON" in error(post(srv, tok, "{nope"), 400)["message"]
    assert error(post(srv, tok, "[1]"), 400)["message"].startswith("the request body")
    err = error(post(srv, tok, {}), 400)
    assert err["param"] == "prompt" and err["type"] == "invalid_request_error"
    assert error(post(srv, tok, {"prompt": [1, 2]}), 400)["param"] == "prompt"
    assert error(post(srv, tok, {"prompt": "a", "messages": msgs}), 400)["param"] == "messages"
    assert error(post(srv, tok, {"messages": "hi"}), 400)["param"] == "messages"
    err = error(post(srv, tok, {"messages": msgs, "reasoning_effort": "max"}), 400)
    assert err["param"] == "reasoning_effort"
    err = error(post(srv, tok, {"messages": msgs, "add_generation_prompt": "no"}), 400)
    assert err["param"] == "add_generation_prompt"
    err = error(post(srv, tok, {"prompt": "a", "return_token_strs": 1}), 400)
    assert err["param"] == "return_token_strs"
    assert error(post(srv, tok, {"prompt": "a", "add_special_tokens": "y"}), 400)["param"] == (
        "add_special_tokens"
    )
    vocab = srv.client.info.vocab_size
    for tokens in ([1, vocab], [-1], "12", [1, 2.5], [True], None):
        err = error(post(srv, detok, {"tokens": tokens}), 400)
        assert err["param"] == "tokens", tokens
    assert str(vocab) in error(post(srv, detok, {"tokens": [vocab]}), 400)["message"]
    assert ok(post(srv, detok, {"tokens": []})) == {"prompt": ""}
    # lone surrogates, as in every other endpoint
    err = error(post(srv, tok, '{"prompt": "a\\ud800"}'), 400)
    assert err["param"] == "prompt" and "surrogate" in err["message"]
    bad_utf8 = httpx.post(
        srv.url + tok, content=b'{"prompt": "\xff"}', headers={"Authorization": f"Bearer {KEY}"}
    )
    assert "UTF-8" in error(bad_utf8, 400)["message"]


def test_limits(srv):
    # the body limit of every endpoint
    big = {"prompt": "a" * MAX_BYTES}
    assert error(post(srv, "/tokenize", big), 413)["code"] == "request_too_large"
    # a prompt longer than the context: the chat endpoints' error
    err = error(post(srv, "/tokenize", {"prompt": "word " * (TINY.max_model_len + 10)}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    long_chat = {"messages": [{"role": "user", "content": "word " * TINY.max_model_len}]}
    err = error(post(srv, "/tokenize", long_chat), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
