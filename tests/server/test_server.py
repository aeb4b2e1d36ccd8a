"""The OpenAI-compatible server, driven by the official ``openai`` client over loopback, on a
random 2-layer model with the embedded SmolLM2-135M-Instruct's tokenizer and chat template
(``real_model.tiny_chat``; the trained model behind the server: tests/models/test_real_model.py):
chat and completions equal to greedy ``generate``, streaming equal to whole answers, n > 1,
stop strings, concurrent streams each equal to its sequential answer, a client that
disconnects mid-stream (its pages back), every bad input a 4xx in OpenAI's error format with
the server still answering, prefix-cache hits reported as ``cached_tokens``, the API key, the
queue bound, and the metrics."""

import concurrent.futures
import json
import threading
import time

import openai
import pytest
from real_model import QUESTIONS, SYSTEM, generate, prompt
from server_cases import (
    MODEL,
    chat,
    client,
    http,
    oversized,
    root,
    settled,
    start,
    streamed,
    unlabelled,
)


def test_models_and_health(srv):
    c = client(srv)
    assert [m.id for m in c.models.list().data] == [MODEL]
    got = c.models.retrieve(MODEL)  # GET /v1/models/{id}
    assert got.id == MODEL and got.object == "model"
    status, body = http("GET", root(srv) + "/v1/models/no-such-model")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    assert json.loads(http("GET", root(srv) + "/health")[1]) == {"status": "ok"}


def test_chat_is_greedy_generate_and_streaming_equals_the_whole_answer(srv, real):
    model, tok = real
    c = client(srv)
    ids = prompt(tok, QUESTIONS[0])
    want = generate(model, ids, 24, eos_token_id=model.generation_config.eos_token_id)
    r = chat(c, QUESTIONS[0], max_tokens=24)
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert r.choices[0].finish_reason == ("stop" if want[-1] == 2 else "length")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
    texts, reasons, usage = streamed(c, QUESTIONS[0], max_tokens=24,
                                     stream_options={"include_usage": True})  # fmt: skip
    assert texts == {0: r.choices[0].message.content}
    assert reasons == {0: r.choices[0].finish_reason}
    assert usage.completion_tokens == r.usage.completion_tokens


def test_completions_stop_strings_and_n(srv):
    c = client(srv)
    full = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                temperature=0)  # fmt: skip
    text = full.choices[0].text
    assert text and full.choices[0].finish_reason == "length"
    stop = text.strip().split()[1]  # its second word: the text must end right before it
    cut = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                               temperature=0, stop=[stop, "zzzz"])  # fmt: skip
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)] and stop not in cut.choices[0].text
    chunks = list(
        c.completions.create(
            model=MODEL,
            prompt="The capital of France is",
            max_tokens=12,
            temperature=0,
            stop=[stop],
            stream=True,
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == cut.choices[0].text
    many = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3,
                                temperature=1.0, seed=3)  # fmt: skip
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2]
    assert len({ch.text for ch in many.choices}) > 1  # sampled apart
    assert many.usage.completion_tokens == 24  # 3 × 8, none stopped early at this seed
    again = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3,
                                 temperature=1.0, seed=3)  # fmt: skip
    assert [ch.text for ch in again.choices] == [ch.text for ch in many.choices]  # seeded
    fresh = [c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                  temperature=1.0).choices[0].text for _ in range(2)]  # fmt: skip
    assert fresh[0] != fresh[1]  # no seed: sampled afresh each time, as vLLM does
    low = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2,
                               temperature=1.0, seed=-(2**63))  # fmt: skip
    assert low.usage.completion_tokens == 2  # any int64 seed


def test_concurrent_streams_each_equal_their_sequential_answer(srv):
    c = client(srv)
    alone = [chat(c, q, max_tokens=16).choices[0].message.content for q in QUESTIONS[:4]]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda q: streamed(c, q, max_tokens=16)[0][0], QUESTIONS[:4]))
    assert together == alone


def test_a_client_gone_mid_stream_is_aborted_and_its_pages_come_back(srv):
    c = client(srv)
    stream = chat(c, QUESTIONS[2], max_tokens=400, stream=True,
                  extra_body={"ignore_eos": True})  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    live, used, cached = settled(srv)
    assert live == 0 and used == cached  # only the prefix index holds pages
    assert chat(c, QUESTIONS[3], max_tokens=4).choices[0].message.content  # still serving


def test_a_second_turn_on_a_long_system_prompt_reports_cached_tokens(srv):
    c = client(srv)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}]
    first = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": QUESTIONS[4]}]  # fmt: skip
    second = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached >= first.usage.prompt_tokens // 2


BAD = [  # (route, body, status, param)
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "max_tokens": 0}, 400, "max_tokens"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "n": 0}, 400, "n"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "temperature": 3}, 400, "temperature"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "top_p": 0}, 400, "top_p"),
    ("chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
     404, "model"),
    ("completions", {"model": MODEL, "prompt": "x " * 1200, "max_tokens": 4}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": [10**9], "max_tokens": 4}, 400, "prompt"),
]  # fmt: skip


@pytest.mark.parametrize("route,body,status,param", BAD)
def test_bad_input_is_a_4xx_in_openais_format_and_nothing_is_queued(srv, route, body, status,
                                                                     param):  # fmt: skip
    c = client(srv)
    with pytest.raises(openai.APIStatusError) as e:
        c.post(f"/{route}", body=body, cast_to=object)
    assert e.value.status_code == status
    err = e.value.body["error"] if "error" in e.value.body else e.value.body
    assert err["param"] == param and err["message"] and "type" in err and "code" in err
    assert settled(srv)[0] == 0
    assert chat(c, QUESTIONS[3], max_tokens=2).choices[0].message.content is not None


@pytest.mark.parametrize(
    "raw,status",
    [(b"{not json", 400), (b"[1, 2]", 400), (b"\xff\xfe", 400), ("declared", 413),
     ("chunked", 413)],
)  # fmt: skip
def test_malformed_bodies_and_unknown_routes(srv, raw, status):
    if isinstance(raw, str):
        code, text = oversized(srv, chunked=raw == "chunked")
    else:
        code, text = http("POST", f"{srv.url}/chat/completions", raw)
    assert code == status and set(json.loads(text)["error"]) == {"message", "type", "param",
                                                                 "code"}  # fmt: skip
    code, text = http("GET", f"{srv.url}/nothing-here")
    assert code == 404 and json.loads(text)["error"]["code"] == "not_found"
    assert http("GET", f"{srv.url}/chat/completions")[0] == 405


def test_metrics_are_prometheus_text_with_the_engines_figures(srv):
    chat(client(srv), QUESTIONS[5], max_tokens=4)
    text = http("GET", root(srv) + "/metrics")[1]
    values = unlabelled(text)
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped",
                 "kv_cache_usage_perc", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
                 "kv_pages_used", "cow_bytes_copied_total", "swap_bytes_total"):  # fmt: skip
        assert f"vmcache:{name}" in values, name
    assert values["vmcache:generation_tokens_total"] >= 4
    assert values["vmcache:prefix_cache_hits_total"] <= values["vmcache:prefix_cache_queries_total"]
    assert 0 <= values["vmcache:kv_cache_usage_perc"] <= 1


def test_a_scrape_does_not_wait_for_a_long_step(srv):
    # the engine thread busy for 4 s (as a long prefill keeps it): /metrics still answers,
    # from the snapshot the loop kept between steps, before the engine is free again
    busy = threading.Thread(target=srv.server.loop.query, args=(lambda e: time.sleep(4),),
                            kwargs={"timeout_s": 20})  # fmt: skip
    busy.start()
    time.sleep(0.3)
    code, text = http("GET", root(srv) + "/metrics")
    assert code == 200 and "vmcache:kv_pages_used" in text
    assert busy.is_alive()  # answered while the engine was still busy
    busy.join()


def test_the_api_key_is_enforced(real):
    with start(real, "--api-key", "s3cret") as running:
        with pytest.raises(openai.AuthenticationError) as e:
            client(running, key="wrong").models.list()
        assert e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            chat(client(running, key="wrong"), "hi", max_tokens=2)
        assert chat(client(running, key="s3cret"), "hi", max_tokens=2).choices


def test_a_full_queue_is_refused_at_once_and_the_next_request_served(real):
    with start(real, "--max-seqs", "1", "--max-waiting", "0") as running:
        c = client(running)
        long = chat(c, "Count to one hundred.", max_tokens=300, stream=True,
                    extra_body={"ignore_eos": True})  # fmt: skip
        next(iter(long))  # it runs
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as e:
            chat(c, "hi", max_tokens=2)
        assert time.monotonic() - t0 < 5 and e.value.body["code"] == "queue_full"
        long.close()
        assert settled(running)[0] == 0
        assert chat(c, "hi", max_tokens=2).choices[0].message.content is not None
        assert json.loads(http("GET", root(running) + "/health")[1]) == {"status": "ok"}
