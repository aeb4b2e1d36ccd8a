"""Clients that go away: a request abandoned before admission (queued behind full slots),
during its chunked prefill or mid-decode, streaming or not, is aborted within a step of the
disconnect and every page it held comes back (llama.cpp's ``test_cancel_request`` and
vLLM's ``test_request_cancellation``, on both caches). A raw socket, so the moment it
closes is the test's choice, not a client library's."""

import json
import socket
import time

import pytest
from real_model import QUESTIONS
from server_cases import MODEL, settled, start

MOMENTS = ["queued", "prefill", "decode"]


@pytest.fixture(scope="module", params=["vm", "paged"])
def srv(real, request):
    # two slots; 32-token prefill chunks, so a long prompt's prefill spans many steps
    with start(real, "--cache", request.param, "--max-seqs", "2",
               "--max-batch-tokens", "32") as running:  # fmt: skip
        yield running


def post(running, body: dict) -> socket.socket:
    """A completion request sent on a raw socket left open (nothing read)."""
    raw = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", running.port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))  # fmt: skip
    return s


def look(running, fn):
    return running.server.loop.query(fn, timeout_s=30)


def wait_for(running, fn, timeout_s=60.0):
    """Poll ``fn(engine)`` between steps until it is truthy; its value."""
    deadline = time.monotonic() + timeout_s
    while not (got := look(running, fn)):
        assert time.monotonic() < deadline, "the engine never got there"
        time.sleep(0.005)
    return got


def body(prompt: str, stream: bool) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("moment", MOMENTS)
def test_an_abandoned_request_is_aborted_within_a_step_pages_back(srv, moment, stream):
    holders = []
    try:
        abandon(srv, moment, stream, holders)
    finally:
        for s in holders:
            s.close()
    live, used, cached = settled(srv)
    assert live == 0 and used == cached  # only the prefix index holds pages


def abandon(srv, moment: str, stream: bool, holders: list) -> None:
    ids = lambda e: set(e.records.seqs)  # noqa: E731  the requests the engine holds
    before = look(srv, ids)
    if moment == "queued":  # both slots taken: the third request waits to be admitted
        holders += [post(srv, body(q, True)) for q in QUESTIONS[:2]]
        wait_for(srv, lambda e: len(e.scheduler.running) == 2)
        before = look(srv, ids)
    prompt = " ".join([QUESTIONS[0]] * (40 if moment == "prefill" else 1))
    sock = post(srv, body(prompt, stream))
    rid = wait_for(srv, lambda e: next(iter(ids(e) - before), None))
    seq = lambda e: e.records.seqs[rid][0]  # noqa: E731
    if moment == "queued":
        assert look(srv, lambda e: seq(e).status.value) == "waiting"
    elif moment == "prefill":
        wait_for(srv, lambda e: 0 < seq(e).cached < len(seq(e).tokens) - 32)
    else:
        wait_for(srv, lambda e: len(seq(e).generated) >= 5)
    sock.close()
    at_close = look(srv, lambda e: e.stats.steps)
    gone = wait_for(srv, lambda e: rid not in e.records.seqs and (e.stats.steps,), 30)[0]
    assert gone - at_close <= 2, f"aborted {gone - at_close} steps after the client left"
