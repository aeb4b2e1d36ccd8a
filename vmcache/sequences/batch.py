"""StepBatch: one step's sequences, checked once, then written and read by every layer with
one indexed copy each (plan, then run).

A step brings ``q_lens[i]`` new tokens to sequence ``seq_ids[i]``, already grown to hold
them; they are the last ``q_lens[i]`` positions of its length (``starts[i] = length −
q_len``). Every layer writes their K/V with one ``index_copy_`` into the layer's stored rows
seen as one flat ``[rows, R]`` tensor, and the attention gathers every sequence's history
with one ``index_select``:

    packed K/V:  | a: 3 new      | b: 1 | c: 2    |        [Σ q_lens, N_KV, d_h]
    write index: | a·L+5 .. a·L+7 | b·L+9 | c·L+0 c·L+1 |   flat row of each new token
                   (VMKVCache: slot·L_row + position; PagedKVCache: block·B + offset)
    read index:  [B, span]: sequence i's positions w_i … length_i − 1, then its last one
                 repeated to the longest span (masked out by the attention)

Where the cache keeps each sequence's rows in one range of its own (VMKVCache), the batch's
sequences sit in consecutive slots, no window has released a page and every sequence has
pages mapped up to the longest span, the read is no copy at all: one strided view.

    rows [max_seqs, L_row, R]   slot 4 | a a a a a . . . |  mapped to 8 ≥ span 5
                                slot 5 | b b b . . . . . |  mapped to 8 (b's keys 3, 4:
                                slot 6 | c c c c . . . . |  masked by the attention)
    batch (4, 5, 6), span 5  ->  rows[4:7, :5], [3, 5, R], read where it lies

The indices depend on the page-table group of a layer (its row size and its window), so
they are built once per group and step, on the first layer that asks. Copy-on-write happens
here, for every table at once, before any layer writes. Any change to the cache after the
batch was built (a grow, a fork, a free, a split) makes it stale: using it then raises.

Touches, through the core it is handed: its checks (``check_seq``), lengths (``seqs``, read),
the groups' page tables (read), ``tx.split_pages`` (copy-on-write), ``epoch`` and
``pool.scrub_on_reuse`` (read), and the physical hooks ``flat_rows``, ``flat_index``,
``seq_rows`` and ``store_flat``.
"""

from __future__ import annotations

import torch

from vmcache.errors import check_int
from vmcache.sequences.hooks import _bits
from vmcache.sequences.spec import check_kv


class StepBatch:
    """What :meth:`SequenceCache.batch` returns; see the module docstring. Fields are
    read-only for its users: ``seq_ids``, ``q_lens``, ``starts``, ``kv_lens`` (tuples of
    ints, batch order), ``max_q``, ``memo`` (a dict the kernels keep their per-step metadata
    in, owned by :mod:`vmcache.kernels`)."""

    def __init__(self, cache, seq_ids, q_lens) -> None:
        seq_ids = [cache.check_seq(s) for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids must be distinct, got {seq_ids}")
        if len(q_lens) != len(seq_ids):
            raise ValueError("q_lens and seq_ids must have the same length")
        q_lens = [check_int("q_len", n) for n in q_lens]
        kv_lens = cache.seqs.lengths(seq_ids)
        for s, n, q in zip(seq_ids, kv_lens, q_lens):
            if not 1 <= q <= n:
                raise ValueError(f"sequence {s}: q_len {q} must be in [1, seq_len={n}]")
        if not seq_ids:
            raise ValueError("a batch needs at least one sequence")
        self._cache = cache
        self.seq_ids, self.q_lens, self.kv_lens = tuple(seq_ids), tuple(q_lens), tuple(kv_lens)
        self.starts = tuple(n - q for n, q in zip(kv_lens, q_lens))
        self.max_q = max(q_lens)
        self.num_tokens = sum(q_lens)
        for g in cache.groups:  # sliding windows: the new tokens must still be mapped
            for s, start in zip(seq_ids, self.starts):
                if start < g.first_token(s):
                    raise ValueError(f"sequence {s}: writing at {start}, before its window's "
                                     f"first mapped token {g.first_token(s)}")  # fmt: skip
        splits = []
        for g in cache.groups:  # copy-on-write of every shared page the writes touch
            for s, start, n in zip(seq_ids, self.starts, kv_lens):
                j_lo, j_hi = start * g.u // g.P, g.pages_for(n)
                splits += [(s, t, j) for t, j in g.splits(s, g.ids, j_lo, j_hi,
                                                          cache.pool.refcounts)]  # fmt: skip
        if splits:
            cache.tx.split_pages(splits)
        self._epoch = cache.epoch
        # what every layer's write must bring: checked in full (check_kv) only when it differs
        sp = cache.spec
        self._kv_shape = (self.num_tokens, sp.num_kv_heads, sp.head_dim)
        self._kv_dtype, self._device = sp.dtype, cache.config.device
        self._writes: dict[int, torch.Tensor] = {}  # group index -> [Σ q] flat rows (owned here)
        self._reads: dict[int, tuple] = {}  # group index -> (index, window starts, spans)
        self._in_place: dict[int, int | None] = {}  # group index -> first slot (None: gather)
        self._group_at: dict[int, int] = {}  # layer -> group index (owned here)
        self.memo: dict = {}

    @property
    def fresh(self) -> bool:
        """Whether the cache is as it was when the batch was built (else using it raises)."""
        return self._cache.epoch == self._epoch

    def _check(self, cache) -> None:
        if cache is not self._cache:
            raise ValueError("this batch belongs to another cache")
        if cache.epoch != self._epoch:
            raise ValueError("the cache changed since this batch was built (a grow, fork, "
                             "free or copy-on-write): build a new batch")  # fmt: skip

    def group(self, layer: int) -> int:
        """The page-table group ``layer`` belongs to: layers of one group share a batch's
        indices (their row size and window are the same)."""
        gi = self._group_at.get(layer)
        if gi is None:
            c = self._cache
            g = c.group_of[c.tables_of_layer(c.check_layer(layer))[0]]
            gi = self._group_at[layer] = c.groups.index(g)
        return gi

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's packed K and V ``[num_tokens, N_KV, d_h]`` (the cache's dtype and
        device, batch order) for ``layer``: one indexed copy each."""
        c = self._cache
        self._check(c)
        shape, dtype, dev = self._kv_shape, self._kv_dtype, self._device.type
        if not (type(k) is torch.Tensor and type(v) is torch.Tensor and k.shape == shape
                and v.shape == shape and k.dtype == dtype and v.dtype == dtype
                and k.device.type == dev and v.device.type == dev):  # fmt: skip
            if check_kv(c.spec, c.config.device, k, v) != self.num_tokens:  # the precise error
                raise ValueError(f"the batch writes {self.num_tokens} tokens, got {k.shape[0]}")
            raise TypeError(f"k and v must be plain tensors, got {type(k).__name__} and "
                            f"{type(v).__name__}")  # fmt: skip
        c.store_flat(layer, self._write_index(layer), *c.encode(layer, k, v))

    def stored(self, layer: int) -> tuple[torch.Tensor, tuple[int, int, int, int]] | None:
        """(the storage under ``layer``'s K and V rows as one flat tensor of their dtype, a
        view: unmapped pages included, never read through it; (rows, R, K's and V's element
        offsets in it)): where :meth:`read_index`'s rows lie, for a kernel that reads them
        in place. None where a row does not follow the one before it (a token-major layout
        interleaves K and V): such a kernel cannot address them."""
        c = self._cache
        self._check(c)
        k, v = c.flat_rows(layer, 0), c.flat_rows(layer, 1)
        if k.stride() != (k.shape[1], 1) or v.stride() != (v.shape[1], 1):
            return None
        store = store_of(k)
        return store, tuple(layout_of(store, k, v).tolist())

    def write_index(self, layer: int) -> torch.Tensor:
        """int64 ``[num_tokens]`` (on the cache's device): the flat row of
        ``_flat_rows(layer, ·)`` each new token's K/V goes to, batch order; built once per
        group and step."""
        self._check(self._cache)
        return self._write_index(layer)

    def _write_index(self, layer: int) -> torch.Tensor:  # the batch checked by the caller
        c = self._cache
        gi = self.group(layer)
        idx = self._writes.get(gi)
        if idx is None:
            pos = torch.cat([torch.arange(a, n) for a, n in zip(self.starts, self.kv_lens)])
            seqs = torch.repeat_interleave(torch.tensor(self.seq_ids), torch.tensor(self.q_lens))
            idx = c.flat_index(layer, seqs[:, None], pos[:, None])[:, 0].to(c.config.device)
            self._writes[gi] = idx
        return idx

    def read_index(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(int64 ``[B, span]`` flat rows of every sequence's mapped history, each row from
        its window start and padded with its last position; int64 ``[B]`` window starts;
        ``span``, the longest history) for ``layer``'s group."""
        c = self._cache
        self._check(c)
        gi = self.group(layer)
        got = self._reads.get(gi)
        if got is None:
            g = c.groups[gi]
            lo = torch.tensor([g.first_token(s) for s in self.seq_ids])
            n = torch.tensor(self.kv_lens)
            span = int((n - lo).max())
            pos = torch.minimum(lo[:, None] + torch.arange(span)[None], n[:, None] - 1)
            idx = c.flat_index(layer, torch.tensor(self.seq_ids)[:, None], pos)
            got = self._reads[gi] = (idx.to(c.config.device), lo, span)
        return got

    def in_place(self, layer: int) -> int | None:
        """The first slot when :meth:`kv` reads ``layer`` where it lies (see the module
        docstring), else None (it gathers); decided once per group and step."""
        gi = self.group(layer)
        if gi not in self._in_place:
            _, lo, span = self.read_index(layer)
            c, s0, b = self._cache, self.seq_ids[0], len(self.seq_ids)
            g = c.groups[gi]
            # a page that changed owner reads zeros (scrub on reuse): a masked row holds zeros
            # or K/V this sequence's pages were given (its own, a copy-on-write or beam
            # copy's source), never a stranger's bytes, never unmapped memory
            ok = (c.seq_rows(layer, 0) is not None and c.pool.scrub_on_reuse
                  and self.seq_ids == tuple(range(s0, s0 + b)) and not bool(lo.any())
                  and all(g.num_pages(s) * g.P // g.u >= span for s in self.seq_ids))  # fmt: skip
            self._in_place[gi] = s0 if ok else None
        return self._in_place[gi]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, span, N_KV, d_h]`` of every sequence's history (see
        :meth:`read_index`), dequantized for FP8/INT8: a view of the rows where
        :meth:`in_place` says so (rows past a sequence's length hold what its mapped pages
        hold: zeros or K/V written there before), else gathered in one copy each (rows past
        a length repeat its last token). Either way the attention masks them."""
        c = self._cache
        idx, _, span = self.read_index(layer)
        s0 = self.in_place(layer)
        if s0 is not None:
            end = s0 + len(self.seq_ids)
            return c.decode(layer, c.seq_rows(layer, 0)[s0:end, :span],
                             c.seq_rows(layer, 1)[s0:end, :span])  # fmt: skip
        flat = idx.view(-1)
        k = _bits(c.flat_rows(layer, 0)).index_select(0, flat).view(c.spec.storage_dtype)
        v = _bits(c.flat_rows(layer, 1)).index_select(0, flat).view(c.spec.storage_dtype)
        k, v = c.decode(layer, k, v)
        b = len(self.seq_ids)
        return k.view(b, span, *k.shape[1:]), v.view(b, span, *v.shape[1:])


def store_of(rows: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``rows`` as one flat tensor of its dtype (a view: nothing is
    read or copied, unmapped pages included)."""
    st = rows.untyped_storage()
    n = st.nbytes() // rows.element_size()
    return torch.empty(0, dtype=rows.dtype, device=rows.device).set_(st, 0, (n,), (1,))


def layout_of(store: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor) -> torch.Tensor:
    """int64 ``[4]`` (host): rows, row width, and K's and V's element offsets in ``store``
    (both ``[rows, width]`` and row-contiguous, in the storage under ``store``)."""
    at = store.untyped_storage().data_ptr()
    if (k_rows.untyped_storage().data_ptr() != at or v_rows.untyped_storage().data_ptr() != at
            or k_rows.shape != v_rows.shape or k_rows.stride() != (k_rows.shape[1], 1)
            or v_rows.stride() != (v_rows.shape[1], 1)):  # fmt: skip
        raise ValueError("step_attention needs K and V rows [rows, width], row-contiguous, "
                         "in the store's storage")  # fmt: skip
    return torch.tensor([*k_rows.shape, k_rows.storage_offset(), v_rows.storage_offset()])
