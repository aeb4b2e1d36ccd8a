"""A ledger read and limited from outside its holders (``vmcache-kv``, tests, an operator's
script): every holder's pages held, floor, limit and sleep flag, and a holder's limit changed
by its name while it runs.

    view = read(path)                      # dead holders reaped first
    set_limit(path, "chat", 2048)          # the holder "chat" may hold 2,048 pages
    set_limit(path, "chat", 512, shed=True)  # ... and should preempt until it does

A limit changed here is a row of the ledger; the holder reads it on its next call
(:meth:`SharedBudget.available`, at most ``TTL_S`` later while it runs, or its owner's next
check when idle): its pool gives back free pages over the limit at once and the rest as its
sequences end, or, with ``shed``, its owner preempts sequences until it fits.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass

from vmcache.memory.budget import _pages
from vmcache.memory.ledger_rows import SCHEMA, LedgerError, check_access, reap


@dataclass(frozen=True)
class Holder:
    id: str
    pid: int
    name: str
    held_pages: int
    min_pages: int
    max_pages: int
    asleep: bool
    shed: bool


@dataclass(frozen=True)
class LedgerView:
    path: str
    total_pages: int
    unit_bytes: int | None  # the bytes of one page, where the first holder recorded them
    holders: tuple[Holder, ...]

    @property
    def held_pages(self) -> int:
        return sum(h.held_pages for h in self.holders)

    def named(self, name: str) -> list[Holder]:
        return [h for h in self.holders if h.name == name]


def _open(path, timeout_s: float) -> sqlite3.Connection:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise LedgerError(f"no ledger at {path}")
    check_access(path)
    try:
        db = sqlite3.connect(path, timeout=timeout_s, isolation_level=None)
        db.execute("BEGIN IMMEDIATE")
        row = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path} is damaged, locked or not a vmcache ledger: "
                          f"{exc}") from exc  # fmt: skip
    if row is None or row[0] != SCHEMA:
        db.close()
        raise LedgerError(f"ledger {path}: schema {None if row is None else row[0]}, this "
                          f"vmcache reads {SCHEMA}")  # fmt: skip
    return db


def _view(db, path) -> LedgerView:
    meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
    rows = db.execute("SELECT id, pid, name, held, min, max, asleep, shed FROM holders "
                      "ORDER BY name, id").fetchall()  # fmt: skip
    holders = tuple(Holder(i, pid, name, held, lo, hi, bool(a), bool(s))
                    for i, pid, name, held, lo, hi, a, s in rows)  # fmt: skip
    return LedgerView(os.fspath(path), meta["total_pages"], meta.get("unit_bytes"), holders)


def _run(path, timeout_s: float, fn):
    db = _open(path, timeout_s)
    try:
        reap(db, time.monotonic())
        out = fn(db)
        db.execute("COMMIT")
        return out
    except BaseException:
        db.execute("ROLLBACK")
        raise
    finally:
        db.close()


def read(path, timeout_s: float = 10.0) -> LedgerView:
    """The ledger at ``path`` now (holders whose process died reaped first)."""
    return _run(path, timeout_s, lambda db: _view(db, path))


def set_limit(path, name: str, max_pages: int, *, shed: bool = False,
              timeout_s: float = 10.0) -> LedgerView:  # fmt: skip
    """Set the most pages every holder called ``name`` may hold; ``shed``: it should preempt
    sequences until it holds no more (else it gives pages back as they free). ``ValueError``
    (nothing changed) for no such holder, a limit below its floor or above the total."""
    max_pages = _pages("max_pages", max_pages)

    def change(db):
        view = _view(db, path)
        mine = view.named(name)
        if not mine:
            known = sorted({h.name for h in view.holders})
            raise ValueError(f"no holder named {name!r} in {path} (holders: {known})")
        if max_pages > view.total_pages:
            raise ValueError(f"limit {max_pages} pages exceeds the ledger's total "
                             f"{view.total_pages}")  # fmt: skip
        for h in mine:
            if max_pages < h.min_pages:
                raise ValueError(f"limit {max_pages} pages is below {name!r}'s floor of "
                                 f"{h.min_pages} pages")  # fmt: skip
        db.execute("UPDATE holders SET max = ?, shed = ? WHERE name = ?",
                   (max_pages, int(shed), name))  # fmt: skip
        return _view(db, path)

    return _run(path, timeout_s, change)
