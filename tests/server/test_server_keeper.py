"""A model's keeper under faults (vmcache/server/keeper.py, served.py, loop.py): a sleep the
ledger cannot record leaves the model awake and serving, wake promises the floor within the
limit the ledger has now, a sleep that times out is cancelled (it never sleeps the model
later), ``--sleep-level 2`` with a compiled step is refused at start, and a ledger deleted or
replaced by a symbolic link while models serve fails no request. Real servers, real ledgers."""

import os
import threading
import time

import pytest
from multi_cases import complete, held_mib, prompt, query, start_multi
from server_cases import BASE

from vmcache.memory.ledger_admin import read, set_limit
from vmcache.server.cli import build_server, parse_args
from vmcache.server.protocol import APIError


def until(cond, timeout_s=10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def row(running, name):
    return next(h for h in read(running.server.ledger.path).holders if h.name == name)


@pytest.mark.parametrize("cache", ["vm", "paged"])
def test_a_sleep_the_ledger_refuses_leaves_the_model_awake_and_serving(real, cache, tmp_path):
    """The ledger replaced by a symbolic link: the sleep's ledger write is refused, so the
    sleep is undone (it used to leave the cache asleep and the keeper awake: every later
    request failed, "the cache is asleep", and neither sleep nor wake could mend it)."""
    with start_multi(real, ("a", "b"), "--cache", cache) as r:
        ids = prompt(2, 150)
        before = complete(r, "a", ids, 8).choices[0].text
        path = r.server.ledger.path
        os.rename(path, path + ".real")
        os.symlink(tmp_path / "elsewhere.db", path)
        try:
            with pytest.raises(APIError) as err:
                r.server.models["a"].sleep(1)
            assert err.value.status == 503 and "symbolic link" in err.value.message
            assert not r.server.models["a"].is_sleeping
            assert not query(r, "a", lambda e: e.kv.elastic.asleep)
            assert complete(r, "a", ids, 8).choices[0].text == before  # serves on
        finally:
            os.unlink(path)
            os.rename(path + ".real", path)
        assert r.server.models["a"].sleep(1) >= 0 and r.server.models["a"].is_sleeping
        assert complete(r, "a", ids, 8).choices[0].text == before  # woken by the request
        assert not row(r, "a").asleep


def test_wake_promises_the_floor_within_the_limit_set_while_asleep(real):
    """A limit lowered below the floor while the model slept: the wake used to cap the
    floor with the limit it had read before, got a ValueError, swallowed it, and the model
    ran with no floor at all. Now its floor is the new limit."""
    with start_multi(real, ("a", "b")) as r:
        floor = row(r, "a").min_pages
        assert floor > 0
        r.server.models["a"].sleep(1)
        assert row(r, "a").min_pages == 0 and row(r, "a").asleep
        set_limit(r.server.ledger.path, "a", floor // 2)
        r.server.models["a"].wake()
        a = row(r, "a")
        assert a.min_pages == floor // 2 and a.max_pages == floor // 2 and not a.asleep
        set_limit(r.server.ledger.path, "a", floor * 4)  # raised: the next tick promises all
        until(lambda: row(r, "a").min_pages == floor)


def test_a_sleep_that_times_out_is_cancelled_and_never_sleeps_the_model_later(real):
    """The engine thread busy past the sleep's deadline: a 503 that says nothing changed,
    and the sleep is not run when the thread frees (it used to answer 500, then sleep)."""
    with start_multi(real, ("a", "b")) as r:
        served = r.server.models["a"]
        served.sleep_timeout_s = 0.3
        busy = threading.Thread(target=query, args=(r, "a", lambda e: time.sleep(1.5)))
        busy.start()
        time.sleep(0.1)
        with pytest.raises(APIError) as err:
            served.sleep(1)
        assert err.value.status == 503 and "nothing changed" in err.value.message
        busy.join()
        time.sleep(0.3)
        assert not served.is_sleeping and served.keeper.sleeps == 0
        assert complete(r, "a", prompt(1, 20), 2).usage.completion_tokens == 2


def test_sleep_level_2_with_a_compiled_step_is_refused_at_start(real):
    """It used to start, then refuse every sleep on the engine thread every 0.1 s in
    silence: the model never slept."""
    base = [f for f in BASE if f != "--no-compile"]
    flags = [*base, "--model", "a=tiny", "--kv-budget-mib", "8", "--max-seq-len", "512"]
    with pytest.raises(ValueError, match="--sleep-level 2 drops the weights.*--no-compile"):
        build_server(parse_args([*flags, "--compile", "--sleep-level", "2"]), *real)
    eager = parse_args([*flags, "--no-compile", "--sleep-level", "2"])
    server, _ = build_server(eager, *real)
    server.close()


@pytest.mark.parametrize("fault", ["deleted", "symlink"])
def test_a_ledger_lost_while_two_models_serve_fails_no_request(real, fault, tmp_path):
    """The ledger deleted (rebuilt from the models' own accounts) or replaced by a symbolic
    link (refused: the models serve on with what they hold, then re-register once it is a
    file again): every request answered, the same tokens, the ledger's sum equal to the
    models' own accounts afterwards."""
    with start_multi(real, ("a", "b")) as r:
        ids = [prompt(i, 120) for i in range(4)]
        before = [complete(r, "ab"[i % 2], p, 6).choices[0].text for i, p in enumerate(ids)]
        path = r.server.ledger.path
        os.unlink(path)
        if fault == "symlink":
            os.symlink(tmp_path / "elsewhere.db", path)
        after = [complete(r, "ab"[i % 2], p, 6).choices[0].text for i, p in enumerate(ids)]
        assert after == before
        if fault == "symlink":
            assert all(s.keeper.budget.faults for s in r.server.models.values())
            os.unlink(path)
        for s in r.server.models.values():
            s.keeper.budget.beat()  # (its keepalive thread does this within a second)
        accounts = {n: s.keeper.budget.held for n, s in r.server.models.items()}
        view = read(path)
        assert {h.name: h.held_pages for h in view.holders} == accounts
        assert sum(held_mib(r).values()) * 2**20 == view.held_pages * view.unit_bytes


def test_a_wake_that_has_begun_and_runs_past_its_deadline_says_so(tmp_path):
    """A call that had begun on the engine thread and ran past the second wait was answered
    as "not begun; nothing changed" while it went on and took effect: now a 504 that says it
    is still running, and it completes."""
    from real_model import tiny_chat_checkpoint

    from vmcache.server.cli import Running

    directory = tiny_chat_checkpoint(tmp_path / "tiny")
    args = parse_args(["--model", f"a={directory}", "--kv-budget-mib", "8", "--max-seq-len",
                       "512", "--no-compile"])  # fmt: skip
    with Running(build_server(args)[0]) as r:
        served = r.server.models["a"]
        served.sleep(2)  # the weights dropped: a wake loads them again (about a second)
        served.sleep_timeout_s = 0.05
        with pytest.raises(APIError) as err:
            served.wake()
        assert err.value.status == 504 and err.value.code == "in_progress"
        until(lambda: not served.is_sleeping)  # it went on, as it said
        served.sleep_timeout_s = 30
        assert complete(r, "a", prompt(1, 20), 2).usage.completion_tokens == 2
