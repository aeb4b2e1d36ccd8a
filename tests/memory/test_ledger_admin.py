"""A ledger read and limited from outside its holders (vmcache/memory/ledger_admin.py), a
holder's own limits changed (SharedBudget.set_limits), and one budget in units under caches
of different page sizes (ScaledBudget)."""

import os
import sqlite3

import pytest

from vmcache.memory.budget import LocalBudget, ScaledBudget
from vmcache.memory.ledger import LedgerError, SharedBudget
from vmcache.memory.ledger_admin import read, set_limit


@pytest.fixture
def path(tmp_path):
    return tmp_path / "budget.db"


def test_a_limit_set_from_outside_reaches_the_holder_and_its_excess(path):
    a = SharedBudget(path, 100, name="a", unit_bytes=4096, min_pages=10)
    b = SharedBudget(path, name="b", min_pages=5)
    assert a.acquire(60) and b.acquire(20)
    view = read(path)
    assert (view.total_pages, view.unit_bytes, view.held_pages) == (100, 4096, 80)
    assert [(h.name, h.held_pages, h.min_pages, h.max_pages) for h in view.holders] == [
        ("a", 60, 10, 100), ("b", 20, 5, 100)]  # fmt: skip
    view = set_limit(path, "a", 40, shed=True)
    assert view.named("a")[0].max_pages == 40 and view.named("a")[0].shed
    assert a.excess() == 0  # not read yet
    assert a.available() == 0 and (a.max, a.shed, a.excess()) == (40, True, 20)
    a.release(20)
    assert a.excess() == 0 and not a.acquire(1)
    set_limit(path, "a", 90)
    assert a.available() == 40 and not a.shed  # 100 - (40 + 20) held; b's floor is held
    a.set_limits(min_pages=30)
    assert read(path).named("a")[0].min_pages == 30


def test_bad_limits_are_value_errors_and_change_nothing(path):
    a = SharedBudget(path, 100, name="a", unit_bytes=4096, min_pages=10)
    SharedBudget(path, name="b", min_pages=50)  # another process's floor, as it were
    before = read(path)
    for name, pages, match in (("zz", 50, "no holder named 'zz'"), ("a", 5, "below"),
                               ("a", 101, "exceeds"), ("a", -1, "non-negative")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            set_limit(path, name, pages)
    with pytest.raises(ValueError, match="not promised"):
        a.set_limits(min_pages=60)  # 50 are b's
    with pytest.raises(ValueError, match="exceeds"):
        a.set_limits(min_pages=20, max_pages=15)
    assert read(path) == before
    with pytest.raises(ValueError, match="pages are 4096 bytes"):
        SharedBudget(path, name="c", unit_bytes=8192)
    with pytest.raises(ValueError, match="name"):
        SharedBudget(path, name=7)


def test_a_ledger_that_cannot_be_used_is_a_ledger_error_naming_it(tmp_path):
    with pytest.raises(LedgerError, match="no ledger"):
        read(tmp_path / "missing.db")
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database" * 100)
    with pytest.raises(LedgerError, match="junk.db"):
        read(junk)
    old = tmp_path / "old.db"
    with sqlite3.connect(old) as db:  # a schema-1 ledger (no names)
        db.executescript("CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);"
                         "INSERT INTO meta VALUES ('total_pages', 10), ('schema', 1);")  # fmt: skip
    with pytest.raises(LedgerError, match="schema 1"):
        read(old)
    with pytest.raises(LedgerError, match="schema 1"):
        SharedBudget(old)
    if os.geteuid() != 0:  # root reads any file
        locked = tmp_path / "locked.db"
        SharedBudget(locked, 10).close()
        os.chmod(locked, 0)
        with pytest.raises(LedgerError, match="cannot be read"):
            SharedBudget(locked)


def test_a_scaled_budget_counts_pages_in_units():
    inner = LocalBudget(100)
    s = ScaledBudget(inner, unit_bytes=4096)
    with pytest.raises(RuntimeError, match="bind"):
        s.available()
    s.bind_page_bytes(65536 + 1)  # 17 units a page (rounded up)
    assert s.available() == 5 and s.acquire(5) and inner.held == 85 and not s.acquire(1)
    inner.set_limit(50)
    assert s.excess() == 3  # 35 units over: 3 pages
    s.release(5)
    assert inner.held == 0
    for bad in ({}, {"units_per_page": 0}, {"units_per_page": 2, "unit_bytes": 4096}):
        with pytest.raises(ValueError):
            ScaledBudget(inner, **bad)
    shared = ScaledBudget(SharedBudget.__new__(SharedBudget), 2)  # forwards want
    assert hasattr(shared, "want") and not hasattr(ScaledBudget(inner, 2), "want")


def test_the_fair_share_caps_a_grower_only_while_a_holder_below_its_share_wants(path):
    a = SharedBudget(path, 90, name="a")
    b = SharedBudget(path, name="b")
    c = SharedBudget(path, name="c")
    assert a.acquire(60)  # alone: as much as it likes
    assert c.acquire(10) and not c.acquire(25)  # only 20 left: c is refused and wants
    # c holds 10, below its share (90 / 3 holders active = 30): a may not pass 30 now
    assert a.available() == 0
    assert b.acquire(5) and not a.acquire(1)
    a.release(40)  # a at 20: room up to its share of 30 (3 active) and what is free
    assert a.available() == 10
    assert c.acquire(20) and c.held == 30  # c reaches its share
    # no wanting holder is below its share: a may take all that is free (acquire reads the
    # ledger; available() may answer from its read of 2 ms ago)
    assert not a.acquire(36) and a.acquire(35) and a.held == 55
