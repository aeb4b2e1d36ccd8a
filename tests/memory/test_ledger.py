"""One budget shared by caches in three processes (vmcache/memory/ledger.py): the total is never
exceeded, a process's guaranteed minimum stays available, a killed process's pages return,
freed and trimmed pages go to whoever asks next (tests/ledger_scenarios.py runs the ranks)."""

import json
import os
import sqlite3
import time

import pytest
from ledger_scenarios import MIN0, TOTAL, shared
from ranks import run_ranks

from vmcache.memory.ledger import SharedBudget, _start_time


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("ledger") / "budget.db"
    return run_ranks(shared, 3, str(path))


def test_the_total_is_never_exceeded_and_the_minimum_is_kept(results):
    r0, r1 = results[0], results[1]
    assert sum(r1["after_fill"].values()) == TOTAL - MIN0  # everything not promised
    assert r0["room_0"] == MIN0 and r0["held_0"] == MIN0


def test_a_killed_process_gives_its_pages_back(results):
    r0, r1 = results[0], results[1]
    assert 2 not in results  # rank 2 died holding pages
    for r in (r0, r1):
        assert r["procs_after_death"] == 2
        assert r["total_held_after_death"] == r1["held_1"] + MIN0
    assert r1["held_1_after"] == TOTAL - MIN0  # rank 1 grew into what rank 2 held


def test_trimmed_pages_go_back_to_the_budget(results):
    r0, r1 = results[0], results[1]
    assert r1["held_1_trimmed"] == 0 and r1["trimmed"] == (TOTAL - MIN0) * 4096
    assert r0["room_0_after_trim"] == TOTAL - MIN0


def _row(path, pid, held, lo, hi):
    """A holder row written as another process's SharedBudget would (pid ``pid``)."""
    with sqlite3.connect(path) as db:
        db.execute(
            "INSERT INTO holders VALUES (?, ?, ?, ?, ?, ?, 0, ?, NULL, '', 0, 0)",
            (f"row-{pid}", pid, _start_time(pid), held, lo, hi, time.monotonic()),
        )


def test_bad_ledger_arguments_and_dead_entries(tmp_path):
    path = tmp_path / "b.db"
    with pytest.raises(ValueError, match="total_pages"):
        SharedBudget(path)  # no ledger yet and no total
    SharedBudget(path, 10).close()  # the file, empty of holders
    parent = os.getppid()  # a live process with a promise of 6 of the 10 pages
    _row(path, parent, 2, 6, 10)
    with pytest.raises(ValueError, match="not promised"):
        SharedBudget(path, min_pages=5)  # 6 + 5 > 10
    with pytest.raises(ValueError, match="exceeds"):
        SharedBudget(path, min_pages=3, max_pages=2)
    with pytest.raises(ValueError, match="total"):
        SharedBudget(path, 12)
    b = SharedBudget(path, max_pages=8)
    assert b.available() == 4  # 10 - 2 held - 4 still promised to the parent
    assert not b.acquire(5) and b.acquire(4) and b.available() == 0
    b.release(4)
    _row(path, 999999999, 3, 0, 10)  # no such pid
    snap = b.snapshot()["holders"]
    assert b.available() == 4 and "row-999999999" not in snap and f"row-{parent}" in snap
    b.close()
    assert b.id not in json.dumps(SharedBudget(path).snapshot())
