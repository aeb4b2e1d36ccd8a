"""The ledger's file: one SQLite connection to the path, its transactions one at a time, and
what a holder does when the file under the path is not the one it joined.

    transaction(recover)   BEGIN IMMEDIATE, reap dead holders, ... COMMIT (ROLLBACK on error)
      the path deleted or replaced     connect to the file there now (created if missing)
      the file damaged                 moved aside as PATH.damaged-<time>-<pid> (kept)
      its lock held past the timeout   removed, where the holder of the lock is a stopped
                                       process (SIGSTOP inside a transaction); a slow
                                       one that runs is waited for at the next call
                                       and then, in either case, a new file at the path
    (``recover``: a holder, which can register again with what it holds; a reader such as
    ``vmcache-kv`` only reports, with the one command that recovers the file)

Only the first holder that finds the damage moves the file (it checks that the path still
names the file it joined); the others find the path replaced and follow.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time

from vmcache.memory.ledger_rows import (
    _TABLES,
    SCHEMA,
    LedgerError,
    check_ledger_file,
    lock_holders,
    move_aside,
    reap,
    repair_hint,
)


class LedgerFile:
    """The connection of one holder (or reader) to the ledger at ``path``. ``create``: make
    the file (0600) when the path is empty; ``lock_timeout_s``: the longest a transaction
    waits for another process's."""

    def __init__(self, path: str, lock_timeout_s: float, *, create: bool) -> None:
        self.path, self.lock_timeout_s = path, lock_timeout_s
        self.db: sqlite3.Connection | None = None
        self.inode: tuple[int, int] | None = None
        self.damaged = False  # a statement found the file damaged: recover at the next call
        self.rebuilt = 0  # times this connection moved a damaged or stuck file aside
        self.faults = 0  # faults met: recovered here, or refused by the caller
        self.fault: str | None = None  # the last of them
        self.closed = False  # by its owner, for good (a reconnect closes and opens)
        self.mutex = threading.RLock()  # one transaction at a time on this connection
        try:
            self.connect(create)
        except sqlite3.Error as exc:
            raise self.error(exc) from exc

    def connect(self, create: bool) -> None:
        """Open the file at the path (made, 0600, where ``create`` and it is missing).
        ``LedgerError`` for a file not to be trusted, another schema or an ``OSError``;
        SQLite's own errors as they are (:meth:`transaction` may recover from them: the
        file's identity is known by then)."""
        try:
            if create and not os.path.lexists(self.path):
                try:  # private from the start (SQLite would create it with the umask's mode)
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    os.close(fd)
                except FileExistsError:
                    pass
            elif not os.path.lexists(self.path):
                raise ValueError(f"no ledger at {self.path}: give total_pages")
            st = check_ledger_file(self.path)
        except OSError as e:
            raise LedgerError(f"ledger {self.path}: {e}") from e
        self.inode = (st.st_dev, st.st_ino)
        db = sqlite3.connect(
            self.path, timeout=self.lock_timeout_s, isolation_level=None, check_same_thread=False
        )
        try:
            db.execute("PRAGMA synchronous=NORMAL")
            # a commit truncates the journal through its descriptor, never unlinks it by name:
            # a process stopped mid-transaction whose file was moved aside cannot, once
            # resumed, delete the journal of the new file at the path
            db.execute("PRAGMA journal_mode=TRUNCATE")
            if st.st_size == 0:  # new (here or by another holder): the tables made
                db.executescript(f"BEGIN IMMEDIATE; {_TABLES} COMMIT;")
            row = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            if row is not None and row[0] != SCHEMA:
                raise LedgerError(
                    f"ledger {self.path}: schema {row[0]}, this vmcache reads {SCHEMA}"
                )
            if check_ledger_file(self.path).st_ino != st.st_ino:
                raise LedgerError(f"ledger {self.path} was replaced while it was opened")
        except BaseException:
            db.close()
            raise
        self.db, self.damaged = db, False

    def close(self) -> None:
        """For good: later transactions raise :class:`LedgerError`."""
        with self.mutex:
            self.closed = True
            self._drop()

    def _drop(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None

    def replaced(self) -> bool:
        """Whether the path no longer names the file this connection opened."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self.inode

    def error(self, exc: BaseException) -> LedgerError:
        if locked(exc):
            return LedgerError(
                f"ledger {self.path}: its lock was not obtained within {self.lock_timeout_s} s "
                f"(another process holds it); {repair_hint(self.path)}"
            )
        return LedgerError(
            f"ledger {self.path} is damaged or not a vmcache ledger: {exc}; "
            f"{repair_hint(self.path)}"
        )

    def recover(self, exc: BaseException) -> bool:
        """After ``exc`` from the file this connection opened: a damaged file moved aside
        (kept), a stuck one (its lock held by a process that is stopped) removed, and a new
        file connected at the path. False (nothing done): not a fault that a new file mends,
        a lock held by a process that runs (it is only slow: the caller refuses this once),
        or the move could not be made."""
        if self.inode is None or not (locked(exc) or damaged(exc)):
            return False
        why = "stuck" if locked(exc) else "damaged"
        if why == "stuck":
            holders = lock_holders(self.inode)
            if not holders or not all(state in "Tt" for _, state in holders):
                return False
        try:
            aside = move_aside(self.path, self.inode, why, self.lock_timeout_s)
            if aside is not None:
                self.rebuilt += 1
                if why == "stuck":  # nothing in it to keep: every live holder re-registers
                    for name in (aside, aside + "-journal"):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(name)
        except OSError as e:
            self.note(LedgerError(f"ledger {self.path}: {why}, and not moved aside: {e}"))
            return False
        self.note(self.error(exc))
        self._drop()
        self.connect(create=True)
        return True

    def note(self, exc: BaseException) -> None:
        self.faults += 1
        self.fault = str(exc)

    @contextlib.contextmanager
    def transaction(self, recover: bool, keep: str | None = None):
        """A write transaction (dead holders but ``keep`` reaped first), after connecting
        to a replaced file and, with ``recover``, recovering a damaged or stuck one (once);
        SQLite errors become :class:`LedgerError`. Yields the connection."""
        with self.mutex:
            if self.closed:
                raise LedgerError(f"ledger {self.path}: this SharedBudget is closed")
            for attempt in (0, 1):
                try:
                    self._begin(recover, keep)
                    break
                except sqlite3.Error as exc:
                    self._rollback()
                    if attempt or not recover:
                        raise self.error(exc) from exc
                    try:
                        mended = self.recover(exc)
                    except sqlite3.Error as again:
                        raise self.error(again) from again
                    if not mended:
                        raise self.error(exc) from exc
                except BaseException:
                    self._rollback()
                    raise
            try:
                yield self.db
                self.db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                self.damaged = self.damaged or damaged(exc)
                raise self.error(exc) from exc
            except BaseException:
                self._rollback()
                raise

    def _begin(self, recover: bool, keep: str | None) -> None:
        if recover and self.damaged:
            self.damaged = False
            self.recover(sqlite3.DatabaseError("database disk image is malformed"))
        elif recover and (self.db is None or self.replaced()):
            self._drop()  # deleted or swapped: a new file, where holders register again
            self.connect(create=True)
        elif self.db is None:
            raise LedgerError(f"ledger {self.path}: not connected")
        self.db.execute("BEGIN IMMEDIATE")
        reap(self.db, time.monotonic(), keep=keep)

    def _rollback(self) -> None:
        db = self.db
        if db is None:
            return
        with contextlib.suppress(sqlite3.Error):
            if db.in_transaction:
                db.execute("ROLLBACK")


def locked(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


def damaged(exc: BaseException) -> bool:
    """SQLite's answers for a file that is not (or no longer) a whole ledger."""
    text = str(exc).lower()
    signs = ("not a database", "malformed", "no such table", "no such column", "corrupt")
    return isinstance(exc, sqlite3.DatabaseError) and any(s in text for s in signs)
