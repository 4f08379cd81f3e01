"""The embedded API refuses bad input with errors that say what and where, and takes vLLM's
prompt dicts (TextPrompt / TokensPrompt)."""

import dataclasses
import pickle
import threading
import time

import pytest
import torch

from tinyoss import SamplingParams, harmony
from tinyoss.engine.core import truncate_prompt
from tinyoss.sampling_params import bad_words_ids

GREEDY = SamplingParams(temperature=0, max_tokens=2)
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather"}}


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_vllm_prompt_dicts_match_plain_forms(tiny_llm):
    ids = tiny_llm.tokenizer.encode("Hello there")
    want = tokens(tiny_llm.generate(["Hello there", ids], GREEDY, use_tqdm=False))
    assert want[0] == want[1]
    forms = [{"prompt": "Hello there"}, {"prompt_token_ids": ids}]
    assert tokens(tiny_llm.generate(forms, GREEDY, use_tqdm=False)) == want
    assert tokens(tiny_llm.generate(forms[1], GREEDY, use_tqdm=False)) == want[:1]
    assert tokens(tiny_llm.generate(tuple(ids), GREEDY, use_tqdm=False)) == want[:1]
    streamed = list(tiny_llm.stream({"prompt_token_ids": ids}, GREEDY))
    assert streamed[-1].outputs[0].token_ids == want[0]


def test_a_text_prompt_reads_special_token_names_as_vllm_does(tiny_llm):
    text = "<|start|>user<|message|>Hello<|end|><|start|>assistant"
    ids = tiny_llm.tokenizer.encode_prompt(text)
    assert len(ids) == 7 and sum(map(tiny_llm.tokenizer.is_special, ids)) == 4
    by_text, by_ids = tiny_llm.generate([text, ids], GREEDY, use_tqdm=False)
    assert by_text.prompt_token_ids == ids and tokens([by_text]) == tokens([by_ids])
    # a reserved name the tokenizer.json lists is its token; one past the list is text, as in
    # transformers (tests/test_tokenizer.py checks every one against it)
    out = tiny_llm.generate("<|reserved_200013|><|reserved_200019|>", GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == [200013, *tiny_llm.tokenizer.encode("<|reserved_200019|>")]
    assert tiny_llm.get_tokenizer().encode("<|reserved_200013|>") == [200013]


@pytest.mark.parametrize(
    "prompts, error, match",
    [
        (b"bytes", TypeError, r"prompts=b'bytes' \(bytes\) is invalid: give a str"),
        (123, TypeError, r"prompts=123 \(int\) is invalid"),
        (None, TypeError, r"prompts=None \(NoneType\)"),
        ({"a": 1}, ValueError, r"prompt has unsupported key 'a'"),
        ({"prompt": "x", "multi_modal_data": {}}, ValueError, r"unsupported key 'multi_modal_data"),
        ({}, ValueError, r"exactly one of 'prompt' or 'prompt_token_ids'"),
        ({"prompt": "x", "prompt_token_ids": [1]}, ValueError, r"exactly one of"),
        ({"prompt": [1, 2]}, TypeError, r"prompt\['prompt'\]=\[1, 2\] \(list\).*must be a str"),
        ({"prompt_token_ids": "ab"}, TypeError, r"\['prompt_token_ids'\]='ab' \(str\)"),
        ({"prompt_token_ids": [1, True]}, TypeError, r"\['prompt_token_ids'\]\[1\]=True \(bool"),
        ([True, False], TypeError, r"prompt\[0\]=True \(bool\).*not bools"),
        ([1, 2.5], TypeError, r"prompt\[1\]=2.5 \(float\)"),
        ([], ValueError, r"prompts is an empty list"),
        (["ok", 7], TypeError, r"prompts\[1\]=7 \(int\) is invalid: a prompt is a str"),
        (["ok", b"x"], TypeError, r"prompts\[1\]=b'x' \(bytes\)"),
        (["ok", [1, None]], TypeError, r"prompts\[1\]\[1\]=None"),
        (["ok", {"prompt": 3}], TypeError, r"prompts\[1\]\['prompt'\]=3"),
        (["ok", {"image": 1}], ValueError, r"prompts\[1\] has unsupported key 'image'"),
        ("", ValueError, r"prompt: prompt is empty"),
        ([[]], ValueError, r"prompts\[0\]: prompt is empty"),
        (["ok", {"prompt_token_ids": []}], ValueError, r"prompts\[1\]: prompt is empty"),
        (["ok", [1, 10**9]], ValueError, r"prompts\[1\]: prompt token id 1000000000 is outside"),
    ],
)
def test_bad_prompts_leave_nothing_queued(tiny_llm, prompts, error, match):
    with pytest.raises(error, match=match):
        tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not tiny_llm.engine.has_work()
    assert not tiny_llm.processor.requests
    assert len(tiny_llm.generate(["ok", [1, 2]], GREEDY, use_tqdm=False)) == 2


@pytest.mark.parametrize(
    "params, error, match",
    [
        ("x", TypeError, r"sampling_params='x' \(str\) is invalid: give None, a SamplingParams"),
        ({"temperature": 0}, TypeError, r"sampling_params=\{'temperature': 0\} \(dict\)"),
        ([GREEDY], ValueError, r"got 1 sampling_params for 2 prompts"),
        ([GREEDY, "x"], TypeError, r"sampling_params\[1\]='x' \(str\).*must be a SamplingParams"),
        ([GREEDY, None], TypeError, r"sampling_params\[1\]=None"),
    ],
)
def test_bad_sampling_params(tiny_llm, params, error, match):
    with pytest.raises(error, match=match):
        tiny_llm.generate(["a", "b"], params, use_tqdm=False)
    assert not tiny_llm.engine.has_work()


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("temperature", -1, r"temperature=-1 is invalid: must be a finite number >= 0"),
        ("max_tokens", 0, r"max_tokens=0 is invalid"),
        ("stop", 5, r"stop=5 is invalid"),
        ("n", True, r"n=True is invalid"),
    ],
)
def test_params_changed_after_construction_are_checked_again(tiny_llm, field, value, match):
    params = dataclasses.replace(GREEDY)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=r"sampling_params: " + match):
        tiny_llm.generate("a", params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"sampling_params\[1\]: " + match):
        tiny_llm.generate(["a", "b"], [GREEDY, params], use_tqdm=False)
    with pytest.raises(ValueError, match=match):
        tiny_llm.stream("a", params)
    assert not tiny_llm.engine.has_work()


def test_replace_is_idempotent():
    params = SamplingParams(temperature=1, stop="x", stop_token_ids=(3,), top_k=5, seed=1)
    again = dataclasses.replace(params)
    assert again == params and again is not params
    assert again.stop == ["x"] and again.stop_token_ids == [3] and again.temperature == 1.0
    assert again.stop is not params.stop  # the request's copy does not follow later edits


def test_stream_checks_at_the_call(tiny_llm):
    with pytest.raises(TypeError, match=r"prompt=b'x' \(bytes\) is invalid: a prompt is a str"):
        tiny_llm.stream(b"x")
    for batch in (["a", "b"], [[1], [2]]):  # one prompt only: a batch goes to generate
        with pytest.raises(TypeError, match=r"stream takes one prompt.*give them all to generate"):
            tiny_llm.stream(batch)
    with pytest.raises(TypeError, match=r"sampling_params=\[.*\(list\).*must be a SamplingParams"):
        tiny_llm.stream("a", [GREEDY])
    # the engine's own checks too (they came on the first next, a trial found)
    vocab, most = tiny_llm.engine.info.vocab_size, tiny_llm.engine.info.max_model_len
    for prompt, match in (({"prompt": ""}, r"prompt: prompt is empty"),
                          ([vocab], r"prompt: prompt token id \d+ is outside the vocabulary"),
                          ([1] * most, r"prompt: prompt is \d+ tokens long")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            tiny_llm.stream(prompt, GREEDY)
    bias = SamplingParams(max_tokens=1, logit_bias={vocab: 1.0})
    with pytest.raises(ValueError, match=r"^sampling_params\.logit_bias names token id"):
        tiny_llm.stream("a", bias)  # it had blamed the prompt
    with pytest.raises(ValueError, match=r"^sampling_params\.logit_bias.*\(the params of "
                                         r"prompts\[1\]\)"):
        tiny_llm.generate(["a", "b"], [GREEDY, bias], use_tqdm=False)
    with pytest.raises(ValueError, match="cannot be encoded as UTF-8"):  # the tokenizer's TypeError
        tiny_llm.stream("a\ud800b", GREEDY)
    tiny_llm.stream("never started", GREEDY)
    assert not tiny_llm.engine.has_work()


def test_a_streamed_output_keeps_its_text(tiny_llm):
    """Each output of a stream keeps the text and cumulative logprob of its step (they grew with
    the later steps: a trial read the final text on the first step's output)."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
    outs = list(tiny_llm.stream("Once upon a time", params))
    assert len(outs) == 5
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == "".join(o.outputs[0].delta_text for o in outs)
    sums = [o.outputs[0].cumulative_logprob for o in outs]
    entries = outs[-1].outputs[0].logprobs
    assert sums == pytest.approx([sum(e.logprob for e in entries[: i + 1]) for i in range(5)])


def test_vllm_names_a_port_reads(tiny_llm):
    """What vLLM code calls, found missing by a trial: SamplingParams.clone, the LLM's default
    params, RequestOutput.metrics; chat's continue_final_message with add_generation_prompt
    left at True refused with what to do; the engine's seed seeds sampling, as vLLM's; a pickled
    output keeps its tokens' text."""
    params = SamplingParams(stop=["x"], temperature=0.5)
    copy = params.clone()
    assert copy == params and copy.stop is not params.stop
    assert tiny_llm.get_default_sampling_params() == SamplingParams()
    out = tiny_llm.generate("a", SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)[0]
    times = out.metrics  # vLLM's RequestStateStats: the engine's queue, schedule, token times
    assert times.queued_ts <= times.scheduled_ts <= times.first_token_ts < times.last_token_ts
    back = pickle.loads(pickle.dumps(out))
    lp, again = out.outputs[0].logprobs[0], back.outputs[0].logprobs[0]
    assert [e.decoded_token for e in again.values()] == [e.decoded_token for e in lp.values()]
    assert all(isinstance(e.decoded_token, str) for e in again.values())
    with pytest.raises(ValueError, match="Cannot set both `continue_final_message` and "
                                         "`add_generation_prompt`.*set add_generation_prompt "
                                         "to false"):
        tiny_llm.chat(HI + [{"role": "assistant", "content": "The"}], GREEDY,
                      continue_final_message=True)


def test_the_engine_seed_seeds_sampling_as_vllms():
    """LLM(seed=...) seeded only dummy weights (a trial): as vLLM's, it seeds the sampling of
    requests without a seed of their own, so the same calls sample the same tokens run after
    run."""
    from tinyoss import LLM

    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    runs = []
    for seed in (7, 7, 8):
        llm = LLM("tiny", device="cpu", seed=seed, kv_cache_tokens=4096)
        assert torch.initial_seed() == seed
        runs.append(llm.generate(["Hello", "Hi"], params, use_tqdm=False))
        llm.close()
    ids = [tokens(r) for r in runs]
    assert ids[0] == ids[1] and ids[0] != ids[2]


def test_chat_accepts_one_conversation_or_a_batch(tiny_llm):
    one = tiny_llm.chat(HI, GREEDY, use_tqdm=False)
    two = tiny_llm.chat([HI, HI], GREEDY, use_tqdm=False, tools=[TOOL], tool_choice=TOOL)
    assert len(one) == 1 and len(two) == 2
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert tiny_llm.chat(parts, GREEDY, use_tqdm=False)[0].output.prompt_token_ids == (
        one[0].output.prompt_token_ids
    )


def test_chat_logprobs_are_the_answers_tokens(tiny_llm):
    """As on the server, each choice's logprobs are its content's tokens (they decode to it),
    none of its headers or reasoning; None without SamplingParams(logprobs=k)."""
    params = SamplingParams(n=2, max_tokens=20, seed=4, temperature=1.0, logprobs=1)
    reply = tiny_llm.chat(HI, params, use_tqdm=False)[0]
    for choice, raw in zip(reply.choices, reply.output.outputs):
        assert choice.content
        assert tiny_llm.tokenizer.decode([e.token_id for e in choice.logprobs]) == choice.content
        assert all(any(e is r for r in raw.logprobs) for e in choice.logprobs)
    assert reply.logprobs is reply.choices[0].logprobs
    assert tiny_llm.chat(HI, GREEDY, use_tqdm=False)[0].logprobs is None


def test_chat_stop_strings_cut_the_answer_only(tiny_llm):
    """As on the server, a stop string ends the answer before it (it had stayed in `content`),
    with the logprobs of the tokens at least partly before it; one inside the reasoning or a
    tool call's arguments changes nothing (it had ended the reply there, the call lost)."""
    params = SamplingParams(max_tokens=30, seed=1, temperature=1.0, logprobs=0)
    free = tiny_llm.chat(HI, params, use_tqdm=False)[0]
    assert free.content and len(free.content) > 4
    stop = free.content[2:4]
    cut = free.content.find(stop)
    got = tiny_llm.chat(HI, dataclasses.replace(params, stop=[stop]), use_tqdm=False)[0]
    assert got.content == (free.content[:cut] or None) and got.finish_reason == "stop"
    text = tiny_llm.tokenizer.decode([e.token_id for e in got.logprobs])
    assert text.startswith(free.content[:cut]) and len(text) < len(free.content)
    # include_stop_str_in_output keeps the stop string, as in generate (it had been ignored)
    kept = tiny_llm.chat(HI, dataclasses.replace(params, stop=[stop],
                                                 include_stop_str_in_output=True),
                         use_tqdm=False)[0]
    assert kept.content == free.content[:cut + len(stop)] and kept.finish_reason == "stop"
    # an answer in its harmony message (the random model writes one when its reasoning is
    # cut at once): the sequence ends at the stop string in the engine too (it had run on to
    # max_tokens, its raw output saying "length" where the reply said "stop")
    final = dict(thinking_token_budget=0, use_tqdm=False)
    free = tiny_llm.chat(HI, dataclasses.replace(params, ignore_eos=True), **final)[0]
    assert free.content and len(free.content) > 8 and free.outputs[0].finish_reason == "length"
    stop = free.content[4:6]
    got = tiny_llm.chat(HI, dataclasses.replace(params, ignore_eos=True, stop=[stop]),
                        **final)[0]  # fmt: skip
    raw, whole = got.outputs[0], free.outputs[0]
    assert got.content == free.content[: free.content.find(stop)] and got.finish_reason == "stop"
    assert (raw.finish_reason, raw.stop_reason) == ("stop", stop)
    assert raw.token_ids == whole.token_ids[: len(raw.token_ids)]
    assert len(raw.token_ids) < len(whole.token_ids)
    tools = dict(tools=[TOOL], tool_choice="required", thinking_token_budget=10, use_tqdm=False)
    free = tiny_llm.chat(HI, params, **tools)[0]
    assert free.reasoning and free.tool_calls
    stop = free.reasoning[1:3]
    got = tiny_llm.chat(HI, dataclasses.replace(params, stop=[stop]), **tools)[0]
    calls = [[(c.name, c.arguments) for c in r.tool_calls] for r in (got, free)]
    assert (got.reasoning, got.finish_reason, calls[0]) == (
        free.reasoning, free.finish_reason, calls[1])


def test_chat_takes_vllms_arguments(tiny_llm):
    """vLLM's chat(messages, params, use_tqdm, ..., chat_template_kwargs=...): gpt-oss's effort
    is often given in chat_template_kwargs; keys the template does not read are refused."""
    params = SamplingParams(temperature=0, max_tokens=3)
    by_kwargs = tiny_llm.chat(HI, params, False, chat_template_kwargs={
        "reasoning_effort": "low", "model_identity": "You are Tiny."})[0]
    by_name = tiny_llm.chat(HI, params, use_tqdm=False, reasoning_effort="low")[0]
    assert by_kwargs.output.prompt_token_ids != by_name.output.prompt_token_ids  # the identity
    low = tiny_llm.tokenizer.encode("Reasoning: low")
    ids = by_kwargs.output.prompt_token_ids
    assert any(ids[i:i + len(low)] == low for i in range(len(ids)))
    default = tiny_llm.chat(HI, params, False, reasoning_effort=None)[0].output.prompt_token_ids
    assert default == tiny_llm.chat(HI, params, False)[0].output.prompt_token_ids  # medium
    medium = tiny_llm.tokenizer.encode("Reasoning: medium")
    assert any(default[i:i + len(medium)] == medium for i in range(len(default)))
    for kw, match in (({"chat_template_kwargs": {"enable_thinking": False}}, "enable_thinking"),
                      ({"chat_template_kwargs": {"reasoning_effort": "low"},
                        "reasoning_effort": "high"}, "contradicts"),
                      ({"chat_template_kwargs": {"builtin_tools": ["browser"]}}, "browser")):
        with pytest.raises(ValueError, match=match):
            tiny_llm.chat(HI, params, False, **kw)
    with pytest.raises(TypeError, match="list of chat messages: give them to chat"):
        list(tiny_llm.stream(HI, params))
    assert tiny_llm.chat(HI, params, False)[0].finish_reason  # still serving


def test_cumulative_logprob_is_vllms(tiny_llm):
    """vLLM scripts rank n samples by `cumulative_logprob`: the sum of the sampled tokens'
    logprobs, None when none were asked for."""
    out = tiny_llm.generate("Hello", SamplingParams(n=2, seed=0, max_tokens=4, logprobs=1),
                            use_tqdm=False)[0]
    for c in out.outputs:
        assert c.cumulative_logprob == pytest.approx(sum(e.logprob for e in c.logprobs))
        assert c.cumulative_logprob < 0
    assert max(out.outputs, key=lambda c: c.cumulative_logprob) in out.outputs
    plain = tiny_llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.outputs[0].cumulative_logprob is None


def test_completion_finished_is_a_method_as_vllms(tiny_llm):
    """vLLM scripts call `c.finished()` on a CompletionOutput (a method there; the request's
    `finished` is a field): as a property it raised "'bool' object is not callable"."""
    outs = list(tiny_llm.stream("Hello", SamplingParams(max_tokens=2)))
    assert [o.outputs[0].finished() for o in outs] == [False, True]
    assert outs[-1].finished is True


def test_seed_minus_one_is_no_seed_as_vllms(tiny_llm):
    """vLLM reads seed=-1 as no seed (scripts pass it for "random"): it seeded every call with
    -1, so each repeated the last one's tokens."""
    assert SamplingParams(seed=-1).seed is None
    params = SamplingParams(seed=-1, max_tokens=6, ignore_eos=True)
    runs = [tokens(tiny_llm.generate("Hello", params, use_tqdm=False)) for _ in range(2)]
    assert runs[0] != runs[1]


def test_vllms_inert_arguments_are_taken_and_the_others_refused(tiny_llm):
    """vLLM scripts pass lora_request=None, chat_template=None and the like, and a factory of
    the progress bar as use_tqdm: each was a TypeError. A value that would ask for something
    tinyoss does not do is refused by name, and the LLM serves on."""
    made = []

    def bar(**kw):
        made.append(kw["total"])
        return __import__("tqdm").tqdm(**kw, disable=True)

    outs = tiny_llm.generate(["a", "b"], GREEDY, bar, lora_request=None, priority=None,
                             tokenization_kwargs={})
    assert len(outs) == 2 and made == [2]
    # vLLM's default priority, 0 a prompt, is the order tinyoss serves in anyway
    assert len(tiny_llm.generate(["a", "b"], GREEDY, False, priority=[0, 0])) == 2
    assert tiny_llm.chat(HI, GREEDY, False, lora_request=None, chat_template=None,
                         chat_template_content_format="openai", mm_processor_kwargs=None)
    for call, kw, words in [
        (tiny_llm.generate, {"lora_request": object()}, "lora_request=.* no LoRA"),
        (tiny_llm.generate, {"priority": [1]}, "priority=.* first come, first served"),
        (tiny_llm.generate, {"priority": [0, 2]}, "priority=.* only None or 0"),
        (tiny_llm.generate, {"priority": [False]}, "priority=.* first come, first served"),
        (tiny_llm.chat, {"chat_template": "{{ x }}"}, "chat_template=.* rendered in harmony"),
    ]:
        with pytest.raises(ValueError, match=words):
            call(HI if call == tiny_llm.chat else "a", GREEDY, False, **kw)
    with pytest.raises(TypeError, match="generate.* unexpected keyword argument 'chat_template'"):
        tiny_llm.generate("a", GREEDY, chat_template=None)
    assert tiny_llm.generate("a", GREEDY, use_tqdm=False)[0].finished


def test_metrics_count_tokens_and_time_the_first_as_vllms(tiny_llm):
    """vLLM's RequestStateStats also carries num_generation_tokens (all n sequences) and
    first_token_latency (arrival to first token): scripts reading them got AttributeError."""
    out = tiny_llm.generate("a", SamplingParams(n=2, max_tokens=3, seed=1, ignore_eos=True),
                            use_tqdm=False)[0]
    assert out.metrics.num_generation_tokens == 6
    assert out.metrics.first_token_latency == pytest.approx(
        out.first_token_time - out.arrival_time) and out.metrics.first_token_latency > 0


def test_chat_takes_every_choice_apart(tiny_llm):
    """With n > 1 each choice is parsed (only the first was), the first also as the reply's
    own fields."""
    from tinyoss import SamplingParams

    reply = tiny_llm.chat(HI, SamplingParams(n=3, max_tokens=6, seed=4), use_tqdm=False)[0]
    assert len(reply.choices) == 3 == len(reply.output.outputs)
    from tinyoss import harmony

    for choice, raw in zip(reply.choices, reply.output.outputs):
        parsed = harmony.parse_completion(raw.token_ids, tiny_llm.tokenizer.decode)
        assert (choice.reasoning, choice.content, choice.tool_calls) == (
            parsed.reasoning, parsed.content, parsed.tool_calls)
        assert choice.finish_reason == raw.finish_reason
    first = reply.choices[0]
    assert (reply.reasoning, reply.content, reply.tool_calls, reply.finish_reason) == (
        first.reasoning, first.content, first.tool_calls, first.finish_reason)
    assert len({tuple(o.token_ids) for o in reply.output.outputs}) > 1  # seeded apart


@pytest.mark.parametrize(
    "messages, error, match",
    [
        ("hi", TypeError, r"messages='hi' \(str\) is invalid: give a list of message dicts"),
        (HI[0], TypeError, r"messages=\{.*\(dict\) is invalid.*\[\{\"role\": \"user\""),
        ([], ValueError, r"messages is empty: give a list of message dicts"),
        ([[]], ValueError, r"messages\[0\] must be a non-empty list of message objects"),
        ([HI[0], HI], ValueError, r"messages\[1\] must be an object, not \["),
        ([HI, HI[0]], TypeError, r"messages\[1\]=\{.*\(dict\) is invalid: give a list"),
        ([HI, "hi"], TypeError, r"messages\[1\]='hi' \(str\)"),
        (["hi"], TypeError, r"messages\[0\]='hi' \(str\)"),
        ([HI, [HI[0], "x"]], ValueError, r"messages\[1\]\[1\] must be an object, not 'x'"),
        # a missing value is said to be missing (a JSON client sends null, a Python one None)
        ([{"content": "hi"}], ValueError, r"messages\[0\]\.role is missing: must be one of"),
        ([{"role": "user", "content": None}], ValueError,
         r"messages\[0\]\.content is missing: a user message's content is a string or a list"),
        ([{"role": "user", "content": [{"type": "text"}]}], ValueError,
         r"messages\[0\]\.content\[0\]\.text is missing: a text part is"),
        ([HI[0], {"role": "bot"}], ValueError, r"messages\[1\]\.role='bot' is invalid"),
        ([{"role": "user", "content": 5}], ValueError, r"messages\[0\]\.content must be.*not 5"),
        (
            [HI, [{"role": "user", "content": [{"type": "image_url"}]}]],
            ValueError,
            r"messages\[1\]\[0\]\.content\[0\] of type 'image_url' is not supported",
        ),
        ([{"role": "tool", "content": "42"}], ValueError,
         r"messages: messages\[0\] is a tool result without"),
        (
            [HI, [{"role": "assistant", "tool_calls": [{"function": {}}]}]],
            ValueError,
            r"messages\[1\]\[0\]\.tool_calls\[0\] must be \{\"type\": \"function\"",
        ),
    ],
)
def test_bad_chat_messages(tiny_llm, messages, error, match):
    with pytest.raises(error, match=match):
        tiny_llm.chat(messages, GREEDY, use_tqdm=False)
    assert not tiny_llm.engine.has_work()


@pytest.mark.parametrize(
    "options, match",
    [
        ({"reasoning_effort": "max"}, r"reasoning_effort='max' is invalid: must be one of low"),
        ({"tools": TOOL}, r"tools must be a list of \{\"type\": \"function\""),
        ({"tools": [{"name": "f"}]}, r"tools\[0\] must be \{\"type\": \"function\""),
        ({"tools": [TOOL, {"function": {"name": "f"}}, TOOL]},
         r"tools\[2\] is named 'get_weather' like tools\[0\]: give each tool its own name"),
        ({"tools": [{"function": {"name": "get weather"}}]},
         r"tools\[0\] is named 'get weather': a tool's name must be 1 to 64 letters"),
        ({"tools": [TOOL], "tool_choice": "any"}, r"tool_choice='any' is invalid: must be 'auto'"),
        ({"tool_choice": TOOL}, r"tool_choice=.*naming one of the tools"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}},
            r"tool_choice=.*'other'.*naming one of the tools",
        ),
    ],
)
def test_bad_chat_options(tiny_llm, options, match):
    with pytest.raises(ValueError, match=match):
        tiny_llm.chat(HI, GREEDY, use_tqdm=False, **options)
    assert not tiny_llm.engine.has_work()


def _text(outs) -> list[str]:
    return [o.outputs[0].text for o in outs]


def test_streams_and_calls_may_overlap(tiny_llm):
    """A stream left open while generate() runs, and two streams read in turns, each get all of
    their own output: the same text as alone (seeded sampling), nothing lost or hung."""
    sp = SamplingParams(max_tokens=12, seed=1, ignore_eos=True)
    alone = {p: "".join(o.outputs[0].delta_text for o in tiny_llm.stream(p, sp))
             for p in ("alpha", "beta")}
    other = _text(tiny_llm.generate(["gamma"], SamplingParams(max_tokens=30, seed=2),
                                    use_tqdm=False))
    s = tiny_llm.stream("alpha", sp)
    first = next(s).outputs[0].delta_text
    assert _text(tiny_llm.generate(["gamma"], SamplingParams(max_tokens=30, seed=2),
                                   use_tqdm=False)) == other
    assert first + "".join(o.outputs[0].delta_text for o in s) == alone["alpha"]
    a, b = tiny_llm.stream("alpha", sp), tiny_llm.stream("beta", sp)
    got = {"alpha": "", "beta": ""}
    live = {"alpha": a, "beta": b}
    while live:  # in turns
        for p, it in list(live.items()):
            out = next(it, None)
            if out is None:
                del live[p]
            else:
                got[p] += out.outputs[0].delta_text
    assert got == alone
    assert tiny_llm.engine.scheduler.kv.usage() == 0 and not tiny_llm._inbox


def test_calls_from_two_threads(tiny_llm):
    """generate() from two threads at once on one LLM: both answer as they would alone."""
    prompts = [f"p{i}" for i in range(2)]
    sp = [SamplingParams(max_tokens=8, seed=i, ignore_eos=True) for i in range(2)]
    alone = [_text(tiny_llm.generate([p], s, use_tqdm=False)) for p, s in zip(prompts, sp)]
    got: list = [None, None]
    errors: list = []

    def run(i: int) -> None:
        try:
            got[i] = _text(tiny_llm.generate([prompts[i]], sp[i], use_tqdm=False))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and got == alone


@pytest.mark.parametrize("spec", [{"regex": "(("}, {"json": {"type": "bogus"}}, {"json": "{nope"},
                                  {"grammar": "start: ("}, {"regex": r"a[^\s\S]"},
                                  {"grammar": 'start: x\nx: x "a"'}])
def test_a_structured_output_that_cannot_be_enforced_raises_at_the_call(tiny_llm, spec):
    from tinyoss import StructuredOutputs

    bad = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputs(**spec))
    where = "sampling_params.structured_outputs: the .* (cannot be enforced|matches no text)"
    with pytest.raises(ValueError, match=where):
        tiny_llm.generate(["x"], bad, use_tqdm=False)
    with pytest.raises(ValueError, match=where):
        tiny_llm.stream("x", bad)
    if "grammar" not in spec:  # (a Lark grammar has no place in a chat reply at all)
        with pytest.raises(ValueError, match=where):
            tiny_llm.chat([{"role": "user", "content": "x"}], bad, use_tqdm=False)
    assert not tiny_llm.engine.has_work()


def test_an_output_shows_its_text():
    from tinyoss.engine.output_processor import CompletionOutput

    out = CompletionOutput(0, [1, 2], pieces=["he", "llo"], finish_reason="length")
    assert repr(out) == ("CompletionOutput(index=0, text='hello', token_ids=[1, 2], "
                         "finish_reason='length', stop_reason=None)")


def test_close_ends_the_requests_still_running():
    """close() ends what still runs: an open stream's next step and a generate in another
    thread raise RuntimeError (both had run to their end after close; close had waited
    seconds for the lock while the other thread stepped)."""
    from tinyoss import LLM

    llm = LLM("tiny", max_model_len=4096)
    params = SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0)
    stream = llm.stream("hi", params)
    next(stream)
    errors: list[BaseException] = []
    started = threading.Event()

    def run() -> None:
        try:
            started.set()
            llm.generate(["hi", "there"], params, use_tqdm=False)
        except RuntimeError as e:
            errors.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    started.wait()
    while len(llm._inbox) < 3:  # the stream's request and the generate's two are in
        time.sleep(0.01)
    llm.close()
    worker.join(60)
    assert not worker.is_alive() and len(errors) == 1
    assert "closed while it generated" in str(errors[0])
    with pytest.raises(RuntimeError, match="closed"):
        next(stream)


def test_logit_bias_and_allowed_token_ids_steer_the_model(tiny_llm):
    """Through the engine: allowed_token_ids keeps every sampled token inside its set, a bias of
    100 makes its token the greedy pick, and an id outside the vocabulary is refused before it
    can index the sampler's logits (a device-side assert on a GPU)."""
    ids = tiny_llm.tokenizer.encode("Hello there")
    allowed = [11, 200, 3000]
    sampled = SamplingParams(temperature=1.0, max_tokens=12, seed=1, allowed_token_ids=allowed)
    assert set(tokens(tiny_llm.generate(ids, sampled, use_tqdm=False))[0]) <= set(allowed)
    plain = tokens(tiny_llm.generate(ids, GREEDY, use_tqdm=False))[0]
    forced = 4242 if plain[0] != 4242 else 4243
    biased = dataclasses.replace(GREEDY, logit_bias={forced: 100})
    assert tokens(tiny_llm.generate(ids, biased, use_tqdm=False))[0] == [forced, forced]
    vocab = tiny_llm.tokenizer.vocab_size
    for bad in ({"logit_bias": {vocab: 1}}, {"allowed_token_ids": [1, vocab]}):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tiny_llm.generate(ids, dataclasses.replace(GREEDY, **bad), use_tqdm=False)
    assert tokens(tiny_llm.generate(ids, GREEDY, use_tqdm=False))[0] == plain  # still serving


def test_vllm_code_reads_chat_outputs_and_logprobs_unchanged(tiny_llm):
    """vLLM's `llm.chat(...)[0].outputs[0].text` and its logprobs dicts {token id: Logprob}
    (the sampled token first, ranks from 1) work on tinyoss's outputs as they are."""
    reply = tiny_llm.chat(HI, SamplingParams(max_tokens=6, seed=2, temperature=1.0, logprobs=3),
                          use_tqdm=False)[0]
    assert reply.outputs is reply.output.outputs
    assert reply.outputs[0].text == reply.output.outputs[0].text
    assert reply.prompt_token_ids == reply.output.prompt_token_ids and reply.finished
    assert reply.request_id == reply.output.request_id
    for position in reply.outputs[0].logprobs:
        sampled = position.token_id
        assert next(iter(position)) == sampled and sampled in position
        assert position[sampled].logprob == position.logprob
        assert [position[t].rank for t, _ in position.top] == list(range(1, len(position.top) + 1))
        assert len(position) == len({sampled, *(t for t, _ in position.top)}) <= 4
        best = max(position.values(), key=lambda lp: lp.logprob)
        assert best.rank == 1 and best.logprob == position.top[0][1]
        assert position.get(-1) is None
        for t, entry in position.items():  # each token's own text, as vLLM's detokenizer gives
            assert entry.decoded_token == tiny_llm.tokenizer.decode([t])
        copy = pickle.loads(pickle.dumps(position))  # the texts travel, not the tokenizer
        assert copy == position and dict(copy.items()) == dict(position.items())
        assert not hasattr(copy.decode, "__self__") or isinstance(copy.decode.__self__, dict)
    ids = tiny_llm.tokenizer.encode("Hello there")
    prompt = tiny_llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=1),
                               use_tqdm=False)[0].prompt_logprobs
    assert len(ids) > 1 and prompt[0] is None
    assert [p[t].decoded_token for p, t in zip(prompt[1:], ids[1:])] == [
        tiny_llm.tokenizer.decode([t]) for t in ids[1:]]


def test_chat_outputs_read_every_request_output_field_and_logprobs_rank_truly(tiny_llm):
    """A ChatOutput gives any RequestOutput field (prompt_logprobs, num_cached_tokens), and a
    sampled or prompt token's Logprob rank is its true rank even outside the top ones asked
    for (vLLM's; it had been None there, so sorting by rank raised)."""
    params = SamplingParams(max_tokens=4, seed=1, temperature=1.0, logprobs=2, prompt_logprobs=2)
    reply = tiny_llm.chat(HI, params, use_tqdm=False)[0]
    assert reply.prompt_logprobs is reply.output.prompt_logprobs
    assert reply.prompt_logprobs[0] is None and len(reply.prompt_logprobs) > 1
    assert reply.num_cached_tokens == reply.output.num_cached_tokens
    with pytest.raises(AttributeError):
        reply.no_such_field
    for position in [*reply.outputs[0].logprobs, *reply.prompt_logprobs[1:]]:
        ranks = [lp.rank for lp in position.values()]
        assert all(isinstance(r, int) and r >= 1 for r in ranks), ranks
        top = [t for t, _ in position.top]
        sampled = position[position.token_id].rank
        assert sampled == top.index(position.token_id) + 1 if position.token_id in top else (
            sampled > len(top))


def test_bad_words_keep_a_word_out_of_the_output(tiny_llm):
    """vLLM's bad_words through the engine: the greedy output's first token, as a word, is
    never generated once banned (the rest of the output may change)."""
    ids = tiny_llm.tokenizer.encode("Hello there")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = tokens(tiny_llm.generate(ids, greedy, use_tqdm=False))[0]
    word = next(w for t in plain if (w := tiny_llm.tokenizer.decode([t])).strip()
                and tiny_llm.tokenizer.encode(w.lstrip()) in ([t], ))
    banned = bad_words_ids(SamplingParams(bad_words=[word]), tiny_llm.tokenizer.encode)
    out = tokens(tiny_llm.generate(ids, dataclasses.replace(greedy, bad_words=[word]),
                                   use_tqdm=False))[0]
    assert out != plain
    assert not any(q[0] in out for q in banned.bad_words_token_ids if len(q) == 1)


def test_truncate_prompt_tokens_keeps_the_prompts_end(tiny_llm):
    """vLLM's SamplingParams.truncate_prompt_tokens: the engine reads the prompt's last k
    tokens (the output's prompt_token_ids say so), a prompt longer than the context fits, and
    a k the context cannot take is refused naming the field."""
    limit = tiny_llm.engine.info.max_model_len
    ids = [1000 + i % 5000 for i in range(limit + 50)]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    cut = tiny_llm.generate(ids, dataclasses.replace(greedy, truncate_prompt_tokens=64),
                            use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-64:]
    assert tokens([cut]) == tokens(tiny_llm.generate(ids[-64:], greedy, use_tqdm=False))
    # -1: as much of the end as leaves room for max_tokens (end to end in test_server.py)
    assert truncate_prompt(ids, dataclasses.replace(greedy, truncate_prompt_tokens=-1),
                           limit) == ids[-(limit - 5):]
    assert truncate_prompt(ids, greedy, limit) is ids  # not set: whole (check_prompt refuses)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        tiny_llm.generate(ids, dataclasses.replace(greedy, truncate_prompt_tokens=limit),
                          use_tqdm=False)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_vllm_llm_arguments_that_change_nothing_pass_and_others_are_refused_by_name(tiny_llm):
    """vLLM's `LLM(trust_remote_code=True)` and `quantization="mxfp4"` were TypeErrors; they
    are `tinyoss serve`'s vLLM flags as keywords: noted and dropped where they change nothing,
    a ValueError naming them where they would; `generate` takes use_tqdm third, as vLLM's."""
    from tinyoss import LLM
    from tinyoss.server.vllm_flags import llm_keyword

    assert "changes nothing" in llm_keyword("trust_remote_code", True)
    assert "changes nothing" in llm_keyword("quantization", "MXFP4")
    assert llm_keyword("quantization", None) is not None and llm_keyword("foo", 1) is None
    for bad in ({"quantization": "awq"}, {"enable_lora": True}, {"kv_cache_dtype": "fp8"}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"{name}="):
            LLM("tiny", device="cpu", **bad)
    with pytest.raises(TypeError, match="unknown LLM argument"):
        LLM("tiny", device="cpu", not_an_argument=1)
    ids = tiny_llm.tokenizer.encode("Hello there")
    greedy = SamplingParams(temperature=0, max_tokens=3)
    assert tokens(tiny_llm.generate(ids, greedy, False)) == tokens(
        tiny_llm.generate(ids, greedy, use_tqdm=False))


def test_vllms_best_of_equal_to_n_is_taken():
    """vLLM's SamplingParams(best_of=...) was a TypeError: n's value (what the samples are
    anyway) passes, any other is refused naming it."""
    assert SamplingParams(n=2, best_of=2).best_of == 2 and SamplingParams().best_of is None
    for bad in (3, True, 2.0):
        with pytest.raises(ValueError, match=r"best_of=.* is invalid: must be None or n \(2\)"):
            SamplingParams(n=2, best_of=bad)


def test_chat_continues_the_final_message_as_vllms(tiny_llm):
    """vLLM's chat(..., add_generation_prompt=False, continue_final_message=True): the prompt
    ends inside the last assistant message and the reply is the new text only, parsed from
    inside the answer (the random model writes no header), so stop strings watch it from the
    first token; a continuation that cannot be rendered or constrained is a ValueError."""
    msgs = [*HI, {"role": "assistant", "content": "Hello wor"}]
    params = SamplingParams(temperature=0, max_tokens=12)
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    r = tiny_llm.chat(msgs, params, use_tqdm=False, **cont)[0]
    want = harmony.render_prompt(msgs, tiny_llm.tokenizer.encode, **cont)
    assert r.prompt_token_ids == want
    assert tiny_llm.tokenizer.decode(want).endswith(
        "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>Hello wor")
    raw = tiny_llm.generate({"prompt_token_ids": want}, params, use_tqdm=False)[0].outputs[0]
    assert r.outputs[0].token_ids == raw.token_ids
    # its text, less a reserved special token or two the random model writes
    assert not set(raw.token_ids) & {harmony.END, harmony.START, harmony.CHANNEL}
    assert r.content == tiny_llm.tokenizer.decode(
        [t for t in raw.token_ids if t < harmony.FIRST_SPECIAL])
    assert r.reasoning is None and r.content and len(r.content) > 4
    stop = r.content[2:4]
    got = tiny_llm.chat(msgs, dataclasses.replace(params, stop=[stop]), use_tqdm=False,
                        **cont)[0]
    assert got.content == r.content[: r.content.find(stop)] and got.finish_reason == "stop"
    assert (got.outputs[0].finish_reason, got.outputs[0].stop_reason) == ("stop", stop)
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    for conv, kw, match in [
        (HI, cont, r"messages\[0\]\.role is 'user'.*must be the assistant's"),
        ([*HI, call], cont, r"messages\[1\] has tool_calls.*cannot continue a tool call"),
        (msgs, {**cont, "response_format": {"type": "json_object"}},
         "^response_format cannot be enforced with add_generation_prompt=False"),
        (HI, {"add_generation_prompt": False, "thinking_token_budget": 0},
         "^thinking_token_budget cannot be enforced"),
        (HI, {"add_generation_prompt": False, "tools": [TOOL], "tool_choice": "required"},
         "^tool_choice cannot be enforced"),
    ]:
        with pytest.raises(ValueError, match=match):
            tiny_llm.chat(conv, params, use_tqdm=False, **kw)
    bare = tiny_llm.chat(HI, params, use_tqdm=False, add_generation_prompt=False)[0]
    assert bare.prompt_token_ids == tiny_llm.chat(HI, params, use_tqdm=False)[0].prompt_token_ids[
        :-2]  # less <|start|>assistant


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_get_tokenizer_reads_as_vllms_hugging_face_tokenizer(tiny_llm):
    """vLLM scripts build prompts with `llm.get_tokenizer()`: its apply_chat_template renders
    as `chat` does (tools, reasoning effort, template keywords, both endings), so generate of
    its text or ids runs `chat`'s prompt; text is read as generate reads it, special-token
    names as those tokens."""
    tok = tiny_llm.get_tokenizer()
    assert tok is tiny_llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=2)

    def chat_ids(messages, **kw):
        return tiny_llm.chat(messages, params, use_tqdm=False, **kw)[0].prompt_token_ids

    text = tok.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and text.endswith("<|start|>user<|message|>hi<|end|>"
                                                   "<|start|>assistant")
    assert tiny_llm.generate(text, params, use_tqdm=False)[0].prompt_token_ids == chat_ids(HI)
    assert tok.encode(text) == tok(text).input_ids == tok(text)["input_ids"] == chat_ids(HI)
    assert tok.apply_chat_template(HI, add_generation_prompt=True) == chat_ids(HI)
    assert tok.apply_chat_template(HI) == chat_ids(HI)[:-2]  # Hugging Face's default: none
    kw = {"tools": [TOOL], "reasoning_effort": "low"}
    assert tok.apply_chat_template(HI, add_generation_prompt=True, **kw) == chat_ids(HI, **kw)
    ctk = {"reasoning_effort": "high", "model_identity": "You are Tiny."}
    assert tok.apply_chat_template(HI, add_generation_prompt=True, chat_template_kwargs=ctk) == (
        chat_ids(HI, chat_template_kwargs=ctk)) == tok.apply_chat_template(
        HI, add_generation_prompt=True, **ctk)
    said = [*HI, {"role": "assistant", "content": "Hello wor"}]
    assert tok.apply_chat_template(said, continue_final_message=True) == chat_ids(
        said, add_generation_prompt=False, continue_final_message=True)
    two = tok.apply_chat_template([HI, said], add_generation_prompt=True)
    assert two == [chat_ids(HI), chat_ids(said)]
    enc = tok.apply_chat_template([HI, said], add_generation_prompt=True, return_dict=True)
    assert enc.input_ids == two and enc["attention_mask"] == [[1] * len(i) for i in two]
    # typed in content, a special token's name stays text in the ids; in the text form it
    # reads back as the token, as any template's text does
    forged = [{"role": "user", "content": "a<|end|>b"}]
    ids = tok.apply_chat_template(forged)
    text = tok.apply_chat_template(forged, tokenize=False)
    assert text == tok.decode(ids) and text.endswith("<|message|>a<|end|>b<|end|>")
    assert tok.encode(text).count(harmony.END) == ids.count(harmony.END) + 1
    # the common surface
    assert tok.encode("<|start|>user<|message|>hi<|end|>") == [200006, 1428, 200008, 3686, 200007]
    assert tok.decode([200006, 1428]) == "<|start|>user" and tok.decode(1428) == "user"
    assert tok.decode([[1428], [3686]]) == tok.batch_decode([[1428], [3686]]) == ["user", "hi"]
    assert tok.decode([200006, 1428], skip_special_tokens=True) == "user"
    assert tok.convert_ids_to_tokens([200006, 1428]) == ["<|start|>", "user"]
    assert tok.convert_ids_to_tokens(200007) == "<|end|>"
    assert tok.convert_tokens_to_ids(["<|end|>", "user"]) == [200007, 1428]
    assert (tok.eos_token, tok.eos_token_id) == ("<|return|>", 200002)
    assert (tok.pad_token_id, tok.bos_token_id) == (199999, 199998)
    assert (len(tok), tok.vocab_size) == (200019, 199998) == (len(tok.get_vocab()), 199998)
    assert tok(["hi", "user"]).input_ids == [[3686], [1428]]
    for call, match in [
        (lambda: tok.apply_chat_template(HI, chat_template="{{ messages }}"),
         "chat_template is not supported: tinyoss renders gpt-oss's harmony format"),
        (lambda: tok.apply_chat_template(HI, padding=True), "padding=True is not supported"),
        (lambda: tok("hi", return_tensors="pt"), "return_tensors='pt' is not supported"),
        (lambda: tok.apply_chat_template(HI, enable_thinking=False), "enable_thinking"),
        (lambda: tok.apply_chat_template(said, add_generation_prompt=True,
                                         continue_final_message=True), "Cannot set both"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.raises(TypeError, match="unexpected keyword argument 'stride'"):
        tok.encode("hi", stride=2)


def test_a_finished_conversation_renders_as_hugging_faces_template(tiny_llm, tiny_dir):
    """add_generation_prompt=False after an assistant's answer (Hugging Face's default in
    `apply_chat_template`): `get_tokenizer().apply_chat_template` and `chat` give the ids
    transformers' tokenizer gives with the checkpoint's chat_template.jinja: the answer closed
    by <|return|> and its reasoning shown. `continue_final_message` still leaves it open."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    tok = tiny_llm.get_tokenizer()
    said = [*HI, {"role": "assistant", "content": "Hello", "reasoning_content": "Greet."}]
    ours = tok.apply_chat_template(said)
    theirs = hf.apply_chat_template(said, tokenize=True, return_dict=False)
    assert theirs in (ours, tok.apply_chat_template(said))  # rendered again past midnight
    assert tok.decode(ours).endswith(
        "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>analysis<|message|>"
        "Greet.<|end|><|start|>assistant<|channel|>final<|message|>Hello<|return|>")
    params = SamplingParams(temperature=0, max_tokens=4)
    r = tiny_llm.chat(said, params, use_tqdm=False, add_generation_prompt=False)[0]
    assert r.prompt_token_ids == ours and len(r.outputs[0].token_ids) == 4
    opened = tok.apply_chat_template(said, continue_final_message=True)
    assert opened == ours[:-1] and harmony.RETURN not in opened
