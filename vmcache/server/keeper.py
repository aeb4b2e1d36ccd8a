"""One served model's share of a KV budget, kept on its engine thread between steps: the
ledger's limits applied, idle prefix pages yielded to others, sleep after idleness, wake on
the next request.

    every check_s (idle or not)   read the ledger row: limit, shed flag, others' unmet demand
      limit lowered + shed        preempt sequences (the engine's victim policy) until it fits
      others want pages, or       free pages given back, then idle prefix-cached pages
      idle while others grow and  evicted, down to its floor (promised to it anyway): an
      < 1/4 of the budget is      idle model's cache goes before another model's sequences
      left for it                 must preempt (they take a tick, 0.1 s, to notice); a
                                  model alone keeps its cache
      idle >= sleep_after_s       sleep (below)
    before a request is added     wake if asleep

Sleep, as vLLM's levels: 1 gives back every KV page (the prefix index dropped: its K/V would
be lost) and the floor (the ledger's minimum drops to 0, so others may use it); 2 also drops
the weights' memory, loaded again from the model's source on wake (eager engines only: the
compiled step keeps packed copies of them); on the CPU the heap memory freed is handed back
to the OS (glibc's ``malloc_trim``). A model wakes with its floor promised again and
its next request gets the same tokens as before (nothing of the model changed).

The keeper uses the engine's and the cache's public calls only (``kv.elastic``,
``kv.prefix.index``, ``engine.preempt_one``) and the budget's (:class:`SharedBudget`).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

import torch

from vmcache.engine.runner import ModelRunner
from vmcache.memory.ledger_rows import LedgerError

SLEEP_LEVELS = (1, 2)


def return_freed_heap() -> None:
    """Hand the heap memory glibc keeps after frees back to the OS (a PagedKVCache's block
    tensor and dropped weights are host allocations it would keep for reuse, so the
    process's resident memory would not fall); nothing where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def drop_weights(model) -> int:
    """Free the memory of every parameter of ``model`` (each becomes an empty tensor of its
    dtype, the Parameter objects stay); returns the bytes dropped."""
    freed = 0
    for p in model.parameters():
        freed += p.numel() * p.element_size()
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return freed


def restore_weights(model, fresh) -> None:
    """Every parameter of ``model`` takes ``fresh``'s tensor of the same name (the same
    architecture, loaded again from its source)."""
    new = dict(fresh.named_parameters())
    for name, p in model.named_parameters():
        if name not in new:
            raise ValueError(f"the reloaded model has no parameter {name!r}")
        p.data = new[name].data.to(p.device)


class Keeper:
    """Housekeeping of one model's engine over its ``budget`` (a :class:`SharedBudget`, whose
    pages may be a :class:`ScaledBudget`'s units; None: the model has a pool of its own and
    only sleeps). ``floor_pages``: the ledger minimum it holds while awake;
    ``units_per_page``: ledger pages one cache page counts for (the ScaledBudget's).
    ``reload()``: the model loaded again from its source (level 2)."""

    def __init__(self, budget, floor_pages: int, *, units_per_page: int = 1,
                 sleep_after_s: float | None = None,
                 sleep_level: int = 1, reload: Callable[[], object] | None = None,
                 check_s: float = 0.1) -> None:  # fmt: skip
        if sleep_level not in SLEEP_LEVELS:
            raise ValueError(f"sleep_level must be one of {SLEEP_LEVELS}, got {sleep_level!r}")
        if sleep_after_s is not None and not sleep_after_s > 0:
            raise ValueError(f"sleep_after_s must be > 0, got {sleep_after_s!r}")
        self.budget, self.floor_pages, self.units_per_page = budget, floor_pages, units_per_page
        self.sleep_after_s, self.sleep_level = sleep_after_s, sleep_level
        self.reload, self.check_s = reload, check_s
        self.level = 0  # 0 awake, else the level it sleeps at (engine thread writes)
        self.last_busy_s = time.monotonic()
        self._checked_s = -float("inf")
        self.yielded_pages = 0  # prefix pages evicted for other holders
        self._others_held = 0  # the other holders' pages at the last check
        self.shed_sequences = 0  # sequences preempted to meet a lowered limit
        self.sleeps = self.wakes = 0
        self.ledger_faults = 0  # ledger writes of sleep / wake / floor that failed (retried)
        self.ledger_fault: str | None = None

    @property
    def asleep(self) -> bool:
        return self.level > 0

    # --- on the engine thread ---------------------------------------------------------------
    def tick(self, engine, busy: bool) -> None:
        now = time.monotonic()
        if busy:
            self.last_busy_s = now
        if now - self._checked_s < self.check_s or self.asleep:
            return
        self._checked_s = now
        b, kv = self.budget, engine.kv
        if b is None:  # a model with its own pool: only its sleep to keep
            self._maybe_sleep(engine, busy, now)
            return
        room = b.available()  # reads the row: limit, shed flag, whether others want pages
        if b.min < min(self.floor_pages, b.max) or b.asleep:  # not all promised at wake
            self._promise_floor(asleep=False)
        if b.shed and b.excess():
            while b.excess() and engine.preempt_one():
                self.shed_sequences += 1
        # others want pages, or (idle) others grow into a nearly spent budget: what this
        # model holds beyond its floor (promised to it whether held or not) and does not use
        growing, self._others_held = b.others_held > self._others_held, b.others_held
        tight = not busy and growing and room < b.total // 4
        if b.contended or b.excess() or tight:
            self._yield(kv)
        self._maybe_sleep(engine, busy, now)

    def _yield(self, kv) -> None:
        """Free pages back, then idle prefix pages, down to the floor (or the limit)."""
        b = self.budget
        kv.elastic.trim(0)
        over = -(-(b.held - min(b.min, b.max)) // self.units_per_page)
        index = kv.prefix.index
        if over > 0 and index is not None and index.reclaimable():
            self.yielded_pages += index.reclaim(min(over, index.reclaimable()))
            kv.elastic.trim(0)

    def _maybe_sleep(self, engine, busy: bool, now: float) -> None:
        idle_s = now - self.last_busy_s
        if not busy and self.sleep_after_s is not None and idle_s >= self.sleep_after_s:
            self.sleep(engine, self.sleep_level)

    def sleep(self, engine, level: int = 1) -> int:
        """Sleep at ``level`` (nothing may run: ``RuntimeError`` otherwise); returns the bytes
        given back (KV, and weights at level 2). Asleep already: 0. All or nothing: the
        ledger records it first (a :class:`LedgerError` there changes nothing), and a cache
        that cannot sleep has its floor promised again."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level must be one of {SLEEP_LEVELS}, got {level!r}")
        if self.asleep:
            return 0
        if engine.scheduler.has_work():
            raise RuntimeError("the model is serving requests; sleep it when they end")
        if level == 2 and (self.reload is None or not isinstance(engine.runner, ModelRunner)):
            raise ValueError("sleep level 2 drops the weights: it needs an eager engine and a "
                             "source to load them from again")  # fmt: skip
        b = self.budget
        if b is not None:  # first: a ledger that cannot record it leaves all as it was
            b.set_limits(min_pages=0, asleep=True)
        try:
            freed = engine.kv.elastic.sleep(keep="none")
            try:
                if level == 2:
                    freed += drop_weights(engine.runner.model)
            except BaseException:
                engine.kv.elastic.wake()
                raise
        except BaseException:
            if b is not None:  # the floor back (a ledger fault here is retried by a tick)
                self._promise_floor(asleep=False)
            raise
        if engine.kv.config.device.type == "cpu":
            return_freed_heap()
        self.level = level
        self.sleeps += 1
        return freed

    def wake(self, engine) -> None:
        """Back from sleep: weights loaded again (level 2), pages on demand, the floor
        promised again within the limit the ledger has now. A reload or a cache that
        cannot wake leaves the model asleep as it was (the next request tries again); the
        floor, where the ledger cannot take it now, is promised by a later tick."""
        if not self.asleep:
            return
        if self.level == 2:
            restore_weights(engine.runner.model, self.reload())
        try:
            engine.kv.elastic.wake()
        except BaseException:
            if self.level == 2:
                drop_weights(engine.runner.model)
            raise
        self.level = 0
        self.last_busy_s = time.monotonic()
        self.wakes += 1
        if self.budget is not None:
            self._promise_floor(asleep=False)

    def _promise_floor(self, asleep: bool | None = None) -> None:
        """The floor on the ledger: as much of it as the limit and the others' floors leave
        (a later tick raises it when they leave more)."""
        b = self.budget
        try:
            b.promise_floor(self.floor_pages, asleep=asleep)
        except LedgerError as e:
            self.ledger_faults += 1
            self.ledger_fault = str(e)

    def admit(self, engine) -> None:
        """A request is about to be added: wake first."""
        self.wake(engine)
