"""The shared-budget ledger (vmcache/memory/ledger.py) under faults: bad requests, two budgets
in one process, a crash in the middle of an update, a process stopped holding the lock, a hung
holder whose lease runs out, a ledger deleted or damaged while in use."""

import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from vmcache.memory.ledger import LedgerError, SharedBudget


@pytest.fixture
def path(tmp_path):
    return tmp_path / "budget.db"


def held(b):
    return {h: r["held"] for h, r in b.snapshot()["holders"].items()}


def test_bad_requests_are_value_errors_and_change_nothing(path):
    b = SharedBudget(path, 10)
    assert b.acquire(3)
    for bad in (-5, 1.5, True, "2", None):
        with pytest.raises(ValueError):
            b.acquire(bad)
        with pytest.raises(ValueError):
            b.release(bad)
    with pytest.raises(ValueError):
        b.release(4)  # more than held
    assert b.held == 3 and held(b) == {b.id: 3}
    for kw in ({"lock_timeout_s": 0}, {"lease_s": -1}, {"min_pages": -1}, {"max_pages": 2.5}):
        with pytest.raises(ValueError):
            SharedBudget(path, **kw)
    assert held(b) == {b.id: 3}
    b.close()


def test_the_ledger_file_is_private(path):
    SharedBudget(path, 10).close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_two_budgets_in_one_process_are_two_holders(path):
    a, b = SharedBudget(path, 10), SharedBudget(path)
    assert a.acquire(6) and not b.acquire(5) and b.acquire(4)
    assert held(a) == {a.id: 6, b.id: 4}  # one row each, not one per pid
    a.release(6)
    assert held(b) == {a.id: 0, b.id: 4}
    a.close()
    assert held(b) == {b.id: 4} and b.acquire(6)
    b.close()


def _child(path, body: str, kw: str = "") -> subprocess.Popen:
    """A process with its own SharedBudget(path, kw) running ``body`` (prints 'ready')."""
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        from vmcache.memory.ledger import SharedBudget
        b = SharedBudget(sys.argv[1], {kw})
        """) + textwrap.dedent(body)  # fmt: skip
    p = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                         text=True)  # fmt: skip
    assert p.stdout.readline().strip() == "ready"
    return p


def test_a_crash_in_the_middle_of_an_update_leaves_the_ledger_as_it_was(path):
    """The old ledger truncated then wrote the file: a crash between left it empty or cut,
    and every process failed for good. An update is a transaction now."""
    mine = SharedBudget(path, 10)
    assert mine.acquire(2)
    p = _child(path, """
        assert b.acquire(3)
        b._db.execute("BEGIN IMMEDIATE")
        b._db.execute("UPDATE holders SET held = 99")
        b._db.execute("DELETE FROM meta")
        print("ready", flush=True)
        os._exit(9)  # dies mid-transaction
        """)  # fmt: skip
    p.wait(timeout=60)
    assert held(mine) == {mine.id: 2}  # the dead child's row reaped, nothing else touched
    assert mine.snapshot()["total_pages"] == 10 and mine.acquire(8)
    mine.close()


def test_a_process_stopped_holding_the_lock_blocks_others_only_until_the_timeout(path):
    mine = SharedBudget(path, 10, lock_timeout_s=0.5)
    assert mine.acquire(1)
    p = _child(path, """
        b._db.execute("BEGIN IMMEDIATE")
        print("ready", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        """)  # fmt: skip
    try:
        t0 = time.monotonic()
        with pytest.raises(LedgerError, match="lock") as err:
            mine.acquire(2)
        assert time.monotonic() - t0 < 5 and str(path) in str(err.value)
        assert mine.held == 1
    finally:
        p.kill()
        p.wait(timeout=60)
    assert mine.acquire(2) and held(mine) == {mine.id: 3}  # its row reaped, the lock free
    mine.close()


def test_a_hung_holder_loses_its_pages_when_its_lease_runs_out_and_rejoins_if_it_resumes(path):
    hung = SharedBudget(path, 10, lease_s=0.3)
    other = SharedBudget(path)
    assert hung.acquire(8) and not other.acquire(5)
    time.sleep(0.5)  # no sign of life from `hung` for longer than its lease
    assert other.acquire(5) and hung.id not in held(other)
    p = _child(path, """
        print("ready", flush=True)
        while True: time.sleep(0.05); b.beat()
        """, "lease_s=0.3")  # fmt: skip
    try:
        time.sleep(0.8)
        assert len(held(other)) == 2  # a holder that beats within its lease stays
    finally:
        p.kill()
        p.wait(timeout=60)
    assert hung.available() == 0  # it resumes: joins again with the 8 it still has
    assert hung.rejoined == 1 and held(other) == {hung.id: 8, other.id: 5}  # over: shown
    assert not other.acquire(1)  # nobody gets more until the total is kept again
    other.release(5)
    hung.release(8)
    assert other.acquire(10)
    hung.close()
    other.close()


def test_a_deleted_ledger_is_rebuilt_from_what_live_holders_hold(path):
    a = SharedBudget(path, 10)
    assert a.acquire(10)
    os.unlink(path)
    newcomer = SharedBudget(path, 10)  # a fresh ledger at the same path
    assert newcomer.acquire(4)  # it cannot know of `a` until `a` says so (docs/security.md)
    assert not a.acquire(1)  # a's next call re-registers its 10 in the new file
    assert a.rejoined == 1 and held(newcomer) == {a.id: 10, newcomer.id: 4}
    assert not newcomer.acquire(1)
    newcomer.release(4)
    a.release(3)
    assert newcomer.acquire(3) and not newcomer.acquire(1)
    a.close()
    newcomer.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "json"])
def test_a_damaged_ledger_is_refused_naming_the_file(path, damage):
    a = SharedBudget(path, 10)
    assert a.acquire(2)
    raw = path.read_bytes()
    new = {"garbage": os.urandom(len(raw)), "truncated": raw[:100],
           "json": b'{"total_pages": 10, "procs": {}}'}[damage]  # fmt: skip
    with open(path, "r+b") as f:  # in place: the same file, as a faulty disk would
        f.write(new)
        f.truncate(len(new))
    for call in (lambda: a.acquire(1), a.available, lambda: SharedBudget(path)):
        with pytest.raises(LedgerError, match=str(path)):
            call()
    assert a.held == 2
