"""VMKVCache: every sequence owns one contiguous virtual range per K/V tensor; physical pages
are mapped into it on demand (vAttention's design), refcounted and shared copy-on-write.

layer_major (default): per layer, K and V tensors ``[max_seqs, max_seq_len, N_KV, d_h]``:

    reservation: | L0.K | L0.V | L1.K | L1.V | ...          table t = 2·layer + (0 K | 1 V)
    tensor t:    | row 0 (seq 0) | row 1 | ... | row S-1 |  each row = pages_per_row pages
    address(s, t, j) = base + (t·S + s)·row_bytes + j·page_size

token_major ("megacache"): one K and one V tensor ``[max_seqs, max_seq_len, N_L, N_KV, d_h]``
(tables 0 and 1); a page then holds every layer of fewer tokens, and a layer's view is strided.
A model that mixes attention types (sliding-window and full layers) gets one such pair per
type (tables 2g, 2g + 1 hold the layers of type g), so a page never holds two types and a
sliding type's pages can leave its window while the full layers keep theirs.

Sliding-window layers: their tables form their own :class:`~vmcache.sequences.tables.PageTables`
group, which unmaps the pages wholly before the window as the sequence grows; ``kv()`` then
starts at :meth:`window_start`, and the whole-tensor views stay where they were.

Rows are padded to a multiple of lcm(page, token row), so a page never spans two sequences
and every row starts at a whole token (FlashAttention's varlen path addresses the layer as one
flat ``[S·L_row, N_KV, d_h]`` tensor, row ``s`` at token ``s·L_row``). Only pages a sequence's
length needs are mapped; reading past that faults (host) or is an illegal address (CUDA), so
the whole-tensor views print a summary, never their contents.
"""

from __future__ import annotations

import math

import torch

from vmcache.memory.backends import Backend, make_backend, round_up
from vmcache.memory.budget import Budget
from vmcache.memory.pagestore import Stager, VMPageStore
from vmcache.memory.pool import PagePool
from vmcache.sequences.config import CacheConfig
from vmcache.sequences.coordinator import SequenceCache, _check_int
from vmcache.sequences.handoff import TableRuns
from vmcache.sequences.quant import split_rows
from vmcache.sequences.spec import KVSpec
from vmcache.sequences.tables import FA_TILE_TOKENS, PageTables
from vmcache.sequences.views import VMViews

LAYOUTS = ("layer_major", "token_major")


def default_window_align(device: torch.device) -> int:
    """Tokens a sliding layer's first kept token is rounded down to: on CUDA, FlashAttention
    (aten FA2, flash-attn) reads a window's K in whole tiles from a tile-aligned start, so the
    pages under that tile must stay mapped; elsewhere nothing reads before the window."""
    return FA_TILE_TOKENS if torch.device(device).type == "cuda" else 1


class VMKVCache(SequenceCache):
    _releases_memory = True  # trim / sleep give physical pages back to the device
    # a beam reorder copies a page it would move: a page copy costs less than unmapping and
    # mapping it (host: munmap + mmap, ~30 us each; CUDA: cuMemUnmap, cuMemMap, cuMemSetAccess)
    _copies_moves = True

    def __init__(
        self,
        spec: KVSpec,
        max_seqs: int,
        max_seq_len: int,
        device: torch.device | str = "cpu",
        page_size: int | None = None,
        pool_bytes: int | None = None,
        layout: str = "layer_major",
        *,
        backend: Backend | None = None,
        scrub_on_reuse: bool = True,
        swap_bytes: int | None = None,
        chunk_pages: int = 64,
        rollback_tokens: int = 0,
        prefix_caching: bool = False,
        prefix_tiers=None,
        own_backend: bool | None = None,
        budget: Budget | None = None,
        window_align_tokens: int | None = None,
    ) -> None:
        """``backend``: physical memory (default: the real one for ``device``); the cache
        closes it when it made it, or when ``own_backend`` is True. ``budget``: how many
        pages may exist at once (default: ``pool_bytes`` worth, changeable with
        ``cache.memory.set_limit``; a :class:`~vmcache.memory.ledger.SharedBudget` shares one
        device's memory between processes). ``window_align_tokens``: a sliding layer keeps
        its pages from its first needed token rounded down to this multiple (default
        :data:`FA_TILE_TOKENS` on CUDA, where FlashAttention reads whole K tiles from a
        tile-aligned start before the window; 1 elsewhere)."""
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
        for name, value in (("max_seqs", max_seqs), ("max_seq_len", max_seq_len)):
            if _check_int(name, value) <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if _check_int("rollback_tokens", rollback_tokens) < 0:
            raise ValueError(f"rollback_tokens must be >= 0, got {rollback_tokens}")
        if (
            window_align_tokens is not None
            and _check_int("window_align_tokens", window_align_tokens) <= 0
        ):
            raise ValueError(f"window_align_tokens must be positive, got {window_align_tokens}")
        self._owns_backend = backend is None if own_backend is None else bool(own_backend)
        self._backend = backend if backend is not None else make_backend(device)
        try:
            align = window_align_tokens or default_window_align(self._backend.device)
            self._setup(spec, max_seqs, max_seq_len, page_size, pool_bytes, layout,
                        scrub_on_reuse, swap_bytes, chunk_pages, prefix_caching,
                        rollback_tokens, budget, prefix_tiers, align)  # fmt: skip
        except BaseException:
            if self._owns_backend:
                self._backend.close()
            raise

    def _setup(
        self, spec, max_seqs, max_seq_len, page_size, pool_bytes, layout, scrub, swap, chunk,
        prefix, rollback, budget, tiers, align,
    ):  # fmt: skip
        be = self._backend
        P = be.default_page_size if page_size is None else _check_int("page_size", page_size)
        if P <= 0 or P % be.granularity:
            raise ValueError(
                f"page_size must be a positive multiple of the backend granularity "
                f"{be.granularity} bytes, got {P}"
            )
        groups = spec.attention_groups  # ((window, layers), ...)
        if layout == "layer_major":
            table_layers = [[i] for i in range(spec.num_layers) for _ in "kv"]
            ids = [[2 * i + kv for i in layers for kv in (0, 1)] for _, layers in groups]
        else:  # one K and one V tensor per attention type: a page never mixes two types
            table_layers = [list(layers) for _, layers in groups for _ in "kv"]
            ids = [[2 * gi, 2 * gi + 1] for gi in range(len(groups))]
        n_tables = len(table_layers)
        tb = [spec.bytes_per_token_per_layer * len(ls) for ls in table_layers]
        self._token_bytes = tb  # bytes of one token in one row of table t
        self._token_row_bytes = tb[0]
        # one row size for every table: whole pages and whole tokens of every table's type
        self._row_bytes = round_up(max_seq_len * max(tb), math.lcm(P, *tb))
        self._pages_per_row = self._row_bytes // P
        capacity = n_tables * max_seqs * self._pages_per_row
        num_pages = capacity
        if pool_bytes is not None:
            _check_int("pool_bytes", pool_bytes)
            if pool_bytes < P:
                raise ValueError(f"pool_bytes ({pool_bytes}) is smaller than one page ({P})")
            num_pages = min(capacity, pool_bytes // P)
        self._pagestore = VMPageStore(be, P, num_pages)
        pool = PagePool(num_pages, self._pagestore, scrub_on_reuse=scrub, chunk_pages=chunk,
                        budget=budget)  # fmt: skip
        tables = [PageTables(t_ids, w, max_seqs, tb[t_ids[0]], P, rollback, align)
                  for (w, _), t_ids in zip(groups, ids)]  # fmt: skip
        config = CacheConfig(max_seqs, max_seq_len, be.device, P, layout)
        super().__init__(spec, config, pool, groups=tables, swap_bytes=swap,
                         prefix_caching=prefix, prefix_tiers=tiers)  # fmt: skip
        self._reserved = n_tables * max_seqs * self._row_bytes
        self._base = be.reserve(self._reserved)
        self._bytes = be.view(self._base, self._reserved)  # uint8 over the whole reservation
        el, H, D, R = spec.dtype_bytes, spec.num_kv_heads, spec.head_dim, spec.row_elems
        flat, row = self._bytes.view(spec.storage_dtype), self._row_bytes // el
        self._layer_at: dict[int, tuple[int, int]] = {}  # layer -> (K table, index in it)
        tensors = []
        for t, ls in enumerate(table_layers):
            n = self._row_bytes // tb[t]  # token rows a table row holds (>= max_seq_len)
            shape, strides = (max_seqs, n, len(ls), R), (row, len(ls) * R, R, 1)
            tensors.append(flat.as_strided(shape, strides, t * max_seqs * row))
            for i, layer in enumerate(ls):
                self._layer_at.setdefault(layer, (t, i))
        self._row_views = []  # per layer, K's and V's stored rows [max_seqs, max_seq_len, R]
        for layer in range(spec.num_layers):
            t, i = self._layer_at[layer]
            self._row_views.append((tensors[t][:, :max_seq_len, i],
                                    tensors[t + 1][:, :max_seq_len, i]))  # fmt: skip
        self._flat = [
            tuple(tensors[t + kv][:, :, i].view(-1, R) for kv in (0, 1))
            for t, i in (self._layer_at[layer] for layer in range(spec.num_layers))
        ]
        self._views = [tuple(split_rows(x, H, D)[0].as_subclass(CacheView) for x in pair)
                       for pair in self._row_views]  # fmt: skip
        self._stager: Stager | None = None  # a wake's copies in flight (owned here)
        self.views = VMViews(self._core)  # facet: what the kernels read
        self._closed = False

    # --- kernel-facing views (cache.views reads them) --------------------------------------
    def _layer_row_tokens(self, layer: int) -> int:
        return self._row_bytes // self._token_bytes[self._layer_at[layer][0]]

    def _layer_view(self, layer: int, kv: int) -> torch.Tensor:
        return self._views[layer][kv]

    def kv(self, layer: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy views ``[seq_len − w, N_KV, d_h]`` of sequence ``s``'s K and V from
        ``w = window_start(layer, s)``, the first token its sliding window still maps (0
        for full attention); dequantized copies in the compute dtype for FP8/INT8 K/V."""
        w, n = self._window_start(layer, s), self._seqs.length(s)
        k, v = self._row_views[layer]
        return self._decode(layer, k[s, w:n], v[s, w:n])

    # --- physical hooks ----------------------------------------------------------------
    def _va(self, s: int, t: int, j: int) -> int:
        return (
            self._base
            + (t * self.config.max_seqs + s) * self._row_bytes
            + j * self.config.page_bytes
        )

    def _attach(self, s: int, t: int, j0: int, pages: list[int]) -> None:
        handles = self._pagestore.handles(pages)
        self._backend.map(self._va(s, t, j0), handles, self.config.page_bytes)

    def _detach(self, s: int, t: int, j0: int, n: int) -> None:
        self._backend.unmap(self._va(s, t, j0), n, self.config.page_bytes)

    def _page(self, p: int, units: int) -> torch.Tensor:
        return self._pagestore.view(p)[:units]

    def _tables_of_layer(self, layer: int) -> list[int]:
        t = self._layer_at[layer][0]
        return [t, t + 1]

    def _rows(self, layer: int, kv: int) -> torch.Tensor:
        return self._row_views[layer][kv]

    def _seq_rows(self, layer: int, kv: int) -> torch.Tensor:
        return self._row_views[layer][kv]  # each sequence's own virtual range

    def _flat_rows(self, layer: int, kv: int) -> torch.Tensor:
        return self._flat[layer][kv]  # row s·L_row + t: token t of sequence s

    def _flat_index(self, layer: int, seqs: torch.Tensor, positions: torch.Tensor):
        return seqs * self._layer_row_tokens(layer) + positions

    def _store(self, layer: int, s: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[0]
        self._row_views[layer][0][s, start : start + n].copy_(k)
        self._row_views[layer][1][s, start : start + n].copy_(v)

    def _load(self, layer: int, s: int, positions: torch.Tensor):
        idx = positions.to(self.config.device)
        return self._row_views[layer][0][s, idx], self._row_views[layer][1][s, idx]

    def _row(self, s: int, t: int, lo: int, hi: int) -> torch.Tensor:
        off = (t * self.config.max_seqs + s) * self._row_bytes
        return self._bytes[off + lo : off + hi]

    def _runs(self, s: int, t: int, j0: int, length: int) -> TableRuns:
        """One run: the mapped pages of a row are adjacent in the virtual range."""
        return TableRuns(
            [self._row(s, t, j0 * self.config.page_bytes, length * self._token_bytes[t])]
        )

    def _sync(self) -> None:
        self._backend.synchronize()

    # --- sleep / wake hooks (cache.elastic) ---------------------------------------------
    def _read_pages(self, pages: list[int], pin: bool = False) -> torch.Tensor:
        """A host copy of ``pages`` (prefix tiers' demotion, sleep). No device-wide wait: the
        copy is ordered after the K/V writes on the current stream (the cache's writes are),
        and a sleep synchronizes before it anyway."""
        return self._pagestore.read(pages, pin=pin)

    def _write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        self._pagestore.write(pages, data)

    def _release_all(self, live: list[int], keep: bool):
        """Before the pool releases every page: the live ones' bytes to (pinned) host memory
        when ``keep``, and every sequence's pages unmapped."""
        # pageable and exactly sized: torch's pinned-memory cache would round a large copy up
        # to a power of two and keep it after wake (the driver stages pageable copies itself)
        saved = self._read_pages(live) if keep else None
        for s in self.sequences:
            for g in self._groups:
                for t, j0, pages in g.mapped_runs(s):
                    self._detach(s, t, j0, len(pages))
        return saved

    def _wake_fill(self, live: list[int], saved):
        """What the pool calls as each chunk of ``live`` exists again: that chunk's saved
        bytes written into it (through a pinned stager: on a GPU the copies run while the
        next chunk's pages are created), so a wake is not create-everything-then-copy."""
        if saved is None:
            return None
        row = {p: i for i, p in enumerate(live)}
        self._stager = Stager(self.config.device)

        def fill(pages: list[int]) -> None:
            lo = row[pages[0]]
            if [row[p] for p in pages] == list(range(lo, lo + len(pages))):
                data = saved[lo : lo + len(pages)]
            else:
                data = saved.index_select(0, torch.tensor([row[p] for p in pages]))
            self._pagestore.write(pages, data, self._stager)

        return fill

    def _restore_all(self, live: list[int], saved) -> None:
        """After the pool created ``live`` again at their window slots (their bytes written by
        :meth:`_wake_fill` as they were created): every sequence's pages mapped where they
        were; all or nothing."""
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.finish()
        elif saved is not None:
            self._write_pages(live, saved)
        runs = [(s, *r) for s in self.sequences for g in self._groups for r in g.mapped_runs(s)]
        self._tx.map_steps([(s, t, j0, pages, True) for s, t, j0, pages in runs])

    # --- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Unmap everything and release pages, reservations and (if owned) the backend.

        Views returned by :meth:`kv`, :meth:`k_cache` and :meth:`v_cache` are invalid after
        this (their memory is unmapped). Without ``close()``, a live view keeps the memory."""
        if getattr(self, "_closed", True):
            return
        if not self._pool.asleep:  # asleep, nothing is mapped and the store holds no page
            for s in self.sequences:
                self.free(s)
        self.prefix.close_tiers()
        self._views = self._row_views = []
        self._bytes = None
        self._pagestore.close()
        self._backend.release_reservation(self._base, self._reserved)
        if self._owns_backend:
            self._backend.close()
        self._closed = True

    def __repr__(self) -> str:
        cf = self.config
        return (f"VMKVCache({self.spec}, max_seqs={cf.max_seqs}, max_seq_len="
                f"{cf.max_seq_len}, layout={cf.layout!r}, page_size={cf.page_bytes}, "
                f"device={cf.device})")  # fmt: skip

    def __enter__(self) -> VMKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CacheView(torch.Tensor):
    """A whole virtual K or V tensor: mostly unmapped, so it prints its shape, never its
    contents (printing reads every element: a fault on the host, a sticky illegal address on
    CUDA). Operations on it return plain tensors (no ``__torch_function__`` overhead)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *args, **kwargs) -> str:
        return (f"CacheView(shape={tuple(self.shape)}, stride={self.stride()}, "
                f"dtype={self.dtype}, device={self.device}; mapped only up to each "
                "sequence's length)")  # fmt: skip

    __str__ = __repr__
