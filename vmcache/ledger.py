"""One device's KV memory shared by several processes: a ledger file that each process's
:class:`SharedBudget` reads and updates under an exclusive ``fcntl`` lock. No server process:
the lock serialises the few updates (one per chunk of pages created or released, not per
token), and each update first reaps processes that died holding pages.

    ledger (JSON, one file):  {"total_pages": T,
                               "procs": {"<pid>": {"start": ..., "held": h, "min": m, "max": M}}}
    a process may take n more pages when
        held + n <= max   and   Σ held + n + Σ_{others} max(0, min − held) <= T
    (every process's guaranteed minimum stays available to it), and, while another process
    was refused pages in the last WANT_S seconds, only up to its fair share
        held + n <= max(min, T / active processes)
    so a busy process cannot take what another needs: when both are overloaded each keeps its
    share (no page ping-pong, no preemption storms), and one alone may use the whole budget.

A process is dead when ``kill(pid, 0)`` finds no such process or the pid now belongs to a
process started at another time (``/proc/<pid>/stat``): its pages go back to the budget the
next time anyone updates the ledger (the device frees a dead process's memory itself). A
heartbeat would also catch a hung process; a hung process still holds its memory, so it
should keep its pages in the budget too.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager

from .budget import _pages

WANT_S = 1.0  # how long a refusal marks a process as wanting pages
TTL_S = 0.002  # available() answers from a cached read this long (acquire always locks)


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


class SharedBudget:
    """This process's share of a ledger at ``path``: at least ``min_pages`` guaranteed (they
    count against the total whether used or not), at most ``max_pages``. ``total_pages``
    creates the ledger when it does not exist (the first process); later ones may omit it."""

    def __init__(self, path: str, total_pages: int | None = None, *, min_pages: int = 0,
                 max_pages: int | None = None) -> None:  # fmt: skip
        self.path = os.fspath(path)
        self.pid = os.getpid()
        self.min = _pages("min_pages", min_pages)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with self._locked() as doc:
                if doc.get("total_pages") is None:
                    if total_pages is None:
                        raise ValueError(f"no ledger at {self.path}: give total_pages")
                    doc["total_pages"] = _pages("total_pages", total_pages)
                elif total_pages is not None and total_pages != doc["total_pages"]:
                    raise ValueError(f"the ledger's total is {doc['total_pages']} pages, "
                                     f"not {total_pages}")  # fmt: skip
                total = doc["total_pages"]
                self.max = total if max_pages is None else _pages("max_pages", max_pages)
                if self.min > self.max:
                    raise ValueError(f"min_pages {self.min} exceeds max_pages {self.max}")
                promised = sum(p["min"] for k, p in doc["procs"].items() if k != str(self.pid))
                if promised + self.min > total:
                    raise ValueError(f"min_pages {self.min}: only {total - promised} of the "
                                     f"{total} pages are not promised to others")  # fmt: skip
                doc["procs"][str(self.pid)] = {"start": _start_time(self.pid), "held": 0,
                                               "min": self.min, "max": self.max}  # fmt: skip
        except BaseException:
            os.close(self._fd)
            raise
        self.held = 0  # mirror of this process's entry (only this process changes it)
        self._cached: tuple[float, int] | None = None  # (time, available()) of the last read
        self._wanted_at = float("-inf")  # when want() last wrote

    @contextmanager
    def _locked(self):
        """The ledger under an exclusive lock, dead processes reaped; written back after."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            raw = os.pread(self._fd, 1 << 20, 0)
            doc = json.loads(raw) if raw.strip() else {"total_pages": None, "procs": {}}
            raw = raw if raw.strip() else b""
            doc["procs"] = {k: p for k, p in doc["procs"].items()
                            if _alive(int(k), p["start"])}  # fmt: skip
            yield doc
            data = json.dumps(doc).encode()
            if data != raw:  # reads and reaps that found nothing dead write nothing
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, data, 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @staticmethod
    def _room(doc: dict, me: str, now: float) -> int:
        procs = doc["procs"]
        mine = procs[me]
        held = sum(p["held"] for p in procs.values())
        promised = sum(max(0, p["min"] - p["held"]) for k, p in procs.items() if k != me)
        room = min(mine["max"] - mine["held"], doc["total_pages"] - held - promised)
        if any(p.get("want_until", 0) > now for k, p in procs.items() if k != me):
            active = sum(1 for p in procs.values() if p["held"] or p.get("want_until", 0) > now)
            fair = max(mine["min"], doc["total_pages"] // max(active, 1))
            room = min(room, fair - mine["held"])
        return max(0, room)

    def acquire(self, n: int) -> bool:
        self._cached = None
        now = time.monotonic()
        with self._locked() as doc:
            mine = doc["procs"][str(self.pid)]
            if n > self._room(doc, str(self.pid), now):
                mine["want_until"] = now + WANT_S  # others keep to their share meanwhile
                self._wanted_at = now
                return False
            mine["held"] += n
            mine.pop("want_until", None)
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
        with self._locked() as doc:
            doc["procs"][str(self.pid)]["want_until"] = now + WANT_S

    def release(self, n: int) -> None:
        if n > self.held:
            raise ValueError(f"release of {n} pages, {self.held} held")
        self._cached = None
        with self._locked() as doc:
            doc["procs"][str(self.pid)]["held"] -= n
        self.held -= n

    def excess(self) -> int:
        return max(0, self.held - self.max)

    def available(self) -> int:
        """Pages :meth:`acquire` would give now (another process may take them first: a
        ``can_grow`` that says yes is then answered by ``CacheFull``, which a scheduler
        handles by preempting, as for any full pool). Read at most every TTL_S seconds."""
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < TTL_S:
            return self._cached[1]
        with self._locked() as doc:
            room = self._room(doc, str(self.pid), now)
        self._cached = (now, room)
        return room

    def snapshot(self) -> dict:
        """The ledger now (dead processes reaped): total and per-pid held / min / max."""
        with self._locked() as doc:
            return json.loads(json.dumps(doc))

    def close(self) -> None:
        """Leave the ledger (what is held goes back); the cache must have released it."""
        if self._fd < 0:
            return
        with self._locked() as doc:
            doc["procs"].pop(str(self.pid), None)
        os.close(self._fd)
        self._fd = -1
