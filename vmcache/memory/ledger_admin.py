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
from dataclasses import dataclass

from vmcache.memory.budget import _pages
from vmcache.memory.ledger_file import LedgerFile, damaged, locked
from vmcache.memory.ledger_rows import LedgerError, lock_holders, move_aside


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


def _open(path, timeout_s: float) -> LedgerFile:
    path = os.fspath(path)
    if not os.path.lexists(path):
        raise LedgerError(f"no ledger at {path}")
    try:
        return LedgerFile(path, timeout_s, create=False)
    except ValueError as e:
        raise LedgerError(str(e)) from None


def _view(db, path) -> LedgerView:
    meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
    rows = db.execute("SELECT id, pid, name, held, min, max, asleep, shed FROM holders "
                      "ORDER BY name, id").fetchall()  # fmt: skip
    holders = tuple(Holder(i, pid, name, held, lo, hi, bool(a), bool(s))
                    for i, pid, name, held, lo, hi, a, s in rows)  # fmt: skip
    return LedgerView(os.fspath(path), meta["total_pages"], meta.get("unit_bytes"), holders)


def _run(path, timeout_s: float, fn):
    f = _open(path, timeout_s)
    try:
        with f.transaction(recover=False) as db:  # dead holders reaped first
            if db.execute("SELECT value FROM meta WHERE key = 'total_pages'").fetchone() is None:
                raise LedgerError(f"ledger {path} records no total: not a vmcache ledger")
            return fn(db)
    finally:
        f.close()


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


def repair(path, timeout_s: float = 10.0) -> str | None:
    """Move the ledger at ``path`` aside (kept as ``PATH.damaged-...``) when it is damaged
    (SQLite cannot read it as a ledger), or locked past ``timeout_s`` by a process that is
    stopped. The live holders re-register what they hold in a new file at the path on their
    next call (a serving process within a quarter of its lease); a new holder creates it.
    Returns the name it was moved to; None when the ledger is readable (nothing to repair).
    ``LedgerError`` for anything else (a file not to be trusted, another schema, a lock
    held by a process that runs): nothing is moved."""
    path = os.fspath(path)
    try:
        st = os.lstat(path)  # the file judged is the file moved, not one put there since
    except FileNotFoundError:
        raise LedgerError(f"no ledger at {path}") from None
    try:
        read(path, timeout_s)
        return None
    except LedgerError as e:
        cause = e.__cause__
        inode = (st.st_dev, st.st_ino)
        stuck = locked(cause) and any(s in "Tt" for _, s in lock_holders(inode))
        if not (damaged(cause) or stuck):
            raise
    try:
        aside = move_aside(path, inode, "damaged", timeout_s)
    except OSError as e:
        raise LedgerError(f"ledger {path}: not moved aside: {e}") from e
    if aside is None:
        raise LedgerError(f"ledger {path} was replaced meanwhile: nothing moved")
    return aside
