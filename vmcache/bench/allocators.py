"""The allocators the harness compares, behind one token-level interface.

    StaticAlloc   every sequence reserves L_max tokens up front (slots of the budget)
    OrcaAlloc     one contiguous extent per sequence in one arena, grown in chunks of ΔL tokens:
                  in place if the next hole is free, else moved to the first hole that fits
                  (copy); fails when no hole fits even if the free total would (fragmentation)
    CacheAlloc    the real VMKVCache / PagedKVCache (on the sizing backend / meta device)

Handles are ints. ``snapshot()`` returns bytes: ``held`` (physical), ``logical`` (per-sequence
allocation, shared pages counted per sequence), ``granule`` (allocation rounded to the
allocator's growth unit), ``used`` (tokens × bytes/token).
"""

from __future__ import annotations

from ..errors import CacheFull


class StaticAlloc:
    kind = "static"
    can_fragment = False  # equal slots: any free slot fits any request

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

    def can_admit(self, tokens: int, running: int = 0, k: int = 1) -> bool:
        return len(self.lens) + k <= self.slots

    uses_ids = False  # token ids matter only to a prefix-caching cache
    last_hit = 0  # prompt tokens the last admit found cached

    def admit(self, tokens: int, ids=None) -> int:
        if not self.can_admit(tokens):
            raise CacheFull("no free static slot", wanted=1, free=0)
        self._next += 1
        self.lens[self._next] = tokens
        return self._next

    def can_grow(self, h: int, n: int) -> bool:
        return self.lens[h] + n <= self.l_max

    def grow(self, h: int, n: int, ids=None) -> None:
        self.lens[h] += n

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

    def snapshot(self) -> dict:
        used = sum(self.lens.values()) * self.bpt
        held = len(self.lens) * self.l_max * self.bpt
        return {"held": held, "logical": held, "granule": used, "used": used}


class OrcaAlloc(StaticAlloc):
    kind = "orca"
    can_fragment = True  # free memory can be split into holes too small to use

    def __init__(self, bytes_per_token: int, budget_bytes: int, l_max: int, chunk: int) -> None:
        super().__init__(bytes_per_token, budget_bytes, l_max)
        self.chunk = chunk
        self.capacity = budget_bytes // bytes_per_token  # arena size in tokens
        self.holes: list[list[int]] = [[0, self.capacity]]  # sorted [start, end)
        self.ext: dict[int, list[int]] = {}  # handle -> [start, size]

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

    def can_admit(self, tokens: int, running: int = 0, k: int = 1) -> bool:
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
            else:  # move: first fit elsewhere, copy, release the old extent
                new = self._first_fit(size + extra)
                if new is None:
                    raise CacheFull(
                        "no hole fits the resized sequence", wanted=size + extra, free=0
                    )
                self.copied_bytes += self.lens[h] * self.bpt
                self._release(start, size)
                self.ext[h] = [new, size + extra]
        self.lens[h] += n

    def free(self, h: int) -> None:
        start, size = self.ext.pop(h)
        self._release(start, size)
        del self.lens[h]

    def snapshot(self) -> dict:
        used = sum(self.lens.values()) * self.bpt
        held = sum(size for _, size in self.ext.values()) * self.bpt
        return {"held": held, "logical": held, "granule": held, "used": used}


class CacheAlloc:
    """A real cache: admission keeps one page per table free for each running sequence."""

    can_fragment = False  # any free page serves any sequence

    def __init__(self, kind: str, cache) -> None:
        self.kind, self.kv = kind, cache
        self.bpt = cache.spec.bytes_per_token
        self.uses_ids = cache.prefix is not None
        self.last_hit = 0

    @property
    def copied_bytes(self) -> int:
        return self.kv.cow_bytes_copied

    def free_bytes(self) -> int:
        return self.kv.pool.stats().free_pages * self.kv.page_bytes

    def need_bytes(self, tokens: int) -> int:
        return self.kv.pages_for_tokens(tokens) * self.kv.page_bytes

    def can_admit(self, tokens: int, running: int = 0, k: int = 1) -> bool:
        kv = self.kv
        slots = kv.max_seqs - len(kv.sequences) >= k
        # the first write of each fork copies its partly used tail page
        pages = kv.pages_for_tokens(tokens) + (k - 1 + running) * kv.pages_for_tokens(1)
        return slots and kv.pool.can_allocate(pages)

    def admit(self, tokens: int, ids=None) -> int:
        """A sequence of ``tokens``; with prefix caching its cached prefix is mapped in and
        only the rest is allocated (at least the last token: it yields the next logits)."""
        kv = self.kv
        s = kv.new_sequence(prefix_tokens=ids if self.uses_ids else None)
        hit = min(kv.seq_len(s), tokens - 1)
        try:
            kv.truncate(s, hit)
            kv.grow(s, tokens - hit, token_ids=ids[hit:] if self.uses_ids else None)
        except CacheFull:
            kv.free(s)
            raise
        if self.uses_ids:
            kv.cache_prefix(s)
        self.last_hit = hit
        return s

    def can_grow(self, h: int, n: int) -> bool:
        return self.kv.can_grow(h, n)

    def grow(self, h: int, n: int, ids=None) -> None:
        self.kv.grow(h, n, token_ids=ids)

    def fork(self, h: int, k: int) -> list[int]:
        return self.kv.fork(h, k)

    def assign(self, dsts: list[int], srcs: list[int]) -> None:
        self.kv.assign(dsts, srcs)

    def free(self, h: int) -> None:
        self.kv.free(h)

    def snapshot(self) -> dict:
        st = self.kv.stats()
        # pages only the prefix index holds are a cache, evicted on demand: not "held"
        cached = self.kv.prefix.reclaimable() if self.kv.prefix is not None else 0
        return {"held": st.physical_bytes - cached * self.kv.page_bytes,
                "logical": st.mapped_bytes, "granule": st.mapped_bytes,
                "used": st.used_bytes, "cached": cached * self.kv.page_bytes}  # fmt: skip
