"""Several models in one server on one KV budget (vmcache/server/fleet.py, keeper.py,
served.py): routing by the ``model`` field, one budget a model alone may fill, a fair share
under a simultaneous peak, no failure when the budget runs out, idle prefix pages yielding to
another model's sequences, sleep and wake, and bad input. Real HTTP, the ``openai`` client,
the ledger read as ``vmcache-kv`` reads it (tests/multi_cases.py)."""

import json
import os
import threading
import time

import openai
import pytest
from multi_cases import (
    MIB,
    Sampler,
    burst,
    client,
    complete,
    held_mib,
    metric,
    prompt,
    query,
    start_multi,  # fmt: skip
)
from server_cases import http, root

from vmcache.sequences.invariants import check_invariants


@pytest.fixture(scope="module", params=["vm", "paged"])
def pair(real, request):
    with start_multi(real, ("a", "b"), "--cache", request.param, "--kv-budget-mib", "8") as r:
        yield r


def test_requests_route_by_model_and_an_unknown_one_is_a_404(pair):
    c = client(pair)
    listed = c.models.list().data
    assert [m.id for m in listed] == ["a", "b"] and all(m.root == "tiny" for m in listed)
    assert c.models.retrieve("b").id == "b"
    ids = prompt(0, 40)
    a, b = complete(pair, "a", ids, 8), complete(pair, "b", ids, 8)
    assert a.model == "a" and b.model == "b"
    assert a.choices[0].text == b.choices[0].text  # the same weights under two names
    with pytest.raises(openai.NotFoundError) as e:
        complete(pair, "c", ids, 2)
    assert e.value.body["code"] == "model_not_found" and "'a'" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("c")
    text = http("GET", root(pair) + "/metrics")[1]
    assert 'vmcache:generation_tokens_total{model_name="a"} 8.0' in text
    assert 'vmcache:generation_tokens_total{model_name="b"} 8.0' in text


def test_a_model_alone_may_use_the_whole_budget_and_a_shortage_fails_nothing(pair):
    # 10 sequences of 400 tokens: 12.5 MiB wanted from an 8 MiB budget, model a alone
    sampler = Sampler(pair)
    out = burst(pair, [("a", prompt(i, 300), 100) for i in range(10)])
    sampler.stop()
    assert [o.usage.completion_tokens for o in out] == [100] * 10
    assert sampler.peak["a"] > 6.0  # most of the 8 MiB: b's floor (1.5 MiB) aside
    assert sampler.total_peak <= 8.0
    assert metric(pair, "num_preemptions_total", "b") == 0


def test_under_a_simultaneous_peak_each_model_gets_a_fair_share(pair):
    # both models ask for 10 sequences of 400 tokens (12.5 MiB each) at once: the ledger
    # keeps each to max(floor, 8 MiB / 2) while the other wants pages; neither starves
    sampler = Sampler(pair)
    jobs = [(m, prompt(i, 300), 100) for i in range(10) for m in ("a", "b")]
    out = burst(pair, jobs)
    sampler.stop()
    assert all(o.usage.completion_tokens == 100 for o in out)
    assert sampler.total_peak <= 8.0
    for m in ("a", "b"):
        assert sampler.peak[m] >= 4.0 - 1.0, sampler.peak  # its share, within a chunk


@pytest.mark.parametrize("cache", ["vm", "paged"])
def test_idle_prefix_pages_yield_to_another_models_sequences(real, cache):
    # a caches a 1,000-token prompt (about 3 MiB of prefix pages) and goes idle; then b needs
    # 7.5 MiB of a 10 MiB budget: it gets them only if a's cached pages go, and they go
    # before b preempts anything
    flags = ("--kv-budget-mib", "10", "--kv-floor-mib", "a=0.5", "--kv-floor-mib", "b=0.5",
             "--max-seq-len", "1100", "--cache", cache)  # fmt: skip
    with start_multi(real, ("a", "b"), *flags) as r:
        complete(r, "a", prompt(99, 1000), 4)
        time.sleep(0.6)  # the loop's snapshot is at most state_every_s old when idle
        cached = metric(r, "kv_pages_prefix_idle", "a")
        assert cached >= 40 and held_mib(r)["a"] > 2.5
        out = burst(r, [("b", prompt(i, 300), 100) for i in range(6)])
        assert all(o.usage.completion_tokens == 100 for o in out)
        # a yields at its next check (every 0.1 s): b's first refusals may come before it (a
        # loaded run preempted once, a fresh clone's `make test` once); without the yield
        # rule b preempted 20 times
        assert metric(r, "num_preemptions_total", "b") <= 2
        assert r.server.models["a"].keeper.yielded_pages >= 40
        time.sleep(0.6)
        assert metric(r, "kv_pages_prefix_idle", "a") < cached
        for m in ("a", "b"):
            query(r, m, lambda e: check_invariants(e.kv))


def mapped(address: int) -> bool:
    """Whether any mapping of this process holds ``address`` (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def resident_bytes() -> int:
    """This process's memory: anonymous pages resident (torch's tensors: PagedKVCache's
    blocks) plus the memory its memfds hold (VMKVCache's pages on the host: a page whose
    sequence ended is no longer mapped, so no RSS counts it, but it is held until released)."""
    with open("/proc/self/status") as f:
        anon = next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))
    memfd = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:vmcache"):
                memfd += os.fstat(int(fd)).st_blocks * 512
        except OSError:
            pass
    return anon + memfd


@pytest.mark.parametrize("cache", ["vm", "paged"])
def test_sleep_gives_the_kv_memory_back_and_wake_answers_the_same(real, cache):
    with start_multi(real, ("a", "b"), "--cache", cache, "--kv-budget-mib", "24") as r:
        ids = prompt(5, 400)
        before = complete(r, "a", ids, 16).choices[0].text
        burst(r, [("a", prompt(i, 400), 60) for i in range(12)])  # pages created: ~17 MiB
        # the K/V the model's pages hold now (its prefix index's: written, so resident)
        kv_bytes = query(r, "a", lambda e: e.kv.capacity.used_pages * e.kv.config.page_bytes)
        assert kv_bytes >= 4 * MIB
        code, body = http("GET", root(r) + "/is_sleeping?model=a")
        assert (code, json.loads(body)) == (200, {"is_sleeping": False})
        rss = resident_bytes()
        code, body = http("POST", root(r) + "/sleep?model=a&level=1")
        assert code == 200 and json.loads(body)["freed_bytes"] >= kv_bytes
        assert rss - resident_bytes() >= kv_bytes, (rss, resident_bytes(), kv_bytes)
        assert json.loads(http("GET", root(r) + "/is_sleeping?model=a")[1])["is_sleeping"]
        assert not json.loads(http("GET", root(r) + "/is_sleeping?model=b")[1])["is_sleeping"]
        if cache == "vm":
            assert held_mib(r)["a"] == 0
        assert complete(r, "a", ids, 16).choices[0].text == before  # woken by the request
        assert not json.loads(http("GET", root(r) + "/is_sleeping?model=a")[1])["is_sleeping"]
        assert http("POST", root(r) + "/sleep?model=b&level=1")[0] == 200
        assert http("POST", root(r) + "/wake_up?model=b")[0] == 200
        assert complete(r, "b", ids, 16).choices[0].text == before


def test_a_model_idle_for_sleep_after_s_sleeps_and_its_next_request_wakes_it(real):
    with start_multi(real, ("a", "b"), "--sleep-after-s", "0.5") as r:
        ids = prompt(3, 200)
        before = complete(r, "a", ids, 12).choices[0].text
        deadline = time.monotonic() + 10
        while not r.server.models["a"].is_sleeping:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert held_mib(r)["a"] == 0
        assert complete(r, "a", ids, 12).choices[0].text == before
        assert r.server.models["a"].keeper.wakes == 1


def test_sleep_and_model_errors_are_the_apis_and_change_nothing(pair):
    for method, path, code in (("POST", "/sleep?model=c", 404), ("POST", "/sleep", 400),
                               ("POST", "/sleep?model=a&level=3", 400),
                               ("GET", "/is_sleeping?model=zz", 404),
                               ("POST", "/wake_up?model=c", 404)):  # fmt: skip
        status, body = http(method, root(pair) + path)
        assert status == code and "error" in json.loads(body), (path, body)
    assert not pair.server.models["a"].is_sleeping
    assert complete(pair, "a", prompt(1, 20), 2).usage.completion_tokens == 2


def test_a_busy_model_refuses_to_sleep_with_409(pair):
    t = threading.Thread(target=complete, args=(pair, "a", prompt(7, 100), 400))
    t.start()
    deadline = time.monotonic() + 10
    while not query(pair, "a", lambda e: len(e.scheduler.running)):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    status, body = http("POST", root(pair) + "/sleep?model=a")
    t.join()
    assert status == 409 and json.loads(body)["error"]["code"] == "model_busy", body
    assert not pair.server.models["a"].is_sleeping


def test_sleep_level_2_drops_the_weights_and_wake_loads_them_again(tmp_path):
    from real_model import tiny_chat_checkpoint

    from vmcache.server.cli import Running, build_server, parse_args

    directory = tiny_chat_checkpoint(tmp_path / "tiny")
    args = parse_args(["--model", f"a={directory}", "--model", f"b={directory}",
                       "--kv-budget-mib", "8", "--max-seq-len", "512", "--no-compile"])  # fmt: skip
    with Running(build_server(args)[0]) as r:
        ids = prompt(4, 64)
        before = complete(r, "a", ids, 12).choices[0].text
        weights = query(r, "a", lambda e: sum(p.numel() * 4 for p in e.runner.model.parameters()))
        # the embedding (37.7 of the 41.3 MB) is one allocation of its own: its middle byte
        emb = query(r, "a", lambda e: e.runner.model.get_input_embeddings().weight)
        middle = emb.data_ptr() + emb.numel() * emb.element_size() // 2
        del emb
        assert mapped(middle)
        rss = resident_bytes()
        status, body = http("POST", root(r) + "/sleep?model=a&level=2")
        assert status == 200 and json.loads(body)["freed_bytes"] >= weights
        assert not mapped(middle)  # given back to the OS whole
        # and the process's resident memory fell by at least half the weights: the layers'
        # small tensors leave glibc's heap as fragmentation allows, and other threads
        # allocate meanwhile (fresh clones' runs: 36.9 and 30.2 of the 41.3 MB)
        assert rss - resident_bytes() >= weights * 0.5
        assert query(r, "a", lambda e: sum(p.numel() for p in e.runner.model.parameters())) == 0
        assert complete(r, "b", ids, 12).choices[0].text == before  # b keeps its own weights
        assert complete(r, "a", ids, 12).choices[0].text == before  # loaded again on wake


def test_sleep_level_2_is_refused_without_a_source_to_load_from(pair):
    status, body = http("POST", root(pair) + "/sleep?model=a&level=2")
    assert status == 400 and "level 2" in json.loads(body)["error"]["message"]
    assert not pair.server.models["a"].is_sleeping


def test_streaming_logprobs_and_abort_on_disconnect_hold_for_the_second_model(pair):
    c = client(pair)
    kw = dict(model="b", prompt=prompt(2, 30), max_tokens=10, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})  # fmt: skip
    whole = c.completions.create(**kw).choices[0]
    pieces = list(c.completions.create(**kw, stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == whole.text
    streamed = [lp for p in pieces if p.choices and p.choices[0].logprobs
                for lp in p.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert streamed == pytest.approx(whole.logprobs.token_logprobs, abs=1e-4)
    stream = c.completions.create(model="b", prompt=prompt(3, 30), max_tokens=400, stream=True,
                                  temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client goes away mid-stream: b's request is aborted, pages back
    deadline = time.monotonic() + 30
    while query(pair, "b", lambda e: len(e.kv.sequences)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert query(pair, "b", lambda e: e.stats.aborted_requests) >= 1


def test_a_model_alone_on_a_budget_keeps_its_idle_prefix_cache(real):
    with start_multi(real, ("a",), "--kv-budget-mib", "4", "--max-seq-len", "1100") as r:
        complete(r, "a", prompt(11, 1000), 2)  # most of the budget, cached
        cached = query(r, "a", lambda e: e.kv.prefix.index.reclaimable())
        assert cached >= 40
        time.sleep(1.0)  # ten checks while idle, nobody else there
        assert query(r, "a", lambda e: e.kv.prefix.index.reclaimable()) == cached
        assert r.server.models["a"].keeper.yielded_pages == 0
