"""Seeded sampling under concurrency: a request with `seed` and temperature 1 gives the same
text run alone and run 16 times at once among other traffic (other prompts and temperatures,
n > 1, streams, a longer prompt being prefilled), whatever batches it lands in.

The suite's server admits MAX_NUM_SEQS + MAX_QUEUED requests at a time; a request answered
429 tries again shortly."""

from __future__ import annotations

import asyncio

from tests.reliability.helpers import CHAT, COMPLETIONS, MODEL, Api, Hang, Lost, wait_idle

SEEDED = {
    "model": MODEL,
    "prompt": "The seeded request, under load",
    "max_tokens": 4,
    "temperature": 1.0,
    "seed": 1234,
    "ignore_eos": True,
}
SEEDED_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "seeded chat"}],
    "max_tokens": 4,
    "temperature": 1.0,
    "seed": 77,
    "logprobs": True,
    "ignore_eos": True,
}
COPIES, CHAT_COPIES = 16, 4


def other_traffic() -> list[tuple[str, dict]]:
    base = {"model": MODEL, "max_tokens": 4, "ignore_eos": True}
    return [
        (COMPLETIONS, {**base, "prompt": "other traffic one", "temperature": 0.7, "seed": 1}),
        (COMPLETIONS, {**base, "prompt": "other traffic two", "temperature": 1.3}),
        (COMPLETIONS, {**base, "prompt": "other traffic three", "n": 2, "temperature": 1.0}),
        (COMPLETIONS, {**base, "prompt": "x " * 300, "temperature": 0.0}),  # a longer prefill
        (COMPLETIONS, {**base, "prompt": "streamed", "stream": True, "temperature": 1.0}),
        (COMPLETIONS, {**base, "prompt": SEEDED["prompt"], "temperature": 1.0, "seed": 5}),
        (CHAT, {**base, "messages": [{"role": "user", "content": "hello"}], "top_p": 0.9}),
        (CHAT, {**base, "messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ]


def text_of(answer: dict) -> str:
    return answer["choices"][0]["text"]


def tokens_of(answer: dict) -> list[str]:
    return [e["token"] for e in answer["choices"][0]["logprobs"]["content"]]


def test_seeded_text_is_identical_alone_and_under_concurrency(api: Api) -> None:
    r = api.post(COMPLETIONS, SEEDED, what="seeded request alone")
    assert r.status_code == 200, r.text[:300]
    alone = text_of(r.json())
    r = api.post(CHAT, SEEDED_CHAT, what="seeded chat alone")
    assert r.status_code == 200, r.text[:300]
    alone_chat = tokens_of(r.json())
    assert len(alone_chat) == SEEDED_CHAT["max_tokens"]

    async def main() -> list:
        async with api.async_client() as client:

            async def one(path: str, body: dict, what: str):
                try:
                    r, _ = await api.apost_until_admitted(client, path, body, what=what)
                    return what, r
                except (Hang, Lost) as e:
                    return what, e

            jobs = [one(COMPLETIONS, SEEDED, f"seeded copy {i}") for i in range(COPIES)]
            jobs += [one(CHAT, SEEDED_CHAT, f"seeded chat copy {i}") for i in range(CHAT_COPIES)]
            others = [one(p, b, f"other traffic {i}") for i, (p, b) in enumerate(other_traffic())]
            for k, job in enumerate(others):  # the other traffic between the copies
                jobs.insert(3 * k + 1, job)
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    failed = [f"{what}: {r}" for what, r in results if isinstance(r, Exception)]
    assert not failed, f"requests without an answer: {failed}"
    bad = [f"{what}: {r.status_code} {r.text[:200]}" for what, r in results if r.status_code != 200]
    assert not bad, f"requests that failed: {bad}"
    seeded = [(w, text_of(r.json())) for w, r in results if w.startswith("seeded copy")]
    chats = [(w, tokens_of(r.json())) for w, r in results if w.startswith("seeded chat copy")]
    assert len(seeded) == COPIES and len(chats) == CHAT_COPIES
    differ = [(w, t) for w, t in seeded if t != alone]
    assert not differ, f"alone {alone!r}; {len(differ)} of {COPIES} copies differ: {differ[:4]}"
    differ = [(w, t) for w, t in chats if t != alone_chat]
    assert not differ, f"chat alone {alone_chat}; {len(differ)} copies differ: {differ[:4]}"
    again = api.post(COMPLETIONS, SEEDED, what="seeded request alone again")
    assert text_of(again.json()) == alone
    wait_idle(api)
