"""What OpenAI clients and evaluation harnesses rely on beyond text, through the official
``openai`` client (raw HTTP where it hides the wire), on both caches with a random 2-layer
model of the embedded model's family, tokenizer and chat template (``real_model.tiny_chat``):
log-probabilities equal to the model's teacher-forced ones (chat and completions, streamed and
whole), echo with the prompt's log-probabilities (the payload
lm-evaluation-harness's ``local-completions`` sends), several prompts in one request,
penalties and logit bias equal to a plain reference, a role chunk per choice when streaming
n > 1, usage in every chunk on request, templates' own roles, CORS off unless origins are
named, and OpenAI's errors for a wrong key or a form body."""

import json
import time
import urllib.request

import pytest
import torch
from engine_cases import penalized_greedy
from real_model import QUESTIONS, SYSTEM, generate
from server_cases import MODEL, client, http, root, settled, start, unlabelled

PROMPT = "The three primary colors are"


@torch.no_grad()
def teacher_forced(model, ids) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def post(running, route: str, body: dict) -> dict:
    status, text = http("POST", f"{running.url}/{route}", json.dumps(body).encode())
    assert status == 200, text
    return json.loads(text)


def test_completion_logprobs_are_the_models_own(srv, real):
    model, tok = real
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    want = generate(model, ids, 6, eos_token_id=None)
    lp = teacher_forced(model, [*ids, *want])[len(ids) - 1 : -1]
    r = client(srv).completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                       temperature=0, logprobs=3)  # fmt: skip
    got = r.choices[0].logprobs
    assert got.tokens == [tok.decode([t]) for t in want]
    assert got.token_logprobs == pytest.approx([float(lp[i, t]) for i, t in enumerate(want)],
                                               abs=1e-4)  # fmt: skip
    for top, row, value in zip(got.top_logprobs, lp, got.token_logprobs):
        assert 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(value)  # greedy
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(
            row.topk(3).values.tolist(), abs=1e-4)  # fmt: skip
    assert got.text_offset[0] == 0 and "".join(got.tokens) == r.choices[0].text


def test_echo_gives_the_prompts_logprobs_as_lm_eval_asks(srv, real):
    model, tok = real
    prompts = [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS[:2]]
    # lm-evaluation-harness's local-completions log-likelihood payload, batched
    payload = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1,
               "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    r = post(srv, "completions", payload)
    assert [c["index"] for c in r["choices"]] == [0, 1]
    for choice, ids in zip(r["choices"], prompts):
        lp = teacher_forced(model, ids)
        got = choice["logprobs"]
        assert len(got["tokens"]) == len(ids) + 1 and got["token_logprobs"][0] is None
        assert got["top_logprobs"][0] is None
        want = [float(lp[i - 1, t]) for i, t in enumerate(ids) if i]
        assert got["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=1e-4)
        assert choice["text"].startswith(tok.decode(ids))
    assert r["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert r["usage"]["completion_tokens"] == 2
    only = post(srv, "completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 0,
                                     "echo": True, "logprobs": 0})  # fmt: skip
    choice = only["choices"][0]
    assert choice["text"] == PROMPT and only["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == only["usage"]["prompt_tokens"]
    assert settled(srv)[0] == 0


def test_chat_logprobs_streamed_equal_whole(srv):
    c = client(srv)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=8,
              temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    whole = c.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    assert "".join(e.token for e in content) == whole.message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
               for e in content)  # fmt: skip
    assert all(bytes(e.bytes).decode() == e.token for e in content)
    streamed = [e for ch in c.chat.completions.create(**kw, stream=True) for chc in ch.choices
                if chc.logprobs for e in chc.logprobs.content]  # fmt: skip
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content]  # fmt: skip


def test_several_prompts_in_one_request_are_choices_in_order(srv):
    c = client(srv)
    alone = [c.completions.create(model=MODEL, prompt=q, max_tokens=6, temperature=0)
             for q in QUESTIONS[:3]]  # fmt: skip
    both = c.completions.create(model=MODEL, prompt=QUESTIONS[:3], max_tokens=6, temperature=0,
                                n=2)  # fmt: skip
    assert [ch.index for ch in both.choices] == list(range(6))
    assert [ch.text for ch in both.choices] == [a.choices[0].text for a in alone for _ in "ab"]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # once each
    texts = {}
    for ch in c.completions.create(model=MODEL, prompt=QUESTIONS[:3], max_tokens=6,
                                   temperature=0, stream=True):  # fmt: skip
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {k: a.choices[0].text for k, a in enumerate(alone)}


def test_penalties_and_bias_equal_a_plain_reference(srv, real):
    model, tok = real
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    greedy = generate(model, ids, 1, eos_token_id=None)[0]
    cases = [({"frequency_penalty": 1.2, "presence_penalty": 0.4}, dict(freq=1.2, pres=0.4)),
             ({"logit_bias": {str(greedy): -100}}, dict(bias={greedy: -100}))]  # fmt: skip
    for body, ref in cases:
        r = post(srv, "completions", {"model": MODEL, "prompt": ids, "max_tokens": 8,
                                      "temperature": 0, "ignore_eos": True, "logprobs": 0,
                                      **body})  # fmt: skip
        want = penalized_greedy(model, ids, 8, **ref)
        assert r["choices"][0]["logprobs"]["tokens"] == [tok.decode([t]) for t in want]
        assert r["choices"][0]["text"] == tok.decode(want)


def test_streaming_n_gives_every_choice_its_role_and_usage_on_request(srv):
    c = client(srv)
    chunks = list(c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTIONS[2]}], max_tokens=5, n=3,
        temperature=1.0, seed=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # fmt: skip
    with_choices = [ch for ch in chunks if ch.choices]
    assert all(len(ch.choices) == 1 for ch in with_choices)  # clients read choices[0]
    firsts = {}
    for ch in with_choices:
        firsts.setdefault(ch.choices[0].index, ch.choices[0].delta.role)
    assert firsts == {0: "assistant", 1: "assistant", 2: "assistant"}
    counts = [ch.usage.completion_tokens for ch in with_choices[3:]]
    assert counts == sorted(counts) and all(ch.usage is not None for ch in with_choices[3:])
    assert chunks[-1].usage.completion_tokens == counts[-1] == 15


def test_a_templates_own_role_is_served(srv):
    r = client(srv).chat.completions.create(
        model=MODEL, temperature=0, max_tokens=4,
        messages=[{"role": "user", "content": "What is 6 times 7?"},
                  {"role": "tool", "content": "42"}])  # fmt: skip
    assert r.choices[0].message.content


def preflight(running, origin: str):
    req = urllib.request.Request(f"{running.url}/chat/completions", method="OPTIONS",
                                 headers={"Origin": origin,
                                          "Access-Control-Request-Method": "POST"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers.get("access-control-allow-origin")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("access-control-allow-origin")


def test_cors_is_off_unless_origins_are_named(srv, real):
    status, allowed = preflight(srv, "http://app.example")
    assert status != 200 and allowed is None
    with start(real, "--allowed-origins", "http://app.example") as running:
        assert preflight(running, "http://app.example") == (200, "http://app.example")
        assert preflight(running, "http://evil.example")[1] is None


def test_errors_for_a_wrong_key_and_a_form_body(srv, real):
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # curl -d's default
    req = urllib.request.Request(f"{srv.url}/completions", data=body, method="POST",
                                 headers=form)  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 415 and json.loads(e.value.read())["error"]["code"]
    with start(real, "--api-key", "k") as running:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{running.url}/models", timeout=30)
        err = json.loads(e.value.read())["error"]
        assert e.value.code == 401 and e.value.headers["WWW-Authenticate"] == "Bearer"
        assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
    assert http("GET", root(srv) + "/health")[0] == 200


def scrape(running) -> dict[str, float]:
    return unlabelled(http("GET", root(running) + "/metrics")[1])


def test_metrics_have_vllms_families_and_idle_prefix_pages_are_not_usage(srv, real):
    tok = real[1]
    ids = tok(SYSTEM, add_special_tokens=False)["input_ids"]  # whole pages to index: 600 tokens
    before = scrape(srv)
    post(srv, "completions", {"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0,
                              "ignore_eos": True, "n": 2})  # fmt: skip
    after = scrape(srv)
    grew = lambda name: after[f"vmcache:{name}"] - before.get(f"vmcache:{name}", 0)  # noqa: E731
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_max_num_generation_tokens",
                 "request_params_n", "request_params_max_tokens"):  # fmt: skip
        assert grew(f"{name}_count") == 1, name
    assert grew("request_prompt_tokens_sum") == len(ids)
    assert grew("request_generation_tokens_sum") == 12 and grew("request_params_n_sum") == 2
    assert grew("request_params_max_tokens_sum") == 6
    assert grew("inter_token_latency_seconds_count") == 5  # six tokens, five gaps
    assert grew("iteration_tokens_total_sum") >= len(ids) + 12 - 1
    assert grew("iteration_tokens_total_count") >= 6
    info = [k for k in after if k.startswith("vmcache:cache_config_info{")]
    assert len(info) == 1 and 'prefix_caching="true"' in info[0] and "max_seqs=" in info[0]
    assert settled(srv)[0] == 0
    time.sleep(0.6)  # the loop's snapshot is at most state_every_s old when idle
    idle = scrape(srv)
    assert idle["vmcache:kv_pages_used"] > 0 and idle["vmcache:kv_pages_prefix_idle"] > 0
    assert idle["vmcache:kv_cache_usage_perc"] == 0.0  # nothing runs: the pages are evictable


def test_a_repeated_217_token_prompt_hits_at_least_208(srv, real):
    ids = real[1](SYSTEM, add_special_tokens=False)["input_ids"][:217]  # less than a VM block
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0}
    first, again = post(srv, "completions", body), post(srv, "completions", body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 208
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_stop_reason_and_matched_stop_say_what_stopped_a_choice(srv):
    # (vLLM's stop_reason: the stop string or token id, None at EOS or length; SGLang's
    # matched_stop: the same, and the EOS id at EOS)
    ids = list(range(1000, 1020))
    base = {"model": MODEL, "prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    free = post(srv, "completions", {**base, "logprobs": 0, "return_tokens_as_token_ids": True})
    choice = free["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], choice["matched_stop"]) == (
        "length", None, None)  # fmt: skip
    tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    assert len(tokens) == 12
    by_id = post(srv, "completions", {**base, "stop_token_ids": [tokens[4]]})["choices"][0]
    assert (by_id["finish_reason"], by_id["stop_reason"], by_id["matched_stop"]) == (
        "stop", tokens[4], tokens[4])  # fmt: skip
    text = choice["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    by_text = post(srv, "completions", {**base, "stop": [stop]})["choices"][0]
    assert (by_text["finish_reason"], by_text["stop_reason"], by_text["matched_stop"]) == (
        "stop", stop, stop)  # fmt: skip
    assert by_text["text"] == text[: text.index(stop)]
    chunks = http("POST", f"{srv.url}/completions",
                  json.dumps({**base, "stop": [stop], "stream": True}).encode())[1]  # fmt: skip
    last = [json.loads(c[6:]) for c in chunks.split("\n\n") if c.startswith("data: {")][-1]
    assert last["choices"][0]["stop_reason"] == stop


def test_return_tokens_as_token_ids_names_every_token_by_its_id(srv, real):
    tok = real[1]
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5,
            "temperature": 0, "logprobs": 2, "echo": True,
            "return_tokens_as_token_ids": True}  # fmt: skip
    lp = post(srv, "completions", body)["choices"][0]["logprobs"]
    prompt_ids = tok("The capital of France is", add_special_tokens=False)["input_ids"]
    assert lp["tokens"][: len(prompt_ids)] == [f"token_id:{t}" for t in prompt_ids]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"][1:] for k in top)
    chat = post(srv, "chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "temperature": 0, "logprobs": True, "top_logprobs": 1,
        "return_tokens_as_token_ids": True})["choices"][0]["logprobs"]["content"]  # fmt: skip
    assert all(c["token"].startswith("token_id:") for c in chat)
    assert all(t["token"].startswith("token_id:") for c in chat for t in c["top_logprobs"])
    assert (
        http(
            "POST",
            f"{srv.url}/completions",
            json.dumps({**body, "return_tokens_as_token_ids": "yes"}).encode(),
        )[0]
        == 400
    )
