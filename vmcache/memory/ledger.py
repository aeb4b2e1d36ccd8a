"""One device's KV memory shared by several processes: a ledger that each :class:`SharedBudget`
reads and updates in a SQLite transaction. No server process: SQLite's file lock serialises
the few updates (one per chunk of pages created or released, not per token), and each update
first reaps holders that died or whose lease ran out.

    ledger (SQLite, one file):  meta     total_pages T, schema version
                                holders  one row per SharedBudget instance (not per pid):
                                         id, pid, start, held h, min m, max M, want_until,
                                         beat (last sign of life), lease_s
    a holder may take n more pages when
        held + n <= max   and   Σ held + n + Σ_{others} max(0, min − held) <= T
    (every holder's guaranteed minimum stays available to it), and, while another holder
    that was refused pages in the last WANT_S seconds holds less than its own fair share,
    only up to its fair share
        held + n <= max(min, T / active holders)      (active: holding or wanting pages)
    so a busy process cannot take what another needs: when both are overloaded each keeps its
    share (no page ping-pong, no preemption storms); one alone may use the whole budget, and
    one whose neighbours want no more than their share (a light load) may use what they leave.

Why SQLite, not a JSON file under ``flock``: an update is a transaction (a crash or a short
write mid-update leaves the previous ledger, never a truncated one), a lock wait has a timeout
(``lock_timeout_s``: a process stopped while holding the lock blocks the others only that
long, then they get :class:`LedgerError`), damage is detected (SQLite's header and page checks)
and the standard library has it: no server, one file, nothing to install.

Dead and hung holders: a holder is reaped when its process is gone (``kill(pid, 0)``, or the
pid now belongs to a process started at another time), or, with ``lease_s``, when it showed no
sign of life for that long (every call of its budget is one; call :meth:`SharedBudget.beat`
from an idle process). A reaped holder that turns out alive (a hung process that resumes)
joins again with what it holds, on its next call. A ledger file deleted or replaced while in
use is rebuilt the same way: each holder's next call re-registers what it holds in the file
now at the path (a newcomer that came in between may see room that is not there until then).
A damaged ledger is refused with :class:`LedgerError` naming the file.

Trust model: the processes that open one ledger trust each other and whoever can write the
file (any of them can deny the others pages by lying about what it holds). The ledger is
created 0600: give every process the same user, or a group-writable directory on purpose.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid

from vmcache.memory.budget import _pages
from vmcache.memory.ledger_rows import (  # noqa: F401  (LedgerError, _start_time: re-exported)
    _TABLES,
    SCHEMA,
    LedgerError,
    _seconds,
    _start_time,
    check_access,
    reap,
)

WANT_S = 1.0  # how long a refusal marks a holder as wanting pages
# the bytes one ledger page stands for where holders of different page sizes share a ledger
# (vmcache-server's models, vmcache.vllm's engines: each counts its pages through a
# ScaledBudget of this unit)
UNIT_BYTES = 4096
TTL_S = 0.002  # available() answers from a cached read this long (acquire always locks)


class SharedBudget:
    """This holder's share of the ledger at ``path``: at least ``min_pages`` guaranteed (they
    count against the total whether used or not), at most ``max_pages``. ``total_pages``
    creates the ledger when it does not exist (the first process); later ones may omit it.
    ``lock_timeout_s``: how long a call waits for another process's transaction before
    :class:`LedgerError`. ``lease_s``: reap this holder when it shows no sign of life for
    that long (None: only when its process dies). ``name``: a label the ledger shows
    (:mod:`vmcache.memory.ledger_admin` reads and limits holders by it). ``unit_bytes``: the
    bytes one ledger page stands for, recorded by the first process (a later one naming
    another is refused), so that readers can show bytes."""

    def __init__(self, path: str | os.PathLike, total_pages: int | None = None, *,
                 min_pages: int = 0, max_pages: int | None = None,
                 lock_timeout_s: float = 10.0, lease_s: float | None = None,
                 name: str = "", unit_bytes: int | None = None) -> None:  # fmt: skip
        if not isinstance(name, str) or len(name) > 256:
            raise ValueError(f"name must be a string of at most 256 characters, got {name!r}")
        self.path, self.name = os.fspath(path), name
        self.min = _pages("min_pages", min_pages)
        self.lock_timeout_s = _seconds("lock_timeout_s", lock_timeout_s)
        self.lease_s = None if lease_s is None else _seconds("lease_s", lease_s)
        if total_pages is not None:
            total_pages = _pages("total_pages", total_pages)
        if max_pages is not None:
            max_pages = _pages("max_pages", max_pages)
        self.id = uuid.uuid4().hex  # this instance's row (two budgets in one process: two)
        self.pid = os.getpid()
        self.held = 0  # mirror of this holder's row (only this instance changes it)
        self.asleep = False  # mirror of the row's sleep flag (only this instance changes it)
        self.shed = False  # the row's shed flag as last read (set from outside with a limit)
        self.contended = False  # whether another holder wanted pages at the last read
        self.others_held = 0
        self.rejoined = 0  # times this holder found its row gone (reaped, file rebuilt)
        self._db: sqlite3.Connection | None = None
        self._inode: tuple[int, int] | None = None
        self._cached: tuple[float, int] | None = None  # (time, available()) of the last read
        self._wanted_at = float("-inf")  # when want() last wrote
        self._beat_at = float("-inf")
        self._beat_every = 1.0 if self.lease_s is None else self.lease_s / 4
        self._connect(create=total_pages is not None)
        try:
            with self._tx(join=False) as db:
                total = self._meta(db, "total_pages")
                if total is None:
                    if total_pages is None:
                        raise ValueError(f"no ledger at {self.path}: give total_pages")
                    db.execute("INSERT INTO meta VALUES ('total_pages', ?), ('schema', ?)",
                               (total_pages, SCHEMA))  # fmt: skip
                    total = total_pages
                elif total_pages is not None and total_pages != total:
                    raise ValueError(f"the ledger's total is {total} pages, not {total_pages}")
                unit = self._meta(db, "unit_bytes")
                if unit_bytes is not None:
                    if unit is None:
                        db.execute("INSERT INTO meta VALUES ('unit_bytes', ?)",
                                   (_pages("unit_bytes", unit_bytes),))  # fmt: skip
                    elif unit != unit_bytes:
                        raise ValueError(f"the ledger's pages are {unit} bytes, not {unit_bytes}")
                self.total, self.unit_bytes = total, unit_bytes or unit
                self.max = total if max_pages is None else max_pages
                if self.min > self.max:
                    raise ValueError(f"min_pages {self.min} exceeds max_pages {self.max}")
                promised = db.execute("SELECT COALESCE(SUM(min), 0) FROM holders").fetchone()[0]
                if promised + self.min > total:
                    raise ValueError(f"min_pages {self.min}: only {total - promised} of the "
                                     f"{total} pages are not promised to others")  # fmt: skip
                self._insert(db)
        except BaseException:
            self._disconnect()
            raise

    # --- the file --------------------------------------------------------------------------
    def _connect(self, create: bool) -> None:
        if create and not os.path.lexists(self.path):
            try:  # private from the start (SQLite would create it with the umask's mode)
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except FileExistsError:
                pass
        elif not os.path.exists(self.path):
            raise ValueError(f"no ledger at {self.path}: give total_pages")
        check_access(self.path)
        try:
            st = os.stat(self.path)
            db = sqlite3.connect(self.path, timeout=self.lock_timeout_s, isolation_level=None,
                                 check_same_thread=False)  # fmt: skip
            try:
                db.execute("PRAGMA synchronous=NORMAL")
                db.executescript(f"BEGIN IMMEDIATE; {_TABLES} COMMIT;")
                version = self._meta(db, "schema")
                if version not in (None, SCHEMA):
                    raise sqlite3.DatabaseError(f"schema {version}, this vmcache reads {SCHEMA}")
            except BaseException:
                db.close()
                raise
        except sqlite3.Error as exc:
            raise self._error(exc) from exc
        self._db, self._inode = db, (st.st_dev, st.st_ino)

    def _disconnect(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _error(self, exc: BaseException) -> LedgerError:
        if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
            return LedgerError(f"ledger {self.path}: its lock was not obtained within "
                               f"{self.lock_timeout_s} s (another process holds it)")  # fmt: skip
        return LedgerError(f"ledger {self.path} is damaged or not a vmcache ledger: {exc}")

    def _replaced(self) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._inode

    def _tx(self, join: bool = True, beat: bool = False):
        """A write transaction on the ledger (reaped first); with ``join``, this holder's row
        is there (re-registered with what it holds if it was reaped or the file rebuilt) and
        its sign of life is refreshed when older than a quarter of its lease (``beat``:
        now), so a call that changes nothing writes nothing."""
        return _Transaction(self, join, beat)

    @staticmethod
    def _meta(db, key: str) -> int | None:
        row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def _insert(self, db) -> None:
        now = time.monotonic()
        db.execute("INSERT INTO holders VALUES (?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?, 0)",
                   (self.id, self.pid, _start_time(self.pid), self.held, self.min, self.max,
                    now, self.lease_s, self.name, int(self.asleep)))  # fmt: skip
        self._beat_at = now

    def _reap(self, db, now: float) -> None:
        reap(db, now, keep=self.id)

    # --- the budget ------------------------------------------------------------------------
    def _room(self, db, now: float) -> int:
        total = self._meta(db, "total_pages")
        rows = db.execute("SELECT id, held, min, max, want_until, shed FROM holders").fetchall()
        mine = next(r for r in rows if r[0] == self.id)
        self.min, self.max, self.shed = mine[2], mine[3], bool(mine[5])  # may be set outside
        held = sum(r[1] for r in rows)
        self.others_held = held - mine[1]  # what the other holders hold, as last read
        promised = sum(max(0, r[2] - r[1]) for r in rows if r[0] != self.id)
        room = min(mine[3] - mine[1], total - held - promised)
        self.contended = any(r[4] > now for r in rows if r[0] != self.id)
        if self.contended:
            share = total // max(1, sum(1 for r in rows if r[1] or r[4] > now))
            # capped only while a holder that wants pages holds less than its fair share
            if any(r[4] > now and r[1] < max(r[2], share) for r in rows if r[0] != self.id):
                room = min(room, max(mine[2], share) - mine[1])
        return max(0, room)

    def acquire(self, n: int) -> bool:
        n = _pages("pages", n)
        self._cached = None
        now = time.monotonic()
        with self._tx() as db:
            if n > self._room(db, now):
                db.execute("UPDATE holders SET want_until = ? WHERE id = ?",
                           (now + WANT_S, self.id))  # fmt: skip
                self._wanted_at = now
                return False
            db.execute("UPDATE holders SET held = held + ?, want_until = 0 WHERE id = ?",
                       (n, self.id))  # fmt: skip
        self.held += n
        return True

    def want(self) -> None:
        """Note unmet demand (a scheduler found no room for what it wants to run): for the
        next WANT_S seconds the others keep to their fair share. At most one write per
        WANT_S / 2."""
        now = time.monotonic()
        if now < self._wanted_at + WANT_S / 2:
            return
        self._wanted_at = now
        self._cached = None
        with self._tx() as db:
            db.execute("UPDATE holders SET want_until = ? WHERE id = ?", (now + WANT_S, self.id))

    def release(self, n: int) -> None:
        n = _pages("pages", n)
        if n > self.held:
            raise ValueError(f"release of {n} pages, {self.held} held")
        self._cached = None
        with self._tx() as db:
            db.execute("UPDATE holders SET held = held - ? WHERE id = ?", (n, self.id))
        self.held -= n

    def excess(self) -> int:
        """Pages held beyond the limit as last read (every :meth:`available` and
        :meth:`acquire` reads it: a limit lowered from outside shows within TTL_S)."""
        return max(0, self.held - self.max)

    def set_limits(self, min_pages: int | None = None, max_pages: int | None = None) -> None:
        """This holder's guaranteed minimum and its most, now (None: unchanged). A minimum
        above the maximum, or more than the others leave unpromised, is a ``ValueError``
        and changes nothing; a maximum below what is held is an :meth:`excess` the pool
        gives back as its pages free."""
        lo = self.min if min_pages is None else _pages("min_pages", min_pages)
        self._cached = None
        with self._tx() as db:
            hi = db.execute("SELECT max FROM holders WHERE id = ?", (self.id,)).fetchone()[0]
            hi = hi if max_pages is None else _pages("max_pages", max_pages)
            if lo > hi:
                raise ValueError(f"min_pages {lo} exceeds max_pages {hi}")
            others = db.execute("SELECT COALESCE(SUM(min), 0) FROM holders WHERE id != ?",
                                (self.id,)).fetchone()[0]  # fmt: skip
            if others + lo > self.total:
                raise ValueError(f"min_pages {lo}: only {self.total - others} of the "
                                 f"{self.total} pages are not promised to others")  # fmt: skip
            db.execute("UPDATE holders SET min = ?, max = ?, shed = 0 WHERE id = ?",
                       (lo, hi, self.id))  # fmt: skip
        self.min, self.max, self.shed = lo, hi, False

    def set_asleep(self, asleep: bool) -> None:
        """Record whether this holder sleeps (shown to readers of the ledger)."""
        self.asleep = bool(asleep)
        with self._tx() as db:
            db.execute("UPDATE holders SET asleep = ? WHERE id = ?", (int(asleep), self.id))

    def available(self) -> int:
        """Pages :meth:`acquire` would give now (another process may take them first: a
        ``can_grow`` that says yes is then answered by ``CacheFull``, which a scheduler
        handles by preempting, as for any full pool). Read at most every TTL_S seconds."""
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < TTL_S:
            return self._cached[1]
        with self._tx() as db:
            room = self._room(db, now)
        self._cached = (now, room)
        return room

    def beat(self) -> None:
        """A sign of life (with ``lease_s``): an idle process calls this more often than its
        lease, or others may reap its pages."""
        with self._tx(beat=True):
            pass

    def snapshot(self) -> dict:
        """The ledger now (dead holders reaped): the total and, per holder id, its pid and
        held / min / max pages."""
        with self._tx() as db:
            rows = db.execute("SELECT id, pid, held, min, max FROM holders").fetchall()
            total = self._meta(db, "total_pages")
        return {"total_pages": total,
                "holders": {h: {"pid": pid, "held": held, "min": lo, "max": hi}
                            for h, pid, held, lo, hi in rows}}  # fmt: skip

    def close(self) -> None:
        """Leave the ledger (what is held goes back); the cache must have released it."""
        if self._db is None:
            return
        try:
            if not self._replaced():
                with self._tx(join=False) as db:
                    db.execute("DELETE FROM holders WHERE id = ?", (self.id,))
        finally:
            self._disconnect()


class _Transaction:
    """``BEGIN IMMEDIATE`` .. ``COMMIT`` (``ROLLBACK`` on an error) on the budget's ledger,
    after reconnecting to a replaced file; SQLite errors become :class:`LedgerError`."""

    def __init__(self, budget: SharedBudget, join: bool, beat: bool = False) -> None:
        self.b, self.join, self.beat = budget, join, beat

    def __enter__(self):
        b = self.b
        if b._db is None:
            raise LedgerError(f"ledger {b.path}: this SharedBudget is closed")
        if self.join and b._replaced():  # deleted or swapped: rebuild from what we hold
            b._disconnect()
            b._connect(create=True)
        try:
            b._db.execute("BEGIN IMMEDIATE")
            now = time.monotonic()
            b._reap(b._db, now)
            if self.join:
                if b._meta(b._db, "total_pages") is None:
                    b._db.execute("INSERT INTO meta VALUES ('total_pages', ?), ('schema', ?)",
                                  (b.total, SCHEMA))  # fmt: skip
                if self.beat or now - b._beat_at >= b._beat_every:  # a write only this often
                    found = b._db.execute("UPDATE holders SET beat = ? WHERE id = ?",
                                          (now, b.id)).rowcount  # fmt: skip
                    b._beat_at = now
                else:
                    found = b._db.execute("SELECT 1 FROM holders WHERE id = ?",
                                          (b.id,)).fetchone() is not None  # fmt: skip
                if not found:
                    b._insert(b._db)
                    b.rejoined += 1
        except sqlite3.Error as exc:
            self._rollback()
            raise b._error(exc) from exc
        except BaseException:
            self._rollback()
            raise
        return b._db

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None:
            self._rollback()
            if isinstance(exc, sqlite3.Error):
                raise self.b._error(exc) from exc
            return
        try:
            self.b._db.execute("COMMIT")
        except sqlite3.Error as err:
            self._rollback()
            raise self.b._error(err) from err

    def _rollback(self) -> None:
        try:
            self.b._db.execute("ROLLBACK")
        except sqlite3.Error:
            pass
