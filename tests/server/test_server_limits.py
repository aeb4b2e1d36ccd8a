"""A model's KV limit read and changed while it serves, from the command line over the ledger
(``vmcache-kv``, run as a user runs it), and what the server refuses at start: floors that do
not fit, repeated names, a ledger owned by another user or damaged (nothing changed)."""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from multi_cases import Sampler, burst, held_mib, prompt, query, start_multi
from server_cases import BASE

from vmcache.memory.ledger import LedgerError
from vmcache.memory.ledger_admin import read
from vmcache.server.cli import build_server, parse_args

KV = os.path.join(os.path.dirname(sys.executable), "vmcache-kv")


def kv(*args) -> subprocess.CompletedProcess:
    return subprocess.run([KV, *args], capture_output=True, text=True, timeout=60)


def until(cond, timeout_s=10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_limit_lowered_with_preemption_and_raised_while_serving(real):
    with start_multi(real, ("a", "b"), "--kv-budget-mib", "8") as r:
        path = r.server.ledger.path
        shown = json.loads(kv("--ledger", path, "show", "--json").stdout)
        assert [m["name"] for m in shown["models"]] == ["a", "b"]
        assert shown["total_bytes"] == 8 << 20 and shown["models"][0]["floor_bytes"] == 24 << 16
        with ThreadPoolExecutor(1) as pool:
            # 16 requests: enough still queued when the limit is raised again to grow into
            # (with 10, a loaded run raised it with two left, and a peaked at exactly 3 MiB)
            done = pool.submit(burst, r, [("a", prompt(i, 300), 100) for i in range(16)])
            until(lambda: held_mib(r)["a"] > 4)
            out = kv("--ledger", path, "set-limit", "a", "2", "--preempt")
            assert out.returncode == 0 and "a " in out.stdout, out.stderr
            until(lambda: held_mib(r)["a"] <= 2, timeout_s=5)  # preempted down to it
            # by the keeper's shedding (its 0.1 s check) or, when a step comes first, by the
            # engine's own preemption at the lowered limit (a fresh clone's run: the engine)
            shed = r.server.models["a"].keeper.shed_sequences
            own = query(r, "a", lambda e: e.stats.preempt_recompute + e.stats.preempt_swap)
            assert shed + own >= 1
            time.sleep(0.3)
            assert held_mib(r)["a"] <= 2  # and kept there while it serves
            sampler = Sampler(r)
            assert kv("--ledger", path, "set-limit", "a", "8").returncode == 0
            results = done.result(timeout=120)
            sampler.stop()
        assert [o.usage.completion_tokens for o in results] == [100] * 16  # none lost
        assert sampler.peak["a"] > 3  # grew again once raised


def test_a_limit_lowered_without_preemption_holds_once_sequences_end(real):
    with start_multi(real, ("a", "b"), "--kv-budget-mib", "8") as r:
        path = r.server.ledger.path
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(burst, r, [("a", prompt(i, 300), 100) for i in range(6)])
            until(lambda: held_mib(r)["a"] > 4)
            assert kv("--ledger", path, "set-limit", "a", "2").returncode == 0
            results = done.result(timeout=120)
        assert r.server.models["a"].keeper.shed_sequences == 0
        assert all(o.usage.completion_tokens == 100 for o in results)
        until(lambda: held_mib(r)["a"] <= 2)
        table = kv("--ledger", path, "show").stdout
        assert "a " in table and "limit MiB" in table and "awake" in table


def test_a_limit_below_the_floor_or_for_no_model_is_refused(real):
    with start_multi(real, ("a", "b"), "--kv-budget-mib", "8") as r:
        path = r.server.ledger.path
        before = read(path)
        low = kv("--ledger", path, "set-limit", "a", "0.5")
        assert low.returncode == 1 and "below 'a''s floor" in low.stderr
        nobody = kv("--ledger", path, "set-limit", "zz", "4")
        assert nobody.returncode == 1 and "no holder named 'zz'" in nobody.stderr
        assert kv("--ledger", path + ".missing", "show").returncode == 1
        assert read(path) == before


def build(real, *flags):
    return build_server(parse_args([*BASE, "--max-seq-len", "512", *flags]), *real)


def test_what_the_server_refuses_at_start(real, tmp_path):
    with pytest.raises(ValueError, match="floor of 4.0 MiB does not fit"):
        build(real, "--model", "a=x", "--model", "b=x", "--kv-budget-mib", "6",
              "--kv-floor-mib", "a=4", "--kv-floor-mib", "b=4")  # fmt: skip
    for flags in (["--model", "a=x", "--model", "a=y"], ["--kv-floor-mib", "zz=1"],
                  ["--model", "a=x", "--model", "b=y", "--served-model-name", "c"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args([*BASE, *flags])
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"x" * 4096)
    with pytest.raises(LedgerError, match="junk.db"):
        build(real, "--kv-ledger", str(junk))
    assert junk.read_bytes() == b"x" * 4096  # nothing written
    theirs = tmp_path / "theirs.db"
    server, _ = build(real, "--model", "a=x", "--kv-ledger", str(theirs), "--kv-budget-mib", "4")
    server.close()
    with pytest.raises(ValueError, match="the ledger's total is 1024 pages, not 2048"):
        build(real, "--model", "a=x", "--kv-ledger", str(theirs), "--kv-budget-mib", "8")
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(theirs, 65534, 65534)
        with pytest.raises(LedgerError, match="owned by uid 65534"):
            build(real, "--model", "a=x", "--kv-ledger", str(theirs))


def test_a_ledger_damaged_while_models_serve_is_rebuilt_and_vmcache_kv_repairs_an_idle_one(
    real, tmp_path
):
    """8 KiB of garbage over the ledger while two models serve: it used to stop both engines
    for good (every request a 503) and ``vmcache-kv show`` offered no way back. Now the
    models rebuild it from their own accounts and answer the same; an idle damaged ledger
    is named with the command that recovers it, and that command does."""
    with start_multi(real, ("a", "b"), "--kv-budget-mib", "8") as r:
        path = r.server.ledger.path
        ids = [prompt(i, 100) for i in range(4)]
        before = burst(r, [("ab"[i % 2], p, 8) for i, p in enumerate(ids)])
        with open(path, "r+b") as f:
            f.write(os.urandom(8192))
        after = burst(r, [("ab"[i % 2], p, 8) for i, p in enumerate(ids)])
        assert [c.choices[0].text for c in after] == [c.choices[0].text for c in before]
        for s in r.server.models.values():
            s.keeper.budget.beat()  # (its keepalive thread does this within a second)
        view = read(path)
        assert {h.name: h.held_pages for h in view.holders} == {
            n: s.keeper.budget.held for n, s in r.server.models.items()
        }
        assert sum(s.keeper.budget.rebuilt for s in r.server.models.values()) == 1
    idle = tmp_path / "idle.db"
    from vmcache.memory.ledger import SharedBudget

    SharedBudget(idle, 100, unit_bytes=4096).close()
    idle.write_bytes(os.urandom(4096))
    shown = kv("--ledger", str(idle), "show")
    assert shown.returncode == 1 and f"vmcache-kv --ledger {idle} repair" in shown.stderr
    fixed = kv("--ledger", str(idle), "repair")
    assert fixed.returncode == 0 and "moved aside" in fixed.stdout and not idle.exists()
    again = kv("--ledger", str(idle), "repair")
    assert again.returncode == 1 and "no ledger" in again.stderr
