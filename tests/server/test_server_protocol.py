"""The server's pure parts: a request body checked field by field (each bad field named in a
400, another model a 404), incremental detokenization that never emits half a character and
streams exactly the text decoded whole, and stop strings matched across token boundaries."""

import pytest
from real_model import smol

from vmcache.server.protocol import APIError, Limits, parse
from vmcache.server.text import Detokenizer, StopMatcher

LIMITS = Limits("m", max_seq_len=512, max_n=4, vocab_size=100)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
CHAT_MESSAGES = ({"role": "user", "content": "hi"},)


def test_a_good_request_becomes_a_job_with_openais_defaults():
    job = parse(dict(CHAT), "chat", LIMITS)
    assert job.kind == "chat" and job.max_tokens is None and job.params.temperature == 1.0
    assert job.messages == ({"role": "user", "content": "hi"},) and not job.stream
    job = parse({"model": "m", "prompt": [5, 6], "max_tokens": 3, "temperature": 0, "n": 2,
                 "stop": "x", "top_k": -1, "seed": 7, "stream": True,
                 "stream_options": {"include_usage": True}, "user": "ignored"},
                "completion", LIMITS)  # fmt: skip
    assert job.prompts == ((5, 6),) and job.params.max_new_tokens == 3 and job.params.n == 2
    assert job.stops == ("x",) and job.params.top_k == 0 and job.include_usage
    assert parse({"model": "m", "prompt": "a"}, "completion", LIMITS).max_tokens == 16
    parts = {**CHAT, "messages": [{"role": "developer", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}  # fmt: skip
    assert parse(parts, "chat", LIMITS).messages == ({"role": "system", "content": "ab"},)
    assert parse({**CHAT, "max_completion_tokens": 9}, "chat", LIMITS).max_tokens == 9
    assert parse(dict(CHAT), "chat", LIMITS).params.seed is None  # sampled afresh
    assert parse({**CHAT, "seed": -(2**63)}, "chat", LIMITS).params.seed == -(2**63)


def test_what_clients_and_harnesses_send_is_served():
    batch = parse({"model": "m", "prompt": ["a", "b"], "logprobs": 0, "echo": True,
                   "max_tokens": 0}, "completion", LIMITS)  # fmt: skip
    assert batch.prompts == ("a", "b") and batch.echo and batch.max_tokens == 0
    assert batch.params.logprobs == 0 and batch.params.prompt_logprobs == 0
    ids = parse({"model": "m", "prompt": [[1, 2], [3]], "logprobs": 5}, "completion", LIMITS)
    assert ids.prompts == ((1, 2), (3,)) and ids.params.prompt_logprobs is None
    job = parse({**CHAT, "logprobs": True, "top_logprobs": 3, "frequency_penalty": -1,
                 "presence_penalty": 0.5, "logit_bias": {"7": -100, "3": 2},
                 "repetition_penalty": 1.1}, "chat", LIMITS)  # fmt: skip
    p = job.params
    assert p.logprobs == 3 and p.prompt_logprobs is None and p.logit_bias == ((3, 2.0), (7, -100.0))
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (-1, 0.5, 1.1)
    assert parse({**CHAT, "logprobs": True}, "chat", LIMITS).params.logprobs == 0
    assert parse({**CHAT, "logprobs": False}, "chat", LIMITS).params.logprobs is None
    tool = {**CHAT, "messages": [{"role": "tool", "content": "42"}]}  # a template's own role
    assert parse(tool, "chat", LIMITS).messages == ({"role": "tool", "content": "42"},)
    no_ops = {
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "min_tokens": 0,
        "skip_special_tokens": True,
        "modalities": ["text"],
        "guided_json": None,
    }
    assert parse({**CHAT, **no_ops}, "chat", LIMITS).messages == CHAT_MESSAGES  # change nothing
    opts = {"include_usage": True, "continuous_usage_stats": True}
    assert parse({**CHAT, "stream": True, "stream_options": opts}, "chat", LIMITS).continuous_usage


BAD = [
    ("chat", [1, 2], None),
    ("chat", {"messages": CHAT["messages"]}, "model"),
    ("chat", {**CHAT, "model": 3}, "model"),
    ("chat", {**CHAT, "messages": []}, "messages"),
    ("chat", {**CHAT, "messages": [{"role": "", "content": "x"}]}, "messages"),
    ("chat", {**CHAT, "messages": [{"role": 5, "content": "x"}]}, "messages"),
    ("chat", {**CHAT, "messages": [{"role": "r" * 65, "content": "x"}]}, "messages"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages"),
    (
        "chat",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages",
    ),
    ("chat", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": 513}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": "5"}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": True}, "max_tokens"),
    ("chat", {**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
    ("chat", {**CHAT, "n": 0}, "n"),
    ("chat", {**CHAT, "n": 5}, "n"),
    ("chat", {**CHAT, "temperature": -0.1}, "temperature"),
    ("chat", {**CHAT, "temperature": 2.5}, "temperature"),
    ("chat", {**CHAT, "temperature": "hot"}, "temperature"),
    ("chat", {**CHAT, "top_p": 0}, "top_p"),
    ("chat", {**CHAT, "top_p": 1.5}, "top_p"),
    ("chat", {**CHAT, "top_k": -2}, "top_k"),
    ("chat", {**CHAT, "seed": -(2**63) - 1}, "seed"),
    ("chat", {**CHAT, "seed": 2**63}, "seed"),
    ("chat", {**CHAT, "stop": ["a"] * 5}, "stop"),
    ("chat", {**CHAT, "stop": [""]}, "stop"),
    ("chat", {**CHAT, "stop": 3}, "stop"),
    ("chat", {**CHAT, "stream": "yes"}, "stream"),
    ("chat", {**CHAT, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
    ("chat", {**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {**CHAT, "logprobs": 1}, "logprobs"),
    ("chat", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {**CHAT, "presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {**CHAT, "frequency_penalty": "x"}, "frequency_penalty"),
    ("chat", {**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {**CHAT, "logit_bias": {"x": 1}}, "logit_bias"),
    ("chat", {**CHAT, "logit_bias": {"100": 1}}, "logit_bias"),
    ("chat", {**CHAT, "logit_bias": {"5": 101}}, "logit_bias"),
    ("chat", {**CHAT, "logit_bias": [1]}, "logit_bias"),
    ("chat", {**CHAT, "echo": True}, "echo"),
    (
        "chat",
        {**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": 1}},
        "stream_options",
    ),
    ("chat", {**CHAT, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("completion", {"model": "m"}, "prompt"),
    ("completion", {"model": "m", "prompt": ""}, "prompt"),
    ("completion", {"model": "m", "prompt": ["a", ""]}, "prompt"),
    ("completion", {"model": "m", "prompt": [1, "a"]}, "prompt"),
    ("completion", {"model": "m", "prompt": [[1], "a", []]}, "prompt"),
    ("completion", {"model": "m", "prompt": [100]}, "prompt"),
    ("completion", {"model": "m", "prompt": [[1], [-1]]}, "prompt"),
    ("completion", {"model": "m", "prompt": ["a"] * 257}, "prompt"),
    ("completion", {"model": "m", "prompt": "a", "echo": 1}, "echo"),
    ("completion", {"model": "m", "prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("completion", {"model": "m", "prompt": "a", "logprobs": 21}, "logprobs"),
    ("completion", {"model": "m", "prompt": "a", "logprobs": True}, "logprobs"),
    ("chat", {**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("chat", {**CHAT, "min_tokens": 5}, "min_tokens"),
    ("chat", {**CHAT, "guided_json": {"type": "object"}}, "guided_json"),
    ("chat", {**CHAT, "skip_special_tokens": False}, "skip_special_tokens"),
    (
        "completion",
        {"model": "m", "prompt": "a", "include_stop_str_in_output": True},
        "include_stop_str_in_output",
    ),
    ("completion", {"model": "m", "prompt": "a", "prompt_logprobs": 1}, "prompt_logprobs"),
]


@pytest.mark.parametrize("kind,body,param", BAD)
def test_each_bad_field_is_a_400_that_names_it(kind, body, param):
    with pytest.raises(APIError) as e:
        parse(body, kind, LIMITS)
    assert e.value.status == 400 and e.value.param == param
    err = e.value.body()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_another_model_is_a_404_model_not_found():
    with pytest.raises(APIError) as e:
        parse({**CHAT, "model": "gpt-4"}, "chat", LIMITS)
    assert e.value.status == 404 and e.value.code == "model_not_found"


def test_stop_strings_are_found_across_pushes_and_held_back_while_they_may_start():
    m = StopMatcher(("END", "\n\n"))
    text = "abc EN"
    assert m.find(text, 0) is None and m.safe(text) == len(text) - 2  # "EN" may begin END
    text += "D tail"
    assert m.find(text, 6) == 4  # found though it began before the new text
    assert StopMatcher(()).safe("xyz") == 3 and StopMatcher(("a", "bb")).find("xbba", 0) == 1


@pytest.fixture(scope="module")
def tokenizer():
    return smol()[1]


@pytest.mark.parametrize(
    "text",
    [
        "Zürich café — naïve résumé",
        "日本語のテキスト, 中文",
        "emoji 🙂👍🏽 and 🇫🇷 flags",
        " leading  spaces\nand lines",
    ],
)
def test_streamed_text_is_whole_characters_and_equals_the_text_decoded_whole(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = tokenizer("Say:", add_special_tokens=False)["input_ids"]
    d = Detokenizer(tokenizer, prompt)
    pieces = [d.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert all("\ufffd" not in p for p in pieces)  # never half a character
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    split = any("\ufffd" in tokenizer.decode([t]) for t in ids)  # a character over tokens
    assert split or "emoji" not in text  # the emoji case does spread characters
    if split:
        assert any(p == "" for p in pieces[:-1])  # held back until whole
