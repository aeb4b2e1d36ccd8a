"""The ledger file's rows and their rules, shared by :class:`~vmcache.memory.ledger.SharedBudget`
(a holder) and :mod:`vmcache.memory.ledger_admin` (a reader that sets limits from outside):
the schema, the error type, and which holders are dead (reaped by every transaction)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
import uuid

SCHEMA = 2  # 2: holders carry a name, a sleep flag and a shed flag (limits set from outside)
_TABLES = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS holders (
    id TEXT PRIMARY KEY, pid INTEGER NOT NULL, start TEXT,
    held INTEGER NOT NULL CHECK (held >= 0), min INTEGER NOT NULL, max INTEGER NOT NULL,
    want_until REAL NOT NULL DEFAULT 0, beat REAL NOT NULL, lease_s REAL,
    name TEXT NOT NULL DEFAULT '', asleep INTEGER NOT NULL DEFAULT 0,
    shed INTEGER NOT NULL DEFAULT 0);
"""


class LedgerError(RuntimeError):
    """The ledger file cannot be used: damaged, of another format, or its lock was not
    obtained in time. Names the file; this budget's state is unchanged."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    return start is None or _start_time(pid) in (None, start)


def repair_hint(path: str) -> str:
    return f"recover it with: vmcache-kv --ledger {path} repair"


def check_ledger_file(path: str) -> os.stat_result:
    """:class:`LedgerError` unless ``path`` is a ledger this process may trust: a regular
    file (not a symbolic link, which would let whoever can write the directory point the
    budget elsewhere), owned by this user, writable by no one else, and readable and
    writable here. Every opener of a ledger calls this (holders, ``vmcache-kv``, the
    server's flag check, vLLM's scheduler). Returns the file's ``lstat``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise LedgerError(f"no ledger at {path}") from None
    if stat.S_ISLNK(st.st_mode):
        raise LedgerError(f"ledger {path} is a symbolic link: refusing to follow it")
    if not stat.S_ISREG(st.st_mode):
        raise LedgerError(f"ledger {path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise LedgerError(f"ledger {path} is owned by uid {st.st_uid}, not this user "
                          f"({os.geteuid()}): refusing to share a budget with it")  # fmt: skip
    if st.st_mode & stat.S_IWOTH:
        raise LedgerError(f"ledger {path} is writable by every user (mode "
                          f"{stat.S_IMODE(st.st_mode):o}): refusing it")  # fmt: skip
    if not os.access(path, os.R_OK | os.W_OK, follow_symlinks=False):
        raise LedgerError(f"ledger {path} cannot be read and written by this process "
                          f"(uid {os.geteuid()})")  # fmt: skip
    return st


def check_ledger_path(path: str) -> None:
    """A ledger path refused before use: its directory missing (``ValueError``), or a file
    there this process cannot trust (:func:`check_ledger_file`)."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"ledger {path}: no directory {directory}")
    if os.path.lexists(path):
        check_ledger_file(path)


def move_aside(path: str, inode: tuple[int, int], why: str, timeout_s: float) -> str | None:
    """Rename the ledger file at ``path`` (and its rollback journal) to a name of its own,
    ``path.<why>-<time>-<random>``, if it is still the file ``inode`` (device, inode) names;
    returns the new name, or None when it was not (another process moved it first). Movers
    take turns on ``path.recover`` (``flock``, at most ``timeout_s``), so two that found
    the same damage never move each other's new file. ``OSError`` when it cannot be done
    (the directory read-only, the lock not had in time)."""
    fd = os.open(path + ".recover", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OSError(f"{path}.recover is held by another process") from None
                time.sleep(0.01)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if (st.st_dev, st.st_ino) != inode:
            return None
        base = os.path.basename(path)[:150]
        stamp = time.strftime("%Y%m%dT%H%M%S")
        aside = os.path.join(os.path.dirname(path), f"{base}.{why}-{stamp}-{uuid.uuid4().hex[:8]}")
        os.rename(path, aside)
        # its rollback journal goes with it: left at the path, SQLite could take it for a hot
        # journal of the new file there
        with contextlib.suppress(FileNotFoundError):
            os.rename(path + "-journal", aside + "-journal")
        return aside
    finally:
        os.close(fd)  # (the flock goes with it)


def lock_holders(inode: tuple[int, int]) -> list[tuple[int, str]]:
    """The other processes that hold a POSIX lock on the file ``inode`` names, each with its
    state letter (``T``: stopped), from ``/proc/locks`` (no descriptor is opened: closing one
    would drop this process's own SQLite locks on the file). Empty where unknown."""
    dev, ino = inode
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    out = []
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] != "POSIX" or parts[5] != want:
            continue
        pid = int(parts[4])
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        out.append((pid, state))
    return out


def reap(db, now: float, keep: str | None = None) -> int:
    """Delete the rows of holders whose process is gone or whose lease ran out (never
    ``keep``'s); returns how many."""
    rows = db.execute("SELECT id, pid, start, beat, lease_s FROM holders").fetchall()
    gone = [(h,) for h, pid, start, beat, lease in rows if h != keep and (
        not _alive(pid, start) or (lease is not None and now - beat > lease))]  # fmt: skip
    if gone:
        db.executemany("DELETE FROM holders WHERE id = ?", gone)
    return len(gone)


def _seconds(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {x!r}")
    return float(x)
