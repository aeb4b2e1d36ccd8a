"""SequenceCache: the sequence bookkeeping both caches share (slots, lengths, page tables,
grow / fork / copy-on-write / free / swap), written once over a few physical hooks.

A sequence owns ``T`` page tables (VMKVCache: one per virtual K/V tensor; PagedKVCache: one
block table). Page ``j`` of a table covers units ``[j·P, (j+1)·P)`` of the row, where a token
is ``u`` units (VMKVCache: u = bytes per token row, P = page bytes; paged: u = 1, P = B):

    row:   | page 0          | page 1          | page 2 (tail) |
    units: 0                 P                 2P     L·u      3P
                                                      ^ length: page 2 is partly used

Every public call validates first, then allocates all pages it needs (``CacheFull`` here
changes nothing), then runs the fallible physical steps with an undo log, then commits
bookkeeping that cannot fail. The caches alone change page tables; the pool alone refcounts.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice
from typing import Any

import torch

from .errors import CacheFull, check_int
from .invariants import check_invariants
from .pool import PagePool
from .prefix import PrefixIndex, PrefixOps
from .reserve import ReserveOps
from .sharing import SharingOps
from .spec import KVSpec
from .stats import CacheStats
from .swap import SwapOps

_check_int = check_int  # the name cache.py and paged_fallback import


def _check_tokens(name: str, ids) -> list[int]:
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    ids = list(ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise TypeError(f"{name} must be a sequence of int token ids")
    return ids


class SequenceCache(SharingOps, SwapOps, PrefixOps, ReserveOps):
    def __init__(
        self,
        spec: KVSpec,
        max_seqs: int,
        max_seq_len: int,
        pool: PagePool,
        *,
        num_tables: int,
        units_per_token: int,
        units_per_page: int,
        page_bytes: int,
        device: torch.device,
        swap_bytes: int | None,
        prefix_caching: bool = False,
    ) -> None:
        self.spec = spec
        self.max_seqs = max_seqs
        self.max_seq_len = max_seq_len
        self.pool = pool
        self.device = device
        self.page_bytes = page_bytes
        self._T = num_tables
        self._u = units_per_token
        self._P = units_per_page
        self._swap_limit = swap_bytes
        self._swapped_bytes = 0  # host bytes held by live swap handles
        self._lens = [0] * max_seqs
        self._tables: list[list[list[int]] | None] = [None] * max_seqs  # owned by the cache
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._tokens: list[list[int] | None] = [None] * max_seqs  # token ids, None = unknown
        self._salts: list[object] = [None] * max_seqs  # tenant salt for the prefix index
        self._ahead: list[list[list[int]]] = [[[] for _ in range(num_tables)]
                                                 for _ in range(max_seqs)]  # fmt: skip
        self.reserved_pages_mapped = 0  # pages mapped ahead by reserve() (owned here)
        self.prefix: PrefixIndex | None = None  # owned here; holds pool references
        if prefix_caching:
            if units_per_page % units_per_token:
                raise ValueError(
                    "prefix caching needs pages that hold whole tokens; "
                    f"{units_per_page} is not a multiple of {units_per_token}"
                )
            self.prefix = PrefixIndex(pool, units_per_page // units_per_token, num_tables)
            pool.reclaimer = self.prefix
        self._lens_tensor: torch.Tensor | None = None
        self.epoch = 0  # bumped whenever a length or a page table changes (owned here)
        self.step_plan = None  # per-step kernel metadata memo; owned by vmcache.kernels.plan
        self.plans_built = 0  # how many plans (device uploads) vmcache.kernels built
        self.cow_copies = 0  # pages copied on write since construction (owned by the cache)
        self.cow_bytes_copied = 0  # bytes those copies moved (used part of each page only)

    # --- hooks a cache implements ------------------------------------------------------
    def _attach(self, s: int, t: int, j0: int, pages: list[int]) -> None:
        raise NotImplementedError

    def _detach(self, s: int, t: int, j0: int, n: int) -> None:
        raise NotImplementedError

    def _copy_page(self, src: int, dst: int, used_units: int) -> None:
        raise NotImplementedError

    def _tables_of_layer(self, layer: int) -> list[int]:
        raise NotImplementedError

    def _store(self, layer: int, s: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def _export(self, s: int, length: int) -> list[torch.Tensor]:
        raise NotImplementedError

    def _import(self, s: int, payload: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def _sync(self) -> None:
        pass

    # --- queries -----------------------------------------------------------------------
    def _pages_for(self, length: int) -> int:
        return -(-length * self._u // self._P)

    def _used_units(self, j: int, length: int) -> int:
        return max(0, min(self._P, length * self._u - j * self._P))

    def _check_seq(self, s: Any) -> int:
        _check_int("sequence id", s)
        if not 0 <= s < self.max_seqs or self._tables[s] is None:
            raise KeyError(f"sequence {s} is not live (unknown, freed or swapped out)")
        return s

    def _check_layer(self, layer: Any) -> int:
        _check_int("layer", layer)
        if not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer must be in [0, {self.spec.num_layers}), got {layer}")
        return layer

    def pages_for_tokens(self, n: int) -> int:
        """Pages a new sequence of ``n`` tokens maps (every table), for admission planning."""
        return self._T * self._pages_for(n)

    def seq_len(self, s: int) -> int:
        return self._lens[self._check_seq(s)]

    @property
    def sequences(self) -> list[int]:
        return [s for s in range(self.max_seqs) if self._tables[s] is not None]

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def seq_lens(self) -> torch.Tensor:
        """``[max_seqs]`` int32 on the cache's device; 0 for slots not in use."""
        if self._lens_tensor is None:
            self._lens_tensor = torch.tensor(self._lens, dtype=torch.int32, device=self.device)
        return self._lens_tensor

    def page_table(self, s: int) -> list[list[int]]:
        """A copy of sequence ``s``'s page tables (``T`` lists of page ids)."""
        return [list(t) for t in self._tables[self._check_seq(s)]]

    def _splits(self, s: int, tables: list[int], j_lo: int, j_hi: int) -> list[tuple[int, int]]:
        tab, rc = self._tables[s], self.pool.refcount
        if j_hi - j_lo == 1:  # one page per table (a grow's tail): the common case
            return [(t, j_lo) for t in tables if j_lo < len(tab[t]) and rc(tab[t][j_lo]) > 1]
        return [(t, j) for t in tables for j in range(j_lo, min(j_hi, len(tab[t])))
                if rc(tab[t][j]) > 1]  # fmt: skip

    def _grow_plan(self, s: int, n: int) -> tuple[list[tuple[int, int]], int, int]:
        length = self._lens[s]
        p_old, p_new = self._pages_for(length), self._pages_for(length + n)
        splits = []
        if n > 0 and (length * self._u) % self._P:  # new tokens land in the partly used tail
            splits = self._splits(s, list(range(self._T)), p_old - 1, p_old)
        return splits, p_old, p_new

    def can_grow(self, s: int, n: int) -> bool:
        """Whether ``grow(s, n)`` would succeed now (for schedulers; raises nothing for n)."""
        s = self._check_seq(s)
        if not isinstance(n, int) or n < 0 or self._lens[s] + n > self.max_seq_len:
            return False
        splits, p_old, p_new = self._grow_plan(s, n)
        ready = min(len(self._ahead[s][0]), p_new - p_old)
        return self.pool.can_allocate(len(splits) + self._T * (p_new - p_old - ready))

    # --- sequence lifecycle ------------------------------------------------------------
    def new_sequence(self, slot: int | None = None, prefix_tokens=None, salt=None) -> int:
        """A new sequence. ``slot`` asks for that particular free slot (callers that keep
        batch row i in slot i, like :mod:`vmcache.hf`). With ``prefix_tokens`` (token ids) and
        prefix caching on, the leading full pages already cached under ``salt`` are mapped in,
        nothing copied: ``seq_len`` is then the number of tokens whose K/V are present."""
        if slot is not None:
            _check_int("slot", slot)
            if slot not in self._free_slots:
                raise ValueError(f"slot {slot} is not free (max_seqs={self.max_seqs})")
        elif not self._free_slots:
            raise CacheFull(f"all {self.max_seqs} sequence slots are in use", wanted=1, free=0)
        if prefix_tokens is not None:
            prefix_tokens = _check_tokens("prefix_tokens", prefix_tokens)
        s = self._free_slots.pop() if slot is None else slot
        if slot is not None:
            self._free_slots.remove(slot)
        self._tables[s] = [[] for _ in range(self._T)]
        self._set_len(s, 0)
        self._tokens[s], self._salts[s] = [], salt
        if prefix_tokens and self.prefix is not None:
            try:
                self._attach_prefix(s, prefix_tokens)
            except BaseException:
                self.free(s)
                raise
        return s

    def grow(self, s: int, n: int, token_ids=None) -> None:
        """Length += n: map the pages the new length needs; split a shared tail page.
        ``token_ids`` (n ids) records what the new positions hold, for prefix caching."""
        s = self._check_seq(s)
        _check_int("n", n)
        if n < 0:
            raise ValueError(f"grow needs n >= 0, got {n}")
        if token_ids is not None:
            token_ids = _check_tokens("token_ids", token_ids)
            if len(token_ids) != n:
                raise ValueError(f"grow({s}, {n}) got {len(token_ids)} token ids")
        if self._lens[s] + n > self.max_seq_len:
            raise ValueError(
                f"grow({s}, {n}) would reach {self._lens[s] + n} tokens, past max_seq_len "
                f"{self.max_seq_len}"
            )
        if n == 0:
            return
        splits, p_old, p_new = self._grow_plan(s, n)
        take = self._take_reserved(s, p_new - p_old)  # mapped ahead by reserve()
        try:
            self._split_and_extend(s, splits, p_old + take, p_new)
        except BaseException:
            self._untake_reserved(s, take)
            raise
        known = self._tokens[s]
        if token_ids is not None and known is not None and len(known) == self._lens[s]:
            known.extend(token_ids)
        else:
            self._tokens[s] = None
        self._set_len(s, self._lens[s] + n)

    def write(self, layer: int, s: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` (each ``[T, N_KV, d_h]``, the cache's dtype and device) at
        positions ``[start, start+T)`` of sequence ``s``, which must be within its length.
        Pages still shared with another sequence are copied first (copy-on-write)."""
        layer, s, n = self._check_write(layer, s, start, k, v)
        if n == 0:
            return
        j_lo, j_hi = start * self._u // self._P, self._pages_for(start + n)
        splits = self._splits(s, self._tables_of_layer(layer), j_lo, j_hi)
        if splits:
            p = self._pages_for(self._lens[s])
            self._split_and_extend(s, splits, p, p)
        self._store(layer, s, start, k, v)

    def free(self, s: int) -> None:
        """Drop the sequence: unmap its pages, refcounts −1, pages at 0 return to the pool.
        With prefix caching, its full pages of known tokens stay cached (index references)."""
        s = self._check_seq(s)
        self.cache_prefix(s)
        self._drop_reserved(s)
        tab = self._tables[s]
        self._sync()
        for t in range(self._T):
            self._detach(s, t, 0, len(tab[t]))
        self.pool.decref([p for t in tab for p in t])
        self._tables[s] = self._tokens[s] = self._salts[s] = None
        self._set_len(s, 0)
        self._free_slots.append(s)

    def _check_write(self, layer, s, start, k, v) -> tuple[int, int, int]:
        """Validate a write; returns (layer, sequence, token count)."""
        layer = self._check_layer(layer)
        s = self._check_seq(s)
        _check_int("start", start)
        spec = self.spec
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 3 or tuple(x.shape[1:]) != (spec.num_kv_heads, spec.head_dim):
                raise ValueError(
                    f"{name} must have shape [T, {spec.num_kv_heads}, {spec.head_dim}], "
                    f"got {list(x.shape)}"
                )
            if x.dtype != spec.dtype:
                raise TypeError(f"{name} must have dtype {spec.dtype}, got {x.dtype}")
            if x.device.type != self.device.type:
                raise ValueError(f"{name} must be on {self.device}, got {x.device}")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k and v hold different token counts: {k.shape[0]} vs {v.shape[0]}")
        n = k.shape[0]
        if start < 0 or start + n > self._lens[s]:
            raise ValueError(
                f"write of {n} tokens at {start} is outside sequence {s}'s length "
                f"{self._lens[s]}; grow it first"
            )
        return layer, s, n

    # --- the transactional core --------------------------------------------------------
    def _split_and_extend(
        self, s: int, splits: list[tuple[int, int]], j_from: int, j_to: int
    ) -> None:
        """Copy-on-write ``splits`` (table, page index) of ``s`` and map pages
        ``[j_from, j_to)`` in every table: all of it, or (after an exception) none of it."""
        self._split_pages([(s, t, j) for t, j in splits], s, j_from, j_to)

    def _split_pages(
        self, splits: list[tuple[int, int, int]], s_ext: int | None = None, j_from: int = 0,
        j_to: int = 0,
    ) -> None:  # fmt: skip
        """The transactional core: copy-on-write ``splits`` (sequence, table, page index),
        possibly of several sequences, and map pages ``[j_from, j_to)`` in every table of
        ``s_ext``. Every page is allocated first (``CacheFull`` here changes nothing), then
        the fallible steps run with an undo log, then bookkeeping that cannot fail commits."""
        n_ext = self._T * (j_to - j_from) if s_ext is not None else 0
        fresh = self.pool.allocate(len(splits) + n_ext)
        undo: list[Callable[[], None]] = []
        replaced: list[tuple[int, int, int, int, int]] = []  # (seq, table, index, old, new)
        if splits:
            self._sync()  # the old pages are unmapped below: no kernel may still read them
        try:
            it = iter(fresh)
            for s, t, j in splits:
                old, new = self._tables[s][t][j], next(it)
                self._copy_page(old, new, self._used_units(j, self._lens[s]))
                self._detach(s, t, j, 1)
                undo.append(lambda s=s, t=t, j=j, old=old: self._attach(s, t, j, [old]))
                self._attach(s, t, j, [new])
                undo.append(lambda s=s, t=t, j=j: self._detach(s, t, j, 1))
                replaced.append((s, t, j, old, new))
            n = j_to - j_from
            extension = [list(islice(it, n)) for _ in range(self._T if s_ext is not None else 0)]
            if n and extension:
                self._attach_row(s_ext, j_from, extension)  # all tables or none
                undo.append(lambda: [self._detach(s_ext, t, j_from, n) for t in range(self._T)])
        except BaseException:
            for f in reversed(undo):
                f()
            self.pool.decref(fresh)
            raise
        for s, t, j, _, new in replaced:
            self._tables[s][t][j] = new
            self.cow_bytes_copied += self._used_units(j, self._lens[s]) * self.page_bytes // self._P
        self.cow_copies += len(replaced)
        self.epoch += 1
        self.pool.decref([old for *_, old, _ in replaced])
        for t, pages in enumerate(extension):
            self._tables[s_ext][t].extend(pages)

    def _set_len(self, s: int, length: int) -> None:
        self._lens[s] = length
        self._lens_tensor = None
        self.epoch += 1

    # --- stats -------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        live = self.sequences
        entries = sum(len(t) for s in live for t in self._tables[s])
        pool = self.pool.stats()
        tokens = sum(self._lens[s] for s in live)
        return CacheStats(
            num_sequences=len(live),
            num_tokens=tokens,
            page_bytes=self.page_bytes,
            mapped_bytes=entries * self.page_bytes,
            used_bytes=self.spec.kv_bytes(tokens),
            physical_pages=pool.used_pages,
            physical_bytes=pool.used_pages * self.page_bytes,
            shared_pages=pool.shared_pages,
            free_pages=pool.free_pages,
            total_pages=pool.num_pages,
            cow_copies=self.cow_copies,
            cow_bytes_copied=self.cow_bytes_copied,
        )

    def check_invariants(self) -> None:
        """Check invariants 1–2 (refcounts = mappings; free list ⇔ refcount 0) and the
        bookkeeping around them; raises :class:`~vmcache.errors.InvariantError`. For tests and
        soak runs; O(pages)."""
        check_invariants(self)
