"""The allocators the harness compares, behind one token-level interface.

    StaticAlloc   every sequence reserves L_max tokens up front (slots of the budget)
    OrcaAlloc     one contiguous extent per sequence in one arena, grown in chunks of ΔL tokens:
                  in place if the next hole is free, else moved to the first hole that fits
                  (copy); fails when no hole fits even if the free total would (fragmentation)
    CacheAlloc    the real VMKVCache / PagedKVCache (on the sizing backend / meta device)

Handles are ints. Every query the simulator asks per step is O(1) or O(one sequence):
``mapped_bytes(h)`` (what the sequence's allocation covers; shared pages counted per
sequence), ``headroom(h)`` (tokens it can still take without allocating), ``held_bytes()``
(physical bytes in use; cached pages nobody maps excluded), ``can_admit(tokens, k, growing)``
(``growing``: running sequences whose next token needs new memory; admission leaves room for
them). ``reserves`` is True where unused allocation is a reservation (static) rather than a
partly filled granule.
"""

from __future__ import annotations

from vmcache.errors import CacheFull


class StaticAlloc:
    kind = "static"
    can_fragment = False  # equal slots: any free slot fits any request
    reserves = True  # unused slot space is reservation waste

    def __init__(self, bytes_per_token: int, budget_bytes: int, l_max: int) -> None:
        self.bpt, self.l_max = bytes_per_token, l_max
        self.slots = budget_bytes // (l_max * bytes_per_token)
        self.lens: dict[int, int] = {}
        self._next = 0
        self.copied_bytes = 0

    def free_bytes(self) -> int:
        return (self.slots - len(self.lens)) * self.l_max * self.bpt

    def need_bytes(self, tokens: int) -> int:
        return self.l_max * self.bpt

    def can_admit(self, tokens: int, k: int = 1, growing: int = 0) -> bool:
        return len(self.lens) + k <= self.slots

    uses_ids = False  # token ids matter only to a prefix-caching cache
    last_hit = 0  # prompt tokens the last admit found cached

    def admit(self, tokens: int, ids=None) -> int:
        """A sequence of ``tokens`` tokens (the first chunk of its prompt)."""
        if not self.can_admit(tokens):
            raise CacheFull("no free static slot", wanted=1, free=0)
        self._next += 1
        self.lens[self._next] = tokens
        return self._next

    def cached_tokens(self, ids) -> int:
        return 0

    def cache_prefix(self, h: int) -> None:
        pass

    def mapped_bytes(self, h: int) -> int:
        return self.l_max * self.bpt

    def headroom(self, h: int) -> int:
        return self.l_max - self.lens[h]

    def held_bytes(self) -> int:
        return len(self.lens) * self.l_max * self.bpt

    def can_grow(self, h: int, n: int) -> bool:
        return self.lens[h] + n <= self.l_max

    def grow(self, h: int, n: int, ids=None) -> None:
        self.lens[h] += n

    def try_grow(self, h: int, n: int, ids=None) -> bool:
        """``grow`` where it fits, else False and nothing changed (one call: a scheduler's
        check and its allocation, as vLLM's ``allocate_slots``)."""
        if not self.can_grow(h, n):
            return False
        self.grow(h, n, ids)
        return True

    def fork(self, h: int, k: int) -> list[int]:
        kids = [self.admit(self.lens[h]) for _ in range(k)]
        self.copied_bytes += k * self.lens[h] * self.bpt
        return kids

    def assign(self, dsts: list[int], srcs: list[int]) -> None:
        lens = {s: self.lens[s] for s in srcs}
        for d, s in zip(dsts, srcs):
            if d != s:
                self.copied_bytes += lens[s] * self.bpt  # a gather copy of the whole history
            self.lens[d] = lens[s]

    def free(self, h: int) -> None:
        del self.lens[h]


class OrcaAlloc(StaticAlloc):
    kind = "orca"
    can_fragment = True  # free memory can be split into holes too small to use
    reserves = False  # unused extent space is internal (a partly filled chunk)

    def __init__(self, bytes_per_token: int, budget_bytes: int, l_max: int, chunk: int) -> None:
        super().__init__(bytes_per_token, budget_bytes, l_max)
        self.chunk = chunk
        self.capacity = budget_bytes // bytes_per_token  # arena size in tokens
        self.holes: list[list[int]] = [[0, self.capacity]]  # sorted [start, end)
        self.ext: dict[int, list[int]] = {}  # handle -> [start, size]
        self._held = 0  # bytes of all extents

    def _round(self, tokens: int) -> int:
        return -(-tokens // self.chunk) * self.chunk

    def free_bytes(self) -> int:
        return sum(e - s for s, e in self.holes) * self.bpt

    def need_bytes(self, tokens: int) -> int:
        return self._round(tokens) * self.bpt

    def _first_fit(self, size: int) -> int | None:
        for i, (s, e) in enumerate(self.holes):
            if e - s >= size:
                self.holes[i][0] += size
                if self.holes[i][0] == e:
                    del self.holes[i]
                return s
        return None

    def _release(self, start: int, size: int) -> None:
        self.holes.append([start, start + size])
        self.holes.sort()
        merged = [self.holes[0]]
        for s, e in self.holes[1:]:
            if s == merged[-1][1]:
                merged[-1][1] = e
            else:
                merged.append([s, e])
        self.holes = merged

    def can_admit(self, tokens: int, k: int = 1, growing: int = 0) -> bool:
        size, free = self._round(tokens), [e - s for s, e in self.holes]
        for _ in range(k):  # k extents, first fit
            i = next((i for i, f in enumerate(free) if f >= size), None)
            if i is None:
                return False
            free[i] -= size
        return True

    def admit(self, tokens: int, ids=None) -> int:
        size = self._round(tokens)
        start = self._first_fit(size)
        if start is None:
            raise CacheFull(f"no hole of {size} tokens", wanted=size, free=0)
        self._next += 1
        self.lens[self._next], self.ext[self._next] = tokens, [start, size]
        self._held += size * self.bpt
        return self._next

    def can_grow(self, h: int, n: int) -> bool:
        start, size = self.ext[h]
        if self.lens[h] + n <= size:
            return True
        extra = self._round(self.lens[h] + n) - size
        after = next((e - s for s, e in self.holes if s == start + size), 0)
        return after >= extra or self.can_admit(size + extra)

    def grow(self, h: int, n: int, ids=None) -> None:
        start, size = self.ext[h]
        if self.lens[h] + n > size:
            extra = self._round(self.lens[h] + n) - size
            hole = next((x for x in self.holes if x[0] == start + size), None)
            if hole is not None and hole[1] - hole[0] >= extra:  # resize in place
                hole[0] += extra
                if hole[0] == hole[1]:
                    self.holes.remove(hole)
                self.ext[h][1] += extra
                self._held += extra * self.bpt
            else:  # move: first fit elsewhere, copy, release the old extent
                new = self._first_fit(size + extra)
                if new is None:
                    raise CacheFull(
                        "no hole fits the resized sequence", wanted=size + extra, free=0
                    )
                self.copied_bytes += self.lens[h] * self.bpt
                self._release(start, size)
                self.ext[h] = [new, size + extra]
                self._held += extra * self.bpt
        self.lens[h] += n

    def free(self, h: int) -> None:
        start, size = self.ext.pop(h)
        self._release(start, size)
        del self.lens[h]
        self._held -= size * self.bpt

    def mapped_bytes(self, h: int) -> int:
        return self.ext[h][1] * self.bpt

    def headroom(self, h: int) -> int:
        return self.ext[h][1] - self.lens[h]

    def held_bytes(self) -> int:
        return self._held


class CacheAlloc:
    """A real cache. Admission leaves one growth step of pages for every running sequence at
    a page boundary (its next token needs new pages), and for each fork the copy of the
    shared tail page its first token makes: headroom in tokens, not in pages per sequence."""

    can_fragment = False  # any free page serves any sequence
    reserves = False

    def __init__(self, kind: str, cache, share: bool = True) -> None:
        self.kind, self.kv = kind, cache
        self.share = share  # False: a fork copies its parent (the no-sharing baseline)
        self.bpt = cache.spec.bytes_per_token
        self.uses_ids = cache.prefix.index is not None
        self.last_hit = 0
        self._copied = 0  # bytes copied by forks without sharing
        self._step_pages = cache.capacity.pages_for_tokens(
            1
        )  # pages one token past a boundary needs

    @property
    def copied_bytes(self) -> int:
        return self.kv.stats().cow_bytes_copied + self._copied

    @property
    def prefix_page_tokens(self) -> int:
        """Tokens of one prefix-index entry (a full page of every table)."""
        return self.kv.prefix.tokens_per_entry

    def free_bytes(self) -> int:
        return self.kv._pool.num_free * self.kv.config.page_bytes

    def need_bytes(self, tokens: int) -> int:
        return self.kv.capacity.pages_for_tokens(tokens) * self.kv.config.page_bytes

    def can_admit(self, tokens: int, k: int = 1, growing: int = 0) -> bool:
        kv = self.kv
        if kv.capacity.free_slots < k:
            return False
        first = kv.capacity.pages_for_tokens(tokens)
        forks = (k - 1) * (self._step_pages if self.share else first)
        return kv.capacity.can_allocate(first + forks + growing * self._step_pages)

    def cached_tokens(self, ids) -> int:
        return self.kv.prefix.cached_tokens(ids) if self.uses_ids else 0

    def admit(self, tokens: int, ids=None) -> int:
        """A sequence whose first ``tokens`` prompt tokens need K/V; with prefix caching
        ``ids`` is the whole prompt: its cached prefix is mapped in (``last_hit`` tokens, at
        most all but its last token) and ``tokens`` more are allocated after it."""
        kv = self.kv
        s = kv.new_sequence(prefix_tokens=ids if self.uses_ids else None)
        hit = kv.seq_len(s)
        if self.uses_ids and hit >= len(ids):
            hit = len(ids) - 1
            kv.beams.truncate(s, hit)
        try:
            kv.grow(s, tokens, token_ids=ids[hit : hit + tokens] if self.uses_ids else None)
        except CacheFull:
            kv.free(s)
            raise
        self.last_hit = hit
        return s

    def cache_prefix(self, h: int) -> None:
        if self.uses_ids:
            self.kv.prefix.publish(h)

    def can_grow(self, h: int, n: int) -> bool:
        return self.kv.can_grow(h, n)

    def grow(self, h: int, n: int, ids=None) -> None:
        self.kv.grow(h, n, token_ids=ids)

    def try_grow(self, h: int, n: int, ids=None) -> bool:
        """The cache's grow, False where it raised CacheFull (which changes nothing): its
        plans built once, where ``can_grow`` and then ``grow`` would build them twice."""
        try:
            self.kv.grow(h, n, token_ids=ids)
        except CacheFull:
            return False
        return True

    def fork(self, h: int, k: int) -> list[int]:
        if self.share:
            return self.kv.fork(h, k)
        n = self.kv.seq_len(h)
        kids = [self.kv.new_sequence() for _ in range(k)]
        for c in kids:
            self.kv.grow(c, n)
        self._copied += k * n * self.bpt
        return kids

    def assign(self, dsts: list[int], srcs: list[int]) -> None:
        if self.share:
            self.kv.beams.assign(dsts, srcs)
        else:  # a gather copy of each history that changes hands
            self._copied += sum(self.kv.seq_len(s) for d, s in zip(dsts, srcs) if d != s) * self.bpt

    def free(self, h: int) -> None:
        self.kv.free(h)

    def mapped_bytes(self, h: int) -> int:
        return self.kv.capacity.mapped_pages(h) * self.kv.config.page_bytes

    def headroom(self, h: int) -> int:
        return self.kv.capacity.headroom(h)

    def held_bytes(self) -> int:
        """Pages in use, less those only the prefix index holds (a cache, evicted on demand)."""
        pool = self.kv._pool
        return (pool.num_used - pool.index_only) * self.kv.config.page_bytes
