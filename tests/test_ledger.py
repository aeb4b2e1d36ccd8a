"""One budget shared by caches in three processes (vmcache/ledger.py): the total is never
exceeded, a process's guaranteed minimum stays available, a killed process's pages return,
freed and trimmed pages go to whoever asks next (tests/ledger_scenarios.py runs the ranks)."""

import json
import os

import pytest
from ledger_scenarios import MIN0, TOTAL, shared
from ranks import run_ranks

from vmcache.ledger import SharedBudget, _start_time


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("ledger") / "budget.json"
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


def test_bad_ledger_arguments_and_dead_entries(tmp_path):
    path = tmp_path / "b.json"
    with pytest.raises(ValueError, match="total_pages"):
        SharedBudget(path)  # no ledger yet and no total
    parent = os.getppid()  # a live process with a promise of 6 of the 10 pages
    entry = {"start": _start_time(parent), "held": 2, "min": 6, "max": 10}
    path.write_text(json.dumps({"total_pages": 10, "procs": {str(parent): entry}}))
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
    doc = json.loads(path.read_text())
    doc["procs"]["999999999"] = {"start": "1", "held": 3, "min": 0, "max": 10}  # no such pid
    path.write_text(json.dumps(doc))
    assert b.available() == 4 and "999999999" not in b.snapshot()["procs"]  # reaped
    b.close()
    assert str(os.getpid()) not in json.loads(path.read_text())["procs"]
