"""Core: what a cache's coordinator hands its transactional core, its facets and its kernel
views, instead of a back-reference into its private state. Each holder reads and changes the
objects through their own interfaces; nothing here is a copy.

    objects        spec, config; pool (refcounts, free list: their owner), groups / group_of /
                   T (one PageTables per attention type: the page lists' owner), seqs (Slots:
                   slots, lengths, token ids, salts), tx (Transactions: the one writer of page
                   tables), cache (the cache, for its public calls only)
    coordinator    the checks and conversions of :data:`COORDINATOR`, bound
    hooks          every physical hook of :class:`~vmcache.sequences.hooks.PhysicalHooks`
                   (:data:`HOOKS`), bound, and the calls only one kind of cache has and only
                   its views read (:data:`CACHE_OWN`; None on the other kind)
    flags          releases_memory, copies_moves (the cache's class says)

Owned here: ``epoch``, bumped by :meth:`changed` whenever a length or a page table changes, so
that plans and step batches built before it are seen to be stale.
"""

from __future__ import annotations

HOOKS = ("attach", "detach", "page", "copy_page", "copy_pages", "tables_of_layer", "rows",
         "flat_rows", "flat_index", "seq_rows", "store_flat", "store", "load", "runs", "sync",
         "read_pages", "write_pages", "release_all", "restore_all", "device_bytes",
         "wake_fill")  # fmt: skip
COORDINATOR = ("check_seq", "check_layer", "open", "set_len", "pages_for_tokens",
               "window_start", "page_table", "write_splits", "check_write", "encode", "decode",
               "kv_scales_for")  # fmt: skip
CACHE_OWN = ("layer_view", "layer_row_tokens", "block_pool", "table_of_layer")


class Core:
    """The coordinator's state and calls, passed explicitly (see the module docstring).
    ``calls``: every name of :data:`HOOKS` and :data:`COORDINATOR` to its bound call, and
    those of :data:`CACHE_OWN` the cache has."""

    def __init__(self, cache, pool, groups: list, seqs, calls: dict, *, releases_memory: bool,
                 copies_moves: bool) -> None:  # fmt: skip
        missing = [n for n in (*HOOKS, *COORDINATOR) if n not in calls]
        if missing:
            raise TypeError(f"a cache core needs the calls {missing}")
        self.cache = cache  # its public calls only (new_sequence, free, the facets)
        self.spec, self.config = cache.spec, cache.config
        self.pool = pool
        self.groups = groups
        self.group_of = {t: g for g in groups for t in g.ids}
        self.T = len(self.group_of)
        self.seqs = seqs
        self.tx = None  # the Transactions, set by the coordinator once built
        self.releases_memory = releases_memory  # trim / sleep give physical pages back
        self.copies_moves = copies_moves  # beams.assign copies a page it would only move
        self.epoch = 0  # bumped whenever a length or a page table changes (owned here)
        for name in (*HOOKS, *COORDINATOR, *CACHE_OWN):
            setattr(self, name, calls.get(name))

    def changed(self) -> None:
        """A length or a page table changed: plans built before are stale."""
        self.epoch += 1
