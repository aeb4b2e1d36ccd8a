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
write mid-update leaves the previous ledger, never a truncated one), a lock wait has a timeout,
damage is detected (SQLite's header and page checks) and the standard library has it: no
server, one file, nothing to install.

Each holder's own account is the truth; the file is a shared copy of the accounts, so it can
always be rebuilt from them:
  - every write sets this holder's row to what it holds (``held``, not a difference): a
    release whose write failed is written by the next call, never lost or counted twice;
  - a holder whose row is gone (reaped, or the file deleted, replaced or rebuilt) joins
    again with what it holds on its next call; where that no longer fits the total, its row
    is capped at what fits and marked to shed (its owner gives back or preempts down to it),
    and its own limits come back once it fits;
  - a ledger found damaged, or locked by another process for longer than ``lock_timeout_s``
    (a holder stopped inside a transaction), is moved out of the way by the first holder
    that finds it (a damaged file is kept beside it as ``PATH.damaged-...``), and every live
    holder re-registers in a new file at the path: nothing waits on a stopped process
    longer than that bound;
  - with ``lease_s``, a holder that shows no sign of life for that long is reaped (a stopped
    process, or one whose caller stopped calling); ``keepalive=True`` beats from a thread of
    its own, so an idle or busy process keeps its lease and a stopped one loses it (a process
    whose threads still run keeps it, however stuck its work). A reaped holder that resumes
    joins again as above.
The calls a cache makes while it serves (:meth:`SharedBudget.acquire`, ``release``,
``available``, ``want``) never raise for a ledger fault: a fault they cannot recover from
(the path replaced by a symbolic link, say) is a refusal (``acquire`` False, ``available`` 0)
and is kept in :attr:`SharedBudget.fault`; a new holder is refused with :class:`LedgerError`
naming the file and the one command that recovers it (``vmcache-kv --ledger PATH repair``).

Trust model: the processes that open one ledger trust each other and whoever can write the
file (any of them can deny the others pages by lying about what it holds). The ledger is
created 0600, and every opener refuses a symbolic link, a file of another user or one that
every user may write (:func:`~vmcache.memory.ledger_rows.check_ledger_file`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid

from vmcache.memory.budget import _pages
from vmcache.memory.ledger_file import LedgerFile
from vmcache.memory.ledger_rows import (  # noqa: F401  (LedgerError, _start_time: re-exported)
    SCHEMA,
    LedgerError,
    _seconds,
    _start_time,
)

WANT_S = 1.0  # how long a refusal marks a holder as wanting pages
# the bytes one ledger page stands for where holders of different page sizes share a ledger
# (vmcache-server's models, vmcache.vllm's engines: each counts its pages through a
# ScaledBudget of this unit)
UNIT_BYTES = 4096
TTL_S = 0.002  # available() answers from a cached read this long (acquire always locks)
# what a serving process takes (vmcache-server, vmcache.vllm): a lease kept by a thread of
# its own (a stopped process loses its pages after this long), and the longest a call waits
# for another process's transaction before it rebuilds the ledger without it
SERVING_LEASE_S = 5.0
# a file rebuilt by a holder (damaged, stuck, deleted) gives no holder more pages for this
# long, so that the live holders re-register what they hold (a serving one within a quarter
# of its lease) before anyone grows into room that is theirs
REJOIN_GRACE_S = 2.0
SERVING_LOCK_TIMEOUT_S = 2.0


class SharedBudget:
    """This holder's share of the ledger at ``path``: at least ``min_pages`` guaranteed (they
    count against the total whether used or not), at most ``max_pages``. ``total_pages``
    creates the ledger when it does not exist (the first process); later ones may omit it.
    ``lock_timeout_s``: how long a call waits for another process's transaction before it
    moves the stuck ledger aside and goes on in a new one (where the holder of its lock is
    stopped). ``rejoin_grace_s``: after a ledger is rebuilt, how long nobody grows (the live
    holders register first). ``lease_s``: reap this holder
    when it shows no sign of life for that long (None: only when its process dies);
    ``keepalive``: beat from a thread of its own (needs ``lease_s``). ``name``: a label the
    ledger shows (:mod:`vmcache.memory.ledger_admin` reads and limits holders by it).
    ``unit_bytes``: the bytes one ledger page stands for, recorded by the first process (a
    later one naming another is refused), so that readers can show bytes."""

    def __init__(
        self,
        path: str | os.PathLike,
        total_pages: int | None = None,
        *,
        min_pages: int = 0,
        max_pages: int | None = None,
        lock_timeout_s: float = 10.0,
        lease_s: float | None = None,
        rejoin_grace_s: float = REJOIN_GRACE_S,
        keepalive: bool = False,
        name: str = "",
        unit_bytes: int | None = None,
    ) -> None:
        if not isinstance(name, str) or len(name) > 256:
            raise ValueError(f"name must be a string of at most 256 characters, got {name!r}")
        self.path, self.name = os.fspath(path), name
        self.min = _pages("min_pages", min_pages)
        self.lock_timeout_s = _seconds("lock_timeout_s", lock_timeout_s)
        self.rejoin_grace_s = float(rejoin_grace_s)
        if not 0 <= self.rejoin_grace_s <= 600:
            raise ValueError(f"rejoin_grace_s must be in [0, 600] seconds, got {rejoin_grace_s!r}")
        self.lease_s = None if lease_s is None else _seconds("lease_s", lease_s)
        if keepalive and self.lease_s is None:
            raise ValueError("keepalive beats within a lease: give lease_s")
        if total_pages is not None:
            total_pages = _pages("total_pages", total_pages)
        if max_pages is not None:
            max_pages = _pages("max_pages", max_pages)
        self.id = uuid.uuid4().hex  # this instance's row (two budgets in one process: two)
        self.pid = os.getpid()
        self.held = 0  # this holder's account: the truth its row mirrors
        self.asleep = False  # mirror of the row's sleep flag (only this instance changes it)
        self.shed = False  # the row's shed flag as last read (set from outside with a limit)
        self.contended = False  # whether another holder wanted pages at the last read
        self.others_held = 0
        self.rejoined = 0  # times this holder found its row gone (reaped, file rebuilt)
        self._capped: tuple[int, int, int] | None = None  # (cap, min, max) set on rejoin
        self._cached: tuple[float, int] | None = None  # (time, available()) of the last read
        self._wanted_at = float("-inf")  # when want() last wrote
        self._beat_at = float("-inf")
        self._beat_every = 1.0 if self.lease_s is None else self.lease_s / 4
        self._stop, self._beater = threading.Event(), None
        self._file = LedgerFile(self.path, self.lock_timeout_s, create=total_pages is not None)
        try:
            with self._tx(join=False) as db:
                self._register(db, total_pages, max_pages, unit_bytes)
        except BaseException:
            self._file.close()
            raise
        if keepalive:
            self._beater = threading.Thread(
                target=self._keepalive, name=f"vmcache-ledger-{name or self.id[:8]}", daemon=True
            )
            self._beater.start()

    def _register(self, db, total_pages, max_pages, unit_bytes) -> None:
        total = self._meta(db, "total_pages")
        if total is None:
            if total_pages is None:
                raise ValueError(f"no ledger at {self.path}: give total_pages")
            db.execute(
                "INSERT INTO meta VALUES ('total_pages', ?), ('schema', ?)", (total_pages, SCHEMA)
            )
            total = total_pages
        elif total_pages is not None and total_pages != total:
            raise ValueError(f"the ledger's total is {total} pages, not {total_pages}")
        unit = self._meta(db, "unit_bytes")
        if unit_bytes is not None:
            if unit is None:
                unit = _pages("unit_bytes", unit_bytes)
                db.execute("INSERT INTO meta VALUES ('unit_bytes', ?)", (unit,))
            elif unit != unit_bytes:
                raise ValueError(f"the ledger's pages are {unit} bytes, not {unit_bytes}")
        self.total, self.unit_bytes = total, unit
        self.max = total if max_pages is None else max_pages
        if self.min > self.max:
            raise ValueError(f"min_pages {self.min} exceeds max_pages {self.max}")
        self._check_floor(db, self.min)  # (its row is not there yet: the others' floors)
        self._insert(db, self.min, self.max, shed=False)

    # --- the file --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._file.closed

    @property
    def rebuilt(self) -> int:
        """Times this holder moved a damaged or stuck ledger file aside."""
        return self._file.rebuilt

    @contextlib.contextmanager
    def _tx(self, join: bool = True, beat: bool = False):
        """A write transaction on the ledger (reaped first); with ``join``, this holder's row
        is there and says what it holds (re-registered if it was reaped or the file rebuilt,
        written if a write failed before), and its sign of life is refreshed when older than
        a quarter of its lease (``beat``: now), so a call that changes nothing writes
        nothing. Yields the connection."""
        with self._file.transaction(recover=join, keep=self.id) as db:
            if join:
                now = time.monotonic()
                row = db.execute("SELECT held FROM holders WHERE id = ?", (self.id,)).fetchone()
                if row is None:
                    self._rejoin(db)
                elif row[0] != self.held:  # a release whose write failed: the account wins
                    db.execute("UPDATE holders SET held = ? WHERE id = ?", (self.held, self.id))
                if beat or now - self._beat_at >= self._beat_every:  # a write only this often
                    db.execute("UPDATE holders SET beat = ? WHERE id = ?", (now, self.id))
                    self._beat_at = now
            yield db

    @staticmethod
    def _meta(db, key: str) -> int | None:
        row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def _insert(self, db, lo: int, hi: int, shed: bool) -> None:
        now = time.monotonic()
        db.execute(
            "INSERT INTO holders VALUES (?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?)",
            (self.id, self.pid, _start_time(self.pid), self.held, lo, hi, now, self.lease_s)
            + (self.name, int(self.asleep), int(shed)),
        )
        self.min, self.max, self.shed = lo, hi, shed
        self._beat_at = now

    def _rejoin(self, db) -> None:
        """Register again with what this holder holds, within the total (:meth:`_place`)."""
        if self._meta(db, "total_pages") is None:  # the first into a new file
            db.execute(
                "INSERT INTO meta VALUES ('total_pages', ?), ('schema', ?), ('rebuilt_at', ?)",
                (self.total, SCHEMA, time.monotonic()),
            )
            if self.unit_bytes is not None:
                db.execute("INSERT INTO meta VALUES ('unit_bytes', ?)", (self.unit_bytes,))
        lo, hi = self._wanted()
        self._insert(db, *self._place(db, lo, hi))
        self.rejoined += 1

    def _wanted(self) -> tuple[int, int]:
        """The floor and limit this holder asked for (its row may show less while capped)."""
        return (self._capped[1], self._capped[2]) if self._capped else (self.min, self.max)

    def _place(self, db, lo: int, hi: int) -> tuple[int, int, bool]:
        """The row (min, max, shed) of this holder wanting floor ``lo`` and limit ``hi`` with
        what it holds now beside the others' rows: where they leave less than it holds, its
        limit is what fits and it sheds to it; where their floors leave less than ``lo``, its
        floor is what is left. What it wants is kept (``_capped``) until the row shows it,
        and :meth:`_room` places it again at every read."""
        held, promised, floors = db.execute(
            "SELECT COALESCE(SUM(held), 0), COALESCE(SUM(MAX(0, min - held)), 0), "
            "COALESCE(SUM(min), 0) FROM holders WHERE id != ?",
            (self.id,),
        ).fetchone()
        fits = max(0, self.total - held - promised)
        shed = self.held > min(hi, fits)
        row_hi = min(hi, fits) if shed else hi
        row_lo = min(lo, row_hi, max(0, self.total - floors))
        self._capped = (row_hi, lo, hi) if (row_lo, row_hi) != (lo, hi) else None
        return row_lo, row_hi, shed

    def _note(self, exc: BaseException) -> None:
        """A ledger fault a serving call does not raise (it refuses, or writes later)."""
        if self.closed:
            raise exc
        self._file.note(exc)

    @property
    def faults(self) -> int:
        """Ledger faults met: recovered (a new file), or refused by a call that does not
        raise (``acquire``, ``release``, ``available``, ``want``, the keepalive's beats)."""
        return self._file.faults

    @property
    def fault(self) -> str | None:
        """The last of them (None: none)."""
        return self._file.fault

    # --- the budget ------------------------------------------------------------------------
    def _room(self, db, now: float) -> int:
        total = self._meta(db, "total_pages")
        rows = db.execute("SELECT id, held, min, max, want_until, shed FROM holders").fetchall()
        mine = next(r for r in rows if r[0] == self.id)
        if self._capped is not None:
            mine = self._lift_cap(db, mine)
            rows = [mine if r[0] == self.id else r for r in rows]
        self.min, self.max, self.shed = mine[2], mine[3], bool(mine[5])  # may be set outside
        held = sum(r[1] for r in rows)
        self.others_held = held - mine[1]  # what the other holders hold, as last read
        promised = sum(max(0, r[2] - r[1]) for r in rows if r[0] != self.id)
        room = min(mine[3] - mine[1], total - held - promised)
        rebuilt_at = self._meta(db, "rebuilt_at")
        if rebuilt_at is not None and time.monotonic() - rebuilt_at < self.rejoin_grace_s:
            room = 0  # a new file: the live holders register what they hold first
        self.contended = any(r[4] > now for r in rows if r[0] != self.id)
        if self.contended:
            share = total // max(1, sum(1 for r in rows if r[1] or r[4] > now))
            # capped only while a holder that wants pages holds less than its fair share
            if any(r[4] > now and r[1] < max(r[2], share) for r in rows if r[0] != self.id):
                room = min(room, max(mine[2], share) - mine[1])
        return max(0, room)

    def _lift_cap(self, db, mine) -> tuple:
        """A capped row placed again (:meth:`_place`): its own limits back once it fits. A
        limit set from outside meanwhile wins (it is what the holder wants now)."""
        if mine[3] != self._capped[0]:  # set from outside since
            self._capped = None
            return mine
        lo, hi, shed = self._place(db, *self._wanted())
        if (lo, hi, shed) != (mine[2], mine[3], bool(mine[5])):
            db.execute(
                "UPDATE holders SET min = ?, max = ?, shed = ? WHERE id = ?",
                (lo, hi, int(shed), self.id),
            )
        return (mine[0], mine[1], lo, hi, mine[4], int(shed))

    def acquire(self, n: int) -> bool:
        """Take ``n`` pages, all or nothing; False when the budget cannot give them now, or
        the ledger cannot be used (:attr:`fault` says why)."""
        n = _pages("pages", n)
        if n == 0:
            return True
        self._cached = None
        now = time.monotonic()
        # the account and the row change under one lock (the keepalive thread writes the row
        # from the account: it must never see one without the other)
        with self._file.mutex:
            try:
                with self._tx() as db:
                    if n > self._room(db, now):
                        if now >= self._wanted_at + WANT_S / 2:  # at most this often
                            db.execute(
                                "UPDATE holders SET want_until = ? WHERE id = ?",
                                (now + WANT_S, self.id),
                            )
                            self._wanted_at = now
                        return False
                    db.execute(
                        "UPDATE holders SET held = ?, want_until = 0 WHERE id = ?",
                        (self.held + n, self.id),
                    )
            except LedgerError as e:
                self._note(e)
                return False
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
        try:
            with self._tx() as db:
                db.execute(
                    "UPDATE holders SET want_until = ? WHERE id = ?", (now + WANT_S, self.id)
                )
        except LedgerError as e:
            self._note(e)

    def release(self, n: int) -> None:
        """Give back ``n`` pages: this holder's account drops now; its row follows in the
        same call or, where the ledger cannot be written now, in the next call that can."""
        n = _pages("pages", n)
        with self._file.mutex:
            if n > self.held:
                raise ValueError(f"release of {n} pages, {self.held} held")
            if self.closed:
                raise LedgerError(f"ledger {self.path}: this SharedBudget is closed")
            self._cached = None
            self.held -= n
            try:
                with self._tx():
                    pass  # the transaction writes the row from the account
            except LedgerError as e:
                self._note(e)

    def excess(self) -> int:
        """Pages held beyond the limit as last read (every :meth:`available` and
        :meth:`acquire` reads it: a limit lowered from outside shows within TTL_S)."""
        return max(0, self.held - self.max)

    def set_limits(
        self, min_pages: int | None = None, max_pages: int | None = None, *, asleep=None
    ) -> None:
        """This holder's guaranteed minimum and its most, now (None: unchanged), and its sleep
        flag (``asleep``), in one transaction. A minimum above the maximum, or more than the
        others leave unpromised, is a ``ValueError`` and changes nothing; a maximum below what
        is held is an :meth:`excess` the pool gives back as its pages free. A holder capped
        on rejoining keeps what it wants and gets it once it fits."""
        self._cached = None
        with self._file.mutex, self._tx() as db:
            row_hi, row_shed = db.execute(
                "SELECT max, shed FROM holders WHERE id = ?", (self.id,)
            ).fetchone()
            want_lo, want_hi = self._wanted() if self._capped else (self.min, row_hi)
            lo = want_lo if min_pages is None else _pages("min_pages", min_pages)
            hi = want_hi if max_pages is None else _pages("max_pages", max_pages)
            if lo > hi:
                raise ValueError(f"min_pages {lo} exceeds max_pages {hi}")
            sleep = self.asleep if asleep is None else bool(asleep)
            if self._capped:
                lo, hi, shed = self._place(db, lo, hi)
            else:
                self._check_floor(db, lo)
                shed = bool(row_shed) and self.held > hi  # a shed set from outside stays
            db.execute(
                "UPDATE holders SET min = ?, max = ?, shed = ?, asleep = ? WHERE id = ?",
                (lo, hi, int(shed), int(sleep), self.id),
            )
            self.min, self.max, self.shed, self.asleep = lo, hi, shed, sleep

    def promise_floor(self, pages: int, *, asleep: bool | None = None) -> int:
        """Set the guaranteed minimum to ``pages`` or as much of it as fits now: within this
        holder's limit as the ledger has it now (it may have been lowered from outside) and
        what the others leave unpromised; and the sleep flag (``asleep``, None: unchanged),
        in one transaction. Returns the minimum set."""
        pages = _pages("min_pages", pages)
        sleep = self.asleep if asleep is None else bool(asleep)
        self._cached = None
        with self._file.mutex, self._tx() as db:
            hi, shed = db.execute(
                "SELECT max, shed FROM holders WHERE id = ?", (self.id,)
            ).fetchone()
            if self._capped:
                lo, hi, shed = self._place(db, pages, self._capped[2])
            else:
                lo = max(0, min(pages, hi, self.total - self._others_floors(db)))
            db.execute(
                "UPDATE holders SET min = ?, max = ?, shed = ?, asleep = ? WHERE id = ?",
                (lo, hi, int(shed), int(sleep), self.id),
            )
            self.min, self.max, self.shed, self.asleep = lo, hi, bool(shed), sleep
        return lo

    def _others_floors(self, db) -> int:
        return db.execute(
            "SELECT COALESCE(SUM(min), 0) FROM holders WHERE id != ?", (self.id,)
        ).fetchone()[0]

    def _check_floor(self, db, lo: int) -> None:
        others = self._others_floors(db)
        if others + lo > self.total:
            raise ValueError(
                f"min_pages {lo}: only {self.total - others} of the {self.total} pages are not "
                "promised to others"
            )

    def set_asleep(self, asleep: bool) -> None:
        """Record whether this holder sleeps (shown to readers of the ledger)."""
        with self._tx() as db:
            db.execute("UPDATE holders SET asleep = ? WHERE id = ?", (int(asleep), self.id))
        self.asleep = bool(asleep)

    def available(self) -> int:
        """Pages :meth:`acquire` would give now (another process may take them first: a
        ``can_grow`` that says yes is then answered by ``CacheFull``, which a scheduler
        handles by preempting, as for any full pool); 0 while the ledger cannot be used.
        Read at most every TTL_S seconds."""
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < TTL_S:
            return self._cached[1]
        try:
            with self._tx() as db:
                room = self._room(db, now)
        except LedgerError as e:
            self._note(e)
            room = 0
        self._cached = (now, room)
        return room

    def beat(self) -> None:
        """A sign of life (with ``lease_s``): an idle process calls this more often than its
        lease, or others may reap its pages (``keepalive`` does it from a thread)."""
        with self._tx(beat=True):
            pass

    def _keepalive(self) -> None:
        while not self._stop.wait(self._beat_every):
            try:
                self.beat()
            except Exception as e:  # noqa: BLE001 - the thread must outlive any one fault
                if self.closed:
                    return
                self._file.note(e)

    def snapshot(self) -> dict:
        """The ledger now (dead holders reaped): the total and, per holder id, its pid and
        held / min / max pages."""
        with self._tx() as db:
            rows = db.execute("SELECT id, pid, held, min, max FROM holders").fetchall()
            total = self._meta(db, "total_pages")
        return {
            "total_pages": total,
            "holders": {
                h: {"pid": pid, "held": held, "min": lo, "max": hi} for h, pid, held, lo, hi in rows
            },
        }

    def close(self) -> None:
        """Leave the ledger (what is held goes back); the cache must have released it."""
        if self._beater is not None:
            self._stop.set()
            self._beater.join(self.lock_timeout_s * 2 + 1)
        if self.closed:
            return
        try:
            if not self._file.replaced():
                with self._tx(join=False) as db:
                    db.execute("DELETE FROM holders WHERE id = ?", (self.id,))
        finally:
            self._file.close()
