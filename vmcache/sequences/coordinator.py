"""SequenceCache: the sequence coordinator both caches share. It orders every change: plan,
allocate, map, commit. Slots, lengths, token ids and tenant salts belong to
:class:`~vmcache.sequences.slots.Slots` (``self._seqs``, their only writer), the page tables
belong to one :class:`~vmcache.sequences.tables.PageTables` per attention type (full, or
sliding with its window), refcounts to the pool, memory to the cache's physical hooks.

A sequence owns ``T`` page tables (VMKVCache: one per virtual K/V tensor; PagedKVCache: one
block table per group of layers). Page ``j`` of a table covers units ``[j·P, (j+1)·P)`` of
the row, where a token is ``u`` units (VMKVCache: u = bytes per token row, P = page bytes;
paged: u = 1, P = B):

    row:   | page 0          | page 1          | page 2 (tail) |
    units: 0                 P                 2P     L·u      3P
                                                      ^ length: page 2 is partly used

Every public call validates first, then allocates all pages it needs (``CacheFull`` here
changes nothing a reader can see), then runs the fallible physical steps with an undo log,
then commits bookkeeping that cannot fail. A sliding group's release of pages its window no
longer needs is a change of its own, made before a grow allocates.
"""

from __future__ import annotations

from typing import Any

import torch

from vmcache.errors import CacheFull, check_tokens
from vmcache.errors import (
    check_int as _check_int,  # also the name cache.py and paged_fallback import
)
from vmcache.memory.pool import PagePool
from vmcache.prefix.tiers.digest import salt_bytes
from vmcache.sequences import grow
from vmcache.sequences.batch import StepBatch
from vmcache.sequences.beams import Beams, fork
from vmcache.sequences.capacity import Capacity
from vmcache.sequences.config import CacheConfig
from vmcache.sequences.core import CACHE_OWN, COORDINATOR, HOOKS, Core
from vmcache.sequences.elastic import Elastic
from vmcache.sequences.handoff import Handoff
from vmcache.sequences.hooks import PhysicalHooks
from vmcache.sequences.prefix import Prefix
from vmcache.sequences.quant import decode_rows, encode_rows, split_rows
from vmcache.sequences.slots import Slots
from vmcache.sequences.spec import KVSpec, check_kv
from vmcache.sequences.stats import CacheStats, collect_stats
from vmcache.sequences.swap import Swap
from vmcache.sequences.tables import PageTables
from vmcache.sequences.transactions import Transactions


class SequenceCache(PhysicalHooks):
    """The core: sequences (``new_sequence``, ``allocate``, ``grow``, ``can_grow``, ``write``,
    ``batch``, ``kv``, ``fork``, ``free``, ``seq_len(s)``, ``sequences``), ``stats``,
    ``close``; ``spec`` and ``config``; and named facets for the rest, each an object with its
    own file and a docstring saying what of the coordinator it touches: ``beams`` (assign,
    truncate, write_group), ``swap`` (out, restore), ``handoff`` (manifest, runs, adopt,
    export, load), ``elastic`` (trim, set_limit, sleep, wake), ``capacity`` (the admission
    arithmetic: pages used, free, a grow's, a sequence's, headroom), ``prefix`` (the index,
    publish, cached_tokens) and ``views`` (what kernels read; each cache makes its own).
    Everything else is private: 22 public names in all."""

    _releases_memory = False  # whether trim / sleep give physical pages back (the caches set it)
    _copies_moves = False  # whether beams.assign copies a page it would move (the caches set it)

    def __init__(
        self,
        spec: KVSpec,
        config: CacheConfig,
        pool: PagePool,
        *,
        groups: list[PageTables],
        swap_bytes: int | None,
        prefix_caching: bool = False,
        prefix_tiers=None,
    ) -> None:
        self.spec = spec
        self.config = config
        self._pool = pool  # page ids, free list, refcounts (their owner); queries: elastic
        self._groups = groups  # one per attention type; each owns its tables' page lists
        self._group_of = {t: g for g in groups for t in g.ids}
        self._T = len(self._group_of)
        # slots, lengths, token ids, salts: owned by Slots, the only writer of them
        self._seqs = Slots(config.max_seqs)
        # what the core and the facets are handed in place of this object (owns the epoch)
        calls = {n: getattr(self, "_" + n) for n in (*HOOKS, *COORDINATOR, *CACHE_OWN)
                 if hasattr(self, "_" + n)}  # fmt: skip
        self._core = core = Core(self, pool, groups, self._seqs, calls,
                                 releases_memory=self._releases_memory,
                                 copies_moves=self._copies_moves)  # fmt: skip
        self._tx = core.tx = Transactions(core)  # the one writer of tables; CoW counters
        self.swap = Swap(core, swap_bytes)  # facet; owns the host tier's byte count
        self.beams = Beams(core)  # facet
        self.handoff = Handoff(core)  # facet
        self.elastic = Elastic(core)  # facet; owns what a sleep keeps
        self.capacity = Capacity(core)  # facet; reads only
        self.prefix = Prefix(core, prefix_caching, prefix_tiers)  # facet; owns the index
        # fp32 [N_L, 2, N_KV] head scales of FP8/INT8 K/V (None: stored as computed, or per
        # token in each row); the spec's, on the device for the kernels; never changed
        head = spec.quantized and spec.kv_granularity == "head"
        self._kv_scales = spec.scales().to(config.device) if head else None

    def _changed(self) -> None:
        """A length or a page table changed: plans built before are stale."""
        self._core.changed()

    # --- queries -----------------------------------------------------------------------
    def _check_awake(self) -> None:
        if self._pool.asleep:
            raise RuntimeError("the cache is asleep: wake() it first")

    def _check_seq(self, s: Any) -> int:
        self._check_awake()
        _check_int("sequence id", s)
        if not 0 <= s < self.config.max_seqs or not self._seqs.is_live(s):
            raise KeyError(f"sequence {s} is not live (unknown, freed or swapped out)")
        return s

    def _check_layer(self, layer: Any) -> int:
        _check_int("layer", layer)
        if not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer must be in [0, {self.spec.num_layers}), got {layer}")
        return layer

    def _pages_for_tokens(self, n: int) -> int:
        """Pages a new sequence of ``n`` tokens maps (every table): for ``capacity``."""
        return sum(len(g.ids) * g.pages_for(n) for g in self._groups)

    def seq_len(self, s: int) -> int:
        return self._seqs.length(self._check_seq(s))

    def _window_start(self, layer: int, s: int) -> int:
        """The first position of ``s`` whose K/V layer ``layer`` still maps (0 unless its
        sliding window released pages)."""
        g = self._group_of[self._tables_of_layer(self._check_layer(layer))[0]]
        return g.first_token(self._check_seq(s))

    @property
    def sequences(self) -> list[int]:
        return self._seqs.live()

    def _page_table(self, s: int) -> list[list[int]]:
        s = self._check_seq(s)
        return [list(self._group_of[t].row(s, t)) for t in range(self._T)]

    # --- sequence lifecycle ------------------------------------------------------------
    def new_sequence(self, slot: int | None = None, prefix_tokens=None, salt=None) -> int:
        """A new sequence. ``slot`` asks for that particular free slot (callers that keep
        batch row i in slot i, like :mod:`vmcache.hf`). With ``prefix_tokens`` (token ids) and
        prefix caching on, the leading full pages already cached under ``salt`` are mapped in,
        nothing copied: ``seq_len`` is then the number of tokens whose K/V are present."""
        self._check_awake()
        if slot is not None:
            _check_int("slot", slot)
            if not self._seqs.is_free(slot):
                raise ValueError(f"slot {slot} is not free (max_seqs={self.config.max_seqs})")
        elif not self._seqs.num_free:
            raise CacheFull(
                f"all {self.config.max_seqs} sequence slots are in use", wanted=1, free=0
            )
        if prefix_tokens is not None:
            prefix_tokens = check_tokens("prefix_tokens", prefix_tokens)
        if self.prefix.index is not None and self.prefix.index.tiers is not None:
            salt_bytes(salt)  # TypeError for a salt with no name outside this process
        s = self._seqs.take(slot)
        self._open(s, [], salt)
        if prefix_tokens and self.prefix.enabled:
            try:
                found = self.prefix.hit(s, prefix_tokens)  # planned, then mapped here
                if found is not None:
                    rows, n = found
                    self._tx.share_rows(s, rows)
                    self._seqs.set_tokens(s, prefix_tokens[:n])
                    self._set_len(s, n)
            except BaseException:
                self.free(s)
                raise
        return s

    def _open(self, s: int, tokens: list[int] | None, salt, length: int = 0,
              tables: bool = True) -> None:  # fmt: skip
        """Slot ``s`` opened with these ids, salt and length; its tables empty (``tables``),
        or as the caller's transaction set them."""
        if tables:
            self._tx.open(s)
        self._seqs.open(s, tokens, salt, length)
        self._core.changed()

    def grow(self, s: int, n: int, token_ids=None) -> None:
        """Length += n: map the pages the new length needs; split a shared tail page; first,
        sliding groups give back the pages their window no longer needs.
        ``token_ids`` (n ids) records what the new positions hold, for prefix caching.
        ``CacheFull`` when the pool is short (nothing changed): :meth:`allocate` returns
        None instead."""
        got = self._allocate(s, n, token_ids, 0)
        if not isinstance(got, grow.Allocation):
            raise CacheFull(self._pool.shortage(got.need), wanted=got.need, free=got.free)

    def allocate(self, s: int, n: int, token_ids=None, ahead: int = 0):
        """The one allocation call: grow ``s`` by ``n`` tokens (as :meth:`grow`) and map the
        pages of ``ahead`` more tokens past the new length (best effort: none when the pool is
        short; the next grows take them first).
        Returns an :class:`~vmcache.sequences.grow.Allocation` (pages taken, copied, mapped
        ahead), or None when the pool is short for the grow: nothing changed. Bad input
        raises as :meth:`grow` does."""
        _check_int("ahead", ahead)
        if ahead < 0:
            raise ValueError(f"allocate needs ahead >= 0, got {ahead}")
        got = self._allocate(s, n, token_ids, ahead)
        return got if isinstance(got, grow.Allocation) else None

    def _allocate(self, s, n, token_ids, ahead):
        s = self._check_seq(s)
        _check_int("n", n)
        if n < 0:
            raise ValueError(f"grow needs n >= 0, got {n}")
        if token_ids is not None:
            token_ids = check_tokens("token_ids", token_ids)
            if len(token_ids) != n:
                raise ValueError(f"grow({s}, {n}) got {len(token_ids)} token ids")
        if self._seqs.length(s) + n > self.config.max_seq_len:
            raise ValueError(
                f"grow({s}, {n}) would reach {self._seqs.length(s) + n} tokens, past max_seq_len "
                f"{self.config.max_seq_len}"
            )
        return self._run_allocation(s, n, token_ids, ahead)

    def _run_allocation(self, s, n, token_ids, ahead):
        """The allocation of checked ``s``, ``n``, ``token_ids``, ``ahead``: planned once
        (:mod:`.grow`), then run by the transactional core (the map is in ``tx.grow`` /
        ``tx.map_ahead``). An :class:`~vmcache.sequences.grow.Allocation`, or the plan that
        did not fit (nothing changed). A sliding group's release of pages its window no longer
        needs is made first, a change of its own."""
        c, tx = self._core, self._tx
        if n == 0:
            mapped = tx.map_ahead(s, grow.ahead_plan(c, s, ahead)) if ahead else 0
            return grow.Allocation(0, 0, mapped)
        plan = grow.plan_grow(c, s, n)  # a window release leaves it valid: it is all before
        if not plan.fits:  # the tail page the plan may copy
            return plan
        if plan.releases:
            tx.release_window(s, plan.releases)
        try:
            tx.grow(s, plan.groups)
        except CacheFull:  # a shared budget's pages went to another process first
            return plan
        self._seqs.grow(s, n, token_ids)
        c.changed()
        copied = sum(len(splits) for _, splits, _, _ in plan.groups)
        mapped = tx.map_ahead(s, grow.ahead_plan(c, s, ahead)) if ahead else 0
        return grow.Allocation(plan.need, copied, mapped)

    def write(self, layer: int, s: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` (each ``[T, N_KV, d_h]``, the cache's dtype and device) at
        positions ``[start, start+T)`` of sequence ``s``, which must be within its length
        (and its window's mapped part). Pages still shared with another sequence are copied
        first (copy-on-write)."""
        layer, s, n = self._check_write(layer, s, start, k, v)
        if n == 0:
            return
        k, v = self._encode(layer, k, v)
        splits = self._write_splits(layer, s, start, start + n)
        if splits:
            self._tx.split_pages(splits)
        self._store(layer, s, start, k, v)

    def batch(self, seq_ids, q_lens) -> StepBatch:
        """One step's sequences, checked once (live, distinct, ``1 <= q_len <= seq_len``, the
        new tokens inside each sliding window), every page they write copied on write now:
        a :class:`~vmcache.sequences.batch.StepBatch` whose ``write`` stores a layer's K/V of
        the whole step in one indexed copy, and which the kernels read in one gather. Each
        sequence's new tokens are its last ``q_len`` positions (grow it first)."""
        return StepBatch(self._core, list(seq_ids), list(q_lens))

    def _write_splits(self, layer: int, s: int, start: int, end: int) -> list[tuple[int, int, int]]:
        """(s, table, page) of ``layer``'s pages over positions ``[start, end)`` that another
        sequence still shares: what a write there must copy first."""
        tables = self._tables_of_layer(layer)
        g = self._group_of[tables[0]]
        j_lo, j_hi = start * g.u // g.P, g.pages_for(end)
        return [(s, t, j) for t, j in g.splits(s, tables, j_lo, j_hi, self._pool.refcounts)]

    def free(self, s: int) -> None:
        """Drop the sequence: unmap its pages, refcounts −1, pages at 0 return to the pool.
        With prefix caching, its full pages of known tokens stay cached (index references)."""
        s = self._check_seq(s)
        self.prefix.publish(s)
        self._tx.close(s)
        self._seqs.close(s)
        self._core.changed()

    def _encode(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """K, V ``[n, N_KV, d_h]`` → stored rows ``[n, spec.row_elems]`` (quantized with the
        layer's head scales or each token's own, FP8/INT8; else the same elements)."""
        sp = self.spec
        if not sp.quantized:  # the same elements: views, every write of every step
            return k.reshape(k.shape[0], sp.row_elems), v.reshape(v.shape[0], sp.row_elems)
        sc = (None, None) if self._kv_scales is None else self._kv_scales[layer]
        return tuple(encode_rows(x, s, sp.storage_dtype, sp.row_elems) for x, s in zip((k, v), sc))

    def _decode(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Stored rows ``[..., spec.row_elems]`` → K, V ``[..., N_KV, d_h]`` in the compute
        dtype (zero-copy views unless quantized; dequantized copies for FP8/INT8)."""
        sp = self.spec
        if not sp.quantized:  # views of the same elements
            shape = (sp.num_kv_heads, sp.head_dim)
            return k.view(*k.shape[:-1], *shape), v.view(*v.shape[:-1], *shape)
        sc = (None, None) if self._kv_scales is None else self._kv_scales[layer]
        return tuple(decode_rows(x, s, sp.num_kv_heads, sp.head_dim, sp.dtype)
                     for x, s in zip((k, v), sc))  # fmt: skip

    def _kv_scales_for(self, layer: int):
        """What a kernel dequantizes ``layer``'s K/V with: fp32 ``[2, N_KV]`` head scales, or
        per token the pair of fp32 views ``[..., N_KV]`` over K's and V's stored rows (shaped
        as :meth:`_rows` less its last dim), or None when K/V are not quantized."""
        layer = self._check_layer(layer)
        if self._kv_scales is not None:
            return self._kv_scales[layer]
        if not self.spec.quantized:
            return None
        sp = self.spec
        return tuple(split_rows(self._rows(layer, kv), sp.num_kv_heads, sp.head_dim)[1]
                     for kv in (0, 1))  # fmt: skip

    def _check_write(self, layer, s, start, k, v) -> tuple[int, int, int]:
        """Validate a write; returns (layer, sequence, token count)."""
        layer, s = self._check_layer(layer), self._check_seq(s)
        _check_int("start", start)
        n = check_kv(self.spec, self.config.device, k, v)
        if start < 0 or start + n > self._seqs.length(s):
            raise ValueError(
                f"write of {n} tokens at {start} is outside sequence {s}'s length "
                f"{self._seqs.length(s)}; grow it first"
            )
        first = self._window_start(layer, s)
        if n and start < first:
            raise ValueError(f"write at {start} into layer {layer} of sequence {s}: positions "
                             f"before {first} left its sliding window (released)")  # fmt: skip
        return layer, s, n

    def _set_len(self, s: int, length: int) -> None:
        self._seqs.set_length(s, length)
        self._core.changed()

    def fork(self, s: int, n: int = 1) -> list[int]:
        """``n`` children sharing every page of ``s`` (refcounts += n, no K/V copied)."""
        return fork(self._core, s, n)

    def can_grow(self, s: int, n: int) -> bool:
        """Whether ``grow(s, n)`` would succeed now (for schedulers; raises nothing for n):
        the plan :meth:`allocate` would build, as a pure query."""
        return grow.can_grow(self._core, s, n)

    # --- stats -------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        return collect_stats(self._core)
